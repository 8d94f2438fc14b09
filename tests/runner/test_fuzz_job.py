"""Fuzz the whole job: generated JSONL, Parquet (a file, and a directory of partitioned parts with mixed
schemas and stray files) and OpenAI batch files with hostile strings, ids,
schemas and sampling values, run in-process on the tiny model, each interrupted once and resumed.

Every run ends as the CLI's exit 0 (run_job returns) or 2 (ConfigError), never 1 (any other exception);
every input row has exactly one output row (one per sample of its n, or the one error row of a request
that failed before its fork); nothing written by the interrupted attempt is lost by the resume.
Bounded: a few rows per example, max_tokens small, a handful of examples per format
(LADLE_FUZZ_EXAMPLES=200 for a deeper run).
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, Phase, event, given, settings
from hypothesis import strategies as st

from ladle.runner.config import ConfigError
from ladle.runner.job import run_job
from ladle.runner.sampling import MAX_N
from tests.runner.conftest import compose_cfg
from tests.runner.test_job import InterruptAfter

WORDS = ["", " ", "\x00", "\ud800", "\udfff", "\ufffe", "😀", "(", "[a-", "{", "0", "-1", "nan", "<line 1>", "a" * 40]
TEXT = st.one_of(st.sampled_from(WORDS), st.text(st.one_of(st.characters(exclude_categories=()),
                                                          st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)),
                                                 max_size=6))
ID = st.one_of(TEXT, st.integers(-3, 3), st.none(), st.sampled_from([1.5, float("nan"), [1, 2], {"a": 1}, True]))
PROMPT = st.one_of(st.text(min_size=1, max_size=12), TEXT, st.none(), st.integers(),
                   st.lists(st.integers(-3, 600), max_size=4),
                   st.lists(st.fixed_dictionaries({"role": TEXT, "content": TEXT}), max_size=2))
HOSTILE_INT = st.sampled_from([None, -1, 0, 10**12, -10**12, 2**64, 1025, 2.0, 2.5, "2", "x", True, float("nan")])
HOSTILE_FLOAT = st.sampled_from([None, -1.0, 0.0, 1e308, float("nan"), float("inf"), "0.5", "x", False, 3])
# Each key: usable values most of the time, hostile ones otherwise (a row with many bad values is only
# ever an error row: the engine would see too little).
VALUES = {
    "temperature": st.one_of(st.floats(0, 2), HOSTILE_FLOAT), "top_p": st.one_of(st.floats(0.1, 1), HOSTILE_FLOAT),
    "min_p": st.one_of(st.floats(0, 1), HOSTILE_FLOAT), "top_k": st.one_of(st.integers(0, 5), HOSTILE_INT),
    "seed": st.one_of(st.integers(-2**63, 2**64 - 1), HOSTILE_INT), "n": st.one_of(st.integers(1, 3), HOSTILE_INT),
    "max_tokens": st.one_of(st.integers(1, 3), HOSTILE_INT), "logprobs": st.one_of(st.integers(0, 3), HOSTILE_INT),
    "prompt_logprobs": st.one_of(st.integers(0, 2), HOSTILE_INT),
    "stop": st.one_of(TEXT, st.lists(TEXT, max_size=2), st.sampled_from([None, [1], 5])),
    "json_schema": st.sampled_from([None, {}, {"type": "object"}, {"type": "string", "maxLength": 3}, {"type": "foo"},
                                    {"enum": []}, {"type": "string", "pattern": "("}, {"$ref": "#/nope"}, True,
                                    False, "not json", '{"type": "boolean"}', 3,
                                    {"type": "array", "maxItems": 1, "items": {"type": "integer"}}]),
    "regex": st.sampled_from([None, "[a-z]+", "(", "a{2,3}", "", "\ud800"]),
    "choice": st.sampled_from([None, [], [""], ["yes", "no"], '["a"]', ["\ud800x"]]),
}
SAMPLING = st.lists(st.sampled_from(sorted(VALUES)).flatmap(lambda k: st.tuples(st.just(k), VALUES[k])),
                    max_size=3).map(dict)
ROW = st.tuples(PROMPT, ID, SAMPLING)
ROWS = st.lists(ROW, min_size=1, max_size=4)
KEYS = ["temperature", "top_p", "top_k", "min_p", "seed", "n", "max_tokens", "logprobs", "prompt_logprobs", "stop",
        "json_schema", "regex", "choice"]


def columns(keys) -> str:
    return "+workload.columns={" + ", ".join(f"{k}: {k}" for k in keys) + "}"


def _json(x: Any) -> str:
    return json.dumps(x, allow_nan=True)


def write_jsonl(d: Path, rows) -> list[str]:
    lines = [_json({"prompt": p, "id": rid, **s}) for p, rid, s in rows]
    (d / "in.jsonl").write_text("".join(x + "\n" for x in lines))
    keys = [k for k in KEYS if any(k in s for _, _, s in rows)]  # a key of some line is a column
    return ["workload=jsonl", f"workload.path={d / 'in.jsonl'}", "workload.id_column=id", *([columns(keys)] * bool(keys))]


def _typed(values: list[Any], kind: type) -> list[Any]:
    """A Parquet column holds one type: the values of that type, others null."""
    return [v if isinstance(v, kind) and not isinstance(v, bool) else None for v in values]


def _b(s: str | None) -> bytes | None:
    return None if s is None else s.encode("utf-8", "surrogatepass")


def write_parquet(d: Path, rows) -> list[str]:
    pq.write_table(parquet_table(rows), d / "in.parquet")
    return ["workload=parquet", f"workload.path={d / 'in.parquet'}", "workload.id_column=id", columns(KEYS)]


def write_parquet_dir(d: Path, rows) -> list[str]:
    """The rows as a directory dataset as pandas and Spark write one: hive partitions (`part=k/`, read as
    the class column), parts whose schemas differ (a column with no value in a part is Arrow null there,
    as pandas writes an all-None column; the first part's integers int32 where they fit, the second's
    int64), and stray files that are not data."""
    table, root = parquet_table(rows), d / "ds"
    half = (len(rows) + 1) // 2
    for k, part in enumerate((table.slice(0, half), table.slice(half))):
        if not part.num_rows:
            continue
        cols = {n: pa.nulls(part.num_rows) if part.column(n).null_count == part.num_rows and n != "prompt"
                else _narrowed(part.column(n)) if k == 0 else part.column(n) for n in part.column_names}
        (root / f"part={k}").mkdir(parents=True)
        pq.write_table(pa.table(cols), root / f"part={k}" / "part-0.parquet")
    (root / "_SUCCESS").write_text("")
    (root / "stats.json").write_text(json.dumps({"rows": len(rows)}))
    (root / "part=0" / ".part-0.parquet.crc").write_bytes(b"\x00crc")
    return ["workload=parquet", f"workload.path={root}", "workload.id_column=id", "workload.class_column=part",
            columns(KEYS)]


def _narrowed(col: pa.ChunkedArray) -> pa.ChunkedArray:
    """An int64 column as int32 when its values fit (a part written by a tool that chose the narrower type)."""
    if col.type == pa.int64() and all(v is None or -2**31 <= v < 2**31 for v in col.to_pylist()):
        return col.cast(pa.int32())
    return col


def parquet_table(rows) -> pa.Table:
    """Typed columns (a Parquet column holds one type: other values are null), strings as raw bytes."""
    col = {k: [s.get(k) for _, _, s in rows] for k in KEYS}
    table = {"prompt": pa.array([_b(p) if isinstance(p, str) else None for p, _, _ in rows], pa.binary()),
             "id": pa.array([None if r is None else _b(str(r)) for _, r, _ in rows], pa.binary())}
    for k in KEYS:
        if k in ("temperature", "top_p", "min_p"):
            table[k] = pa.array(_typed(col[k], float), pa.float64())
        elif k in ("stop", "choice"):
            table[k] = pa.array([[_b(x) for x in v] if isinstance(v, list) and all(isinstance(x, str) for x in v)
                                 else None for v in col[k]], pa.list_(pa.binary()))
        elif k in ("json_schema", "regex"):
            table[k] = pa.array([_b(v) if isinstance(v, str) else None if v is None else _b(_json(v))
                                 for v in col[k]], pa.binary())
        else:
            table[k] = pa.array([v if v is not None and -2**63 <= v < 2**63 else None for v in _typed(col[k], int)],
                                pa.int64())
    return pa.table({k: _as_strings(v) for k, v in table.items()})


def _as_strings(arr: pa.Array) -> pa.Array:
    """Binary as string without validation: bytes that are not UTF-8 (surrogates' bytes) stay in the file."""
    if arr.type == pa.binary():
        return pa.Array.from_buffers(pa.string(), len(arr), arr.buffers(), null_count=arr.null_count)
    if pa.types.is_list(arr.type):
        return pa.ListArray.from_arrays(arr.offsets, _as_strings(arr.values), mask=arr.is_null())
    return arr


def write_batch(d: Path, rows) -> list[str]:
    lines = []
    for i, (p, rid, s) in enumerate(rows):
        body = {k: v for k, v in s.items() if k in ("temperature", "top_p", "top_k", "min_p", "seed", "n",
                                                    "max_tokens", "stop")}
        if s.get("json_schema") is not None:
            body["response_format"] = {"type": "json_schema", "json_schema": {"schema": s["json_schema"]}}
        if i % 2:
            body.update(prompt=p, logprobs=s.get("logprobs"), echo=bool(s.get("prompt_logprobs")))
            url = "/v1/completions"
        else:
            body.update(messages=p if isinstance(p, list) else [{"role": "user", "content": p}],
                        logprobs=s.get("logprobs") is not None, top_logprobs=s.get("logprobs"))
            url = "/v1/chat/completions"
        line = {"custom_id": rid, "method": "POST", "url": url, "body": body}
        lines.append(_json(line) if i != 3 else "{not json " + _json(rid))
    (d / "in.jsonl").write_text("".join(x + "\n" for x in lines))
    return ["workload=openai_batch", f"workload.path={d / 'in.jsonl'}"]


WRITERS = {"jsonl": write_jsonl, "parquet": write_parquet, "parquet_dir": write_parquet_dir,
           "openai_batch": write_batch}


def asked_n(kind: str, s: dict[str, Any]) -> int:
    """The samples a row asks for (1 when its n cannot be used); Parquet's int column keeps ints only."""
    n = s.get("n")
    if kind in ("parquet", "parquet_dir") and (not isinstance(n, int) or isinstance(n, bool)):
        return 1
    if isinstance(n, float) and math.isfinite(n) and n.is_integer():
        n = int(n)
    if isinstance(n, str) and n.strip().lstrip("-").isdigit():
        n = int(n)
    return n if isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= MAX_N else 1


def check_outputs(kind: str, out: Path, rows, first: list[dict[str, Any]]) -> None:
    gen = pq.read_table(out / "generations.parquet")
    gen.validate(full=True)
    got: dict[int, list[dict[str, Any]]] = {}
    for r in gen.to_pylist():
        got.setdefault(r["index"], []).append(r)
    assert sorted(got) == list(range(len(rows))), "every input row has an output row"
    for i, (_, _, s) in enumerate(rows):
        ks = sorted(r["sample_index"] for r in got[i])
        assert ks == list(range(len(ks))), (i, ks)  # unique, no gap
        assert len(ks) in (1, asked_n(kind, s)), (i, ks, s)
        if len(ks) == 1 and asked_n(kind, s) > 1:
            assert got[i][0]["finish_reason"] == "error", "one row for n samples: the request's error"
    if kind == "parquet_dir":  # the partition key is a column: each row's class is its part's
        half = (len(rows) + 1) // 2
        assert all(r["class"] == str(int(i >= half)) for i, rs in got.items() for r in rs), got
    final = {(r["id"], r["index"], r["sample_index"]): r for rs in got.values() for r in rs}
    for r in first:  # nothing the interrupted attempt wrote is lost or changed
        kept = final[(r["id"], r["index"], r["sample_index"])]
        assert (kept["output_text"], kept["finish_reason"], kept["attempt"]) == (
            r["output_text"], r["finish_reason"], r["attempt"])
    json.loads((out / "summary.json").read_bytes().decode("utf-8"))
    if (out / "batch_output.jsonl").exists():
        lines = (out / "batch_output.jsonl").read_bytes().decode("utf-8").splitlines()
        assert len(lines) == len(rows) and all(json.loads(x)["id"] for x in lines)


def run_and_resume(engine, kind: str, rows, steps: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        cfg = compose_cfg(*WRITERS[kind](d, rows), "sampling.max_tokens=2", "sampling.seed=0")
        out = d / "out"
        try:
            first = run_job(cfg, out, engine=InterruptAfter(engine, steps))
        except ConfigError as e:  # exit 2: a config the user must fix (e.g. an unusable column type)
            # A directory's parts are typed as the single file's are: nothing in them for the user to fix.
            assert kind != "parquet_dir", e
            event(f"config error: {str(e)[:60]}")
            return
        event("interrupted" if first.interrupted else "ran")
        written = pq.read_table(out / "generations.parquet").to_pylist() if first.interrupted else []
        run_job(cfg, out, engine=engine)  # anything but a ConfigError here is a crash (exit 1)
        assert not engine.has_unfinished_requests()
        check_outputs(kind, out, rows, written)


@pytest.mark.parametrize("kind", sorted(WRITERS))
# No shrinking: each example is a few rows already, and a shrink replays whole jobs for minutes.
@settings(max_examples=int(os.environ.get("LADLE_FUZZ_EXAMPLES", "8")), deadline=None, phases=[Phase.explicit, Phase.reuse, Phase.generate],
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(rows=ROWS, steps=st.integers(0, 3))
def test_fuzz_the_whole_job(engine, kind, rows, steps):
    run_and_resume(engine, kind, rows, steps)
