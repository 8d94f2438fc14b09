"""The C++ kernels live in kernels/csrc: their builds are cached by every file they include, and each
library's structs are checked against their ctypes mirrors when it loads (a mismatch is a clear error and
the kernel falls back to torch, never a kernel reading fields at the wrong offsets)."""

from __future__ import annotations

import ctypes
import shutil

import pytest

from ladle.kernels import cpu_build, cpu_layers, cpu_structs
from ladle.kernels.cpu_build import CSRC, library_name, source_files
from ladle.kernels.cpu_structs import PAGED_LAYOUT, STACK_LAYOUT, check_layout, layout_text

if cpu_build.load_library() is None:
    pytest.skip(f"the C++ kernels do not build here: {cpu_build.build_error()}", allow_module_level=True)


def _swapped(struct: type[ctypes.Structure], a: str, b: str) -> type[ctypes.Structure]:
    """A copy of `struct` with fields a and b swapped: the mistake a mirror edited by hand can make."""
    fields = list(struct._fields_)
    i, j = (next(k for k, f in enumerate(fields) if f[0] == name) for name in (a, b))
    fields[i], fields[j] = fields[j], fields[i]
    return type(struct.__name__, (ctypes.Structure,), {"_fields_": fields})


def test_the_built_libraries_match_their_mirrors():
    check_layout(cpu_build.load_library(), "ladle_paged_layout", PAGED_LAYOUT)
    assert cpu_layers.load_library() is not None, cpu_layers._state.get("error")
    check_layout(cpu_layers.load_library(), "ladle_stack_layout", STACK_LAYOUT)
    assert layout_text(PAGED_LAYOUT).startswith(f"Args={ctypes.sizeof(cpu_structs.Args)} Args.q=0 ")


def test_a_wrong_mirror_is_a_clear_error_naming_the_field():
    wrong = {"Args": _swapped(cpu_structs.Args, "scale", "num_threads")}  # float and int32: same size
    with pytest.raises(RuntimeError, match=r"ladle_paged_layout: .*cpu_structs\.py .*C\+\+ Args\.scale=\d+ vs ctypes Args\.num_threads"):
        check_layout(cpu_build.load_library(), "ladle_paged_layout", wrong)
    missing = {"StackOps": cpu_structs.StackOps, "StackLinear": cpu_structs.StackLinear}
    with pytest.raises(RuntimeError, match=r"StackLayer=\d+ vs ctypes \(none\)"):
        check_layout(cpu_layers.load_library(), "ladle_stack_layout", missing)


def test_a_wrong_mirror_makes_the_kernel_fall_back(monkeypatch):
    monkeypatch.setattr(cpu_build, "PAGED_LAYOUT", {"Args": _swapped(cpu_structs.Args, "q_dtype", "kv_dtype")})
    monkeypatch.setattr(cpu_build, "_state", {})
    assert cpu_build.load_library() is None
    assert "Args.q_dtype" in cpu_build.build_error()
    wrong = _swapped(cpu_structs.StackStep, "hidden", "q_heads")
    monkeypatch.setattr(cpu_layers, "STACK_LAYOUT", {**STACK_LAYOUT, "StackStep": wrong})
    monkeypatch.setattr(cpu_layers, "_state", {})
    assert cpu_layers.load_library() is None
    assert "StackStep.hidden" in cpu_layers._state["error"]


def test_the_cache_key_hashes_every_included_file(tmp_path):
    shutil.copytree(CSRC, tmp_path, dirs_exist_ok=True)
    gemm = tmp_path / "gemm.cpp"
    assert {p.name for p in source_files(gemm)} == {"gemm.cpp", "gated_avx512.h"}
    cxx, flags = "c++", ["-O3"]
    before = library_name(gemm, "libx", cxx, flags)
    (tmp_path / "layers.cpp").write_text((tmp_path / "layers.cpp").read_text() + "\n// not included by gemm.cpp\n")
    assert library_name(gemm, "libx", cxx, flags) == before
    (tmp_path / "gated_avx512.h").write_text((tmp_path / "gated_avx512.h").read_text() + "\n// changed\n")
    assert library_name(gemm, "libx", cxx, flags) != before
