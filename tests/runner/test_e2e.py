"""End to end on the tiny model: every source kind and arrival process, read back and cross-checked."""

from __future__ import annotations

import math

import numpy as np
import pytest

from ladle.runner.arrivals import arrival_times
from ladle.runner.config import ArrivalConfig
from ladle.runner.job import run_job
from tests.runner.conftest import PROMPTS, check_run, compose_cfg

IDS = [f"q{i}" for i in range(len(PROMPTS))]
ROW_IDS = [str(i) for i in range(len(PROMPTS))]

SOURCES = {
    "parquet_file": ("parquet", "prompts.parquet", "question", ["workload.id_column=qid"], IDS),
    "parquet_dir": ("parquet", "parts", "question", ["workload.id_column=qid"], IDS),
    "arrow": ("arrow", "prompts.arrow", "question", [], ROW_IDS),
    "hf_dataset": ("hf_dataset", "hf", "question", ["workload.id_column=qid"], IDS),
    "hf_data_files": ("hf_dataset", "prompts.jsonl", "question", ["workload.id_column=qid"], IDS),
    "jsonl": ("jsonl", "prompts.jsonl", "question", ["workload.id_column=qid"], IDS),
    "token_ids": ("parquet", "prompts.parquet", "tokens", ["workload.prompt_format=tokens"], ROW_IDS),
    "chat": ("parquet", "prompts.parquet", "messages", ["workload.id_column=qid"], IDS),
}


@pytest.mark.parametrize("name", list(SOURCES))
def test_source_kinds(name, engine, datasets_dir, tmp_path):
    kind, path, column, extra, ids = SOURCES[name]
    cfg = compose_cfg(f"workload={kind}", f"workload.path={datasets_dir / path}",
                      f"workload.prompt_column={column}", "workload.max_tokens_column=max_tokens", *extra)
    result = run_job(cfg, tmp_path, engine=engine)
    run = check_run(tmp_path, expected_ids=ids)
    assert result.summary["completed"] == len(PROMPTS)
    by_index = {r["index"]: r for r in run["rows"]}
    col_max = [None, 2, None, 3, None, None, 1, None]
    for i, r in by_index.items():
        assert r["arrival_s"] == 0.0  # offline
        assert r["output_tokens"] <= (col_max[i] or 4)
        if r["finish_reason"] == "length":
            assert r["output_tokens"] == (col_max[i] or 4)
        if column == "question":
            assert r["prompt"] == PROMPTS[i]
            assert r["prompt_tokens"] == len(PROMPTS[i].encode()) + 1  # bytes + <bos>
        elif column == "tokens":
            assert r["prompt"] is None and r["prompt_tokens"] == len(PROMPTS[i].encode())
        else:  # chat: the template adds role markers around both messages
            assert PROMPTS[i] in r["prompt"] and r["prompt_tokens"] > len(PROMPTS[i].encode()) + 10
    for r in run["ok"]:  # a step carries at most 16 tokens (the derived budget): what the cache did
        # not hold takes at least that many chunks, more when decodes share the steps
        assert r["num_prefill_chunks"] >= math.ceil((r["prompt_tokens"] - r["num_cached_tokens"]) / 16)


@pytest.mark.parametrize("process", ["poisson", "gamma", "trace"])
def test_arrival_processes(process, engine, datasets_dir, tmp_path):
    cfg = compose_cfg("workload=parquet", f"workload.path={datasets_dir / 'prompts.parquet'}",
                      "workload.prompt_column=question", "workload.id_column=qid",
                      f"workload.arrivals.process={process}", "workload.arrivals.rate=20",
                      "workload.arrivals.burstiness=0.5", "workload.arrivals.column=arrival_ms",
                      "workload.arrivals.unit=ms", "workload.arrivals.seed=7")
    run_job(cfg, tmp_path, engine=engine)
    run = check_run(tmp_path, expected_ids=IDS)
    arrivals = [r["arrival_s"] for r in sorted(run["rows"], key=lambda r: r["index"])]
    if process == "trace":
        expected = np.array([0.0, 5.0, 5.0, 40.0, 41.0, 300.0, 301.0, 1000.0]) / 1000
    else:
        expected = arrival_times(ArrivalConfig(process=process, rate=20, burstiness=0.5, seed=7), len(PROMPTS))
    np.testing.assert_allclose(arrivals, expected, rtol=0, atol=1e-9)
    # A request is never scheduled before it arrives.
    for r in run["ok"]:
        assert r["first_scheduled_s"] >= r["arrival_s"] - 1e-12


