"""Logprobs of generated and prompt tokens: the raw model's, as vLLM reports by default.

A logprob here is log_softmax of the model's float32 logits over the whole logits row, taken BEFORE
temperature, top-k/top-p/min-p and any grammar mask: it says how likely the model finds the token, not
how likely the sampler was to pick it. Top-k alternatives are the k most likely ids, best first, among
ids the tokenizer knows (`vocab_limit`): an LM head padded beyond the tokenizer's vocabulary is not
reported, though its padded logits stay in the normaliser exactly as transformers computes it.

- Generated tokens: the sampling rows the step computed anyway (`SampleLogprobs`), taken before the
  sampler (and a grammar mask) touch them, gathered for the chosen token after sampling.
- Prompt tokens: the model runner keeps the hidden states of every prefill position of a request that
  asks for them and calls `token_logprobs` on them, a bounded number of rows at a time, so a long
  prompt never materialises [prompt_len, vocab].
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ladle.engine.memory import PROMPT_LOGPROB_LOGITS
from ladle.engine.request import Request

# Rows of [rows, vocab] float32 logits materialised at once for prompt logprobs (~128 MiB at most);
# the memory plan budgets this piece (memory.prompt_logprob_bytes).
_MAX_LOGIT_ELEMENTS = PROMPT_LOGPROB_LOGITS

TopK = list[tuple[int, float]]


def _top_k(logprobs: torch.Tensor, k: int, vocab_limit: int) -> list[TopK]:
    """Per row, the k best (token_id, logprob) among ids < vocab_limit, best first."""
    if k <= 0:
        return [[] for _ in range(logprobs.shape[0])]
    vals, ids = logprobs[:, :vocab_limit].topk(min(k, vocab_limit), dim=-1)
    return [list(zip(i, v)) for i, v in zip(ids.tolist(), vals.tolist())]


def token_logprobs(
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    targets: list[int],
    k: int,
    vocab_size: int,
    vocab_limit: int,
) -> tuple[list[float], list[TopK]]:
    """Logprob of targets[i] under the logits of hidden[i] (rows of vocab_size logits), and the top-k
    per row, computing the logits a bounded number of rows at a time."""
    chosen: list[float] = []
    tops: list[TopK] = []
    rows = max(1, _MAX_LOGIT_ELEMENTS // vocab_size)
    for start in range(0, hidden.shape[0], rows):
        lp = torch.log_softmax(compute_logits(hidden[start : start + rows]).float(), dim=-1)
        tgt = torch.tensor(targets[start : start + lp.shape[0]], device=lp.device)
        chosen.extend(lp.gather(1, tgt[:, None])[:, 0].tolist())
        tops.extend(_top_k(lp, k, vocab_limit))
    return chosen, tops


@dataclass
class SampleLogprobs:
    """Logprobs for a step's sampling rows, taken from the raw logits before sampling."""

    rows: list[int]  # indices into the sampled requests that asked for logprobs
    logprobs: torch.Tensor | None  # [len(rows), vocab] log_softmax of those rows
    tops: list[TopK]

    @staticmethod
    def prepare(logits: torch.Tensor, requests: list[Request], vocab_limit: int) -> SampleLogprobs:
        rows = [i for i, r in enumerate(requests) if r.params.logprobs is not None]
        if not rows:
            return SampleLogprobs([], None, [])
        index = torch.tensor(rows, device=logits.device)
        lp = torch.log_softmax(logits.index_select(0, index).float(), dim=-1)
        k = max(requests[i].params.logprobs for i in rows)
        tops = _top_k(lp, k, vocab_limit)
        tops = [t[: requests[i].params.logprobs] for t, i in zip(tops, rows)]
        return SampleLogprobs(rows, lp, tops)

    def results(self, tokens: list[int]) -> dict[int, tuple[float, TopK]]:
        """Row index -> (logprob of the sampled token, top-k) for the rows that asked."""
        if self.logprobs is None:
            return {}
        tgt = torch.tensor([tokens[i] for i in self.rows], device=self.logprobs.device)
        chosen = self.logprobs.gather(1, tgt[:, None])[:, 0].tolist()
        return {i: (c, t) for i, c, t in zip(self.rows, chosen, self.tops)}
