"""Token sampling, vectorised across the batch: greedy, temperature, top-k, top-p, min-p, seeds.

Greedy rows take the argmax. Other rows are filtered in one sorted pass and sampled with the
exponential-race trick (argmax of p / Exp(1) noise), which draws the noise per row, so a request
with its own seed gets the same tokens whatever else is in the batch.
"""

from __future__ import annotations

import torch

from engine.request import Request


class Sampler:
    def __init__(self, seed: int, device: torch.device) -> None:
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)

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
        rows = [i for i, r in enumerate(requests) if r.params.temperature > 0]
        if rows:
            reqs = [requests[i] for i in rows]
            tokens[rows] = self._sample_random(logits[rows], reqs)
        return tokens.tolist()

    def _sample_random(self, logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        _n, vocab = logits.shape
        dev = logits.device
        temp = torch.tensor([r.params.temperature for r in reqs], device=dev)
        top_k = torch.tensor([r.params.top_k if r.params.top_k > 0 else vocab for r in reqs], device=dev)
        top_p = torch.tensor([r.params.top_p for r in reqs], device=dev)
        min_p = torch.tensor([r.params.min_p for r in reqs], device=dev)

        sorted_logits, order = (logits / temp[:, None]).sort(dim=-1, descending=True)
        rank = torch.arange(vocab, device=dev)[None, :]
        # Filters apply in vLLM's and HF's order: top-k, then top-p and min-p on the distribution
        # renormalised over what top-k kept.
        probs = sorted_logits.masked_fill(rank >= top_k[:, None], float("-inf")).softmax(dim=-1)
        # top-p: keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop = (probs.cumsum(dim=-1) - probs) >= top_p[:, None]
        drop |= probs < min_p[:, None] * probs[:, :1]
        probs = probs.masked_fill(drop, 0.0)
        noise = self._noise(reqs, vocab).clamp_(min=torch.finfo(torch.float32).tiny)  # never 0/0
        choice = (probs / noise).argmax(dim=-1)
        return order.gather(1, choice[:, None]).squeeze(1)
