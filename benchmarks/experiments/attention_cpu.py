"""CPU attention op: the C++ paged kernel (cpu_paged) against the torch reference, or against another
revision's kernel (--baseline), alternated.

Decode batches (one query per sequence) at several contexts, and one prefill chunk at several
contexts, on a paged cache (block 16, blocks scattered), fp32, at 1 and 2 threads. Each case times
both in turn (the order rotates every repeat) and reports the median (and best) milliseconds per call
(a call includes writing the new keys/values into the cache and building the step's metadata, as in a
forward), the speedup of the medians, and a bound: decode against the bytes it must read (visible K/V)
at the bandwidth measured here by a large `torch.sum` at the same thread count, prefill as GFLOP/s of
its attention FLOPs (4 x visible query-key pairs x head dim x heads).

--baseline REV builds kernels/csrc/paged_attention.cpp as of git revision REV (same compiler and flags) in
place of the torch reference, and says whether both kernels gave the same bits (or, when the revisions'
formulas differ, the largest absolute difference of their outputs). --workload is the shape
of vs_vllm.py's model (16 heads / 8 KV heads x 64) with its prefill chunks (512 queries at contexts 0,
512, 1536) and a 32-sequence decode. --clock cpu times the calling thread's CPU time (1 thread only:
less sensitive to other jobs on a shared machine than wall time).

    PYTHONPATH=benchmarks .venv/bin/python benchmarks/experiments/attention_cpu.py [--quick] [--threads-list 1,2] [--heads 8 --kv-heads 2 --head-dim 64]
    PYTHONPATH=benchmarks .venv/bin/python benchmarks/experiments/attention_cpu.py --workload --baseline HEAD~3 --threads-list 1 --clock cpu
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import benchutil as bu
import torch

from ladle.engine.kv_cache import layer_cache
from ladle.kernels import AttentionMetadata, cpu_paged, reference_attention
from ladle.kernels.cpu_build import ARCH_FLAGS, build_info, build_library, load_library

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


def time_calls(fn, n: int, clock=time.perf_counter) -> float:
    start = clock()
    for _ in range(n):
        fn()
    return (clock() - start) / n * 1e3


def bandwidth_gbs(repeats: int = 5) -> float:
    x = torch.ones(64 * 2**20)  # 256 MB: far beyond the caches
    x.sum()
    best = min(time_calls(x.sum, 3) for _ in range(repeats))
    return x.numel() * 4 / best / 1e6


def baseline_kernel(rev: str):
    """The kernel as of git revision `rev` (its kernels/csrc), built with the default build's flags, and
    whether it takes the cache's strides. Its Args must match today's mirror (checked when it loads)."""
    folder = Path(tempfile.mkdtemp(prefix="ladle-baseline-"))
    archive = subprocess.run(["git", "archive", rev, "ladle/kernels/csrc"], cwd=bu.REPO, check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive, check=True)
    source = folder / "ladle" / "kernels" / "csrc" / "paged_attention.cpp"
    return build_library(ARCH_FLAGS[0], source=source)[0], "kv_stride_block" in source.read_text()


def attention_fns(baseline) -> dict:
    """name -> (attention function, whether it reads the engine's cache layout): the reference or the
    baseline kernel, then the current kernel. A baseline that predates strided caches gets token-major."""
    current = load_library()

    def with_lib(lib):
        def fn(*args, **kw):
            cpu_paged.load_library = lambda: lib
            return cpu_paged.cpu_paged_attention(*args, **kw)
        return fn

    first = ("torch", (reference_attention, True)) if baseline is None else ("baseline", (with_lib(baseline[0]), baseline[1]))
    return dict([first, ("cpu_paged", (with_lib(current), True))])


def in_layout(cache: torch.Tensor, engine_layout: bool) -> torch.Tensor:
    """The same logical cache in the layout the engine allocates (head-major blocks on the CPU, engine/
    kv_cache.layer_cache), or as it is (token-major) for a kernel that reads only that."""
    if not engine_layout:
        return cache
    return layer_cache(tuple(cache.shape), cache.dtype, cache.device).copy_(cache)


def run_case(kind: str, batch: int, query_len: int, context: int, args, gen, bw: float, fns: dict) -> list:
    q, k, v, cache, (qls, sls, tables) = make_case([query_len] * batch, [context] * batch, args.heads,
                                                    args.kv_heads, args.head_dim, gen)
    scale = args.head_dim**-0.5
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter

    caches = {name: in_layout(cache, engine_layout) for name, (_, engine_layout) in fns.items()}

    def call(name):
        # A fresh metadata per call, as every forward builds one: the per-forward plans are included.
        meta = AttentionMetadata.build(qls, sls, tables, BLOCK)
        return fns[name][0](q, k, v, caches[name], meta, scale=scale)

    names = list(fns)
    outs = {name: call(name) for name in names}
    a, b = outs.values()
    # The score formula may differ between revisions: then the bits differ, by rounding only.
    same = "yes" if torch.equal(a, b) else f"differs (max abs {(a - b).abs().max().item():.1e})"
    # Aim at ~0.2 s per timing.
    once = max(time_calls(lambda n=name: call(n), 1) for name in names)
    n = args.calls or max(1, min(200, int(0.2 * 1e3 / max(once, 1e-3))))
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(args.repeats):
        for name in names if r % 2 == 0 else names[::-1]:
            times[name].append(time_calls(lambda m=name: call(m), n, clock))
    ref_ms, ours_ms = statistics.median(times[names[0]]), statistics.median(times["cpu_paged"])
    best, ref_best = min(times["cpu_paged"]), min(times[names[0]])
    kv_bytes = batch * (context + query_len) * args.kv_heads * args.head_dim * 2 * 4
    pairs = batch * (query_len * context + query_len * (query_len + 1) // 2)
    gflop = 4 * pairs * args.heads * args.head_dim / 1e9
    bound = f"{kv_bytes / bw / 1e6:.2f} ms ({kv_bytes / 1e6:.0f} MB)" if kind == "decode" else ""
    row = [kind, batch, query_len, context, f"{ref_ms:.3g} ({ref_best:.3g})", f"{ours_ms:.3g} ({best:.3g})",
           f"{ref_ms / ours_ms:.2f}x ({ref_best / best:.2f}x)", bound]
    if names[0] == "baseline":
        row += [f"{gflop / ref_ms * 1e3:.1f}", f"{gflop / ours_ms * 1e3:.1f}", same]
    else:
        row += [f"{gflop / ours_ms * 1e3:.1f}"]
    return row


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
    p.add_argument("--workload", action="store_true",
                   help="vs_vllm.py's model's shapes: 16/8 heads x 64, chunks of 512 at 0/512/1536, decode 32 x 1024")
    p.add_argument("--baseline", metavar="REV", help="compare with the kernel of this git revision, not torch")
    p.add_argument("--clock", choices=["wall", "cpu"], default="wall")
    p.add_argument("--calls", type=int, default=0,
                   help="calls per timing (default: ~0.2 s worth); 1 with many --repeats makes the best a single call's")
    args = p.parse_args()
    if args.quick:
        args.repeats, args.decode_batches, args.decode_contexts = 3, "1,32", "128,1024"
        args.chunks, args.chunk_contexts = "128", "0,2048"
    if args.workload:
        args.heads, args.kv_heads, args.head_dim = 16, 8, 64
        args.decode_batches, args.decode_contexts, args.chunks, args.chunk_contexts = "32", "1024", "512", "0,512,1536"
    ints = lambda s: [int(x) for x in s.split(",")]
    if args.clock == "cpu" and ints(args.threads_list) != [1]:
        p.error("--clock cpu times one thread: use it with --threads-list 1")
    fns = attention_fns(baseline_kernel(args.baseline) if args.baseline else None)
    first = next(iter(fns))
    print(f"kernel: {build_info()}")
    print(f"heads {args.heads}, kv heads {args.kv_heads}, head dim {args.head_dim}, fp32, block {BLOCK}; "
          f"{args.clock} clock; load average {bu.load_average()}")
    headers = ["kind", "batch", "query len", "context", f"{first} ms (best)", "cpu_paged ms (best)",
               "speedup (of the bests)", "bytes bound"]
    headers += [f"{first} GFLOP/s", "cpu_paged GFLOP/s", "same bits"] if first == "baseline" else ["cpu_paged GFLOP/s"]
    for threads in ints(args.threads_list):
        torch.set_num_threads(threads)
        bw = bandwidth_gbs()
        gen = torch.Generator().manual_seed(0)
        rows = []
        for ctx in ints(args.decode_contexts):
            for batch in ints(args.decode_batches):
                rows.append(run_case("decode", batch, 1, ctx, args, gen, bw, fns))
                print(rows[-1], flush=True)
        for ctx in ints(args.chunk_contexts):
            for chunk in ints(args.chunks):
                rows.append(run_case("prefill", 1, chunk, ctx, args, gen, bw, fns))
                print(rows[-1], flush=True)
        print(f"\n### {threads} thread(s); torch.sum bandwidth {bw:.1f} GB/s\n")
        print(bu.markdown_table(headers, rows))


if __name__ == "__main__":
    main()
