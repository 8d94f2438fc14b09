"""Every chunking knob changes the schedule as documented, observed through eng.last_step."""

from __future__ import annotations

import pytest

from ladle.engine import SamplingParams
from tests.engine.helpers import GREEDY, drive, make_engine, random_prompt

DECODE = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)


def trace(eng, max_steps=10_000):
    """Run to completion; return the StepStats of every step and the final outputs."""
    steps, done = [], {}
    for _ in range(max_steps):
        if not eng.has_unfinished_requests():
            break
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
        if eng.last_step is not None:
            steps.append(eng.last_step)
    assert eng.num_free_blocks() == eng.num_total_blocks()
    return steps, done


def start_decodes(eng, n=3):
    ids = [eng.add_request(random_prompt(4 + i, seed=i), DECODE) for i in range(n)]
    eng.step()  # all three prefilled in one step, now decoding
    return ids


@pytest.fixture
def path(tiny_hf_model_dir):
    return tiny_hf_model_dir("qwen3")


def test_decodes_run_every_step_while_a_long_prompt_is_chunked(path):
    eng = make_engine(path, size=16, token_budget=64)
    decoders = start_decodes(eng)
    long_id = eng.add_request(random_prompt(200, seed=7), GREEDY)
    steps, _ = trace(eng)
    prefill_steps = [s for s in steps if long_id in s.scheduled and s.prefill_tokens]
    assert len(prefill_steps) == -(-200 // 16)
    for s in prefill_steps:
        assert all(s.scheduled.get(d) == 1 for d in decoders), s.scheduled
        assert s.scheduled[long_id] <= 16


def test_unchunked_prefills_whole_prompt_in_one_step(path):
    eng = make_engine(path, enabled=False)
    start_decodes(eng)
    long_id = eng.add_request(random_prompt(200, seed=7), GREEDY)
    steps, _ = trace(eng)
    assert next(s.scheduled[long_id] for s in steps if long_id in s.scheduled) == 200


@pytest.mark.parametrize("budget", [8, 13, 40])
def test_token_budget_is_never_exceeded(path, budget):
    eng = make_engine(path, size=32, token_budget=budget)
    for i in range(6):
        eng.add_request(random_prompt(10 + 17 * i, seed=i), GREEDY)
    steps, done = trace(eng)
    assert len(done) == 6
    assert max(s.decode_tokens + s.prefill_tokens for s in steps) == budget
    assert all(s.decode_tokens + s.prefill_tokens <= budget for s in steps)


@pytest.mark.parametrize("cap", [1, 2])
def test_max_chunks_per_step(path, cap):
    eng = make_engine(path, size=8, max_chunks_per_step=cap)
    for i in range(5):
        eng.add_request(random_prompt(30, seed=i), GREEDY)
    steps, _ = trace(eng)
    assert max(s.prefill_requests for s in steps) == cap


@pytest.mark.parametrize("cap", [1, 2])
def test_max_partial_prefills(path, cap):
    eng = make_engine(path, size=8, max_partial_prefills=cap, token_budget=64)
    ids = [eng.add_request(random_prompt(30, seed=i), GREEDY) for i in range(5)]
    reqs = [eng.requests[i] for i in ids]
    partial = []
    drive(eng, lambda eng: partial.append(sum(1 for r in reqs if 0 < r.num_computed_tokens < r.num_prompt_tokens)))
    assert max(partial) == cap


def test_decode_headroom_caps_prefill_while_decodes_run(path):
    eng = make_engine(path, size=64, decode_headroom=10)
    start_decodes(eng)
    long_id = eng.add_request(random_prompt(100, seed=7), GREEDY)
    steps, _ = trace(eng)
    with_decodes = [s for s in steps if s.decode_tokens and s.prefill_tokens]
    assert with_decodes and all(s.prefill_tokens <= 10 for s in with_decodes)
    assert max(s.prefill_tokens for s in with_decodes) == 10
    assert long_id in with_decodes[0].scheduled


def test_decode_headroom_does_not_apply_without_decodes(path):
    eng = make_engine(path, size=64, decode_headroom=10)
    eng.add_request(random_prompt(100, seed=7), GREEDY)
    eng.step()
    assert eng.last_step.prefill_tokens == 64


@pytest.mark.parametrize("interval", [2, 3])
def test_prefill_interval(path, interval):
    eng = make_engine(path, size=8, prefill_interval=interval)
    start_decodes(eng)
    eng.add_request(random_prompt(60, seed=7), GREEDY)
    steps, _ = trace(eng)
    kinds = [bool(s.prefill_tokens) for s in steps if s.decode_tokens]
    first, last = kinds.index(True), len(kinds) - 1 - kinds[::-1].index(True)
    window = kinds[first : last + 1]
    # Exactly every interval-th step carries prefill while decodes run.
    assert window == [i % interval == 0 for i in range(len(window))]


@pytest.mark.parametrize("ubatch", [1, 5, 16])
def test_ubatch_splits_forwards_with_identical_outputs(path, ubatch):
    prompts = [random_prompt(n, seed=n) for n in (3, 17, 40)]
    ref = make_engine(path, size=32).generate(prompts, GREEDY)
    eng = make_engine(path, size=32, ubatch=ubatch)
    ids = [eng.add_request(p, GREEDY) for p in prompts]
    steps, done = trace(eng)
    for s in steps:
        total = s.decode_tokens + s.prefill_tokens
        assert s.num_forwards == -(-total // ubatch)
    assert max(s.num_forwards for s in steps) > 1
    for rid, r in zip(ids, ref):
        assert done[rid].output_token_ids == r.output_token_ids


def test_max_num_seqs_limits_running(path):
    eng = make_engine(path, size=32, max_num_seqs=2)
    for i in range(5):
        eng.add_request(random_prompt(5, seed=i), GREEDY)
    steps, done = trace(eng)
    assert len(done) == 5 and max(s.running for s in steps) == 2


def test_never_an_empty_step_while_work_is_pending(path):
    eng = make_engine(path, size=4, token_budget=8, max_num_seqs=8, prefill_interval=3, decode_headroom=2)
    for i in range(4):
        eng.add_request(random_prompt(9 + i, seed=i), GREEDY)
    def step_scheduled_work(eng) -> None:
        assert eng.last_step is not None and eng.last_step.scheduled

    drive(eng, step_scheduled_work)


@pytest.mark.parametrize("size,max_num_seqs,expected", [(16, 8, 16), (4, 8, 8), (8, 8, 8)])
def test_default_step_budget_is_the_chunk_size(path, size, max_num_seqs, expected):
    """token_budget=null: a step carries at most max(size, max_num_seqs) tokens, decodes included, so
    a sweep over chunking.size changes what a step carries; every decode still fits."""
    eng = make_engine(path, size=size, max_num_seqs=max_num_seqs)
    decoders = start_decodes(eng, n=3)
    while any(eng.requests[d].is_prefilling for d in decoders):  # a small budget takes a few steps
        eng.step()
    for i in range(4):
        eng.add_request(random_prompt(60 + i, seed=10 + i), GREEDY)
    steps, _ = trace(eng)
    assert max(s.decode_tokens + s.prefill_tokens for s in steps) == expected
    assert all(s.decode_tokens + s.prefill_tokens <= expected for s in steps)
    assert all(s.scheduled.get(d, 1) == 1 for s in steps for d in decoders)  # decodes never squeezed out


def test_default_step_budget_unchunked_admits_a_whole_prompt(path):
    eng = make_engine(path, enabled=False, max_model_len=256)
    start_decodes(eng)
    long_id = eng.add_request(random_prompt(200, seed=7), GREEDY)
    steps, _ = trace(eng)
    assert next(s.scheduled[long_id] for s in steps if long_id in s.scheduled) == 200


def test_unchunked_with_a_headroom_below_max_model_len_is_refused(path):
    """A whole prompt longer than the headroom could never be scheduled while decodes run (and would
    block the queue): the combination is a config error naming both keys."""
    with pytest.raises(ValueError, match=r"chunking.decode_headroom=128 .*chunking.enabled=true"):
        make_engine(path, enabled=False, decode_headroom=128, max_model_len=256)
    eng = make_engine(path, enabled=False, decode_headroom=256, max_model_len=256)  # fits: allowed
    start_decodes(eng)
    long_id = eng.add_request(random_prompt(200, seed=7), GREEDY)
    steps, done = trace(eng)
    assert done[long_id].finish_reason == "length"
    first = next(s for s in steps if long_id in s.scheduled)
    assert first.scheduled[long_id] == 200 and first.decode_tokens == 3  # no waiting for decodes to end


def test_unchunked_default_budget_fits_a_full_length_prompt_beside_every_decode(path):
    """A prompt of max_model_len - 1 tokens must not wait for running decodes to finish."""
    eng = make_engine(path, enabled=False, max_model_len=128, max_num_seqs=4)
    decoders = start_decodes(eng, n=3)
    long_id = eng.add_request(random_prompt(127, seed=7), SamplingParams(max_tokens=1, temperature=0.0))
    eng.step()
    assert eng.last_step.scheduled.get(long_id) == 127 and all(d in eng.last_step.scheduled for d in decoders)
