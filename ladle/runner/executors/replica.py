"""An executor=ray replica: a Ray Data callable class holding one engine, running ordinary executor=local
jobs over its shares of the rows into <out>/replicas/r<k>/ (so each replica resumes on its own)."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from ladle.runner.config import ConfigError, to_job_config
from ladle.runner.executors.local import Local, make_engine
from ladle.runner.executors.replica_files import replica_dir
from ladle.runner.sources import open_source
from ladle.runner.sources.shard import Routing, Shard

CRASH_ENV = "LADLE_TEST_CRASH"  # test-only: "<replica>:<rows>" -> that replica os._exit()s once after <rows> rows


def replica_cfg(cfg: DictConfig) -> DictConfig:
    """The config each replica's job runs: local, quiet, and with its torch threads fixed (the free-cores
    default would give every replica on a node all of the node's cores)."""
    c = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    c.executor.kind = "local"
    c.output.print_summary = False
    c.output.progress = False
    c.output.path = None  # the driver copies the merged outputs to output.path, never a replica its own share
    if c.threads is None:
        c.threads = max(1, int(c.executor.num_cpus_per_replica))
    return c


class Replica:
    """One engine per actor, reused for every replica task routed to it."""

    def __init__(self, cfg_yaml: str, out_root: str, routing: dict[str, int],
                 duplicates: dict[int, list[int]], store: str | None = None, run_token: str = "") -> None:
        self.cfg = OmegaConf.create(cfg_yaml)
        self.out_root, self.routing = Path(out_root), Routing(**routing)
        # output.path set: a replica works in a directory of its node and keeps its files in the store
        self.store, self.run_token = store, run_token
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
        from ladle.runner.threads import apply_threads

        job = to_job_config(self.cfg)
        if self.engine is None:
            self.threads = {**apply_threads(job.threads), "niceness": os.nice(0)}
            self.engine = make_engine(job)
        crash = os.environ.get(CRASH_ENV)
        after = int(crash.split(":")[1]) if crash and int(crash.split(":")[0]) == k else None
        cfg, out = self.cfg, replica_dir(self.out_root, k)
        crashed = out / ".crashed"
        if self.store is not None:  # nothing shared with the driver but the store
            cfg = self.cfg.copy()
            cfg.output.path = replica_store(self.store, k)
            out = Path(tempfile.gettempdir()) / "ladle-replicas" / self.run_token / f"r{k}"
            crashed = out.with_name(f"r{k}.crashed")  # outlives `out`, which goes once it is in the store
        out.mkdir(parents=True, exist_ok=True)
        shard = Shard(k, self.routing, self.duplicates.get(k), job.workload.id_column, after, crashed)
        extra = {"replica": k, "cpu_threads": self.threads}
        res = Local(engine=self.engine, source=open_source(job.workload, shard), extra=extra).run(cfg, out)
        if self.store is not None:  # its files are in the store now (a retry here would resume from them)
            shutil.rmtree(out, ignore_errors=True)
        return int(res.summary.get("requests", 0) or 0)


def replica_store(store: str, k: int) -> str:
    """Where replica k keeps its files when output.path is set: `<output.path>/replicas/r<k>`."""
    return f"{store.rstrip('/')}/replicas/r{k}"
