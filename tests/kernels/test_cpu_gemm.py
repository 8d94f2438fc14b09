"""kernels/cpu_gemm: oneDNN's bits at every shape and row count, and models/linear.py's use of it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch
from torch import nn

from ladle.kernels import cpu_gemm
from ladle.models import linear as linear_mod
from ladle.models.linear import Linear

pytestmark = pytest.mark.skipif(not cpu_gemm.available(), reason="the CPU GEMM kernel needs AVX-512")


def onednn(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """oneDNN's packed inner product, two rows at least (its one-row kernel sums in another order)."""
    packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
    x2 = x if x.shape[0] >= 2 else x.expand(2, -1)
    return torch.ops.mkldnn._linear_pointwise(x2, packed, bias, "none", [], "")[: x.shape[0]]


# K on each side of oneDNN's block edges (512, 1024) and not a multiple of 16; N not a multiple of 32.
@pytest.mark.parametrize("n,k", [(64, 16), (33, 77), (100, 512), (96, 513), (1000, 1024), (48, 1025),
                                 (70, 3072), (31, 4100)])
def test_bitwise_onednn_at_every_row_count(threads, n, k):
    gen = torch.Generator().manual_seed(n * 7 + k)
    w = torch.randn(n, k, generator=gen)
    packed = cpu_gemm.pack(w)
    for m in (1, 2, 3, 11, 12, 13, 25, 64, 131):
        x = torch.randn(m, k, generator=gen) * 3
        out = cpu_gemm.gemm(x, packed)
        assert out.shape == (m, n)
        assert torch.equal(out, onednn(x, w)), (m, n, k)


def test_a_rows_bits_do_not_depend_on_the_others_or_the_threads():
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(200, 1100, generator=gen)
    packed = cpu_gemm.pack(w)
    row = torch.randn(1, 1100, generator=gen)
    alone = cpu_gemm.gemm(row, packed)[0]
    before = torch.get_num_threads()
    try:
        for threads, m, at in ((1, 40, 39), (2, 40, 0), (2, 7, 3), (1, 512, 300)):
            torch.set_num_threads(threads)
            x = torch.randn(m, 1100, generator=gen)
            x[at] = row[0]
            assert torch.equal(cpu_gemm.gemm(x, packed)[at], alone)
    finally:
        torch.set_num_threads(before)


def test_strided_rows_empty_input_and_bad_shapes():
    w = torch.randn(40, 96)
    packed = cpu_gemm.pack(w)
    big = torch.randn(5, 200)
    x = big[:, 10:106]  # rows 200 floats apart
    assert torch.equal(cpu_gemm.gemm(x, packed), cpu_gemm.gemm(x.contiguous(), packed))
    assert cpu_gemm.gemm(torch.empty(0, 96), packed).shape == (0, 40)
    with pytest.raises(ValueError, match="does not fit"):
        cpu_gemm.gemm(torch.randn(2, 95), packed)
    with pytest.raises(ValueError, match="float32"):
        cpu_gemm.pack(w.to(torch.bfloat16))


def test_out_buffer_is_rewritten_and_checked():
    """out= (benchmarks/experiments/gemm_ab.py's shared buffer): the same bits as a fresh output, every element rewritten,
    and a buffer of the wrong shape, dtype or strides refused before the kernel runs."""
    w, x = torch.randn(40, 96), torch.randn(7, 96)
    packed = cpu_gemm.pack(w)
    out = torch.full((7, 40), float("nan"))
    assert cpu_gemm.gemm(x, packed, out=out) is out
    assert torch.equal(out, cpu_gemm.gemm(x, packed))
    for bad in (torch.empty(7, 41), torch.empty(7, 40, dtype=torch.float64), torch.empty(40, 7).t()):
        with pytest.raises(ValueError, match="contiguous float32"):
            cpu_gemm.gemm(x, packed, out=bad)


