"""Arrivals relative to the machine (`load`), request classes, and what the sweep report says."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from ladle.runner.calibration import Calibration
from ladle.runner.config import ConfigError, check, to_job_config
from ladle.runner.job import run_job
from ladle.runner.sweep import answers
from tests.runner.conftest import compose_cfg

FAST_CHUNKED = ["experiment=chunked_prefill", "workload.synthetic.groups.0.max_tokens=48",
                "workload.synthetic.groups.1.num_requests=3", "workload.synthetic.groups.1.prompt_len=600",
                "workload.synthetic.groups.1.min_prompt_len=400", "workload.synthetic.groups.1.max_prompt_len=800",
                "chunking.size=64", "cache.max_model_len=1024"]


def test_calibrated_rate_is_recorded_and_long_prompts_overlap_running_decodes(tmp_path):
    run = run_job(compose_cfg(*FAST_CHUNKED), tmp_path / "r")
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    cal = summary["arrival_calibration"]
    assert cal["prefill_tokens"] > 0 and cal["prefill_s"] > 0 and cal["decode_step_s"] > 0
    lengths = [r["prompt_tokens"] for r in pq.read_table(tmp_path / "r" / "generations.parquet").to_pylist()
               if r["class"] == "long"]
    expected = 0.7 / (sum(lengths) / len(lengths) * cal["prefill_s_per_token"])
    assert cal["rates_per_s"]["long"] == pytest.approx(expected, rel=1e-6)
    steps = pq.read_table(tmp_path / "r" / "steps.parquet").to_pylist()
    gen = {r["id"]: r for r in pq.read_table(tmp_path / "r" / "generations.parquet").to_pylist()}
    long_ids = {i for i in gen if gen[i]["class"] == "long"}
    mixed = [s for s in steps if s["decode_tokens"] and set(s["scheduled_ids"]) & long_ids and s["prefill_tokens"]]
    assert mixed, "no step carried decode tokens beside a long prompt's chunk"
    assert run.summary["complete"]


def test_a_sweep_shares_one_calibration(tmp_path):
    """The runs of a sweep replay identical arrivals: the second run reads the first one's calibration."""
    shared = tmp_path / "calibration.json"
    a = run_job(compose_cfg(*FAST_CHUNKED), tmp_path / "a", calibration_path=shared)
    b = run_job(compose_cfg(*FAST_CHUNKED, "chunking.size=32"), tmp_path / "b", calibration_path=shared)
    assert a.summary["arrival_calibration"] == b.summary["arrival_calibration"]
    arrivals = [{r["id"]: r["arrival_s"] for r in pq.read_table(d / "generations.parquet").to_pylist()}
                for d in (tmp_path / "a", tmp_path / "b")]
    assert arrivals[0] == arrivals[1]


def test_rate_follows_the_calibration():
    cal = Calibration("k", prefill_tokens=500, prefill_s=0.5, decode_batch=8, decode_step_s=0.01)
    assert cal.prefill_s_per_token == pytest.approx(1e-3)
    assert cal.rate(0.7, 1000) == pytest.approx(0.7)  # a 1-second prefill, 70% busy: 0.7 per second


@pytest.mark.parametrize("overrides,needle", [
    (["workload.arrivals.process=offline", "+workload.arrivals.load=0.5"], "needs workload.arrivals.process"),
    (["workload.arrivals.process=poisson", "+workload.arrivals.load=0"], "must be > 0"),
    (["workload.class_column=null"], "workload.class_arrivals needs workload.class_column"),
])
def test_load_and_class_arrivals_are_checked(overrides, needle):
    with pytest.raises(ConfigError, match=needle):
        check(to_job_config(compose_cfg("workload=sample", *overrides)))


def test_sample_workload_documents_arrive_by_load_and_have_their_class(tmp_path):
    run_job(compose_cfg("workload=sample", "workload.limit=null", "sampling.max_tokens=4"), tmp_path / "s")
    rows = pq.read_table(tmp_path / "s" / "generations.parquet").to_pylist()
    docs = [r for r in rows if r["class"] == "document"]
    short = [r for r in rows if r["class"] == "short"]
    assert len(docs) == 8 and len(short) == 40
    assert all(r["arrival_s"] == 0.0 for r in short) and len({r["arrival_s"] for r in docs}) == 8
    assert min(r["prompt_tokens"] for r in docs) > 2000
    summary = json.loads((tmp_path / "s" / "summary.json").read_text())
    assert set(summary["arrival_calibration"]["rates_per_s"]) == {"document"}


def test_sweep_answers_name_the_best_runs_and_the_knee():
    rows = [
        {"varied": "chunking.size=128", "run": "0", "chunk_size": 128, "itl_p99_ms": 20.0, "ttft_p50_ms": 90.0,
         "busy_tok_per_s": 960.0},
        {"varied": "chunking.size=512", "run": "1", "chunk_size": 512, "itl_p99_ms": 60.0, "ttft_p50_ms": 80.0,
         "busy_tok_per_s": 990.0},
        {"varied": "chunking.size=1024", "run": "2", "chunk_size": 1024, "itl_p99_ms": 120.0, "ttft_p50_ms": 70.0,
         "busy_tok_per_s": 1000.0},
    ]
    lines = answers(rows)
    assert lines[0].startswith("- Best P99 ITL: `chunking.size=128`")
    assert lines[1].startswith("- Best TTFT p50: `chunking.size=1024`")
    assert lines[2].startswith("- Best throughput: `chunking.size=1024`")
    assert lines[3].startswith("- Knee: chunking.size=128")  # 960 is within 5% of 1000
    rows[0]["busy_tok_per_s"] = 900.0  # 10% below: the knee moves to 512
    assert answers(rows)[3].startswith("- Knee: chunking.size=512")


def _engine(*overrides):
    from ladle.runner.executors.local import make_engine

    return make_engine(to_job_config(compose_cfg(*overrides)))


def test_calibration_key_changes_with_what_changes_speed():
    """A sweep over model shape, threads or max_model_len must not reuse another shape's timing."""
    import torch

    from ladle.runner.calibration import engine_key

    base = _engine()
    same = _engine("seed=7")  # weights' values do not change speed
    assert engine_key(base) == engine_key(same)
    assert engine_key(_engine("model.architecture.num_hidden_layers=2")) != engine_key(base)
    assert engine_key(_engine("cache.max_model_len=128")) != engine_key(base)
    key, threads = engine_key(base), torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        assert engine_key(base) != key
    finally:
        torch.set_num_threads(threads)


def test_a_resumed_run_replays_the_calibration_it_started_with(tmp_path, monkeypatch):
    from ladle.runner import calibration

    first = run_job(compose_cfg(*FAST_CHUNKED), tmp_path / "r")
    stored = json.loads((tmp_path / "r" / "calibration.json").read_text())
    assert [v["prefill_s"] for v in stored.values()] == [first.summary["arrival_calibration"]["prefill_s"]]

    def no_recalibration(eng):
        raise AssertionError("a resumed run measured the machine again")

    monkeypatch.setattr(calibration, "calibrate", no_recalibration)
    again = run_job(compose_cfg(*FAST_CHUNKED), tmp_path / "r")
    assert again.summary["arrival_calibration"] == first.summary["arrival_calibration"]
    with pytest.raises(AssertionError, match="measured the machine again"):  # a fresh start measures anew
        run_job(compose_cfg(*FAST_CHUNKED, "output.resume=false"), tmp_path / "r")
