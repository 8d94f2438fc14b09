"""The sweep report's token agreement: same tokens across runs, or the first request and position that differ."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from ladle.runner.sweep import write_sweep_report
from ladle.runner.sweep_tokens import compare_runs, first_difference


def make_run(root: Path, name: str, rows: list[tuple[str, int, list[int]]] | None, size: int) -> None:
    run = root / name
    run.mkdir(parents=True)
    summary = {"overrides": [f"chunking.size={size}", "deterministic=true"], "requests": 2,
               "config": {"chunking": {"size": size}}}
    (run / "summary.json").write_text(json.dumps(summary))
    if rows is None:
        return
    table = pa.table({"id": [r[0] for r in rows], "sample_index": pa.array([r[1] for r in rows], pa.int32()),
                      "output_token_ids": pa.array([r[2] for r in rows], pa.list_(pa.int32()))})
    pq.write_table(table, run / "generations.parquet")


SAME = [("a", 0, [5, 6, 7]), ("b", 0, [1, 2]), ("b", 1, [1, 3])]


def report(root: Path) -> tuple[list[dict], str]:
    files = write_sweep_report(root)
    return pq.read_table(files["parquet"]).to_pylist(), files["markdown"].read_text()


def test_identical_tokens_are_reported(tmp_path):
    make_run(tmp_path, "0", SAME, 8)
    make_run(tmp_path, "1", list(reversed(SAME)), 32)  # row order does not matter, only (id, sample)
    rows, md = report(tmp_path)
    assert [r["same_tokens"] for r in rows] == [True, True]
    assert [r["first_token_diff"] for r in rows] == [None, None]
    assert "Tokens: identical in all 2 runs for every request" in md


def test_the_first_differing_request_and_position_are_named(tmp_path):
    make_run(tmp_path, "0", SAME, 8)
    make_run(tmp_path, "1", SAME, 16)
    make_run(tmp_path, "2", [("a", 0, [5, 6, 7]), ("b", 0, [1, 2]), ("b", 1, [1, 4])], 32)
    rows, md = report(tmp_path)
    assert [r["same_tokens"] for r in rows] == [True, True, False]
    diff = rows[2]["first_token_diff"]
    assert "request `b` sample 1" in diff and "position 1" in diff and "token 3" in diff and "token 4" in diff
    assert "1 of 2 runs differ from `0`" in md and diff in md


def test_length_and_missing_requests_differ(tmp_path):
    ref = {("a", 0): [5, 6, 7], ("b", 0): [1]}
    short = first_difference("r", ref, {("a", 0): [5, 6], ("b", 0): [1]})
    assert (short.key, short.position, short.reference, short.got) == (("a", 0), 2, 7, None)
    missing = first_difference("r", ref, {("a", 0): [5, 6, 7]})
    assert missing.key == ("b", 0) and missing.position is None and "missing from `r`" in missing.describe("ref")
    extra = first_difference("r", ref, {**ref, ("c", 0): [9]})
    assert extra.key == ("c", 0) and "only in `r`" in extra.describe("ref")
    assert first_difference("r", ref, dict(ref)) is None


def test_runs_without_generations_are_left_out(tmp_path):
    make_run(tmp_path, "0", None, 8)
    make_run(tmp_path, "1", SAME, 16)
    make_run(tmp_path, "2", SAME, 32)
    result = compare_runs(tmp_path, ["0", "1", "2"])
    assert result == {"0": "no generations", "1": None, "2": None}
    rows, md = report(tmp_path)
    assert [r["same_tokens"] for r in rows] == [None, True, True]
    assert "identical in all 2 runs" in md


def test_a_deterministic_multirun_reports_identical_tokens(tmp_path):
    """A real sweep: chunk sizes 8 and 32, sampled at temperature 1 with seeds, deterministic=true."""
    from tests.runner.test_cli import FAST, ladle

    sweep = tmp_path / "sweep"
    p = ladle("--multirun", "chunking.size=8,32", "deterministic=true", "sampling.temperature=1",
              "sampling.seed=7", "sampling.logprobs=0", "sampling.ignore_eos=true", f"hydra.sweep.dir={sweep}",
              "workload.limit=4", "output.plots=false", *FAST, "sampling.max_tokens=6", cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = pq.read_table(sweep / "sweep.parquet").to_pylist()
    assert [r["varied"] for r in rows] == ["chunking.size=8", "chunking.size=32"]
    assert [r["same_tokens"] for r in rows] == [True, True]
    assert "Tokens: identical in all 2 runs for every request" in (sweep / "sweep.md").read_text()
    gens = [pq.read_table(sweep / str(i) / "generations.parquet").to_pylist() for i in (0, 1)]
    assert [len(g) for g in gens] == [4, 4] and all(len(r["output_token_ids"]) == 6 for r in gens[0])
    by_id = [{r["id"]: r["logprobs"] for r in g} for g in gens]
    assert by_id[0] == by_id[1]  # the logprobs too, as floats read back from parquet (bitwise)


def test_an_incomplete_run_is_marked_and_left_out_of_the_best_runs(tmp_path):
    """An interrupted run's summary says complete: false; a few fast requests must not make it the sweep's best."""
    make_run(tmp_path, "0", SAME, 8)
    make_run(tmp_path, "1", SAME, 32)
    for name, busy, complete in (("0", 100.0, True), ("1", 900.0, False)):
        path = tmp_path / name / "summary.json"
        summary = json.loads(path.read_text())
        summary.update(throughput={"busy_tokens_per_s": busy}, complete=complete)
        path.write_text(json.dumps(summary))
    rows, md = report(tmp_path)
    assert [r["complete"] for r in rows] == [True, False]
    assert "- Best throughput: `chunking.size=8`" in md
    assert "- Incomplete (interrupted, or a replica failed), left out of the lines above: `chunking.size=32`" in md
    assert "| 1 (incomplete) |" in md
