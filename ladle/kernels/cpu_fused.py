"""Fused CPU float32 kernels for a layer's elementwise work (C++ in kernels/csrc/fused.cpp).

Eager torch runs a decoder layer's norms, RoPE and activation as ~25 separate ops, each a pass over
its tensor in memory; these do each group in one pass:
- `add_rms_norm`: the residual add and RMSNorm (sum of squares, scale, weight), both outputs at once;
- `gated_activation`: SiLU(gate) * up or GELU-tanh(gate) * up, read from the gate|up matmul output;
- `qk_norm_rope`: Qwen3's / Gemma's per-head RMSNorm of q and k, then RoPE, over the qkv output
  (or RoPE alone, Llama), written where the attention kernel reads q and k.

Numerics (the contract): every output element is the same sequence of float32 operations as the torch
ops of models/layers.py, in the same order (a fused multiply-add only where torch's vector GELU has
one); a row's sum of squares is added in torch's CPU sum order (its 8- or 16-lane cascade, the width
found once by comparing with torch: `torch_lanes`); exp and tanh are torch's own vector functions
(SLEEF's u10, looked up in libtorch_cpu). So norms and RoPE are bitwise the torch ops', and the
activations bitwise F.silu's / F.gelu's vector loops. They can differ in the last bit from F.*'s
scalar remainder loop (libm) and from the torch path's batch-invariant exp/tanh forms (torch.exp and
torch.tanh are MKL's, not SLEEF's). Where SLEEF cannot be found: libm (within an ulp).

Determinism: each row (each head, for qk_norm_rope) is computed by one thread from its own values
alone, so its bits never depend on the batch, the row count or the thread count: batch-invariant by
construction. Built with -march=native (kernels/cpu_build.py's cache and fallbacks); if the build
fails, `load_library()` is None and models/layers.py keeps the torch ops.
"""

from __future__ import annotations

import ctypes
import logging
import os
import subprocess
import threading
from pathlib import Path

import torch

from ladle.kernels.cpu_build import ARCH_FLAGS, CSRC, compile_cached, report_unavailable

log = logging.getLogger("ladle.kernels")

ACTIVATIONS = {"silu": 0, "gelu_pytorch_tanh": 1, "gelu_tanh": 1}  # models' hidden_act -> kernel code
MAX_HEAD_DIM = 1024  # qk_norm_rope's bound (a stack buffer per head)
_P, _I64, _I32, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
_SIGNATURES = {
    "ladle_add_rmsnorm": [_P, _I64, _P, _I64, _P, _I64, _P, _I64, _P, _I64, _I64, _F, _I32, _I32],
    "ladle_gated_act": [_P, _I64, _P, _I64, _I64, _I64, _I32, _I32],
    "ladle_qk_norm_rope": [_P, _I64, _I64, _P, _P, _P, _I64, _P, _I64, _I64, _I64, _I64, _F, _I32, _I32],
    "ladle_fused_set_math": [_P, _P, _P, _P],
}
_SUM_SIGNATURE = ([_P, _I64, _I32], ctypes.c_float)

_lock = threading.Lock()
_state: dict[str, object] = {}


def torch_lanes() -> int:
    """The vector width (8 or 16 float32 lanes) whose summation order reproduces torch's CPU sum along a
    row, found once by comparing both with torch on rows where they differ; 8 if neither matches."""
    lanes = _state.get("lanes")
    if lanes is None:
        lanes = _state["lanes"] = _calibrate_lanes(_lib())
    return lanes  # type: ignore[return-value]


def _calibrate_lanes(lib: ctypes.CDLL) -> int:
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(2, n, generator=gen) * 3 for n in (8, 24, 72, 1000, 1024, 4099)]
    sums = [x.pow(2).sum(-1).tolist() for x in xs]
    for lanes in (8, 16):
        ours = [[lib.ladle_fused_sum_squares(row.data_ptr(), row.numel(), lanes) for row in x] for x in xs]
        if ours == sums:
            _state["sum_order"] = "torch"
            return lanes
    _state["sum_order"] = "own"
    log.warning("fused CPU kernels: torch's row-sum order not reproduced; norms round slightly differently")
    return 8


def _sleef(names: tuple[str, str]) -> tuple[int | None, int | None]:
    """Addresses of torch's SLEEF functions (exported by libtorch_cpu), or None each."""
    try:
        lib = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"))
    except OSError:
        return None, None
    out = []
    for name in names:
        fn = getattr(lib, name, None)
        out.append(None if fn is None else ctypes.cast(fn, ctypes.c_void_p).value)
    return out[0], out[1]


def sleef16() -> tuple[int | None, int | None]:
    """Addresses of torch's 16-lane SLEEF exp and tanh (u10), the functions this library's 16-lane
    math calls (kernels/cpu_gemm's gated form calls them too, for the same bits); None each if absent."""
    return _sleef(("Sleef_expf16_u10", "Sleef_tanhf16_u10"))


