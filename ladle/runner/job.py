"""The job: a composed config -> an executor (local: one engine here; ray: replicas) -> a run directory.

The executors share one interface and one tail (runner/executors/base.py); executor=local
(executors/local.py) reads the source (sources/), feeds the engine by arrival time (loop.py) and writes
generations and steps (writer.py), resuming what a previous run into the directory left (resume.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from ladle.runner.config import check, to_job_config
from ladle.runner.executors.base import Executor, RunResult
from ladle.runner.executors.checks import check_executor
from ladle.runner.executors.local import Local
from ladle.runner.executors.ray import Ray


def run_job(cfg: DictConfig, out_dir: str | Path, engine: Any = None,
            extra: dict[str, Any] | None = None, calibration_path: Path | None = None) -> RunResult:
    """Run the job described by a composed config into `out_dir`. `engine`: reuse this one (executor=local);
    `extra`: summary fields (the CLI's overrides); `calibration_path`: a sweep's shared arrival calibration."""
    job = to_job_config(cfg)
    check(job)
    check_executor(job)
    executor: Executor = Ray(extra) if job.executor.kind == "ray" else Local(engine, extra, calibration_path)
    return executor.run(cfg, out_dir)
