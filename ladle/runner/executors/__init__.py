"""Executors: where a job's requests run, behind one interface (base.py: `Executor.run(cfg, out)`).
`local` (local.py) is one engine in this process; `ray` (ray.py) runs local jobs on data-parallel
replicas (replica.py) and merges their files (replica_files.py)."""
