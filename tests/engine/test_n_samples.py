"""n samples per prompt: one prefill, KV shared by the samples, each with its own stream."""

from __future__ import annotations

import pytest

from ladle.engine import SamplingParams
from tests.engine.helpers import drive, hf_greedy, make_engine, random_prompt
from tests.engine.test_logprobs import CHUNKINGS, check_against_hf, hf_model, run


def greedy(n: int, max_tokens: int = 8, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, n=n, **kw)


def samples(done: dict, rid: str) -> list:
    outs = sorted((o for (r, _), o in done.items() if r == rid), key=lambda o: o.sample_index)
    assert [o.sample_index for o in outs] == list(range(len(outs)))
    return outs


def step_until_idle(eng) -> tuple[dict, list]:
    """{(request id, sample index): final output} and every step's StepStats."""
    run = drive(eng)
    return run.samples, run.steps


@pytest.mark.parametrize("chunking", list(CHUNKINGS))
def test_prompt_computed_once_and_greedy_samples_equal_n1(tiny_hf_model_dir, chunking):
    eng = make_engine(tiny_hf_model_dir("llama"), **CHUNKINGS[chunking])
    prompt = random_prompt(21, seed=1)
    eng.add_request(prompt, greedy(4, max_tokens=6), request_id="q")
    done, steps = step_until_idle(eng)
    assert sum(s.prefill_tokens for s in steps) == len(prompt)  # not 4 x: the prompt is prefilled once
    assert sum(s.scheduled.get("q", 0) for s in steps) == len(prompt) + 4 * 5  # then 4 decodes x 5 tokens
    expected = hf_greedy(hf_model(), prompt, 6)
    outs = samples(done, "q")
    assert len(outs) == 4
    assert all(o.output_token_ids == expected and o.finish_reason == "length" for o in outs)


def test_samples_differ_and_seeds_reproduce(tiny_hf_model_dir):
    path = tiny_hf_model_dir("llama")
    prompt = random_prompt(9, seed=2)
    hot = SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True, n=4, seed=7)
    a = make_engine(path).generate([prompt], hot)
    b = make_engine(path, size=3).generate([prompt], hot)  # another chunking: same streams
    assert [o.output_token_ids for o in a] == [o.output_token_ids for o in b]
    assert [o.sample_index for o in a] == [0, 1, 2, 3] and {o.request_id for o in a} == {a[0].request_id}
    assert len({tuple(o.output_token_ids) for o in a}) == 4, "seeded samples must differ"
    single = make_engine(path).generate([prompt], SamplingParams(max_tokens=12, temperature=1.0,
                                                                 ignore_eos=True, seed=7))[0]
    assert single.output_token_ids == a[0].output_token_ids  # sample 0 uses the seed itself
    unseeded = make_engine(path).generate([prompt], SamplingParams(max_tokens=12, temperature=1.0,
                                                                   ignore_eos=True, n=4))
    assert len({tuple(o.output_token_ids) for o in unseeded}) > 1


def test_samples_carry_their_own_logprobs(tiny_hf_model_dir):
    eng = make_engine(tiny_hf_model_dir("llama"), size=4)
    prompt = random_prompt(10, seed=3)
    outs = eng.generate([prompt], SamplingParams(max_tokens=6, temperature=1.0, seed=1, ignore_eos=True, n=3,
                                                 logprobs=2, prompt_logprobs=1))
    assert len(outs) == 3
    for o in outs:
        check_against_hf(o, 2, 1)


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_samples_share_prompt_blocks_then_release_them(tiny_hf_model_dir, prefix_caching):
    eng = make_engine(tiny_hf_model_dir("llama"), block_size=4, prefix_caching=prefix_caching)
    free0 = eng.num_free_blocks()
    prompt = random_prompt(10, seed=4)  # 2 full blocks + a partial one
    eng.add_request(prompt, greedy(4), request_id="q")
    eng.step()  # the whole prompt, then the fork
    kids = eng.requests["q"].children
    assert len(kids) == 4 and all(k.num_computed_tokens == 10 for k in kids)
    shared = kids[0].block_ids[:2]
    assert all(k.block_ids[:2] == shared for k in kids)
    assert [eng.kv.pool.ref_counts[b] for b in shared] == [4, 4]
    lasts = {k.block_ids[2] for k in kids}
    assert len(lasts) == 4, "each sample writes into its own copy of the partial block"
    assert eng.num_free_blocks() == free0 - 2 - 4
    done, _ = step_until_idle(eng)
    assert eng.num_free_blocks() == free0
    assert len({tuple(o.output_token_ids) for o in samples(done, "q")}) == 1


