"""The vs_vllm workload at one thread, part by part, against this core's limits.

Runs benchmarks/vs_vllm.py's ladle workload (random Qwen3 166M, 32 prompts / ~12,000 prompt tokens x 32
greedy tokens, step budget 512, fp32, eager) at `--threads N` (default 1) in a worker process under the
CLI's start-up environment (runner/startup.py), every ctypes kernel call timed (the thread's CPU clock at 1
thread, wall time at more: each call is one parallel region) and its work counted:

- linear layers (kernels/cpu_gemm.gemm): 2 x rows x N x K FLOPs and the weight's N x K x 4 bytes (each call
  streams it), by weight shape and by row count;
- attention (kernels/cpu_paged): the prefill chunks' query-key pairs (causal) x 4 x head_dim x heads FLOPs, and
  the one-row queries' (decodes') visible K/V bytes; calls with prefill rows and calls of one-row queries only
  apart (the last layer keeps one row per sequence: its calls are all one-row queries, reading the whole
  context's K/V);
- the fused elementwise kernels (kernels/cpu_fused);
- the rest: the timed generate's time less all of these (Python, scheduling, sampling, torch ops).

Each part's floor is its work at these cores' limits (a linear call's: the larger of its FLOPs at the peak
and its weight's bytes at the bandwidth; an attention call's: its FLOPs at the peak plus its K/V bytes at the
bandwidth, the two being separate work items), measured in the same worker before the run: the FMA
peak by a register-only loop of independent fused multiply-adds (built like the kernels; N threads run it at
once), the DRAM read bandwidth by a torch.sum over 256 MB at N threads. A part's floor is a bound, not a target: attention's softmax and the
gated activation's exp are work the FLOP count leaves out. `--peer-seconds S` adds what a 1.2x lead over a
peer's S seconds would need.

    .venv/bin/python benchmarks/roofline.py [--threads 1] [--peer-seconds 28.6]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
import vs_vllm

TARGET = 1.2

# Independent FMA chains in registers: enough to cover the FMA latency on every x86 core with two pipes.
FMA_SOURCE = r"""
#include <cstdint>
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif
constexpr int CHAINS = 12;
extern "C" int64_t ladle_fma_flops_per_iter() {
#if defined(__AVX512F__)
  return int64_t(CHAINS) * 16 * 2;
#elif defined(__AVX2__) && defined(__FMA__)
  return int64_t(CHAINS) * 8 * 2;
#else
  return 0;
#endif
}
extern "C" float ladle_fma_loop(int64_t iters) {
#if defined(__AVX512F__)
  __m512 acc[CHAINS];
  const __m512 b = _mm512_set1_ps(0.999f), c = _mm512_set1_ps(1e-3f);
  for (int j = 0; j < CHAINS; ++j) acc[j] = _mm512_set1_ps(float(j));
  for (int64_t i = 0; i < iters; ++i)
    for (int j = 0; j < CHAINS; ++j) acc[j] = _mm512_fmadd_ps(acc[j], b, c);
  __m512 s = acc[0];
  for (int j = 1; j < CHAINS; ++j) s = _mm512_add_ps(s, acc[j]);
  return _mm512_reduce_add_ps(s);
#elif defined(__AVX2__) && defined(__FMA__)
  __m256 acc[CHAINS];
  const __m256 b = _mm256_set1_ps(0.999f), c = _mm256_set1_ps(1e-3f);
  for (int j = 0; j < CHAINS; ++j) acc[j] = _mm256_set1_ps(float(j));
  for (int64_t i = 0; i < iters; ++i)
    for (int j = 0; j < CHAINS; ++j) acc[j] = _mm256_fmadd_ps(acc[j], b, c);
  float out[8], s = 0.0f;
  for (int j = 1; j < CHAINS; ++j) acc[0] = _mm256_add_ps(acc[0], acc[j]);
  _mm256_storeu_ps(out, acc[0]);
  for (float v : out) s += v;
  return s;
#else
  (void)iters;
  return 0.0f;
#endif
}
"""


def fma_peak_gflops(threads: int = 1, repeats: int = 5) -> float:
    """The fp32 FMA peak of `threads` cores together (GFLOP/s: at 1 the thread's CPU clock, else wall time, the
    loop run by that many threads at once: ctypes releases the GIL), or 0.0 where there is no FMA unit to use."""
    from kernels.cpu_build import ARCH_FLAGS, compile_cached

    path, _ = compile_cached(FMA_SOURCE, "libladle_fma_peak", list(ARCH_FLAGS[0]))
    lib = ctypes.CDLL(str(path))
    lib.ladle_fma_loop.argtypes = [ctypes.c_int64]
    lib.ladle_fma_loop.restype = ctypes.c_float
    lib.ladle_fma_flops_per_iter.restype = ctypes.c_int64
    per_iter = lib.ladle_fma_flops_per_iter()
    if per_iter == 0:
        return 0.0
    iters = 20_000_000
    clock = time.thread_time if threads == 1 else time.perf_counter
    best = float("inf")
    for _ in range(repeats):
        workers = [threading.Thread(target=lib.ladle_fma_loop, args=(iters,)) for _ in range(threads - 1)]
        t = clock()
        for w in workers:
            w.start()
        lib.ladle_fma_loop(iters)
        for w in workers:
            w.join()
        best = min(best, clock() - t)
    return threads * per_iter * iters / best / 1e9


def read_bandwidth_gbs(repeats: int = 5) -> float:
    """DRAM read bandwidth at torch's thread count (GB/s): a torch.sum over 256 MB, best of `repeats`."""
    import torch

    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    x = torch.ones(64 * 2**20)
    x.sum()
    best = float("inf")
    for _ in range(repeats):
        t = clock()
        x.sum()
        best = min(best, clock() - t)
    return x.numel() * 4 / best / 1e9


