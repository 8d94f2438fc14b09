"""The sampler's filters at their boundaries: default values are exact no-ops on a large vocabulary."""

from __future__ import annotations

import pytest
import torch

from ladle.engine import SamplingParams
from ladle.engine.request import Request, RequestMetrics
from ladle.engine.sampler import Sampler

VOCAB = 151_936  # Qwen3's vocabulary: float32 cumulative sums saturate at 1.0 well before its tail


def _req(**params) -> Request:
    return Request("r", [1], SamplingParams(**params), RequestMetrics(0.0))


def _tail_token_logits() -> tuple[torch.Tensor, int]:
    torch.manual_seed(0)
    logits = torch.randn(1, VOCAB) * 3
    tail = int(logits[0].argmin())  # the least likely token: last in sorted order
    return logits, tail


@pytest.mark.parametrize(
    "params",
    [
        {"temperature": 1.0},  # no filter at all: no sort
        {"temperature": 1.0, "top_p": 1.0, "top_k": VOCAB - 1, "min_p": 0.0},  # sorted path, top_p=1 kept whole
        {"temperature": 0.5, "top_p": 1.0, "top_k": 0, "min_p": 0.0},
    ],
)
def test_top_p_one_keeps_the_whole_vocabulary(monkeypatch, params):
    """Noise that favours the least likely token picks it iff its probability is > 0."""
    logits, tail = _tail_token_logits()
    if params.get("top_k") == VOCAB - 1:  # top-k drops exactly one token: make it not the tail
        tail = int(logits[0].topk(2, largest=False).indices[1])
    noise = torch.full((1, VOCAB), 1e30)
    noise[0, tail] = torch.finfo(torch.float32).tiny
    sampler = Sampler(seed=0, device=torch.device("cpu"))
    monkeypatch.setattr(sampler, "_noise", lambda reqs, vocab: noise.clone())
    assert sampler.sample(logits, [_req(**params)]) == [tail]


def test_temperature_only_rows_do_not_sort(monkeypatch):
    logits, _ = _tail_token_logits()
    calls = []
    real_sort = torch.Tensor.sort
    monkeypatch.setattr(torch.Tensor, "sort", lambda self, *a, **k: calls.append(1) or real_sort(self, *a, **k))
    Sampler(seed=0, device=torch.device("cpu")).sample(logits.repeat(3, 1), [_req(temperature=0.8)] * 3)
    assert calls == []
    Sampler(seed=0, device=torch.device("cpu")).sample(logits, [_req(temperature=0.8, top_p=0.9)])
    assert calls == [1]


def test_top_p_just_below_one_still_filters(monkeypatch):
    """The no-op is exactly top_p == 1: 0.5 drops the tail token."""
    logits, tail = _tail_token_logits()
    noise = torch.full((1, VOCAB), 1e30)
    noise[0, tail] = torch.finfo(torch.float32).tiny
    sampler = Sampler(seed=0, device=torch.device("cpu"))
    monkeypatch.setattr(sampler, "_noise", lambda reqs, vocab: noise.clone())
    assert sampler.sample(logits, [_req(temperature=1.0, top_p=0.5)]) != [tail]


def test_mixed_batch_filters_only_its_own_rows():
    torch.manual_seed(1)
    logits = torch.randn(4, 64)
    reqs = [_req(temperature=1.0, top_k=1), _req(temperature=1.0), _req(temperature=0.0),
            _req(temperature=1.0, min_p=1.0)]
    for seed in range(10):
        out = Sampler(seed=seed, device=torch.device("cpu")).sample(logits, reqs)
        assert out[0] == int(logits[0].argmax()) and out[2] == int(logits[2].argmax())
        assert out[3] == int(logits[3].argmax())


@pytest.mark.parametrize("filters", [{}, {"top_k": 3}, {"top_p": 0.9}, {"min_p": 0.1}])
def test_logits_that_overflow_under_the_temperature_are_still_drawn_from(filters):
    """A logit_bias up to float32's largest is valid: divided by a temperature below 1 it is inf, and
    the softmax of inf is NaN. The draw must still pick among the boosted tokens, never a token whose
    probability is 0 (the argmax of an all-NaN row is token 0)."""
    logits = torch.zeros(1, 32)
    logits[0, [7, 9]] = 3e38  # what logit_bias {7: 3e38, 9: 3e38} makes of them
    sampler = Sampler(seed=0, device=torch.device("cpu"))
    req = _req(temperature=0.5, seed=4, **filters)
    drawn = [sampler.sample(logits.clone(), [req])[0] for _ in range(40)]
    assert set(drawn) == {7, 9}  # both, as they tie: neither is more likely in float32
