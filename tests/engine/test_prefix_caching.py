"""Prefix caching: identical outputs, the expected hits, eviction only of unreferenced blocks."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ladle.engine import SamplingParams
from ladle.engine.block_pool import BlockPool
from tests.engine.helpers import GREEDY, drive, fail_on_forward, make_engine, random_prompt, run_to_completion

PREAMBLE = random_prompt(100, seed=1000)


def shared_prefix_prompts(n=4):
    return [PREAMBLE + random_prompt(5 + 3 * i, seed=i) for i in range(n)]


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3", "qwen2", "mistral", "phi3", "qwen3_moe", "mixtral"])
@pytest.mark.parametrize("chunking", [{"size": 16}, {"size": 7}, {"enabled": False}])
def test_outputs_identical_with_and_without_prefix_caching(tiny_hf_model_dir, family, chunking):
    path = tiny_hf_model_dir(family)
    prompts = shared_prefix_prompts()
    off = make_engine(path, prefix_caching=False, **chunking)
    ref = [off.generate([p], GREEDY)[0] for p in prompts]
    on = make_engine(path, prefix_caching=True, **chunking)
    outs = [on.generate([p], GREEDY)[0] for p in prompts]  # one after another: later ones hit
    for r, o in zip(ref, outs):
        assert o.output_token_ids == r.output_token_ids
    assert outs[0].metrics.num_cached_tokens == 0
    # 100 shared tokens = 6 full blocks of 16 -> 96 cached tokens for every later request.
    assert [o.metrics.num_cached_tokens for o in outs[1:]] == [96, 96, 96]


def test_cached_tokens_cut_prefill_and_steps_report_them(tiny_hf_model_dir):
    eng = make_engine(tiny_hf_model_dir("qwen3"), size=32)
    first = eng.add_request(PREAMBLE + [7, 8, 9], GREEDY)
    run_to_completion(eng)
    second = eng.add_request(PREAMBLE + [10, 11], GREEDY)
    eng.step()
    s = eng.last_step
    assert s.cached_prompt_tokens == 96
    assert s.scheduled == {second: 102 - 96}  # only the uncached tail is computed
    assert first != second


def test_whole_prompt_cached_still_computes_last_token(tiny_hf_model_dir):
    path = tiny_hf_model_dir("qwen3")
    prompt = random_prompt(64, seed=3)  # exactly 4 full blocks
    ref = make_engine(path, prefix_caching=False).generate([prompt], GREEDY)[0]
    eng = make_engine(path)
    eng.generate([prompt], GREEDY)
    again = eng.generate([prompt], GREEDY)[0]
    assert again.metrics.num_cached_tokens == 48  # at most len - 1 tokens, full blocks: 3 blocks
    assert again.output_token_ids == ref.output_token_ids


def test_concurrent_requests_share_blocks_by_reference(tiny_hf_model_dir):
    eng = make_engine(tiny_hf_model_dir("qwen3"), size=200)
    a = eng.add_request(PREAMBLE + [5], GREEDY)
    eng.step()  # a's prompt computed and its 6 full blocks published
    b = eng.add_request(PREAMBLE + [6], GREEDY)
    eng.step()
    ra, rb = eng.requests[a], eng.requests[b]
    assert ra.block_ids[:6] == rb.block_ids[:6]
    assert all(eng.kv.pool.ref_counts[x] == 2 for x in ra.block_ids[:6])
    run_to_completion(eng)


def test_block_pool_evicts_only_unreferenced_blocks_lru():
    pool = BlockPool(4, enable_caching=True)
    a, b = pool.allocate(2)
    pool.register(a, 111)
    pool.register(b, 222)
    pool.free([b, a])  # tail first: b is evicted before a
    assert pool.lookup(111) == a and pool.lookup(222) == b
    c, d = pool.allocate(2)  # the two never-used blocks go first, cached ones stay
    assert {c, d}.isdisjoint({a, b}) and pool.lookup(111) == a
    pool.touch(a)  # a referenced again: it must not be evicted
    (e,) = pool.allocate(1)
    assert e == b and pool.lookup(222) is None and pool.lookup(111) == a
    with pytest.raises(RuntimeError):
        pool.allocate(1)
    pool.free([a, c, d, e])
    pool.check_invariants()
    assert pool.num_free == 4


def _refs_match_running_requests(eng) -> None:
    """After every step: the pool is consistent and each block is referenced once per running request
    holding it (a shared prefix block by each of its sharers), no more, no less."""
    pool = eng.kv.pool
    pool.check_invariants()
    live = {}
    for r in eng.scheduler.running:
        for blk in r.block_ids:
            live[blk] = live.get(blk, 0) + 1
    assert all(pool.ref_counts[b] == live.get(b, 0) for b in range(pool.num_blocks))


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    picks=st.lists(st.tuples(st.integers(0, 2), st.integers(0, 20), st.integers(1, 10)), min_size=2, max_size=8),
    num_blocks=st.integers(8, 24),
    chunk=st.integers(2, 48),
    fail_step=st.one_of(st.none(), st.integers(1, 20)),
)
def test_shared_prefixes_with_preemption_and_failures_never_leak(tiny_hf_model_dir, picks, num_blocks, chunk, fail_step):
    prefixes = [random_prompt(n, seed=500 + n) for n in (8, 20, 33)]
    eng = make_engine(tiny_hf_model_dir("qwen3"), block_size=4, num_blocks=num_blocks, max_model_len=96,
                      max_num_seqs=4, size=chunk)
    fail_on_forward(eng, fail_step)
    for i, (p, tail, max_tokens) in enumerate(picks):
        eng.add_request(prefixes[p] + random_prompt(tail, seed=i), SamplingParams(max_tokens=max_tokens, temperature=0))
    done = drive(eng, after_step=_refs_match_running_requests, max_steps=3000).finished
    assert len(done) == len(picks)
