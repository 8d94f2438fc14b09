"""models/linear.py: the packed oneDNN linear layer of CPU fp32 inference.

A row's output is bitwise independent of the batch (row count, position, other rows) at 1 and 2 threads
and the same at both; the packed path equals F.linear within fp32 rounding; the packed copy follows the
Parameter (in-place changes, reassignment, .to(), deepcopy); torch.compile runs it as one custom op with
eager's bits; every other dtype and device is F.linear unchanged.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ladle.models.linear import (
    Linear,
    check_batch_invariance,
    onednn_available,
    packed_bytes_estimate,
    verify_batch_invariance,
)

pytestmark = pytest.mark.skipif(not onednn_available(), reason="needs torch built with oneDNN")

# (out, in): the tiny test models' qkv, down and LM head; a 166M Qwen3's qkv and down (K >= 2048 is
# where oneDNN's one-row kernel reduces in another order).
SHAPES = [(128, 64), (64, 128), (384, 64), (2048, 1024), (1024, 3072)]
ROWS = [*range(1, 70), 127, 128, 129, 255, 256, 257, 511, 513, 1100]


def make_linear(n: int, k: int, bias: bool = False, seed: int = 0) -> Linear:
    gen = torch.Generator().manual_seed(seed)
    layer = Linear(k, n, bias=bias).requires_grad_(False)
    layer.weight.copy_(torch.randn(n, k, generator=gen) * 0.05)
    if bias:
        layer.bias.copy_(torch.randn(n, generator=gen))
    layer.derive_weights()
    return layer


def row_outputs(layer: Linear, row: torch.Tensor, rows: list[int], seed: int = 1) -> dict[int, torch.Tensor]:
    """{M: the row's output when it sits at a random position among M - 1 random rows}."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for m in rows:
        x = torch.randn(m, row.shape[-1], generator=gen)
        pos = int(torch.randint(m, (), generator=gen))
        x[pos] = row
        out[m] = layer(x)[pos]
    return out


@pytest.mark.parametrize("n,k", SHAPES, ids=[f"{n}x{k}" for n, k in SHAPES])
@torch.inference_mode()
def test_a_rows_output_is_bitwise_independent_of_the_batch(threads, n, k):
    layer = make_linear(n, k)
    row = torch.randn(k, generator=torch.Generator().manual_seed(7))
    alone = layer(row[None])[0]
    differ = [m for m, y in row_outputs(layer, row, ROWS).items() if not torch.equal(y, alone)]
    assert differ == [], f"row counts whose output differs from the row alone: {differ}"


@torch.inference_mode()
def test_with_bias_too(threads):
    layer = make_linear(192, 64, bias=True)
    row = torch.randn(64)
    alone = layer(row[None])[0]
    assert all(torch.equal(y, alone) for y in row_outputs(layer, row, ROWS[:80]).values())


@pytest.mark.parametrize("n,k", SHAPES[-2:], ids=["2048x1024", "1024x3072"])
@torch.inference_mode()
def test_the_same_bits_at_one_and_two_threads(n, k):
    """Measured, not promised by oneDNN: it splits rows and columns among threads, never the K sum."""
    layer = make_linear(n, k)
    row = torch.randn(k)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = row_outputs(layer, row, [1, 2, 7, 64, 300])
        torch.set_num_threads(2)
        two = row_outputs(layer, row, [1, 2, 7, 64, 300])
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(one[m], two[m]) for m in one)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("m", [1, 3, 64, 300])
@torch.inference_mode()
def test_packed_path_equals_f_linear_within_fp32_rounding(m, bias):
    layer = make_linear(1024, 3072, bias=bias)
    x = torch.randn(m, 3072)
    got = layer(x)
    assert layer._packed is not None  # the packed path ran
    torch.testing.assert_close(got, F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=2e-5)


@torch.inference_mode()
def test_three_dimensional_and_empty_inputs():
    layer = make_linear(96, 64)
    x = torch.randn(2, 5, 64)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight), rtol=1e-5, atol=1e-5)
    assert layer(torch.randn(0, 64)).shape == (0, 96)


def test_packed_copy_follows_the_parameter():
    layer = make_linear(96, 64)
    x = torch.randn(4, 64)
    with torch.no_grad():
        before = layer(x)
        layer.weight.mul_(2)  # in place: the version counter moves, the layer repacks
        torch.testing.assert_close(layer(x), 2 * before, rtol=1e-6, atol=1e-6)
        layer.weight = nn.Parameter(torch.zeros(96, 64), requires_grad=False)  # a new tensor
        assert torch.equal(layer(x), torch.zeros(4, 96))


@torch.inference_mode()
def test_other_dtypes_and_autograd_are_f_linear_unchanged():
    layer = make_linear(96, 64).to(torch.bfloat16)
    assert layer._packed is None  # .to() dropped the fp32 copy
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    assert torch.equal(layer(x), F.linear(x, layer.weight))
    assert layer._packed is None


def test_autograd_falls_back_to_f_linear():
    layer = Linear(64, 32)  # requires grad: training, not inference
    x = torch.randn(3, 64, requires_grad=True)
    layer(x).sum().backward()
    assert x.grad is not None and layer.weight.grad is not None and layer._packed is None