def test_virtual_clock_skips_idle_gaps(engine, datasets_dir, tmp_path):
    """Arrivals 100 s apart cost no waiting; latencies are compute time only."""
    import time

    cfg = compose_cfg("workload=parquet", f"workload.path={datasets_dir / 'prompts.parquet'}",
                      "workload.prompt_column=question", "workload.limit=3",
                      "workload.arrivals.process=trace", "workload.arrivals.column=arrival_ms",
                      "workload.arrivals.unit=s")
    t = time.perf_counter()
    result = run_job(cfg, tmp_path, engine=engine)
    assert time.perf_counter() - t < 60
    run = check_run(tmp_path, expected_ids=["0", "1", "2"])
    by = {r["id"]: r for r in run["rows"]}
    assert [by[i]["arrival_s"] for i in "012"] == pytest.approx([0.0, 5.0, 5.0], abs=1e-9)
    # Request 0 finished long before request 1 arrived: the clock jumped to 5 s, no idle step was run.
    assert by["0"]["finish_s"] < 4.0 and by["1"]["first_scheduled_s"] >= by["1"]["arrival_s"]
    later = [s for s in run["steps"] if s["start_s"] > 4.0]
    assert later and later[0]["start_s"] == pytest.approx(5.0, abs=1e-9)
    assert later[0]["arrived"] == 2 and len(run["steps"]) - len(later) == run["steps"].index(later[0])
    assert result.summary["duration_s"] == pytest.approx(max(r["finish_s"] for r in run["rows"]))
    assert by["1"]["ttft_s"] < 5.0


def test_bad_rows_become_error_rows(engine, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    prompts = ["Hello there.", None, "", "   ", "x" * 400, "Fine too.", "Last one."]
    pq.write_table(pa.table({"prompt": prompts}), tmp_path / "bad.parquet")
    tokens = pa.array([[72, 105], [10_000, 3], [], None], pa.list_(pa.int64()))
    pq.write_table(pa.table({"prompt": tokens}), tmp_path / "badtok.parquet")
    # null content is "" (as in vLLM), so only the empty conversation is an error
    msgs = [[{"role": "user", "content": "Hi"}], [{"role": "user", "content": None}], []]
    pq.write_table(pa.table({"prompt": msgs}), tmp_path / "badchat.parquet")
    for name, n_bad, ok_ids in (("bad", 4, ["0", "5", "6"]), ("badtok", 3, ["0"]), ("badchat", 1, ["0", "1"])):
        out = tmp_path / name
        cfg = compose_cfg("workload=parquet", f"workload.path={tmp_path / name}.parquet")
        result = run_job(cfg, out, engine=engine)
        run = check_run(out, errors=n_bad)
        assert sorted(r["id"] for r in run["ok"]) == ok_ids
        assert result.summary["errors"] == n_bad
    errors = {r["index"]: r["error"] for r in check_run(tmp_path / "bad", errors=4)["rows"] if r["error"]}
    assert "null" in errors[1] and "empty" in errors[2] and "empty" in errors[3]
    assert "max_model_len" in errors[4]  # the engine's message: 401 tokens + 4 > 256
    badtok = {r["index"]: r["error"] for r in check_run(tmp_path / "badtok", errors=3)["rows"] if r["error"]}
    assert "vocabulary" in badtok[1] and "empty" in badtok[2] and "null" in badtok[3]


def test_synthetic_prefix_caching(engine, tmp_path):
    """A shared preamble: later requests find it in the prefix cache; the accounting still adds up."""
    cfg = compose_cfg("experiment=prefix_caching", "workload.synthetic.groups.0.num_requests=6",
                      "workload.synthetic.groups.0.shared_prefix_len=64", "workload.synthetic.groups.0.max_tokens=4",
                      "workload.arrivals.rate=0.2")  # virtual time: long gaps cost nothing
    result = run_job(cfg, tmp_path, engine=engine)
    run = check_run(tmp_path, expected_ids=[f"q-{k}" for k in range(6)])
    assert all(r["output_tokens"] == 4 for r in run["ok"])  # ignore_eos: outputs run to max_tokens
    assert sum(r["num_cached_tokens"] for r in run["ok"]) >= 5 * 48
    assert result.summary["prefix_cache_hit_rate"] > 0.3
    assert not math.isnan(result.summary["latency_s"]["itl"]["p99"])


def test_resume_after_a_limited_run(engine, datasets_dir, tmp_path):
    """Run 3 rows, then all 8 into the same directory: the 3 are kept as they were, 5 are added."""
    import pyarrow.parquet as pq

    args = ["workload=parquet", f"workload.path={datasets_dir / 'prompts.parquet'}",
            "workload.prompt_column=question", "workload.id_column=qid"]
    run_job(compose_cfg(*args, "workload.limit=3"), tmp_path, engine=engine)
    first = {r["id"]: r for r in pq.read_table(tmp_path / "generations.parquet").to_pylist()}
    result = run_job(compose_cfg(*args), tmp_path, engine=engine)
    run = check_run(tmp_path, expected_ids=IDS)
    assert sorted(r["attempt"] for r in run["rows"]) == [0] * 3 + [1] * 5
    for r in run["rows"]:
        if r["attempt"] == 0:
            assert r == first[r["id"]]
    assert result.summary["resumed"] == 3 and result.summary["attempts"] == 2
    assert {s["attempt"] for s in run["steps"]} == {0, 1}
