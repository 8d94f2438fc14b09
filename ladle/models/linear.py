"""Linear layers for CPU inference: a weight packed once, one path that is batch-invariant.

On this CPU (AMD EPYC, AVX-512, torch 2.13 with MKL 2024.2 and oneDNN 3.12; benchmarks/experiments/linear_cpu.py)
`F.linear` in fp32 is MKL's sgemm, which packs the weight on every call and runs at 40-50% of oneDNN's
speed. oneDNN's inner product (`mkldnn::_linear_pointwise`) on a weight reordered once into its blocked
layout (`mkldnn::_reorder_linear_weight`, what inductor's CPU freezing does for a dynamic batch) is
2-3x faster than F.linear from 8 rows up (1-1.7x at one row, where both stream the weight).

Batch invariance: with the packed weight, a row's output is bitwise the same for every
row count M >= 2, every position in the batch, any other rows, and every thread count tried (1, 2, 3,
4, 8, 16): oneDNN blocks over rows and columns but reduces over K in one fixed order. Only M = 1 takes
another kernel, which reduces in another order when K >= 2048, so a one-row call is padded to two rows
(~5% of a one-sequence decode step; nothing from two rows up). So the fast path is also the
deterministic one; `check_batch_invariance` re-proves it for a weight at start-up, and the tests prove
it for the model shapes. MKL's F.linear is not invariant: M = 1, 2-3 and >= 4 give three different
results for one row (and 7 joins 2-3 at 2 threads).

Faster with oneDNN's bits: a layer without bias on an AVX-512 CPU packs for ladle's own GEMM instead
(kernels/cpu_gemm.py), which computes oneDNN's very sums (the same K-blocked chains) but overlaps the
weight's DRAM stream with the arithmetic: 1.2-1.4x at 8-32 rows, a decode step's, about even at 512. It
takes exact row counts (no primitives) and one row as it is. The equality with oneDNN is proven once
per weight shape (`pack_for_cpu`); a shape where it does not hold keeps oneDNN.

Everything else (CUDA, other dtypes, no oneDNN, autograd) is plain `F.linear`, unchanged.
"""

from __future__ import annotations

import itertools
import os
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from ladle.kernels import cpu_fused, cpu_gemm
from ladle.models.config import ModelArch

# oneDNN builds one primitive per (weight shape, row count) and keeps 1024 of them; an engine's steps
# have up to ~budget distinct row counts per shape, and a miss costs ~0.3 ms of primitive creation.
# Read once, when oneDNN first runs: effective only if nothing used oneDNN before this import.
os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "8192")

MIN_ROWS = 2  # oneDNN's one-row kernel reduces in another order (K >= 2048): pad to two rows

_keys = itertools.count()
_modules: weakref.WeakValueDictionary[int, Linear] = weakref.WeakValueDictionary()


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


_ONEDNN = onednn_available()


