"""workload=openai_batch: OpenAI Batch API input files in, batch_output.jsonl (and the Parquet outputs) out."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from ladle.engine.sampling_params import StructuredOutputs
from ladle.runner.config import ConfigError
from ladle.runner.job import run_job
from ladle.runner.sources.openai_batch import parse_line
from tests.runner.conftest import compose_cfg
from tests.runner.fake_engine import FakeEngine, fake_logprob
from tests.runner.test_job import InterruptAfter

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


def req(cid, url=CHAT, **body):
    if url == CHAT:
        body.setdefault("messages", [{"role": "user", "content": f"question {cid}"}])
    else:
        body.setdefault("prompt", f"text {cid}")
    return {"custom_id": cid, "method": "POST", "url": url, "body": {"model": "gpt-x", **body}}


def batch_file(path, lines):
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x, ensure_ascii=False)) + "\n" for x in lines))
    return path


def run_batch(tmp_path, lines, *overrides, engine=None, out="out"):
    src = batch_file(tmp_path / "batch.jsonl", lines)
    cfg = compose_cfg("workload=openai_batch", f"workload.path={src}", *overrides)
    res = run_job(cfg, tmp_path / out, engine=engine or FakeEngine())
    return res, read_output(tmp_path / out)


def read_output(out):
    p = out / "batch_output.jsonl"
    return [json.loads(x) for x in p.read_text(encoding="utf-8").splitlines()] if p.exists() else None


def test_chat_and_completion_lines_give_openai_response_objects(tmp_path):
    lines = [req("c1", max_completion_tokens=3, n=2, logprobs=True, top_logprobs=2, seed=5, temperature=0.8),
             req("p1", COMPLETIONS, max_tokens=2, logprobs=1),
             req("p2", COMPLETIONS, prompt=[104, 105, 33], max_tokens=1)]
    eng = FakeEngine()
    res, out = run_batch(tmp_path, lines, engine=eng)
    assert [o["custom_id"] for o in out] == ["c1", "p1", "p2"] and all(o["error"] is None for o in out)
    assert len({o["id"] for o in out}) == 3
    chat = out[0]["response"]
    assert chat["status_code"] == 200 and chat["request_id"]
    body = chat["body"]
    assert body["object"] == "chat.completion" and [c["index"] for c in body["choices"]] == [0, 1]
    gen = {(r["id"], r["sample_index"]): r for r in pq.read_table(tmp_path / "out" / "generations.parquet").to_pylist()}
    for c in body["choices"]:
        row = gen[("c1", c["index"])]
        assert c["message"] == {"role": "assistant", "content": row["output_text"]}
        assert c["finish_reason"] == "length"
        content = c["logprobs"]["content"]
        assert [x["token"] for x in content] == [chr(t) for t in row["output_token_ids"]]
        assert [x["logprob"] for x in content] == pytest.approx([fake_logprob(t) for t in row["output_token_ids"]])
        assert all(len(x["top_logprobs"]) == 2 and x["bytes"] == list(x["token"].encode()) for x in content)
    u = body["usage"]
    assert u["prompt_tokens"] == gen[("c1", 0)]["prompt_tokens"] and u["completion_tokens"] == 6
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
    comp = out[1]["response"]["body"]
    assert comp["object"] == "text_completion" and comp["choices"][0]["text"] == gen[("p1", 0)]["output_text"]
    lp = comp["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 2
    assert lp["text_offset"] == [0, 1]
    assert out[2]["response"]["body"]["usage"]["prompt_tokens"] == 3  # token ids as the prompt
    assert out[2]["response"]["body"]["choices"][0]["logprobs"] is None
    # The body's sampling fields reached the engine; the config's defaults fill the rest.
    p = eng.params_seen
    assert (p["c1"].max_tokens, p["c1"].n, p["c1"].logprobs, p["c1"].seed, p["c1"].temperature) == (3, 2, 2, 5, 0.8)
    assert p["p2"].logprobs is None and p["p2"].max_tokens == 1
    assert res.summary["requests"] == 3 and res.summary["samples"] == 4
    assert not list((tmp_path / "out").glob("*.tmp"))


def test_body_fields_map_onto_sampling(tmp_path):
    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    lines = [req("a", max_tokens=9, max_completion_tokens=4, stop="END", top_p=0.5,
                 response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}),
             req("b", response_format={"type": "json_object"}),
             req("c", response_format={"type": "text"}, stop=["x", "y"]),
             req("d", COMPLETIONS, prompt=["only one"])]
    eng = FakeEngine()
    run_batch(tmp_path, lines, "sampling.max_tokens=6", engine=eng)
    p = eng.params_seen
    assert p["a"].max_tokens == 4 and p["a"].stop == ["END"] and p["a"].top_p == 0.5  # max_completion_tokens wins
    assert p["a"].structured == StructuredOutputs(json_schema=schema)
    assert p["b"].structured == StructuredOutputs(json_schema={"type": "object"})
    assert p["c"].structured is None and p["c"].stop == ["x", "y"] and p["c"].max_tokens == 6
    assert p["d"].max_tokens == 6


BAD_LINES = [
    ("{not json", None, "not valid JSON"),
    ('["a list"]', None, "not an object"),
    (json.dumps({"method": "POST", "url": CHAT, "body": {"messages": []}}), None, "no custom_id"),
    (json.dumps(req("c0")), "c0", "duplicate"),  # c0 is also the first good line
    (json.dumps(req("emb", "/v1/embeddings")), "emb", "url='/v1/embeddings' is not supported"),
    (json.dumps({**req("get"), "method": "GET"}), "get", "method='GET'"),
    (json.dumps({"custom_id": "nobody", "method": "POST", "url": CHAT}), "nobody", "body is missing"),
    (json.dumps(req("both", COMPLETIONS, messages=[{"role": "user", "content": "x"}])), "both",
     "both messages and prompt"),
    (json.dumps(req("empty", messages=[])), "empty", "non-empty list"),
    (json.dumps(req("img", messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])),
     "img", "not text"),
    (json.dumps(req("two", COMPLETIONS, prompt=["a", "b"])), "two", "one prompt per line"),
    (json.dumps(req("lp", logprobs=3)), "lp", "must be true or false"),
    (json.dumps(req("rf", response_format={"type": "json_schema", "json_schema": {"name": "x"}})), "rf",
     "schema is missing"),
    (json.dumps(req("nan", temperature=float("nan"))), "nan", "body.temperature (sampling temperature) holds nan"),
    (json.dumps(req("seed", seed=1.5)), "seed", "body.seed (sampling seed) holds 1.5"),
    (json.dumps(req("n0", n=0)), "n0", "n=0 must be an integer >= 1"),
    (json.dumps(req("long", max_tokens=10_000)), "long", "max_model_len"),  # fails in the engine
]


def test_bad_lines_give_error_lines_and_never_stop_the_batch(tmp_path):
    lines = [req("c0"), *[text for text, _, _ in BAD_LINES], req("ünï→😀", COMPLETIONS), req("last")]
    res, out = run_batch(tmp_path, lines)
    assert len(out) == len(lines)  # one output line per input line, in input order
    assert out[0]["error"] is None and out[-1]["error"] is None and out[-2]["error"] is None
    assert out[-2]["custom_id"] == "ünï→😀" and out[-2]["response"]["status_code"] == 200
    for o, (_, cid, fragment) in zip(out[1:-2], BAD_LINES, strict=True):
        assert o["custom_id"] == cid
        assert o["response"]["status_code"] == 400 and o["response"]["body"] is None
        assert o["error"]["code"] == "invalid_request" and fragment in o["error"]["message"], o["error"]
    assert len({o["id"] for o in out}) == len(out)
    gen = pq.read_table(tmp_path / "out" / "generations.parquet").to_pylist()
    assert len(gen) == len(lines) and sum(r["finish_reason"] == "error" for r in gen) == len(BAD_LINES)
    # A line that cannot run under its custom_id (duplicate, missing) is its own row: no id (null: no
    # custom_id can collide with it) or, for a duplicate, the repeated id at its own row index.
    assert {(r["id"], r["index"]) for r in gen} >= {("c0", 0), (None, 1), (None, 3), ("c0", 4), ("ünï→😀", 18)}
    assert res.summary["errors"] == len(BAD_LINES)


def test_parse_line_never_raises_on_odd_json():
    seen: set[str] = set()
    for text in ["null", "1", '"s"', '{"custom_id": 5}', '{"custom_id": "x", "body": 3, "url": "/v1/completions"}',
                 '{"custom_id": "y", "url": "/v1/completions", "body": {"prompt": [true]}}',
                 '{"custom_id": "z", "url": "/v1/chat/completions", "body": {"messages": [{"content": "x"}]}}',
                 '{"custom_id": "w", "url": "/v1/completions", "body": {"prompt": "p", "response_format": "json"}}']:
        line = parse_line(text, 1, seen)
        assert line.error and line.prompt is None, text


def test_interrupted_batch_resumes_and_writes_every_line_once(tmp_path):
    lines = [req(f"r{i}", max_completion_tokens=3, n=2) for i in range(10)] + ["oops"]
    src = batch_file(tmp_path / "batch.jsonl", lines)
    cfg = compose_cfg("workload=openai_batch", f"workload.path={src}", "max_num_seqs=2")
    out = tmp_path / "out"
    eng = FakeEngine(max_num_seqs=2)
    first = run_job(cfg, out, engine=InterruptAfter(eng, 8))
    assert first.interrupted and read_output(out) is None  # written only by a complete run
    run_job(cfg, out, engine=eng)
    got = read_output(out)
    assert [o["custom_id"] for o in got] == [f"r{i}" for i in range(10)] + [None]
    assert all(len(o["response"]["body"]["choices"]) == 2 for o in got[:10]) and got[10]["error"]
    fresh = tmp_path / "fresh"
    run_job(cfg, fresh, engine=FakeEngine(max_num_seqs=2))
    strip = [{**o, "response": {**o["response"], "body": o["response"]["body"] and
                                {k: v for k, v in o["response"]["body"].items() if k != "created"}}} for o in got]
    again = [{**o, "response": {**o["response"], "body": o["response"]["body"] and
                                {k: v for k, v in o["response"]["body"].items() if k != "created"}}}
             for o in read_output(fresh)]
    assert strip == again  # the same file as an uninterrupted run
    assert not list(out.glob("*.tmp"))


def test_openai_batch_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="workload.path is not set"):
        run_job(compose_cfg("workload=openai_batch"), tmp_path / "o", engine=FakeEngine())
    src = batch_file(tmp_path / "b.jsonl", [req("a")])
    with pytest.raises(ConfigError, match="executor=local only"):
        run_job(compose_cfg("workload=openai_batch", f"workload.path={src}", "executor.kind=ray"), tmp_path / "o")


def test_batch_file_on_the_tiny_model(tmp_path, engine):
    """The real engine and byte tokenizer: chat template, token strings, usage from the real counts."""
    lines = [req("chat", max_completion_tokens=3), req("text", COMPLETIONS, max_tokens=2), "{bad"]
    _, out = run_batch(tmp_path, lines, engine=engine)
    assert [o["custom_id"] for o in out] == ["chat", "text", None]
    chat, text = out[0]["response"]["body"], out[1]["response"]["body"]
    assert chat["choices"][0]["finish_reason"] in ("stop", "length")
    assert 1 <= chat["usage"]["completion_tokens"] <= 3 and chat["usage"]["prompt_tokens"] > len("question chat")
    assert text["usage"]["prompt_tokens"] >= len("text text") and text["usage"]["completion_tokens"] <= 2
    assert out[2]["error"]["code"] == "invalid_request"


def test_response_format_json_schema_on_the_tiny_model(tmp_path, engine):
    jsonschema = pytest.importorskip("jsonschema")
    # no free-form strings: a random model rarely closes one within max_tokens
    schema = {"type": "object", "properties": {"colour": {"enum": ["red", "green"]}, "ok": {"type": "boolean"}},
              "required": ["colour", "ok"], "additionalProperties": False}
    rf = {"type": "json_schema", "json_schema": {"name": "item", "schema": schema, "strict": True}}
    lines = [req(f"r{i}", max_completion_tokens=64, temperature=1.0, seed=i, response_format=rf) for i in range(4)]
    _, out = run_batch(tmp_path, lines, engine=engine)
    stopped = 0
    for o in out:
        choice = o["response"]["body"]["choices"][0]
        if choice["finish_reason"] == "stop":
            jsonschema.validate(json.loads(choice["message"]["content"]), schema)
            stopped += 1
    assert stopped >= 2, [o["response"]["body"]["choices"][0] for o in out]


def test_a_bom_and_a_line_that_is_not_utf8(tmp_path):
    src = tmp_path / "batch.jsonl"
    good = [json.dumps(req(c)).encode() for c in ("first", "third")]
    src.write_bytes(b"\xef\xbb\xbf" + good[0] + b"\r\n" + b'{"custom_id": "\xff\xfe"}\n' + good[1] + b"\n")
    cfg = compose_cfg("workload=openai_batch", f"workload.path={src}")
    run_job(cfg, tmp_path / "out", engine=FakeEngine())
    out = read_output(tmp_path / "out")
    assert [o["custom_id"] for o in out] == ["first", None, "third"]
    assert out[0]["error"] is None and out[2]["error"] is None and "not UTF-8" in out[1]["error"]["message"]
