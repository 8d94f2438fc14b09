"""A row's values as the job reads them: a bad value is that row's error, naming its column (or, set for the
whole job, a config error before the model loads); usable column types parse; resume reruns a repeated id's
row and a sample that failed after the fork. Each test failed on the code before its fix."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ladle.runner.config import ConfigError
from ladle.runner.job import run_job
from ladle.runner.resume import is_done
from tests.runner.conftest import compose_cfg
from tests.runner.fake_engine import FakeEngine
from tests.runner.test_job import InterruptAfter


def rows_of(out):
    return pq.read_table(out / "generations.parquet").to_pylist()


def keys(out):
    return sorted((r["id"], r["index"], r["sample_index"], r["error"] is None) for r in rows_of(out))


def test_resume_runs_a_row_whose_repeated_id_already_has_its_error_row(tmp_path):
    """The repeat's error row is written when read, before the first row finishes: a run interrupted
    between the two left the id looking done, and the resume never ran the first row."""
    src = tmp_path / "p.parquet"
    pq.write_table(pa.table({"prompt": ["first", "second", "third"], "key": ["x", "y", "x"]}), src)
    cfg = compose_cfg("workload=parquet", f"workload.path={src}", "workload.id_column=key", "sampling.n=2")
    out = tmp_path / "out"
    first = run_job(cfg, out, engine=InterruptAfter(FakeEngine(), 1))
    assert first.interrupted and ("x", 2, 0, False) in keys(out) and ("x", 0, 0, True) not in keys(out)
    run_job(cfg, out, engine=FakeEngine())
    assert keys(out) == [("x", 0, 0, True), ("x", 0, 1, True), ("x", 2, 0, False), ("y", 1, 0, True),
                         ("y", 1, 1, True)]


def test_a_huge_n_is_that_rows_error_not_a_crashed_job(tmp_path):
    """n=10**12 in one row built a 10**12-bit mask (MemoryError: the job died) before reaching the engine."""
    src = tmp_path / "p.jsonl"
    src.write_text("".join(json.dumps({"prompt": f"p{i}", "k": k}) + "\n" for i, k in enumerate([2, 10**12, 1025])))
    cfg = compose_cfg("workload=jsonl", f"workload.path={src}", "+workload.columns={n: k}")
    run_job(cfg, tmp_path / "out", engine=FakeEngine())
    rows = {(r["id"], r["sample_index"]): r for r in rows_of(tmp_path / "out")}
    assert sorted(rows) == [("0", 0), ("0", 1), ("1", 0), ("2", 0)]
    for rid, n in (("1", 10**12), ("2", 1025)):
        assert f"n={n} is more than 1024" in rows[(rid, 0)]["error"] and "column 'k'" in rows[(rid, 0)]["error"]
    assert not is_done(0b11, 10**12) and is_done(0b11, 2) and not is_done(None, 10**12)


def test_a_seed_torch_cannot_take_is_that_rows_error_and_the_other_rows_run(tmp_path, engine):
    """A seed outside [-2**63, 2**64) failed the whole engine step: every row in it became an error."""
    src = tmp_path / "p.jsonl"
    src.write_text("".join(json.dumps({"prompt": f"p{i} hello", "s": s}) + "\n"
                           for i, s in enumerate([3, 10**30, -5, 2**64 - 1])))
    cfg = compose_cfg("workload=jsonl", f"workload.path={src}", "+workload.columns={seed: s}",
                      "sampling.temperature=1.0")
    run_job(cfg, tmp_path / "out", engine=engine)
    rows = {r["id"]: r for r in rows_of(tmp_path / "out")}
    assert [rows[i]["error"] is None for i in "0123"] == [True, False, True, True], rows["0"]["error"]
    assert "seed=1000000000000000000000000000000 must be None or an integer in [-2**63, 2**64)" in rows["1"]["error"]
    assert "column 's'" in rows["1"]["error"]


def test_a_bom_starting_any_batch_file_of_a_directory_is_allowed(tmp_path):
    """Only the first line of the first file was decoded with utf-8-sig: the second file's first line
    (a BOM, as Windows tools write) became an error line."""
    def line(cid):
        return json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/completions", "body": {"prompt": "hi"}})
    d = tmp_path / "in"
    d.mkdir()
    (d / "a.jsonl").write_bytes(b"\xef\xbb\xbf" + (line("a1") + "\r\n\r\n" + line("a2") + "\r\n").encode())
    (d / "b.jsonl").write_bytes(b"\xef\xbb\xbf" + (line("b1") + "\n" + line("b2")).encode())
    cfg = compose_cfg("workload=openai_batch", f"workload.path={d}")
    run_job(cfg, tmp_path / "out", engine=FakeEngine())
    out = [json.loads(x) for x in (tmp_path / "out" / "batch_output.jsonl").read_text().splitlines()]
    assert [(o["custom_id"], o["error"]) for o in out] == [("a1", None), ("a2", None), ("b1", None), ("b2", None)]


def test_json_schema_true_is_the_schema_that_accepts_anything_and_false_is_refused_naming_the_column(tmp_path):
    """as_schema let the booleans through; the engine then refused `true` with a message naming neither
    the column nor the value ("structured.json_schema must be a JSON string or a dict, got bool")."""
    src = tmp_path / "p.jsonl"
    src.write_text("".join(json.dumps({"prompt": "hi", "s": s}) + "\n" for s in ["true", True, "false", False]))
    cfg = compose_cfg("workload=jsonl", f"workload.path={src}", "+workload.columns={json_schema: s}")
    eng = FakeEngine()
    run_job(cfg, tmp_path / "out", engine=eng)
    rows = {r["id"]: r for r in rows_of(tmp_path / "out")}
    assert rows["0"]["error"] is None and rows["1"]["error"] is None
    assert eng.params_seen["0"].structured.json_schema == {} == eng.params_seen["1"].structured.json_schema
    for rid, shown in (("2", "'false'"), ("3", "False")):
        assert f"column 's' (sampling json_schema) holds {shown}, which is the schema no output" in rows[rid]["error"]


def test_decimal_columns_are_numbers(tmp_path):
    """Parquet DECIMAL columns (SQL exports) came back as decimal.Decimal and every row was an error
    ("must be a number, not a Decimal")."""
    from decimal import Decimal

    src = tmp_path / "p.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b", "c"],
                             "t": pa.array([Decimal("0.70"), None, Decimal("1.25")], pa.decimal128(4, 2)),
                             "mt": pa.array([Decimal(3), Decimal(2), Decimal("2.5")], pa.decimal128(4, 1))}), src)
    cfg = compose_cfg("workload=parquet", f"workload.path={src}", "+workload.columns={temperature: t, max_tokens: mt}")
    eng = FakeEngine()
    run_job(cfg, tmp_path / "out", engine=eng)
    rows = {r["id"]: r for r in rows_of(tmp_path / "out")}
    assert rows["0"]["error"] is None and rows["1"]["error"] is None
    assert eng.params_seen["0"].temperature == 0.7 and eng.params_seen["0"].max_tokens == 3
    assert eng.params_seen["1"].max_tokens == 2
    assert "holds Decimal('2.5'), which must be an integer" in rows["2"]["error"]


class FailSample:
    """Sample `k` of every request fails after its first token (as a step failure after the fork would);
    Ctrl-C arrives during step `interrupt_at` (None: never)."""

    def __init__(self, eng, interrupt_at=None, k=1):
        self.eng, self.interrupt_at, self.steps, self.k = eng, interrupt_at, 0, k

    def __getattr__(self, name):
        return getattr(self.eng, name)

    def step(self):
        import dataclasses

        self.steps += 1
        if self.interrupt_at is not None and self.steps >= self.interrupt_at:
            raise KeyboardInterrupt
        outs = []
        for o in self.eng.step():
            if o.sample_index == self.k and o.finish_reason != "error":
                self.eng.running = [r for r in self.eng.running
                                    if not (r.id == o.request_id and r.sample_index == self.k)]
                o = dataclasses.replace(o, finished=True, finish_reason="error", error="step failed: boom")
            outs.append(o)
        return outs


@pytest.mark.parametrize("k", [0, 1])
def test_a_sample_that_failed_after_the_fork_does_not_make_its_siblings_done_on_resume(tmp_path, k):
    """A sample's error row marked the whole id done: a run interrupted before its siblings finished
    never wrote them. Only a pre-fork error (the one row of all n samples, with no token) means that;
    sample 0 failing after the fork has drawn its first token, and is that sample's alone."""
    src = tmp_path / "p.parquet"
    pq.write_table(pa.table({"prompt": ["aa", "bb"]}), src)
    cfg = compose_cfg("workload=parquet", f"workload.path={src}", "sampling.n=3", "sampling.max_tokens=6")
    out = tmp_path / "out"
    first = run_job(cfg, out, engine=FailSample(FakeEngine(), interrupt_at=4, k=k))
    rows = rows_of(out)
    assert first.interrupted and [(r["sample_index"], r["error"]) for r in rows] == [(k, "step failed: boom")] * 2
    assert all(r["output_tokens"] >= 1 for r in rows)
    run_job(cfg, out, engine=FakeEngine())
    got = sorted((r["id"], r["sample_index"], r["error"] is None) for r in rows_of(out))
    assert got == [(i, j, j != k) for i in ("0", "1") for j in range(3)]


