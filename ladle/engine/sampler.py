"""Token sampling, vectorised across the batch: greedy, temperature, min-p, top-k, top-p, seeds.

The logits are first processed (engine/logits_processors.py: logit_bias, min_tokens, penalties). Greedy
rows take the argmax. Rows that use min-p, top-k or top-p are filtered in one sorted pass, in vLLM V1's
order (their defaults, min_p=0, top_k=0 or -1, top_p=1, are exact no-ops and cost no sort); rows are sampled with
the exponential-race trick (argmax of p / Exp(1) noise), which draws the noise per row, so a request
with its own seed gets the same tokens whatever else is in the batch.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass

import torch

from ladle.engine.logits_processors import apply as process_logits
from ladle.engine.logprobs import SampleLogprobs, TopK
from ladle.engine.request import Request

Mask = Callable[[torch.Tensor, list[Request]], None]  # masks logits rows in place (structured output)


@dataclass(slots=True)
class Drawn:
    """What a step drew: a token per sampling request, and (logprob, top-k) for those that asked."""

    tokens: dict[Request, int]
    logprobs: dict[Request, tuple[float, TopK]]


class Sampler:
    def __init__(self, seed: int, device: torch.device, max_rows: int = 1 << 30,
                 logprob_vocab: int | None = None) -> None:
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.max_rows = max_rows  # rows drawn at once: what the memory plan budgets (memory.sampler_bytes)
        self.logprob_vocab = logprob_vocab  # ids reported as top-k alternatives: [0, logprob_vocab)

    def draw(self, logits: torch.Tensor, rows: list[int] | None, requests: list[Request],
             mask: Mask | None = None, eos_token_ids: Collection[int] = ()) -> Drawn:
        """A token for each request from its logits row (`rows[i]`, or row i when rows is None): raw
        logprobs first, then the mask (grammars), the logits processors (min_tokens masks EOS, unless
        ignore_eos, and stop_token_ids), then sampling. n > 1 forks repeat a parent's row n times
        (engine/n_samples.py), so the rows are drawn max_rows at a time."""
        tokens: list[int] = []
        logprobs: dict[Request, tuple[float, TopK]] = {}
        for lo in range(0, len(requests), self.max_rows):
            hi = min(lo + self.max_rows, len(requests))
            part = requests[lo:hi]
            if rows is None and hi - lo == logits.shape[0]:
                chunk = logits  # the common case: every row once, no copy
            else:
                picked = rows[lo:hi] if rows is not None else list(range(lo, hi))
                chunk = logits[torch.tensor(picked, dtype=torch.long, device=logits.device)]
            vocab = self.logprob_vocab or logits.shape[-1]
            sample_logprobs = SampleLogprobs.prepare(chunk, part, vocab)  # raw logits
            if mask is not None:
                mask(chunk, part)
            process_logits(chunk, part, eos_token_ids)
            drawn = self.sample(chunk, part)
            tokens.extend(drawn)
            logprobs.update((part[i], lp) for i, lp in sample_logprobs.results(drawn).items())
        return Drawn(dict(zip(requests, tokens)), logprobs)

    def _noise(self, requests: list[Request], vocab: int) -> torch.Tensor:
        noise = torch.empty(len(requests), vocab, device=self.device)
        seeded = [i for i, r in enumerate(requests) if r.params.seed is not None]
        if len(seeded) < len(requests):
            noise.exponential_(generator=self.generator)
        for i in seeded:
            req = requests[i]
            if req.generator is None:
                req.generator = torch.Generator(device=self.device).manual_seed(req.params.seed)
            noise[i].exponential_(generator=req.generator)
        return noise

    def sample(self, logits: torch.Tensor, requests: list[Request]) -> list[int]:
        """logits: float32 [S, vocab], one row per request; returns one token id per row."""
        tokens = logits.argmax(dim=-1)
        rows = [i for i, r in enumerate(requests) if not r.params.greedy]
        if rows:
            reqs = [requests[i] for i in rows]
            tokens[rows] = self._sample_random(logits[rows], reqs)
        return tokens.tolist()

    def _sample_random(self, logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        """Sample the rows that are not greedy (temperature >= GREEDY_BELOW). Rows without
        top-k/top-p/min-p need no sort over the vocabulary; only rows that filter pay for one."""
        vocab = logits.shape[1]
        # float32 whatever the params hold: all-int temperatures would make an int64 tensor (2**63 overflows it)
        temp = torch.tensor([float(r.params.temperature) for r in reqs], dtype=torch.float32, device=logits.device)
        # A valid logit_bias (or a small repetition_penalty) up to float32's largest overflows to inf
        # once divided by a temperature below 1, and softmax(inf) is NaN: capped, the tokens that
        # overflowed share the mass (float32 cannot tell them apart), as the limit does.
        scaled = (logits / temp[:, None]).clamp_(max=torch.finfo(torch.float32).max)
        probs = scaled.softmax(dim=-1)
        noise = self._noise(reqs, vocab).clamp_(min=torch.finfo(torch.float32).tiny)  # never 0/0
        filtered = [i for i, r in enumerate(reqs) if _filters(r, vocab)]
        if filtered:
            rows = torch.tensor(filtered, device=logits.device)
            picked = scaled[rows]
            del scaled  # only the filtered rows' copy stays alive (memory.SAMPLER_BYTES_PER_LOGIT)
            kept = self._filter(picked, [reqs[i] for i in filtered])
            probs[rows] = kept
        return (probs / noise).argmax(dim=-1)

    @staticmethod
    def _filter(scaled: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        """Probabilities after vLLM V1's filters, in vocabulary order: min-p and top-k on the scaled
        logits (min-p drops tokens less likely than min_p times the best; top-k keeps every token whose
        logit is >= the k-th largest, ties included, as vLLM and transformers' TopKLogitsWarper do),
        then top-p on the distribution renormalised over what they kept."""
        _n, vocab = scaled.shape
        dev = scaled.device
        top_k = torch.tensor([_top_k(r, vocab) for r in reqs], device=dev)
        top_p = torch.tensor([r.params.top_p for r in reqs], device=dev)
        min_p = torch.tensor([r.params.min_p for r in reqs], device=dev)
        sorted_logits, order = scaled.sort(dim=-1, descending=True)
        full = sorted_logits.softmax(dim=-1)
        kth = sorted_logits.gather(1, (top_k - 1)[:, None])
        drop = (sorted_logits < kth) | (full < min_p[:, None] * full[:, :1])
        del full  # freed before the next [rows, vocab] tensors (memory.SAMPLER_BYTES_PER_LOGIT)
        probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        # top-p keeps the smallest prefix whose mass reaches top_p (the first token always stays).
        # top_p = 1 must keep everything: in float32 the running sum reaches 1.0 before the tail of
        # a large vocabulary, so the comparison alone would drop real tokens.
        drop = ((probs.cumsum(dim=-1) - probs) >= top_p[:, None]) & (top_p[:, None] < 1.0)
        probs = probs.masked_fill(drop, 0.0)
        return torch.zeros_like(probs).scatter_(1, order, probs)


def _top_k(req: Request, vocab: int) -> int:
    k = req.params.top_k
    return vocab if k <= 0 or k >= vocab else k  # 0 and -1 (vLLM's "all tokens") are off


def _filters(req: Request, vocab: int) -> bool:
    """Whether any of min-p, top-k, top-p changes the distribution (their defaults are exact no-ops)."""
    p = req.params
    return _top_k(req, vocab) < vocab or p.top_p < 1.0 or p.min_p > 0.0