def row_bucket(rows: int) -> int:
    """The row count a call runs at. oneDNN builds (and caches, with its scratch memory) one primitive
    per (weight shape, row count): unbucketed, an engine's ~budget distinct widths grew host memory by
    ~1 MB per primitive without bound (1.8 GB for 512 widths of 4 small shapes). Small widths are
    exact, since a decode step's time grows ~linearly with its rows (a 17-row step padded to 32 took
    45 ms instead of 29 on the 166M model): every width up to 32 (one row goes to two, see MIN_ROWS),
    then multiples of 8 up to 128, of 16 up to 1024, then of 128; at most 7, 15 and 127 wasted rows.
    ~120 buckets per shape up to 4096 rows. A primitive holds ~0.6 MB whatever the shape (measured:
    Qwen3-0.6B's 5 decoder shapes at a 512-token budget, 335 primitives, +190 MB; the memory plan does
    not count them, they live in engine/memory.py's HOST_HEADROOM_GB)."""
    if rows <= 32:
        return max(MIN_ROWS, rows)
    step = 8 if rows <= 128 else 16 if rows <= 1024 else 128
    return -(-rows // step) * step


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """The weight [out, in] reordered once into oneDNN's blocked layout (an opaque mkldnn tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


# (out, in) -> whether kernels/cpu_gemm gives oneDNN's bits at that shape (checked once per process).
_gemm_matches: dict[tuple[int, int], bool] = {}


def pack_for_cpu(weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | cpu_gemm.PackedWeight:
    """The weight packed for the faster of the two bit-identical paths: kernels/cpu_gemm (no bias,
    AVX-512, its equality with oneDNN proven at this shape) or oneDNN's blocked layout."""
    if bias is None and cpu_gemm.available():
        shape = weight.shape[0], weight.shape[1]
        if shape not in _gemm_matches:  # on a random weight of the shape, not this one (see the check)
            _gemm_matches[shape] = cpu_gemm.matches_onednn(*shape)
        if _gemm_matches[shape]:
            return cpu_gemm.pack(weight)
    return pack_weight(weight)


def packed_linear(
    x: torch.Tensor, packed: torch.Tensor | cpu_gemm.PackedWeight, bias: torch.Tensor | None
) -> torch.Tensor:
    """x [..., in] @ packed.T (+ bias) through kernels/cpu_gemm or oneDNN (fewer than MIN_ROWS rows
    padded by repeating, row counts bucketed)."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if isinstance(packed, cpu_gemm.PackedWeight):  # exact rows: no primitives to bound, no row kernel apart
        if bias is not None:
            raise ValueError("packed_linear: kernels/cpu_gemm has no bias term; pack such a layer for oneDNN")
        return cpu_gemm.gemm(x2, packed).view(*shape[:-1], packed.out_features)
    rows = x2.shape[0]
    padded = row_bucket(rows)
    if rows == 1:  # one row -> two: a view, no copy (the decode of one sequence)
        x2 = x2.expand(MIN_ROWS, -1)
    elif rows and padded != rows:  # zero rows: a row's result does not depend on the others (M >= 2)
        x2 = F.pad(x2, (0, 0, 0, padded - rows))
    out = torch.ops.mkldnn._linear_pointwise(x2, packed, bias, "none", [], "")
    if out.shape[0] != rows:
        out = out[:rows]
    return out.view(*shape[:-1], out.shape[-1])


@torch.library.custom_op("ladle::cpu_linear", mutates_args=())
def cpu_linear_op(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, key: torch.Tensor
) -> torch.Tensor:
    """Linear `key`'s packed forward as one opaque op for torch.compile: inductor cannot lower a packed
    mkldnn tensor as a graph input, so the op finds the module (and its packed weight) by key. The key is
    a 0-d int64 CPU tensor, a graph input: as a Python int it would be a constant of the graph, guarded,
    so every other model (each has its own keys) compiled a graph of its own, and the ninth model
    compiled in a process hit dynamo's recompile limit (an error under fullgraph=True)."""
    module = _modules.get(int(key))
    if module is None:
        raise RuntimeError(f"ladle::cpu_linear: no live Linear with key {key}")
    return module.packed_forward(x).contiguous()


@cpu_linear_op.register_fake
def _cpu_linear_fake(x, weight, bias, key):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@torch.library.custom_op("ladle::cpu_linear_gated", mutates_args=())
def cpu_linear_gated_op(gate_up: torch.Tensor, weight: torch.Tensor, act: str, key: torch.Tensor) -> torch.Tensor:
    """Linear `key`'s `packed_gated_forward` as one opaque op for torch.compile (see cpu_linear_op)."""
    module = _modules.get(int(key))
    if module is None:
        raise RuntimeError(f"ladle::cpu_linear_gated: no live Linear with key {key}")
    return module.packed_gated_forward(gate_up, act).contiguous()


@cpu_linear_gated_op.register_fake
def _cpu_linear_gated_fake(gate_up, weight, act, key):
    return gate_up.new_empty((*gate_up.shape[:-1], weight.shape[0]))


def _pack_state(weight: torch.Tensor, bias: torch.Tensor | None) -> tuple[int, int, bool]:
    """What must not change under a packed copy: the storage and its in-place version, and whether
    there is a bias (a layer packed for kernels/cpu_gemm, which has none, repacks when given one)."""
    version = -1 if weight.is_inference() else weight._version
    return weight.data_ptr(), version, bias is None


class Linear(nn.Linear):
    """nn.Linear whose CPU fp32 inference runs through oneDNN on a weight packed once.

    The Parameter stays the source of truth (loading, state_dict, tying, .to()); the packed copy is
    derived from it by `derive_weights` (the loader calls it) or on the first CPU forward, and is rebuilt
    whenever the weight changed in place since (its version counter) or moved (`_apply` drops it). An
    inference tensor (a weight made under torch.inference_mode) has no version counter: after changing
    one in place, call derive_weights (CausalLM.derive_weights) or the old packed copy keeps running.
    `use_packed=False` forces F.linear for this layer. `deterministic` (set by
    CausalLM.set_deterministic) makes a forward that would leave the packed path an error instead."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__(in_features, out_features, bias=bias)
        self.use_packed = True
        self.deterministic = False
        self._packed: torch.Tensor | cpu_gemm.PackedWeight | None = None
        self._packed_for: tuple[int, int, bool] | None = None
        self._register()

    def _register(self) -> None:
        self._key = next(_keys)
        _modules[self._key] = self
        # The key as cpu_linear_op takes it: a plain attribute (no buffer: `to_empty` and `.to()` would
        # reallocate or move it), on the CPU even under `torch.device("meta")` (models are built there).
        self._key_tensor = torch.tensor(self._key, dtype=torch.int64, device="cpu")

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_packed"], state["_packed_for"] = None, None  # an opaque tensor; rebuilt on demand
        return state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self._register()  # a copy gets its own key: the compiled op must find the copy, not the original

    def _apply(self, fn, recurse: bool = True):
        self._packed, self._packed_for = None, None
        return super()._apply(fn, recurse)

    def packable(self) -> bool:
        """Whether this layer's inference runs packed: CPU, fp32, oneDNN present, no autograd."""
        w = self.weight
        return (
            self.use_packed
            and w.device.type == "cpu"
            and w.dtype == torch.float32
            and not w.requires_grad
            and (self.bias is None or not self.bias.requires_grad)
            and _ONEDNN
        )

    def derive_weights(self) -> None:
        """Pack now (once the weights are final), so the first step does not pay for it."""
        if self.packable():
            self.pack()

    def pack(self) -> torch.Tensor | cpu_gemm.PackedWeight:
        self._packed = pack_for_cpu(self.weight, self.bias)
        self._packed_for = _pack_state(self.weight, self.bias)
        return self._packed

    def packed_bytes(self) -> int:
        """Host memory held by the packed copy (0 when none): in addition to the Parameter."""
        if isinstance(self._packed, cpu_gemm.PackedWeight):
            return self._packed.nbytes()
        return 0 if self._packed is None else self.weight.numel() * self.weight.element_size()

    def current_pack(self) -> torch.Tensor | cpu_gemm.PackedWeight:
        """The packed copy, repacked first when the weight (or the bias) changed since it was made."""
        if self._packed is None or self._packed_for != _pack_state(self.weight, self.bias):
            return self.pack()
        return self._packed

    def packed_forward(self, x: torch.Tensor) -> torch.Tensor:
        packed = self.current_pack()
        return packed_linear(x, packed, self.bias)

    def packed_gated_forward(self, gate_up: torch.Tensor, act: str) -> torch.Tensor:
        """This layer of act(gate) * up, gate_up [..., 2 * in] (gate then up; act a key of
        kernels/cpu_fused.ACTIVATIONS): through kernels/cpu_gemm's gated form where this layer packed for
        it (the activation computed while the GEMM packs its rows, never written out), else the fused
        activation kernel, then the packed GEMM. The same bits either way (kernels/cpu_gemm.gemm)."""
        packed = self.current_pack()
        if isinstance(packed, cpu_gemm.PackedWeight) and act in cpu_gemm.GATED_ACTIVATIONS \
                and cpu_gemm.gated_available():
            shape = gate_up.shape
            out = cpu_gemm.gemm(gate_up.reshape(-1, shape[-1]), packed, act=act)
            return out.view(*shape[:-1], packed.out_features)
        return packed_linear(cpu_fused.gated_activation(gate_up, act), packed, self.bias)

    def gated(self, gate_up: torch.Tensor, act: str) -> torch.Tensor:
        """self(act(gate) * up) for gate_up [..., 2 * in_features] on the CPU float32 inference path, where
        kernels/cpu_fused runs the activation (models/layers.MLP): one pass instead of two on the packed
        path, eager and compiled alike; elsewhere the activation kernel, then this layer as usual."""
        if gate_up.dtype == torch.float32 and not gate_up.requires_grad and self.packable():
            if torch.compiler.is_compiling():
                return cpu_linear_gated_op(gate_up, self.weight, act, self._key_tensor)
            return self.packed_gated_forward(gate_up, act)
        return self(cpu_fused.gated_activation(gate_up, act))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32 or x.requires_grad or not self.packable():
            if self.deterministic:
                raise RuntimeError(
                    f"deterministic mode: this linear layer cannot run batch-invariant on "
                    f"{x.device.type} {x.dtype} (weight {self.weight.device.type} {self.weight.dtype}); "
                    f"only the packed oneDNN path (CPU, float32, no autograd) is"
                )
            return F.linear(x, self.weight, self.bias)
        if torch.compiler.is_compiling():
            return cpu_linear_op(x, self.weight, self.bias, self._key_tensor)
        return self.packed_forward(x)


def packed_bytes_estimate(arch: ModelArch, dtype: torch.dtype, device: torch.device | str) -> int:
    """What the packed copies will add to a model's host memory, from its shapes alone (for a memory
    plan made before loading): every projection and the LM head (a tied one too: the embedding keeps its
    dense copy), in float32; 0 where nothing is packed (CUDA, other dtypes, no oneDNN). Each output
    dimension counted as kernels/cpu_gemm pads it (to its column groups): never less than they hold."""
    if torch.device(device).type != "cpu" or dtype != torch.float32 or not _ONEDNN:
        return 0
    h, i, d = arch.hidden_size, arch.intermediate_size, arch.head_dim
    q, kv, pad = arch.num_heads * d, arch.num_kv_heads * d, cpu_gemm.padded_columns
    # q and k|v (padded apart: at least as much as q|k|v padded together), o
    attention = h * (pad(q) + pad(2 * kv)) + q * pad(h)
    dense = h * pad(2 * i) + i * pad(h)  # gate|up, down
    m = arch.moe_intermediate_size
    sparse = arch.num_experts * (h * pad(2 * m) + m * pad(h)) + h * pad(arch.num_experts)  # experts, router
    mlps = sum(sparse if arch.is_sparse(layer) else dense for layer in range(arch.num_layers))
    return 4 * (arch.num_layers * attention + mlps + pad(arch.vocab_size) * h)


@torch.no_grad()
def check_batch_invariance(
    linear: Linear, rows: tuple[int, ...] = (1, 2, 3, 5, 17, 64, 129), seed: int = 0
) -> list[int]:
    """Row counts at which one fixed row's output is not bitwise what it is alone (empty: invariant).

    The row sits at a different position among fresh random rows for each count. Draws from its own
    generator (the global RNG, which seeded sampling may use, is untouched)."""
    gen = torch.Generator().manual_seed(seed)
    w = linear.weight
    row = torch.randn(1, w.shape[1], generator=gen, dtype=w.dtype)
    reference = linear(row)[0]
    bad = []
    for m in rows:
        x = torch.randn(m, w.shape[1], generator=gen, dtype=w.dtype)
        pos = int(torch.randint(m, (), generator=gen))
        x[pos] = row[0]
        if not torch.equal(linear(x)[pos], reference):
            bad.append(m)
    return bad


def verify_batch_invariance(linears: list[Linear]) -> None:
    """Raise unless every layer can run packed and, for each distinct weight shape, one row's output is
    bitwise the same at every row count tried (check_batch_invariance), at the current thread count."""
    unfit = [i for i, m in enumerate(linears) if not m.packable()]
    if unfit:
        w = linears[unfit[0]].weight
        raise ValueError(
            f"deterministic mode needs every linear layer on the packed oneDNN path (CPU, float32, "
            f"oneDNN present, no autograd); {len(unfit)} cannot run it (the first: weight on "
            f"{w.device.type}, {w.dtype}; oneDNN available: {_ONEDNN})"
        )
    seen: set[tuple[int, int, bool]] = set()
    for m in linears:
        shape = (m.out_features, m.in_features, m.bias is not None)
        if shape in seen:
            continue
        seen.add(shape)
        bad = check_batch_invariance(m)
        if bad:
            raise RuntimeError(
                f"deterministic mode: a linear layer of shape {shape[:2]} is not batch-invariant on this "
                f"machine at {torch.get_num_threads()} threads: one row's output differs at row counts {bad}"
            )
