"""The ctypes mirrors of the C++ kernels' argument structs (kernels/csrc), and the check that they match.

A mirror must list its struct's fields in the same order with the same types. Each library exports its
structs' sizes and field offsets as text (csrc/layout.h); `check_layout` compares them with the mirrors'
when the library is loaded, so a struct changed on one side only is a clear error (and the kernel falls
back to torch) instead of a kernel reading fields at the wrong offsets.
"""

from __future__ import annotations

import ctypes
from itertools import zip_longest

_P, _I64, _I32, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_float


class Args(ctypes.Structure):
    """`struct Args` of csrc/paged_attention.cpp: one paged attention call."""

    _fields_ = [
        ("q", _P), ("q_stride_t", _I64), ("q_stride_h", _I64),
        ("out", _P), ("k_cache", _P), ("v_cache", _P),
        ("k_new", _P), ("v_new", _P),
        ("k_stride_t", _I64), ("k_stride_h", _I64),
        ("v_stride_t", _I64), ("v_stride_h", _I64),
        ("slot_mapping", _P), ("query_start_loc", _P),
        ("seq_lens", _P), ("block_tables", _P), ("bt_stride", _I64),
        ("num_seqs", _I32), ("num_tokens", _I32), ("num_heads", _I32),
        ("num_kv_heads", _I32), ("head_dim", _I32), ("block_size", _I32),
        ("q_dtype", _I32), ("kv_dtype", _I32), ("window", _I32),
        ("scale", _F), ("softcap", _F),
        ("num_threads", _I32), ("positions_per_item", _I32),
        ("kv_stride_block", _I64), ("kv_stride_token", _I64), ("kv_stride_head", _I64),
    ]


class StackOps(ctypes.Structure):
    """`struct StackOps` of csrc/layers.cpp: the kernels' entry points."""

    _fields_ = [("add_rmsnorm", _P), ("gemm", _P), ("gemm_gated", _P), ("qk_norm_rope", _P), ("attention", _P)]


class StackLinear(ctypes.Structure):
    """`struct StackLinear`: a packed weight (kernels/cpu_gemm.PackedWeight)."""

    _fields_ = [("packed", _P), ("n", _I32), ("k", _I32), ("kb", _I32)]


class StackLayer(ctypes.Structure):
    """`struct StackLayer`: one layer's weights and KV cache planes."""

    _fields_ = [
        ("input_norm", _P), ("post_norm", _P), ("qk_norm", _P),
        ("qkv", StackLinear), ("o", StackLinear), ("gate_up", StackLinear), ("down", StackLinear),
        ("k_cache", _P), ("v_cache", _P),
    ]


class StackStep(ctypes.Structure):
    """`struct StackStep`: the forward's rows, sizes and buffers."""

    _fields_ = [
        ("rows", _I64),
        ("hidden", _I32), ("q_heads", _I32), ("kv_heads", _I32), ("head_dim", _I32), ("act", _I32),
        ("lanes", _I32), ("threads", _I32),
        ("eps", _F), ("qk_eps", _F),
        ("cos", _P), ("sin", _P), ("cos_row", _I64), ("sin_row", _I64),
        ("input", _P), ("x", _P), ("residual", _P),
        ("h", _P), ("qkv", _P), ("qk", _P), ("attn", _P), ("o", _P), ("gate_up", _P),
        ("attention_args", _P), ("args_k_cache", _P), ("args_v_cache", _P),
    ]


# library's layout symbol -> its C++ struct names and their mirrors, in the order the library lists them
PAGED_LAYOUT = {"Args": Args}
STACK_LAYOUT = {"StackOps": StackOps, "StackLinear": StackLinear, "StackLayer": StackLayer, "StackStep": StackStep}


def layout_text(mirrors: dict[str, type[ctypes.Structure]]) -> str:
    """The mirrors' layout in the library's format: "Struct=size Struct.field=offset ..."."""
    parts = []
    for name, struct in mirrors.items():
        parts.append(f"{name}={ctypes.sizeof(struct)}")
        parts += [f"{name}.{field[0]}={getattr(struct, field[0]).offset}" for field in struct._fields_]
    return " ".join(parts)


def check_layout(lib: ctypes.CDLL, symbol: str, mirrors: dict[str, type[ctypes.Structure]]) -> None:
    """Raise RuntimeError naming the first differences when `lib`'s structs (its `symbol()` text) and the
    ctypes mirrors disagree on a size, a field's name or its offset."""
    export = getattr(lib, symbol)
    export.argtypes, export.restype = [], ctypes.c_char_p
    native, mirror = export().decode().split(), layout_text(mirrors).split()
    if native != mirror:
        diff = [f"C++ {a or '(none)'} vs ctypes {b or '(none)'}" for a, b in zip_longest(native, mirror) if a != b]
        raise RuntimeError(
            f"{symbol}: the C++ structs and their ctypes mirrors in kernels/cpu_structs.py differ ({'; '.join(diff[:3])}); "
            "make both list the same fields, with the same types, in the same order")
