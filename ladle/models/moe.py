"""A mixture-of-experts MLP (Qwen3-MoE, Mixtral): a router picks each token's top-k experts, and the
step's tokens are grouped by expert so that one forward runs each chosen expert once.

The grouped computation: the (token, expert) pairs are sorted by expert, the tokens gathered in that
order, each expert with any tokens runs its gated MLP on its contiguous rows (one matmul pair per expert,
whatever mix of decodes and prefill chunks the step holds), and the results are weighted and put back.

Batch invariance: routing is row-wise (the router is a packed Linear, softmax and top-k per row); each
expert is an ordinary MLP (models/layers.py), whose packed linear layers give a row the same bits at any
row count; and a token's k expert outputs are added in one fixed order, by increasing expert id (the order
transformers adds them in), never in an order the other tokens of the step decide.
"""

from __future__ import annotations

import torch
from torch import nn

from ladle.models.config import ModelArch
from ladle.models.layers import MLP
from ladle.models.linear import Linear


class SparseMoE(nn.Module):
    """`gate` (the router, [experts, hidden]) and `experts` (one MLP each), named as the checkpoints
    name them (Qwen3-MoE's `mlp.gate`, `mlp.experts.N.gate_proj`; the loader maps Mixtral's names)."""

    # The per-expert token counts are read on the host (one matmul per routed expert): a CUDA graph
    # cannot record that, so an engine with these layers runs its steps eagerly (engine/builder.py).
    graph_capturable = False

    def __init__(self, arch: ModelArch):
        super().__init__()
        self.num_experts, self.top_k = arch.num_experts, arch.num_experts_per_tok
        self.norm_topk_prob = arch.norm_topk_prob
        # transformers' Qwen3-MoE casts the routing weights to the model dtype before weighting; Mixtral
        # weights in float32 and casts the product.
        self.weights_in_model_dtype = arch.family == "qwen3_moe"
        self.gate = Linear(arch.hidden_size, arch.num_experts, bias=False)
        self.experts = nn.ModuleList(
            MLP(arch.hidden_size, arch.moe_intermediate_size, arch.hidden_act) for _ in range(arch.num_experts)
        )

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k], experts [T, k]) of each token, each row's experts in increasing id."""
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.weights_in_model_dtype:
            weights = weights.to(x.dtype)
        experts, order = experts.sort(dim=-1)
        return weights.gather(-1, order), experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t, hidden = x.shape
        weights, experts = self.route(x)
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "mixture-of-experts layers read their per-expert token counts on the host, which a CUDA graph "
                "cannot capture")
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)  # the (token, slot) pairs grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        grouped = x.index_select(0, order // self.top_k)
        out = torch.empty_like(grouped)
        start = 0
        for expert, n in enumerate(counts):
            if n:  # each expert with tokens runs once, on its contiguous rows
                out[start:start + n] = self.experts[expert](grouped[start:start + n])
                start += n
        per_slot = torch.empty_like(out).index_copy_(0, order, out).view(t, self.top_k, hidden)
        per_slot = (per_slot * weights.unsqueeze(-1)).to(x.dtype)
        total = per_slot[:, 0]
        for slot in range(1, self.top_k):  # increasing expert id: the same order for every token
            total = total + per_slot[:, slot]
        return total
