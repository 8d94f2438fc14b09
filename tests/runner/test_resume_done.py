"""Resume's notion of "done" is one function, `ResumeState.progress`: a test per case.

A row is done when all n of its samples were written (a sample's error row counts as written), or when
its one row is the error of the whole request (sample 0, no token: it failed before its prompt forked
into samples). A repeated id's row, and a row with no id of its own, is done when its error row (found
by id and row index) was written.
"""

from __future__ import annotations

import dataclasses

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ladle.runner.config import OutputConfig
from ladle.runner.job import run_job
from ladle.runner.resume import Progress, ResumeState
from ladle.runner.sinks import generations_schema
from ladle.runner.sources.rows import duplicate_id_error
from tests.runner.conftest import compose_cfg
from tests.runner.fake_engine import FakeEngine


def row(rid, index, k=0, error=None, tokens=1):
    return {"id": rid, "index": index, "sample_index": k, "finish_reason": "error" if error else "length",
            "error": error, "output_tokens": tokens}


def state(tmp_path, rows, **output) -> ResumeState:
    path = tmp_path / "generations.parquet"
    pq.write_table(pa.Table.from_pylist(rows, schema=generations_schema(True)), path)
    return ResumeState.read(path, tmp_path / "steps.parquet", OutputConfig(**output))


def test_all_samples_written(tmp_path):
    s = state(tmp_path, [row("a", 0, k) for k in range(3)])
    assert s.progress("a", 0, 3, False) == Progress(True, frozenset({0, 1, 2}))
    assert s.progress("a", 0, 2, False).done  # a lower n later: still all written
    assert not s.progress("a", 0, 4, False).done


def test_some_samples_written_runs_only_the_others(tmp_path):
    s = state(tmp_path, [row("a", 0, 0), row("a", 0, 2)])
    assert s.progress("a", 0, 3, False) == Progress(False, frozenset({0, 2}))
    assert s.progress("b", 1, 3, False) == Progress(False, frozenset())  # nothing written


def test_an_error_row_for_the_whole_request_before_the_fork_is_done_whatever_n(tmp_path):
    s = state(tmp_path, [row("a", 0, 0, error="prompt too long", tokens=0)])
    for n in (1, 3, 1024):
        assert s.progress("a", 0, n, False) == Progress(True, frozenset())


def test_error_rows_per_sample_after_the_fork_count_for_their_sample_only(tmp_path):
    s = state(tmp_path, [row("a", 0, 0), row("a", 0, 1, error="step failed", tokens=2)])
    assert s.progress("a", 0, 3, False) == Progress(False, frozenset({0, 1}))
    # sample 0 failing after the fork drew its first token: its lone error row is its own
    s = state(tmp_path, [row("b", 0, 0, error="step failed", tokens=1)])
    assert s.progress("b", 0, 3, False) == Progress(False, frozenset({0}))


def test_repeated_ids_are_told_apart_by_row_index(tmp_path):
    dup = duplicate_id_error("x", "key")
    s = state(tmp_path, [row("x", 2, 0, error=dup, tokens=0), row("x", 0, 0), row("y", 1, 0)])
    assert s.progress("x", 2, 3, True) == Progress(True, frozenset())  # the repeat: its error row is there
    assert s.progress("x", 4, 3, True) == Progress(False, frozenset())  # another repeat, not written yet
    # the id's own row: the repeat's error row never makes it look done, nor counts as its sample 0
    assert s.progress("x", 0, 1, False) == Progress(True, frozenset({0}))
    assert s.progress("x", 0, 2, False) == Progress(False, frozenset({0}))


def test_rows_without_an_id_of_their_own_are_told_apart_by_row_index(tmp_path):
    s = state(tmp_path, [row(None, 3, 0, error="line 4 is not valid JSON", tokens=0),
                         row(None, 5, 0, error="line 6 has no custom_id", tokens=0)])
    assert s.progress(None, 3, 1, False).done and s.progress(None, 5, 1, False).done
    assert not s.progress(None, 4, 1, False).done


