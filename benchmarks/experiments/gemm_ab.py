"""kernels/cpu_gemm of this tree against the same kernel from another checkout, weight shape by weight shape.

For a change to the GEMM's loops, where the whole vs_vllm workload moves by less than the host's drift
(+-3-5% over minutes): each of the 166M Qwen3's four decoder weight shapes (qkv 2048 x 1024, o 1024 x 1024,
gate_up 6144 x 1024, down 1024 x 3072 through the gated form) and any extra `--shapes`, at M rows, on
`--weights` distinct random weights per shape (6 x 25 MB of gate_up come from DRAM as in the engine; the
smaller shapes' 25-50 MB may partly stay in L3), each packed by its own kernel's entry point. Both kernels run
the same calls, alternated within every repeat; 1 thread on the thread's CPU clock, more on the wall.
Reports GFLOP/s, the median of the per-repeat speed ratios (this tree / the other) and whether the outputs
are bitwise equal.

    PYTHONPATH=.:benchmarks .venv/bin/python benchmarks/experiments/gemm_ab.py --before /tmp/before --threads 1,2 --rows 32,516
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from ladle.kernels import cpu_fused, cpu_gemm
from ladle.kernels.cpu_build import build_first

# (name, N, K, gated): the vs_vllm model's decoder weights (benchmarks/vs_vllm.py ARCH)
SHAPES = [("qkv", 2048, 1024, False), ("o", 1024, 1024, False), ("gate_up", 6144, 1024, False),
          ("down", 1024, 3072, True)]


def other_library(checkout: Path):
    """The other checkout's kernels/csrc/gemm.cpp, built under its own name and given the same math."""
    lib, error = build_first(checkout / "ladle" / "kernels" / "csrc" / "gemm.cpp", "libladle_gemm_ab_before",
                             cpu_gemm._open)
    if lib is None:
        raise SystemExit(f"the other checkout's kernel does not build: {error}")
    exp16, tanh16 = cpu_fused.sleef16()
    if not lib.ladle_gemm_set_math(exp16, tanh16):
        raise SystemExit("the other checkout's kernel did not take torch's SLEEF exp / tanh (its gated form)")
    return lib


def call(lib, x: torch.Tensor, w: cpu_gemm.PackedWeight, out: torch.Tensor, gated: bool) -> None:
    """One GEMM through kernels/cpu_gemm.gemm with build `lib`, into the shared buffer `out`."""
    cpu_gemm.gemm(x, w, "silu" if gated else None, out=out, lib=lib)


def measure(libs: dict, name: str, n: int, k: int, gated: bool, rows: int, threads: int, args) -> str:
    gen = torch.Generator().manual_seed(0)
    raw = [torch.randn(n, k, generator=gen) * 0.03 for _ in range(args.weights)]
    # each kernel packs its own copy: it reads the layout it packs (a change may alter it)
    packed = {label: [cpu_gemm.pack(w, lib=lib) for w in raw] for label, lib in libs.items()}
    xs = [torch.randn(rows, 2 * k if gated else k, generator=gen) for _ in range(args.weights)]
    # One output buffer for both, so the comparison does not also measure where two buffers' pages fall (the
    # stores are ~2% of a call; a first comparison with a buffer each reversed its sign when the builds swapped).
    out = torch.empty(rows, n)
    clock = time.thread_time if threads == 1 else time.perf_counter
    rates: dict[str, list[float]] = {label: [] for label in libs}
    results = {}
    for label, lib in libs.items():  # warm-up, and each kernel's outputs for the bitwise check
        results[label] = []
        for x, w in zip(xs, packed[label]):
            out.fill_(float("nan"))  # a kernel that left outputs unwritten cannot pass on the other's values
            call(lib, x, w, out, gated)
            results[label].append(out.clone())
    same = all(torch.equal(a, b) for a, b in zip(results["this"], results["before"]))
    for rep in range(args.repeats):
        for label in (list(libs) if rep % 2 == 0 else list(libs)[::-1]):
            t = clock()
            for x, w in zip(xs, packed[label]):
                call(libs[label], x, w, out, gated)
            rates[label].append(2 * rows * n * k * len(xs) / (clock() - t) / 1e9)
    ratio = statistics.median(a / b for a, b in zip(rates["this"], rates["before"]))
    return (f"| {threads} | {rows} | {name} {n} x {k} | {statistics.median(rates['before']):.1f} | "
            f"{statistics.median(rates['this']):.1f} | {ratio:.3f}x | {'yes' if same else 'NO'} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before", type=Path, required=True, help="the other checkout (its kernels/csrc/gemm.cpp)")
    p.add_argument("--threads", default="1")
    p.add_argument("--rows", default="516")
    p.add_argument("--repeats", type=int, default=12)
    p.add_argument("--weights", type=int, default=6, help="distinct weights per shape (default 6: the gate_up ones come from DRAM)")
    p.add_argument("--shapes", default="", help="extra N x K shapes, e.g. 2048x2048,1024x2048")
    args = p.parse_args()
    if not cpu_gemm.gated_available():
        raise SystemExit("kernels/cpu_gemm's gated form is not available here (it needs AVX-512 and torch's SLEEF)")
    libs = {"this": cpu_gemm.load_library(), "before": other_library(args.before)}
    shapes = list(SHAPES)
    for item in filter(None, args.shapes.split(",")):
        n, k = (int(v) for v in item.lower().split("x"))
        shapes.append(("extra", n, k, False))
    print("| threads | rows | weight | before GFLOP/s | this GFLOP/s | speed (median of per-repeat ratios) "
          "| bitwise equal |")
    print("|---|---|---|---|---|---|---|")
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        for rows in (int(r) for r in args.rows.split(",")):
            for name, n, k, gated in shapes:
                print(measure(libs, name, n, k, gated, rows, threads, args), flush=True)


if __name__ == "__main__":
    main()
