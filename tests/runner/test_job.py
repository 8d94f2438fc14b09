"""The job loop on a stand-in engine (no model): bounded read-ahead, wall clock, resume details."""

from __future__ import annotations

import sys
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ladle.engine.clock import WallClock
from ladle.runner.config import to_job_config
from ladle.runner.job import run_job
from tests.runner.conftest import check_run, compose_cfg
from tests.runner.fake_engine import FakeEngine


def parquet(path, prompts, **cols):
    pq.write_table(pa.table({"prompt": prompts, **cols}), path)
    return path


def test_large_dataset_streams_with_bounded_pending(tmp_path):
    n = 3000
    src = parquet(tmp_path / "big.parquet", [f"prompt number {i}" for i in range(n)])
    cfg = compose_cfg("workload=parquet", f"workload.path={src}", "workload.batch_size=64", "max_pending=8",
                      "sampling.max_tokens=2", "output.row_group_size=500")
    eng = FakeEngine(max_num_seqs=4)
    result = run_job(cfg, tmp_path / "out", engine=eng)
    assert eng.max_waiting <= 8 - 0  # never more than max_pending requests read but unfinished
    t = pq.read_table(tmp_path / "out" / "generations.parquet", columns=["id", "output_tokens"])
    assert t.num_rows == n and len(set(t.column("id").to_pylist())) == n
    assert pq.ParquetFile(tmp_path / "out" / "generations.parquet").metadata.num_row_groups == n // 500
    assert result.summary["tokens"]["output"] == 2 * n


def test_wall_clock_waits_for_arrivals(tmp_path):
    src = parquet(tmp_path / "p.parquet", ["a", "b", "c"], t=[0.0, 0.15, 0.3])
    cfg = compose_cfg("workload=parquet", f"workload.path={src}", "workload.arrivals.process=trace",
                      "workload.arrivals.column=t", "clock=wall")
    start = time.perf_counter()
    run_job(cfg, tmp_path / "out", engine=FakeEngine(clock=WallClock()))
    assert time.perf_counter() - start >= 0.3
    rows = pq.read_table(tmp_path / "out" / "generations.parquet").to_pylist()
    for r in rows:
        assert r["first_scheduled_s"] >= r["arrival_s"] and r["ttft_s"] > 0


class InterruptAfter:
    """Wraps an engine; Ctrl-C arrives during its n-th step."""

    def __init__(self, eng, n):
        self.eng, self.n = eng, n

    def __getattr__(self, name):
        return getattr(self.eng, name)

    def step(self):
        self.n -= 1
        if self.n < 0:
            raise KeyboardInterrupt
        return self.eng.step()


def test_interrupt_then_resume(tmp_path):
    n = 30
    src = parquet(tmp_path / "p.parquet", [f"question {i}?" for i in range(n)])
    cfg = compose_cfg("workload=parquet", f"workload.path={src}", "output.row_group_size=4")
    out = tmp_path / "out"
    eng = FakeEngine(max_num_seqs=3)
    first = run_job(cfg, out, engine=InterruptAfter(eng, 25))
    assert first.interrupted and not first.summary["complete"]
    partial = pq.read_table(out / "generations.parquet")  # finalised with what was written
    assert 0 < partial.num_rows < n and not list(out.glob("*.tmp"))
    assert not eng.has_unfinished_requests()  # what was in flight was aborted
    second = run_job(cfg, out, engine=eng)
    assert second.summary["resumed"] == partial.num_rows and second.summary["complete"]
    run = check_run(out, expected_ids=[str(i) for i in range(n)], interrupted=(0,))
    by_attempt = {a: [r for r in run["rows"] if r["attempt"] == a] for a in (0, 1)}
    assert len(by_attempt[0]) == partial.num_rows and len(by_attempt[1]) == n - partial.num_rows
    old = {r["id"]: r for r in partial.to_pylist()}
    for r in by_attempt[0]:
        assert r == old[r["id"]]  # rows of the first run are kept as they were
    # A third run finds everything done.
    third = run_job(cfg, out, engine=eng)
    assert third.summary["resumed"] == n and pq.read_table(out / "generations.parquet").num_rows == n


