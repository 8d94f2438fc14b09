"""Property: arbitrary Unicode (lone surrogates, NULs, non-characters, astral characters) in every string
of every source kind reaches every sink as valid UTF-8, one row per input row.

JSON sources carry surrogates as `\\ud800` escapes; Arrow and Parquet strings cannot hold them, so those
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

from ladle.runner.job import run_job
from ladle.runner.text import clean_str
from tests.runner.conftest import compose_cfg
from tests.runner.fake_engine import FakeEngine

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
