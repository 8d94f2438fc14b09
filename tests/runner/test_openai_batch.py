"""The OpenAI batch source and sink (runner/sources/openai_batch.py, runner/batch_output.py).

workload=openai_batch: OpenAI Batch API input files in, batch_output.jsonl (and the Parquet outputs) out.

The OpenAI batch format as vLLM and OpenAI run it.
"""

from __future__ import annotations

import dataclasses
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


def test_penalties_bias_and_vllms_extra_fields_are_read_not_ignored(tmp_path):
    """presence_penalty, frequency_penalty and logit_bias (OpenAI's; keys as text) and vLLM's extra fields
    were dropped without a word: a line asking for them ran without them."""
    lines = [req("a", presence_penalty=0.5, frequency_penalty=-1.0, logit_bias={"65": -100, "66": 3},
                 repetition_penalty=1.1, min_tokens=2, include_stop_str_in_output=True, skip_special_tokens=False),
             req("b"), req("c", presence_penalty=5)]
    eng = FakeEngine()
    run_batch(tmp_path, lines, "sampling.max_tokens=6", "sampling.presence_penalty=1.5", engine=eng)
    p = eng.params_seen
    assert (p["a"].presence_penalty, p["a"].frequency_penalty, p["a"].logit_bias) == (0.5, -1.0, {65: -100.0, 66: 3.0})
    assert p["a"].repetition_penalty == 1.1 and p["a"].min_tokens == 2
    assert p["a"].include_stop_str_in_output is True and p["a"].skip_special_tokens is False
    assert p["b"].presence_penalty == 0.0 and p["b"].logit_bias is None  # the format's default, not the config's
    out = {o["custom_id"]: o for o in read_output(tmp_path / "out")}
    assert "presence_penalty=5.0 must be in [-2, 2] (0 = off) (from body.presence_penalty)" in out["c"]["error"]["message"]


def test_a_lines_stop_token_ids_and_ignore_eos_are_read_as_vllms_server_reads_them(tmp_path):
    """vLLM's server takes stop_token_ids and ignore_eos from the body: a line asking for them ran without
    them. A line that leaves them out keeps the config's."""
    lines = [req("a", stop_token_ids=[5, "6"], ignore_eos=True), req("b"), req("c", stop_token_ids=[1.5]),
             req("d", ignore_eos="maybe")]
    eng = FakeEngine()
    run_batch(tmp_path, lines, "sampling.stop_token_ids=[9]", engine=eng)
    p = eng.params_seen
    assert (p["a"].stop_token_ids, p["a"].ignore_eos) == ([5, 6], True)
    assert (p["b"].stop_token_ids, p["b"].ignore_eos) == ([9], False)
    out = {o["custom_id"]: o for o in read_output(tmp_path / "out")}
    assert "body.stop_token_ids" in out["c"]["error"]["message"] and "body.ignore_eos" in out["d"]["error"]["message"]


def test_a_bias_beyond_openais_range_is_clamped_to_it_as_vllms_server_does(tmp_path):
    """vLLM's server clamps every logit_bias to [-100, 100]: a line with 500 runs with 100, and one with
    1e39 (past float32, which SamplingParams refuses) runs rather than failing."""
    lines = [req("a", logit_bias={"65": 500, "66": -1e39, "67": 7.5, "68": 10**400, "69": "-500"}), req("b", logit_bias={"65": "x"})]
    eng = FakeEngine()
    run_batch(tmp_path, lines, engine=eng)
    assert eng.params_seen["a"].logit_bias == {65: 100.0, 66: -100.0, 67: 7.5, 68: 100.0, 69: -100.0}
    out = {o["custom_id"]: o for o in read_output(tmp_path / "out")}
    assert out["a"]["error"] is None and "logit_bias" in out["b"]["error"]["message"]


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


class FailSamples:
    """Samples `ks` of every request fail right after the fork (their first token drawn)."""

    def __init__(self, eng, ks):
        self.eng, self.ks = eng, set(ks)

    def __getattr__(self, name):
        return getattr(self.eng, name)

    def step(self):
        outs = []
        for o in self.eng.step():
            if o.sample_index in self.ks and o.finish_reason != "error":
                self.eng.running = [r for r in self.eng.running
                                    if not (r.id == o.request_id and r.sample_index == o.sample_index)]
                o = dataclasses.replace(o, finished=True, finish_reason="error", error=f"boom {o.sample_index}")
            outs.append(o)
        return outs


# -- 7: failed samples ---------------------------------------------------------------------------------


