"""The OpenAI batch format as vLLM and OpenAI run it."""

from __future__ import annotations

import dataclasses
import json

import pyarrow.parquet as pq
import pytest

from ladle.runner.job import run_job
from tests.runner.conftest import compose_cfg
from tests.runner.fake_engine import FakeEngine, fake_logprob
from tests.runner.test_openai_batch import COMPLETIONS, batch_file, read_output, req, run_batch


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
