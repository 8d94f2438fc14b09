"""What changes a row's logits before any draw, greedy included, in vLLM V1's order: logit_bias, then
min_tokens (EOS and stop_token_ids masked, unless a grammar's mask left nothing else), then the penalties (repetition over the prompt and output
tokens, frequency and presence over the output tokens, as vLLM's `apply_penalties`).

Rows that set none of these cost nothing. A penalised row reads its prompt and output each step
(O(context) for that row only), as vLLM's penalties do.
"""

from __future__ import annotations

from collections.abc import Collection

import torch

from ladle.engine.request import Request


def processes(req: Request) -> bool:
    """Whether any processor changes this request's logits now."""
    p = req.params
    return (bool(p.logit_bias) or len(req.output_token_ids) < p.min_tokens or p.presence_penalty != 0.0
            or p.frequency_penalty != 0.0 or p.repetition_penalty != 1.0)


@torch.inference_mode()  # the forward's logits are inference tensors: changed in place only in that mode
def apply(logits: torch.Tensor, requests: list[Request], eos_token_ids: Collection[int] = ()) -> None:
    """Process the rows of `logits` (float32 [S, vocab], row i is requests[i]) in place."""
    for i, req in enumerate(requests):
        if processes(req):
            _process_row(logits[i], req, eos_token_ids)


def _process_row(row: torch.Tensor, req: Request, eos_token_ids: Collection[int]) -> None:
    p = req.params
    vocab, dev = row.shape[0], row.device
    if p.logit_bias:
        ids = torch.tensor(list(p.logit_bias), dtype=torch.long, device=dev)
        row.index_add_(0, ids, torch.tensor([float(v) for v in p.logit_bias.values()], device=dev))
    if len(req.output_token_ids) < p.min_tokens:
        stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
        stops = [t for t in stops if 0 <= t < vocab]
        if stops:
            ids = torch.tensor(stops, dtype=torch.long, device=dev)
            kept = row[ids].clone()
            row[ids] = float("-inf")
            if not bool((row > float("-inf")).any()):  # a grammar left only its end: that end wins
                row[ids] = kept
    if p.presence_penalty == 0.0 and p.frequency_penalty == 0.0 and p.repetition_penalty == 1.0:
        return
    output = torch.tensor(req.output_token_ids, dtype=torch.long, device=dev)
    counts = torch.zeros(vocab, device=dev).index_add_(0, output, torch.ones(len(output), device=dev))
    if p.repetition_penalty != 1.0:
        seen = counts > 0
        seen[torch.tensor(req.prompt_token_ids, dtype=torch.long, device=dev)] = True
        rep = torch.where(seen, torch.tensor(float(p.repetition_penalty), device=dev), 1.0)
        row.copy_(torch.where(row > 0, row / rep, row * rep))
    row -= float(p.frequency_penalty) * counts + float(p.presence_penalty) * (counts > 0)
