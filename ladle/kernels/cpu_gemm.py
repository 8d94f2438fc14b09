"""CPU float32 GEMM for the linear layers (C++ in kernels/csrc/gemm.cpp): oneDNN's bits, faster.

Why our own: oneDNN's packed inner product (models/linear.py) runs a few-row GEMM, a decode step's,
in about the weight's DRAM time *plus* its compute time (the 166M model's linears: ~13 ms + ~1.0 ms
per row at one thread), where the two could overlap. This kernel streams the packed weight with
software prefetches far enough ahead to hide DRAM latency behind the multiply-adds: 1.2-1.45x
faster from 8 to 32 rows; from ~128 rows both run near this core's peak (at 512 rows, the model's four
decoder shapes 0.98-1.03x of oneDNN at one thread; benchmarks/experiments/gemm_stream.py, docs/design-notes.md).
Threads split the column groups; one done with its share takes groups from the back of another's, so a
slower core (a busy vCPU) does not hold the others at the end of the call.

Numerics (the contract): every output element is oneDNN's sum, bit for bit. Measured on oneDNN 3.12's
AVX-512 fp32 kernels (torch 2.13; other oneDNN versions may block K otherwise, and the check below
then keeps oneDNN): an output is one fused multiply-add chain per block of K, in
increasing k from +0, the blocks' partial sums added left to right, blocks of K itself up to 512,
of 512 up to 1024, of 1024 beyond (`k_block`), whatever M, N, the row's position or the threads.
This kernel computes exactly that, so a row's bits depend on nothing but the row and the weight
(batch-invariant by construction), and switching a layer between this kernel and oneDNN changes
nothing. `matches_onednn` re-proves the equality per weight shape before a layer uses the kernel
(models/linear.py); where it fails (another oneDNN, another blocking), the layer keeps oneDNN.

AVX-512 only (the chains are 16-lane vectors over columns); elsewhere `available()` is False.
"""

from __future__ import annotations

import ctypes
import os
import threading
from dataclasses import dataclass

import torch

from ladle.kernels.cpu_build import CSRC, load_first
from ladle.kernels.cpu_paged import zeros_on_huge_pages

_P, _I64, _I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_lock = threading.Lock()
_state: dict[str, object] = {}


