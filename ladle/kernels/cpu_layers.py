"""The CPU decoder-layer stack: a forward's layers run as one native call (C++ in kernels/csrc/layers.cpp).

Why: each kernel of a layer is fast, but between two of them the Python and torch glue of models/ (views,
splits, output allocations, argument checks) ran cold: on this project's shared vCPUs the first torch op
after a 30-100 ms kernel took ~70 us instead of ~1 us (its code and data evicted while the kernel ran;
the same after a Python busy loop or a sleep), ~1 ms per layer of a 512-token step, and at 2 threads
every such gap let the OpenMP worker fall asleep (a futex wake-up, ~30-50 us, per parallel region).
The stack calls the same kernels, through function pointers taken from their loaded libraries, with
the arguments their Python wrappers pass, in the order models/llama.LlamaDecoderLayer calls them: the
same bits (tests/models/test_cpu_stack.py compares logits with torch.equal).

It owns no policy: models/cpu_stack.py decides which layers may run here and builds the arguments.
"""

from __future__ import annotations

import ctypes
import os
import threading

from ladle.kernels.cpu_build import CSRC, load_first
from ladle.kernels.cpu_structs import STACK_LAYOUT, StackLayer, StackLinear, StackOps, StackStep, check_layout

# the structs a caller fills live with the other ctypes mirrors; they are part of this module's API
__all__ = ["STEP_NAMES", "StackLayer", "StackLinear", "StackOps", "StackStep", "enabled", "load_library", "ops",
           "run", "set_enabled"]

_P, _I32 = ctypes.c_void_p, ctypes.c_int32
_lock = threading.Lock()
_state: dict[str, object] = {}


STEP_NAMES = {1: "input norm", 2: "qkv projection", 3: "q/k norm and RoPE", 4: "attention", 5: "o projection",
              6: "post-attention norm", 7: "gate|up projection", 8: "gated down projection"}


def _open(path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    lib.ladle_stack_run.argtypes = [_P, _P, _P, _I32]
    lib.ladle_stack_run.restype = _I32
    check_layout(lib, "ladle_stack_layout", STACK_LAYOUT)
    return lib


def load_library() -> ctypes.CDLL | None:
    """The stack, built at first use; None when it cannot be (the layers then run one op at a time)."""
    return load_first(_state, _lock, CSRC / "layers.cpp", "libladle_layers", _open, "CPU layer stack unavailable, layers run op by op")


def enabled() -> bool:
    """Whether models may run their layers here: LADLE_CPU_STACK is not 0 (the switch for A/B runs and an
    escape hatch) and the library builds."""
    on = _state.get("enabled")
    if on is None:
        on = _state["enabled"] = os.environ.get("LADLE_CPU_STACK", "1") != "0" and load_library() is not None
    return on  # type: ignore[return-value]


def set_enabled(on: bool) -> None:
    """Switch the stack on or off for this process (tests and benchmarks compare both)."""
    _state["enabled"] = on and load_library() is not None


def _address(lib: ctypes.CDLL, name: str) -> int:
    return ctypes.cast(getattr(lib, name), ctypes.c_void_p).value


def ops(fused: ctypes.CDLL, gemm: ctypes.CDLL, attention: ctypes.CDLL) -> StackOps:
    """The kernels' entry points, from their loaded libraries (the ones their Python wrappers call)."""
    return StackOps(
        _address(fused, "ladle_add_rmsnorm"), _address(gemm, "ladle_gemm"), _address(gemm, "ladle_gemm_gated"),
        _address(fused, "ladle_qk_norm_rope"), _address(attention, "ladle_paged_attention"),
    )


def run(stack_ops: StackOps, step: StackStep, layers: ctypes.Array) -> None:
    """Run the layers; a kernel's refusal raises, naming the layer and the step."""
    code = load_library().ladle_stack_run(ctypes.byref(stack_ops), ctypes.byref(step), layers, len(layers))
    if code != 0:
        layer, what = divmod(code, 1000)
        raise RuntimeError(f"CPU layer stack: layer {layer - 1}'s {STEP_NAMES.get(what, what)} kernel "
                           f"rejected its arguments")
