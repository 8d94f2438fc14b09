"""The fused CPU kernels (kernels/cpu_fused.py) against the torch ops of models/layers.py they replace.

Norms and RoPE must be bitwise torch's (same operations, torch's row-sum order); the activations
bitwise F.silu's / F.gelu's vector loops when torch's SLEEF functions were found (tight tolerance
otherwise, and always for the elements F.silu runs through its scalar remainder loop). Every output
row must not depend on the other rows or the thread count. Other builds (AVX2, generic) are checked too.
"""

from __future__ import annotations

import platform

import pytest
import torch
import torch.nn.functional as F

from ladle.kernels import cpu_build, cpu_fused
from ladle.models.layers import RMSNorm, RotaryEmbedding, apply_rope

if cpu_build._compiler() is None:
    pytest.skip("no C++ compiler", allow_module_level=True)
assert cpu_fused.load_library() is not None, cpu_fused._state.get("error")

SLEEF = cpu_fused.build_info()["math"] == "sleef x16" and torch.backends.cpu.get_cpu_capability() == "AVX512"
WIDTHS = [1, 3, 7, 8, 15, 17, 64, 72, 100, 1000, 1023, 1024, 2730, 4099]
ROWS = [1, 2, 37, 300]


@pytest.fixture(params=[1, 2, 3], ids=lambda n: f"{n}threads")
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def torch_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool) -> torch.Tensor:
    """ladle.models.layers.RMSNorm's torch path."""
    norm = RMSNorm(x.shape[-1], eps, offset=offset)
    return norm.with_weight(x, weight, 1.0 + weight if offset else None)


def test_torch_sum_order_is_reproduced():
    assert cpu_fused.build_info()["sum_order"] == "torch"


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("offset", [False, True], ids=["plain", "gemma_offset"])
@pytest.mark.parametrize("with_residual", [True, False])
def test_add_rms_norm_is_bitwise_torch(width, offset, with_residual, threads):
    gen = torch.Generator().manual_seed(width)
    weight = torch.randn(width, generator=gen)
    for rows in ROWS:
        # x a strided view (a row stride beyond the width), as a sliced matmul output would be.
        x = (torch.randn(rows, width + 5, generator=gen) * 3)[:, :width]
        residual = torch.randn(rows, width, generator=gen) if with_residual else None
        total = x + residual if with_residual else x
        out, got_total = cpu_fused.add_rms_norm(x, residual, 1.0 + weight if offset else weight, 1e-6)
        assert torch.equal(got_total, total), (rows, width)
        assert torch.equal(out, torch_norm(total, weight, 1e-6, offset)), (rows, width)


def test_add_rms_norm_three_dims_and_large_values():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 5, 96, generator=gen) * 1e18  # squares near float32's top: same overflow as torch
    weight = torch.randn(96, generator=gen)
    out, _ = cpu_fused.add_rms_norm(x, None, weight, 1e-5)
    assert out.shape == x.shape
    torch.testing.assert_close(out, torch_norm(x, weight, 1e-5, False), rtol=0, atol=0, equal_nan=True)


