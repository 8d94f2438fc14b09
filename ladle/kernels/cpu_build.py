"""Build the C++ CPU kernels (kernels/csrc) once per machine and source, and load them with ctypes.

The kernel is plain C++ (no torch headers, no pybind, no ninja), so a build is one compiler call of
about 4 s, and needs only a C++17 compiler (g++ or clang++; `CXX` picks another), with OpenMP for more
than one thread. With GCC it links the OpenMP runtime by its soname, `libgomp.so.1`, which torch's
wheel has already loaded: one runtime, one thread pool. The shared library is cached under `LADLE_KERNEL_CACHE` (default
`~/.cache/ladle/kernels`) by a hash of the source files (the .cpp and every header of kernels/csrc it
includes), the compiler, its flags and the CPU's feature flags (it is built with -march=native), written to a temporary name and renamed, so concurrent first uses
never load a half-written file. If anything fails, `load_library()` returns None, `build_error()` says
why, and one warning is logged: the dispatcher then uses the torch reference attention.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from ladle.kernels.cpu_structs import PAGED_LAYOUT, check_layout

log = logging.getLogger("ladle.kernels")

CSRC = Path(__file__).resolve().parent / "csrc"  # the kernels' sources, shipped in the package
PAGED_SOURCE = CSRC / "paged_attention.cpp"
_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)

# Keys per tile. Part of the numerical contract: outputs are bitwise reproducible only between builds
# with the same tile (and the same instruction set). LADLE_ATTENTION_TILE is for experiments only.
TILE = int(os.environ.get("LADLE_ATTENTION_TILE", "32"))
BASE_FLAGS = ("-O3", "-std=c++17", "-fPIC", "-shared", "-ffp-contract=off")
# Tried in order. Without -march=native the portable path is built (same results where the CPU has
# FMA and the build uses it; without, a*b+c rounds twice); without OpenMP the kernel runs on one thread.
ARCH_FLAGS = (("-march=native", "-fopenmp"), ("-fopenmp",), ())

_lock = threading.Lock()
_state: dict[str, object] = {}
NO_COMPILER = "no C++ compiler found (set CXX, or install g++)"
_no_compiler_warned = threading.Event()


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() + platform.machine()


def cache_dir() -> Path:
    root = os.environ.get("LADLE_KERNEL_CACHE")
    if root:
        return Path(root)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ladle" / "kernels"


def source_files(source: Path) -> list[Path]:
    """`source` and every file it includes with quotes, transitively (found beside the includer, else in
    its -I directory, the source's own): what a build of it reads of ours, so what its cache key hashes."""
    seen: list[Path] = []
    todo = [source.resolve()]
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.append(path)
        for name in _INCLUDE.findall(path.read_text()):
            for folder in (path.parent, source.resolve().parent):
                if (folder / name).is_file():
                    todo.append((folder / name).resolve())
                    break
    return seen


def _compile(cxx: str, flags: list[str], out: Path, source: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=out.stem + ".", suffix=".tmp.so", dir=out.parent)
    os.close(fd)
    try:
        cmd = [cxx, *flags, f"-I{source.parent}", str(source), "-o", tmp]
        result = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=300)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{result.stderr[-2000:]}")
        os.replace(tmp, out)
    finally:
        Path(tmp).unlink(missing_ok=True)


