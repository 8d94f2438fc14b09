"""Count the aten ops a model forward dispatches, per decoder layer, so the op budget of a layer is
visible to tests and benchmarks (on a GPU every op is a kernel launch; on a CPU, dispatcher and
Python work). Ops that only re-describe a tensor (views, transposes, splits) are counted apart.
What is counted is a layer run op by op: the CPU layer stack (models/cpu_stack.py), which runs the same
kernels from one native call, is switched off while counting."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ladle.kernels import cpu_gemm, cpu_layers

# Metadata-only ops: no kernel, no data touched.
VIEW_OPS = frozenset(
    f"aten.{name}"
    for name in (
        "view", "_unsafe_view", "reshape", "detach", "alias", "t", "transpose", "permute", "expand",
        "unsqueeze", "squeeze", "select", "slice", "split", "split_with_sizes", "chunk", "unbind",
        "as_strided", "_reshape_alias", "to",
    )
)  # fmt: skip

# The GEMM of a linear layer: torch's (MKL on the CPU, cuBLAS on CUDA), oneDNN's on a packed weight, or
# ladle's (models/linear.py, CPU fp32; a ctypes call, no aten op: count_layer_ops records it by name).
LADLE_GEMM = "ladle.cpu_gemm"
MATMUL_OPS = frozenset({"aten.mm", "aten.addmm", "mkldnn._linear_pointwise", LADLE_GEMM})


@contextmanager
def op_by_op() -> Iterator[None]:
    """The layers one op at a time inside the block (the CPU layer stack off), as counted here."""
    was = cpu_layers.enabled()
    cpu_layers.set_enabled(False)
    try:
        yield
    finally:
        cpu_layers.set_enabled(was)


class AtenOpCounter(TorchDispatchMode):
    """Records every aten op dispatched inside the `with` block, by op name, under the current scope."""

    def __init__(self) -> None:
        super().__init__()
        self.scope = "other"
        self.counts: dict[str, Counter[str]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.record(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))

    def record(self, op: str) -> None:
        self.counts.setdefault(self.scope, Counter())[op] += 1

    def compute_ops(self, scope: str) -> int:
        return sum(n for op, n in self.counts.get(scope, Counter()).items() if op not in VIEW_OPS)

    def view_ops(self, scope: str) -> int:
        return sum(n for op, n in self.counts.get(scope, Counter()).items() if op in VIEW_OPS)


def count_layer_ops(model, *forward_args) -> tuple[AtenOpCounter, list[str]]:
    """Run model(*forward_args) once under the counter with each decoder layer as its own scope
    (`layer.N`); returns the counter and the layer scope names. ladle's GEMM (kernels/cpu_gemm, called
    through ctypes, invisible to the dispatcher) is counted as the op LADLE_GEMM."""
    counter = AtenOpCounter()
    gemm = cpu_gemm.gemm

    def counted_gemm(*args, **kwargs):
        counter.record(LADLE_GEMM)
        return gemm(*args, **kwargs)

    layers = list(model.model.layers)
    scopes = [f"layer.{i}" for i in range(len(layers))]
    handles = []
    for scope, layer in zip(scopes, layers):
        handles.append(layer.register_forward_pre_hook(lambda *_, s=scope: setattr(counter, "scope", s)))
        handles.append(layer.register_forward_hook(lambda *_: setattr(counter, "scope", "other")))
    cpu_gemm.gemm = counted_gemm
    try:
        with op_by_op(), torch.no_grad(), counter:  # not inference_mode: it shows composites (linear) undecomposed
            model(*forward_args)
    finally:
        cpu_gemm.gemm = gemm
        for h in handles:
            h.remove()
    return counter, scopes


def ops_per_layer(model, *forward_args) -> dict[str, float]:
    """Mean aten ops per decoder layer in one forward: {'compute': ..., 'views': ...}.

    Runs the forward once uncounted first so per-forward work cached on the metadata (the attention
    gather plan, RoPE tables) is not charged to the first layer."""
    with torch.inference_mode():
        model(*forward_args)
    counter, scopes = count_layer_ops(model, *forward_args)
    n = len(scopes)
    return {
        "compute": sum(counter.compute_ops(s) for s in scopes) / n,
        "views": sum(counter.view_ops(s) for s in scopes) / n,
    }


def decode_ops_per_layer(model, context_lens: list[int], block_size: int = 16) -> dict[str, float]:
    """ops_per_layer for a decode batch (one new token per sequence, `context_lens[b]` tokens already
    cached) on scratch caches of the model's dtype and device."""
    return ops_per_layer(model, *decode_batch(model, context_lens, block_size))


def decode_batch(model, context_lens: list[int], block_size: int = 16) -> tuple:
    """Forward arguments (ids, positions, caches, metadata) of a decode batch: one new token per
    sequence, `context_lens[b]` tokens already cached, on scratch caches of the model's dtype and device."""
    from ladle.kernels import AttentionMetadata

    param = next(model.parameters())
    a = model.arch
    per_seq = max(context_lens) // block_size + 1
    shape = (2, per_seq * len(context_lens) + 1, block_size, a.num_kv_heads, a.head_dim)
    caches = [torch.zeros(shape, dtype=param.dtype, device=param.device) for _ in range(a.num_layers)]
    tables = [list(range(1 + b * per_seq, 1 + (b + 1) * per_seq)) for b in range(len(context_lens))]
    seq_lens = [n + 1 for n in context_lens]
    meta = AttentionMetadata.build([1] * len(seq_lens), seq_lens, tables, block_size, device=param.device)
    ids = torch.arange(3, 3 + len(seq_lens), device=param.device)
    positions = torch.tensor(context_lens, device=param.device)
    return ids, positions, caches, meta


def compiled_kernels_per_layer(model, context_lens: list[int], block_size: int = 16) -> dict[str, float]:
    """What a compiled decode forward launches, from inductor's generated code: fused kernels
    (`cpp_fused_*` on CPU, Triton kernels on CUDA), library calls (`extern_kernels.mm`/`addmm`, or
    `ladle::cpu_linear`, the packed oneDNN linear of models/linear.py) and the
    attention custom op, per decoder layer (the graph's total / layers, so the embedding and the final
    norm are spread over the layers: an upper bound). The attention op runs its own eager ops inside.

    Compiles afresh: it resets dynamo (every compiled function in the process recompiles on its next
    call) and leaves the model compiled op by op, so call it from a benchmark or test, never next to a
    running engine."""
    import re

    from torch._inductor.utils import run_and_get_code

    ids, positions, caches, meta = decode_batch(model, context_lens, block_size)
    torch._dynamo.reset()
    with op_by_op():
        model.enable_compile()  # (again): a graph of the layers' own ops, not one ladle::decoder_stack op
        with torch.inference_mode():
            _, codes = run_and_get_code(model, ids, positions, caches, meta)
    calls = Counter()
    for code in codes:
        body = code.split("def call(", 1)[-1]
        for name in re.findall(r"^\s+(?:\w+ = )?([\w.]+)(?:\.run)?\(", body, re.MULTILINE):
            if name.startswith(("cpp_fused", "triton_")):
                calls["fused"] += 1
            elif name.startswith(("extern_kernels.", "torch.ops.ladle.cpu_linear")):
                calls["library"] += 1
            elif name.startswith("torch.ops.ladle.attention"):
                calls["attention"] += 1
    n = model.arch.num_layers
    return {"kernels": sum(calls.values()) / n, **{k: v / n for k, v in calls.items()}}