def test_a_wrong_k_block_is_caught_by_the_check():
    """The check that guards models/linear.py can fail: a blocking that is not oneDNN's is refused."""
    assert cpu_gemm.matches_onednn(64, 2048)
    assert not cpu_gemm.matches_onednn(64, 2048, kb=512)
    assert not cpu_gemm.matches_onednn(33, 1024, kb=256)  # a partial column group too


def test_the_shape_check_does_not_rest_on_the_first_layers_weight(monkeypatch):
    """The check proves the kernel for a weight shape once per process. Proven on the weight the shape
    first came with, a degenerate one (zeros, before loading: every sum exact in any order) admitted a
    blocking that is not oneDNN's for every later layer of that shape."""
    monkeypatch.setattr(cpu_gemm, "k_block", lambda k: 256)  # a blocking that is not oneDNN's
    monkeypatch.setattr(linear_mod, "_gemm_matches", {})
    first, later = Linear(1024, 48), Linear(1024, 48)
    for layer in (first, later):
        layer.requires_grad_(False)
    first.weight.zero_()
    first.derive_weights()
    later.derive_weights()
    x = torch.randn(4, 1024)
    assert not isinstance(later._packed, cpu_gemm.PackedWeight)
    assert torch.equal(later(x), onednn(x, later.weight))


def test_linear_uses_the_kernel_without_bias_and_onednn_with_it():
    plain, biased = Linear(256, 80), Linear(256, 80, bias=True)
    for layer in (plain, biased):
        layer.requires_grad_(False)
        layer.derive_weights()
    assert isinstance(plain._packed, cpu_gemm.PackedWeight)
    assert not isinstance(biased._packed, cpu_gemm.PackedWeight) and biased._packed is not None
    x = torch.randn(3, 5, 256)
    assert torch.equal(plain(x), onednn(x.reshape(15, 256), plain.weight).view(3, 5, 80))
    assert plain.packed_bytes() == 3 * 256 * 32 * 4  # 80 columns padded to 3 groups of 32


def test_a_bias_given_after_packing_is_added():
    """The kernel has no bias term: a layer packed for it, then given a bias, must not drop the bias (it
    repacks for oneDNN, which takes one)."""
    layer = Linear(256, 80)
    layer.requires_grad_(False)
    layer.derive_weights()
    assert isinstance(layer._packed, cpu_gemm.PackedWeight)
    layer.bias = nn.Parameter(torch.randn(80), requires_grad=False)
    x = torch.randn(3, 256)
    with torch.no_grad():
        assert torch.equal(layer(x), onednn(x, layer.weight, layer.bias))
    with pytest.raises(ValueError, match="bias"):
        linear_mod.packed_linear(x, cpu_gemm.pack(layer.weight), layer.bias)


def test_linear_keeps_onednn_where_the_bits_would_differ(monkeypatch):
    """A shape where the kernel does not reproduce oneDNN (here: a forced wrong blocking) stays on
    oneDNN, so a layer's bits never depend on which path it took."""
    monkeypatch.setattr(cpu_gemm, "k_block", lambda k: 256)
    monkeypatch.setattr(linear_mod, "_gemm_matches", {})
    layer = Linear(1024, 48)
    layer.requires_grad_(False)
    layer.derive_weights()
    assert not isinstance(layer._packed, cpu_gemm.PackedWeight)
    x = torch.randn(4, 1024)
    assert torch.equal(layer(x), onednn(x, layer.weight))


def test_switched_off_layers_pack_for_onednn(monkeypatch):
    monkeypatch.setitem(cpu_gemm._state, "enabled", False)
    layer = Linear(64, 64)
    layer.requires_grad_(False)
    layer.derive_weights()
    assert layer._packed is not None and not isinstance(layer._packed, cpu_gemm.PackedWeight)


def test_switched_off_by_the_environment_it_is_not_even_built(monkeypatch):
    """LADLE_CPU_GEMM=0 is the way out where building or loading the kernel is the trouble."""
    monkeypatch.setenv("LADLE_CPU_GEMM", "0")
    monkeypatch.delitem(cpu_gemm._state, "enabled", raising=False)

    def build():
        raise AssertionError("built although switched off")

    monkeypatch.setattr(cpu_gemm, "load_library", build)
    assert not cpu_gemm.available()


