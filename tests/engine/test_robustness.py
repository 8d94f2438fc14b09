"""No block leak under preemption, injected failures and random workloads; bad input never crashes."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ladle.engine import CacheConfig, ChunkingConfig, EngineConfig, LLMEngine, ModelConfig, SamplingParams
from tests.engine.helpers import GREEDY, fail_on_forward, make_engine, random_prompt, run_to_completion


@pytest.fixture(scope="module")
def path(tiny_hf_model_dir):
    return tiny_hf_model_dir("qwen3")


@pytest.fixture(scope="module")
def reference_engine(path):
    return make_engine(path, prefix_caching=False)


@pytest.mark.parametrize("backend,num_blocks", [("paged", 12), ("contiguous", 2)])
def test_preemption_recomputes_and_outputs_stay_identical(path, backend, num_blocks):
    prompts = [random_prompt(n, seed=n) for n in (20, 30, 25, 40)]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    ref = make_engine(path, size=16).generate(prompts, params)
    eng = make_engine(path, backend=backend, num_blocks=num_blocks, size=16, max_model_len=128)
    ids = [eng.add_request(p, params) for p in prompts]
    done = run_to_completion(eng)
    if backend == "paged":  # 12 blocks of 16 cannot hold four growing sequences: someone is preempted
        assert sum(done[i].metrics.num_preemptions for i in ids) > 0
    for rid, r in zip(ids, ref):
        assert done[rid].output_token_ids == r.output_token_ids
        assert len(done[rid].metrics.token_times) == 40


def test_failure_mid_prefill_fails_only_that_steps_requests(path):
    eng = make_engine(path, size=8)
    a = eng.add_request(random_prompt(5, seed=1), GREEDY)
    eng.step()  # a is decoding
    fail_on_forward(eng, 2)  # the second step after b's admission: b is mid-prefill
    b = eng.add_request(random_prompt(40, seed=2), GREEDY)
    eng.step()
    assert 0 < eng.requests[b].num_computed_tokens < 40
    outs = eng.step()
    failed = {o.request_id: o for o in outs}
    assert set(failed) == {a, b} and all(o.finish_reason == "error" for o in failed.values())
    assert "injected failure" in failed[b].error
    assert set(eng.last_step.failed) == {a, b}
    c = eng.add_request(random_prompt(12, seed=3), GREEDY)
    done = run_to_completion(eng)
    assert done[c].finish_reason == "length" and len(done[c].output_token_ids) == 32


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    lengths=st.lists(st.integers(1, 70), min_size=1, max_size=7),
    max_tokens=st.lists(st.integers(1, 12), min_size=7, max_size=7),
    chunk=st.integers(1, 40),
    num_blocks=st.integers(6, 30),
    budget=st.one_of(st.none(), st.integers(8, 64)),
    fail_step=st.one_of(st.none(), st.integers(0, 15)),
    arrivals=st.lists(st.integers(0, 3), min_size=7, max_size=7),
)
def test_random_workloads_never_leak_blocks(path, lengths, max_tokens, chunk, num_blocks, budget, fail_step, arrivals):
    eng = LLMEngine(
        EngineConfig(
            model=ModelConfig(path=str(path), dtype="float32", device="cpu"),
            cache=CacheConfig(block_size=4, num_blocks=num_blocks, max_model_len=128, prefix_caching=False),
            chunking=ChunkingConfig(size=chunk, token_budget=budget),
            max_num_seqs=4,
        )
    )
    fail_on_forward(eng, fail_step)
    pending = list(enumerate(lengths))
    done = {}
    step = 0
    while pending or eng.has_unfinished_requests():
        while pending and arrivals[pending[0][0]] <= step:
            i, n = pending.pop(0)
            eng.add_request(random_prompt(n, seed=i), SamplingParams(max_tokens=max_tokens[i], temperature=0.0))
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
        used = sum(len(r.block_ids) for r in eng.scheduler.running)
        assert eng.kv.pool.num_used == used, "blocks in use must equal the sum over live requests"
        eng.kv.pool.check_invariants()
        step += 1
        assert step < 5000
    assert len(done) == len(lengths)
    assert eng.num_free_blocks() == eng.num_total_blocks()
    for out in done.values():
        assert out.finish_reason in ("length", "stop", "error")
        if out.finish_reason == "error":
            assert out.error


def test_bad_input_gets_a_clear_per_request_error(path):
    eng = make_engine(path, size=16, max_model_len=64)
    cases = {
        "empty": ([], GREEDY, "empty prompt"),
        "too_long": (random_prompt(60, seed=1), GREEDY, "max_model_len=64"),
        "max_tokens": (random_prompt(5, seed=1), SamplingParams(max_tokens=0), "max_tokens=0"),
        "vocab": ([5, 99999, -1], GREEDY, "outside the vocabulary"),
        "top_p": (random_prompt(5, seed=1), SamplingParams(top_p=0.0), "top_p"),
    }
    for rid, (prompt, params, _) in cases.items():
        eng.add_request(prompt, params, request_id=rid)
    good = eng.add_request(random_prompt(5, seed=2), GREEDY, request_id="good")
    done = run_to_completion(eng)
    for rid, (_, _, needle) in cases.items():
        assert done[rid].finish_reason == "error" and needle in done[rid].error, done[rid].error
        assert done[rid].output_token_ids == []
    assert done[good].finish_reason == "length"


def test_duplicate_request_id_is_refused(path):
    eng = make_engine(path)
    eng.add_request([5, 6], GREEDY, request_id="x")
    with pytest.raises(ValueError, match="'x' is already in use"):
        eng.add_request([5, 6], GREEDY, request_id="x")


def test_automatic_ids_skip_the_ids_a_caller_chose(path):
    eng = make_engine(path)
    eng.add_request([5, 6], GREEDY, request_id="0")
    auto = eng.add_request([5, 6], GREEDY)  # was "0": refused as already in use
    assert auto != "0"
    eng.add_request([5, 7], GREEDY, request_id="3")
    outs = eng.generate([[8, 9], [9, 8], [7, 7]], SamplingParams(max_tokens=2, ignore_eos=True))
    assert len(outs) == 3 and len({o.request_id for o in outs} | {"0", auto, "3"}) == 6


def test_params_that_cannot_be_copied_are_the_requests_error(path):
    """add_request copies the params; a schema nested past the recursion limit made the copy raise out of
    add_request (a runner job then died on that row)."""
    from ladle.engine.sampling_params import StructuredOutputs

    deep: dict = {}
    node = deep
    for _ in range(50_000):
        node["items"] = {}
        node = node["items"]
    eng = make_engine(path)
    bad = eng.add_request([5, 6], SamplingParams(structured=StructuredOutputs(json_schema=deep)))
    good = eng.add_request([5, 6], GREEDY)
    done = run_to_completion(eng)
    assert done[bad].finish_reason == "error" and "cannot be copied" in done[bad].error
    assert done[good].finish_reason == "length"


def test_generate_leaves_nothing_queued_when_adding_its_requests_fails(path, monkeypatch):
    eng = make_engine(path)
    calls, original = [], eng.add_request

    def add_then_fail(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return original(*args, **kwargs)

    monkeypatch.setattr(eng, "add_request", add_then_fail)
    with pytest.raises(KeyboardInterrupt):
        eng.generate([[5, 6], [6, 7], [7, 8]], GREEDY)
    assert not eng.has_unfinished_requests() and not eng.requests  # the two added were aborted
    assert eng.step() == []


def test_aborting_a_refused_request_before_any_step_frees_its_id(path):
    # A job interrupted before its first step aborts what it added, refused requests included: their
    # id must be free for the resume and nothing left unfinished (found by tests/runner/test_fuzz_job.py).
    eng = make_engine(path)
    eng.add_request([], GREEDY, request_id="x")  # refused: an empty prompt
    eng.add_request([5, 6], SamplingParams(max_tokens=2, n=2), request_id="y")
    assert eng.has_unfinished_requests()
    eng.abort_request("x")
    eng.abort_request("y")
    assert not eng.has_unfinished_requests()
    assert eng.step() == []  # the refused request's error is not reported after its abort
    eng.add_request([], GREEDY, request_id="x")  # the id is free again
    done = run_to_completion(eng)
    assert done["x"].finish_reason == "error" and list(done) == ["x"]


@pytest.mark.parametrize(
    "overrides,needle",
    [
        ({"chunking": ChunkingConfig(size=0)}, "chunking.size=0"),
        ({"chunking": ChunkingConfig(token_budget=4)}, "chunking.token_budget=4"),
        ({"chunking": ChunkingConfig(enabled=False, token_budget=100)}, "chunking.token_budget=100"),
        ({"chunking": ChunkingConfig(prefill_interval=0)}, "chunking.prefill_interval=0"),
        ({"chunking": ChunkingConfig(ubatch=0)}, "chunking.ubatch=0"),
        ({"chunking": ChunkingConfig(max_chunks_per_step=0)}, "chunking.max_chunks_per_step=0"),
        ({"chunking": ChunkingConfig(max_partial_prefills=0)}, "chunking.max_partial_prefills=0"),
        ({"chunking": ChunkingConfig(decode_headroom=0)}, "chunking.decode_headroom=0"),
        ({"cache": CacheConfig(backend="ring")}, "cache.backend='ring'"),
        ({"cache": CacheConfig(block_size=0)}, "cache.block_size=0"),
        ({"cache": CacheConfig(backend="contiguous", prefix_caching=True)}, "cache.prefix_caching=True"),
        ({"max_num_seqs": 0}, "max_num_seqs=0"),
        ({"model": ModelConfig(path=None, architecture=None)}, "model.path"),
        ({"model": ModelConfig(path="x", dtype="float64")}, "model.dtype='float64'"),
    ],
)
def test_invalid_config_names_the_key(path, overrides, needle):
    kwargs = {"model": ModelConfig(path=str(path), dtype="float32", device="cpu"), "max_num_seqs": 8}
    kwargs.update(overrides)
    with pytest.raises(ValueError) as err:
        LLMEngine(EngineConfig(**kwargs))
    assert needle in str(err.value)


def test_max_model_len_beyond_model_positions(path):
    with pytest.raises(ValueError, match="max_position_embeddings"):
        make_engine(path, max_model_len=100_000)


def test_abort_frees_blocks_and_the_request_is_dropped(path):
    eng = make_engine(path, size=8)
    a = eng.add_request(random_prompt(30, seed=1), GREEDY)
    b = eng.add_request(random_prompt(10, seed=2), GREEDY)
    eng.step()  # a mid-prefill, b admitted
    assert eng.num_free_blocks() < eng.num_total_blocks()
    eng.abort_request(a)
    done = run_to_completion(eng)
    assert a not in done and done[b].finish_reason == "length"
    eng.abort_request(a)  # already gone: a no-op
    assert eng.num_free_blocks() == eng.num_total_blocks()


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    suffixes=st.lists(st.integers(1, 30), min_size=2, max_size=7),
    preamble=st.integers(0, 40),
    max_tokens=st.lists(st.integers(1, 12), min_size=7, max_size=7),
    chunk=st.integers(1, 40),
    num_blocks=st.integers(8, 30),
    max_partial=st.one_of(st.none(), st.integers(1, 2)),
    arrivals=st.lists(st.integers(0, 3), min_size=7, max_size=7),
)
def test_random_shared_prefix_workloads_with_prefix_caching(path, reference_engine, suffixes, preamble,
                                                            max_tokens, chunk, num_blocks, max_partial, arrivals):
    """Prefix caching on, shared preambles, a tight cache (preemption), partial-prefill caps: blocks in
    use always equal the distinct blocks live requests hold, and a step's scheduling never evicts more
    cached blocks than it newly allocates (a refused admission takes and evicts nothing)."""
    eng = LLMEngine(
        EngineConfig(
            model=ModelConfig(path=str(path), dtype="float32", device="cpu"),
            cache=CacheConfig(block_size=4, num_blocks=num_blocks, max_model_len=128, prefix_caching=True),
            chunking=ChunkingConfig(size=chunk, max_partial_prefills=max_partial),
            max_num_seqs=4,
        )
    )
    pool, sched = eng.kv.pool, eng.scheduler
    real_schedule = sched.schedule

    def checked_schedule():
        evictions, held = pool.num_evictions, {id(r): len(r.block_ids) for r in sched.running}
        out = real_schedule()
        new_blocks = sum(len(r.block_ids) - held.get(id(r), r.num_cached_blocks) for r in sched.running)
        assert pool.num_evictions - evictions <= new_blocks, "scheduling evicted blocks it did not use"
        assert all(not r.block_ids for r in sched.waiting), "a waiting request holds blocks"
        return out

    sched.schedule = checked_schedule
    shared = random_prompt(preamble, seed=99) if preamble else []
    pending = [(i, shared + random_prompt(n, seed=i)) for i, n in enumerate(suffixes)]
    prompts = {str(i): p for i, p in pending}
    done, step = {}, 0
    while pending or eng.has_unfinished_requests():
        while pending and arrivals[pending[0][0]] <= step:
            i, prompt = pending.pop(0)
            eng.add_request(prompt, SamplingParams(max_tokens=max_tokens[i], temperature=0.0, ignore_eos=True),
                            request_id=str(i))
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
        held = {b for r in sched.running for b in r.block_ids}
        assert pool.num_used == len(held), "blocks in use must equal the distinct blocks live requests hold"
        pool.check_invariants()
        step += 1
        assert step < 5000
    for rid, out in done.items():  # sharing cached KV never changes an output
        if out.finish_reason == "length":
            ref = reference_engine.generate([prompts[rid]], GREEDY)[0].output_token_ids
            assert out.output_token_ids == ref[: len(out.output_token_ids)]
