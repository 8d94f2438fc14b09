"""Every linear layer of one forward of the 166M Qwen3, oneDNN's packed inner product vs kernels/cpu_gemm.

The model's projections (8 layers of qkv, o, gate_up, down, then the LM head: 531 MB of fp32 weights,
each layer its own random weights, so they come from DRAM as in a real forward) run once per
measurement at M rows, through oneDNN on weights reordered once (models/linear.pack_weight) and through
the ladle kernel (kernels/cpu_gemm.pack); the two alternate within every repeat, best of `--repeats`.
1 thread: process clock; more: wall clock. Before timing, every shape's output is checked bitwise
equal between the two at each M.

    PYTHONPATH=.:benchmarks .venv/bin/python benchmarks/experiments/gemm_stream.py [--threads 1,2] [--rows 1,2,4,8,16,32,64,128,512]
"""

from __future__ import annotations

import argparse
import time

import benchutil as bu
import torch

from ladle.kernels import cpu_gemm
from ladle.models.linear import pack_weight, packed_linear

HIDDEN, INTER, QKV, LAYERS, VOCAB = 1024, 3072, (16 + 2 * 8) * 64, 8, 32000


def weights(gen: torch.Generator) -> list[torch.Tensor]:
    shapes = [(QKV, HIDDEN), (HIDDEN, HIDDEN), (2 * INTER, HIDDEN), (HIDDEN, INTER)] * LAYERS + [(VOCAB, HIDDEN)]
    return [torch.randn(n, k, generator=gen) * 0.02 for n, k in shapes]


def onednn_run(packed: list[torch.Tensor], xs: list[torch.Tensor]) -> list[torch.Tensor]:
    # The layers' own oneDNN path (one row padded to two, row counts bucketed: models/linear.py).
    return [packed_linear(x, p, None) for p, x in zip(packed, xs)]


def ladle_run(packed: list[cpu_gemm.PackedWeight], xs: list[torch.Tensor]) -> list[torch.Tensor]:
    return [cpu_gemm.gemm(x, p) for p, x in zip(packed, xs)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", default="1,2")
    p.add_argument("--rows", default="1,2,4,8,16,32,64,128,512")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    if not cpu_gemm.available():
        raise SystemExit("kernels/cpu_gemm is not available on this machine (it needs AVX-512)")
    gen = torch.Generator().manual_seed(0)
    ws = weights(gen)
    dnn = [pack_weight(w) for w in ws]
    ours = [cpu_gemm.pack(w) for w in ws]
    flop_per_row = 2 * sum(w.numel() for w in ws)
    rows_out = []
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        clock = time.process_time if threads == 1 else time.perf_counter
        for m in [int(r) for r in args.rows.split(",")]:
            xs = [torch.randn(m, w.shape[1], generator=gen) for w in ws]
            same = all(torch.equal(a, b) for a, b in zip(onednn_run(dnn, xs), ladle_run(ours, xs)))
            best = {"onednn": float("inf"), "ladle": float("inf")}
            for rep in range(args.repeats):
                order = [("onednn", onednn_run, dnn), ("ladle", ladle_run, ours)]
                for name, run, packed in order if rep % 2 == 0 else order[::-1]:
                    start = clock()
                    run(packed, xs)
                    best[name] = min(best[name], clock() - start)
            rows_out.append([str(threads), str(m), f"{best['onednn'] * 1e3:.1f}", f"{best['ladle'] * 1e3:.1f}",
                             f"{best['onednn'] / best['ladle']:.2f}x",
                             f"{flop_per_row * m / best['ladle'] / 1e9:.0f}", "yes" if same else "NO"])
            print(" | ".join(rows_out[-1]), flush=True)
    machine = bu.machine_info()
    print(f"\n{machine['cpu']}, {machine['cores']} cores, torch {machine['torch']}; load average {bu.load_average()}")
    print(bu.markdown_table(["threads", "rows", "oneDNN ms", "ladle ms", "ladle speed-up", "ladle GFLOP/s",
                             "bitwise equal"], rows_out))


if __name__ == "__main__":
    main()
