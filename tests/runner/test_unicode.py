"""Strings that UTF-8 cannot encode never kill a job.

The rule (runner/text.py): every string a source yields has each code point UTF-8 cannot encode (a lone
surrogate) replaced by U+FFFD where it enters; bytes that are not UTF-8 are decoded the same way; the
sinks clean again, and a row a sink still cannot write becomes an error row of its own.
"""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

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