def test_failed_samples_keep_their_index_say_why_and_count_in_usage(tmp_path):
    """With n=8 and 3 failing samples the line said 200 with 5 choices renumbered 0-4, usage left the
    failed samples out and error was null."""
    eng = FailSamples(FakeEngine(max_num_seqs=8), {2, 5, 7})
    _, out = run_batch(tmp_path, [req("a", n=8, max_tokens=3), req("b", COMPLETIONS, n=2, max_tokens=3)],
                       "max_num_seqs=8", engine=eng)
    gen = {(r["id"], r["sample_index"]): r for r in pq.read_table(tmp_path / "out" / "generations.parquet").to_pylist()}
    line = out[0]
    assert line["response"]["status_code"] == 200
    choices = line["response"]["body"]["choices"]
    assert [c["index"] for c in choices] == list(range(8))  # each its own sample index
    for c in choices:
        row = gen[("a", c["index"])]
        if c["index"] in (2, 5, 7):
            assert c["finish_reason"] == "error" and c["error"] == {"code": "generation_failed",
                                                                     "message": f"boom {c['index']}"}
        else:
            assert c["finish_reason"] == "length" and "error" not in c
            assert c["message"]["content"] == row["output_text"]
    usage = line["response"]["body"]["usage"]
    assert usage["completion_tokens"] == sum(gen[("a", k)]["output_tokens"] for k in range(8))
    assert gen[("a", 2)]["output_tokens"] >= 1  # the failed samples' tokens are counted too
    assert line["error"]["code"] == "samples_failed"
    assert "3 of 8 samples failed" in line["error"]["message"] and "sample 5: boom 5" in line["error"]["message"]
    assert out[1]["error"] is None and [c["index"] for c in out[1]["response"]["body"]["choices"]] == [0, 1]


# -- 8: the format's defaults -----------------------------------------------------------------------------


def test_a_line_without_temperature_samples_as_openai_does_not_greedy(tmp_path):
    """The config's sampling.temperature (0: greedy in conf/config.yaml) applied to every line that left
    temperature out: n=3 gave three identical choices. The format's defaults are OpenAI's."""
    eng = FakeEngine()
    lines = [req("plain", n=3), req("own", temperature=0.2, top_p=0.5, top_k=4, min_p=0.1),
             req("c", COMPLETIONS)]
    run_batch(tmp_path, lines, "sampling.temperature=0", "sampling.top_p=0.3", "sampling.top_k=7", "sampling.n=2",
              "sampling.stop=[zz]", "sampling.logprobs=3", "sampling.max_tokens=5", "sampling.seed=11", engine=eng)
    p = eng.params_seen
    for rid in ("plain", "c"):
        assert (p[rid].temperature, p[rid].top_p, p[rid].top_k, p[rid].min_p) == (1.0, 1.0, 0, 0.0)
        assert p[rid].stop == [] and p[rid].logprobs is None  # the format's: no stop, no logprobs
    assert p["plain"].n == 3 and p["c"].n == 1
    assert (p["own"].temperature, p["own"].top_p, p["own"].top_k, p["own"].min_p) == (0.2, 0.5, 4, 0.1)
    # what the format leaves open stays the config's: max_tokens (the server's bound) and the seed
    assert p["plain"].max_tokens == 5 and p["plain"].seed == 11 and p["own"].seed == 12


def test_a_line_without_temperature_takes_the_models_generation_config_as_vllm_does(tmp_path):
    from tests.conftest import TINY_HF_MODELS

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
                                                   **TINY_HF_MODELS["qwen3"][1]}))
    (model / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_p": 0.95, "top_k": 20,
                                                              "do_sample": True, "eos_token_id": 1}))
    eng = FakeEngine()
    run_batch(tmp_path, [req("plain"), req("own", temperature=0.0)], f"model.path={model}",
              "model.random_weights=true", "model.architecture=null", engine=eng)
    p = eng.params_seen
    assert (p["plain"].temperature, p["plain"].top_p, p["plain"].top_k, p["plain"].min_p) == (0.6, 0.95, 20, 0.0)
    assert p["own"].temperature == 0.0 and p["own"].top_p == 0.95


# -- 9: logprob caps, scoring lines, ids ------------------------------------------------------------------