def gated_inputs(rows: int, width: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gate_up = torch.randn(rows, 2 * width, generator=torch.Generator().manual_seed(seed)) * 4
    gate, up = gate_up.chunk(2, dim=-1)
    return gate_up, gate.contiguous(), up


@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
@pytest.mark.parametrize("width", [1, 5, 16, 37, 128, 1000, 2730, 3072])
def test_gated_activation_matches_torch(act, width, threads):
    torch_act = F.silu if act == "silu" else lambda g: F.gelu(g, approximate="tanh")
    for rows in (1, 3, 64):
        gate_up, gate, up = gated_inputs(rows, width, width + rows)
        got = cpu_fused.gated_activation(gate_up, act)
        want = torch_act(gate) * up
        # One rounding apart at most anywhere (F.* run a remainder through libm)...
        torch.testing.assert_close(got, want, rtol=4e-7, atol=1e-37)
        if SLEEF and threads == 1:
            # ...and bitwise in F.*'s vector loop: every full 32 elements (two vectors) of the flattened
            # gate (at one thread: more cut the tensor where they like, each piece with a remainder).
            full = (rows * width) // 32 * 32
            assert torch.equal(got.flatten()[:full], want.flatten()[:full]), (rows, width)


def test_gated_activation_extremes():
    g = torch.tensor([[-200.0, -88.0, -20.0, -1e-30, 0.0, 1e-30, 20.0, 88.0, 200.0, float("inf"), -float("inf")]])
    up = torch.ones_like(g)
    gate_up = torch.cat((g, up), dim=-1)
    torch.testing.assert_close(cpu_fused.gated_activation(gate_up, "silu"), F.silu(g), rtol=4e-7, atol=0,
                               equal_nan=True)
    gelu = cpu_fused.gated_activation(gate_up, "gelu_pytorch_tanh")
    torch.testing.assert_close(gelu, F.gelu(g, approximate="tanh"), rtol=4e-7, atol=0, equal_nan=True)


def torch_qk(qk, weight, eps, offset, cos, sin):
    """Attention._qk_norm_rope's torch path."""
    if weight is None:
        return apply_rope(qk, cos, sin)
    norm = RMSNorm(qk.shape[-1], eps, offset=offset)
    return apply_rope(norm.with_weight(qk, weight, 1.0 + weight if offset else None), cos, sin)


@pytest.mark.parametrize(
    "heads,kv_heads,dim", [(16, 8, 64), (4, 2, 16), (2, 1, 128), (3, 1, 10), (2, 2, 6), (1, 1, 256)]
)
@pytest.mark.parametrize("norm", ["qwen3", "gemma_offset", "llama_none"])
def test_qk_norm_rope_is_bitwise_torch(heads, kv_heads, dim, norm, threads):
    gen = torch.Generator().manual_seed(dim)
    rope = RotaryEmbedding({"rope_theta": 10000.0, "rope_type": "default"}, dim, 512)
    h = heads + kv_heads
    weight = None if norm == "llama_none" else torch.randn(h, dim, generator=gen)
    offset = norm == "gemma_offset"
    for rows in (1, 7, 130):
        qkv = torch.randn(rows, (h + kv_heads) * dim, generator=gen) * 2
        qk = qkv[:, : h * dim].view(rows, h, dim)  # a view of the qkv matmul output, as in Attention
        cos, sin = rope(torch.randint(0, 512, (rows,), generator=gen), 512, torch.float32)
        got = cpu_fused.qk_norm_rope(qk, None if weight is None else (1.0 + weight if offset else weight),
                                     1e-6, cos, sin)
        assert torch.equal(got, torch_qk(qk, weight, 1e-6, offset, cos, sin)), rows


def test_qk_norm_weight_broadcast_from_one_head():
    gen = torch.Generator().manual_seed(1)
    rope = RotaryEmbedding({"rope_theta": 1e6, "rope_type": "default"}, 32, 64)
    qk = torch.randn(5, 3, 32, generator=gen)
    cos, sin = rope(torch.arange(5), 64, torch.float32)
    weight = torch.randn(32, generator=gen)
    want = torch_qk(qk, weight.expand(3, 32), 1e-6, False, cos, sin)
    assert torch.equal(cpu_fused.qk_norm_rope(qk, weight, 1e-6, cos, sin), want)


def rows_alone_vs_batched(fn, width: int) -> list[int]:
    """Row counts at which fn's output row for a fixed input row differs from its output alone."""
    gen = torch.Generator().manual_seed(width)
    row = torch.randn(width, generator=gen) * 3
    alone = fn(row[None])[0]
    bad = []
    for m in [2, 3, 15, 16, 17, 33, 64, 129, 257, 333]:
        x = torch.randn(m, width, generator=gen) * 3
        pos = int(torch.randint(m, (), generator=gen))
        x[pos] = row
        if not torch.equal(fn(x)[pos], alone):
            bad.append(m)
    return bad


@pytest.mark.parametrize("width", [72, 1000, 3072])
def test_rows_do_not_depend_on_the_batch(width, threads):
    weight = torch.randn(width)
    rope = RotaryEmbedding({"rope_theta": 10000.0, "rope_type": "default"}, 8, 4096)

    def norm(x):
        return cpu_fused.add_rms_norm(x, x * 0.5, weight, 1e-6)[0]

    def act(x):
        return cpu_fused.gated_activation(torch.cat((x, x.flip(-1)), dim=-1), "silu")

    def qk(x):  # heads of 8 at a position taken from the row's own content
        cos, sin = rope((x[:, 0].abs() * 100).long() % 4096, 4096, x.dtype)
        return cpu_fused.qk_norm_rope(x.view(x.shape[0], -1, 8), weight.view(-1, 8), 1e-6, cos, sin).flatten(1)

    for fn in (norm, act, qk):
        assert rows_alone_vs_batched(fn, width) == [], fn.__name__


@pytest.mark.parametrize(
    "flags",
    [pytest.param(("-march=native", "-mno-avx512f"), id="avx2"), pytest.param((), id="generic")],
)
def test_other_builds(flags, tmp_path, monkeypatch):
    """An AVX2 build (torch's 8-lane SLEEF or libm) and the generic one (libm): norms and RoPE stay
    bitwise torch's (the same scalar order), activations within an ulp or two (GELU's 1 + tanh near
    tanh = -1 turns a tanh ulp into an absolute error of up to |x| * 2^-24 * |up|)."""
    if flags and (platform.machine() not in ("x86_64", "AMD64") or "avx2" not in cpu_build._cpu_flags()):
        pytest.skip("needs an x86 CPU with AVX2")
    lib = cpu_fused.build_library(flags, tmp_path)
    assert lib.ladle_fused_isa().decode() == ("avx2" if flags else "generic")
    monkeypatch.setitem(cpu_fused._state, "lib", lib)
    gen = torch.Generator().manual_seed(3)
    for use_sleef in (True, False):
        cpu_fused.install_math(lib, use_sleef)
        x, weight = torch.randn(9, 1000, generator=gen), torch.randn(1000, generator=gen)
        assert torch.equal(cpu_fused.add_rms_norm(x, None, weight, 1e-6)[0], torch_norm(x, weight, 1e-6, False))
        rope = RotaryEmbedding({"rope_theta": 10000.0, "rope_type": "default"}, 64, 128)
        qk = torch.randn(9, 6, 64, generator=gen)
        cos, sin = rope(torch.arange(9), 128, torch.float32)
        w = torch.randn(6, 64, generator=gen)
        assert torch.equal(cpu_fused.qk_norm_rope(qk, w, 1e-6, cos, sin), torch_qk(qk, w, 1e-6, False, cos, sin))
        gate_up, gate, up = gated_inputs(9, 1000, 5)
        torch.testing.assert_close(cpu_fused.gated_activation(gate_up, "silu"), F.silu(gate) * up,
                                   rtol=5e-7, atol=1e-37)
        torch.testing.assert_close(cpu_fused.gated_activation(gate_up, "gelu_pytorch_tanh"),
                                   F.gelu(gate, approximate="tanh") * up, rtol=1e-6, atol=2e-5)


D = 64
_BAD_CALLS = {  # what the kernels would read as float32 [rows, D] (or past its end): rejected instead
    "bf16 x": ("fused_rms_norm", lambda: (torch.randn(3, D, dtype=torch.bfloat16), torch.ones(D), 1e-6)),
    "short weight": ("fused_rms_norm", lambda: (torch.randn(3, D), torch.ones(D // 2), 1e-6)),
    "residual shape": ("fused_add_rms_norm", lambda: (torch.randn(3, D), torch.randn(3, D // 2), torch.ones(D), 1e-6)),
    "f16 residual": ("fused_add_rms_norm", lambda: (torch.randn(3, D), torch.randn(3, D).half(), torch.ones(D), 1e-6)),
    "f64 gate_up": ("fused_gated_activation", lambda: (torch.randn(3, 2 * D, dtype=torch.float64), "silu")),
    "f64 qk": ("fused_qk_norm_rope", lambda: (torch.randn(2, 3, 16).double(), None, 0.0, torch.ones(2, 1, 16),
                                             torch.zeros(2, 1, 16))),
    "f16 cos": ("fused_qk_norm_rope", lambda: (torch.randn(2, 3, 16), None, 0.0, torch.ones(2, 1, 16).half(),
                                              torch.zeros(2, 1, 16))),
}


@pytest.mark.parametrize("case", list(_BAD_CALLS))
def test_ops_reject_what_the_kernels_would_misread(case):
    """The ops take raw float32 CPU pointers: another dtype or a mismatched shape is an error, never a
    reinterpretation of its bytes or a read past its end (they are public as torch.ops.ladle.*)."""
    name, args = _BAD_CALLS[case]
    with pytest.raises(ValueError):
        getattr(torch.ops.ladle, name)(*args())
