"""The CPU decoder-layer stack (models/cpu_stack.py, kernels/cpu_layers.py): the layers before the last as
one native call give bitwise what the op-by-op layers give, hidden states and KV caches alike, eager and
compiled; layers it cannot run exactly (Gemma, a linear off the packed GEMM) run op by op, and a kernel's
refusal names the layer and the step."""

from __future__ import annotations

import math

import pytest
import torch

from ladle.kernels import AttentionMetadata, cpu_layers
from ladle.models import load_model
from ladle.models.cpu_stack import _stack_ops
from tests.conftest import TINY_HF_MODELS
from tests.models.ladle_driver import make_kv_caches

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
BLOCK = 16
FAMILIES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "gemma3": "Gemma3ForCausalLM"}
# (query length, context length) per sequence: a fresh prefill chunk, a chunk after context, decodes,
# a chunk starting mid-block, one-token sequences.
SEQS = [(37, 0), (20, 45), (1, 70), (24, 5), (1, 1), (1, 15)]


@pytest.fixture(autouse=True)
def stack_switch_restored():
    was = cpu_layers.enabled()
    yield
    cpu_layers.set_enabled(was)


@pytest.fixture
def stack_calls(monkeypatch) -> list[int]:
    """The number of layers each native stack call ran (a positive control: equal outputs would also
    come from a stack that never ran)."""
    calls: list[int] = []
    run = cpu_layers.run

    def counted(ops, step, layers):
        calls.append(len(layers))
        return run(ops, step, layers)

    monkeypatch.setattr(cpu_layers, "run", counted)
    return calls


def tiny(family: str, seed: int = 3):
    arch = {"architectures": [FAMILIES[family]], **TINY_HF_MODELS[family][1], "initializer_range": 0.08}
    return load_model(None, arch, torch.float32, "cpu", seed=seed)


def forward(model, stack: bool, keep_from: list[int] | None = None):
    """One mixed forward (prefill chunks and decodes) on caches holding random context."""
    cpu_layers.set_enabled(stack)
    per_seq = max(math.ceil((q + c) / BLOCK) for q, c in SEQS)
    caches = make_kv_caches(model, per_seq * len(SEQS) + 1, BLOCK)
    gen = torch.Generator().manual_seed(0)
    for cache in caches:
        cache.copy_(torch.randn(cache.shape, generator=gen))
    tables = [list(range(1 + i * per_seq, 1 + (i + 1) * per_seq)) for i in range(len(SEQS))]
    ids = torch.randint(3, model.arch.vocab_size, (sum(q for q, _ in SEQS),), generator=gen)
    with torch.inference_mode():
        meta = AttentionMetadata.build([q for q, _ in SEQS], [q + c for q, c in SEQS], tables, BLOCK,
                                       backend="cpu_paged")
        if keep_from is not None:
            meta.restrict_outputs(keep_from)
        hidden = model(ids, meta.positions, caches, meta)
    return hidden, caches


def assert_same(a, b) -> None:
    assert torch.equal(a[0], b[0]), (a[0] - b[0]).abs().max()
    for i, (x, y) in enumerate(zip(a[1], b[1], strict=True)):
        assert torch.equal(x, y), f"layer {i}'s KV cache differs"


@pytest.mark.parametrize("keep_from", [None, [36, 19, 0, 23, 0, 0]], ids=["every_row", "last_rows"])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_stack_is_op_by_op_bitwise(family, keep_from, threads, stack_calls):
    if not cpu_layers.enabled():
        pytest.skip("the CPU layer stack cannot be built here")
    model = tiny(family)
    want = forward(model, stack=False, keep_from=keep_from)
    assert stack_calls == []
    got = forward(model, stack=True, keep_from=keep_from)
    assert stack_calls == [model.arch.num_layers - 1]  # every layer but the last, in one call
    assert_same(got, want)


