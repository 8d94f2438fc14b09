"""How a structured request ends: a grammar without stop tokens ends
when it allows nothing more or when the model draws a token it would not take, never at its shortest
match; a request's own stop_token_ids pass the grammar's mask; stop ids outside the vocabulary are
the request's error, never the engine's; a stop string is found in text released at any ending."""

from __future__ import annotations

import re
from pathlib import Path

import torch
import yaml

from ladle.engine import CacheConfig, ChunkingConfig, EngineConfig, LLMEngine, ModelConfig, SamplingParams
from ladle.engine.output_processor import OutputProcessor
from ladle.engine.request import Request, RequestMetrics
from ladle.engine.sampling_params import StructuredOutputs
from ladle.engine.structured_output import StructuredOutputManager
from ladle.models.tokenizer import ByteTokenizer
from tests.engine.helpers import random_prompt, run_to_completion

TINY = yaml.safe_load((Path(__file__).parents[2] / "ladle" / "conf" / "model" / "tiny.yaml").read_text())
NO_STOP = ByteTokenizer(259, specials=False)


def grammar_request(stop_token_ids=(), **spec) -> Request:
    p = SamplingParams(max_tokens=32, temperature=1.0, stop_token_ids=list(stop_token_ids),
                       structured=StructuredOutputs(**spec))
    return Request("r", [1], p, RequestMetrics(arrival_time=0.0))


def advance(mgr: StructuredOutputManager, req: Request, text: bytes) -> None:
    for token in text:
        mgr.apply_masks(torch.zeros(1, 259), [req])
        assert mgr.verdict(req, token) is None
        mgr.accept(req, token)


def test_without_stop_tokens_a_complete_grammar_lets_the_model_choose_to_go_on_or_end():
    mgr = StructuredOutputManager(NO_STOP, 259, eos_ids=[])
    req = grammar_request(regex="[a-z]{3,8}")
    mgr.submit(req)
    advance(mgr, req, b"ab")
    logits = torch.zeros(1, 259)
    mgr.apply_masks(logits, [req])
    assert torch.isinf(logits).sum() == 259 - 26  # not yet complete: letters only
    advance(mgr, req, b"c")
    logits = torch.zeros(1, 259)
    mgr.apply_masks(logits, [req])
    assert not torch.isinf(logits).any()  # complete and could go on: the model decides
    assert mgr.verdict(req, ord("d")) is None  # a letter continues it
    assert mgr.verdict(req, ord("1")) == ("stop", None)  # anything else is the model ending it
    advance(mgr, req, b"defgh")  # 8 letters: nothing more is allowed
    mgr.apply_masks(torch.zeros(1, 259), [req])
    assert mgr.verdict(req, ord("z")) == ("stop", None)


def no_eos_engine() -> LLMEngine:
    eng = LLMEngine(EngineConfig(model=ModelConfig(**TINY, device="cpu", dtype="float32"),
                                 cache=CacheConfig(max_model_len=128), chunking=ChunkingConfig(size=16)))
    eng.output_processor.eos_token_ids = set()
    eng.structured = StructuredOutputManager(eng.tokenizer, eng.vocab_size, [])  # no stop token at all
    eng.input_processor.structured = eng.structured
    eng.updater.structured = eng.structured
    return eng


def test_an_engine_without_stop_tokens_does_not_always_stop_at_the_shortest_match():
    """Before: regex [a-z]{3,8} gave 3 letters, an integer one digit, every time."""
    eng = no_eos_engine()
    specs = [{"regex": "[ -/:-~]{2,12}"}, {"json_schema": {"type": "integer"}}]
    ids = {}
    for k, spec in enumerate(specs):
        for s in range(12):
            sp = SamplingParams(max_tokens=16, temperature=1.0, seed=s, structured=StructuredOutputs(**spec))
            ids[eng.add_request(random_prompt(6, seed=10 * k + s, vocab=256), sp)] = k
    done = run_to_completion(eng)
    lengths = {0: [], 1: []}
    for rid, k in ids.items():
        out = done[rid]
        assert out.finish_reason == "stop", (out.text, out.error)
        assert re.fullmatch(r"[ -/:-~]{2,12}" if k == 0 else r"-?(0|[1-9][0-9]*)", out.text), out.text
        lengths[k].append(len(out.text))
    # a near-uniform random model puts ~17% of its mass on the regex's characters: it goes on sometimes
    assert max(lengths[0]) > 2 and len(set(lengths[0])) > 1, lengths[0]


def test_a_requests_own_stop_token_passes_the_grammar_mask():
    """A control-character stop token (byte 0x01) with no EOS: a complete object ends on it."""
    mgr = StructuredOutputManager(NO_STOP, 259, eos_ids=[])
    req = grammar_request(stop_token_ids=[1], json_schema={"type": "object", "properties": {
        "a": {"type": "integer"}}, "required": ["a"]})
    mgr.submit(req)
    advance(mgr, req, b'{"a": 1}')
    logits = torch.zeros(1, 259)
    mgr.apply_masks(logits, [req])
    assert logits[0, 1] == 0.0  # allowed
    assert mgr.verdict(req, 1) is None and mgr.accept(req, 1)  # it ends the grammar: "stop"


def test_stop_ids_outside_the_vocabulary_fail_only_their_request():
    eng = LLMEngine(EngineConfig(model=ModelConfig(**TINY, device="cpu", dtype="float32"),
                                 cache=CacheConfig(max_model_len=128)))
    bad = eng.add_request("hi", SamplingParams(max_tokens=4, stop_token_ids=[7, 10**6],
                                               structured=StructuredOutputs(regex="[a-z]+")))
    plain = eng.add_request("hi", SamplingParams(max_tokens=4, ignore_eos=True))
    structured = eng.add_request("hi", SamplingParams(max_tokens=4, structured=StructuredOutputs(regex="[a-z]+")))
    done = run_to_completion(eng)
    assert done[bad].finish_reason == "error" and "1000000" in done[bad].error and "stop_token_ids" in done[bad].error
    assert done[plain].finish_reason == "length" and done[structured].finish_reason in ("length", "stop")
    again = eng.add_request("hi", SamplingParams(max_tokens=2, ignore_eos=True))  # the engine still serves
    assert run_to_completion(eng)[again].finish_reason == "length"


def test_a_stop_string_in_the_text_released_at_an_error_ending_cuts_it():
    out = OutputProcessor(NO_STOP, eos_token_ids=set(), max_model_len=100)
    req = Request("r", [1], SamplingParams(max_tokens=10, stop=["a\ufffd"]), RequestMetrics(arrival_time=0.0))
    out.start(req)
    for token in (ord("x"), ord("a"), 0xC3):  # 0xC3 starts a 2-byte character: held back
        req.output_token_ids.append(token)
        assert out.take_token(req, token, grammar_ended=False) is None
    assert req.text == "xa"
    out.flush(req)  # an error ends it: the incomplete character is released as U+FFFD
    assert req.text == "x"
