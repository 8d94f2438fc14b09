"""Text that UTF-8 cannot encode, from every source to every sink.

Strings that UTF-8 cannot encode never kill a job.

The rule (runner/text.py): every string a source yields has each code point UTF-8 cannot encode (a lone
surrogate) replaced by U+FFFD where it enters; bytes that are not UTF-8 are decoded the same way; the
sinks clean again, and a row a sink still cannot write becomes an error row of its own.

Property: arbitrary Unicode (lone surrogates, NULs, non-characters, astral characters) in every string
of every source kind reaches every sink as valid UTF-8, one row per input row.

JSON sources carry surrogates as `\ud800` escapes; Arrow and Parquet strings cannot hold them, so those
files carry the surrogates' bytes (invalid UTF-8, as a writer that does not validate leaves them).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from ladle.runner.config import OutputConfig
from ladle.runner.job import run_job
from ladle.runner.sinks import GENERATIONS, STEPS
from ladle.runner.text import clean, clean_str
from ladle.runner.writer import RunWriter
from tests.runner.conftest import compose_cfg
from tests.runner.fake_engine import FakeEngine

BAD = "\ud800"  # a lone surrogate: valid in JSON ("\ud800"), not encodable as UTF-8


def rows_of(out):
    t = pq.read_table(out / GENERATIONS)
    t.validate(full=True)  # every string column holds valid UTF-8
    return t.to_pylist()


def test_clean_replaces_each_unencodable_code_point_and_keeps_the_rest():
    assert clean_str(f"a{BAD}b\udfff") == "a\ufffdb\ufffd"
    kept = "nul\x00 nonchar\ufffe\uffff astral😀 é"
    assert clean_str(kept) == kept
    assert clean({f"k{BAD}": [f"v{BAD}", 3, None, (f"t{BAD}",)]}) == {"k\ufffd": ["v\ufffd", 3, None, ("t\ufffd",)]}
    ids = list(range(5))
    assert clean(ids) == ids


def test_lone_surrogates_in_every_string_of_a_jsonl_row_are_replaced_and_the_job_runs(tmp_path):
    """A JSONL prompt "bad \\ud800 here" crashed the flush of its row group: exit 1, no row kept."""
    lines = [{"prompt": f"bad {BAD} here", "key": "a", "cls": "x", "stop": None},
             {"prompt": "plain", "key": f"id{BAD}", "cls": f"c{BAD}", "stop": [f"s{BAD}"]},
             {"prompt": [{"role": f"user{BAD}", "content": f"hi {BAD}"}], "key": "c"},
             {"prompt": "last", "key": "d"}]
    src = tmp_path / "p.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))  # json.dumps escapes the surrogates
    cfg = compose_cfg("workload=jsonl", f"workload.path={src}", "workload.id_column=key",
                      "workload.class_column=cls", "+workload.columns={stop: stop}")
    eng = FakeEngine()
    res = run_job(cfg, tmp_path / "out", engine=eng)
    rows = {r["index"]: r for r in rows_of(tmp_path / "out")}
    assert sorted(rows) == [0, 1, 2, 3] and all(r["error"] is None for r in rows.values()), rows
    assert rows[0]["prompt"] == "bad \ufffd here" and rows[0]["prompt_tokens"] == len("bad \ufffd here".encode())
    assert rows[1]["id"] == "id\ufffd" and rows[1]["class"] == "c\ufffd"
    assert eng.params_seen["id\ufffd"].stop == ["s\ufffd"]
    assert json.loads(rows[2]["prompt"]) == [{"role": "user\ufffd", "content": "hi \ufffd"}]
    steps = pq.read_table(tmp_path / "out" / STEPS)
    steps.validate(full=True)
    assert "id\ufffd" in {i for s in steps.column("scheduled_ids").to_pylist() for i in s}
    assert res.summary["requests"] == 4
    json.loads((tmp_path / "out" / "summary.json").read_bytes().decode("utf-8"))


def test_lone_surrogates_in_a_batch_file_reach_batch_output_as_replacement_characters(tmp_path):
    line = {"custom_id": f"c{BAD}", "method": "POST", "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": f"x{BAD}"}], "stop": [f"{BAD}"]}}
    bad_url = {"custom_id": f"u{BAD}", "method": "POST", "url": f"/v1/{BAD}", "body": {}}
    src = tmp_path / "b.jsonl"
    src.write_text(json.dumps(line) + "\n" + json.dumps(bad_url) + "\n")
    run_job(compose_cfg("workload=openai_batch", f"workload.path={src}"), tmp_path / "out", engine=FakeEngine())
    out = [json.loads(x) for x in (tmp_path / "out" / "batch_output.jsonl").read_bytes().decode("utf-8").splitlines()]
    assert [o["custom_id"] for o in out] == ["c\ufffd", "u\ufffd"]
    assert out[0]["error"] is None and out[1]["response"]["status_code"] == 400
    assert {r["id"] for r in rows_of(tmp_path / "out")} == {"c\ufffd", "u\ufffd"}


def invalid_utf8(values: list[bytes | None]) -> pa.Array:
    """A string array holding bytes that are not UTF-8 (as a writer that does not validate leaves them)."""
    raw = pa.array(values, pa.binary())
    return pa.Array.from_buffers(pa.string(), len(raw), raw.buffers(), null_count=raw.null_count)


def test_an_arrow_string_column_with_bytes_that_are_not_utf8_is_decoded_with_replacements(tmp_path):
    """pyarrow raised UnicodeDecodeError converting the batch: the job died (exit 1) mid-run."""
    prompts = invalid_utf8([b"good", b"bad \xff here", b"cut \xed\xa0\x80", None])
    ids = invalid_utf8([b"a", b"b\xfe", b"c", b"d"])
    stop_values = invalid_utf8([b"x\xff", b"y"])
    stops = pa.ListArray.from_arrays(pa.array([0, 1, 1, 2, 2], pa.int32()), stop_values)
    src = tmp_path / "p.parquet"
    pq.write_table(pa.table({"prompt": prompts, "key": ids, "st": stops}), src)
    cfg = compose_cfg("workload=parquet", f"workload.path={src}", "workload.id_column=key",
                      "+workload.columns={stop: st}")
    eng = FakeEngine()
    run_job(cfg, tmp_path / "out", engine=eng)
    rows = {r["index"]: r for r in rows_of(tmp_path / "out")}
    assert rows[1]["prompt"] == "bad \ufffd here" and rows[1]["id"] == "b\ufffd" and rows[1]["error"] is None
    assert rows[2]["prompt"] == "cut \ufffd\ufffd\ufffd"
    assert eng.params_seen["a"].stop == ["x\ufffd"] and eng.params_seen["c"].stop == ["y"]
    assert "prompt is null" in rows[3]["error"]


def test_a_row_a_sink_cannot_write_becomes_an_error_row_and_its_row_group_is_kept(tmp_path):
    w = RunWriter(tmp_path, OutputConfig(row_group_size=8), "a: 1\n", 0)
    w.copy_previous()
    base = {"index": 0, "sample_index": 0, "output_text": "", "output_token_ids": [], "output_tokens": 0,
            "finish_reason": "length", "token_times_s": []}
    w.generation({**base, "id": "ok", "index": 0})
    w.generation({**base, "id": "text", "index": 1, "output_text": f"x{BAD}"})  # cleaned: written as text
    w.generation({**base, "id": "ids", "index": 2, "output_token_ids": ["not an id"], "output_tokens": 1})
    w.generation({**base, "id": "ok2", "index": 3})
    w.step({"step": 0, "scheduled_ids": [f"s{BAD}"], "scheduled_tokens": [1]})
    w.close()
    rows = {r["id"]: r for r in rows_of(tmp_path)}
    assert sorted(rows) == ["ids", "ok", "ok2", "text"]
    assert rows["text"]["output_text"] == "x\ufffd" and rows["text"]["error"] is None
    bad = rows["ids"]
    assert bad["finish_reason"] == "error" and "could not be written" in bad["error"] and bad["index"] == 2
    assert bad["output_token_ids"] == [] and bad["attempt"] == 0
    assert rows["ok"]["error"] is None and rows["ok2"]["error"] is None
    assert pq.read_table(tmp_path / STEPS).column("scheduled_ids").to_pylist() == [["s\ufffd"]]


def test_a_steps_file_that_cannot_open_leaves_the_previous_generations_file_as_it_was(tmp_path):
    """RunWriter closed (not aborted) generations when steps failed to open: the empty new file
    replaced generations.parquet, and every row a previous run had written was lost."""
    run_job(compose_cfg("workload.limit=3"), tmp_path, engine=FakeEngine())
    before = pq.read_table(tmp_path / GENERATIONS)
    assert before.num_rows == 3
    (tmp_path / (STEPS + ".tmp")).mkdir()  # the steps writer cannot create its .tmp
    with pytest.raises(OSError):
        RunWriter(tmp_path, OutputConfig(), "a: 1\n", 1)
    assert pq.read_table(tmp_path / GENERATIONS).equals(before)
    assert not (tmp_path / (GENERATIONS + ".tmp")).exists()


def test_json_that_datasets_refuses_is_a_config_error_naming_the_file_not_a_crash(tmp_path):
    """datasets' JSON reader refuses lone surrogates (ArrowInvalid): the job died with a traceback (exit 1).
    workload=jsonl reads the same file."""
    from ladle.runner.config import ConfigError

    src = tmp_path / "p.jsonl"
    src.write_text(json.dumps({"prompt": f"a{BAD}"}) + "\n")
    with pytest.raises(ConfigError, match="datasets could not read the data .*jsonl reads"):
        run_job(compose_cfg("workload=hf_dataset", f"workload.path={src}"), tmp_path / "out", engine=FakeEngine())
    run_job(compose_cfg("workload=jsonl", f"workload.path={src}"), tmp_path / "ok", engine=FakeEngine())
    assert rows_of(tmp_path / "ok")[0]["prompt"] == "a\ufffd"


SPECIAL = ["\ud800", "\udfff", "\ud83d", "\ude00", "\x00", "\ufffe", "\uffff", "\U0001f600", "\U0010ffff", "\u2028"]
CHARS = st.one_of(st.characters(exclude_categories=()), st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF),
                  st.sampled_from(SPECIAL))
TEXT = st.text(CHARS, max_size=8)
ROWS = st.lists(st.tuples(TEXT, TEXT, TEXT, TEXT), min_size=1, max_size=4)  # (prompt, id, class, stop)
HOSTILE = [("bad \ud800 here", "x\udfff", "c\x00\ufffe", "\ud83d"), ("\U0010ffff", "", "", ""),
           ("\x00", "\ud800\udc00", "\uffff", "s")]

KINDS = ["jsonl", "openai_batch", "parquet", "arrow", "hf_disk", "hf_stream"]
ARROW_KINDS = {"parquet", "arrow", "hf_disk", "hf_stream"}


def via_json(s: str) -> str:
    return clean_str(json.loads(json.dumps(s)))  # an escaped surrogate pair reads back as one character


def via_bytes(s: str) -> str:
    return s.encode("utf-8", "surrogatepass").decode("utf-8", "replace")


def raw_strings(values: list[str | None]) -> pa.Array:
    """A string array of the values' bytes, surrogates included (invalid UTF-8, never validated)."""
    raw = pa.array([None if v is None else v.encode("utf-8", "surrogatepass") for v in values], pa.binary())
    return pa.Array.from_buffers(pa.string(), len(raw), raw.buffers(), null_count=raw.null_count)