@pytest.mark.parametrize("line,fragment", [
    (req("chat", logprobs=True, top_logprobs=21), "body.top_logprobs=21 is more than 20"),
    (req("comp", COMPLETIONS, logprobs=50), "body.logprobs=50 is more than 20"),
    (req("zero", max_completion_tokens=0), "max_tokens=0 generates nothing"),
    (req("zero2", COMPLETIONS, max_tokens=0), "max_tokens=0 generates nothing"),
])
def test_lines_the_format_refuses_are_error_lines_naming_the_field(tmp_path, line, fragment):
    _, out = run_batch(tmp_path, [line, req("ok", top_logprobs=20, logprobs=True)])
    assert out[0]["response"]["status_code"] == 400 and fragment in out[0]["error"]["message"], out[0]
    assert out[1]["error"] is None
    assert len(out[1]["response"]["body"]["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 20


def test_a_scoring_line_echoes_the_prompt_with_its_logprobs(tmp_path):
    """max_tokens: 0 with echo and logprobs (OpenAI's and vLLM's way to score a text) was refused."""
    lines = [req("score", COMPLETIONS, prompt="the cat", max_tokens=0, echo=True, logprobs=1),
             req("echo", COMPLETIONS, prompt="hey", max_tokens=2, echo=True, logprobs=0),
             req("bare", COMPLETIONS, prompt=[104, 105], max_tokens=0, echo=True)]
    eng = FakeEngine()
    _, out = run_batch(tmp_path, lines, engine=eng)
    assert all(o["error"] is None for o in out), out
    score = out[0]["response"]["body"]
    c = score["choices"][0]
    assert c["text"] == "the cat" and c["finish_reason"] == "length"
    ids = list(b"the cat")
    lp = c["logprobs"]
    assert lp["tokens"] == [chr(t) for t in ids] and lp["text_offset"] == list(range(len(ids)))
    assert lp["token_logprobs"][0] is None and lp["token_logprobs"][1:] == pytest.approx(
        [fake_logprob(t) for t in ids[1:]])
    assert lp["top_logprobs"][0] is None and all(len(t) == 1 for t in lp["top_logprobs"][1:])
    assert score["usage"] == {"prompt_tokens": 7, "completion_tokens": 0, "total_tokens": 7}
    echo = out[1]["response"]["body"]["choices"][0]
    gen = {r["id"]: r for r in pq.read_table(tmp_path / "out" / "generations.parquet").to_pylist()}
    assert echo["text"] == "hey" + gen["echo"]["output_text"]
    assert echo["logprobs"]["tokens"][:3] == ["h", "e", "y"] and len(echo["logprobs"]["tokens"]) == 3 + 2
    assert echo["logprobs"]["top_logprobs"][3:] == [{}, {}]  # logprobs=0: the chosen token only
    assert out[2]["response"]["body"]["choices"][0]["text"] == "hi"  # token ids echoed as their text
    assert out[2]["response"]["body"]["choices"][0]["logprobs"] is None
    assert eng.params_seen["score"].prompt_logprobs == 1 and eng.params_seen["echo"].prompt_logprobs == 0
    assert eng.params_seen["bare"].max_tokens == 0


def test_a_real_custom_id_never_collides_with_a_line_that_has_none(tmp_path):
    """A line without a usable custom_id was written as '<line N>', which a real custom_id can be: the
    two rows shared an id, batch_output gave the real line the bad line's row, and resume mixed them."""
    lines = [req("<line 2>", max_tokens=2), "{not json", req("<line 2>", max_tokens=2), req("x", max_tokens=2),
             {"custom_id": 7, "method": "POST", "url": "/v1/completions", "body": {"prompt": "p"}}]
    _, out = run_batch(tmp_path, lines)
    assert [o["custom_id"] for o in out] == ["<line 2>", None, "<line 2>", "x", "7"]
    assert out[0]["error"] is None and out[0]["response"]["body"]["choices"][0]["finish_reason"] == "length"
    assert [o["response"]["status_code"] for o in out] == [200, 400, 400, 200, 400]
    assert "duplicate id '<line 2>'" in out[2]["error"]["message"] and "line 3" in out[2]["error"]["message"]
    gen = pq.read_table(tmp_path / "out" / "generations.parquet").to_pylist()
    ids = {(r["id"], r["index"]) for r in gen}
    assert ids == {("<line 2>", 0), (None, 1), ("<line 2>", 2), ("x", 3), (None, 4)}
    # a rerun into the directory finds every line done: no row twice, the same output
    again = run_job(compose_cfg("workload=openai_batch", f"workload.path={tmp_path / 'batch.jsonl'}"),
                    tmp_path / "out", engine=FakeEngine())
    assert again.summary["resumed"] == 5 and pq.read_table(tmp_path / "out" / "generations.parquet").num_rows == 5
    assert [o["error"] is None for o in read_output(tmp_path / "out")] == [o["error"] is None for o in out]


def test_an_interrupted_batch_with_lines_without_ids_resumes_each_line_once(tmp_path):
    from tests.runner.test_job import InterruptAfter

    lines = ["{bad", req("a", max_tokens=3), "[1]", req("b", max_tokens=3), "{also bad"]
    src = batch_file(tmp_path / "batch.jsonl", lines)
    cfg = compose_cfg("workload=openai_batch", f"workload.path={src}", "max_num_seqs=1")
    first = run_job(cfg, tmp_path / "out", engine=InterruptAfter(FakeEngine(max_num_seqs=1), 3))
    assert first.interrupted
    run_job(cfg, tmp_path / "out", engine=FakeEngine(max_num_seqs=1))
    gen = pq.read_table(tmp_path / "out" / "generations.parquet").to_pylist()
    assert sorted(r["index"] for r in gen) == [0, 1, 2, 3, 4]
    assert [o["custom_id"] for o in read_output(tmp_path / "out")] == [None, "a", None, "b", None]


def test_a_custom_id_holding_a_line_separator_stays_on_its_output_line(tmp_path):
    """JSON keeps U+2028, U+2029 and U+0085 raw in strings; str.splitlines (and other readers) split the
    output line there (found by the fuzz test)."""
    _, out = run_batch(tmp_path, [req("a\u2028b\x85c\u2029"), req("d")])
    assert [o["custom_id"] for o in out] == ["a\u2028b\x85c\u2029", "d"]
