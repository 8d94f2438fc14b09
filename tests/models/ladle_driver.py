"""A minimal single-sequence driver for ladle models (the engine proper lives in engine/).

It owns a paged KV cache for one sequence (blocks deliberately out of order), feeds the prompt in one
or several chunks, then decodes one token per forward, building AttentionMetadata exactly as the
engine's model runner does.
"""

from __future__ import annotations

import math

import torch

from ladle.engine.kv_cache import layer_cache
from ladle.kernels import AttentionMetadata
from ladle.models import CausalLM


def make_kv_caches(model: CausalLM, num_blocks: int, block_size: int) -> list[torch.Tensor]:
    """Zeroed caches in the engine's layout (engine/kv_cache.layer_cache: head-major blocks on the CPU)."""
    a = model.arch
    dtype = next(model.parameters()).dtype
    device = next(model.parameters()).device
    shape = (2, num_blocks, block_size, a.num_kv_heads, a.head_dim)
    return [layer_cache(shape, dtype, device) for _ in range(a.num_layers)]


class Sequence:
    """One sequence's cache and position; `feed(tokens)` returns the float32 logits of every fed token."""

    def __init__(
        self,
        model: CausalLM,
        max_len: int,
        block_size: int = 16,
        kv_caches: list[torch.Tensor] | None = None,
        blocks: list[int] | None = None,
    ):
        """Own caches by default; or share `kv_caches` (a pool) using the given `blocks` of it."""
        self.model = model
        self.block_size = block_size
        num_blocks = math.ceil(max_len / block_size)
        if kv_caches is None:
            kv_caches = make_kv_caches(model, num_blocks + 1, block_size)
            blocks = list(range(num_blocks, 0, -1))  # reversed: block order must not matter
        self.kv_caches = kv_caches
        self.blocks = blocks
        self.length = 0

    @torch.inference_mode()
    def feed(self, tokens: list[int]) -> torch.Tensor:
        q = len(tokens)
        seq_len = self.length + q
        device = self.kv_caches[0].device
        meta = AttentionMetadata.build([q], [seq_len], [self.blocks], self.block_size, device=device)
        ids = torch.tensor(tokens, dtype=torch.long, device=device)
        positions = torch.arange(self.length, seq_len, device=device)
        hidden = self.model(ids, positions, self.kv_caches, meta)
        self.length = seq_len
        return self.model.compute_logits(hidden)


def prompt_logits(model: CausalLM, prompt: list[int], chunk: int | None = None) -> torch.Tensor:
    """Logits [len(prompt), vocab] with the prompt prefilled whole or in chunks of `chunk` tokens."""
    seq = Sequence(model, len(prompt))
    chunk = chunk or len(prompt)
    return torch.cat([seq.feed(prompt[i : i + chunk]) for i in range(0, len(prompt), chunk)]).cpu()


def greedy(model: CausalLM, prompt: list[int], max_new_tokens: int, chunk: int | None = None):
    """(prompt logits [P, vocab], greedy continuation of max_new_tokens ids); EOS does not stop it."""
    seq = Sequence(model, len(prompt) + max_new_tokens)
    chunk = chunk or len(prompt)
    logits = torch.cat([seq.feed(prompt[i : i + chunk]) for i in range(0, len(prompt), chunk)])
    out = [int(logits[-1].argmax())]
    while len(out) < max_new_tokens:
        out.append(int(seq.feed([out[-1]])[-1].argmax()))
    return logits.cpu(), out