def test_retry_errors_and_no_resume(tmp_path):
    src = parquet(tmp_path / "p.parquet", ["short", "y" * 100])
    out = tmp_path / "out"
    run_job(compose_cfg("workload=parquet", f"workload.path={src}"), out, engine=FakeEngine(max_model_len=64))
    check_run(out, errors=1)
    run_job(compose_cfg("workload=parquet", f"workload.path={src}"), out, engine=FakeEngine(max_model_len=512))
    check_run(out, errors=1)  # errored rows are finished rows: skipped on resume
    run_job(compose_cfg("workload=parquet", f"workload.path={src}", "output.retry_errors=true"), out,
            engine=FakeEngine(max_model_len=512))
    run = check_run(out, expected_ids=["0", "1"], errors=0)
    assert {r["id"]: r["attempt"] for r in run["rows"]} == {"0": 0, "1": 1}  # the 2nd run left no trace
    run_job(compose_cfg("workload=parquet", f"workload.path={src}", "output.resume=false"), out,
            engine=FakeEngine(max_model_len=512))
    assert {r["attempt"] for r in check_run(out, expected_ids=["0", "1"])["rows"]} == {0}


def test_duplicate_ids_and_bad_max_tokens(tmp_path):
    src = parquet(tmp_path / "p.parquet", ["a", "b", "c", "d"], key=["x", "y", "x", "z"],
                  mt=pa.array(["2", None, "1", "many"]))
    cfg = compose_cfg("workload=parquet", f"workload.path={src}", "workload.id_column=key",
                      "workload.max_tokens_column=mt")
    run_job(cfg, tmp_path / "out", engine=FakeEngine())
    rows = {r["index"]: r for r in pq.read_table(tmp_path / "out" / "generations.parquet").to_pylist()}
    assert rows[0]["output_tokens"] == 2 and rows[1]["output_tokens"] == 4
    assert "duplicate id 'x'" in rows[2]["error"] and "'many'" in rows[3]["error"]


@pytest.mark.parametrize("include_prompt", [True, False])
def test_plots_and_prompt_column(tmp_path, include_prompt, capsys):
    src = parquet(tmp_path / "p.parquet", ["hello", "world"])
    cfg = compose_cfg("workload=parquet", f"workload.path={src}", "output.plots=true",
                      "output.print_summary=true", f"output.include_prompt={include_prompt}")
    result = run_job(cfg, tmp_path / "out", engine=FakeEngine())
    for name in ("schedule.png", "latency.png"):
        assert (tmp_path / "out" / name).read_bytes()[:4] == b"\x89PNG"
    names = pq.read_schema(tmp_path / "out" / "generations.parquet").names
    assert ("prompt" in names) == include_prompt
    printed = capsys.readouterr().out
    assert "TTFT" in printed and str(result.out_dir.resolve()) in printed


def test_resume_with_another_config_warns(tmp_path, caplog):
    src = parquet(tmp_path / "p.parquet", ["a", "b", "c"])
    out = tmp_path / "out"
    run_job(compose_cfg("workload=parquet", f"workload.path={src}", "workload.limit=1"), out, engine=FakeEngine())
    run_job(compose_cfg("workload=parquet", f"workload.path={src}", "workload.limit=2"), out, engine=FakeEngine())
    assert "different" not in caplog.text  # reading further is what resuming is for
    run_job(compose_cfg("workload=parquet", f"workload.path={src}", "sampling.max_tokens=2"), out,
            engine=FakeEngine())
    assert "other settings (sampling.max_tokens: 4 -> 2)" in caplog.text
    check_run(out, expected_ids=["0", "1", "2"])
    caplog.clear()  # engine settings change the rows too (before: only model, sampling, workload were compared)
    run_job(compose_cfg("workload=parquet", f"workload.path={src}", "sampling.max_tokens=2", "chunking.size=64"),
            out, engine=FakeEngine())
    assert "chunking.size: " in caplog.text and "-> 64" in caplog.text