def _open(path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    lib.ladle_gemm_isa.restype = ctypes.c_char_p
    lib.ladle_gemm_packed_numel.argtypes, lib.ladle_gemm_packed_numel.restype = [_I32, _I32], _I64
    lib.ladle_gemm_pack.argtypes, lib.ladle_gemm_pack.restype = [_P, _I64, _P, _I32, _I32], _I32
    lib.ladle_gemm.argtypes = [_P, _I64, _P, _P, _I64, _I32, _I32, _I32, _I32, _I32]
    lib.ladle_gemm.restype = _I32
    lib.ladle_gemm_gated.argtypes = [_P, _I64, _P, _P, _I64, _I32, _I32, _I32, _I32, _I32, _I32]
    lib.ladle_gemm_gated.restype = _I32
    lib.ladle_gemm_set_math.argtypes, lib.ladle_gemm_set_math.restype = [_P, _P], _I32
    return lib


def load_library() -> ctypes.CDLL | None:
    """The kernel, built at first use (-march=native first); None when it cannot be built."""
    return load_first(_state, _lock, CSRC / "gemm.cpp", "libladle_gemm", _open,
                      "CPU GEMM kernel unavailable, the linear layers keep oneDNN")


def available() -> bool:
    """Whether linear layers may use this kernel: built with AVX-512, and not switched off
    (LADLE_CPU_GEMM=0, or set_enabled(False))."""
    on = _state.get("enabled")
    if on is None:
        if os.environ.get("LADLE_CPU_GEMM", "1") == "0":  # switched off: not built either
            on = False
        else:
            lib = load_library()
            on = lib is not None and lib.ladle_gemm_isa() == b"avx512"
        _state["enabled"] = on
    return on  # type: ignore[return-value]


def gated_available() -> bool:
    """Whether `gemm` takes `act` (the gated activation fused into its row packing): the kernel is
    available, and the fused elementwise kernels run torch's 16-lane SLEEF exp / tanh, which this library
    then calls too, so its packed act(gate) * up is bitwise kernels/cpu_fused.gated_activation's.
    LADLE_GEMM_GATED=0 switches it off (the two-pass path, same bits)."""
    on = _state.get("gated")
    if on is None:
        on = False
        if available() and os.environ.get("LADLE_GEMM_GATED", "1") != "0":
            from ladle.kernels import cpu_fused

            fused = cpu_fused.load_library()
            if fused is not None and getattr(fused, "math_lanes", 0) == 16:
                exp16, tanh16 = cpu_fused.sleef16()
                on = bool(load_library().ladle_gemm_set_math(exp16, tanh16))
        _state["gated"] = on
    return on  # type: ignore[return-value]


def set_gated_enabled(on: bool) -> None:
    """Switch the fused gated form on or off for this process (benchmarks and tests compare both)."""
    _state.pop("gated", None)
    _state["gated"] = on and gated_available()


def set_enabled(on: bool) -> None:
    """Switch the kernel on or off for layers packed from now on (benchmarks compare both in one run)."""
    _state.pop("enabled", None)
    _state["enabled"] = on and available()


_INT_MAX = 2**31 - 1  # sizes go to the C++ as int (ctypes would wrap a larger one without a word)

GROUP_COLUMNS = 32  # GW in the C++: a packed weight's columns come in groups of 32, the last zero-padded


def padded_columns(n: int) -> int:
    """A packed weight of n output columns holds this many (n rounded up to whole column groups)."""
    return -(-n // GROUP_COLUMNS) * GROUP_COLUMNS


def k_block(k: int) -> int:
    """oneDNN's K blocking for an fp32 AVX-512 inner product of K inputs (measured; see the module)."""
    return k if k <= 512 else 512 if k <= 1024 else 1024


@dataclass(slots=True, eq=False)
class PackedWeight:
    """A weight [N, K] in the kernel's layout (column groups of 32, a flat float32 tensor)."""

    data: torch.Tensor
    out_features: int
    in_features: int
    kb: int

    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()


def pack(weight: torch.Tensor, kb: int | None = None, *, lib: ctypes.CDLL | None = None) -> PackedWeight:
    """weight [N, K] (CPU float32, unit last stride) packed for `gemm`; kb: K block (default k_block). lib: another
    build of this kernel to pack with (benchmarks/experiments/gemm_ab.py compares builds whose layouts may differ)."""
    lib = lib if lib is not None else load_library()
    if lib is None:
        raise RuntimeError(f"the CPU GEMM kernel is not available: {_state.get('error')}")
    if weight.dtype != torch.float32 or weight.device.type != "cpu" or weight.dim() != 2:
        raise ValueError(f"cpu_gemm.pack takes a 2-D CPU float32 weight, not {weight.dtype} {tuple(weight.shape)}")
    w = weight.detach()
    if w.stride(-1) != 1:
        w = w.contiguous()
    n, k = w.shape
    if max(n, k) > _INT_MAX:
        raise ValueError(f"cpu_gemm.pack: a weight of {n} x {k} is past the kernel's int sizes ({_INT_MAX})")
    # On 2 MiB pages where the OS allows: a few-row GEMM streams the whole weight (3-5% faster at 2-8 rows).
    data = zeros_on_huge_pages((lib.ladle_gemm_packed_numel(n, k),), torch.float32)
    if lib.ladle_gemm_pack(w.data_ptr(), w.stride(0), data.data_ptr(), n, k) != 0:
        raise ValueError(f"cpu_gemm.pack: empty weight {tuple(w.shape)}")
    return PackedWeight(data, n, k, k_block(k) if kb is None else kb)


GATED_ACTIVATIONS = {"silu": 0, "gelu_pytorch_tanh": 1, "gelu_tanh": 1}  # kernels/cpu_fused.ACTIVATIONS' codes


def gemm(x: torch.Tensor, packed: PackedWeight, act: str | None = None, *, out: torch.Tensor | None = None,
         lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """x [M, K] (CPU float32) @ weight.T -> a fresh [M, N], or `out` (contiguous float32 [M, N]) rewritten.

    act (a key of GATED_ACTIVATIONS; needs `gated_available()`): x is [M, 2K], gate then up, and the
    product is act(gate) * up @ weight.T, the activation computed while the rows are packed, bitwise
    kernels/cpu_fused.gated_activation's (no [M, K] intermediate in memory). lib: another build of this
    kernel, with `packed` packed by it (benchmarks/experiments/gemm_ab.py)."""
    width = packed.in_features * (1 if act is None else 2)
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 2 or x.shape[1] != width:
        raise ValueError(f"cpu_gemm.gemm: x {x.dtype} {tuple(x.shape)} does not fit a weight "
                         f"[{packed.out_features}, {packed.in_features}]")
    if x.shape[0] > _INT_MAX:  # the C entry point counts rows in an int: more would wrap, silently
        raise ValueError(f"cpu_gemm.gemm: {x.shape[0]} rows is more than one call takes ({_INT_MAX}); "
                         f"split the rows into several calls")
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, n = x.shape[0], packed.out_features
    if out is None:
        out = torch.empty(m, n, dtype=torch.float32)
    elif out.dtype != torch.float32 or out.device.type != "cpu" or out.shape != (m, n) or not out.is_contiguous():
        raise ValueError(f"cpu_gemm.gemm: out {out.dtype} {tuple(out.shape)} is not a contiguous float32 [{m}, {n}]")
    lib = lib if lib is not None else load_library()
    ldx = x.stride(0) if m > 1 else width
    if act is None:
        code = lib.ladle_gemm(x.data_ptr(), ldx, packed.data.data_ptr(), out.data_ptr(), n, m, n,
                              packed.in_features, packed.kb, torch.get_num_threads())
    else:
        if not gated_available():
            raise RuntimeError("cpu_gemm.gemm: the gated form is not available here (see gated_available)")
        code = lib.ladle_gemm_gated(x.data_ptr(), ldx, packed.data.data_ptr(), out.data_ptr(), n, m,
                                    n, packed.in_features, packed.kb, torch.get_num_threads(),
                                    GATED_ACTIVATIONS[act])
    if code != 0:
        raise RuntimeError(f"ladle_gemm rejected its arguments (code {code})")
    return out


@torch.no_grad()
def matches_onednn(n: int, k: int, kb: int | None = None, rows: tuple[int, ...] = (1, 2, 13, 40)) -> bool:
    """Whether `gemm` with K blocks of kb (default k_block) gives oneDNN's packed inner product bit for bit
    for a weight [n, k], on random inputs at these row counts.

    The weight is random too, not a layer's: the answer is cached per shape (models/linear.py), and a
    proof on a degenerate weight (zeros: every sum exact in any order) would hold for any blocking.
    Its n rows repeat 64 random ones: oneDNN runs at the full shape (its blocking may depend on n), this
    kernel on the 64 alone, since its sums for an output depend on that output's weight row and nothing
    else (every column group, every lane, runs the same chains). A fixed generator: the global RNG is
    untouched."""
    gen = torch.Generator().manual_seed(0)
    block = torch.randn(min(n, 64), k, generator=gen)
    cols = torch.arange(n) % block.shape[0]
    onednn = torch.ops.mkldnn._reorder_linear_weight(block[cols], None)
    packed = pack(block, kb)
    for m in rows:
        x = torch.randn(max(m, 2), k, generator=gen) * 2
        ref = torch.ops.mkldnn._linear_pointwise(x, onednn, None, "none", [], "")[:m]
        if not torch.equal(gemm(x[:m], packed)[:, cols], ref):
            return False
    return True
