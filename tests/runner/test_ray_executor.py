"""executor=ray: two replicas on a local Ray cluster give the same rows as executor=local, survive a
replica's death (also mid-write), resume into the same directory writing only the missing rows, skip
replicas with nothing to do, refuse a resume with another routing, and check the cluster's resources.
One Ray cluster for the whole module (starting one costs seconds)."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ladle.runner.config import ConfigError
from ladle.runner.executors.shards import Routing
from ladle.runner.job import run_job
from tests.runner.conftest import PROMPTS, compose_cfg

ray = pytest.importorskip("ray", reason="ray is not installed: pip install -e '.[ray]' to run the Ray tests")

N_ROWS = 200


@pytest.fixture(scope="module", autouse=True)
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
    ids[-1] = "q0"  # a duplicate id on the other replica (blocks of 20: row 199 -> replica 1): an error row
    pq.write_table(pa.table({"id": ids, "prompt": prompts,
                             "max_tokens": pa.array(max_tokens, pa.int64())}), path, row_group_size=32)
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


RAY = ["executor=ray", "executor.num_replicas=2", "executor.num_cpus_per_replica=0.5", "executor.batch_size=20"]


def test_two_replicas_match_local(mixed_parquet, engine, tmp_path):
    run_job(compose_cfg(*_args(mixed_parquet)), tmp_path / "local", engine=engine)
    result = run_job(compose_cfg(*_args(mixed_parquet), *RAY, "output.plots=true"), tmp_path / "ray")
    local, n_local = _by_id(tmp_path / "local" / "generations.parquet")
    got, n_ray = _by_id(result.files["generations"])
    assert n_ray == n_local == N_ROWS and set(got) == set(local)
    assert sum(r["error"] is not None for r in got.values()) >= 10  # the bad rows are there, as errors
    assert got[("q0", N_ROWS - 1)]["error"] == "duplicate id 'q0' in column 'id'"
    for i in local:
        _same(got[i], local[i])
    steps = pq.read_table(result.files["steps"])
    assert set(steps["replica"].to_pylist()) == {0, 1}
    # summary.json covers every replica; the outputs of both replicas are in its percentiles
    s = json.loads(result.files["summary"].read_text())
    ok = [r for r in got.values() if r["error"] is None]
    assert s["requests"] == N_ROWS and s["completed"] == len(ok) and s["executor"] == "ray"
    assert s["latency_s"]["ttft"]["count"] == len(ok) and s["latency_s"]["itl"]["count"] > 0
    assert s["throughput"]["output_tokens_per_s"] > 0 and s["steps"]["count"] == steps.num_rows
    assert [r["replica"] for r in s["replicas"]] == [0, 1]
    assert sum(r["requests"] for r in s["replicas"]) == N_ROWS
    assert all(r["cpu_threads"]["threads"] == 1 for r in s["replicas"])  # 0.5 CPU each: one thread
    # plots: latency over all replicas, the schedule per replica (its own engine steps)
    for name in ("latency", "schedule_r0", "schedule_r1"):
        assert result.files[name].exists() and result.files[name].stat().st_size > 0, name
    assert (tmp_path / "ray" / "replicas" / "r1" / "schedule.png") == result.files["schedule_r1"]


def test_replica_killed_mid_job(mixed_parquet, tmp_path, monkeypatch):
    """The actor dies once after 30 of its rows, mid-write: row groups of 4 rows are in its .tmp."""
    monkeypatch.setenv("LADLE_TEST_CRASH", "1:30")
    result = run_job(compose_cfg(*_args(mixed_parquet), *RAY, "output.row_group_size=4"), tmp_path)
    assert (tmp_path / "replicas" / "r1" / ".crashed").exists()  # the fault did happen
    got, n = _by_id(result.files["generations"])
    assert n == N_ROWS and len(got) == N_ROWS
    assert result.summary["requests"] == N_ROWS


def test_a_replica_that_keeps_dying_fails_the_job_and_a_rerun_resumes(mixed_parquet, tmp_path, monkeypatch):
    monkeypatch.setenv("LADLE_TEST_CRASH", "1:30")
    cfg = compose_cfg(*_args(mixed_parquet), *RAY, "output.row_group_size=4", "executor.max_restarts=0")
    with pytest.raises(RuntimeError, match=r"replica 1: its actor died more than executor.max_restarts=0 times\. "
                                           r"The 100 rows written so far are in .*generations.parquet; the same "
                                           r"command resumes: \S*python\S* -m ladle"):
        run_job(cfg, tmp_path)
    # replica 0 finished its share (Ray Data went on without replica 1's block) and was merged
    written, n = _by_id(tmp_path / "generations.parquet")
    assert n == len(written) == Routing(2, 20).share_size(0, N_ROWS) == 100
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["complete"] is False and summary["resume_command"] and list(summary["failed_replicas"]) == ["1"]
    result = run_job(cfg, tmp_path)  # the fault happened once (its marker is there): this run completes
    got, n = _by_id(result.files["generations"])
    assert n == len(got) == N_ROWS
    assert got[("q0", N_ROWS - 1)]["error"] == "duplicate id 'q0' in column 'id'"
    assert all(got[i] == r for i, r in written.items())  # nothing written before is lost or redone


def test_a_config_error_inside_a_replica_is_a_config_error(mixed_parquet, tmp_path):
    cfg = compose_cfg(*_args(mixed_parquet), *RAY, f"model.path={tmp_path / 'no_such_model'}")
    with pytest.raises(ConfigError, match=r"in a replica: .*no_such_model"):
        run_job(cfg, tmp_path / "out")


def test_resume_writes_only_missing_rows(mixed_parquet, engine, tmp_path):
    # executor=local, interrupted after 60 rows then resumed, is the reference. Both resumes write the
    # later duplicate of q0 as its error row, as a fresh run of either executor does (200 rows).
    for limit in ("workload.limit=60", "workload.limit=null"):
        ref = run_job(compose_cfg(*_args(mixed_parquet, limit)), tmp_path / "local", engine=engine)
    local, n_local = _by_id(tmp_path / "local" / "generations.parquet")
    out = tmp_path / "ray"
    run_job(compose_cfg(*_args(mixed_parquet, "workload.limit=60"), *RAY), out)
    first, n_first = _by_id(out / "generations.parquet")
    assert n_first == 60
    result = run_job(compose_cfg(*_args(mixed_parquet), *RAY), out)
    got, n = _by_id(result.files["generations"])
    dup = ("q0", N_ROWS - 1)
    assert n == len(got) == n_local == N_ROWS and set(got) == set(local)
    assert got[dup]["error"] == "duplicate id 'q0' in column 'id'"
    for i in local:
        _same(got[i], local[i])
    for i, row in first.items():  # rows written before are kept as they were (same timings), not run again
        assert got[i] == row
    assert result.summary["attempts"] == 2  # the second run is a resume, not a fresh run
    assert result.summary["resumed"] == 60 == ref.summary["resumed"]
    # another routing would give rows to other replicas: refused before anything runs
    with pytest.raises(ConfigError, match="num_replicas=2 and executor.batch_size=20"):
        run_job(compose_cfg(*_args(mixed_parquet), *RAY[:-1], "executor.batch_size=8"), out)
    # a resume after a partial ray write (replica 0's file is lost): only replica 0's rows run again
    r1_before, _ = _by_id(out / "replicas" / "r1" / "generations.parquet")
    (out / "replicas" / "r0" / "generations.parquet").unlink()
    again = run_job(compose_cfg(*_args(mixed_parquet), *RAY), out)
    rows, n = _by_id(again.files["generations"])
    assert n == len(rows) and set(got) == set(rows)  # each row once
    assert all(rows[i] == r for i, r in r1_before.items())  # replica 1's rows untouched
    assert again.summary["resumed"] == len(r1_before)
    # r0 ran all its rows again, in one new attempt (its steps file still counts the two before)
    assert {r["attempt"] for i, r in rows.items() if i not in r1_before} == {2}


def test_more_replicas_than_rows(mixed_parquet, engine, tmp_path):
    cfg = compose_cfg(*_args(mixed_parquet, "workload.limit=2"), "executor=ray", "executor.num_replicas=3",
                      "executor.num_cpus_per_replica=0.5", "executor.batch_size=1")
    result = run_job(cfg, tmp_path)
    got, n = _by_id(result.files["generations"])
    assert n == 2 and set(got) == {("q0", 0), ("q1", 1)}
    assert sorted(p.name for p in (tmp_path / "replicas").iterdir() if p.is_dir()) == ["r0", "r1"]  # r2 not started
    # the merged file is an ordinary run directory for executor=local, which resumes it ...
    local = run_job(compose_cfg(*_args(mixed_parquet, "workload.limit=3")), tmp_path, engine=engine)
    assert local.summary["requests"] == 3 and local.summary["resumed"] == 2
    # ... after which a ray merge (of the replicas' 2 rows) would drop the local row: refused
    with pytest.raises(ConfigError, match="resumed with executor=local"):
        run_job(cfg, tmp_path)
    empty = run_job(compose_cfg(*_args(mixed_parquet, "workload.limit=0"), *RAY), tmp_path / "empty")
    assert empty.summary["requests"] == 0 and pq.read_table(empty.files["generations"]).num_rows == 0


def test_a_local_run_directory_is_not_resumed_by_ray(mixed_parquet, engine, tmp_path):
    run_job(compose_cfg(*_args(mixed_parquet, "workload.limit=3")), tmp_path, engine=engine)
    with pytest.raises(ConfigError, match="holds an executor=local run"):
        run_job(compose_cfg(*_args(mixed_parquet, "workload.limit=3"), *RAY), tmp_path)


@pytest.mark.parametrize("over,msg", [
    (["executor.num_cpus_per_replica=3"], r"num_cpus_per_replica=3.0 is more than any node .* \(2 CPUs\)"),
    (["executor.num_replicas=3", "executor.num_cpus_per_replica=1"], r"num_replicas=3 x .* = 3 CPUs, the Ray cluster has 2"),
    (["executor.num_gpus_per_replica=1", "model.device=auto"], r"num_gpus_per_replica=1.0 is more than any node"),
])
def test_replicas_that_cannot_fit_the_cluster_are_config_errors(mixed_parquet, tmp_path, over, msg):
    with pytest.raises(ConfigError, match=msg):
        run_job(compose_cfg(*_args(mixed_parquet), *RAY, *over), tmp_path)
    assert not (tmp_path / "replicas").exists()  # nothing pinned: the fixed command may use another routing


def test_n_samples_and_logprobs_through_the_merge_when_a_replica_wrote_only_error_rows(tmp_path):
    """Replica 1's share is all bad rows (its logprob columns hold only nulls): the merged file keeps the
    typed list columns, and the summary counts requests and samples over both replicas."""
    path = tmp_path / "p.parquet"
    prompts = [PROMPTS[i] for i in range(4)] + [None] * 4  # blocks of 4: replica 1 gets the 4 nulls
    pq.write_table(pa.table({"prompt": pa.array(prompts, pa.string())}), path)
    cfg = compose_cfg("workload=parquet", f"workload.path={path}", "sampling.n=2", "sampling.seed=0",
                      "sampling.temperature=1.0", "sampling.logprobs=1", "sampling.max_tokens=2", "executor=ray",
                      "executor.num_replicas=2", "executor.num_cpus_per_replica=0.5", "executor.batch_size=4")
    result = run_job(cfg, tmp_path / "out")
    t = pq.read_table(result.files["generations"])
    assert t.schema.field("logprobs").type == pa.list_(pa.float32())
    assert t.schema.field("sample_index").type == pa.int32()
    rows = t.to_pylist()
    assert sorted((r["id"], r["sample_index"]) for r in rows if r["error"] is None) == \
        [(str(i), k) for i in range(4) for k in range(2)]
    assert sorted(r["id"] for r in rows if r["error"] is not None) == ["4", "5", "6", "7"]
    assert all(len(r["logprobs"]) == r["output_tokens"] for r in rows if r["error"] is None)
    s = result.summary
    assert (s["requests"], s["samples"], s["completed"], s["errors"]) == (8, 12, 4, 4)
    assert s["latency_s"]["ttft"]["count"] == 8 and [r["requests"] for r in s["replicas"]] == [4, 4]
