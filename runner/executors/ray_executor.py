"""executor=ray: data-parallel replicas on a Ray cluster, each an actor holding one LLMEngine.

Rows are routed in blocks of executor.batch_size consecutive rows, round-robin over the replicas
(runner/executors/shards.py). Replica k runs an ordinary ladle Job (the same source code, bad-row
handling, arrivals, continuous batching and sinks as executor=local) over its share, which it reads
itself, into <out>/replicas/r<k>/, so each replica resumes on its own. Ray Data drives the replicas:
`map_batches` over the replica numbers with a pool of one actor per replica, one task per actor at a
time; a task whose actor dies is retried by Ray (max_restarts / max_task_retries) and the retried
replica resumes from the rows it had already flushed. Shares are disjoint and the routing is pinned
per run directory (replicas/routing.json), so each request is written exactly once; the driver then
streams the replicas' files into <out>/generations.parquet and steps.parquet (row group by row group,
never the whole run in memory). The engine knows nothing of Ray.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from omegaconf import DictConfig, OmegaConf

from runner.config import ConfigError, JobConfig
from runner.executors.checks import check_resources, connect, describe_cluster
from runner.executors.shards import duplicate_indices
from runner.sinks import STEPS_SCHEMA, conform, generations_schema, readable
from runner.sources.shard import Routing, Shard

log = logging.getLogger("ladle")

CRASH_ENV = "LADLE_TEST_CRASH"  # test-only: "<replica>:<rows>" -> that replica os._exit()s once after <rows> rows
ROUTING = "routing.json"
MERGED_KEY = b"ladle.merged_by"  # schema metadata of a generations.parquet that executor=ray merged


def replica_dir(out: Path, k: int) -> Path:
    return out / "replicas" / f"r{k}"


def replica_cfg(cfg: DictConfig) -> DictConfig:
    """The config each replica's Job runs: local, quiet, and with its torch threads fixed (the free-cores
    default would give every replica on a node all of the node's cores)."""
    c = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    c.executor.kind = "local"
    c.output.print_summary = False
    c.output.progress = False
    if c.threads is None:
        c.threads = max(1, int(c.executor.num_cpus_per_replica))
    return c


class Replica:
    """A Ray Data callable class: one engine per actor, reused for every replica task routed to it."""

    def __init__(self, cfg_yaml: str, out_root: str, routing: dict[str, int],
                 duplicates: dict[int, list[int]]) -> None:
        self.cfg = OmegaConf.create(cfg_yaml)
        self.out_root, self.routing = Path(out_root), Routing(**routing)
        self.duplicates = duplicates
        self.engine = None
        self.threads: dict[str, Any] | None = None

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        """Run each replica of the batch; a replica's error is returned (as text), not raised, so the other
        replicas finish and the driver can say which one failed and why."""
        ks = [int(x) for x in batch["replica"]]
        done, errors, config = [], [], []
        for k in ks:
            try:
                done.append(self._run(k))
                errors.append("")
                config.append(False)
            except Exception as e:  # noqa: BLE001 - reported by the driver, with the replica's number
                done.append(0)
                errors.append(f"{type(e).__name__}: {e}")
                config.append(isinstance(e, ConfigError))
        return {"replica": ks, "requests": done, "error": errors, "config_error": config}

    def _run(self, k: int) -> int:
        from runner.job import Job, make_engine, to_job_config
        from runner.sources import open_source
        from runner.threads import apply_threads

        job = to_job_config(self.cfg)
        if self.engine is None:
            self.threads = {**apply_threads(job.threads), "niceness": os.nice(0)}
            self.engine = make_engine(job)
        crash = os.environ.get(CRASH_ENV)
        after = int(crash.split(":")[1]) if crash and int(crash.split(":")[0]) == k else None
        out = replica_dir(self.out_root, k)
        out.mkdir(parents=True, exist_ok=True)
        shard = Shard(k, self.routing, set(self.duplicates.get(k, ())), job.workload.id_column, after,
                      out / ".crashed")
        source = open_source(job.workload, shard)
        extra = {"replica": k, "cpu_threads": self.threads}
        res = Job(self.cfg, out, engine=self.engine, source=source, extra=extra).run()
        return int(res.summary.get("requests", 0) or 0)