@pytest.mark.parametrize("override,fragment", [
    ("sampling.structured.json_schema='{\"type\": \"foo\"}'", 'json_schema is not valid: Unsupported type "foo"'),
    ("sampling.structured.regex='('", "regex is not valid: Regex parsing error"),
    ("sampling.structured.grammar='root ::= '", "grammar is not valid: EBNF parser error"),
])
def test_a_config_wide_structured_spec_that_cannot_compile_fails_before_the_model_loads(tmp_path, no_model_load,
                                                                                      override, fragment):
    """It failed every row, after the model (and the arrival calibration) had loaded, and the job exited 0."""
    pytest.importorskip("xgrammar")
    with pytest.raises(ConfigError) as e:
        run_job(compose_cfg(override), tmp_path / "out")  # no engine given: a model load would fail the test
    assert "sampling.structured: " in str(e.value) and fragment in str(e.value), str(e.value)
    assert not (tmp_path / "out" / "generations.parquet").exists()


def test_a_structured_value_the_engine_refuses_names_its_column(tmp_path):
    """The engine's structured problems ('structured.choice=[''] must hold non-empty strings only') were
    reported without the column they came from."""
    src = tmp_path / "p.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b"], "ch": ['["yes", "no"]', '[""]']}), src)
    cfg = compose_cfg("workload=parquet", f"workload.path={src}", "+workload.columns={choice: ch}")
    run_job(cfg, tmp_path / "out", engine=FakeEngine())
    rows = {r["id"]: r for r in rows_of(tmp_path / "out")}
    assert rows["0"]["error"] is None
    assert "structured.choice=[''] must hold non-empty strings only (from column 'ch')" in rows["1"]["error"]