def row_bucket(m: int) -> str:
    return "1-8" if m <= 8 else "9-32" if m <= 32 else "33-128" if m <= 128 else "129+"


class Counters:
    """CPU seconds and work of the wrapped kernels' calls."""

    def __init__(self, clock=time.thread_time, peak_gflops: float = 0.0, bandwidth_gbs: float = 0.0) -> None:
        self.clock = clock  # the thread's CPU time at 1 thread; wall time at more
        self.peak, self.bandwidth = peak_gflops * 1e9, bandwidth_gbs * 1e9  # per second; 0: no floors
        self.gemm: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0, 0.0])  # calls, s, FLOPs, floor s
        self.attn: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0, 0.0])  # kind -> calls, s, FLOPs, B
        self.fused: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])

    def clear(self) -> None:
        self.gemm.clear()
        self.attn.clear()
        self.fused.clear()


def attention_work(q, k, kv_cache, meta) -> tuple[str, float, float]:
    """(kind, prefill FLOPs, decode K/V bytes) of one attention call (no sliding window: Qwen3)."""
    heads, head_dim, kv_heads = q.shape[1], q.shape[2], k.shape[1]
    qs, seq_lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
    flops = kv_bytes = 0.0
    for b, seq_len in enumerate(seq_lens):
        q_len = qs[b + 1] - qs[b]
        if q_len == 1:
            kv_bytes += seq_len * kv_heads * head_dim * 2 * kv_cache.element_size()
        else:
            first = seq_len - q_len  # queries at positions first .. seq_len - 1 see keys 0 .. their own
            pairs = q_len * (first + 1) + q_len * (q_len - 1) // 2
            flops += 4.0 * pairs * heads * head_dim
    return ("calls with prefill rows" if flops else "calls of one-row queries only"), flops, kv_bytes