@torch.inference_mode()
def test_deepcopy_gets_its_own_key_and_weights():
    layer = make_linear(96, 64)
    x = torch.randn(3, 64)
    twin = copy.deepcopy(layer)
    assert twin._key != layer._key
    with torch.no_grad():
        twin.weight.zero_()
    assert torch.equal(twin(x), torch.zeros(3, 96)) and not torch.equal(layer(x), torch.zeros(3, 96))


def test_compiled_forward_runs_the_custom_op_with_eagers_bits():
    """inductor cannot take a packed mkldnn tensor as a graph input: the compiled graph calls
    `ladle::cpu_linear`, which runs the same packed path, so compiled and eager agree bitwise."""
    from torch._inductor.utils import run_and_get_code

    net = nn.Sequential(make_linear(96, 64), nn.ReLU(), make_linear(64, 96, bias=True))
    compiled = torch.compile(net, fullgraph=True)
    with torch.inference_mode():
        for m in (1, 5, 33):
            x = torch.randn(m, 64)
            torch._dynamo.decorators.mark_unbacked(x, 0)
            out, codes = run_and_get_code(compiled, x)
            assert torch.equal(out, net(x)), m
    assert any("torch.ops.ladle.cpu_linear" in code for code in codes)


class _RowCountDependent(Linear):
    """A deliberately batch-dependent layer: the checker must catch it."""

    def forward(self, x):
        return super().forward(x) + 1e-3 * (x.shape[0] > 4)


@torch.inference_mode()
def test_the_invariance_check_catches_a_batch_dependent_layer():
    bad = _RowCountDependent(64, 32).requires_grad_(False)
    assert check_batch_invariance(bad) == [5, 17, 64, 129]
    with pytest.raises(RuntimeError, match="not batch-invariant"):
        verify_batch_invariance([bad])
    assert check_batch_invariance(make_linear(32, 64)) == []


def test_deterministic_refuses_what_cannot_hold_it():
    layer = make_linear(32, 64).to(torch.bfloat16)
    with pytest.raises(ValueError, match="packed oneDNN path"):
        verify_batch_invariance([layer])
    layer.deterministic = True
    with pytest.raises(RuntimeError, match="cannot run batch-invariant"), torch.inference_mode():
        layer(torch.randn(2, 64, dtype=torch.bfloat16))


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("family,cls", [("llama", "LlamaForCausalLM"), ("qwen3", "Qwen3ForCausalLM")])
def test_the_loader_packs_every_projection_and_the_lm_head(family, cls):
    """llama's LM head is its own weight; qwen3's is tied to the embedding (which keeps its dense copy)."""
    from ladle.models import load_model
    from tests.conftest import TINY_HF_MODELS

    arch = {"architectures": [cls], **TINY_HF_MODELS[family][1]}
    model = load_model(None, arch, torch.float32, "cpu")
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    # 4 a layer (the last: q and k|v apart, so 5) and the LM head
    assert len(linears) == 4 * model.arch.num_layers + 2 and all(m._packed is not None for m in linears)
    assert model.packed_weight_bytes() == sum(m.weight.numel() * 4 for m in linears)
    assert model.packed_weight_bytes() == packed_bytes_estimate(model.arch, torch.float32, "cpu")
    assert packed_bytes_estimate(model.arch, torch.bfloat16, "cpu") == 0
    assert load_model(None, arch, torch.bfloat16, "cpu").packed_weight_bytes() == 0


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_the_estimate_covers_padded_packed_copies():
    """kernels/cpu_gemm pads a weight's outputs to groups of 32 columns: with dimensions that are not
    multiples of 32 the memory plan's estimate must still cover what the packed copies hold."""
    from ladle.models import load_model
    from tests.conftest import TINY_HF_MODELS

    arch = {"architectures": ["Qwen3ForCausalLM"], **TINY_HF_MODELS["qwen3"][1], "vocab_size": 390,
            "intermediate_size": 120}
    model = load_model(None, arch, torch.float32, "cpu")
    assert model.packed_weight_bytes() <= packed_bytes_estimate(model.arch, torch.float32, "cpu")


def test_row_counts_are_bucketed_so_onednn_primitives_stay_bounded():
    """oneDNN caches a primitive (with its scratch memory) per (shape, row count): unbucketed, 512
    distinct widths of 4 small shapes grew host memory by 1.8 GB. A call runs at a bucketed width:
    exact up to 32 rows (decode steps' time grows with their rows), then padded by at most 7 / 15 / 127."""
    from ladle.models.linear import row_bucket

    buckets = {row_bucket(m) for m in range(1, 4097)}
    assert len(buckets) <= 125
    assert len({b for b in buckets if b > 32}) <= 95
    for m in range(1, 4097):
        b = row_bucket(m)
        assert b >= max(m, 2) and b - m <= (0 if 2 <= m <= 32 else 7 if m <= 128 else 15 if m <= 1024 else 127)
    assert row_bucket(1) == 2 and row_bucket(17) == 17 and row_bucket(33) == 40 and row_bucket(129) == 144
