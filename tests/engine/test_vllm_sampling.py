"""vLLM's sampling parameters with vLLM's meanings: top_k=-1, max_tokens=None, min_tokens, the presence /
frequency / repetition penalties (over prompt and output tokens as vLLM's apply_penalties), logit_bias,
include_stop_str_in_output, skip_special_tokens, and a stop token's own text left out of the output.

The logits processors are checked against a reference written here token by token over transformers'
logits (the oracle): greedy decoding of the processed logits must give the engine's tokens.
"""

from __future__ import annotations

import math

import pytest
import torch

from ladle.engine import CacheConfig, ChunkingConfig, EngineConfig, LLMEngine, ModelConfig, SamplingParams
from ladle.engine.sampling_params import StructuredOutputs
from ladle.models.tokenizer import ByteTokenizer
from tests.conftest import build_tiny_hf_model
from tests.engine.helpers import make_engine, random_prompt, use_tokenizer

PROMPT = random_prompt(12, seed=31)
_HF: dict[str, torch.nn.Module] = {}


@pytest.fixture(scope="module")
def path(tiny_hf_model_dir):
    return tiny_hf_model_dir("llama")


def hf_logits(tokens: list[int]) -> torch.Tensor:
    if "llama" not in _HF:
        _HF["llama"] = build_tiny_hf_model("llama")
    with torch.no_grad():
        return _HF["llama"](torch.tensor([tokens])).logits[0, -1].double()


def processed(logits: torch.Tensor, prompt: list[int], output: list[int], p: SamplingParams,
              eos: set[int]) -> torch.Tensor:
    """vLLM's processing, one token at a time: logit_bias, min_tokens, then the penalties."""
    x = logits.clone()
    for t, b in (p.logit_bias or {}).items():
        x[t] += b
    if len(output) < p.min_tokens:
        for t in set(p.stop_token_ids) | (set() if p.ignore_eos else eos):
            x[t] = -math.inf
    for t in set(prompt) | set(output):  # repetition: prompt and output tokens
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in set(output):  # frequency and presence: output tokens only
        x[t] -= p.frequency_penalty * output.count(t) + p.presence_penalty
    return x


def reference_greedy(p: SamplingParams, eos: set[int] = frozenset()) -> list[int]:
    out: list[int] = []
    while len(out) < p.max_tokens:
        out.append(int(processed(hf_logits(PROMPT + out), PROMPT, out, p, eos).argmax()))
        if out[-1] in eos and len(out) >= p.min_tokens and not p.ignore_eos:
            break
    return out


CASES = [
    {"repetition_penalty": 1.8},
    {"repetition_penalty": 0.6},
    {"frequency_penalty": 1.5},
    {"presence_penalty": 2.0},
    {"presence_penalty": -1.0, "frequency_penalty": 0.7, "repetition_penalty": 1.3},
    {"logit_bias": {7: 6.0, 11: 3.5}},
]


