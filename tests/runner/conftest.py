"""Runner test fixtures: composed configs, small datasets of every kind, one shared tiny engine, and
`check_run`, which reads a run directory back and checks every column against every other."""

from __future__ import annotations

import json
import math
from itertools import pairwise
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from ladle.runner.config import CONF_DIR, register_configs, to_job_config

register_configs()

# Small and fast: short generations, small chunks (so prompts take several prefill chunks).
BASE = [
    "max_num_seqs=4",
    "cache.max_model_len=256",
    "sampling.max_tokens=4",
    "chunking.size=16",
    "output.plots=false",
    "output.progress=false",
    "output.print_summary=false",
]

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Summarise: the cat sat on the mat and slept all afternoon in the sun.",
    "Why do leaves change colour in autumn?",
    "List three prime numbers.",
    "Translate 'good morning' into Spanish.",
    "Explain gravity in one sentence.",
    "How many legs does a spider have?",
]


def compose_cfg(*overrides: str) -> DictConfig:
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=[*BASE, *overrides])


@pytest.fixture(scope="session")
def engine():
    """One tiny engine for the tests whose engine config is BASE's (each run leaves it empty)."""
    from ladle.runner.executors.local import make_engine

    return make_engine(to_job_config(compose_cfg()))


@pytest.fixture(scope="session")
def datasets_dir(tmp_path_factory) -> Path:
    """PROMPTS in every supported storage: parquet file/dir, arrow file, HF save_to_disk, jsonl, tokens, chat."""
    import datasets

    d = tmp_path_factory.mktemp("data")
    n = len(PROMPTS)
    table = pa.table({
        "qid": [f"q{i}" for i in range(n)],
        "question": PROMPTS,
        "max_tokens": pa.array([None, 2, None, 3, None, None, 1, None], pa.int64()),
        "arrival_ms": [0.0, 5.0, 5.0, 40.0, 41.0, 300.0, 301.0, 1000.0],
        "tokens": pa.array([list(p.encode()) for p in PROMPTS], pa.list_(pa.int32())),
        "messages": [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": p}] for p in PROMPTS],
    })
    pq.write_table(table, d / "prompts.parquet", row_group_size=3)
    (d / "parts").mkdir()
    pq.write_table(table.slice(0, 5), d / "parts" / "part-0.parquet")
    pq.write_table(table.slice(5), d / "parts" / "part-1.parquet")
    with pa.ipc.new_file(d / "prompts.arrow", table.schema) as w:
        for b in table.to_batches(max_chunksize=3):
            w.write_batch(b)
    datasets.Dataset(table).save_to_disk(str(d / "hf"))
    (d / "prompts.jsonl").write_text("".join(json.dumps(row) + "\n" for row in table.to_pylist()))
    return d


def read(out: Path, name: str = "generations.parquet") -> pa.Table:
    return pq.read_table(out / name)


def check_run(out: Path, expected_ids: list[str] | None = None, errors: int = 0,
              interrupted: tuple[int, ...] = ()) -> dict[str, Any]:
    """Read a run directory back and check the generations, steps and summary against each other.

    `interrupted`: attempts that were cut short (their aborted requests have steps but no row).
    """
    out = Path(out)
    assert not list(out.glob("*.tmp")), "a .tmp file was left behind"
    gen, steps = read(out), read(out, "steps.parquet")
    assert b"ladle.config" in gen.schema.metadata and b"ladle.config" in steps.schema.metadata
    assert gen.schema.field("output_token_ids").type == pa.list_(pa.int32())
    assert gen.schema.field("token_times_s").type == pa.list_(pa.float64())
    assert steps.schema.field("scheduled_ids").type == pa.list_(pa.string())
    assert steps.schema.field("scheduled_tokens").type == pa.list_(pa.int32())
    rows = gen.to_pylist()
    ids = [r["id"] for r in rows]
    assert len(ids) == len(set(ids)), "duplicate ids"
    if expected_ids is not None:
        assert sorted(ids) == sorted(expected_ids)
    bad = [r for r in rows if r["finish_reason"] == "error"]
    assert len(bad) == errors, [(r["id"], r["error"]) for r in bad]
    for r in bad:
        assert r["error"] and r["output_tokens"] == 0 and r["token_times_s"] == []
    ok = [r for r in rows if r["finish_reason"] != "error"]
    for r in ok:
        times = r["token_times_s"]
        n = r["output_tokens"]
        assert r["error"] is None
        assert r["finish_reason"] in ("stop", "length")
        assert n == len(r["output_token_ids"]) == len(times) >= 1
        assert all(b > a for a, b in pairwise(times)), "token times must increase"
        assert r["first_token_s"] == times[0] and r["finish_s"] == times[-1]
        assert math.isclose(r["ttft_s"], r["first_token_s"] - r["arrival_s"], abs_tol=1e-9)
        assert math.isclose(r["e2e_s"], r["finish_s"] - r["arrival_s"], abs_tol=1e-9)
        assert r["arrival_s"] <= r["first_scheduled_s"] < r["first_token_s"]
        if n > 1:
            assert math.isclose(r["tpot_s"], (times[-1] - times[0]) / (n - 1), rel_tol=1e-9)
        assert r["num_prefill_chunks"] >= 1 and r["num_preemptions"] == 0
        assert 0 <= r["num_cached_tokens"] < r["prompt_tokens"]
    # Steps: one row per engine step, consecutive, per attempt.
    srows = steps.to_pylist()
    for a in {s["attempt"] for s in srows}:
        nums = [s["step"] for s in srows if s["attempt"] == a]
        assert nums == list(range(nums[0], nums[0] + len(nums))), "one steps row per engine step"
    # Per-step token accounting adds up to the prompt and output tokens processed, attempt by attempt.
    # Requests in flight when an attempt was interrupted were aborted and recomputed by the next one.
    for s in srows:
        assert len(s["scheduled_ids"]) == len(s["scheduled_tokens"])
        assert sum(s["scheduled_tokens"]) == s["decode_tokens"] + s["prefill_tokens"] > 0
        assert s["duration_s"] > 0 and s["preempted"] == [] and s["failed"] == []
    for a in {s["attempt"] for s in srows}:
        a_steps = [s for s in srows if s["attempt"] == a]
        a_ok = [r for r in ok if r["attempt"] == a]
        per_req: dict[str, int] = {}
        for s in a_steps:
            for rid, k in zip(s["scheduled_ids"], s["scheduled_tokens"], strict=True):
                per_req[rid] = per_req.get(rid, 0) + k
        for r in a_ok:
            assert per_req.pop(r["id"]) == r["prompt_tokens"] - r["num_cached_tokens"] + r["output_tokens"] - 1
        if a in interrupted:
            continue
        assert not per_req, f"steps scheduled requests with no output row: {per_req}"
        assert sum(s["prefill_tokens"] for s in a_steps) == sum(r["prompt_tokens"] - r["num_cached_tokens"]
                                                              for r in a_ok)
        assert sum(s["decode_tokens"] for s in a_steps) == sum(r["output_tokens"] - 1 for r in a_ok)
        assert sum(s["cached_prompt_tokens"] for s in a_steps) == sum(r["num_cached_tokens"] for r in a_ok)
    # Start times never go back within an attempt.
    for a in {s["attempt"] for s in srows}:
        starts = [s["start_s"] for s in srows if s["attempt"] == a]
        assert all(b >= x for x, b in pairwise(starts))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["requests"] == len(rows) and summary["errors"] == errors
    assert summary["tokens"]["output"] == sum(r["output_tokens"] for r in ok)
    assert summary["steps"]["count"] == len(srows)
    if ok:
        assert summary["latency_s"]["ttft"]["count"] == len(ok)
        assert np.isclose(summary["latency_s"]["ttft"]["max"], max(r["ttft_s"] for r in ok))
    return {"rows": rows, "ok": ok, "steps": srows, "summary": summary}


class ModelLoaded(BaseException):
    """Raised by the model loader under `no_model_load` (a BaseException: no `except Exception` hides it)."""


@pytest.fixture
def no_model_load(monkeypatch):
    """Any model load fails the test: proves a config error comes before the model loads."""
    from ladle import models
    def load(*args, **kwargs):
        raise ModelLoaded("the model loader ran before the config error")

    monkeypatch.setattr(models, "load_model", load)


from tests.runner.s3_server import s3, s3_endpoint  # noqa: F401 - fixtures: an S3 API server (moto)