def test_tight_cache_preempts_samples_and_outputs_are_unchanged(tiny_hf_model_dir):
    path = tiny_hf_model_dir("llama")
    prompts = [random_prompt(n, seed=10 + n) for n in (9, 14)]
    params = greedy(3, max_tokens=20)

    def outputs(eng):
        for i, p in enumerate(prompts):
            eng.add_request(p, params, request_id=f"r{i}")
        done, steps = step_until_idle(eng)
        return {k: o.output_token_ids for k, o in done.items()}, steps

    roomy, _ = outputs(make_engine(path, block_size=4))
    tight, steps = outputs(make_engine(path, block_size=4, num_blocks=12, size=4))
    assert sum(len(s.preempted) for s in steps) > 0, "the cache was meant to force preemption"
    assert tight == roomy
    assert all(v == hf_greedy(hf_model(), prompts[int(k[0][1])], 20) for k, v in roomy.items())


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_fork_with_room_for_two_of_four(tiny_hf_model_dir, prefix_caching):
    """After the prefill only one block is free: sample 0 keeps the prompt's blocks, sample 1 gets the
    copy, samples 2 and 3 wait (holding their first token) and are recomputed later."""
    eng = make_engine(tiny_hf_model_dir("llama"), block_size=4, num_blocks=4, prefix_caching=prefix_caching)
    prompt = random_prompt(10, seed=5)
    eng.add_request(prompt, greedy(4, max_tokens=6), request_id="q")
    first = eng.step()
    assert [o.sample_index for o in first] == [0, 1, 2, 3]
    assert len(eng.scheduler.running) == 2 and len(eng.scheduler.waiting) == 2
    assert eng.num_free_blocks() == 0
    done, _ = step_until_idle(eng)
    expected = hf_greedy(hf_model(), prompt, 6)
    assert [o.output_token_ids for o in samples(done, "q")] == [expected] * 4


def test_more_samples_than_max_num_seqs(tiny_hf_model_dir):
    eng = make_engine(tiny_hf_model_dir("llama"), max_num_seqs=2)
    prompt = random_prompt(7, seed=6)
    eng.add_request(prompt, greedy(5), request_id="q")
    eng.step()
    assert len(eng.scheduler.running) == 2
    done, steps = step_until_idle(eng)
    assert max(s.running for s in steps) <= 2
    assert [o.output_token_ids for o in samples(done, "q")] == [hf_greedy(hf_model(), prompt, 8)] * 5


@pytest.mark.parametrize("num_blocks", [None, 2])
def test_contiguous_backend_copies_the_prompt_region(tiny_hf_model_dir, num_blocks):
    """One block per sequence, nothing shared: each sample gets a copy of the prompt's KV; with two
    blocks, two samples run and two wait to be recomputed."""
    eng = make_engine(tiny_hf_model_dir("llama"), backend="contiguous", max_model_len=64, size=4,
                      num_blocks=num_blocks)
    prompt = random_prompt(11, seed=7)
    eng.add_request(prompt, greedy(4), request_id="q")
    done, steps = step_until_idle(eng)
    computed_once = sum(s.prefill_tokens for s in steps) == len(prompt)
    assert computed_once == (num_blocks is None)
    assert [o.output_token_ids for o in samples(done, "q")] == [hf_greedy(hf_model(), prompt, 8)] * 4