def install(counters: Counters) -> None:
    """Wrap the ctypes kernels (module attributes: the models call them through their modules)."""
    from kernels import cpu_fused, cpu_gemm, cpu_paged

    gemm = cpu_gemm.gemm

    def timed_gemm(x, packed, act=None):
        t = counters.clock()
        out = gemm(x, packed, act)
        dt = counters.clock() - t
        m, n, k = x.shape[0], packed.out_features, packed.in_features
        flops = 2.0 * m * n * k
        floor = max(flops / counters.peak, n * k * 4 / counters.bandwidth) if counters.peak else 0.0
        for key in (f"{n} x {k}{' (gated)' if act else ''}", f"rows {row_bucket(m)}"):
            c = counters.gemm[key]
            c[0] += 1
            c[1] += dt
            c[2] += flops
            c[3] += floor
        return out

    cpu_gemm.gemm = timed_gemm
    attention = cpu_paged.cpu_paged_attention

    def timed_attention(q, k, v, kv_cache, meta, **kwargs):
        t = counters.clock()
        out = attention(q, k, v, kv_cache, meta, **kwargs)
        dt = counters.clock() - t
        kind, flops, kv_bytes = attention_work(q, k, kv_cache, meta)
        c = counters.attn[kind]
        c[0] += 1
        c[1] += dt
        c[2] += flops
        c[3] += kv_bytes
        return out

    cpu_paged.cpu_paged_attention = timed_attention
    for name in ("add_rms_norm", "qk_norm_rope", "gated_activation"):
        fn = getattr(cpu_fused, name)

        def timed(*args, _fn=fn, _name=name, **kwargs):
            t = counters.clock()
            out = _fn(*args, **kwargs)
            c = counters.fused[_name]
            c[0] += 1
            c[1] += counters.clock() - t
            return out

        setattr(cpu_fused, name, timed)


def worker(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(args.threads)
    from engine import CacheConfig, ChunkingConfig, EngineConfig, LLMEngine, ModelConfig, SamplingParams

    peak, bandwidth = fma_peak_gflops(args.threads), read_bandwidth_gbs()
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    counters = Counters(clock, peak, bandwidth)
    install(counters)
    prompts = vs_vllm.make_prompts(args.num_prompts, args.prompt_tokens, 0, vs_vllm.ARCH["vocab_size"])
    eng = LLMEngine(EngineConfig(
        model=ModelConfig(name="roofline", path=args.model_dir, tokenizer="byte", dtype="float32", device="cpu"),
        cache=CacheConfig(backend="paged", block_size=16, max_model_len=4096, prefix_caching=False),
        chunking=ChunkingConfig(enabled=True, size=args.budget, token_budget=args.budget),
        max_num_seqs=64,
    ))
    eng.generate(prompts[:vs_vllm.WARMUP_PROMPTS],
                 SamplingParams(max_tokens=vs_vllm.WARMUP_TOKENS, temperature=0.0, ignore_eos=True))
    counters.clear()
    sp = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    w0, c0 = time.perf_counter(), clock()
    eng.generate(prompts, sp)
    seconds, wall = clock() - c0, time.perf_counter() - w0
    Path(args.out).write_text(json.dumps({
        "threads": args.threads, "peak_gflops": peak, "bandwidth_gbs": bandwidth, "seconds": seconds,
        "wall_seconds": wall,
        "gemm": dict(counters.gemm), "attention": dict(counters.attn), "fused": dict(counters.fused),
    }))


def run_worker(args: argparse.Namespace, model_dir: Path, work: Path) -> dict:
    from runner import startup

    out = work / "roofline.json"
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    env.update(startup.plan(env, startup.find_malloc()).env)  # what ladle's CLI sets before torch loads
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--model-dir", str(model_dir), "--out",
           str(out), "--num-prompts", str(args.num_prompts), "--prompt-tokens", str(args.prompt_tokens),
           "--output-len", str(args.output_len), "--budget", str(args.budget), "--threads", str(args.threads)]
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"roofline worker failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(out.read_text())


