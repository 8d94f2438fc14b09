"""executor=ray config errors: each a ConfigError (exit 2) naming the key and the fix, raised before a
cluster starts or a model loads; and Hydra --multirun running two executor=ray jobs in one process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from ladle.runner.config import ConfigError
from ladle.runner.job import run_job
from tests.runner.conftest import compose_cfg

REPO = Path(__file__).resolve().parents[2]
RAY = ["executor=ray", "executor.num_cpus_per_replica=0.5"]


@pytest.mark.parametrize("over,msg", [
    (["executor.num_replicas=0"], r"executor.num_replicas=0 must be >= 1"),
    (["executor.batch_size=0"], r"executor.batch_size=0 must be >= 1"),
    (["executor.num_cpus_per_replica=-1"], r"num_cpus_per_replica=-1.0 .* must be >= 0"),
    (["executor.num_gpus_per_replica=1", "model.device=cpu"],
     r"num_gpus_per_replica=1.0 with model.device=cpu: .* set executor.num_gpus_per_replica=0"),
    (["model.device=cuda"], r"model.device=cuda needs executor.num_gpus_per_replica > 0"),
    (["executor.address=nohost"], r"executor.address='nohost' is not host:port"),
    (["executor.address=127.0.0.1:1"], r"executor.address='127.0.0.1:1' is unreachable .* `ray start --head`"),
    (["executor.address=ray://127.0.0.1:1"], r"is unreachable"),
    (["executor.kind=rey"], r"executor.kind='rey' is invalid: use executor=local or executor=ray"),
])
def test_bad_executor_values_are_config_errors(tmp_path, over, msg):
    pytest.importorskip("ray")
    with pytest.raises(ConfigError, match=msg):
        run_job(compose_cfg(*RAY, *over), tmp_path)
    assert not (tmp_path / "replicas").exists()  # nothing ran


def test_address_auto_without_a_cluster_is_a_config_error(tmp_path, monkeypatch):
    ray = pytest.importorskip("ray")
    if ray.is_initialized():
        ray.shutdown()
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    # "auto" joins any Ray running on this machine (another test run's local cluster): none is seen here.
    services = pytest.importorskip("ray._private.services")
    def no_gcs() -> list:
        return []

    no_gcs.cache_clear = lambda: None  # Ray's own is an lru_cache
    monkeypatch.setattr(services, "find_gcs_addresses", no_gcs)
    monkeypatch.setattr(services, "find_bootstrap_address", lambda temp_dir: None)
    try:
        with pytest.raises(ConfigError, match=r"could not reach a Ray cluster at executor.address='auto': "
                                              r"Could not find any running Ray instance"):
            run_job(compose_cfg(*RAY, "executor.address=auto"), tmp_path)
    finally:
        if ray.is_initialized():  # a failure here must not leave later tests a connection to someone's cluster
            ray.shutdown()


def test_ray_not_installed_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now raises ImportError
    with pytest.raises(ConfigError, match=r"executor=ray needs Ray, which is not installed: "
                                          r"pip install -e '\.\[ray\]'"):
        run_job(compose_cfg(*RAY), tmp_path)


def _ladle(*args: str, cwd: Path, timeout: int = 400) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    env.pop("RAY_ADDRESS", None)
    return subprocess.run([sys.executable, "-m", "ladle", *args], cwd=cwd, env=env, capture_output=True, check=False,
                          text=True, timeout=timeout)


def test_cli_exits_2_with_one_message(tmp_path):
    pytest.importorskip("ray")
    p = _ladle("executor=ray", "executor.num_replicas=0", f"hydra.run.dir={tmp_path / 'r'}", cwd=tmp_path)
    assert p.returncode == 2, p.stderr[-2000:]
    assert p.stderr.count("executor.num_replicas=0 must be >= 1") == 1 and "Traceback" not in p.stderr


def test_multirun_runs_two_ray_jobs_in_one_process(tmp_path):
    """Hydra calls the task once per run in one process: the second run reuses the first's Ray
    connection (a second ray.init would fail) and both write complete outputs."""
    pytest.importorskip("ray")
    sweep = tmp_path / "sweep"
    p = _ladle("--multirun", "executor=ray", "executor.num_replicas=2", "executor.num_cpus_per_replica=0.5",
               "executor.batch_size=4", "workload.limit=12", "sampling.max_tokens=2,3", "max_num_seqs=4",
               "output.plots=false", "output.progress=false", f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    for run, max_tokens in (("0", 2), ("1", 3)):
        gen = pq.read_table(sweep / run / "generations.parquet").to_pylist()
        assert len(gen) == 12 and len({r["index"] for r in gen}) == 12
        assert max(r["output_tokens"] for r in gen) == max_tokens  # each run its own config
        s = json.loads((sweep / run / "summary.json").read_text())
        assert s["executor"] == "ray" and s["requests"] == 12 and len(s["replicas"]) == 2
        # the local cluster runs replicas at the job's own niceness (this process's: 0 unless the tests
        # run under `nice`), not 15 above it as Ray would (starved by any other busy process)
        assert [r["cpu_threads"]["niceness"] for r in s["replicas"]] == [os.nice(0)] * 2
    assert (sweep / "sweep.md").exists()  # the sweep report still runs after executor=ray runs