def test_max_tokens_one(tiny_hf_model_dir):
    eng = make_engine(tiny_hf_model_dir("llama"))
    prompt = random_prompt(6, seed=8)
    eng.add_request(prompt, SamplingParams(max_tokens=1, temperature=1.0, seed=3, n=4), request_id="q")
    eng.add_request(prompt, greedy(2, max_tokens=1), request_id="g")
    done = run(eng)
    outs = samples(done, "q")
    assert len(outs) == 4 and all(len(o.output_token_ids) == 1 and o.finish_reason == "length" for o in outs)
    assert all(o.output_token_ids == hf_greedy(hf_model(), prompt, 1) for o in samples(done, "g"))
    assert not eng.requests


def test_abort_mid_prefill(tiny_hf_model_dir):
    eng = make_engine(tiny_hf_model_dir("llama"), size=4)
    eng.add_request(random_prompt(20, seed=9), greedy(4), request_id="q")
    eng.add_request(random_prompt(5, seed=10), greedy(1), request_id="other")
    assert eng.step() == []
    eng.abort_request("q")
    done = run(eng)
    assert list(done) == [("other", 0)]
    assert not eng.requests


def test_abort_after_fork_aborts_every_sample(tiny_hf_model_dir):
    eng = make_engine(tiny_hf_model_dir("llama"))
    eng.add_request(random_prompt(9, seed=11), greedy(4, max_tokens=20), request_id="q")
    assert len(eng.step()) == 4
    kids = eng.requests["q"].children
    eng.abort_request("q")
    assert all(k.finish_reason == "abort" for k in kids)
    assert not eng.has_unfinished_requests() and not eng.requests
    assert eng.num_free_blocks() == eng.num_total_blocks()


def test_step_stats_sum_tokens_over_samples(tiny_hf_model_dir):
    eng = make_engine(tiny_hf_model_dir("llama"))
    eng.add_request(random_prompt(9, seed=12), greedy(3, max_tokens=4), request_id="q")
    eng.step()
    assert eng.last_step.scheduled == {"q": 9}
    eng.step()
    assert eng.last_step.scheduled == {"q": 3} and eng.last_step.decode_tokens == 3


@pytest.mark.parametrize("n", [0, -1, 1.5, True])
def test_invalid_n_fails_that_request_only(tiny_hf_model_dir, n):
    eng = make_engine(tiny_hf_model_dir("llama"))
    eng.add_request([5, 6], SamplingParams(n=n), request_id="bad")
    eng.add_request([5, 6], greedy(2, max_tokens=2), request_id="good")
    done = run(eng)
    assert done[("bad", 0)].finish_reason == "error" and f"n={n!r}" in done[("bad", 0)].error
    assert len(samples(done, "good")) == 2


def test_scoring_with_n_reports_each_sample_index(tiny_hf_model_dir):
    eng = make_engine(tiny_hf_model_dir("llama"))
    eng.add_request(random_prompt(5, seed=13), SamplingParams(max_tokens=0, prompt_logprobs=0, n=2),
                    request_id="s")
    done = run(eng)
    outs = samples(done, "s")
    assert len(outs) == 2 and all(o.output_token_ids == [] and o.finish_reason == "length" for o in outs)


def test_fork_at_a_block_boundary_shares_every_block(tiny_hf_model_dir):
    """A prompt of whole blocks: nothing to copy at the fork; each sample's first decode takes a block,
    and a cache too small for all of them preempts per the usual policy."""
    eng = make_engine(tiny_hf_model_dir("llama"), block_size=4, num_blocks=5, prefix_caching=False)
    prompt = random_prompt(8, seed=14)
    eng.add_request(prompt, greedy(4, max_tokens=4), request_id="q")
    eng.step()
    kids = eng.requests["q"].children
    assert all(k.block_ids == kids[0].block_ids for k in kids) and len(eng.scheduler.running) == 4
    assert [eng.kv.pool.ref_counts[b] for b in kids[0].block_ids] == [4, 4]
    done, steps = step_until_idle(eng)
    assert sum(len(s.preempted) for s in steps) > 0
    assert [o.output_token_ids for o in samples(done, "q")] == [hf_greedy(hf_model(), prompt, 4)] * 4