def table(r: dict, peer_seconds: float | None) -> str:
    peak, bw = r["peak_gflops"], r["bandwidth_gbs"]
    rows, total_floor, parts = [], 0.0, 0.0

    def line(label, calls, work, seconds, rate, floor):
        over = f"{seconds - floor:.2f}" if floor is not None else ""
        rows.append(f"| {label} | {calls} | {work} | {seconds:.2f} | {rate} | "
                    f"{'' if floor is None else f'{floor:.2f}'} | {over} |")

    gemm = r["gemm"]
    for key in sorted(k for k in gemm if not k.startswith("rows")):
        calls, s, flops, floor = gemm[key]
        line(f"linear {key}", calls, f"{flops / 1e9:.0f} GFLOP", s, f"{flops / s / 1e9:.1f} GFLOP/s", floor)
    for key in ("rows 1-8", "rows 9-32", "rows 33-128", "rows 129+"):
        if key in gemm:
            calls, s, flops, floor = gemm[key]
            line(f"linear, {key}", calls, f"{flops / 1e9:.0f} GFLOP", s, f"{flops / s / 1e9:.1f} GFLOP/s", floor)
    by_rows = [v for k, v in gemm.items() if k.startswith("rows")]
    g_s, g_f, g_floor = (sum(v[i] for v in by_rows) for i in (1, 2, 3))
    line("**linear, all**", sum(v[0] for v in by_rows), f"{g_f / 1e9:.0f} GFLOP", g_s,
         f"{g_f / g_s / 1e9:.1f} GFLOP/s", g_floor)
    total_floor += g_floor
    parts += g_s
    a_s = 0.0
    for kind in ("calls with prefill rows", "calls of one-row queries only"):
        if kind not in r["attention"]:
            continue
        calls, s, flops, kv_bytes = r["attention"][kind]
        floor = flops / peak / 1e9 + kv_bytes / bw / 1e9
        work = " + ".join(w for w in (f"{flops / 1e9:.1f} GFLOP" if flops else "",
                                      f"{kv_bytes / 1e9:.2f} GB of K/V" if kv_bytes else "") if w)
        rate = f"{kv_bytes / s / 1e9:.1f} GB/s" if not flops else ""
        line(f"attention, {kind}", calls, work, s, rate, floor)
        total_floor += floor
        a_s += s
    parts += a_s
    for name, (calls, s) in sorted(r["fused"].items()):
        line(f"fused {name}", calls, "", s, "", None)
        parts += s
    total = r["seconds"]
    line("rest (Python, scheduling, sampling, torch ops)", "", "", total - parts, "", None)
    line("**the timed generate**", "", "", total, "", total_floor)
    n = r["threads"]
    clock = "CPU s" if n == 1 else "wall s"
    head = (f"{n} thread{'s' if n > 1 else ''}: FMA peak {peak:.1f} GFLOP/s, DRAM read {bw:.1f} GB/s; generate "
            + (f"{total:.2f} CPU s, {r['wall_seconds']:.2f} wall s" if n == 1 else f"{total:.2f} wall s")
            + ". Floors: linear FLOPs at the peak or the weight's bytes at the bandwidth, whichever is longer; "
            "prefill FLOPs at the peak plus decode K/V bytes at the bandwidth; the total's floor leaves out what "
            f"has none here (elementwise, the rest).\n\n| part | calls | work | {clock} | rate | floor s | over the floor s |\n"
            "|---|---|---|---|---|---|---|\n")
    text = head + "\n".join(rows) + "\n"
    if peer_seconds:
        need = peer_seconds / TARGET
        gap = total - need
        text += (f"\n{TARGET}x over the peer's {peer_seconds:.2f} s needs {need:.2f} s: "
                 + (f"{gap:.2f} s less, {gap / max(total - total_floor, 1e-9):.0%} of this run's "
                    f"{total - total_floor:.2f} s over the floors."
                    if gap > 0 else "this run is already there.") + "\n")
    return text


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--peer-seconds", type=float, default=None, help="a peer's time on the same workload")
    vs_vllm.add_workload_args(p)
    p.add_argument("--budget", type=int, default=512)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    model_dir = vs_vllm.workload_model(args)
    with tempfile.TemporaryDirectory(prefix="roofline-") as work:
        print(table(run_worker(args, model_dir, Path(work)), args.peer_seconds), end="")


if __name__ == "__main__":
    main()