def write_source(kind: str, d: Path, rows: list[tuple[str, str, str, str]]) -> tuple[list[str], Path]:
    """The rows in the kind's storage; the overrides that read them and the file or directory."""
    ids = [f"{i}|{rid}" for i, (_, rid, _, _) in enumerate(rows)]
    cols = ["workload.id_column=key", "workload.class_column=cls", "+workload.columns={stop: stop}"]
    if kind in ("jsonl", "openai_batch"):
        path = d / "in.jsonl"
        if kind == "jsonl":
            lines = [{"prompt": p, "key": k, "cls": c, "stop": s or None} for (p, _, c, s), k in zip(rows, ids)]
            path.write_text("".join(json.dumps(x) + "\n" for x in lines))
            return ["workload=jsonl", *cols], path
        lines = [{"custom_id": k, "method": "POST", "url": "/v1/chat/completions",
                  "body": {"messages": [{"role": "user", "content": p}], "stop": s or None}}
                 if i % 2 == 0 else {"custom_id": k, "method": "POST", "url": "/v1/completions",
                                     "body": {"prompt": p, "stop": [s] if s else None}}
                 for i, ((p, _, _, s), k) in enumerate(zip(rows, ids))]
        path.write_text("".join(json.dumps(x) + "\n" for x in lines))
        return ["workload=openai_batch"], path
    stops = pa.ListArray.from_arrays(pa.array([0, *_cumulative(bool(s) for *_, s in rows)], pa.int32()),
                                     raw_strings([s for *_, s in rows if s]))
    table = pa.table({"prompt": raw_strings([p for p, *_ in rows]), "key": raw_strings(ids),
                      "cls": raw_strings([c for _, _, c, _ in rows]), "stop": stops})
    if kind == "arrow":
        path = d / "in.arrow"
        with pa.ipc.new_file(path, table.schema) as w:
            w.write_table(table)
        return ["workload=arrow", *cols], path
    if kind == "hf_disk":
        import datasets

        path = d / "hf"
        datasets.Dataset(table).save_to_disk(str(path))
        return ["workload=hf_dataset", *cols], path
    path = d / "in.parquet"
    pq.write_table(table, path)
    return ["workload=hf_dataset" if kind == "hf_stream" else "workload=parquet", *cols], path


