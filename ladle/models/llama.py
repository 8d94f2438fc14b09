"""The Llama-shaped decoder layer: pre-norm attention and a gated MLP, each added to the residual.

Llama 3.x, Qwen2/2.5, Qwen3, Mistral, Phi-3/4, Qwen3-MoE and Mixtral are this layer; what differs is in the
ModelArch: a per-head RMSNorm on q and k before RoPE (Qwen3, `arch.qk_norm`), q/k/v biases (Qwen2),
partial rotary (Phi), sliding windows (`arch.window`), and a mixture of experts in place of the MLP
(`arch.is_sparse`, models/moe.py).
"""

from __future__ import annotations

import torch
from torch import nn

from ladle.kernels import AttentionMetadata
from ladle.models.config import ModelArch
from ladle.models.layers import MLP, Attention, RMSNorm
from ladle.models.moe import SparseMoE


class LlamaDecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch, layer: int):
        super().__init__()
        self.self_attn = Attention(arch, layer, qk_norm=arch.qk_norm)
        if arch.is_sparse(layer):
            self.mlp: nn.Module = SparseMoE(arch)
        else:
            self.mlp = MLP(arch.hidden_size, arch.intermediate_size, arch.hidden_act, bias=arch.mlp_bias)
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, the residual stream before it); the next layer's norm adds them.
        rows: only those go on past the attention (the last layer; ladle.kernels.metadata.OutputRows)."""
        h, residual = self.input_layernorm.add_and_norm(x, residual)
        h = self.self_attn(h, rope, kv_cache, meta, rows)
        if rows is not None:
            residual = residual.index_select(0, rows)
        h, residual = self.post_attention_layernorm.add_and_norm(h, residual)
        return self.mlp(h), residual
