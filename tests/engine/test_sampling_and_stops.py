"""Sampler, stop conditions, detokenisation, timing metrics."""

from __future__ import annotations

import pytest
import torch

from ladle.engine import SamplingParams, VirtualClock
from ladle.engine.detokenizer import find_stop
from ladle.engine.request import Request, RequestMetrics
from ladle.engine.sampler import Sampler
from tests.engine.helpers import GREEDY, drive, make_engine, random_prompt, run_to_completion


def _req(**params) -> Request:
    return Request("r", [1], SamplingParams(**params), RequestMetrics(0.0))


def test_sampler_greedy_rows_take_argmax_and_filters_hold():
    torch.manual_seed(0)
    logits = torch.randn(5, 50)
    reqs = [
        _req(temperature=0.0),
        _req(temperature=1.0, top_k=1),  # top-k 1 is greedy
        _req(temperature=0.7, top_p=1e-6),  # top-p tiny keeps only the best
        _req(temperature=1.0, min_p=1.0),  # min-p 1 keeps only the max
        _req(temperature=1.0, top_k=3),
    ]
    best = logits.argmax(-1)
    for _ in range(20):
        out = Sampler(seed=0, device=torch.device("cpu")).sample(logits, reqs)
        assert out[:4] == [best[i].item() for i in range(4)]
        assert out[4] in logits[4].topk(3).indices.tolist()


def test_sampler_distribution_follows_temperature():
    logits = torch.tensor([[0.0, 1.0, 2.0]])
    sampler = Sampler(seed=1, device=torch.device("cpu"))
    req = _req(temperature=1.0)
    counts = torch.zeros(3)
    for _ in range(3000):
        counts[sampler.sample(logits, [req])[0]] += 1
    expected = torch.softmax(logits[0], 0) * 3000
    assert torch.allclose(counts, expected, rtol=0.15)


def test_temperatures_too_small_to_divide_by_sample_greedily():
    # logits / 1e-40 overflows to inf and the softmax of that is NaN: the draw was token 0, every time.
    logits = torch.tensor([[0.5, 3.0, 1.0, -2.0], [4.0, 0.0, 1.0, 2.0]])
    sampler = Sampler(seed=1, device=torch.device("cpu"))
    for temperature in (1e-40, 1e-30, 1e-6):
        for _ in range(20):
            assert sampler.sample(logits, [_req(temperature=temperature), _req(temperature=temperature)]) == [1, 0]
    assert SamplingParams(temperature=1e-40).greedy and not SamplingParams(temperature=1e-5).greedy


def test_temperatures_past_float32_are_refused_and_the_largest_draws_within_the_mask():
    # The sampler divides float32 logits by the temperature: 1e39 is inf there, -inf / inf is NaN and the
    # draw was token 0, outside a grammar's mask. Refused above float32's largest; that one still draws.
    largest = torch.finfo(torch.float32).max
    for temperature in (1e39, 1e300, 10**400):
        (problem,) = SamplingParams(temperature=temperature).problems()
        assert problem.startswith(f"temperature={temperature!r} must be a finite number >= 0"), problem
    assert SamplingParams(temperature=largest).problems() == []
    logits = torch.tensor([[-float("inf"), 0.5, 3.0, -float("inf")]])
    sampler = Sampler(seed=1, device=torch.device("cpu"))
    drawn = {sampler.sample(logits, [_req(temperature=largest)])[0] for _ in range(200)}
    assert drawn == {1, 2}  # uniform over the allowed tokens, never a masked one


def test_integer_temperatures_never_fail_the_step():
    """All-int temperatures made an int64 tensor: 2**63 (valid, below float32's largest) overflowed it and
    failed every request of the step."""
    logits = torch.tensor([[0.5, 3.0, 1.0, -2.0], [4.0, 0.0, 1.0, 2.0]])
    sampler = Sampler(seed=1, device=torch.device("cpu"))
    tokens = sampler.sample(logits, [_req(temperature=1), _req(temperature=2**63)])
    assert len(tokens) == 2 and all(0 <= t < 4 for t in tokens)