def test_layers_the_stack_cannot_run_go_op_by_op(stack_calls):
    """Gemma's layers (offset norms, sandwich norms), and a Llama whose middle layer's o_proj is kept off the
    packed path: no stack call, the op-by-op bits."""
    if not cpu_layers.enabled():
        pytest.skip("the CPU layer stack cannot be built here")
    gemma = tiny("gemma3")
    assert_same(forward(gemma, stack=True), forward(gemma, stack=False))
    llama = tiny("llama")
    llama.model.layers[1].self_attn.o_proj.use_packed = False  # F.linear: not a kernel the stack calls
    assert_same(forward(llama, stack=True), forward(llama, stack=False))
    assert stack_calls == []


def test_hooks_and_strided_weights_keep_the_layers_op_by_op(stack_calls):
    """A forward hook inside a layer must run (the stack calls no module), and a norm weight that is a strided
    view must be read as the op-by-op path reads it (a copy): both keep every layer op by op."""
    if not cpu_layers.enabled():
        pytest.skip("the CPU layer stack cannot be built here")
    model, reference = tiny("llama"), tiny("llama")
    seen = []
    for m in (model, reference):
        m.model.layers[0].mlp.register_forward_hook(lambda mod, args, out: seen.append(1) or out * 0.5)
    assert_same(forward(model, stack=True), forward(reference, stack=False))
    assert len(seen) == 2 and stack_calls == []
    model, reference = tiny("qwen3"), tiny("qwen3")
    norm = model.model.layers[1].post_attention_layernorm
    wide = torch.zeros(2 * norm.weight.numel())
    wide[::2] = norm.weight.detach()
    norm.weight = torch.nn.Parameter(wide[::2], requires_grad=False)  # the same values, every other float
    assert not norm.weight.is_contiguous()
    assert_same(forward(model, stack=True), forward(reference, stack=False))
    assert stack_calls == []


def test_weights_changed_in_place_reach_the_stack(stack_calls):
    """The stack reads each linear's current packed copy (repacked after an in-place change) and the
    norms' weights themselves: scaled weights give the op-by-op path's new bits, not the old ones."""
    if not cpu_layers.enabled():
        pytest.skip("the CPU layer stack cannot be built here")
    model = tiny("qwen3")
    before = forward(model, stack=True)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.75)
    model.derive_weights()  # the per-head q/k norm weight is derived (models/layers.Attention)
    after = forward(model, stack=True)
    assert not torch.equal(before[0], after[0])
    assert_same(after, forward(model, stack=False))
    assert stack_calls == [2, 2]


def test_a_refused_argument_names_the_layer_and_the_step():
    if not cpu_layers.enabled():
        pytest.skip("the CPU layer stack cannot be built here")
    step = cpu_layers.StackStep(rows=4, hidden=8, q_heads=1, kv_heads=1, head_dim=8, lanes=3, threads=1)
    x = torch.zeros(4, 8)
    step.input = step.x = step.residual = step.h = x.data_ptr()
    layers = (cpu_layers.StackLayer * 2)()
    with pytest.raises(RuntimeError, match="layer 0's input norm kernel rejected its arguments"):
        cpu_layers.run(_stack_ops(), step, layers)


def test_layers_that_never_qualify_compile_to_their_own_ops(stack_calls):
    """An activation the gated GEMM does not run (erf GELU): the compiled graph keeps the layers' ops (no
    ladle::decoder_stack op that would run them eagerly, with other bits than inductor's)."""
    if not cpu_layers.enabled():
        pytest.skip("the CPU layer stack cannot be built here")
    arch = {"architectures": [FAMILIES["llama"]], **TINY_HF_MODELS["llama"][1], "hidden_act": "gelu"}
    model = load_model(None, arch, torch.float32, "cpu", seed=5)
    model.enable_compile()
    assert model._stack_key is None
    qwen3 = tiny("qwen3")
    qwen3.enable_compile()
    assert qwen3._stack_key is not None


def test_compiled_forward_runs_the_stack_op(stack_calls):
    """The compiled forward's ladle::decoder_stack op runs the native stack (and gives eager's bits)."""
    if not cpu_layers.enabled():
        pytest.skip("the CPU layer stack cannot be built here")
    eager, compiled = tiny("llama", seed=5), tiny("llama", seed=5)
    want = forward(eager, stack=True)
    compiled.enable_compile()
    assert_same(forward(compiled, stack=True), want)
    assert stack_calls == [2, 2]
