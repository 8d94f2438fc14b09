"""CPU linear layers: which GEMM, how fast, and does a row's result depend on the batch?

Three parts (speed, and batch invariance), fp32, torch threads fixed per measurement:

- peak: a 4096^3 matmul through MKL (torch.mm) and through oneDNN on a packed weight, the practical
  peak every GFLOP/s below is read against.
- speed: the projections of two Qwen3 shapes (qkv, o, gate_up, down, LM head) at row counts M, through
  each candidate: F.linear (MKL sgemm), torch.mm on a pre-transposed weight, MKL's packed GEMM
  (mkl::_mkl_linear on a weight packed for exactly M), oneDNN with the weight reordered on every call,
  oneDNN on a weight packed once, ladle's ladle.models.linear.Linear (the packed oneDNN path plus its one-row
  padding) and the fixed-row-tile alternative (packed oneDNN called on 64-row tiles, the last one
  padded). Threads alternate 1/2 and candidates rotate inside every repeat; medians are reported.
- forward: a whole forward (+ LM head on the sampling rows) of the 166M Qwen3 (8 layers, untied, random
  weights) on a prefill, a mixed and two decode steps, with every linear layer on F.linear, on the packed
  path (the default), and packed with `set_deterministic(True)`; alternated, medians.
- invariance: for each distinct weight shape, one fixed row is placed at a random position among
  random rows for every M in a range; each M's output for that row is compared bitwise with the others.
  Results that are bitwise equal share a class letter (across thread counts too).

    PYTHONPATH=.:benchmarks .venv/bin/python benchmarks/experiments/linear_cpu.py [--quick] [--parts peak,speed,forward,invariance]
        [--out FILE]
"""

from __future__ import annotations

import argparse
import statistics
import string
import sys
import time
from collections.abc import Callable
from pathlib import Path

import benchutil as bu
import torch
import torch.nn.functional as F

from ladle.models.linear import Linear, pack_weight, packed_linear

MODELS = {  # (hidden, intermediate, q heads, kv heads, head dim, vocab)
    "qwen3-166m": (1024, 3072, 16, 8, 64, 32000),
    "qwen3-0.6b": (1024, 3072, 16, 8, 128, 151936),
}
TILE = 64


def shapes(model: str) -> list[tuple[str, int, int]]:
    """(name, out N, in K) of each projection."""
    h, inter, hq, hkv, d, vocab = MODELS[model]
    return [
        ("qkv", (hq + 2 * hkv) * d, h),
        ("o", h, hq * d),
        ("gate_up", 2 * inter, h),
        ("down", h, inter),
        ("lm_head", vocab, h),
    ]


def tiled(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """Packed oneDNN on fixed TILE-row tiles, the last one padded: the row-count-proof alternative."""
    m = x.shape[0]
    pad = -m % TILE
    if pad:
        x = torch.cat((x, x.new_zeros(pad, x.shape[1])))
    return torch.cat([packed_linear(t, packed, None) for t in x.split(TILE)])[:m]


def candidates(w: torch.Tensor, m: int) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    wt = w.t().contiguous()
    packed = pack_weight(w)
    mkl = torch.ops.mkl._mkl_reorder_linear_weight(w, m)
    layer = Linear(w.shape[1], w.shape[0])
    layer.requires_grad_(False)
    layer.weight.copy_(w)
    layer.derive_weights()
    return {
        "F.linear (MKL)": lambda x: F.linear(x, w),
        "mm(x, W^T)": lambda x: torch.mm(x, wt),
        "MKL packed for M": lambda x: torch.ops.mkl._mkl_linear(x, mkl, w, None, m),
        "oneDNN reorder/call": lambda x: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""),
        "oneDNN packed": lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""),
        "ladle Linear": layer,
        f"oneDNN packed, {TILE}-row tiles": lambda x: tiled(x, packed),
    }


