"""executor=ray: data-parallel replicas on a Ray cluster, each an actor holding one LLMEngine.

Rows are routed round-robin (row index % num_replicas). Replica k runs an ordinary ladle Job (the same
source reading, bad-row handling, arrivals, continuous batching and sinks as executor=local) over its
share into <out>/replicas/r<k>/, so each replica resumes on its own. Ray Data drives the replicas:
`map_batches` over the replica numbers with an actor pool of `num_replicas` actors; a task whose
actor dies is retried by Ray (max_restarts / max_task_retries), and the retried replica resumes from
the rows it had already flushed. The driver then merges the replicas' files into the run directory,
keeping the first row per (id, index), so a request is written exactly once. The engine knows nothing of Ray.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from omegaconf import DictConfig, OmegaConf

from runner.sinks import sample_indices
from runner.source import Source

CRASH_ENV = "LADLE_TEST_CRASH"  # test-only: "<replica>:<rows>" -> that replica os._exit()s once after <rows> rows


class ShardSource(Source):
    """Replica k's rows of a source: those with index % n == k (round-robin)."""

    def __init__(self, inner: Source, k: int, n: int, id_column: str | None = None,
                 crash_after: int | None = None, crash_marker: Path | None = None) -> None:
        self.inner, self.k, self.n, self.id_column = inner, k, n, id_column
        self.crash_after, self.crash_marker = crash_after, crash_marker
        self.total = None if inner.total is None else len(range(k, inner.total, n))
        self.description = f"{inner.description} (replica {k} of {n})"

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "vocab_size":
            setattr(self.inner, name, value)
        object.__setattr__(self, name, value)

    def batches(self):
        seen = 0
        ids: set[str] = set()  # every replica reads every row, so a duplicate id is an error row as with local
        for batch in self.inner.batches():
            mine = []
            for r in batch:
                if r.index % self.n == self.k:
                    if self.id_column is not None and r.id in ids:
                        r.error = r.error or f"duplicate id {r.id!r} in column {self.id_column!r}"
                    mine.append(r)
                ids.add(r.id)
            if mine:
                yield mine
            seen += len(mine)
            if self.crash_after is not None and seen >= self.crash_after and not self.crash_marker.exists():
                self.crash_marker.touch()
                os._exit(1)  # test-only fault injection: the actor dies mid-job


def replica_cfg(cfg: DictConfig) -> DictConfig:
    c = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    c.executor.kind = "local"
    c.output.plots = False
    c.output.print_summary = False
    c.output.progress = False
    return c


class Replica:
    """A Ray Data callable class: one engine per actor, reused for every replica task routed to it."""

    def __init__(self, cfg_yaml: str, out_root: str, n: int) -> None:
        self.cfg = OmegaConf.create(cfg_yaml)
        self.out_root, self.n = Path(out_root), n
        self.engine = None

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        from runner.job import Job, make_engine, to_job_config
        from runner.source import open_source

        done = []
        for k in [int(x) for x in batch["replica"]]:
            job = to_job_config(self.cfg)
            if self.engine is None:
                self.engine = make_engine(job)
            crash = os.environ.get(CRASH_ENV)
            after = int(crash.split(":")[1]) if crash and int(crash.split(":")[0]) == k else None
            out = self.out_root / "replicas" / f"r{k}"
            out.mkdir(parents=True, exist_ok=True)
            source = ShardSource(open_source(job.workload), k, self.n, job.workload.id_column,
                                 after, out / ".crashed")
            res = Job(self.cfg, out, engine=self.engine, source=source, extra={"replica": k}).run()
            done.append(int(res.summary.get("requests", 0) or 0))
        return {"replica": batch["replica"], "requests": done}


def _merge(out: Path, n: int, name: str, add_replica: bool, dedupe: bool) -> pa.Table | None:
    tables = []
    for k in range(n):
        p = out / "replicas" / f"r{k}" / name
        if not p.exists():
            continue
        t = pq.read_table(p)
        if add_replica:
            t = t.append_column("replica", pa.array([k] * t.num_rows, pa.int32()))
        tables.append(t)
    if not tables:
        return None
    t = pa.concat_tables(tables, promote_options="default")
    if dedupe and t.num_rows:
        # a row is (id, index, sample_index): a source may repeat an id, and executor=local writes each
        # such row; sampling.n > 1 writes n rows per source row
        seen: set[tuple[str, int, int]] = set()
        keep = []
        keys = zip(t["id"].to_pylist(), t["index"].to_pylist(), sample_indices(t), strict=True)
        for i, key in enumerate(keys):
            if key not in seen:
                seen.add(key)
                keep.append(i)
        t = t.take(pa.array(keep))
    return t


def run_ray(cfg: DictConfig, out_dir: str | Path, extra: dict[str, Any] | None = None) -> Any:
    import ray

    from runner.job import GENERATIONS, STEPS, SUMMARY, RunResult, to_job_config
    from runner.report import summarize, write_summary

    job = to_job_config(cfg)
    ex = job.executor
    out = Path(out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    if not ray.is_initialized():  # a second run in one process (Hydra --multirun) reuses the cluster
        ray.init(address=ex.address, include_dashboard=False)
    n = ex.num_replicas
    ds = ray.data.from_items([{"replica": k} for k in range(n)], override_num_blocks=n)
    res = ds.map_batches(
        Replica, fn_constructor_args=(OmegaConf.to_yaml(replica_cfg(cfg)), str(out), n),
        batch_size=1, concurrency=n, num_cpus=ex.num_cpus_per_replica, num_gpus=ex.num_gpus_per_replica,
        max_restarts=-1, max_task_retries=-1,
    ).take_all()
    del res
    gen = _merge(out, n, GENERATIONS, add_replica=False, dedupe=True)
    steps = _merge(out, n, STEPS, add_replica=True, dedupe=False)
    gen_path, steps_path = out / GENERATIONS, out / STEPS
    if gen is not None:
        pq.write_table(gen, gen_path)
    if steps is not None:
        pq.write_table(steps, steps_path)
    summary = summarize(gen_path, steps_path, {"executor": "ray", "num_replicas": n, **(extra or {})})
    write_summary(summary, out / SUMMARY)
    return RunResult(out, summary, {"generations": gen_path, "steps": steps_path, "summary": out / SUMMARY})