def test_params_are_the_requests_own_copy(tiny_hf_model_dir):
    """A caller that reuses one SamplingParams (a new seed per request) or edits it after add_request
    changes no queued request; before, every request ran with the last seed and unvalidated edits."""
    path = tiny_hf_model_dir("qwen3")
    p = random_prompt(10, seed=5)
    alone = {s: make_engine(path).generate([p], SamplingParams(max_tokens=8, seed=s, ignore_eos=True))[0]
             for s in (0, 1)}
    eng = make_engine(path)
    shared = SamplingParams(max_tokens=8, ignore_eos=True)
    ids = {}
    for s in (0, 1):
        shared.seed = s
        ids[s] = eng.add_request(p, shared)
    shared.max_tokens, shared.logprobs = 40, -5  # after validation: must not reach the requests
    done = run_to_completion(eng)
    for s in (0, 1):
        assert done[ids[s]].output_token_ids == alone[s].output_token_ids
    assert alone[0].output_token_ids != alone[1].output_token_ids  # the seeds do differ


def test_per_request_seed_is_reproducible_whatever_the_batch(tiny_hf_model_dir):
    path = tiny_hf_model_dir("qwen3")
    seeded = SamplingParams(max_tokens=16, temperature=1.0, seed=123, ignore_eos=True)
    other = SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True)
    p = random_prompt(10, seed=5)
    alone = make_engine(path).generate([p], seeded)[0]
    batched = make_engine(path).generate([random_prompt(7, seed=1), p, random_prompt(30, seed=2)],
                                         [other, seeded, other])[1]
    assert alone.output_token_ids == batched.output_token_ids


def test_stop_token_ids_and_eos(tiny_hf_model_dir):
    path = tiny_hf_model_dir("qwen3")
    eng = make_engine(path)
    ref = eng.generate([random_prompt(10, seed=3)], GREEDY)[0].output_token_ids
    stop_at = ref[5]
    first = ref.index(stop_at)
    out = make_engine(path).generate(
        [random_prompt(10, seed=3)], SamplingParams(max_tokens=32, temperature=0.0, stop_token_ids=[stop_at])
    )[0]
    assert out.finish_reason == "stop" and out.output_token_ids == ref[: first + 1]
    # The model's EOS (id 2 in the tiny config) stops unless ignore_eos.
    eos_eng = make_engine(path)
    eos_eng.output_processor.eos_token_ids = {stop_at}
    out = eos_eng.generate([random_prompt(10, seed=3)], SamplingParams(max_tokens=32, temperature=0.0))[0]
    assert out.finish_reason == "stop" and out.output_token_ids == ref[: first + 1]


def test_stop_strings_cut_the_text(tiny_hf_model_dir):
    path = tiny_hf_model_dir("qwen3")  # no tokenizer files: the byte tokenizer decodes
    full = make_engine(path).generate([random_prompt(10, seed=4)], GREEDY)[0]
    text = full.text
    assert len(text) > 6
    stop = text[3:6]
    cut = text.find(stop)
    out = make_engine(path).generate(
        [random_prompt(10, seed=4)], SamplingParams(max_tokens=32, temperature=0.0, stop=[stop])
    )[0]
    assert out.finish_reason == "stop"
    assert out.text == text[:cut]


def test_find_stop_searches_only_new_text():
    assert find_stop("hello world", 5, ["wor"]) == 6
    assert find_stop("hello world", 2, ["lo"]) is None  # 'lo' ended before the new text
    assert find_stop("abc", 1, ["", "c"]) == 2


def test_text_deltas_add_up_and_split_no_characters(tiny_hf_model_dir):
    eng = make_engine(tiny_hf_model_dir("qwen3"))
    # Byte tokens 3.. are bytes 0..; force multi-byte UTF-8 by prompting nothing special: just check
    # that the concatenated deltas equal the final text and contain no replacement characters mid-way.
    rid = eng.add_request(random_prompt(12, seed=6), SamplingParams(max_tokens=40, temperature=1.0, seed=3))
    outs = drive(eng).of(rid)
    pieces, final = [o.new_text for o in outs], outs[-1]
    assert "".join(pieces) == final.text
    assert final.text == eng.tokenizer.decode(final.output_token_ids)


