"""Sinks write row groups and finalise atomically; the summary statistics are exact on known data."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ladle.runner.durable import recover
from ladle.runner.report import distribution, format_table, itl_gaps, summarize
from ladle.runner.sinks import (
    STEPS_SCHEMA,
    ParquetSink,
    generations_schema,
    previous_attempts,
    previous_batches,
    tmp_path,
)


def gen_row(i: int, times: list[float], arrival: float = 0.0, reason: str = "length", attempt: int = 0) -> dict:
    return {"id": f"r{i}", "index": i, "prompt_tokens": 10, "output_text": "x" * len(times),
            "output_token_ids": list(range(len(times))), "output_tokens": len(times), "finish_reason": reason,
            "error": "bad" if reason == "error" else None, "arrival_s": arrival,
            "first_scheduled_s": arrival if times else None, "first_token_s": times[0] if times else None,
            "finish_s": times[-1] if times else arrival, "token_times_s": times,
            "ttft_s": times[0] - arrival if times else None,
            "tpot_s": (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None,
            "e2e_s": times[-1] - arrival if times else None, "num_prefill_chunks": 1, "num_preemptions": 0,
            "num_cached_tokens": 2, "attempt": attempt}


def test_sink_row_groups_and_atomic_finalise(tmp_path):
    path = tmp_path / "g.parquet"
    sink = ParquetSink(path, generations_schema(False), 3, {b"ladle.config": b"a: 1\n"})
    for i in range(7):
        sink.write(gen_row(i, [0.1, 0.2]))
        assert not path.exists()  # only the .tmp exists until close
    assert tmp_path.joinpath("g.parquet.tmp").exists()
    sink.close()
    sink.close()  # idempotent
    pf = pq.ParquetFile(path)
    assert pf.metadata.num_rows == 7 and pf.metadata.num_row_groups == 3
    assert pf.schema_arrow.metadata[b"ladle.config"] == b"a: 1\n"
    assert "prompt" not in pf.schema_arrow.names and not tmp_path.joinpath("g.parquet.tmp").exists()


def test_interrupted_writer_leaves_readable_file(tmp_path):
    path = tmp_path / "g.parquet"
    sink = ParquetSink(path, generations_schema(True), 2, {})
    with pytest.raises(KeyboardInterrupt):
        try:
            for i in range(5):
                sink.write(gen_row(i, [0.1]))
            raise KeyboardInterrupt
        finally:
            sink.close()
    assert pq.read_table(path).num_rows == 5


def test_recover_and_previous_rows(tmp_path):
    path = tmp_path / "g.parquet"
    rows = [gen_row(0, [1.0]), gen_row(1, [], reason="error"), gen_row(0, [2.0]), gen_row(2, [3.0], attempt=1)]
    pq.write_table(pa.Table.from_pylist(rows, schema=generations_schema(True)), path)
    got = pa.concat_tables(previous_batches(path, True)).to_pylist()
    assert [r["id"] for r in got] == ["r0", "r1", "r2"] and got[0]["token_times_s"] == [1.0]
    assert [r["id"] for r in pa.concat_tables(previous_batches(path, True, skip_errors=True)).to_pylist()] == [
        "r0", "r2"]
    assert previous_attempts(path) == 2 and previous_attempts(tmp_path / "none.parquet") == 0
    # A cut-off .tmp (killed mid-write) is removed; a complete one (died before its rename) replaces the file.
    tmp_path.joinpath("g.parquet.tmp").write_bytes(b"PAR1 garbage")
    recover(path)
    assert not tmp_path_exists(path) and pq.read_table(path).num_rows == 4
    pq.write_table(pa.Table.from_pylist(rows[:1], schema=generations_schema(True)), tmp_path / "g.parquet.tmp")
    recover(path)
    assert not tmp_path_exists(path) and pq.read_table(path).num_rows == 1


def tmp_path_exists(path):
    return tmp_path(path).exists()


def test_sink_copies_old_rows_into_a_new_schema(tmp_path):
    path = tmp_path / "g.parquet"
    old = pa.Table.from_pylist([gen_row(0, [1.0])], schema=generations_schema(True))
    sink = ParquetSink(path, generations_schema(False), 10, {})
    sink.write_table(old.drop_columns(["attempt"]))
    sink.write(gen_row(1, [2.0], attempt=1))
    sink.close()
    t = pq.read_table(path)
    assert t.column("id").to_pylist() == ["r0", "r1"] and t.column("attempt").to_pylist() == [None, 1]
    assert "prompt" not in t.schema.names


def test_itl_gaps_exclude_request_boundaries():
    arr = pa.chunked_array([pa.array([[0.0, 1.0, 3.0], [], None, [10.0], [20.0, 20.5]], pa.list_(pa.float64()))])
    assert itl_gaps(arr).tolist() == [1.0, 2.0, 0.5]
    sliced = pa.chunked_array([pa.array([[5.0, 6.0], [0.0, 1.0, 3.0], [7.0, 9.0]], pa.list_(pa.float64())).slice(1)])
    assert itl_gaps(sliced).tolist() == [1.0, 2.0, 2.0]


def test_distribution_percentiles():
    d = distribution(np.arange(1, 101, dtype=float))
    assert d["count"] == 100 and d["mean"] == 50.5 and d["max"] == 100.0
    assert d["p50"] == pytest.approx(50.5) and d["p90"] == pytest.approx(90.1) and d["p99"] == pytest.approx(99.01)
    assert distribution(np.array([np.nan]))["p50"] is None


def test_summarize_known_run(tmp_path):
    rows = [gen_row(0, [1.0, 1.5, 2.0], arrival=0.5), gen_row(1, [2.0, 4.0], arrival=1.0),
            gen_row(2, [], arrival=1.0, reason="error"), gen_row(3, [10.0, 11.0], arrival=9.0, attempt=1)]
    gp, sp = tmp_path / "g.parquet", tmp_path / "s.parquet"
    pq.write_table(pa.Table.from_pylist(rows, schema=generations_schema(False)), gp)
    steps = [{"attempt": 0, "step": i, "start_s": float(i), "duration_s": 0.5, "decode_tokens": 1, "prefill_tokens": 2,
              "prefill_requests": 1, "running": 1, "waiting": 0, "kv_blocks_used": k, "cached_prompt_tokens": 0,
              "num_forwards": 1, "arrived": 0, "scheduled_ids": ["r0"], "scheduled_tokens": [3], "preempted": [],
              "failed": []} for i, k in enumerate([3, 9, 4])]
    pq.write_table(pa.Table.from_pylist(steps, schema=STEPS_SCHEMA), sp)
    s = summarize(gp, sp, {"kv_blocks_total": 12, "model": "m"})
    assert s["requests"] == 4 and s["completed"] == 3 and s["errors"] == 1
    assert s["finish_reasons"] == {"error": 1, "length": 3}
    assert s["duration_s"] == pytest.approx((4.0 - 0.5) + (11.0 - 9.0))  # per attempt: last finish - first arrival
    assert s["throughput"]["output_tokens_per_s"] == pytest.approx(7 / 5.5)
    assert s["throughput"]["input_tokens_per_s"] == pytest.approx(30 / 5.5)
    assert s["latency_s"]["itl"]["count"] == 4 and s["latency_s"]["itl"]["max"] == 2.0
    assert s["latency_s"]["ttft"]["mean"] == pytest.approx((0.5 + 1.0 + 1.0) / 3)
    assert s["latency_s"]["e2e"]["max"] == pytest.approx(3.0)
    assert s["prefix_cache_hit_rate"] == pytest.approx(6 / 30)
    assert s["steps"]["kv_blocks_peak"] == 9 and s["kv_peak_fraction"] == 0.75
    assert s["attempts"] == 2
    table = format_table(s)
    for word in ("TTFT", "ITL", "TPOT", "E2E", "req/s", "peak KV", "9 / 12", "prefix cache", "errors"):
        assert word in table
    json.dumps(s)
