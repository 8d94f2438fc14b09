"""Hostile rows: one row's value never stops the job, and a row never takes another row's id.

- A JSON value nested deeper than ladle.runner.text.MAX_JSON_DEPTH (in a JSONL line, an openai_batch line, a
  json_schema or choice cell) is that row's error ("nested too deeply"); it was a RecursionError that
  stopped the job before any row was written, and again on every resume.
- `clean` walks values without recursion; whatever else a row's clean, sampling values, prompt or
  arrival time raise is that row's error (the backstop in Source.batches and Requests).
- With workload.id_column set, a row whose id is null or missing is an error row with no id: it took
  its row index as its id, which made a later row holding that id a "duplicate" whose output was lost.
"""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ladle.runner.job import run_job
from ladle.runner.sampling import BadValue, as_choice, as_schema
from ladle.runner.text import MAX_JSON_DEPTH, TooDeep, clean, load_json
from tests.runner.conftest import compose_cfg
from tests.runner.fake_engine import FakeEngine

DEEP = "[" * 100_000 + "]" * 100_000  # past the C parser's stack: json.loads raises RecursionError
PARSEABLE = "[" * 900 + "]" * 900  # json.loads takes it; a recursive walk of it does not


def nested(depth: int, leaf: object = None) -> object:
    """A list `depth` levels deep, built without recursion."""
    value = leaf
    for _ in range(depth):
        value = [value]
    return value


def rows(out) -> list[dict]:
    return sorted(pq.read_table(out / "generations.parquet").to_pylist(), key=lambda r: r["index"])


def write_jsonl(path, *lines):
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def run(tmp_path, *overrides, out="out", engine=None):
    res = run_job(compose_cfg(*overrides), tmp_path / out, engine=engine or FakeEngine())
    return res, rows(tmp_path / out)


