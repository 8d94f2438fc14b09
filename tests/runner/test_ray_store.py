"""executor=ray reading its rows from an S3 API server (moto) and keeping its outputs there: the same greedy
outputs as executor=local on the same input, the merged files copied to output.path, no replica's own."""

from __future__ import annotations

import io
import json
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ladle.runner.job import run_job
from tests.runner.conftest import PROMPTS, compose_cfg

ray = pytest.importorskip("ray", reason="ray is not installed: pip install -e '.[ray]' to run the Ray tests")

COLUMNS = ["id", "index", "output_token_ids", "output_text", "finish_reason", "error"]


@pytest.fixture
def ray_with_s3(s3):
    """A local Ray cluster started once the S3 variables are set: its workers read them as the driver does."""
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield s3
    ray.shutdown()


def test_ray_and_local_give_the_same_greedy_outputs_from_s3(ray_with_s3, tmp_path, engine):
    s3 = ray_with_s3
    ids = [f"q{i}" for i in range(24)]
    uri = s3.put("in/prompts.parquet", pa.table({"id": ids, "prompt": [PROMPTS[i % 8] + f" ({i})" for i in range(24)]}),
                 row_group_size=5)
    common = ["workload=parquet", f"workload.path={uri}", "workload.id_column=id"]
    run_job(compose_cfg(*common, f"output.path={s3.uri('local')}"), tmp_path / "local", engine=engine)
    res = run_job(compose_cfg(*common, "executor=ray", "executor.num_replicas=2", "executor.batch_size=4",
                              f"output.path={s3.uri('ray')}"), tmp_path / "ray")
    assert not res.interrupted

    def rows(prefix: str) -> list[dict]:
        t = pq.read_table(io.BytesIO(s3.get(f"{prefix}/generations.parquet")), columns=COLUMNS)
        return sorted(t.to_pylist(), key=lambda r: r["index"])

    local, distributed = rows("local"), rows("ray")
    assert [r["id"] for r in distributed] == ids and distributed == local
    steps = pq.read_table(io.BytesIO(s3.get("ray/steps.parquet")))
    assert set(steps.column("replica").to_pylist()) == {0, 1}
    objects = [k for k in s3.list_keys("ray/") if not k.endswith("/")]
    files = ["generations.parquet", "steps.parquet", "summary.json"]
    assert objects == sorted([f"ray/{f}" for f in files] + [f"ray/replicas/r{k}/{f}" for k in (0, 1) for f in files])


def test_a_replica_killed_mid_run_leaves_exactly_one_row_per_id_in_s3(ray_with_s3, tmp_path, monkeypatch):
    s3 = ray_with_s3
    ids = [f"r{i}" for i in range(60)]
    uri = s3.put("in/p.parquet", pa.table({"id": ids, "prompt": [PROMPTS[i % 8] for i in range(60)]}), row_group_size=7)
    t0 = time.time()
    monkeypatch.setenv("LADLE_TEST_CRASH", "1:10")  # replica 1's actor os._exit()s once after 10 rows
    res = run_job(compose_cfg("workload=parquet", f"workload.path={uri}", "workload.id_column=id", "executor=ray",
                              "executor.num_replicas=2", "executor.batch_size=10", f"output.path={s3.uri('out')}"),
                  tmp_path / "run")
    crashed = [p for p in Path(tempfile.gettempdir()).glob("ladle-replicas/*/r1.crashed") if p.stat().st_mtime >= t0]
    assert not res.interrupted and len(crashed) == 1  # the fault did happen, on the replica's node
    got = pq.read_table(io.BytesIO(s3.get("out/generations.parquet")), columns=["id", "error"]).to_pylist()
    assert sorted(r["id"] for r in got) == sorted(ids) and not any(r["error"] for r in got)


