"""CPU attention op: the C++ paged kernel (cpu_paged) against the torch reference, alternated.

Decode batches (one query per sequence) at several contexts, and one prefill chunk at several
contexts, on a paged cache (block 16, blocks scattered), fp32, at 1 and 2 threads. Each case times
both backends in turn (the order rotates every repeat) and reports the median milliseconds per call
(the call includes writing the new keys/values into the cache, as in a forward), the speedup, and a
bound: decode against the bytes it must read (visible K/V) at the bandwidth measured here by a large
`torch.sum` at the same thread count, prefill against its attention FLOPs (4 x visible query-key pairs
x head dim x heads).

    .venv/bin/python benchmarks/attention_cpu.py [--quick] [--threads-list 1,2] [--heads 8 --kv-heads 2 --head-dim 64]
"""

from __future__ import annotations

import argparse
import statistics
import time

import benchutil as bu
import torch

from kernels import AttentionMetadata, reference_attention
from kernels.cpu_build import build_info
from kernels.cpu_paged import cpu_paged_attention

BLOCK = 16


def make_case(query_lens: list[int], contexts: list[int], heads: int, kv_heads: int, head_dim: int,
              gen: torch.Generator):
    seq_lens = [c + q for c, q in zip(contexts, query_lens)]
    blocks = [-(-s // BLOCK) for s in seq_lens]
    perm = torch.randperm(sum(blocks) + 1, generator=gen).tolist()
    tables, start = [], 0
    for n in blocks:
        tables.append(perm[start : start + n])
        start += n
    cache = torch.randn(2, len(perm), BLOCK, kv_heads, head_dim, generator=gen)
    t = sum(query_lens)
    q = torch.randn(t, heads, head_dim, generator=gen)
    k = torch.randn(t, kv_heads, head_dim, generator=gen)
    v = torch.randn(t, kv_heads, head_dim, generator=gen)
    return q, k, v, cache, (query_lens, seq_lens, tables)


def time_calls(fn, n: int) -> float:
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n * 1e3


def bandwidth_gbs(repeats: int = 5) -> float:
    x = torch.ones(64 * 2**20)  # 256 MB: far beyond the caches
    x.sum()
    best = min(time_calls(x.sum, 3) for _ in range(repeats))
    return x.numel() * 4 / best / 1e6


def run_case(kind: str, batch: int, query_len: int, context: int, args, gen, bw: float) -> list:
    q, k, v, cache, (qls, sls, tables) = make_case([query_len] * batch, [context] * batch, args.heads,
                                                    args.kv_heads, args.head_dim, gen)
    scale = args.head_dim**-0.5

    def call(backend):
        # A fresh metadata per call, as every forward builds one: the per-forward plans are included.
        meta = AttentionMetadata.build(qls, sls, tables, BLOCK)
        fn = reference_attention if backend == "torch" else cpu_paged_attention
        return fn(q, k, v, cache, meta, scale=scale)

    for backend in ("torch", "cpu_paged"):
        call(backend)
    # Aim at ~0.2 s per timing.
    once = max(time_calls(lambda: call("cpu_paged"), 1), time_calls(lambda: call("torch"), 1))
    n = max(1, min(200, int(0.2 * 1e3 / max(once, 1e-3))))
    times: dict[str, list[float]] = {"torch": [], "cpu_paged": []}
    for r in range(args.repeats):
        order = ("torch", "cpu_paged") if r % 2 == 0 else ("cpu_paged", "torch")
        for backend in order:
            times[backend].append(time_calls(lambda b=backend: call(b), n))
    ref_ms, ours_ms = statistics.median(times["torch"]), statistics.median(times["cpu_paged"])
    kv_bytes = batch * (context + query_len) * args.kv_heads * args.head_dim * 2 * 4
    pairs = batch * (query_len * context + query_len * (query_len + 1) // 2)
    gflop = 4 * pairs * args.heads * args.head_dim / 1e9
    bound = f"{kv_bytes / bw / 1e6:.2f} ms ({kv_bytes / 1e6:.0f} MB)" if kind == "decode" else ""
    return [kind, batch, query_len, context, round(ref_ms, 3), round(ours_ms, 3), f"{ref_ms / ours_ms:.2f}x",
            bound, f"{gflop / ours_ms * 1e3:.1f}"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads-list", default="1,2")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--decode-batches", default="1,32,256")
    p.add_argument("--decode-contexts", default="128,1024,4096")
    p.add_argument("--chunks", default="128,512")
    p.add_argument("--chunk-contexts", default="0,2048,8192")
    p.add_argument("--quick", action="store_true", help="smaller sizes, 3 repeats")
    args = p.parse_args()
    if args.quick:
        args.repeats, args.decode_batches, args.decode_contexts = 3, "1,32", "128,1024"
        args.chunks, args.chunk_contexts = "128", "0,2048"
    ints = lambda s: [int(x) for x in s.split(",")]
    info = build_info()
    print(f"kernel: {info}")
    print(f"heads {args.heads}, kv heads {args.kv_heads}, head dim {args.head_dim}, fp32, block {BLOCK}; "
          f"load average {bu.load_average()}")
    headers = ["kind", "batch", "query len", "context", "torch ms", "cpu_paged ms", "speedup",
               "bytes bound", "cpu_paged GFLOP/s"]
    for threads in ints(args.threads_list):
        torch.set_num_threads(threads)
        bw = bandwidth_gbs()
        gen = torch.Generator().manual_seed(0)
        rows = []
        for ctx in ints(args.decode_contexts):
            for batch in ints(args.decode_batches):
                rows.append(run_case("decode", batch, 1, ctx, args, gen, bw))
                print(rows[-1], flush=True)
        for ctx in ints(args.chunk_contexts):
            for chunk in ints(args.chunks):
                rows.append(run_case("prefill", 1, chunk, ctx, args, gen, bw))
                print(rows[-1], flush=True)
        print(f"\n### {threads} thread(s); torch.sum bandwidth {bw:.1f} GB/s\n")
        print(bu.markdown_table(headers, rows))


if __name__ == "__main__":
    main()
