"""Executors: where a job's requests run. `local` is runner.job's single engine; `ray` is ray_executor."""