def check_routing(out: Path, job: JobConfig, routing: Routing) -> None:
    """A run directory keeps one routing once a replica has written rows: resuming with another would
    give a row to two replicas. Checked before anything starts; written by `pin_routing` at launch."""
    path = out / "replicas" / ROUTING
    if not job.output.resume:
        return
    written = any((out / "replicas").glob("r*/generations.parquet*"))
    if written and path.exists():
        before = json.loads(path.read_text())
        if before != routing.as_dict():
            raise ConfigError(
                f"{out} was run with executor.num_replicas={before['num_replicas']} and executor.batch_size="
                f"{before['block_rows']}; resume it with those values, or use a new hydra.run.dir "
                "(or output.resume=false to start over)")
    top = readable(out / "generations.parquet")
    if top is not None and MERGED_KEY not in (top.schema_arrow.metadata or {}):
        # written (last) by executor=local: a merge of the replicas' files would drop its rows
        raise ConfigError(f"{out} holds an executor=local run (or one resumed with executor=local): resume "
                          "it with executor=local, or use a new hydra.run.dir (or output.resume=false to start over)")


def pin_routing(out: Path, routing: Routing) -> None:
    path = out / "replicas" / ROUTING
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(routing.as_dict()))


def stream_merge(sources: list[tuple[int, Path]], dest: Path, add_replica: bool, schema: pa.Schema) -> Path | None:
    """Concatenate the replicas' Parquet files into `dest`, a row group at a time (through a .tmp and a
    rename, so a crash mid-merge leaves the previous merged file). Every row group is conformed to
    `schema` (today's columns): a replica not rerun on resume may hold a file an older ladle wrote.
    None when no replica has the file."""
    files = [(k, pq.ParquetFile(p)) for k, p in sources if p.exists()]
    if not files:
        return None
    meta = files[0][1].schema_arrow.metadata or {}  # the resolved config the replicas wrote
    if add_replica:
        schema = schema.append(pa.field("replica", pa.int32()))
    schema = schema.with_metadata({**meta, MERGED_KEY: b"executor=ray"})
    tmp = dest.with_name(dest.name + ".merging")
    with pq.ParquetWriter(tmp, schema) as w:
        for k, pf in files:
            for rg in range(pf.num_row_groups):
                t = pf.read_row_group(rg)
                if add_replica:
                    t = t.append_column("replica", pa.array([k] * t.num_rows, pa.int32()))
                w.write_table(conform(t, schema).replace_schema_metadata(schema.metadata))
    os.replace(tmp, dest)
    return dest


def _launch(ray: Any, cfg: DictConfig, ex: Any, out: Path, routing: Routing, ks: list[int],
            duplicates: dict[int, list[int]]) -> tuple[dict[int, str], list[str], bool]:
    """Run the replicas through Ray Data; returns (replica -> failure, config errors, interrupted).
    An actor that dies more than executor.max_restarts times loses its block: Ray Data is told to go
    on without it (max_errored_blocks), so the other replicas finish their shares."""
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
                                          duplicates),
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


def _replica_summaries(out: Path, ks: list[int]) -> list[dict[str, Any]]:
    rows = []
    for k in ks:
        p = replica_dir(out, k) / "summary.json"
        if p.exists():
            s = json.loads(p.read_text())
            rows.append({"replica": k, "requests": s.get("requests"), "errors": s.get("errors"),
                         "resumed": s.get("resumed"), "duration_s": s.get("duration_s"),
                         "output_tokens_per_s": (s.get("throughput") or {}).get("output_tokens_per_s"),
                         "wall_time_s": s.get("wall_time_s"), "model": s.get("model"),
                         "workload": s.get("workload"), "clock": s.get("clock"),
                         "max_model_len": s.get("max_model_len"), "kv_blocks_total": s.get("kv_blocks_total"),
                         "cpu_threads": s.get("cpu_threads")})
    return rows