@pytest.fixture
def two_nodes(s3):
    """A head and a worker node, one CPU each (one replica per node), started once the S3 variables are set."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    cluster.add_node(num_cpus=1)
    ray.init(address=cluster.address, log_to_driver=False)
    yield s3
    ray.shutdown()
    cluster.shutdown()


def test_two_nodes_share_nothing_but_the_store(two_nodes, tmp_path):
    """The replicas work in their nodes' own directories and keep their files under output.path; the driver's
    run directory gets them only from there, and merges them."""
    s3 = two_nodes
    ids = [f"n{i}" for i in range(16)]
    uri = s3.put("in/p.parquet", pa.table({"id": ids, "prompt": [PROMPTS[i % 8] for i in range(16)]}))
    out = tmp_path / "driver"
    res = run_job(compose_cfg("workload=parquet", f"workload.path={uri}", "workload.id_column=id", "executor=ray",
                              "executor.num_replicas=2", "executor.batch_size=4", f"output.path={s3.uri('run')}"),
                  out)
    assert not res.interrupted
    assert len([n for n in ray.nodes() if n["Alive"]]) == 2
    for k in (0, 1):
        replica_summary = json.loads(s3.get(f"run/replicas/r{k}/summary.json"))
        assert not replica_summary["run_dir"].startswith(str(out))  # written in its node's own directory
        for name in ("generations.parquet", "steps.parquet", "summary.json"):
            assert (out / "replicas" / f"r{k}" / name).read_bytes() == s3.get(f"run/replicas/r{k}/{name}")
    merged = pq.read_table(io.BytesIO(s3.get("run/generations.parquet")), columns=["id"]).column("id").to_pylist()
    assert sorted(merged) == sorted(ids)
    steps = pq.read_table(io.BytesIO(s3.get("run/steps.parquet")), columns=["replica"])
    assert set(steps.column("replica").to_pylist()) == {0, 1}


def test_a_failed_distributed_run_resumes_from_output_path_on_another_driver(ray_with_s3, tmp_path, monkeypatch):
    """Replica 1 dies with no restart left: the job fails keeping replica 0's rows in the store; a rerun from an
    empty run directory (another machine) runs only replica 1's rows, and every id is written once."""
    s3 = ray_with_s3
    ids = [f"f{i}" for i in range(20)]
    uri = s3.put("in/p.parquet", pa.table({"id": ids, "prompt": [PROMPTS[i % 8] for i in range(20)]}))
    cfg = compose_cfg("workload=parquet", f"workload.path={uri}", "workload.id_column=id", "executor=ray",
                      "executor.num_replicas=2", "executor.batch_size=5", "executor.max_restarts=0",
                      f"output.path={s3.uri('resumed')}")
    monkeypatch.setenv("LADLE_TEST_CRASH", "1:3")
    with pytest.raises(RuntimeError, match="replica 1: its actor died"):
        run_job(cfg, tmp_path / "first")
    first = pq.read_table(io.BytesIO(s3.get("resumed/generations.parquet")), columns=["id"]).column("id").to_pylist()
    assert sorted(first) == sorted(ids[0:5] + ids[10:15])  # replica 0's blocks only
    monkeypatch.delenv("LADLE_TEST_CRASH")
    res = run_job(cfg, tmp_path / "second")
    got = pq.read_table(io.BytesIO(s3.get("resumed/generations.parquet")), columns=["id", "attempt"]).to_pylist()
    assert sorted(r["id"] for r in got) == sorted(ids)
    assert res.summary["resumed"] == 10 and {r["attempt"] for r in got if r["id"] in first} == {0}


def test_arrivals_are_replayed_per_replica_on_its_own_clock(ray_with_s3, tmp_path):
    """poisson at `rate` under executor=ray: each replica draws the seeded arrival stream over its own rows, so
    N replicas are offered N times the rate, as N servers each behind its own queue."""
    import numpy as np

    from ladle.runner.arrivals import arrival_times
    from ladle.runner.config import ArrivalConfig

    s3 = ray_with_s3
    uri = s3.put("in/p.parquet", pa.table({"id": [f"a{i}" for i in range(12)], "prompt": [PROMPTS[i % 8] for i in range(12)]}))
    run_job(compose_cfg("workload=parquet", f"workload.path={uri}", "workload.id_column=id", "executor=ray",
                        "executor.num_replicas=2", "executor.batch_size=3", "workload.arrivals.process=poisson",
                        "workload.arrivals.rate=20", "workload.arrivals.seed=7", f"output.path={s3.uri('arr')}"),
            tmp_path / "run")
    rows = pq.read_table(io.BytesIO(s3.get("arr/generations.parquet")), columns=["index", "arrival_s"]).to_pylist()
    by_index = {r["index"]: r["arrival_s"] for r in rows}
    expected = arrival_times(ArrivalConfig(process="poisson", rate=20, seed=7), 6)
    for share in ([0, 1, 2, 6, 7, 8], [3, 4, 5, 9, 10, 11]):  # blocks of 3 rows, alternating replicas
        np.testing.assert_allclose([by_index[i] for i in share], expected, rtol=0, atol=1e-9)