def test_seeded_samples_survive_preemption_unchanged(tiny_hf_model_dir):
    """Each sample's stream advances only when it draws: a tight cache (preempting and deferring
    samples) gives the same seeded samples, and the same logprobs, as a roomy one."""
    path = tiny_hf_model_dir("llama")
    prompts = [random_prompt(n, seed=40 + n) for n in (9, 14)]
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=5, ignore_eos=True, n=3, logprobs=1)

    def outputs(eng):
        for i, p in enumerate(prompts):
            eng.add_request(p, params, request_id=f"r{i}")
        done, steps = step_until_idle(eng)
        return done, steps

    roomy, _ = outputs(make_engine(path, block_size=4))
    tight, steps = outputs(make_engine(path, block_size=4, num_blocks=11, size=4))
    assert sum(len(s.preempted) for s in steps) > 0
    assert {k: o.output_token_ids for k, o in tight.items()} == {k: o.output_token_ids for k, o in roomy.items()}
    for k, o in tight.items():
        assert o.logprobs == pytest.approx(roomy[k].logprobs, abs=1e-4)
        check_against_hf(o, 1, None)


def test_forked_rows_are_sampled_within_the_budgeted_rows(tiny_hf_model_dir, monkeypatch):
    """The memory plan budgets the sampler for one row per running sequence (memory.sampler_bytes);
    n=16 forks of several prompts in one step would otherwise materialise n x that many rows of
    [vocab] float32 copies (qwen3_4b vocab, max_num_seqs 256, n=16: ~20 GiB against 1.2 GiB budgeted).
    The engine draws them max_rows (Sampler) at a time, with the same seeded tokens and logprobs."""
    path = tiny_hf_model_dir("llama")
    prompts = [random_prompt(5 + i, seed=40 + i) for i in range(3)]
    params = SamplingParams(max_tokens=4, temperature=1.0, ignore_eos=True, n=6, seed=11, logprobs=2)
    ref = make_engine(path, max_num_seqs=32).generate(prompts, params)
    eng = make_engine(path, max_num_seqs=32)
    eng.sampler.max_rows = 4
    widths = []
    original = eng.sampler.sample
    monkeypatch.setattr(eng.sampler, "sample", lambda logits, reqs: widths.append(len(reqs)) or original(logits, reqs))
    outs = eng.generate(prompts, params)
    assert max(widths) <= 4 and sum(widths) >= 18  # the 3 x 6 first tokens, 4 rows at a time
    assert [o.output_token_ids for o in outs] == [o.output_token_ids for o in ref]
    assert [o.logprobs for o in outs] == [o.logprobs for o in ref]
    assert eng.num_free_blocks() == eng.num_total_blocks()


@pytest.mark.parametrize("failing_sample", [0, 1])
def test_a_sample_whose_first_token_fails_fails_alone(tiny_hf_model_dir, failing_sample):
    """The update of one sample's first token raises (here the detokenizer): that sample fails, its
    siblings run to the end and every block comes back. Before: the siblings after it never got their
    first token and sat in the running list unscheduled forever (the engine spun), their blocks held."""
    eng = make_engine(tiny_hf_model_dir("llama"))
    calls = {"n": 0}
    original = eng.output_processor.detokenizer.step

    def flaky(*args):
        calls["n"] += 1
        if calls["n"] == failing_sample + 1:  # the fork's step detokenises samples 0, 1, 2 in order
            raise ValueError("injected")
        return original(*args)

    eng.output_processor.detokenizer.step = flaky
    eng.add_request(random_prompt(9, seed=1), greedy(3, max_tokens=5), request_id="q")
    done = {}
    for _ in range(50):
        if not eng.has_unfinished_requests():
            break
        done.update({o.sample_index: o for o in eng.step() if o.finished})
    assert not eng.has_unfinished_requests() and not eng.requests
    assert eng.num_free_blocks() == eng.num_total_blocks()
    assert sorted(done) == [0, 1, 2]
    assert done[failing_sample].finish_reason == "error" and "injected" in done[failing_sample].error
    expected = hf_greedy(hf_model(), random_prompt(9, seed=1), 5)
    assert all(done[i].output_token_ids == expected for i in (0, 1, 2) if i != failing_sample)