# -- deep JSON ---------------------------------------------------------------------------------------
def test_load_json_refuses_what_nests_past_the_cap_and_takes_what_does_not():
    assert load_json("[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH) == nested(MAX_JSON_DEPTH - 1, [])
    assert load_json(b'{"a": "[[[[[[", "b": [1, {"c": 2}]}') == {"a": "[[[[[[", "b": [1, {"c": 2}]}
    for text in (DEEP, PARSEABLE, "[" * (MAX_JSON_DEPTH + 1) + "]" * (MAX_JSON_DEPTH + 1),
                 ('{"a": ' * 200 + "1" + "}" * 200).encode()):
        with pytest.raises(TooDeep, match=f"nested too deeply: more than {MAX_JSON_DEPTH} levels"):
            load_json(text)
    with pytest.raises(ValueError):
        load_json("{not json")


def test_clean_walks_any_depth_without_recursion():
    """It recursed ~2 frames a level: 900 levels (valid for json.loads) stopped the job."""
    value = {"k\ud800": nested(100_000, ["x\udfff", (1, "y\ud801"), [1, 2]])}
    out = clean(value)
    (key,) = out
    assert key == "k\ufffd"
    inner = out[key]
    for _ in range(100_000):
        (inner,) = inner
    assert inner == ["x\ufffd", (1, "y\ufffd"), [1, 2]] and isinstance(inner[1], tuple)
    ids = list(range(10))
    assert clean(ids) is ids and clean({"a": 1.5, "b": None}) == {"a": 1.5, "b": None}


def test_a_deep_jsonl_line_is_its_rows_error_and_a_resume_does_not_run_it_again(tmp_path):
    src = write_jsonl(tmp_path / "p.jsonl", {"prompt": "good row one"}, '{"prompt": "bad", "x": ' + DEEP + "}",
                      {"prompt": "bad too", "x": json.loads(PARSEABLE)}, {"prompt": "good row four"})
    overrides = ("workload=jsonl", f"workload.path={src}")
    _, got = run(tmp_path, *overrides)
    assert [r["error"] for r in got] == [None, got[1]["error"], None, None]
    assert got[1]["finish_reason"] == "error"  # past the parser's own stack: no row can be made of it
    assert got[1]["error"].startswith(f"p.jsonl line 2 is nested too deeply: more than {MAX_JSON_DEPTH} levels")
    # 900 levels json.loads parses, in a key no column reads: the cap is for what a row is made of (this
    # row was an error before the cap moved to the values read; its prompt runs)
    assert got[2]["finish_reason"] != "error" and got[2]["output_tokens"] > 0
    _, got2 = run(tmp_path, *overrides)
    assert got2 == got, "the resume ran nothing again"


def test_a_deep_first_jsonl_line_does_not_stop_the_column_check(tmp_path):
    """The column check parses lines too: a deep line there stopped the job before the model loaded."""
    src = write_jsonl(tmp_path / "p.jsonl", DEEP, {"q": "a", "id": "x"})
    _, got = run(tmp_path, "workload=jsonl", f"workload.path={src}", "workload.prompt_column=q",
                 "workload.id_column=id")
    assert got[0]["error"].startswith("p.jsonl line 1 is nested too deeply") and got[0]["id"] is None
    assert got[1]["id"] == "x" and got[1]["error"] is None


def test_deep_openai_batch_lines_are_error_lines(tmp_path):
    def line(cid, extra=None):
        return {"custom_id": cid, "method": "POST", "url": "/v1/completions",
                "body": {"prompt": f"hello {cid}", "max_tokens": 3, **(extra or {})}}

    src = write_jsonl(tmp_path / "b.jsonl", line("a"),
                      json.dumps(line("b"))[:-2] + ', "x": ' + PARSEABLE + "}}",
                      json.dumps(line("c"))[:-2] + ', "x": ' + DEEP + "}}", line("d"))
    _, got = run(tmp_path, "workload=openai_batch", f"workload.path={src}")
    assert [r["id"] for r in got] == ["a", None, None, "d"]
    assert [r["error"] is None for r in got] == [True, False, False, True]
    assert got[1]["error"].startswith("line 2 is nested too deeply") and got[2]["error"].startswith("line 3 is")
    out_lines = (tmp_path / "out" / "batch_output.jsonl").read_text().splitlines()
    assert len(out_lines) == 4 and "nested too deeply" in json.loads(out_lines[1])["error"]["message"]


def test_a_batch_line_whose_body_raises_anything_is_an_error_line(tmp_path, monkeypatch):
    import ladle.runner.sources.openai_batch as ob

    real = ob.body_sampling
    monkeypatch.setattr(ob, "body_sampling", lambda body, chat: real(body, chat) if body.get("max_tokens") != 7
                        else {}["no such key"])
    lines = [{"custom_id": c, "url": "/v1/completions", "body": {"prompt": "hi", "max_tokens": m}}
             for c, m in (("a", 3), ("b", 7), ("c", 3))]
    _, got = run(tmp_path, "workload=openai_batch", f"workload.path={write_jsonl(tmp_path / 'b.jsonl', *lines)}")
    assert [r["error"] for r in got[::2]] == [None, None]
    assert got[1]["id"] == "b" and got[1]["error"] == ("line 2 (custom_id 'b'): its body could not be processed: "
                                                       "KeyError: 'no such key'")


def test_a_deep_json_schema_cell_is_that_rows_error(tmp_path):
    shallow = {"type": "object", "properties": {"a": {"type": "string"}}}
    pq.write_table(pa.table({"prompt": ["good", "bad", "good2", "bad2"],
                             "schema": [json.dumps(shallow), DEEP, None, PARSEABLE]}), tmp_path / "s.parquet")
    eng = FakeEngine()
    _, got = run(tmp_path, "workload=parquet", f"workload.path={tmp_path / 's.parquet'}",
                 "+workload.columns={json_schema: schema}", engine=eng)
    assert [r["error"] is None for r in got] == [True, False, True, False]
    assert got[1]["error"].startswith("column 'schema' (sampling json_schema) holds '[[[")
    assert "which is nested too deeply" in got[1]["error"] and "which is nested too deeply" in got[3]["error"]
    assert eng.params_seen["0"].structured.json_schema == shallow


def test_a_deep_schema_or_choice_as_a_value_is_a_bad_value():
    deep_schema = {"type": "object"}
    for _ in range(MAX_JSON_DEPTH):
        deep_schema = {"type": "object", "properties": {"a": deep_schema}}
    for convert, value in ((as_schema, deep_schema), (as_schema, PARSEABLE), (as_choice, DEEP)):
        with pytest.raises(BadValue, match="is nested too deeply"):
            convert(value)


def test_a_schema_nested_up_to_the_cap_runs_in_the_real_engine(tmp_path, engine):
    """The cap leaves the engine's recursive walks (its schema checks, its copy of the params) and the
    grammar compiler room: a schema at the cap compiles and runs; one past it is a row error."""
    def schema(levels: int) -> dict:
        s: dict = {"type": "string"}
        for _ in range(levels):  # 3 JSON levels each: an object, its properties, the property
            s = {"type": "object", "properties": {"a": s}, "required": ["a"]}
        return s

    at_cap = json.dumps(schema((MAX_JSON_DEPTH - 1) // 3))
    assert load_json(at_cap)
    pq.write_table(pa.table({"prompt": ["at the cap", "past it"], "schema": [at_cap, json.dumps(schema(200))]}),
                   tmp_path / "s.parquet")
    _, got = run(tmp_path, "workload=parquet", f"workload.path={tmp_path / 's.parquet'}",
                 "+workload.columns={json_schema: schema}", engine=engine)
    assert got[0]["finish_reason"] != "error", got[0]["error"]
    assert "nested too deeply" in got[1]["error"]


# -- the per-row backstop ------------------------------------------------------------------------------
def test_an_exception_in_a_rows_clean_params_or_encode_is_that_rows_error(tmp_path, monkeypatch):
    import ladle.runner.requests
    import ladle.runner.sources.base

    def failing(real, bad_value, exc):
        def f(value, *a, **kw):
            if bad_value in repr(value):
                raise exc
            return real(value, *a, **kw)
        return f

    monkeypatch.setattr(ladle.runner.sources.base, "clean_row",
                        failing(ladle.runner.sources.base.clean_row, "row-b", RecursionError("too deep")))
    monkeypatch.setattr(ladle.runner.requests, "encode_prompt",
                        failing(ladle.runner.requests.encode_prompt, "row-c", KeyError("boom")))
    real_params = ladle.runner.requests.row_params

    def row_params(base, values, *a):
        if values.get("temperature") == 0.5:
            raise RecursionError("too deep")
        return real_params(base, values, *a)

    monkeypatch.setattr(ladle.runner.requests, "row_params", row_params)

    src = write_jsonl(tmp_path / "p.jsonl", {"prompt": "row-a"}, {"prompt": "row-b"}, {"prompt": "row-c"},
                      {"prompt": "row-d", "t": 0.5}, {"prompt": "row-e"})
    _, got = run(tmp_path, "workload=jsonl", f"workload.path={src}", "+workload.columns={temperature: t}")
    assert [r["error"] is None for r in got] == [True, False, False, False, True]
    assert got[1]["error"] == "this row's values could not be processed: nested too deeply (RecursionError); " \
                              "flatten them" and got[1]["id"] == "1"
    assert got[2]["error"] == "the prompt (column 'prompt') could not be processed: KeyError: 'boom'"
    assert got[3]["error"].startswith("this row's sampling values could not be processed: nested too deeply")


def test_an_arrival_time_no_check_foresaw_is_that_rows_error(tmp_path, monkeypatch):
    """An arrival process raising anything but ArrivalError (float() of a 400-digit integer raised
    OverflowError) stopped the job."""
    from ladle.runner.arrivals import ArrivalStreams

    real_next = ArrivalStreams.next

    def next_time(self, klass, trace_value=None):
        if trace_value == 7:
            raise OverflowError("int too large to convert to float")
        return real_next(self, klass, trace_value)

    monkeypatch.setattr(ArrivalStreams, "next", next_time)
    src = write_jsonl(tmp_path / "p.jsonl", {"prompt": "a", "t": 0}, {"prompt": "b", "t": 7}, {"prompt": "c", "t": 9})
    _, got = run(tmp_path, "workload=jsonl", f"workload.path={src}", "workload.arrivals.process=trace",
                 "workload.arrivals.column=t")
    assert [r["error"] is None for r in got] == [True, False, True]
    assert got[1]["error"] == ("this row's arrival time could not be processed: OverflowError: int too large to "
                               "convert to float")


# -- null ids ----------------------------------------------------------------------------------------
NULL_ID = "id is null in column 'id'; give every row an id, or unset workload.id_column"


def test_a_null_id_is_its_rows_error_and_never_takes_another_rows_id(tmp_path):
    """ids [None, None, '0']: the nulls became "0" and "1", and the real "0" row a duplicate (lost)."""
    pq.write_table(pa.table({"prompt": ["a", "b", "c"], "id": [None, None, "0"]}), tmp_path / "p.parquet")
    overrides = ("workload=parquet", f"workload.path={tmp_path / 'p.parquet'}", "workload.id_column=id")
    res, got = run(tmp_path, *overrides)
    assert [(r["id"], r["index"]) for r in got] == [(None, 0), (None, 1), ("0", 2)]
    assert got[0]["error"].startswith(NULL_ID) and got[1]["error"].startswith(NULL_ID)
    assert got[2]["error"] is None and got[2]["output_tokens"] > 0
    assert res.summary["errors"] == 2 and res.summary["completed"] == 1
    _, again = run(tmp_path, *overrides)
    assert again == got, "a resume neither runs nor duplicates a row"
    _, retried = run(tmp_path, *overrides, "output.retry_errors=true")
    assert [(r["id"], r["index"], r["error"] is None) for r in retried] == [(None, 0, False), (None, 1, False),
                                                                            ("0", 2, True)]


def test_a_run_directory_from_before_id_less_rows_resumes_without_duplicating_them(tmp_path):
    """Runs before this rule wrote a null-id row with its index as its id: resuming one with the new rule
    wrote each such row again, as an id-less error row beside the old one."""
    pq.write_table(pa.table({"prompt": ["a", "b", "c"], "id": [None, "r1", None]}), tmp_path / "p.parquet")
    overrides = ("workload=parquet", f"workload.path={tmp_path / 'p.parquet'}", "workload.id_column=id")
    run(tmp_path, *overrides)
    gen = tmp_path / "out" / "generations.parquet"
    old = pq.read_table(gen)  # as the old rule wrote it: each null id replaced by its row's index, run
    ids = [str(i) if rid is None else rid for rid, i in zip(old["id"].to_pylist(), old["index"].to_pylist())]
    old = old.set_column(old.schema.get_field_index("id"), "id", pa.array(ids, pa.string()))
    pq.write_table(old.replace_schema_metadata(old.schema.metadata), gen)
    _, again = run(tmp_path, *overrides)
    assert sorted((r["index"], r["id"]) for r in again) == [(0, "0"), (1, "r1"), (2, "2")]
    # A row with a real id at an index is not a null-id row's old row: data changed in between, the null-id
    # row now at index 1 is written (its error), not taken as done.
    pq.write_table(pa.table({"prompt": ["a", "new", "c"], "id": [None, None, None]}), tmp_path / "p.parquet")
    _, changed = run(tmp_path, *overrides)
    assert (1, None) in {(r["index"], r["id"]) for r in changed}


def test_a_deep_value_a_jsonl_row_reads_is_its_error_and_keeps_its_id(tmp_path):
    schema: dict = {"type": "string"}
    for _ in range(MAX_JSON_DEPTH + 5):
        schema = {"type": "array", "items": schema}
    src = write_jsonl(tmp_path / "p.jsonl", {"id": "k", "prompt": "p", "schema": schema},
                      {"id": "m", "prompt": "q"})
    _, got = run(tmp_path, "workload=jsonl", f"workload.path={src}", "workload.id_column=id",
                 "+workload.columns.json_schema=schema")
    assert got[0]["id"] == "k" and "nested too deeply" in got[0]["error"]
    assert got[1]["id"] == "m" and got[1]["error"] is None


def test_jsonl_lines_without_an_id_have_none_and_real_ids_run(tmp_path):
    """A line missing the key, a null id and an unreadable line took ids "0".."2" (str(index))."""
    src = write_jsonl(tmp_path / "p.jsonl", {"prompt": "a"}, "{not json", {"prompt": "c", "id": None},
                      {"prompt": "d", "id": "0"}, {"prompt": "e", "id": 1}, {"prompt": "f", "id": "2"})
    _, got = run(tmp_path, "workload=jsonl", f"workload.path={src}", "workload.id_column=id")
    assert [r["id"] for r in got] == [None, None, None, "0", "1", "2"]
    assert got[0]["error"].startswith("id is missing (this line has no key 'id'); give every row an id")
    assert got[1]["error"].startswith("p.jsonl line 2 is not a JSON object")
    assert got[2]["error"].startswith(NULL_ID)
    assert [r["error"] for r in got[3:]] == [None, None, None]


def test_without_an_id_column_rows_are_numbered_by_position_as_before(tmp_path):
    src = write_jsonl(tmp_path / "p.jsonl", {"prompt": "a", "id": None}, "{not json", {"prompt": "c"})
    _, got = run(tmp_path, "workload=jsonl", f"workload.path={src}")
    assert [r["id"] for r in got] == ["0", "1", "2"] and [r["error"] is None for r in got] == [True, False, True]


def test_a_parquet_file_without_the_id_column_gives_error_rows_not_index_ids(tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    pq.write_table(pa.table({"prompt": ["a", "b"], "id": ["2", "3"]}), d / "part-0.parquet")
    pq.write_table(pa.table({"prompt": ["c", "d"]}), d / "part-1.parquet")  # its rows' ids were "2", "3"
    _, got = run(tmp_path, "workload=parquet", f"workload.path={d}", "workload.id_column=id")
    assert [r["id"] for r in got] == ["2", "3", None, None]
    assert [r["error"] for r in got[:2]] == [None, None]
    assert all(r["error"].startswith(NULL_ID) for r in got[2:])
