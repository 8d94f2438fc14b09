"""The replicas' files in an executor=ray run directory: where each replica writes, the routing pinned
to the directory, and the merge of the replicas' files into the run's own (a row group at a time)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from ladle.runner.config import ConfigError, JobConfig
from ladle.runner.durable import fsync_path, sync_dir
from ladle.runner.report import SUMMARY
from ladle.runner.sinks import (
    CONFIG_KEY,
    GENERATIONS,
    STEPS,
    STEPS_SCHEMA,
    conform,
    generations_schema,
    readable,
)
from ladle.runner.sources.shard import Routing
from ladle.runner.text import clean_str

ROUTING = "routing.json"
MERGED_KEY = b"ladle.merged_by"  # schema metadata of a generations.parquet that executor=ray merged


def replica_dir(out: Path, k: int) -> Path:
    return out / "replicas" / f"r{k}"


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
    top = readable(out / GENERATIONS)
    if top is not None and MERGED_KEY not in (top.schema_arrow.metadata or {}):
        # written (last) by executor=local: a merge of the replicas' files would drop its rows
        raise ConfigError(f"{out} holds an executor=local run (or one resumed with executor=local): resume "
                          "it with executor=local, or use a new hydra.run.dir (or output.resume=false to start over)")


def pin_routing(out: Path, routing: Routing) -> None:
    path = out / "replicas" / ROUTING
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(routing.as_dict()))


def merge_replicas(out: Path, job: JobConfig, num_replicas: int, config_yaml: str | None = None) -> None:
    """generations.parquet (each request once) and steps.parquet (with a `replica` column) from every
    replica's files; an empty generations.parquet when no replica wrote one, as executor=local would.
    config_yaml: the run's own resolved config, stored in place of the replicas' (theirs say
    executor=local and their own threads: a resume compares its config with the stored one)."""
    schema = generations_schema(job.output.include_prompt)
    meta = {} if config_yaml is None else {CONFIG_KEY: clean_str(config_yaml).encode()}
    stream_merge([(k, replica_dir(out, k) / GENERATIONS) for k in range(num_replicas)], out / GENERATIONS,
                 add_replica=False, schema=schema, meta=meta)
    stream_merge([(k, replica_dir(out, k) / STEPS) for k in range(num_replicas)], out / STEPS,
                 add_replica=True, schema=STEPS_SCHEMA, meta=meta)
    if not (out / GENERATIONS).exists():
        pq.write_table(schema.with_metadata({**(schema.metadata or {}), **meta, MERGED_KEY: b"executor=ray"})
                       .empty_table(), out / GENERATIONS)


def stream_merge(sources: list[tuple[int, Path]], dest: Path, add_replica: bool, schema: pa.Schema,
                 meta: dict[bytes, bytes] | None = None) -> Path | None:
    """Concatenate the replicas' Parquet files into `dest`, a row group at a time (through a .tmp and a
    rename, so a crash mid-merge leaves the previous merged file). Every row group is conformed to
    `schema` (today's columns): a replica not rerun on resume may hold a file an older ladle wrote.
    None when no replica has the file."""
    files = [(k, pq.ParquetFile(p)) for k, p in sources if p.exists()]
    if not files:
        return None
    written = files[0][1].schema_arrow.metadata or {}  # the resolved config the replicas wrote
    if add_replica:
        schema = schema.append(pa.field("replica", pa.int32()))
    schema = schema.with_metadata({**written, **(meta or {}), MERGED_KEY: b"executor=ray"})
    tmp = dest.with_name(dest.name + ".merging")
    with pq.ParquetWriter(tmp, schema) as w:
        for k, pf in files:
            for rg in range(pf.num_row_groups):
                t = pf.read_row_group(rg)
                if add_replica:
                    t = t.append_column("replica", pa.array([k] * t.num_rows, pa.int32()))
                w.write_table(conform(t, schema).replace_schema_metadata(schema.metadata))
    fsync_path(tmp)  # on the device before its name does (runner/sinks.py)
    os.replace(tmp, dest)
    sync_dir(dest.parent)
    return dest


def replica_summaries(out: Path, ks: list[int]) -> list[dict[str, Any]]:
    """The per-replica lines of the run's summary, from each replica's own summary.json."""
    rows = []
    for k in ks:
        p = replica_dir(out, k) / SUMMARY
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