@pytest.mark.parametrize("extra", CASES, ids=[str(c) for c in CASES])
def test_penalties_and_logit_bias_match_the_reference(path, extra):
    p = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, **extra)
    got = make_engine(path).generate([PROMPT], p)[0].output_token_ids
    plain = make_engine(path).generate([PROMPT], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    assert got == reference_greedy(p)
    assert got != plain[0].output_token_ids  # power: the case changes the output


def test_min_tokens_masks_eos_and_stop_tokens_until_reached(path):
    plain = make_engine(path).generate([PROMPT], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    first = plain[0].output_token_ids
    eos = {first[1]}  # the model's second greedy token plays EOS, a later one a stop token
    p = SamplingParams(max_tokens=16, temperature=0.0, min_tokens=6, stop_token_ids=[first[3]])
    eng = make_engine(path)
    eng.output_processor.eos_token_ids = eos
    out = eng.generate([PROMPT], p)[0]
    want = reference_greedy(p, eos)
    stops = eos | {first[3]}
    end = next((i for i, t in enumerate(want) if t in stops and i + 1 >= p.min_tokens), len(want) - 1)
    assert out.output_token_ids == want[: end + 1]
    assert len(out.output_token_ids) >= 6 and not stops & set(out.output_token_ids[:6])
    unmasked = make_engine(path)
    unmasked.output_processor.eos_token_ids = eos
    assert len(unmasked.generate([PROMPT], SamplingParams(max_tokens=16, temperature=0.0))[0].output_token_ids) == 2


def test_top_k_minus_one_is_every_token_and_max_tokens_none_fills_the_context(path):
    seeded = {"max_tokens": 8, "temperature": 1.0, "seed": 5, "ignore_eos": True}
    eng = make_engine(path, max_model_len=64)
    off, minus_one = eng.generate([PROMPT, PROMPT], [SamplingParams(top_k=0, **seeded),
                                                     SamplingParams(top_k=-1, **seeded)])
    assert minus_one.finish_reason == "length" and minus_one.output_token_ids == off.output_token_ids
    whole = eng.generate([PROMPT], SamplingParams(max_tokens=None, temperature=0.0, ignore_eos=True))[0]
    assert whole.finish_reason == "length" and len(whole.output_token_ids) == 64 - len(PROMPT)


def byte_engine(path):
    eng = make_engine(path)
    use_tokenizer(eng, ByteTokenizer(384))  # <bos> <eos> <pad> are special tokens here
    return eng


def test_a_stop_tokens_text_is_left_out_unless_asked_for(path):
    eng = byte_engine(path)
    text_ids = [65, 66, 67, 68, 69, 70]
    bias = {t: 60.0 - 8 * i for i, t in enumerate(text_ids)}  # decodes "ABCD..." in order
    base = {"max_tokens": 12, "temperature": 0.0, "logit_bias": bias, "repetition_penalty": 100.0}
    plain = eng.generate([PROMPT], SamplingParams(**base))[0]
    assert plain.output_token_ids[:4] == text_ids[:4]
    cut, kept = eng.generate([PROMPT, PROMPT], [SamplingParams(stop_token_ids=[68], **base),
                                                SamplingParams(stop_token_ids=[68], include_stop_str_in_output=True,
                                                               **base)])
    assert cut.output_token_ids == kept.output_token_ids == [65, 66, 67, 68]
    assert cut.text == "ABC" and kept.text == "ABCD"
    strings = eng.generate([PROMPT, PROMPT], [SamplingParams(stop=["CD"], **base),
                                              SamplingParams(stop=["CD"], include_stop_str_in_output=True, **base)])
    assert [o.text for o in strings] == ["AB", "ABCD"] and all(o.finish_reason == "stop" for o in strings)


def test_skip_special_tokens_false_keeps_their_text(path):
    eng = byte_engine(path)
    base = {"max_tokens": 3, "temperature": 0.0, "ignore_eos": True, "logit_bias": {65: 40.0, 258: 30.0},
            "repetition_penalty": 100.0}  # "A", then <pad>, then something else
    skip, keep = eng.generate([PROMPT, PROMPT], [SamplingParams(**base),
                                                 SamplingParams(skip_special_tokens=False, **base)])
    assert skip.output_token_ids[:2] == keep.output_token_ids[:2] == [65, 258]
    assert "<pad>" in keep.text and "<pad>" not in skip.text and keep.text.startswith("A<pad>")


@pytest.mark.parametrize("params,needle", [
    (SamplingParams(min_tokens=-1), "min_tokens=-1"),
    (SamplingParams(min_tokens=20, max_tokens=10), "min_tokens=20 must be at most max_tokens=10"),
    (SamplingParams(presence_penalty=2.5), "presence_penalty=2.5 must be in [-2, 2]"),
    (SamplingParams(frequency_penalty=float("nan")), "frequency_penalty=nan"),
    (SamplingParams(repetition_penalty=0.0), "repetition_penalty=0.0 must be a finite number > 0"),
    (SamplingParams(logit_bias={"a": 1.0}), "logit_bias="),
    (SamplingParams(logit_bias={5: float("inf")}), "logit_bias="),
    (SamplingParams(logit_bias={10**6: 1.0}), "logit_bias token ids [1000000] are outside the vocabulary"),
    (SamplingParams(top_k=-2), "top_k=-2"),
    (SamplingParams(skip_special_tokens="no"), "skip_special_tokens='no' must be true or false"),
])
def test_bad_values_fail_the_request_naming_them(path, params, needle):
    eng = make_engine(path)
    out = eng.generate([PROMPT], params)[0]
    assert out.finish_reason == "error" and needle in out.error, out.error


def test_stop_strings_are_looked_for_only_past_min_tokens(path):
    eng = byte_engine(path)
    base = {"max_tokens": 6, "temperature": 0.0, "logit_bias": {65: 60.0, 66: 52.0, 67: 44.0, 68: 36.0},
            "repetition_penalty": 100.0, "stop": ["B"]}  # decodes "ABCD..."
    early, late = eng.generate([PROMPT, PROMPT], [SamplingParams(**base), SamplingParams(min_tokens=3, **base)])
    assert early.text == "A" and early.finish_reason == "stop"
    assert late.text.startswith("ABCD") and late.finish_reason == "length"  # "B" came with token 2 of 3


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_grammar_that_allows_only_its_end_ends_the_output_before_min_tokens(path, temperature):
    """min_tokens masks the stop tokens; a grammar that has nothing left but its end token would leave
    no token at all (every logit -inf: a NaN draw of token 0, which the grammar rejects). The grammar's
    end wins: the output is complete and valid."""
    eng = make_engine(path)
    base = {"max_tokens": 8, "temperature": temperature, "seed": 3, "structured": StructuredOutputs(choice=["ab"])}
    out, free = eng.generate([PROMPT, PROMPT], [SamplingParams(min_tokens=5, **base), SamplingParams(**base)])
    assert (out.finish_reason, out.error) == ("stop", None) and out.text.startswith("ab")
    assert (out.output_token_ids, out.text) == (free.output_token_ids, free.text)  # as without min_tokens


def test_processed_draws_stay_bitwise_across_chunking_batching_and_prefix_hits(tiny_hf_model_dir):
    """deterministic=true: seeded draws through every logits processor (bias, min_tokens, the three
    penalties, top-p, n > 1 forks) give the same tokens and logprobs, bit for bit, whether the prompts
    are prefilled whole one at a time, in chunks of 4 beside each other, or in chunks of 7 with prefix hits."""
    prompts = [random_prompt(9 + 5 * i, seed=70 + i) for i in range(5)]
    ps = [SamplingParams(max_tokens=12, temperature=0.8, seed=i, top_p=0.9, repetition_penalty=1.3,
                         frequency_penalty=0.5, presence_penalty=-0.5, min_tokens=4, logit_bias={7: 1.5}, logprobs=2,
                         n=1 + i % 2) for i in range(5)]
    runs = []
    for max_num_seqs, kw in [(1, {"enabled": False}), (8, {"size": 4}), (3, {"size": 7, "block_size": 4})]:
        cache = {"block_size": kw.pop("block_size", 16), "prefix_caching": max_num_seqs == 3}
        eng = LLMEngine(EngineConfig(model=ModelConfig(path=str(tiny_hf_model_dir("qwen3")), dtype="float32",
                                                       device="cpu"),
                                     cache=CacheConfig(max_model_len=96, **cache), chunking=ChunkingConfig(**kw),
                                     max_num_seqs=max_num_seqs, deterministic=True))
        runs.append([(o.sample_index, list(o.output_token_ids), list(o.logprobs)) for o in eng.generate(prompts, ps)])
    assert len(runs[0]) == 7 and runs[1] == runs[0] and runs[2] == runs[0]


def test_min_tokens_past_the_room_of_max_tokens_none_runs_to_the_context_end(path):
    """max_tokens=None is the prompt's room in max_model_len; a min_tokens beyond it is no error (the
    user set no max_tokens it could exceed): as in vLLM, stop tokens stay masked and the output ends at
    the context's end."""
    eng = make_engine(path, max_model_len=64)
    eng.output_processor.eos_token_ids = {reference_greedy(SamplingParams(max_tokens=2, temperature=0.0))[1]}
    out = eng.generate([PROMPT], SamplingParams(max_tokens=None, min_tokens=60, temperature=0.0))[0]
    assert (out.finish_reason, out.error, len(out.output_token_ids)) == ("length", None, 64 - len(PROMPT))
    assert not eng.output_processor.eos_token_ids & set(out.output_token_ids)