def _cumulative(flags) -> list[int]:
    out, n = [], 0
    for f in flags:
        n += f
        out.append(n)
    return out


def utf8_json(raw: bytes) -> object:
    """Parse bytes that must be strict UTF-8 JSON holding no lone surrogate (not even escaped)."""
    obj = json.loads(raw.decode("utf-8"))
    json.dumps(obj, ensure_ascii=False).encode("utf-8")  # raises on a surrogate an escape brought in
    return obj


def check_sinks(kind: str, out: Path, rows: list[tuple[str, str, str, str]]) -> None:
    expect = via_bytes if kind in ARROW_KINDS else via_json
    gen = pq.read_table(out / "generations.parquet")
    gen.validate(full=True)  # every string valid UTF-8
    pq.read_table(out / "steps.parquet").validate(full=True)
    got = sorted(gen.to_pylist(), key=lambda r: r["index"])
    assert [r["index"] for r in got] == list(range(len(rows))), "one row per input row"
    for i, (r, (p, rid, c, _)) in enumerate(zip(got, rows, strict=True)):
        assert r["id"] == expect(f"{i}|{rid}")
        if kind == "openai_batch":
            shown = json.loads(r["prompt"])[0]["content"] if i % 2 == 0 and r["prompt"] else r["prompt"]
        else:
            shown = r["prompt"]
            assert r["class"] == expect(c)
        assert shown is None or shown == expect(p), (shown, p)
    summary = utf8_json((out / "summary.json").read_bytes())
    assert summary["requests"] == len(rows)
    if kind == "openai_batch":
        lines = [utf8_json(x) for x in (out / "batch_output.jsonl").read_bytes().splitlines()]
        assert [o["custom_id"] for o in lines] == [expect(f"{i}|{rid}") for i, (_, rid, _, _) in enumerate(rows)]


@pytest.mark.parametrize("kind", KINDS)
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows=ROWS)
@example(rows=HOSTILE)
def test_arbitrary_unicode_through_every_source_kind_into_every_sink(kind, rows):
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        overrides, path = write_source(kind, d, rows)
        cfg = compose_cfg(*overrides, f"workload.path={path}", "sampling.max_tokens=2")
        run_job(cfg, d / "out", engine=FakeEngine())
        check_sinks(kind, d / "out", rows)