def time_call(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, min_time: float) -> float:
    fn(x)
    n, start = 0, time.perf_counter()
    while True:
        fn(x)
        n += 1
        elapsed = time.perf_counter() - start
        if elapsed >= min_time and n >= 2:
            return elapsed / n


def measure_peak(threads: list[int], repeats: int, size: int) -> list[list]:
    a, b = torch.randn(size, size), torch.randn(size, size)
    packed = pack_weight(b)
    fns = {"torch.mm (MKL)": lambda x: torch.mm(x, b),
           "oneDNN packed": lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")}
    times: dict[tuple[str, int], list[float]] = {}
    for r in range(repeats):
        for th in threads[r % len(threads):] + threads[: r % len(threads)]:
            torch.set_num_threads(th)
            for name, fn in fns.items():
                times.setdefault((name, th), []).append(time_call(fn, a, 0.2))
    flop = 2 * size**3
    # The best repeat, not the median: a practical peak is what the machine reaches when left alone.
    return [[name, th, round(flop / min(ts) / 1e9, 1)] for (name, th), ts in times.items()]


def measure_speed(model: str, rows: list[int], threads: list[int], repeats: int, min_time: float,
                  lm_max_rows: int, peak: dict[int, float]) -> str:
    gen = torch.Generator().manual_seed(0)
    out = []
    for name, n, k in shapes(model):
        w = torch.randn(n, k, generator=gen) * 0.02
        for m in rows:
            if name == "lm_head" and m > lm_max_rows:
                continue
            fns = candidates(w, m)
            x = torch.randn(m, k, generator=gen)
            times: dict[tuple[str, int], list[float]] = {}
            names = list(fns)
            with torch.inference_mode():
                for r in range(repeats):
                    for th in threads[r % len(threads):] + threads[: r % len(threads)]:
                        torch.set_num_threads(th)
                        for c in names[r % len(names):] + names[: r % len(names)]:
                            times.setdefault((c, th), []).append(time_call(fns[c], x, min_time))
            flop = 2 * m * n * k
            for th in threads:
                gf = {c: flop / statistics.median(times[(c, th)]) / 1e9 for c in names}
                best = max(gf.values())
                row = [f"{name} {n}x{k}", m, th]
                row += [f"{gf[c]:.0f}" + ("*" if gf[c] == best else "") for c in names]
                row += [f"{gf['ladle Linear'] / gf['F.linear (MKL)']:.2f}x",
                        f"{gf['ladle Linear'] / peak[th]:.0%}"]
                out.append(row)
            print(f"  {model} {name} M={m} done", file=sys.stderr, flush=True)
    headers = ["shape (N x K)", "M", "threads", *names, "ladle / F.linear", "ladle / peak"]
    return bu.markdown_table(headers, out)


def forward_steps(model) -> dict[str, Callable[[object], torch.Tensor]]:
    """Forwards (+ LM head on each sequence's last row) of a prefill, a mixed and two decode steps."""
    from ladle.engine.kv_cache import layer_cache
    from ladle.kernels import AttentionMetadata

    a, block = model.arch, 16

    def step(seqs: list[tuple[int, int]]) -> Callable[[object], torch.Tensor]:  # (new tokens, context)
        per_seq = max(-(-(c + q) // block) for q, c in seqs)
        shape = (2, per_seq * len(seqs) + 1, block, a.num_kv_heads, a.head_dim)
        caches = [layer_cache(shape, torch.float32, torch.device("cpu")) for _ in range(a.num_layers)]  # the engine's layout
        tables = [list(range(1 + i * per_seq, 1 + (i + 1) * per_seq)) for i in range(len(seqs))]
        meta = AttentionMetadata.build([q for q, _ in seqs], [q + c for q, c in seqs], tables, block)
        ids = torch.randint(3, a.vocab_size, (sum(q for q, _ in seqs),))
        positions = torch.cat([torch.arange(c, c + q) for q, c in seqs])
        last = torch.tensor([q for q, _ in seqs]).cumsum(0) - 1

        def run(_: object = None) -> torch.Tensor:
            with torch.inference_mode():
                return model.compute_logits(model(ids, positions, caches, meta)[last])

        return run

    return {  # callables of one ignored argument, as time_call calls them
        "prefill 512": step([(512, 0)]),
        "mixed: 32 decodes + 480 chunk": step([(1, 256)] * 32 + [(480, 0)]),
        "decode 32 (ctx 256)": step([(1, 256)] * 32),
        "decode 1 (ctx 256)": step([(1, 256)]),
    }


def measure_forward(threads: list[int], repeats: int) -> str:
    from ladle.models import load_model
    from ladle.models.linear import Linear

    bu.quiet_random_weights()
    arch = bu.qwen3_architecture(num_hidden_layers=8, head_dim=64, vocab_size=32000, tie_word_embeddings=False)
    model = load_model(None, arch, torch.float32, "cpu", seed=0)
    linears = [m for m in model.modules() if isinstance(m, Linear)]

    def mode(name: str) -> None:
        model.set_deterministic(False)
        for m in linears:
            m.use_packed = name != "F.linear"
        if name == "packed, deterministic":
            model.set_deterministic(True)

    modes = ["F.linear", "packed", "packed, deterministic"]
    steps = forward_steps(model)
    times: dict[tuple[str, str, int], list[float]] = {}
    for r in range(repeats):
        for th in threads[r % len(threads):] + threads[: r % len(threads)]:
            torch.set_num_threads(th)
            for name in modes[r % 3:] + modes[: r % 3]:
                mode(name)
                for step, fn in steps.items():
                    times.setdefault((step, name, th), []).append(time_call(fn, None, 0.2))
    rows = []
    for step in steps:
        for th in threads:
            ms = {name: statistics.median(times[(step, name, th)]) * 1e3 for name in modes}
            rows.append([step, th, *(f"{ms[n]:.1f}" for n in modes),
                         f"{ms['F.linear'] / ms['packed']:.2f}x",
                         f"{ms['packed, deterministic'] / ms['packed'] - 1:+.1%}"])
        print(f"  forward {step} done", file=sys.stderr, flush=True)
    headers = ["step", "threads", *(f"{n} (ms)" for n in modes), "packed speed-up", "deterministic cost"]
    return f"{bu.describe_arch(arch)}\n\n" + bu.markdown_table(headers, rows)


def class_ranges(seq: list[tuple[int, int]]) -> str:
    """'1:A 2-1100:B' from (M, class) pairs in M order."""
    parts, start, prev, last = [], None, None, None
    for m, c in seq:
        if c != prev:
            if prev is not None:
                parts.append(f"{start}-{last}:{string.ascii_uppercase[prev % 26]}".replace(f"{start}-{start}:", f"{start}:"))
            start, prev = m, c
        last = m
    parts.append(f"{start}-{last}:{string.ascii_uppercase[prev % 26]}".replace(f"{start}-{start}:", f"{start}:"))
    return " ".join(parts)


@torch.inference_mode()
def invariance(n: int, k: int, rows: list[int], threads: list[int]) -> list[list]:
    gen = torch.Generator().manual_seed(n * 7 + k)
    w = torch.randn(n, k, generator=gen) * 0.02
    packed = pack_weight(w)
    layer = Linear(k, n)
    layer.weight.requires_grad_(False)
    layer.weight.copy_(w)
    layer.derive_weights()
    fns = {"F.linear (MKL)": lambda x: F.linear(x, w),
           "oneDNN packed": lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""),
           "ladle Linear": layer}
    row = torch.randn(1, k, generator=gen)
    out = []
    for name, fn in fns.items():
        classes: list[torch.Tensor] = []
        for th in threads:
            torch.set_num_threads(th)
            g = torch.Generator().manual_seed(1)
            seq = []
            for m in rows:
                x = torch.randn(m, k, generator=g)
                pos = int(torch.randint(m, (), generator=g))
                x[pos] = row[0]
                y = fn(x)[pos].clone()
                key = next((i for i, c in enumerate(classes) if torch.equal(c, y)), None)
                if key is None:
                    classes.append(y)
                    key = len(classes) - 1
                seq.append((m, key))
            verdict = "invariant" if len({c for _, c in seq}) == 1 else f"{len({c for _, c in seq})} classes"
            out.append([f"{n}x{k}", name, th, class_ranges(seq), verdict])
            print(f"  invariance {n}x{k} {name} threads {th}: {out[-1][3]}", file=sys.stderr, flush=True)
    return out


def parse_rows(spec: str) -> list[int]:
    rows: list[int] = []
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        rows += list(range(int(lo), int(hi or lo) + 1))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke-sized: fewer rows, repeats and shapes")
    p.add_argument("--parts", default="peak,speed,forward,invariance")
    p.add_argument("--models", default="qwen3-166m,qwen3-0.6b")
    p.add_argument("--threads-list", default="1,2")
    p.add_argument("--rows", default="1,8,32,64,128,256,512,1024")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--min-time", type=float, default=0.05, help="seconds per timing (>= 2 calls)")
    p.add_argument("--lm-max-rows", type=int, default=256, help="the LM head runs on sampling rows only")
    p.add_argument("--invariance-rows", default="1-1100", help="M values, e.g. 1-130,255-257")
    p.add_argument("--invariance-lm-rows", default="1-300")
    p.add_argument("--peak-size", type=int, default=4096)
    p.add_argument("--out", type=Path, help="also write the markdown here")
    args = p.parse_args()
    if args.quick:
        args.rows, args.repeats, args.min_time, args.peak_size = "1,8,64,512", 2, 0.02, 2048
        args.models, args.invariance_rows, args.invariance_lm_rows = "qwen3-166m", "1-40,64,129,513", "1-9,64"
    threads = [int(t) for t in args.threads_list.split(",")]
    parts = args.parts.split(",")
    md = [f"# CPU linear layers ({time.strftime('%Y-%m-%d %H:%M')})", "", bu.machine_markdown(),
          f"- Load average at start: {bu.load_average()}", ""]
    peak = {th: 1.0 for th in threads}
    if "peak" in parts or "speed" in parts:
        rows = measure_peak(threads, max(2, args.repeats // 2), args.peak_size)
        for _, th, gf in rows:
            peak[th] = max(peak[th], gf)
        md += [f"## Practical peak: {args.peak_size}^3 fp32 matmul, GFLOP/s (best repeat)", "",
               bu.markdown_table(["GEMM", "threads", "GFLOP/s"], rows), ""]
        print("\n".join(md[-4:]), flush=True)
    if "speed" in parts:
        for model in args.models.split(","):
            table = measure_speed(model, [int(r) for r in args.rows.split(",")], threads, args.repeats,
                                  args.min_time, args.lm_max_rows, peak)
            md += [f"## {model}: GFLOP/s by candidate (median of {args.repeats}; * = best)", "", table, ""]
            print("\n".join(md[-4:]), flush=True)
    if "forward" in parts:
        table = measure_forward(threads, args.repeats)
        md += [f"## Whole forward + LM head: milliseconds (median of {args.repeats})", "", table, ""]
        print("\n".join(md[-4:]), flush=True)
    if "invariance" in parts:
        distinct = {}
        for model in args.models.split(","):
            for name, n, k in shapes(model):
                distinct.setdefault((n, k), name)
        rows_out = []
        for (n, k), name in distinct.items():
            spec = args.invariance_lm_rows if name == "lm_head" else args.invariance_rows
            rows_out += invariance(n, k, parse_rows(spec), threads)
        md += ["## Batch invariance: a fixed row's output class by M (same letter = bitwise equal)", "",
               bu.markdown_table(["N x K", "GEMM", "threads", "class by M", "verdict"], rows_out), ""]
        print("\n".join(md[-4:]), flush=True)
    md.append(f"- Load average at end: {bu.load_average()}")
    if args.out:
        args.out.write_text("\n".join(md) + "\n")


if __name__ == "__main__":
    main()