@pytest.mark.parametrize("col,values,key", [
    ("temp", pa.array([{"t": 1.0}, {"t": 0.5}]), "temperature"),
    ("seed", pa.array([True, False]), "seed"),
    ("stops", pa.array([1, 2]), "stop"),
    ("schema", pa.array([1.0, 2.0]), "json_schema"),
    # let through before: every row failed (a map reads as a list of pairs; stop strings are strings)
    ("schema", pa.array([[("type", "object")], None], pa.map_(pa.string(), pa.string())), "json_schema"),
    ("stops", pa.array([[1], [2]], pa.list_(pa.int64())), "stop"),
    ("choice", pa.array([[1.0], None], pa.large_list(pa.float64())), "choice"),
])
def test_a_sampling_column_of_an_unusable_type_is_a_config_error_before_the_model_loads(tmp_path, no_model_load,
                                                                                        col, values, key):
    """Every row was an error row, found only after the model had loaded."""
    src = tmp_path / "p.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b"], col: values}), src)
    cfg = compose_cfg("workload=parquet", f"workload.path={src}", f"+workload.columns={{{key}: {col}}}")
    with pytest.raises(ConfigError) as e:
        run_job(cfg, tmp_path / "out", engine=None)
    assert f"workload column {col!r} (sampling {key})" in str(e.value) and "has type" in str(e.value), str(e.value)


@pytest.mark.parametrize("col,values,key,parsed", [
    ("temp", pa.array([1, None], pa.int64()), "temperature", 1.0),
    ("temp", pa.array(["0.5", None]), "temperature", 0.5),
    ("stops", pa.array([["a"], None]), "stop", ["a"]),
    ("schema", pa.array([{"type": "object"}, None]), "json_schema", {"type": "object"}),
    ("choice", pa.array([["y", "n"], None]), "choice", ["y", "n"]),
    # refused before, yet every row parses: fixed-size lists of strings, `true` (the any-schema)
    ("stops", pa.array([["a", "b"], None], pa.list_(pa.string(), 2)), "stop", ["a", "b"]),
    ("choice", pa.array([["y", "n"], None], pa.list_(pa.large_string(), 2)), "choice", ["y", "n"]),
    ("stops", pa.array([[], None], pa.list_(pa.null())), "stop", []),
    ("schema", pa.array([True, None]), "json_schema", {}),
])
def test_usable_column_types_are_accepted(tmp_path, col, values, key, parsed):
    """Every row of each accepted layout parses: row 0 to its value, row 1 (null) to the default. The test
    counted rows before, and error rows count too."""
    src = tmp_path / "p.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b"], col: values}), src)
    cfg = compose_cfg("workload=parquet", f"workload.path={src}", f"+workload.columns={{{key}: {col}}}")
    eng = FakeEngine()
    run_job(cfg, tmp_path / "out", engine=eng)
    rows = rows_of(tmp_path / "out")
    assert len(rows) == 2 and [r["error"] for r in rows] == [None, None], rows
    got = [eng.params_seen[rid] for rid in ("0", "1")]
    if key in ("json_schema", "choice"):
        assert getattr(got[0].structured, key) == parsed and got[1].structured is None
    else:
        default = {"temperature": 0.0, "stop": []}[key]  # conf/config.yaml's sampling defaults
        assert getattr(got[0], key) == parsed and getattr(got[1], key) == default
