"""executor=ray: data-parallel replicas on a Ray cluster, each an actor holding one LLMEngine.

Rows are routed in blocks of executor.batch_size consecutive rows, round-robin over the replicas
(runner/sources/shard.py). Replica k (replica.py) runs an ordinary executor=local job (the same source
code, bad-row handling, arrivals, continuous batching and sinks) over its share, which it reads itself,
into <out>/replicas/r<k>/, so each replica resumes on its own. Ray Data drives the replicas:
`map_batches` over the replica numbers with a pool of one actor per replica, one task per actor at a
time; a task whose actor dies is retried by Ray (max_restarts / max_task_retries) and the retried
replica resumes from the rows it had already flushed. Shares are disjoint and the routing is pinned
per run directory (replicas/routing.json), so each request is written exactly once; the driver then
streams the replicas' files into <out>/generations.parquet and steps.parquet (replica_files.py). The
engine knows nothing of Ray.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from ladle.runner.config import ConfigError, JobConfig
from ladle.runner.executors import start_over
from ladle.runner.executors.base import Executor, Ran, try_plot
from ladle.runner.executors.checks import check_resources, connect, describe_cluster
from ladle.runner.executors.replica import CRASH_ENV, Replica, replica_cfg, replica_store
from ladle.runner.executors.replica_files import (
    check_routing,
    merge_replicas,
    pin_routing,
    replica_dir,
    replica_summaries,
)
from ladle.runner.executors.shards import duplicate_indices
from ladle.runner.output_store import fetch, output_location
from ladle.runner.redact import redact
from ladle.runner.report import SUMMARY
from ladle.runner.resume import job_resume_command
from ladle.runner.sinks import GENERATIONS, STEPS
from ladle.runner.sources import Source, open_source
from ladle.runner.sources.shard import Routing
from ladle.runner.storage import locate

log = logging.getLogger("ladle")


@dataclass(slots=True)
class RayRan(Ran):
    started: list[int] = field(default_factory=list)  # the replicas that had rows (and were started)


class Ray(Executor):
    def execute(self, cfg: DictConfig, job: JobConfig, out: Path) -> Ran:
        ex = job.executor
        out = out.resolve()
        out.mkdir(parents=True, exist_ok=True)
        source = open_source(job.workload)  # checks the path and columns before Ray starts; the driver reads no rows
        if job.output.resume:
            start_over.drop_stale(out)
        routing = Routing(ex.num_replicas, ex.batch_size)
        check_routing(out, job, routing)
        ks = _replicas_with_rows(source, routing)
        duplicates = {k: sorted(v) for k, v in duplicate_indices(job.workload, routing).items()}
        connect(ex.address)
        check_resources(job, len(ks))
        log.info("executor=ray: %d replicas (%s) on %s", len(ks), routing.as_dict(), describe_cluster())

        wall0 = time.perf_counter()
        # Starting over: the replicas write apart, and the previous output stays until they have written.
        root = out if job.output.resume else start_over.begin(out)
        pin_routing(root, routing)
        failures: dict[int, str] = {}  # replica -> why it did not finish
        config_errors: list[str] = []
        interrupted = False
        store = job.output.path if output_location(job.output, out) is not None else None
        if ks:
            failures, config_errors, interrupted = _launch(cfg, job, root, routing, ks, duplicates, store)
        if store is not None:  # the replicas kept their files in the store, never in this directory
            for k in ks:
                fetch(locate(replica_store(store, k), "output.path"), (GENERATIONS, STEPS, SUMMARY), replica_dir(root, k))
        if root != out:
            _settle_start_over(out, failures, config_errors, interrupted)
        merge_replicas(out, job, routing.num_replicas, redact(OmegaConf.to_yaml(cfg, resolve=True)))
        replicas = replica_summaries(out, ks)
        resume_cmd = job_resume_command(out, self.extra)
        first = replicas[0] if replicas else {}
        info = {
            "executor": "ray", "num_replicas": routing.num_replicas, "routing": routing.as_dict(),
            **{key: first.get(key) for key in ("model", "workload", "clock", "max_model_len", "kv_blocks_total")},
            "resumed": sum(r.get("resumed") or 0 for r in replicas), "complete": not (interrupted or failures),
            "resume_command": resume_cmd if interrupted or failures else None, "failed_replicas": failures or None,
            "wall_time_s": time.perf_counter() - wall0, "run_dir": str(out), "replicas": replicas, **self.extra,
        }
        return RayRan(out, info, interrupted, notes=[_note(r) for r in replicas],
                      error=_error(config_errors, failures, out, resume_cmd), started=ks)

    def plots(self, job: JobConfig, ran: Ran) -> dict[str, Path]:
        """latency.png over every replica's requests; schedule.png per replica (replicas/r<k>/, made by its
        job): engine steps are per engine, so one step axis across replicas would mean nothing."""
        from ladle.runner.plots import plot_latency

        ks = ran.started if isinstance(ran, RayRan) else []
        title = f"{job.model.name} / {job.workload.name} ({len(ks)} replicas)"
        made = try_plot("latency", lambda: plot_latency(ran.out / GENERATIONS, ran.out / "latency.png", title))
        for k in ks:
            p = replica_dir(ran.out, k) / "schedule.png"
            if p.exists():
                made[f"schedule_r{k}"] = p
        return made


def _replicas_with_rows(source: Source, routing: Routing) -> list[int]:
    """Replicas whose share is empty (num_replicas > rows) are not started at all."""
    ks = [k for k in range(routing.num_replicas)
          if source.total is None or routing.share_size(k, source.total) > 0]
    if len(ks) < routing.num_replicas:
        log.warning("executor=ray: %s rows in blocks of executor.batch_size=%d leave %d of %d replicas without rows "
                    "(not started); a smaller executor.batch_size spreads them", source.total, routing.block_rows,
                    routing.num_replicas - len(ks), routing.num_replicas)
    return ks


def _launch(cfg: DictConfig, job: JobConfig, out: Path, routing: Routing, ks: list[int],
            duplicates: dict[int, list[int]], store: str | None) -> tuple[dict[int, str], list[str], bool]:
    """Run the replicas through Ray Data; returns (replica -> failure, config errors, interrupted).
    An actor that dies more than executor.max_restarts times loses its block: Ray Data is told to go
    on without it (max_errored_blocks), so the other replicas finish their shares."""
    import ray

    ex = job.executor
    ctx = ray.data.DataContext.get_current()
    saved = ctx.max_errored_blocks
    ctx.max_errored_blocks = len(ks)
    ds = ray.data.from_items([{"replica": k} for k in ks], override_num_blocks=len(ks))
    pool = ray.data.ActorPoolStrategy(size=len(ks), max_tasks_in_flight_per_actor=1)  # a replica per actor
    rows: list[dict[str, Any]] = []
    interrupted = False
    try:
        rows = ds.map_batches(
            Replica, fn_constructor_args=(OmegaConf.to_yaml(replica_cfg(cfg)), str(out), routing.as_dict(),
                                          duplicates, store, uuid.uuid4().hex),
            batch_size=1, compute=pool, num_cpus=ex.num_cpus_per_replica, num_gpus=ex.num_gpus_per_replica,
            max_restarts=ex.max_restarts, max_task_retries=ex.max_restarts,
            runtime_env={"env_vars": {CRASH_ENV: os.environ[CRASH_ENV]}} if CRASH_ENV in os.environ else None,
        ).take_all()
    except KeyboardInterrupt:  # the replicas' flushed rows stay; the caller merges them
        interrupted = True
    finally:
        ctx.max_errored_blocks = saved
    failures = {int(r["replica"]): r["error"] for r in rows if r["error"]}
    config_errors = [r["error"] for r in rows if r["config_error"]]
    if not interrupted:
        returned = {int(r["replica"]) for r in rows}
        for k in set(ks) - returned:
            failures[k] = f"its actor died more than executor.max_restarts={ex.max_restarts} times"
    return failures, config_errors, interrupted


def _settle_start_over(out: Path, failures: dict[int, str], config_errors: list[str], interrupted: bool) -> None:
    """The staged attempt replaces the previous output once it is complete or a replica of it wrote; else it
    is dropped and the run ends as one that failed before writing (the previous output as it was)."""
    if not (failures or config_errors or interrupted) or start_over.wrote(out):
        start_over.adopt(out)
        return
    start_over.drop_stale(out)
    kept = f"no replica wrote a row, and the previous output in {out} is kept as it was"
    if config_errors:
        raise ConfigError(f"in a replica: {config_errors[0]} ({kept})")
    if interrupted:
        log.warning("interrupted: %s", kept)
        raise KeyboardInterrupt
    why = "; ".join(f"replica {k}: {msg}" for k, msg in sorted(failures.items()))
    raise RuntimeError(f"executor=ray: {why}. {kept[0].upper()}{kept[1:]}")


def _note(r: dict[str, Any]) -> str:
    tp = r["output_tokens_per_s"]
    return (f"replica {r['replica']:<5} {r['requests']} requests, {r['errors']} errors, "
            f"{'-' if tp is None else f'{tp:.1f}'} output tok/s, wall {r['wall_time_s'] or 0:.1f} s")


def _error(config_errors: list[str], failures: dict[int, str], out: Path,
           resume_cmd: str) -> Callable[[dict[str, Any]], Exception] | None:
    """What the run raises once its summary is written: a replica's config error (the same config in
    every replica: one message is enough), else the failed replicas with the rows kept and the resume."""
    if config_errors:
        return lambda summary: ConfigError(f"in a replica: {config_errors[0]}")
    if not failures:
        return None
    why = "; ".join(f"replica {k}: {msg}" for k, msg in sorted(failures.items()))
    return lambda summary: RuntimeError(
        f"executor=ray: {why}. The {summary['requests']} rows written so far are in {out / GENERATIONS}; the "
        f"same command resumes: {resume_cmd}")
