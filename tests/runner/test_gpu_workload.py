"""The GPU long-document scenario (conf/experiment/gpu_long_documents.yaml): its shape at full size, and a
run of it on the CPU with the tiny model, scaled down by overrides, so the file keeps composing and running
wherever the GPU sweep has not run lately."""

from __future__ import annotations

import json

import pyarrow.parquet as pq

from ladle.runner.config import to_job_config
from ladle.runner.job import run_job
from tests.runner.conftest import compose_cfg

TINY = ["experiment=gpu_long_documents", "workload.synthetic.groups.0.num_requests=4",
        "workload.synthetic.groups.0.max_tokens=40", "workload.synthetic.groups.1.num_requests=2",
        "workload.synthetic.groups.1.prompt_len=300", "workload.synthetic.groups.1.min_prompt_len=200",
        "workload.synthetic.groups.1.max_prompt_len=400", "chunking.size=64", "cache.max_model_len=512"]


def test_documents_are_long_enough_to_stall_a_gpu_and_arrive_by_load():
    """8k-32k-token documents with device-calibrated arrivals beside running decode streams."""
    w = to_job_config(compose_cfg("experiment=gpu_long_documents")).workload
    stream, document = w.synthetic.groups
    assert stream.arrival is None and stream.num_requests >= 32 and stream.max_tokens >= 512
    assert document.min_prompt_len == 8192 and document.max_prompt_len == 32000
    assert 8192 <= document.prompt_len <= 32000
    assert document.arrival.process == "poisson" and document.arrival.load == 0.5
    assert w.arrivals.process == "trace"


def test_the_workload_runs_tiny_on_the_cpu(tmp_path):
    """Scaled down, every row completes, documents' chunks share steps with running streams, and the
    calibrated rate is recorded."""
    run = run_job(compose_cfg(*TINY), tmp_path / "r")
    assert run.summary["complete"]
    gen = pq.read_table(tmp_path / "r" / "generations.parquet").to_pylist()
    assert len(gen) == 6 and not any(r["error"] for r in gen)
    documents = {r["id"] for r in gen if r["class"] == "document"}
    assert len(documents) == 2 and all(200 <= r["prompt_tokens"] <= 400 for r in gen if r["id"] in documents)
    steps = pq.read_table(tmp_path / "r" / "steps.parquet").to_pylist()
    assert any(s["decode_tokens"] and s["prefill_tokens"] and set(s["scheduled_ids"]) & documents for s in steps)
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["arrival_calibration"]["rates_per_s"]["document"] > 0