def test_retry_errors_and_no_resume(tmp_path):
    rows = [row("a", 0, 0, error="boom", tokens=0), row("b", 1, 0)]
    assert not state(tmp_path, rows, retry_errors=True).progress("a", 0, 1, False).done
    assert state(tmp_path, rows, retry_errors=True).progress("b", 1, 1, False).done
    assert not state(tmp_path, rows, resume=False).progress("b", 1, 1, False).done


class FailSampleZeroTokenless:
    """Sample 0 of every request fails right after the fork with no token in its output (the ambiguous
    case: a whole request failing before its fork looks the same); Ctrl-C arrives during step
    `interrupt_at` (None: never)."""

    def __init__(self, eng, interrupt_at=None):
        self.eng, self.interrupt_at, self.steps = eng, interrupt_at, 0

    def __getattr__(self, name):
        return getattr(self.eng, name)

    def step(self):
        self.steps += 1
        if self.interrupt_at is not None and self.steps >= self.interrupt_at:
            raise KeyboardInterrupt
        outs = []
        for o in self.eng.step():
            if o.sample_index == 0 and o.finish_reason != "error":
                self.eng.running = [r for r in self.eng.running if not (r.id == o.request_id and r.sample_index == 0)]
                o = dataclasses.replace(o, output_token_ids=[], text="", finished=True, finish_reason="error",
                                        error="sample failed")
            outs.append(o)
        return outs


def rows_of(out):
    return sorted((r["id"], r["sample_index"], r["error"]) for r in pq.read_table(out / "generations.parquet").to_pylist())


@pytest.fixture
def n3(tmp_path):
    src = tmp_path / "p.parquet"
    pq.write_table(pa.table({"prompt": ["aa", "bb"]}), src)
    return compose_cfg("workload=parquet", f"workload.path={src}", "sampling.n=3", "sampling.max_tokens=6")


def test_a_tokenless_failure_of_sample_0_after_the_fork_then_a_crash_never_skips_its_siblings(tmp_path, n3):
    """Sample 0's error row was written at once; the run stopped before its siblings finished; resume took
    the lone tokenless sample-0 error for a failure before the fork (all n done) and never ran them."""
    out = tmp_path / "out"
    first = run_job(n3, out, engine=FailSampleZeroTokenless(FakeEngine(), interrupt_at=4))
    assert first.interrupted
    run_job(n3, out, engine=FakeEngine())
    got = rows_of(out)
    assert [(rid, k) for rid, k, _ in got] == [(i, k) for i in ("0", "1") for k in range(3)], got


def test_a_tokenless_failure_of_sample_0_after_the_fork_is_written_once_its_siblings_are(tmp_path, n3):
    out = tmp_path / "out"
    res = run_job(n3, out, engine=FailSampleZeroTokenless(FakeEngine()))
    assert rows_of(out) == [(i, k, "sample failed" if k == 0 else None) for i in ("0", "1") for k in range(3)]
    assert res.summary["samples"] == 6
    again = run_job(n3, out, engine=FakeEngine())  # complete: nothing runs again
    assert again.summary["resumed"] == 2 and len(rows_of(out)) == 6


def test_a_request_the_engine_rejects_before_it_ever_runs_is_written_at_once(tmp_path):
    """The unambiguous case needs no waiting: a request never scheduled cannot have forked."""
    src = tmp_path / "p.parquet"
    pq.write_table(pa.table({"prompt": ["y" * 100, "ok"]}), src)
    cfg = compose_cfg("workload=parquet", f"workload.path={src}", "sampling.n=3")
    out = tmp_path / "out"
    first = run_job(cfg, out, engine=_InterruptAfter(FakeEngine(max_model_len=64), 1))
    assert first.interrupted and rows_of(out) == [("0", 0, rows_of(out)[0][2])] and rows_of(out)[0][2]
    run_job(cfg, out, engine=FakeEngine(max_model_len=64))
    assert [(rid, k) for rid, k, _ in rows_of(out)] == [("0", 0), ("1", 0), ("1", 1), ("1", 2)]


class _InterruptAfter:
    def __init__(self, eng, n):
        self.eng, self.n = eng, n

    def __getattr__(self, name):
        return getattr(self.eng, name)

    def step(self):
        self.n -= 1
        if self.n < 0:
            raise KeyboardInterrupt
        return self.eng.step()
