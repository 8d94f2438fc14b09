"""executor=ray: two replicas on a local Ray cluster give the same rows as executor=local, survive a
replica's death, and resume into the same directory writing only the missing rows."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from runner.job import run_job
from tests.runner.conftest import PROMPTS, compose_cfg

ray = pytest.importorskip("ray", reason="ray is not installed: pip install -e '.[ray]' to run the Ray tests")

N_ROWS = 200


@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def mixed_parquet(tmp_path_factory):
    """~200 rows with bad ones: null, empty and too-long prompts, bad max_tokens."""
    prompts, max_tokens = [], []
    for i in range(N_ROWS):
        p: str | None = PROMPTS[i % len(PROMPTS)]
        mt: int | None = None
        if i % 37 == 5:
            p = None
        elif i % 41 == 7:
            p = ""
        elif i % 53 == 9:
            p = "word " * 400  # beyond cache.max_model_len=256
        elif i % 29 == 3:
            mt = -2
        prompts.append(p)
        max_tokens.append(mt)
    path = tmp_path_factory.mktemp("ray_data") / "mixed.parquet"
    ids = [f"q{i}" for i in range(N_ROWS)]
    ids[-1] = "q0"  # a duplicate id on the other replica: an error row, as with executor=local
    pq.write_table(pa.table({"id": ids, "prompt": prompts,
                             "max_tokens": pa.array(max_tokens, pa.int64())}), path)
    return path


def _args(path, *extra):
    return ["workload=parquet", f"workload.path={path}", "workload.id_column=id",
            "workload.max_tokens_column=max_tokens", "sampling.max_tokens=2", *extra]


def _by_id(path):
    """Rows keyed by (id, index): ids may repeat in a source."""
    t = pq.read_table(path).to_pylist()
    return {(r["id"], r["index"]): r for r in t}, len(t)


def _same(row_a, row_b):
    assert row_a["output_token_ids"] == row_b["output_token_ids"], row_a["index"]
    assert row_a["error"] == row_b["error"], row_a["index"]


RAY = ["executor=ray", "executor.num_replicas=2", "executor.num_cpus_per_replica=0.5", "executor.batch_size=64"]


def test_two_replicas_match_local(ray_cluster, mixed_parquet, engine, tmp_path):
    run_job(compose_cfg(*_args(mixed_parquet)), tmp_path / "local", engine=engine)
    result = run_job(compose_cfg(*_args(mixed_parquet), *RAY), tmp_path / "ray")
    local, n_local = _by_id(tmp_path / "local" / "generations.parquet")
    got, n_ray = _by_id(result.files["generations"])
    assert n_ray == n_local == N_ROWS and set(got) == set(local)
    assert sum(r["error"] is not None for r in got.values()) >= 10  # the bad rows are there, as errors
    for i in local:
        _same(got[i], local[i])
    steps = pq.read_table(result.files["steps"])
    assert set(steps["replica"].to_pylist()) == {0, 1}
    assert result.summary["requests"] == N_ROWS


def test_replica_killed_mid_job(ray_cluster, mixed_parquet, tmp_path, monkeypatch):
    monkeypatch.setenv("LADLE_TEST_CRASH", "1:30")  # replica 1 dies once after 30 of its rows
    ray.shutdown()  # actors must inherit the env var: restart the cluster with it
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"LADLE_TEST_CRASH": "1:30"}})
    result = run_job(compose_cfg(*_args(mixed_parquet), *RAY), tmp_path)
    assert (tmp_path / "replicas" / "r1" / ".crashed").exists()  # the fault did happen
    got, n = _by_id(result.files["generations"])
    assert n == N_ROWS and len(got) == N_ROWS


def test_resume_writes_only_missing_rows(ray_cluster, mixed_parquet, tmp_path):
    if ray.is_initialized():
        ray.shutdown()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    run_job(compose_cfg(*_args(mixed_parquet, "workload.limit=60"), *RAY), tmp_path)
    first, n_first = _by_id(tmp_path / "generations.parquet")
    assert n_first == 60
    result = run_job(compose_cfg(*_args(mixed_parquet), *RAY), tmp_path)
    got, n = _by_id(result.files["generations"])
    assert n == N_ROWS and len(got) == N_ROWS
    for i, row in first.items():  # rows written before are kept as they were (same timings), not run again
        assert got[i] == row
    assert result.summary["attempts"] == 2  # the second run is a resume, not a fresh run
