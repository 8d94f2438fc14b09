"""Building blocks shared by the model families: RMSNorm, RoPE, gated MLP, paged attention.

Every tensor is flattened over the batch: [T, ...] where T is the number of tokens in the step (prefill
chunks and decodes of many sequences together). The math follows transformers' implementations step
for step (same dtype casts, same operation order) so outputs match it closely in fp32 and bf16.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ladle.kernels import AttentionMetadata, attention, cpu_fused, write_kv_cache
from ladle.models.attention_op import attention_op
from ladle.models.config import ModelArch
from ladle.models.linear import Linear

ACTIVATIONS = {
    "silu": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
}


# The same activations for the batch-invariant mode, written with exp / tanh / erf. F.silu and F.gelu run a
# vectorised loop and a scalar one for the remainder, which round differently (Sleef vs libm); where the
# remainder falls depends on the row count and on where the threads cut the tensor, so a row's activation
# changed with the batch (measured: SiLU at width 1000, GELU-tanh at 2730, 2 threads). torch's CPU exp,
# tanh and erf (vml) run every element through the same vector code. Within an ulp of the fused forms.
def _silu_invariant(x: torch.Tensor) -> torch.Tensor:
    denominator = torch.exp(-x)
    denominator += 1
    return x / denominator


def _gelu_tanh_invariant(x: torch.Tensor) -> torch.Tensor:
    inner = math.sqrt(2 / math.pi) * (x + 0.044715 * (x * x * x))
    return 0.5 * x * (1 + torch.tanh(inner))


def _gelu_erf_invariant(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1 + torch.erf(x * math.sqrt(0.5)))


INVARIANT_ACTIVATIONS = {
    "silu": _silu_invariant,
    "gelu_pytorch_tanh": _gelu_tanh_invariant,
    "gelu_tanh": _gelu_tanh_invariant,
    "gelu": _gelu_erf_invariant,
}


def fused_cpu(x: torch.Tensor) -> bool:
    """Whether x's elementwise work runs in the fused C++ kernels (kernels/cpu_fused.py): CPU float32, no
    autograd; eager and compiled alike (compiled calls them as custom ops, so both give the same bits)."""
    return (
        x.dtype == torch.float32 and x.device.type == "cpu" and not torch.is_grad_enabled()
        and cpu_fused.enabled()
    )


class RMSNorm(nn.Module):
    """RMSNorm computed in float32. `offset=True` is Gemma's variant: scale by (1 + weight), cast last."""

    def __init__(self, dim: int, eps: float, offset: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps
        self.offset = offset

    def derive_weights(self) -> None:
        """Gemma's (1 + weight) in float32, computed once the weights are final instead of per call
        (one op less per norm; the same values HF computes each time). A non-persistent buffer: it
        follows .to(device) and stays out of the state dict."""
        if self.offset:
            self.register_buffer("scale", 1.0 + self.weight.float(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if fused_cpu(x):
            return cpu_fused.add_rms_norm(x, None, self._fused_weight(), self.eps)[0]
        return self.with_weight(x, self.weight, getattr(self, "scale", None))

    def _fused_weight(self) -> torch.Tensor:
        """What multiplies the normed row: the weight, or the offset variant's 1 + weight (float32)."""
        if not self.offset:
            return self.weight
        scale = getattr(self, "scale", None)
        return 1.0 + self.weight.float() if scale is None else scale

    def with_weight(
        self, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None
    ) -> torch.Tensor:
        """This norm with another weight broadcastable over x (q and k heads normed in one go).
        scale: the offset variant's (1 + weight) in float32 when derive_weights made it."""
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (xf * (1.0 + weight.float() if scale is None else scale)).to(x.dtype)
        return weight * xf.to(x.dtype)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): the residual add fused into the norm's call, so a layer
        passes its un-normed stream along instead of adding it back as a separate step (as vLLM does).
        residual=None (the first layer) norms x alone."""
        if fused_cpu(x):
            return cpu_fused.add_rms_norm(x, residual, self._fused_weight(), self.eps)
        if residual is not None:
            x = x + residual
        return self(x), x


def rope_inv_freq(params: dict, head_dim: int, factors: str = "short_factor") -> torch.Tensor:
    """Inverse frequencies [head_dim / 2] (float32) for rope types default, linear, llama3 and longrope
    (its `factors`: "short_factor" or "long_factor"). head_dim: the rotated width."""
    base = params["rope_theta"]
    # Explicitly on CPU: models are built under torch.device("meta"), the table must hold real values.
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    kind = params["rope_type"]
    if kind == "longrope":
        return 1.0 / (torch.tensor(params[factors], dtype=torch.float32, device="cpu") * base**exponent)
    inv_freq = 1.0 / (base**exponent)
    if kind == "linear":
        return inv_freq / params["factor"]
    if kind == "llama3":
        factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
        old_len = params["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths (beyond old_len / low) are divided by factor, short ones (below old_len / high)
        # kept; in between, interpolate smoothly between the two.
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, smoothed, scaled)
    return inv_freq


class RotaryEmbedding:
    """cos/sin tables by absolute position, built once per device and dtype, indexed by `positions`.

    The table covers max_position_embeddings (or the longest sequence seen, if longer) so it is built
    once and never reallocated mid-run (CUDA graphs can hold on to it). The tables are full head dim:
    cos = cat(cos, cos) as HF builds it, and sin = cat(-sin, sin), the sign of rotate_half folded in, so
    applying RoPE is x * cos + roll(x, D/2) * sin: four ops instead of seven, each rounding as HF's do.

    LongRoPE (Phi-3/4) switches by position: positions below original_max_position_embeddings take the
    short factors, later ones the long factors, and both tables are scaled by the attention factor. That is
    transformers' choice for every sequence whose prompt fits the original length (it picks the set by the
    longest position of each forward); a longer prompt gets the long set from its first position there,
    here only past the original length. A fixed table per position keeps chunked prefill, prefix caching
    and batching from changing a cached key.
    """

    def __init__(self, params: dict, head_dim: int, max_positions: int):
        self.inv_freq = rope_inv_freq(params, head_dim)
        self.long_inv_freq = self.switch = None
        self.attention_factor = params.get("attention_factor", 1.0)
        if params["rope_type"] == "longrope":
            self.long_inv_freq = rope_inv_freq(params, head_dim, "long_factor")
            self.switch = params["original_max_position_embeddings"]
        self.max_positions = max_positions
        self._tables: dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}

    def _table(
        self, length: int, device: torch.device, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        key = (device, dtype)
        table = self._tables.get(key)
        if table is None or table[0].shape[0] < length:
            n = max(length, self.max_positions, 0 if table is None else 2 * table[0].shape[0])
            pos = torch.arange(n, device=device, dtype=torch.int64).float()
            freqs = torch.outer(pos, self.inv_freq.to(device))  # float32, as HF computes them
            if self.long_inv_freq is not None:
                long = torch.outer(pos, self.long_inv_freq.to(device))
                freqs = torch.where((pos >= self.switch).unsqueeze(1), long, freqs)
            cos, sin = freqs.cos(), freqs.sin()
            if self.attention_factor != 1.0:
                cos, sin = cos * self.attention_factor, sin * self.attention_factor
            cos, sin = cos.to(dtype), sin.to(dtype)
            table = self._tables[key] = (torch.cat((cos, cos), -1), torch.cat((-sin, sin), -1))
        return table

    def prepare(self, device: torch.device, dtype: torch.dtype) -> None:
        """Build the table for max_positions now (a compiled forward must find it built)."""
        self._table(self.max_positions, device, dtype)

    def __call__(
        self, positions: torch.Tensor, max_len: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, signed sin [T, 1, head_dim] for `positions` [T]; max_len bounds every position (host int)."""
        cos, sin = self._table(max_len, positions.device, dtype)
        return cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, H, D] by HF's rotate_half convention: x * cos + cat(-x2, x1) * sin, where
    cat(-x2, x1) * sin == roll(x, D/2) * cat(-sin, sin) (the signed table RotaryEmbedding returns)."""
    # Not addcmul: it rounds once where HF rounds twice, and bf16 must stay bit-identical to HF.
    half = x.shape[-1] // 2
    # roll(x, D/2) as one cat of the halves: roll guards on the token count (a compile recompile).
    return x * cos + torch.cat((x[..., half:], x[..., :half]), dim=-1) * sin


class PackedLinear(Linear):
    """One Linear whose output rows are several checkpoint projections stacked (q|k|v, gate|up): one
    matmul instead of several. `shards` names them in order with their row counts; the loader copies
    each checkpoint tensor into its rows (models/loader.py), so HF checkpoints load unchanged."""

    def __init__(self, in_features: int, shards: dict[str, int], bias: bool = False):
        super().__init__(in_features, sum(shards.values()), bias=bias)
        self.shards = dict(shards)

    def shard_rows(self, name: str) -> slice:
        start = 0
        for shard, rows in self.shards.items():
            if shard == name:
                return slice(start, start + rows)
            start += rows
        raise KeyError(name)


class MLP(nn.Module):
    """down(act(gate(x)) * up(x)), gate and up as one packed matmul. On CPU float32, act(gate) * up is one
    fused kernel pass (kernels/cpu_fused.py; row-wise, so in both modes), computed inside the down
    projection's GEMM where it runs kernels/cpu_gemm (Linear.gated). `deterministic`: the
    torch path's activation takes its batch-invariant form (INVARIANT_ACTIVATIONS; set by
    CausalLM.set_deterministic)."""

    def __init__(self, hidden: int, intermediate: int, act: str, bias: bool = False):
        super().__init__()
        if act not in ACTIVATIONS:
            raise ValueError(f"unsupported activation {act!r}; supported: {sorted(ACTIVATIONS)}")
        self.gate_up_proj = PackedLinear(hidden, {"gate_proj": intermediate, "up_proj": intermediate}, bias)
        self.down_proj = Linear(intermediate, hidden, bias=bias)
        self.act = ACTIVATIONS[act]
        self.invariant_act = INVARIANT_ACTIVATIONS[act]
        self.act_name = act
        self.deterministic = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.act_name in cpu_fused.ACTIVATIONS and fused_cpu(gate_up):
            # Row-wise by construction, so deterministic mode takes it too. On the packed path the
            # activation runs inside the down projection's row packing (models/linear.Linear.gated).
            return self.down_proj.gated(gate_up, self.act_name)
        gate, up = gate_up.chunk(2, dim=-1)
        act = self.invariant_act if self.deterministic else self.act
        return self.down_proj(act(gate) * up)


class Attention(nn.Module):
    """Packed q/k/v projection, optional per-head q/k RMSNorm, RoPE, then the paged attention op."""

    def __init__(self, arch: ModelArch, layer: int, qk_norm: bool, norm_offset: bool = False):
        super().__init__()
        h, d = arch.hidden_size, arch.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = arch.num_heads, arch.num_kv_heads, d
        bias = arch.attention_bias
        self.rotary_dim = arch.rotary_dim or d  # Phi's partial rotary: the rest of each head passes unrotated
        self.q_size, self.kv_size = self.num_heads * d, self.num_kv_heads * d
        # The last layer attends with only the rows the caller reads (CausalLM passes `rows`), so its
        # queries are projected for those rows alone: q apart from k|v. Everywhere else one q|k|v matmul.
        self.split_q = layer == arch.num_layers - 1
        if self.split_q:
            self.q_proj = Linear(h, self.q_size, bias=bias)
            self.kv_proj = PackedLinear(h, {"k_proj": self.kv_size, "v_proj": self.kv_size}, bias=bias)
        else:
            self.qkv_proj = PackedLinear(
                h, {"q_proj": self.q_size, "k_proj": self.kv_size, "v_proj": self.kv_size}, bias=bias
            )
        self.o_proj = Linear(self.num_heads * d, h, bias=arch.o_proj_bias)
        if qk_norm:
            self.q_norm = RMSNorm(d, arch.rms_norm_eps, offset=norm_offset)
            self.k_norm = RMSNorm(d, arch.rms_norm_eps, offset=norm_offset)
        else:
            self.q_norm = self.k_norm = None
        self.layer = layer
        self.scale = arch.attention_scale
        self.sliding_window = arch.window(layer)
        self.softcap = arch.attn_logit_softcapping

    def _qk_norm_weight(self) -> torch.Tensor:
        """[Hq + Hkv, D]: q_norm's weight for each q head, then k_norm's for each KV head."""
        return torch.cat(
            (self.q_norm.weight.expand(self.num_heads, -1), self.k_norm.weight.expand(self.num_kv_heads, -1))
        )

    def derive_weights(self) -> None:
        """The per-head q/k norm weight (and Gemma's 1 + it) built once the weights are final, not per
        forward: one or two ops less per layer."""
        if self.q_norm is not None:
            weight = self._qk_norm_weight()
            self.register_buffer("qk_norm_weight", weight, persistent=False)
            if self.q_norm.offset:
                self.register_buffer("qk_norm_scale", 1.0 + weight.float(), persistent=False)

    def _qk_norm_rope(
        self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: slice = slice(None)
    ) -> torch.Tensor:
        """Heads [T, H, D] of q and/or k (`heads`: which of the Hq + Hkv they are; q then k side by
        side by default): the optional per-head norm (each head scaled by its own projection's weight),
        then RoPE. Per (row, head), so q and k normed apart give the bits they give together."""
        if self.rotary_dim < self.head_dim:
            return self._partial_rope(qk, cos, sin, heads)
        fused = self.head_dim <= cpu_fused.MAX_HEAD_DIM and fused_cpu(qk)
        if self.q_norm is None:
            if fused:
                return cpu_fused.qk_norm_rope(qk, None, 0.0, cos, sin)
            return apply_rope(qk, cos, sin)
        weight = getattr(self, "qk_norm_weight", None)
        if weight is None:
            weight = self._qk_norm_weight()
        scale = getattr(self, "qk_norm_scale", None)
        weight = weight[heads]
        scale = None if scale is None else scale[heads]
        if fused:
            if self.q_norm.offset:
                weight = 1.0 + weight.float() if scale is None else scale
            return cpu_fused.qk_norm_rope(qk, weight, self.q_norm.eps, cos, sin)
        return apply_rope(self.q_norm.with_weight(qk, weight, scale), cos, sin)

    def _partial_rope(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: slice) -> torch.Tensor:
        """Partial rotary (torch ops, row-wise): RoPE on each head's first rotary_dim dims, as transformers'
        Phi3 applies it (cos/sin are rotary_dim wide), the rest passed through."""
        if self.q_norm is not None:
            qk = self.q_norm.with_weight(qk, self._qk_norm_weight()[heads])
        r = self.rotary_dim
        return torch.cat((apply_rope(qk[..., :r], cos, sin), qk[..., r:]), dim=-1)

    def _project(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], rows: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [R, Hq, D] of the rows that attend (`rows`, or every row when None), k and v [T, Hkv, D] of
        every row; q and k normed and rotated."""
        t, hq, hkv, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        if not self.split_q:
            qk, v = self.qkv_proj(x).split([self.q_size + self.kv_size, self.kv_size], dim=-1)
            q, k = self._qk_norm_rope(qk.view(t, hq + hkv, d), *rope).split([hq, hkv], dim=1)
            return (q if rows is None else q.index_select(0, rows)), k, v.view(t, hkv, d)
        # oneDNN reduces each output column the same way whatever columns sit beside it, so these are
        # bitwise the packed q|k|v's columns (tests/models/test_layers_split_q.py).
        k, v = self.kv_proj(x).split(self.kv_size, dim=-1)
        k = self._qk_norm_rope(k.view(t, hkv, d), *rope, heads=slice(hq, None))
        cos, sin = rope
        if rows is not None:
            x, cos, sin = x.index_select(0, rows), cos.index_select(0, rows), sin.index_select(0, rows)
        q = self._qk_norm_rope(self.q_proj(x).view(-1, hq, d), cos, sin, heads=slice(0, hq))
        return q, k, v.view(t, hkv, d)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_cache: torch.Tensor | None,
        meta: AttentionMetadata | None,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """meta=None (the compiled forward): attention through the `ladle::attention` custom op, which
        reads this layer's cache and the step's metadata from the forward context (models/attention_op.py).
        rows (the last layer; ladle.kernels.metadata.OutputRows): keys and values of every row go to the cache,
        but only `rows` attend, and only theirs are returned."""
        t = x.shape[0]
        q, k, v = self._project(x, rope, rows)
        k_all = v_all = None
        if rows is not None:
            k_all, v_all = k, v  # written to the cache for every row: later steps read them
            k, v = k.index_select(0, rows), v.index_select(0, rows)
            t = rows.shape[0]
        if meta is None:
            window, softcap = self.sliding_window or -1, self.softcap or 0.0
            out = attention_op(q, k, v, self.layer, self.scale, window, softcap, k_all, v_all)
        else:
            if rows is not None:
                write_kv_cache(k_all, v_all, kv_cache, meta.slot_mapping)
                meta = meta.outputs.meta
            out = attention(
                q,
                k,
                v,
                kv_cache,
                meta,
                scale=self.scale,
                sliding_window=self.sliding_window,
                softcap=self.softcap,
            )
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))
