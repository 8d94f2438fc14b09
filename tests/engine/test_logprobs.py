"""Logprobs and prompt logprobs: the raw model's log_softmax, checked against transformers.

Every generated and prompt position is compared with transformers' log_softmax of the same fp32 model
within 1e-4, for chunk sizes 1, 3, 8, unchunked, a ubatch-split step and prefix caching on.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from ladle.engine import SamplingParams
from tests.conftest import build_tiny_hf_model
from tests.engine.helpers import drive, make_engine, random_prompt

TOL = 1e-4
CHUNKINGS = {
    "chunk1": {"size": 1},
    "chunk3": {"size": 3},
    "chunk8": {"size": 8},
    "unchunked": {"enabled": False},
    "ubatch": {"size": 8, "ubatch": 5},
    "prefix_cache": {"size": 8, "prefix_caching": True, "block_size": 4},
}

_HF: dict[str, torch.nn.Module] = {}


def hf_model(name: str = "llama"):
    if name not in _HF:
        _HF[name] = build_tiny_hf_model(name)
    return _HF[name]


def hf_logprobs(name: str, tokens: list[int]) -> torch.Tensor:
    """transformers' log_softmax over the vocabulary at every position of `tokens` (row i predicts i + 1)."""
    with torch.no_grad():
        logits = hf_model(name)(torch.tensor([tokens])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def run(eng, max_steps: int = 10_000) -> dict[tuple[str, int], object]:
    """Step until idle; {(request_id, sample_index): final output}; the pool must be whole again."""
    done = {}
    for _ in range(max_steps):
        if not eng.has_unfinished_requests():
            break
        for out in eng.step():
            if out.finished:
                key = (out.request_id, out.sample_index)
                assert key not in done, f"{key} finished twice"
                done[key] = out
    assert not eng.has_unfinished_requests()
    assert eng.num_free_blocks() == eng.num_total_blocks(), "KV blocks leaked"
    eng.kv.pool.check_invariants()
    return done


def check_against_hf(
    out, k: int | None, prompt_k: int | None, name: str = "llama", vocab_limit: int = 384
) -> None:
    """Every logprob and top-k list of `out` equals transformers' (None: that kind was not asked for)."""
    tokens = out.prompt_token_ids + out.output_token_ids
    ref = hf_logprobs(name, tokens)
    n = len(out.prompt_token_ids)
    if k is None:
        assert out.logprobs is None and out.top_logprobs is None
    else:
        assert len(out.logprobs) == len(out.top_logprobs) == len(out.output_token_ids)
    for j, tok in enumerate(out.output_token_ids if k is not None else []):
        row = ref[n - 1 + j]
        assert abs(out.logprobs[j] - row[tok].item()) < TOL, (j, out.logprobs[j], row[tok].item())
        check_top(out.top_logprobs[j], row, k, vocab_limit)
    if prompt_k is None:
        assert out.prompt_logprobs is None and out.prompt_top_logprobs is None
        return
    assert len(out.prompt_logprobs) == len(out.prompt_top_logprobs) == n
    assert out.prompt_logprobs[0] is None and out.prompt_top_logprobs[0] == []
    for i in range(1, n):
        row = ref[i - 1]
        got = out.prompt_logprobs[i]
        assert abs(got - row[tokens[i]].item()) < TOL, (i, got, row[tokens[i]].item())
        check_top(out.prompt_top_logprobs[i], row, prompt_k, vocab_limit)


def check_top(top: list[tuple[int, float]], row: torch.Tensor, k: int, vocab_limit: int) -> None:
    vals, ids = row[:vocab_limit].topk(k) if k else (torch.empty(0), torch.empty(0, dtype=torch.long))
    assert [t for t, _ in top] == ids.tolist()
    assert all(abs(v - r) < TOL for (_, v), r in zip(top, vals.tolist()))
    assert all(a[1] >= b[1] for a, b in itertools.pairwise(top)), "best first"


@pytest.mark.parametrize("chunking", list(CHUNKINGS))
def test_logprobs_equal_transformers_at_every_position(tiny_hf_model_dir, chunking):
    kw = dict(CHUNKINGS[chunking])
    eng = make_engine(tiny_hf_model_dir("llama"), **kw)
    prompts = [random_prompt(n, seed=n) for n in (1, 2, 7, 13, 21)]
    if chunking == "prefix_cache":  # a cached prefix must not cut positions out of prompt logprobs
        eng.generate([prompts[-1][:16]], SamplingParams(max_tokens=1, temperature=0.0))
    params = [
        SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=3, prompt_logprobs=2),
        SamplingParams(max_tokens=5, temperature=0.8, seed=1, ignore_eos=True, logprobs=0, prompt_logprobs=0),
        SamplingParams(max_tokens=4, temperature=1.3, top_k=5, ignore_eos=True, logprobs=4),
        SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=1, prompt_logprobs=5),
        SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, logprobs=2, prompt_logprobs=1),
    ]
    for i, (p, sp) in enumerate(zip(prompts, params)):
        eng.add_request(p, sp, request_id=f"r{i}")
    done = run(eng)
    assert len(done) == len(prompts)
    for i, sp in enumerate(params):
        check_against_hf(done[(f"r{i}", 0)], sp.logprobs, sp.prompt_logprobs)