@pytest.mark.parametrize("rows", [516, 517, 1003, 1549])
def test_many_rows_span_several_slabs(threads, rows):
    """Rows up to one packed slab (516) and beyond it, split into 2 or 4 equal slabs whose last row chunk
    is partial, at 1 and 2 threads: still oneDNN's bits."""
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(100, 1100, generator=gen)
    x = torch.randn(rows, 1100, generator=gen)
    assert torch.equal(cpu_gemm.gemm(x, cpu_gemm.pack(w)), onednn(x, w))


@pytest.mark.parametrize("team", [3, 4, 7])
def test_more_threads_than_cores_share_the_groups_out_exactly_once(team):
    """More threads than this machine's cores: they run unevenly, so the ones done first take groups from
    the others' shares (one group's columns, all its rows, by one thread). Every column still comes out
    once, with oneDNN's bits, over several slabs and a last group of 4 columns."""
    gen = torch.Generator().manual_seed(6)
    w = torch.randn(32 * 37 + 4, 600, generator=gen)
    x = torch.randn(1100, 600, generator=gen)
    packed = cpu_gemm.pack(w)
    ref = onednn(x, w)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(team)
        for _ in range(3):
            assert torch.equal(cpu_gemm.gemm(x, packed), ref)
    finally:
        torch.set_num_threads(before)


def test_callers_on_several_threads_at_once_each_get_their_bits():
    """ctypes lets go of the GIL, so Python threads may run GEMMs at the same moment: each caller's packed
    rows are its own (thread_local in the C++), and each call's column-group shares are its own."""
    gen = torch.Generator().manual_seed(7)
    cases = []
    for n, k, m in ((300, 200, 1100), (70, 1100, 530), (40, 96, 29)):
        w, x = torch.randn(n, k, generator=gen), torch.randn(m, k, generator=gen)
        cases.append((cpu_gemm.pack(w), x, onednn(x, w)))
    wrong: list[int] = []

    def call(i: int) -> None:
        packed, x, ref = cases[i % len(cases)]
        for _ in range(3):
            if not torch.equal(cpu_gemm.gemm(x, packed), ref):
                wrong.append(i)

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        callers = [threading.Thread(target=call, args=(i,)) for i in range(6)]
        for caller in callers:
            caller.start()
        for caller in callers:
            caller.join()
    finally:
        torch.set_num_threads(before)
    assert not wrong


def test_a_team_smaller_than_asked_still_computes_every_group():
    """OpenMP may start fewer threads than asked for (OMP_THREAD_LIMIT here; OMP_DYNAMIC, a nested call):
    the column groups are shared among the threads that run, none left to a thread that never started.
    A fresh x per call: a group left out would keep a stale or uninitialised output."""
    code = textwrap.dedent("""
        import torch
        from ladle.kernels import cpu_gemm
        gen = torch.Generator().manual_seed(8)
        w = torch.randn(32 * 11 + 5, 200, generator=gen)
        packed, onednn = cpu_gemm.pack(w), torch.ops.mkldnn._reorder_linear_weight(w, None)
        for m in (3, 530, 1100):
            for _ in range(2):
                x = torch.randn(m, 200, generator=gen)
                torch.set_num_threads(1)  # oneDNN's own sums change when it gets fewer threads than it asked for
                ref = torch.ops.mkldnn._linear_pointwise(x, onednn, None, "none", [], "")
                torch.set_num_threads(6)
                assert torch.equal(cpu_gemm.gemm(x, packed), ref), m
        print("ok")
    """)
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=str(root), OMP_THREAD_LIMIT="2")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120,
                         check=False)
    assert run.returncode == 0 and run.stdout.split() == ["ok"], run.stderr[-2000:]