@pytest.mark.parametrize("workload", ["workload=synthetic", "experiment=baseline", "experiment=continuous_batching",
                                      "experiment=paged_attention", "experiment=chunked_prefill",
                                      "experiment=prefix_caching"])
def test_benchmark_workloads_run(workload, tmp_path):
    """The synthetic source and each benchmark scenario run whole (on the stand-in engine) with the shape
    they promise."""
    cfg = compose_cfg(workload, "max_num_seqs=16")
    eng = FakeEngine(max_num_seqs=16, chunk=512, max_model_len=8192, step_cost=1e-4)
    eng.tokenizer.vocab_size = 256
    result = run_job(cfg, tmp_path, engine=eng)
    run = check_run(tmp_path)
    groups = {g.name: g for g in to_job_config(cfg).workload.synthetic.groups}
    assert result.summary["requests"] == sum(g.num_requests for g in groups.values())
    for r in run["rows"]:
        g = groups[r["id"].rsplit("-", 1)[0]]
        assert r["prompt_tokens"] >= g.min_prompt_len + g.shared_prefix_len
        if g.max_tokens_sigma == 0 and g.max_tokens is not None:
            assert r["output_tokens"] == g.max_tokens  # ignore_eos: every output runs to its length
    if workload == "experiment=chunked_prefill":
        long = [r for r in run["rows"] if r["id"].startswith("long-")]
        assert all(2048 <= r["prompt_tokens"] <= 4000 for r in long)
        assert min(r["arrival_s"] for r in long) > 0  # by Poisson (load-based rate), after the streams started
        assert result.summary["arrival_calibration"]["rates_per_s"]["long"] > 0
        assert all(r["arrival_s"] == 0 for r in run["rows"] if r["id"].startswith("stream-"))
    if workload == "experiment=prefix_caching":
        assert all(r["prompt_tokens"] >= 1536 + 8 for r in run["rows"])


def test_only_config_phase_errors_are_config_errors(monkeypatch):
    """A settings mistake exits 2 as a config error; a failure while loading weights is a real error."""
    from ladle import models
    from ladle.runner.config import ConfigError
    from ladle.runner.executors.local import make_engine
    from tests.runner.conftest import compose_cfg

    with pytest.raises(ConfigError, match="no-such-dir"):
        make_engine(to_job_config(compose_cfg("model.path=/no-such-dir")))

    def broken_load(*args, **kwargs):
        raise ValueError("corrupt tensor")

    monkeypatch.setattr(models, "load_model", broken_load)
    with pytest.raises(ValueError, match="corrupt tensor") as info:
        make_engine(to_job_config(compose_cfg()))
    assert not isinstance(info.value, ConfigError)


@pytest.mark.parametrize("name", ["a=b,c[1] x", "it's", "back\\slash", "end\\"])
def test_resume_command_survives_paths_hydra_would_split(tmp_path, name):
    """The printed command, split by a shell and parsed by Hydra, names exactly the run directory."""
    import shlex

    from hydra.core.override_parser.overrides_parser import OverridesParser

    from ladle.runner.resume import resume_command

    out = tmp_path / name
    argv = shlex.split(resume_command(out, ["chunking.size=64", "hydra.run.dir=old"]))
    assert argv[:4] == [sys.executable, "-m", "ladle", "chunking.size=64"]
    parsed = OverridesParser.create().parse_overrides(argv[3:])
    assert [o.key_or_group for o in parsed] == ["chunking.size", "hydra.run.dir"]
    assert parsed[1].value() == str(out.resolve())