def test_logprobs_are_raw_not_after_temperature_or_filters(tiny_hf_model_dir):
    """A hot, top-p-filtered sampler still reports the model's own log_softmax (vLLM's default)."""
    path = tiny_hf_model_dir("llama")
    prompt = random_prompt(9, seed=3)
    hot = make_engine(path).generate([prompt], SamplingParams(
        max_tokens=6, temperature=2.0, top_p=0.5, seed=5, ignore_eos=True, logprobs=2))[0]
    check_against_hf(hot, 2, None)


def test_scoring_max_tokens_zero(tiny_hf_model_dir):
    eng = make_engine(tiny_hf_model_dir("llama"), size=4)
    prompt = random_prompt(11, seed=4)
    eng.add_request(prompt, SamplingParams(max_tokens=0, prompt_logprobs=1), request_id="s")
    eng.add_request([prompt[0]], SamplingParams(max_tokens=0, prompt_logprobs=3), request_id="one")
    done = run(eng)
    out = done[("s", 0)]
    assert out.finish_reason == "length" and out.output_token_ids == [] and out.error is None
    check_against_hf(out, None, 1)
    one = done[("one", 0)]
    assert one.finish_reason == "length" and one.prompt_logprobs == [None] and one.prompt_top_logprobs == [[]]


def test_scoring_steps_stop_after_prefill(tiny_hf_model_dir):
    """max_tokens=0 generates nothing: the request is gone right after its last prefill chunk."""
    eng = make_engine(tiny_hf_model_dir("llama"), size=4)
    eng.add_request(random_prompt(10, seed=5), SamplingParams(max_tokens=0, prompt_logprobs=0), request_id="s")
    assert len(drive(eng).steps) == 3  # 4 + 4 + 2 prompt tokens, no decode step


def test_prompt_logprobs_survive_preemption_mid_prefill(tiny_hf_model_dir):
    """A tight cache preempts the prompt-logprobs request mid-prefill; its recompute must neither
    repeat nor skip positions."""
    path = tiny_hf_model_dir("llama")
    eng = make_engine(path, num_blocks=9, block_size=4, size=3, max_num_seqs=4)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2, prompt_logprobs=2)
    prompts = [random_prompt(n, seed=10 + n) for n in (12, 14, 10)]
    for i, p in enumerate(prompts):
        eng.add_request(p, params, request_id=f"r{i}")
    done = run(eng)
    assert sum(o.metrics.num_preemptions for o in done.values()) > 0, "the cache was meant to force preemption"
    for i in range(len(prompts)):
        check_against_hf(done[(f"r{i}", 0)], 2, 2)


def test_prompt_logprobs_preempted_mid_prefill(tiny_hf_model_dir):
    """r0's decode needs a block while r1 (prompt logprobs) is halfway through its chunked prefill:
    r1 is preempted with part of its prompt logprobs computed, and ends with each position once."""
    eng = make_engine(tiny_hf_model_dir("llama"), num_blocks=7, block_size=4, size=2)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, logprobs=1)
    eng.add_request(random_prompt(3, seed=20), params, request_id="r0")
    eng.add_request(random_prompt(24, seed=21), SamplingParams(
        max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=1, prompt_logprobs=2), request_id="r1")
    r1 = eng.requests["r1"]
    partial_at_preemption = []

    def note_preemption(eng) -> None:
        if eng.last_step is not None and "r1" in eng.last_step.preempted:
            partial_at_preemption.append(len(r1.prompt_logprobs))

    done = drive(eng, note_preemption).finished
    assert partial_at_preemption and 1 < partial_at_preemption[0] < 24, partial_at_preemption
    check_against_hf(done["r1"], 1, 2)
    check_against_hf(done["r0"], 1, None)
    assert eng.num_free_blocks() == eng.num_total_blocks()