def run_ray(cfg: DictConfig, out_dir: str | Path, extra: dict[str, Any] | None = None) -> Any:
    import ray

    from runner.job import GENERATIONS, STEPS, SUMMARY, RunResult, resume_command, to_job_config
    from runner.report import format_table, summarize, write_summary
    from runner.sources import open_source

    job = to_job_config(cfg)
    ex = job.executor
    out = Path(out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    source = open_source(job.workload)  # checks the path and columns before Ray starts; the driver reads no rows
    if not job.output.resume:  # start over: no replica's earlier rows may reach the merge
        shutil.rmtree(out / "replicas", ignore_errors=True)
        for name in (GENERATIONS, STEPS):
            (out / name).unlink(missing_ok=True)
    routing = Routing(ex.num_replicas, ex.batch_size)
    check_routing(out, job, routing)
    # Replicas whose share is empty (num_replicas > rows) are not started at all.
    ks = [k for k in range(routing.num_replicas)
          if source.total is None or routing.share_size(k, source.total) > 0]
    if len(ks) < routing.num_replicas:
        log.warning("executor=ray: %s rows in blocks of executor.batch_size=%d leave %d of %d replicas without rows "
                    "(not started); a smaller executor.batch_size spreads them", source.total, routing.block_rows,
                    routing.num_replicas - len(ks), routing.num_replicas)
    duplicates = {k: sorted(v) for k, v in duplicate_indices(job.workload, routing).items()}
    connect(ex.address)
    check_resources(job, len(ks))
    log.info("executor=ray: %d replicas (%s) on %s", len(ks), routing.as_dict(), describe_cluster())

    wall0 = time.perf_counter()
    interrupted = False
    pin_routing(out, routing)
    failures: dict[int, str] = {}  # replica -> why it did not finish
    config_errors: list[str] = []
    if ks:
        failures, config_errors, interrupted = _launch(ray, cfg, ex, out, routing, ks, duplicates)

    gen_path, steps_path = out / GENERATIONS, out / STEPS
    all_k = range(routing.num_replicas)
    stream_merge([(k, replica_dir(out, k) / GENERATIONS) for k in all_k], gen_path, add_replica=False,
                 schema=generations_schema(job.output.include_prompt))
    stream_merge([(k, replica_dir(out, k) / STEPS) for k in all_k], steps_path, add_replica=True,
                 schema=STEPS_SCHEMA)
    files: dict[str, Path] = {"generations": gen_path, "steps": steps_path, "summary": out / SUMMARY}
    replicas = _replica_summaries(out, ks)
    first = replicas[0] if replicas else {}
    info = {
        "executor": "ray", "num_replicas": routing.num_replicas, "routing": routing.as_dict(),
        "model": first.get("model"), "workload": first.get("workload"), "clock": first.get("clock"),
        "max_model_len": first.get("max_model_len"), "kv_blocks_total": first.get("kv_blocks_total"),
        "resumed": sum(r.get("resumed") or 0 for r in replicas), "complete": not (interrupted or failures),
        "resume_command": resume_command(out, (extra or {}).get("overrides", [])) if interrupted or failures else None,
        "failed_replicas": failures or None,
        "wall_time_s": time.perf_counter() - wall0, "run_dir": str(out), "replicas": replicas,
        **(extra or {}),
    }
    if not gen_path.exists():  # nothing to run (an empty source): an empty file, as executor=local writes
        schema = generations_schema(job.output.include_prompt)
        pq.write_table(schema.with_metadata({**(schema.metadata or {}), MERGED_KEY: b"executor=ray"}).empty_table(),
                       gen_path)
    summary = summarize(gen_path, steps_path if steps_path.exists() else None, info)
    write_summary(summary, files["summary"])
    if config_errors:  # the same config in every replica: one message is enough
        raise ConfigError(f"in a replica: {config_errors[0]}")
    if failures:
        why = "; ".join(f"replica {k}: {msg}" for k, msg in sorted(failures.items()))
        raise RuntimeError(
            f"executor=ray: {why}. The {summary['requests']} rows written so far are in {gen_path}; the same "
            f"command resumes: {resume_command(out, (extra or {}).get('overrides', []))}")
    if job.output.plots and not interrupted:
        files.update(_plots(job, out, gen_path, ks))
    if job.output.print_summary:
        print(format_table(summary))
        for r in replicas:
            tp = r["output_tokens_per_s"]
            print(f"replica {r['replica']:<5} {r['requests']} requests, {r['errors']} errors, "
                  f"{'-' if tp is None else f'{tp:.1f}'} output tok/s, wall {r['wall_time_s'] or 0:.1f} s")
        print(f"\noutputs in {out}:")
        for name, p in files.items():
            print(f"  {name:<12} {p.relative_to(out)}")
    return RunResult(out, summary, files, interrupted)


def _plots(job: JobConfig, out: Path, gen_path: Path, ks: list[int]) -> dict[str, Path]:
    """latency.png over every replica's requests; schedule.png per replica (replicas/r<k>/, made by its
    job): engine steps are per engine, so one step axis across replicas would mean nothing."""
    from runner.plots import plot_latency

    made: dict[str, Path] = {}
    try:
        made["latency"] = plot_latency(gen_path, out / "latency.png",
                                       f"{job.model.name} / {job.workload.name} ({len(ks)} replicas)")
    except Exception as e:  # noqa: BLE001 - a plot must never cost the run its outputs
        log.warning("latency plot failed: %s", e)
    for k in ks:
        p = replica_dir(out, k) / "schedule.png"
        if p.exists():
            made[f"schedule_r{k}"] = p
    return made
