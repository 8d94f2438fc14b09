"""Chunked prefill equals whole prefill: logits, cache contents, outputs, and streams beside it."""

from __future__ import annotations

import pytest
import torch

from ladle.engine import SamplingParams
from tests.engine.helpers import GREEDY, drive, make_engine, random_prompt, run_to_completion, wrap_execute


def capture_logits(eng):
    """Record the logits rows the model runner returns, per step."""
    seen = []

    def record(execute, scheduled):
        out = execute(scheduled)
        seen.append(out.logits.clone())
        return out

    wrap_execute(eng, record)
    return seen


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3", "qwen2", "mistral", "phi3", "qwen3_moe", "mixtral"])
@pytest.mark.parametrize(
    "prompt_len,chunk",
    [(40, 40), (1, 8), (5, 64), (33, 8), (57, 7), (300, 64)],  # ==, prompt 1, chunk > prompt, % == 1
)
def test_last_position_logits_chunked_equal_whole(tiny_hf_model_dir, family, prompt_len, chunk):
    path = tiny_hf_model_dir(family)
    prompt = random_prompt(prompt_len, seed=1)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    whole = make_engine(path, enabled=False)
    whole_logits = capture_logits(whole)
    whole.generate([prompt], params)
    chunked = make_engine(path, size=chunk)
    chunked_logits = capture_logits(chunked)
    chunked.generate([prompt], params)
    assert len(chunked_logits) == -(-prompt_len // chunk)
    # Intermediate chunks produce no logits rows at all; the last produces exactly one.
    assert all(x.shape[0] == 0 for x in chunked_logits[:-1])
    torch.testing.assert_close(chunked_logits[-1], whole_logits[-1], atol=1e-5, rtol=0)


@pytest.mark.parametrize("backend", ["paged", "contiguous"])
@pytest.mark.parametrize("prompt_len,chunk", [(1, 4), (16, 16), (17, 16), (45, 7), (10, 64)])
def test_chunks_emit_nothing_and_cache_length_tracks_computed(tiny_hf_model_dir, backend, prompt_len, chunk):
    eng = make_engine(tiny_hf_model_dir("qwen3"), backend=backend, size=chunk)
    rid = eng.add_request(random_prompt(prompt_len, seed=2), SamplingParams(max_tokens=3, temperature=0.0))
    req = eng.requests[rid]
    keys0 = eng.kv.kv_caches[0][0]  # [num_blocks, block_size, heads, dim] (head-major memory on the CPU)
    steps = 0
    while req.num_computed_tokens < prompt_len:
        outs = eng.step()
        steps += 1
        done_prefill = req.num_computed_tokens == prompt_len
        assert [o.request_id for o in outs] == ([rid] if done_prefill else [])
        assert eng.last_step.scheduled == {rid: min(chunk, prompt_len - (steps - 1) * chunk)}
        # The cache holds keys for exactly the computed positions of this request.
        bs = eng.kv.block_size
        positions = range(len(req.block_ids) * bs)
        stored = [bool(keys0[req.block_ids[p // bs], p % bs].abs().sum() > 0) for p in positions]
        assert stored == [p < req.num_computed_tokens for p in positions]
    assert steps == -(-prompt_len // chunk)
    assert eng.requests[rid].metrics.num_prefill_chunks == steps
    run_to_completion(eng)


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_decode_streams_unchanged_by_long_prefill_beside_them(tiny_hf_model_dir, family):
    path = tiny_hf_model_dir(family)
    short = [random_prompt(n, seed=10 + n) for n in (3, 9, 20)]
    alone = make_engine(path, size=32).generate(short, GREEDY)

    eng = make_engine(path, size=32)
    ids = [eng.add_request(p, GREEDY) for p in short]
    for _ in range(3):  # the short requests are decoding
        eng.step()
    long_id = eng.add_request(random_prompt(280, seed=99), GREEDY)
    run = drive(eng)
    done = run.finished
    mixed_steps = sum(1 for s in run.steps if long_id in s.scheduled and s.decode_tokens)
    assert mixed_steps >= 5, "the long prompt should have been chunked beside running decodes"
    for rid, ref in zip(ids, alone):
        assert done[rid].output_token_ids == ref.output_token_ids