def install_math(lib: ctypes.CDLL, use_sleef: bool = True) -> int:
    """Point the library's exp/tanh at torch's SLEEF functions of torch's vector width (or the
    narrower one it can call); returns the lanes in use, 0 for libm."""
    exp16 = tanh16 = exp8 = tanh8 = None
    if use_sleef:
        widths = lib.ladle_fused_vector_widths()
        if torch.backends.cpu.get_cpu_capability() == "AVX512" and widths & 2:
            exp16, tanh16 = sleef16()
        elif widths & 1:
            exp8, tanh8 = _sleef(("Sleef_expf8_u10", "Sleef_tanhf8_u10"))
    return lib.ladle_fused_set_math(exp16, tanh16, exp8, tanh8)


def open_library(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    lib.ladle_fused_isa.restype = ctypes.c_char_p
    for name, argtypes in _SIGNATURES.items():
        getattr(lib, name).argtypes = argtypes
        getattr(lib, name).restype = ctypes.c_int
    lib.ladle_fused_sum_squares.argtypes, lib.ladle_fused_sum_squares.restype = _SUM_SIGNATURE
    return lib


def build_library(arch_flags: tuple[str, ...] | list[str], directory: Path | None = None) -> ctypes.CDLL:
    """Build (or reuse) the library with these architecture flags and load it, math installed.
    Tests build others than the default (e.g. -mno-avx512f, or no -march: the generic path)."""
    path, seconds = compile_cached(CSRC / "fused.cpp", "libladle_fused", list(arch_flags), directory)
    if seconds is not None:
        _state["build_seconds"] = seconds
    lib = open_library(path)
    lib.math_lanes = install_math(lib)
    return lib


def load_library() -> ctypes.CDLL | None:
    """The fused kernels, built at first use; None (and one logged warning) when they cannot be."""
    with _lock:
        if "lib" not in _state:
            errors = []
            for arch in ARCH_FLAGS:
                try:
                    _state["lib"] = build_library(arch)
                    break
                except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
                    errors.append(f"{type(e).__name__}: {e}")
            else:
                _state["lib"] = None
                _state["error"] = "\n".join(errors)
                report_unavailable("fused CPU kernels unavailable, using the torch ops", _state["error"])
        return _state["lib"]  # type: ignore[return-value]


def enabled() -> bool:
    """Whether models/layers.py runs its CPU float32 eager elementwise work here (LADLE_FUSED_CPU=0: no;
    or no library)."""
    on = _state.get("enabled")
    if on is None:
        on = _state["enabled"] = os.environ.get("LADLE_FUSED_CPU", "1") != "0" and load_library() is not None
    return on  # type: ignore[return-value]


def set_enabled(on: bool) -> None:
    """Switch the fused path on or off for this process (benchmarks and tests compare both in one run)."""
    _state["enabled"] = on and load_library() is not None


def _lib() -> ctypes.CDLL:
    lib = load_library()
    if lib is None:
        raise RuntimeError(f"the fused CPU kernels are not available: {_state.get('error')}")
    return lib


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, last dim] with a unit last stride (a view where one exists)."""
    x = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    return x if x.stride(-1) == 1 or x.shape[-1] == 1 else x.contiguous()


def _require(ok: bool, name: str, what: str) -> None:
    """The kernels take raw float32 CPU pointers and trust the shapes: a bf16 or CUDA tensor, or a short
    weight, would be read as something else or past its end (the ops are callable as torch.ops.ladle.*)."""
    if not ok:
        raise ValueError(f"{name}: {what}")


def _cpu_f32(*tensors: torch.Tensor | None) -> bool:
    return all(t is None or (t.dtype == torch.float32 and t.device.type == "cpu") for t in tensors)


def _check(code: int, name: str) -> None:
    if code != 0:
        raise RuntimeError(f"{name} rejected its arguments (code {code})")


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight * rms_norm(x + residual), x + residual); residual None: (weight * rms_norm(x), x).
    weight: [dim] float32 (Gemma: its 1 + weight). Under torch.compile: the same kernel as an opaque op."""
    if torch.compiler.is_compiling():
        if residual is None:
            return torch.ops.ladle.fused_rms_norm(x, weight, eps), x
        return torch.ops.ladle.fused_add_rms_norm(x, residual, weight, eps)
    return _add_rms_norm(x, residual, weight, eps)


def _add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    shape, dim = x.shape, x.shape[-1]
    _require(_cpu_f32(x, residual), "add_rms_norm", "x and residual must be float32 CPU tensors")
    _require(residual is None or residual.shape == shape, "add_rms_norm", "residual must have x's shape")
    _require(weight.device.type == "cpu" and weight.numel() == dim, "add_rms_norm", "weight must be [dim] on CPU")
    x2 = _rows(x)
    out = torch.empty(shape, dtype=torch.float32)
    total, r2 = x, None
    if residual is not None:
        r2 = _rows(residual)
        total = torch.empty(shape, dtype=torch.float32)
    weight = weight.float().contiguous()
    _check(_lib().ladle_add_rmsnorm(
        x2.data_ptr(), x2.stride(0), None if r2 is None else r2.data_ptr(), 0 if r2 is None else r2.stride(0),
        total.data_ptr(), dim, out.data_ptr(), dim, weight.data_ptr(), x2.shape[0], dim, eps,
        torch_lanes(), torch.get_num_threads(),
    ), "ladle_add_rmsnorm")
    return out, total