def _open(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    lib.ladle_attention_isa.restype = ctypes.c_char_p
    lib.ladle_paged_attention.restype = ctypes.c_int
    lib.ladle_paged_attention.argtypes = [ctypes.c_void_p]
    check_layout(lib, "ladle_paged_layout", PAGED_LAYOUT)
    return lib


def build_library(arch_flags: tuple[str, ...] | list[str], directory: Path | None = None,
                  source: Path = PAGED_SOURCE) -> tuple[ctypes.CDLL, Path]:
    """Build (or reuse) the kernel with these architecture flags, and load it. The default build is
    `load_library()`'s; tests and benchmarks build others (e.g. -mno-avx512f: the AVX2 path; or another
    revision's source, to compare)."""
    path, seconds = compile_cached(source, "libladle_attention", [*arch_flags, f"-DLADLE_TILE={TILE}"], directory)
    if seconds is not None:
        _state["build_seconds"] = seconds
    return _open(path), path


def library_name(source: Path, stem: str, cxx: str, flags: list[str]) -> str:
    """The cached library's file name: `stem` and a hash of every source file the build reads (names and
    text), the compiler and its version, the flags and the CPU's feature flags."""
    version = subprocess.run([cxx, "--version"], check=False, capture_output=True, text=True).stdout
    texts = [f"{p.name}\0{p.read_text()}" for p in source_files(source)]
    key = hashlib.sha256("\0".join([*texts, cxx, version, *flags, _cpu_flags()]).encode()).hexdigest()
    return f"{stem}_{key[:20]}.so"


def compile_cached(
    source: Path, stem: str, flags: list[str], directory: Path | None = None
) -> tuple[Path, float | None]:
    """The shared library built from the C++ file `source` (with -I its folder) with BASE_FLAGS + flags,
    under `directory` (default cache_dir(); a private temporary directory when that is unwritable), keyed
    by the text of every source file it includes, compiler, flags and CPU; (its path, build seconds or
    None if cached). Shared by every C++ kernel library."""
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError(NO_COMPILER)
    flags = [*BASE_FLAGS, *flags]
    name = library_name(source, stem, cxx, flags)
    path = (directory or cache_dir()) / name
    if path.exists():
        return path, None
    start = time.perf_counter()
    log.info("building %s with %s %s", stem, cxx, " ".join(flags))
    try:
        _compile(cxx, flags, path, source)
    except OSError:  # an unwritable cache directory: build into a private temporary one instead
        path = Path(tempfile.mkdtemp(prefix="ladle-kernels-")) / name
        _compile(cxx, flags, path, source)
    seconds = time.perf_counter() - start
    log.info("built %s in %.1f s", path, seconds)
    return path, seconds


def build_first(source: Path, stem: str, open_library: Callable[[Path], ctypes.CDLL]) -> tuple[ctypes.CDLL | None, str | None]:
    """`source` built with the first of ARCH_FLAGS that compiles and loads (open_library(path) loads it and
    sets its signatures): (library, None), or (None, the last attempt's error)."""
    error = None
    for arch in ARCH_FLAGS:
        try:
            path, _ = compile_cached(source, stem, list(arch))
            return open_library(path), None
        except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
            error = f"{type(e).__name__}: {e}"
    return None, error


def report_unavailable(fallback: str, error: str) -> None:
    """Warn that a kernel library cannot be built and what runs instead. A missing compiler is one
    warning for all the libraries (one fix restores them all); the other libraries' fallbacks then log
    at INFO."""
    if NO_COMPILER not in error:
        log.warning("%s: %s", fallback, error)
    elif _no_compiler_warned.is_set():
        log.info("%s (%s)", fallback, NO_COMPILER)
    else:
        _no_compiler_warned.set()
        log.warning("%s: ladle's C++ CPU kernels are not built, torch's ops run instead (slower; "
                    "deterministic=true needs them); first: %s", NO_COMPILER, fallback)


def load_first(state: dict, lock: threading.Lock, source: Path, stem: str,
               open_library: Callable[[Path], ctypes.CDLL], unavailable: str) -> ctypes.CDLL | None:
    """`build_first` once per process, its library kept in state["lib"] (its error in state["error"]); when
    none builds, one warning, `unavailable` and the error, and None from then on."""
    with lock:
        if "lib" not in state:
            state["lib"], error = build_first(source, stem, open_library)
            if state["lib"] is None:
                state["error"] = error
                report_unavailable(unavailable, error or "")
        return state["lib"]  # type: ignore[return-value]


def _build() -> ctypes.CDLL:
    errors = []
    for arch in ARCH_FLAGS:
        try:
            lib, _state["path"] = build_library(arch)
            return lib
        except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
            errors.append(str(e))
    raise RuntimeError("\n".join(errors))


def load_library() -> ctypes.CDLL | None:
    """The compiled kernel, built at first use; None (and one logged warning) when it cannot be."""
    with _lock:
        if "lib" not in _state:
            try:
                _state["lib"] = _build()
            except Exception as e:  # noqa: BLE001 - any failure means: fall back to torch
                _state["lib"] = None
                _state["error"] = f"{type(e).__name__}: {e}"
                report_unavailable("CPU paged attention kernel unavailable, using the torch reference attention "
                                   "(slower, not batch-invariant)", str(_state["error"]))
        return _state["lib"]  # type: ignore[return-value]


def build_error() -> str | None:
    return _state.get("error")  # type: ignore[return-value]


def build_info() -> dict[str, object]:
    """Where the loaded library is, its instruction set and tile, and the build time if built here."""
    lib = load_library()
    if lib is None:
        return {"error": build_error()}
    return {
        "path": str(_state["path"]), "isa": lib.ladle_attention_isa().decode(),
        "tile": lib.ladle_attention_tile(), "build_seconds": _state.get("build_seconds"),
    }
