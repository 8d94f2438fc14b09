"""Gemma 3 (text) decoder layer: four (1 + weight) RMSNorms per block, q/k norm, GeLU-tanh MLP.

Sliding and full layers differ only in their window and RoPE table (local base for sliding layers);
the model picks both per layer from `arch.layer_types`.
"""

from __future__ import annotations

import torch
from torch import nn

from ladle.kernels import AttentionMetadata
from ladle.models.config import ModelArch
from ladle.models.layers import MLP, Attention, RMSNorm


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch, layer: int):
        super().__init__()
        h, eps = arch.hidden_size, arch.rms_norm_eps
        self.self_attn = Attention(arch, layer, qk_norm=True, norm_offset=True)
        self.mlp = MLP(h, arch.intermediate_size, arch.hidden_act)
        self.input_layernorm = RMSNorm(h, eps, offset=True)
        self.post_attention_layernorm = RMSNorm(h, eps, offset=True)
        self.pre_feedforward_layernorm = RMSNorm(h, eps, offset=True)
        self.post_feedforward_layernorm = RMSNorm(h, eps, offset=True)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's post-normed MLP output, the residual stream before it), as LlamaDecoderLayer."""
        h, residual = self.input_layernorm.add_and_norm(x, residual)
        h = self.post_attention_layernorm(self.self_attn(h, rope, kv_cache, meta, rows))
        if rows is not None:
            residual = residual.index_select(0, rows)
        h, residual = self.pre_feedforward_layernorm.add_and_norm(h, residual)
        return self.post_feedforward_layernorm(self.mlp(h)), residual