def test_prompt_logprobs_skip_the_prefix_cache(tiny_hf_model_dir):
    eng = make_engine(tiny_hf_model_dir("llama"), block_size=4)
    prompt = random_prompt(13, seed=6)
    eng.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))
    eng.add_request(prompt, SamplingParams(max_tokens=2, temperature=0.0, logprobs=0, prompt_logprobs=0),
                    request_id="p")
    eng.add_request(prompt, SamplingParams(max_tokens=2, temperature=0.0), request_id="plain")
    done = run(eng)
    assert done[("p", 0)].metrics.num_cached_tokens == 0
    assert done[("plain", 0)].metrics.num_cached_tokens == 12  # the cache itself still works
    check_against_hf(done[("p", 0)], 0, 0)
    assert done[("p", 0)].output_token_ids == done[("plain", 0)].output_token_ids


def test_padded_vocabulary_ids_are_not_reported(tiny_hf_model_dir):
    """A tokenizer smaller than the LM head: top-k only among real ids; the normaliser is still the
    whole row, as transformers computes it."""
    eng = make_engine(tiny_hf_model_dir("llama"))
    eng.model_runner.logprob_vocab = eng.sampler.logprob_vocab = 200
    prompt = random_prompt(8, seed=7, vocab=200)
    out = eng.generate([prompt], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True,
                                                logprobs=20, prompt_logprobs=20))[0]
    ids = [t for top in out.top_logprobs + out.prompt_top_logprobs for t, _ in top]
    assert ids and max(ids) < 200
    check_against_hf(out, 20, 20, vocab_limit=200)


def test_off_by_default_and_n1_outputs_unchanged(tiny_hf_model_dir):
    path = tiny_hf_model_dir("llama")
    prompt = random_prompt(9, seed=8)
    plain = make_engine(path).generate([prompt], SamplingParams(max_tokens=6, temperature=0.9, seed=3))[0]
    with_lp = make_engine(path).generate(
        [prompt], SamplingParams(max_tokens=6, temperature=0.9, seed=3, logprobs=5, prompt_logprobs=5))[0]
    assert plain.logprobs is None and plain.top_logprobs is None and plain.prompt_logprobs is None
    assert plain.output_token_ids == with_lp.output_token_ids and plain.text == with_lp.text


@pytest.mark.parametrize(
    ("params", "fragment"),
    [
        (SamplingParams(max_tokens=0), "max_tokens=0 is only for scoring"),
        (SamplingParams(logprobs=-1), "logprobs=-1"),
        (SamplingParams(prompt_logprobs=1.5), "prompt_logprobs=1.5"),
        (SamplingParams(max_tokens=-1, prompt_logprobs=0), "max_tokens=-1"),
    ],
)
def test_invalid_logprob_params_fail_that_request_only(tiny_hf_model_dir, params, fragment):
    eng = make_engine(tiny_hf_model_dir("llama"))
    eng.add_request([5, 6, 7], params, request_id="bad")
    eng.add_request([5, 6, 7], SamplingParams(max_tokens=2, temperature=0.0), request_id="good")
    done = run(eng)
    assert done[("bad", 0)].finish_reason == "error" and fragment in done[("bad", 0)].error
    assert done[("good", 0)].finish_reason == "length"


@pytest.mark.parametrize("family", ["qwen3", "gemma3", "gemma3_softcap"])
def test_logprobs_other_families(tiny_hf_model_dir, family):
    """Tied embeddings, sliding windows and Gemma's final logit softcapping (applied before log_softmax)."""
    eng = make_engine(tiny_hf_model_dir(family), size=3)
    prompt = random_prompt(19, seed=30)
    out = eng.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=3,
                                                prompt_logprobs=3))[0]
    check_against_hf(out, 3, 3, name=family)


def test_prompt_logprobs_rows_chunked_as_one_shot(monkeypatch):
    """token_logprobs bounds the logits it materialises; cut into 4-row pieces, it gives what one piece
    gives (ids exactly, values to float rounding), top-k only below vocab_limit."""
    import ladle.engine.logprobs as lp_mod

    gen = torch.Generator().manual_seed(0)
    weight, hidden = torch.randn(50, 8, generator=gen), torch.randn(23, 8, generator=gen)
    targets = torch.randint(0, 50, (23,), generator=gen).tolist()
    calls = []

    def logits(h):
        calls.append(h.shape[0])
        return h @ weight.T

    whole = lp_mod.token_logprobs(logits, hidden, targets, 3, 50, 40)
    monkeypatch.setattr(lp_mod, "_MAX_LOGIT_ELEMENTS", 50 * 4)
    calls.clear()
    pieces = lp_mod.token_logprobs(logits, hidden, targets, 3, 50, 40)
    assert calls == [4, 4, 4, 4, 4, 3]
    assert pieces[0] == pytest.approx(whole[0], abs=1e-5)
    assert [[t for t, _ in top] for top in pieces[1]] == [[t for t, _ in top] for top in whole[1]]
    assert all(t < 40 for top in pieces[1] for t, _ in top)