def test_virtual_clock_metrics(tiny_hf_model_dir):
    clock = VirtualClock()
    eng = make_engine(tiny_hf_model_dir("qwen3"), size=8, clock=clock)
    clock.advance_to(5.0)
    rid = eng.add_request(random_prompt(20, seed=1), SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    done = run_to_completion(eng)[rid]
    m = done.metrics
    assert m.arrival_time == 5.0
    assert m.first_scheduled_time == 5.0  # scheduled at once, at the start of the first step
    assert m.num_prefill_chunks == 3
    assert m.first_token_time == m.token_times[0] > m.first_scheduled_time
    assert all(b > a for a, b in zip(m.token_times, m.token_times[1:]))
    assert m.finish_time == m.token_times[-1] <= clock.now()  # the last update follows the token


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_text_prompts_are_tokenized(tiny_hf_model_dir, family):
    eng = make_engine(tiny_hf_model_dir(family))
    out = eng.generate(["hello there"], SamplingParams(max_tokens=4, temperature=0.0))[0]
    assert out.prompt_token_ids == eng.tokenizer.encode("hello there")
    assert out.finish_reason in ("length", "stop")


def test_top_p_applies_to_what_top_k_kept():
    # After top-k 2 the distribution is [.6, .4]: top-p 0.5 keeps only the first token (vLLM, HF).
    logits = torch.log(torch.tensor([[0.3, 0.2, 0.15, 0.15, 0.1, 0.1]]))
    sampler = Sampler(seed=0, device=torch.device("cpu"))
    req = _req(temperature=1.0, top_k=2, top_p=0.5)
    assert {sampler.sample(logits, [req])[0] for _ in range(300)} == {0}


def force_tokens(eng, data: bytes):
    """Make the engine 'sample' the given byte tokens in order (the byte tokenizer decodes them)."""
    forced = iter(data)
    eng.sampler.sample = lambda logits, reqs: [next(forced) for _ in reqs]


@pytest.mark.parametrize("stop", [["END"], "END", ["xyz", "ND"]])
def test_streamed_deltas_never_show_a_stop_string(tiny_hf_model_dir, stop):
    eng = make_engine(tiny_hf_model_dir("qwen3"))
    force_tokens(eng, b"abENDxyz")
    eng.add_request([65, 66, 67], SamplingParams(max_tokens=8, temperature=0.0, stop=stop))
    outs = drive(eng).outputs
    pieces, texts = [o.new_text for o in outs], [o.text for o in outs]
    expected = "abE" if stop == ["xyz", "ND"] else "ab"
    assert texts[-1] == expected and "".join(pieces) == expected
    assert all(expected.startswith(t) for t in texts)  # no partial stop string ever shown
    assert outs[-1].finish_reason == "stop"


@pytest.mark.parametrize(
    "params,needle",
    [
        (SamplingParams(temperature=None), "temperature=None"),
        (SamplingParams(temperature=float("nan")), "temperature=nan"),  # nan > 0 is False: was greedy
        (SamplingParams(temperature=float("inf")), "temperature=inf"),  # was a uniform draw
        (SamplingParams(temperature=1e39), "temperature=1e+39"),  # inf in float32: was a NaN draw
        (SamplingParams(top_k=None), "top_k=None"),
        (SamplingParams(stop_token_ids=None), "stop_token_ids=None"),
        (SamplingParams(stop_token_ids=5), "stop_token_ids=5"),
        (SamplingParams(stop=[1, 2]), "stop=[1, 2]"),
        (SamplingParams(max_tokens=True), "max_tokens=True"),
    ],
)
def test_bad_param_types_fail_the_request_not_the_engine(tiny_hf_model_dir, params, needle):
    eng = make_engine(tiny_hf_model_dir("qwen3"))
    bad = eng.add_request([5, 6, 7], params)
    good = eng.add_request([5, 6, 7], GREEDY)
    done = run_to_completion(eng)
    assert done[bad].finish_reason == "error" and needle in done[bad].error
    assert done[good].finish_reason == "length"
    eng.add_request([5], GREEDY, request_id=bad)  # the failed id is free again


def test_an_exception_while_updating_one_request_fails_only_it(tiny_hf_model_dir):
    eng = make_engine(tiny_hf_model_dir("qwen3"))
    a = eng.add_request([5, 6, 7], GREEDY)
    b = eng.add_request([8, 9], GREEDY)
    original = eng.output_processor.detokenizer.step

    def broken(state, prompt, output):
        if eng.requests.get(a) is not None and prompt is eng.requests[a].prompt_token_ids:
            raise UnicodeError("broken tokenizer")
        return original(state, prompt, output)

    eng.output_processor.detokenizer.step = broken
    done = run_to_completion(eng)
    assert done[a].finish_reason == "error" and "broken tokenizer" in done[a].error
    assert done[b].finish_reason == "length" and len(done[b].output_token_ids) == 32


@pytest.mark.parametrize("ids", [[True], [3, False], ["7"], 7])
def test_stop_token_ids_must_be_integers_not_booleans(ids):
    """A boolean is an int to Python: [True] would stop at token 1. It is refused, naming the field."""
    (problem,) = SamplingParams(stop_token_ids=ids).problems()
    assert problem.startswith("stop_token_ids=") and "list of integers" in problem
