"""Two rules of the engine, checked on what it does:

- a waiting request holds no KV block: new, preempted, a sample deferred at the fork, and still none
  after such a request is aborted (`check_engine`, which drive() runs after every step);
- a prefix-cache key names the whole prefix, not a block's tokens alone: a prompt whose first block has
  the tokens of another prompt's second block gets no hit, and its output is the uncached one.
"""

from __future__ import annotations

import pytest

from ladle.engine import SamplingParams
from ladle.engine.scheduler import Scheduler
from tests.engine.helpers import check_engine, drive, make_engine, random_prompt


def greedy(max_tokens: int, n: int = 1) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, n=n)


@pytest.fixture(scope="module")
def path(tiny_hf_model_dir):
    return tiny_hf_model_dir("qwen3")


def test_the_check_fails_when_a_preempted_request_keeps_its_blocks(path, monkeypatch):
    """The check can fail: a scheduler whose preemption forgot to free the victim's blocks is caught."""
    def keep_blocks(self, victim, out):
        self.running.remove(victim)
        victim.num_computed_tokens = 0
        self.requeue([victim])
        out.preempted.append(victim)
        out.scheduled = [s for s in out.scheduled if s.request is not victim]

    monkeypatch.setattr(Scheduler, "_preempt", keep_blocks)
    eng = make_engine(path, num_blocks=12, size=16, max_model_len=128)
    for n in (20, 30, 25, 40):
        eng.add_request(random_prompt(n, seed=n), greedy(40))
    with pytest.raises(AssertionError, match="waiting request .* holds KV blocks"):
        drive(eng)


def test_a_preempted_request_aborted_while_waiting_frees_nothing_twice(path):
    prompts = [random_prompt(n, seed=n) for n in (20, 30, 25, 40)]
    ref = make_engine(path, size=16, max_model_len=128).generate(prompts, greedy(40))
    eng = make_engine(path, num_blocks=12, size=16, max_model_len=128)
    ids = [eng.add_request(p, greedy(40)) for p in prompts]
    aborted: list = []

    def abort_a_preempted_one(e):
        preempted = e.last_step.preempted if e.last_step is not None else []
        waiting = [r for r in e.scheduler.waiting if r.request_id in preempted]  # not readmitted at once
        if waiting and not aborted:
            assert not waiting[0].block_ids
            aborted.append(waiting[0])
            e.abort_request(waiting[0].request_id)

    run = drive(eng, abort_a_preempted_one)
    assert aborted, "the cache was meant to force a preemption"
    assert aborted[0].finish_reason == "abort" and not aborted[0].block_ids  # an abort reports no output
    assert sorted(run.finished) == sorted(set(ids) - {aborted[0].request_id})
    for rid, r in zip(ids, ref):
        if rid in run.finished:
            assert run.finished[rid].output_token_ids == r.output_token_ids


def test_samples_deferred_at_the_fork_then_aborted_hold_no_blocks(path):
    """max_num_seqs=2: two of four samples wait after the fork (holding their first token, no KV); the
    request is aborted while they wait; the other request runs on unchanged."""
    other = random_prompt(12, seed=8)
    ref = make_engine(path).generate([other], greedy(10))[0].output_token_ids
    eng = make_engine(path, block_size=4, max_num_seqs=3)
    eng.add_request(random_prompt(10, seed=5), greedy(6, n=4), request_id="q")
    eng.add_request(other, greedy(10), request_id="other")
    deferred: list = []

    def abort_while_deferred(e):
        waiting = [r for r in e.scheduler.waiting if r.parent is not None]
        if waiting and not deferred:
            deferred.extend(waiting)
            check_engine(e)
            e.abort_request("q")

    run = drive(eng, abort_while_deferred)
    assert deferred, "the fork was meant to defer samples"
    assert all(r.finished and r.finish_reason == "abort" and not r.block_ids for r in deferred)
    assert run.finished["other"].output_token_ids == ref


def test_a_first_block_equal_to_another_prompts_second_block_is_no_hit(path):
    """Prompt A = X + Y + tail; prompt B = Y + own. B's first block has Y's tokens, but its key is the
    key of Y *at the start*, not after X: no hit, and B's tokens equal a run without prefix caching. A
    prompt starting with X does hit (the cache is on and A's blocks are in it)."""
    x, y = random_prompt(16, seed=21), random_prompt(16, seed=22)
    a, b, c = x + y + random_prompt(5, seed=23), y + random_prompt(7, seed=24), x + random_prompt(6, seed=25)
    eng = make_engine(path, block_size=16, prefix_caching=True)
    eng.generate([a], greedy(4))
    runs = {}
    for name, prompt in (("b", b), ("c", c)):
        eng.add_request(prompt, greedy(8), request_id=name)
        runs[name] = drive(eng)
    b_out, c_out = runs["b"].finished["b"], runs["c"].finished["c"]
    assert b_out.metrics.num_cached_tokens == 0
    assert sum(s.cached_prompt_tokens for s in runs["b"].steps) == 0
    assert c_out.metrics.num_cached_tokens == 16
    uncached = make_engine(path, block_size=16, prefix_caching=False).generate([b], greedy(8))[0]
    assert b_out.output_token_ids == uncached.output_token_ids
