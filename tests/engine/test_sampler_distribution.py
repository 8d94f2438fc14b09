"""The sampler draws from the exact distribution: softmax(logits / temperature), then top-k, top-p and
min-p, checked by a chi-square test over thousands of draws at several temperatures and at the
filters' limits. Each case also proves the test's power: the same counts are far outside the bound
against the distribution a sampler would give if it ignored the temperature (or the filter)."""

from __future__ import annotations

import math

import pytest
import torch

from ladle.engine.request import Request, RequestMetrics
from ladle.engine.sampler import Sampler
from ladle.engine.sampling_params import SamplingParams

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
DRAWS = 6000
# chi-square with <= 5 degrees of freedom exceeds 40 with probability < 1e-6 (df=5: ppf(1 - 1e-6) = 35.9)
BOUND = 40.0


def exact(temperature: float, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
          logits: torch.Tensor = LOGITS) -> list[float]:
    """The reference distribution in float64, written from the definitions in vLLM V1's order:
    temperature; min-p (tokens at least min_p times the best's probability) and top-k (tokens whose
    logit is >= the k-th largest, ties kept); then top-p on the distribution renormalised over them."""
    z = [x / temperature for x in logits.double().tolist()]
    m = max(z)
    full = [math.exp(x - m) / sum(math.exp(y - m) for y in z) for x in z]
    kth = sorted(z, reverse=True)[top_k - 1] if 0 < top_k < len(z) else -math.inf
    kept = [i for i in sorted(range(len(z)), key=lambda i: -z[i]) if z[i] >= kth and full[i] >= min_p * max(full)]
    total = sum(full[i] for i in kept)
    p = {i: full[i] / total for i in kept}
    cum, keep = 0.0, []
    for i in kept:
        if cum >= top_p and top_p < 1.0:
            break
        keep.append(i)
        cum += p[i]
    total = sum(p[i] for i in keep)
    return [p[i] / total if i in keep else 0.0 for i in range(len(z))]


def draw(params: SamplingParams, logits: torch.Tensor = LOGITS) -> list[int]:
    sampler = Sampler(seed=1234, device=torch.device("cpu"))
    reqs = [Request(str(i), [1], params, RequestMetrics(arrival_time=0.0)) for i in range(DRAWS)]
    tokens = sampler.sample(logits.repeat(DRAWS, 1), reqs)
    return [tokens.count(t) for t in range(len(logits))]


def chi_square(counts: list[int], probs: list[float]) -> float:
    """Pearson's statistic over the tokens with probability > 0; a draw of a zero-probability token
    is infinitely unlikely."""
    stat = 0.0
    for c, p in zip(counts, probs, strict=True):
        if p == 0.0:
            if c:
                return math.inf
            continue
        stat += (c - DRAWS * p) ** 2 / (DRAWS * p)
    return stat


CASES = [
    # (params, the distribution of a sampler that ignores what is tested)
    ({"temperature": 1.0}, {"temperature": 0.5}),
    ({"temperature": 0.5}, {"temperature": 1.0}),
    ({"temperature": 2.0}, {"temperature": 1.0}),
    ({"temperature": 0.25}, {"temperature": 1.0}),
    ({"temperature": 1.5, "top_k": 3}, {"temperature": 1.5}),
    ({"temperature": 1.0, "top_k": 1}, {"temperature": 1.0}),  # limit: top_k=1 is greedy
    ({"temperature": 4.0, "top_k": 5}, {"temperature": 4.0}),  # limit: vocab - 1 drops only the last
    ({"temperature": 1.0, "top_p": 0.5}, {"temperature": 1.0}),
    ({"temperature": 2.0, "top_p": 0.9}, {"temperature": 1.0, "top_p": 0.9}),
    ({"temperature": 1.0, "top_p": 0.01}, {"temperature": 1.0}),  # limit: only the best token
    ({"temperature": 1.0, "min_p": 0.3}, {"temperature": 1.0}),
    ({"temperature": 3.0, "min_p": 0.5}, {"temperature": 1.0, "min_p": 0.5}),
    ({"temperature": 1.0, "min_p": 1.0}, {"temperature": 1.0}),  # limit: only tokens as likely as the best
    ({"temperature": 1.5, "top_k": 4, "top_p": 0.8, "min_p": 0.1}, {"temperature": 1.5, "top_k": 4}),
    # min-p first, then top-p on what it kept (vLLM V1): only token 0. Top-p on the whole distribution
    # first (the order ladle had) keeps tokens 0 and 1, the distribution of min_p alone.
    ({"temperature": 1.0, "min_p": 0.3, "top_p": 0.7}, {"temperature": 1.0, "min_p": 0.3}),
    ({"temperature": 1.0, "top_k": -1}, {"temperature": 0.5}),  # vLLM's -1: every token
]


@pytest.mark.parametrize(("params", "wrong"), CASES, ids=[str(c[0]) for c in CASES])
def test_sampled_distribution_matches_the_exact_softmax(params, wrong):
    counts = draw(SamplingParams(max_tokens=1, **params))
    assert chi_square(counts, exact(**params)) < BOUND, (counts, exact(**params))
    # power: the counts reject the distribution of a sampler that ignored the parameter
    assert chi_square(counts, exact(**wrong)) > 5 * BOUND, (counts, exact(**wrong))


def test_seeded_rows_are_independent_of_the_batch():
    """A seeded request draws the same tokens alone and among others (the noise is drawn per row)."""
    alone = Sampler(seed=1, device=torch.device("cpu"))
    crowd = Sampler(seed=2, device=torch.device("cpu"))
    mine = Request("x", [1], SamplingParams(temperature=0.8, seed=7), RequestMetrics(arrival_time=0.0))
    twin = Request("y", [1], SamplingParams(temperature=0.8, seed=7), RequestMetrics(arrival_time=0.0))
    others = [Request(str(i), [1], SamplingParams(temperature=1.0), RequestMetrics(arrival_time=0.0))
              for i in range(5)]
    a = [alone.sample(LOGITS[None], [mine])[0] for _ in range(50)]
    b = [crowd.sample(LOGITS.repeat(6, 1), [*others[:3], twin, *others[3:]])[3] for _ in range(50)]
    assert a == b and len(set(a)) > 1


TIED = torch.tensor([2.0, 1.0, 1.0, 1.0, 0.0, -1.0])  # three tokens tie for the 2nd place (common in bf16)


def by_rank(temperature: float, top_k: int, logits: torch.Tensor) -> list[float]:
    """What a rank-based top-k would draw from: the first k after a sort, ties cut by their order."""
    z = (logits.double() / temperature).softmax(-1).tolist()
    keep = sorted(range(len(z)), key=lambda i: (-z[i], i))[:top_k]
    return [z[i] / sum(z[j] for j in keep) if i in keep else 0.0 for i in range(len(z))]


@pytest.mark.parametrize("top_k", [2, 3])
def test_top_k_keeps_every_token_tied_with_the_kth(top_k):
    """As vLLM and transformers' TopKLogitsWarper: a token whose logit equals the k-th largest is kept,
    so top_k=2 over [2, 1, 1, 1, ...] draws from four tokens, not two."""
    counts = draw(SamplingParams(max_tokens=1, temperature=1.0, top_k=top_k), TIED)
    want = exact(1.0, top_k=top_k, logits=TIED)
    assert [p > 0 for p in want] == [True, True, True, True, False, False]
    assert chi_square(counts, want) < BOUND, (counts, want)
    assert chi_square(counts, by_rank(1.0, top_k, TIED)) > 5 * BOUND, counts  # power: rank-based is refused