def test_row_counts_past_the_kernels_int_are_refused_before_allocating():
    """2**31 rows would wrap to a negative or small int in the C call; the row tensor here is one row
    expanded (no memory), so the refusal must come before the [M, N] output is allocated."""
    packed = cpu_gemm.pack(torch.randn(8, 16))
    x = torch.randn(1, 16).expand(2**31, 16)
    with pytest.raises(ValueError, match="2147483648 rows"):
        cpu_gemm.gemm(x, packed)
    with pytest.raises(ValueError, match="2147483648 x 1 is past"):
        cpu_gemm.pack(torch.randn(1, 1).expand(2**31, 1))


# -- the gated form: act(gate) * up packed as the GEMM's rows --------------------------------------------
gated = pytest.mark.skipif(not cpu_gemm.gated_available(), reason="needs torch's 16-lane SLEEF exp / tanh")


@gated
@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
@pytest.mark.parametrize("n,k", [(64, 16), (33, 77), (96, 513), (70, 3072), (31, 1100)])
def test_gated_form_is_the_activation_kernel_then_the_gemm_bit_for_bit(threads, act, n, k):
    """K not a multiple of the 256-column pieces nor of 16 (a masked tail), rows 1 to past a 12-row chunk."""
    from ladle.kernels import cpu_fused

    gen = torch.Generator().manual_seed(n + k)
    packed = cpu_gemm.pack(torch.randn(n, k, generator=gen) * 0.1)
    for m in (1, 2, 5, 12, 13, 40, 131):
        gate_up = torch.randn(m, 2 * k, generator=gen) * 4
        want = cpu_gemm.gemm(cpu_fused.gated_activation(gate_up, act), packed)
        assert torch.equal(cpu_gemm.gemm(gate_up, packed, act=act), want), (m, n, k, act)


@gated
def test_gated_form_takes_strided_rows_and_refuses_a_wrong_width():
    from ladle.kernels import cpu_fused

    gen = torch.Generator().manual_seed(3)
    packed = cpu_gemm.pack(torch.randn(40, 96, generator=gen))
    wide = torch.randn(9, 250, generator=gen)
    gate_up = wide[:, 10:202]  # rows 250 apart
    want = cpu_gemm.gemm(cpu_fused.gated_activation(gate_up.contiguous(), "silu"), packed)
    assert torch.equal(cpu_gemm.gemm(gate_up, packed, act="silu"), want)
    with pytest.raises(ValueError):
        cpu_gemm.gemm(torch.randn(3, 96), packed, act="silu")  # K wide, not 2K


@gated
def test_mlp_down_projection_runs_the_gated_form_with_the_two_pass_bits(monkeypatch):
    """models/layers.MLP on the packed path calls the gated form once (no separate activation), eager and
    compiled, with the bits of the activation kernel followed by the down projection."""
    from ladle.kernels import cpu_fused
    from ladle.models.layers import MLP

    torch.manual_seed(0)
    mlp = MLP(64, 160, "silu").requires_grad_(False)  # inference weights: the packed path
    for p in mlp.parameters():
        nn.init.normal_(p, std=0.2)
    mlp.gate_up_proj.derive_weights()  # packed (and the shapes proven) before the calls are counted
    mlp.down_proj.derive_weights()
    calls = []
    real = cpu_gemm.gemm
    monkeypatch.setattr(cpu_gemm, "gemm", lambda *a, **kw: calls.append(kw.get("act")) or real(*a, **kw))
    with torch.inference_mode():
        x = torch.randn(7, 64)
        out = mlp(x)
        assert calls == [None, "silu"]
        want = mlp.down_proj(cpu_fused.gated_activation(mlp.gate_up_proj(x), "silu"))
        assert torch.equal(out, want)
        compiled = torch.compile(mlp, fullgraph=True)
        assert torch.equal(compiled(x), want)
    cpu_gemm.set_gated_enabled(False)
    try:
        calls.clear()
        with torch.inference_mode():
            assert torch.equal(mlp(x), want) and calls == [None, None]
    finally:
        cpu_gemm.set_gated_enabled(True)