def gated_activation(gate_up: torch.Tensor, act: str) -> torch.Tensor:
    """act(gate) * up for gate_up = [..., 2 * width] (gate then up); act one of ACTIVATIONS."""
    if torch.compiler.is_compiling():
        return torch.ops.ladle.fused_gated_activation(gate_up, act)
    return _gated_activation(gate_up, act)


def _gated_activation(gate_up: torch.Tensor, act: str) -> torch.Tensor:
    _require(_cpu_f32(gate_up), "gated_activation", "gate_up must be a float32 CPU tensor")
    width = gate_up.shape[-1] // 2
    g2 = _rows(gate_up)
    out = torch.empty((*gate_up.shape[:-1], width), dtype=torch.float32)
    _check(_lib().ladle_gated_act(
        g2.data_ptr(), g2.stride(0), out.data_ptr(), width, g2.shape[0], width, ACTIVATIONS[act],
        torch.get_num_threads(),
    ), "ladle_gated_act")
    return out


def qk_norm_rope(
    qk: torch.Tensor, weight: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """RoPE(weight * rms_norm(qk)) per head (weight None: RoPE(qk)) for qk [T, H, D], weight [H, D]
    (Gemma: 1 + weight), cos / signed sin [T, 1, D] (ladle.models.layers.RotaryEmbedding); a new [T, H, D].
    D at most MAX_HEAD_DIM."""
    if torch.compiler.is_compiling():
        return torch.ops.ladle.fused_qk_norm_rope(qk, weight, eps, cos, sin)
    return _qk_norm_rope(qk, weight, eps, cos, sin)


def _qk_norm_rope(
    qk: torch.Tensor, weight: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    _require(_cpu_f32(qk, cos, sin) and qk.dim() == 3, "qk_norm_rope", "qk [T, H, D], cos, sin: float32 CPU")
    _require(weight is None or weight.device.type == "cpu", "qk_norm_rope", "weight must be on the CPU")
    t, heads, dim = qk.shape
    if qk.stride(-1) != 1:
        qk = qk.contiguous()
    cos, sin = cos.reshape(t, dim), sin.reshape(t, dim)
    cos = cos if cos.stride(-1) == 1 else cos.contiguous()
    sin = sin if sin.stride(-1) == 1 else sin.contiguous()
    if weight is not None:
        weight = weight.float().expand(heads, dim).contiguous()
    out = torch.empty((t, heads, dim), dtype=torch.float32)
    _check(_lib().ladle_qk_norm_rope(
        qk.data_ptr(), qk.stride(0), qk.stride(1), out.data_ptr(),
        None if weight is None else weight.data_ptr(), cos.data_ptr(), cos.stride(0), sin.data_ptr(),
        sin.stride(0), t, heads, dim, eps, torch_lanes(), torch.get_num_threads(),
    ), "ladle_qk_norm_rope")
    return out


# -- the same kernels as opaque ops for torch.compile ---------------------------------------------
# dynamo cannot trace a ctypes call; as custom ops the compiled forward runs the very kernels eager
# runs (bitwise eager's results, one pass each) instead of inductor's own code for the torch ops.
@torch.library.custom_op("ladle::fused_add_rms_norm", mutates_args=())
def _add_rms_norm_op(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return _add_rms_norm(x, residual, weight, eps)


@_add_rms_norm_op.register_fake
def _(x, residual, weight, eps):
    return x.new_empty(x.shape, dtype=torch.float32), x.new_empty(x.shape, dtype=torch.float32)


@torch.library.custom_op("ladle::fused_rms_norm", mutates_args=())
def _rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _add_rms_norm(x, None, weight, eps)[0]


@_rms_norm_op.register_fake
def _(x, weight, eps):
    return x.new_empty(x.shape, dtype=torch.float32)


@torch.library.custom_op("ladle::fused_gated_activation", mutates_args=())
def _gated_activation_op(gate_up: torch.Tensor, act: str) -> torch.Tensor:
    return _gated_activation(gate_up, act)


@_gated_activation_op.register_fake
def _(gate_up, act):
    return gate_up.new_empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2), dtype=torch.float32)


@torch.library.custom_op("ladle::fused_qk_norm_rope", mutates_args=())
def _qk_norm_rope_op(
    qk: torch.Tensor, weight: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    return _qk_norm_rope(qk, weight, eps, cos, sin)


@_qk_norm_rope_op.register_fake
def _(qk, weight, eps, cos, sin):
    return qk.new_empty(qk.shape, dtype=torch.float32)


def build_info() -> dict[str, object]:
    lib = load_library()
    if lib is None:
        return {"error": _state.get("error")}
    return {
        "isa": lib.ladle_fused_isa().decode(), "math": f"sleef x{lib.math_lanes}" if lib.math_lanes else "libm",
        "sum_lanes": torch_lanes(), "sum_order": _state.get("sum_order"), "build_seconds": _state.get("build_seconds"),
    }
