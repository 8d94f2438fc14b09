"""The vs_vllm workload at N threads, part by part, against these cores' limits.

Runs benchmarks/vs_vllm.py's ladle workload (random Qwen3 166M, 32 prompts / ~12,000 prompt tokens x 32
greedy tokens, step budget 512, fp32, eager) at `--threads N` (default 1) in a worker process under the
CLI's start-up environment (runner/startup.py), every ctypes kernel call timed (the thread's CPU clock at 1
thread, wall time at more: each call is one parallel region) and its work counted:

- linear layers (kernels/cpu_gemm.gemm): 2 x rows x N x K FLOPs and the packed weight's bytes (each call
  streams it), by weight shape and by row count; a layer that runs elsewhere (oneDNN: a bias, or a shape whose
  bits cpu_gemm does not reproduce) is named in the report, its time then in "the rest";
- attention (kernels/cpu_paged): the prefill chunks' query-key pairs (causal) x 4 x head_dim x heads FLOPs, and
  the one-row queries' (decodes') visible K/V bytes; calls with prefill rows and calls of one-row queries only
  apart (the last layer keeps one row per sequence: its calls are all one-row queries, reading the whole
  context's K/V);
- the fused elementwise kernels (kernels/cpu_fused);
- the rest: the timed generate's time less all of these (Python, scheduling, sampling, torch ops).

The layers run op by op (the CPU layer stack, models/cpu_stack.py, switched off: it calls the kernels from
C++, where no Python timer sees them), so the rest includes the Python between a layer's kernels that the
stack removes.

Each part's floor is its work at these cores' limits (a linear call's: the larger of its FLOPs at the peak
and its weight's bytes at the bandwidth; an attention call's: its FLOPs at the peak plus its K/V bytes at the
bandwidth, the two being separate work items run one after the other by a thread; a decode's own FLOPs are
left out), measured in the same worker before the run: the FMA peak by a register-only loop of independent
fused multiply-adds (built like the kernels; N threads run it at once, each free to use every CPU the process
may), the DRAM read bandwidth by a torch.sum over 256 MB at N threads. A part's floor is a bound, not a
target: attention's softmax and the gated activation's exp are work the FLOP count leaves out.
`--peer-seconds S` adds what a 1.2x lead over a peer's S seconds (wall) would need. It measures ladle's own
CPU kernels: where kernels/cpu_gemm or kernels/cpu_paged is not available (no AVX-512, or switched off) it
says so and stops.

    PYTHONPATH=benchmarks .venv/bin/python benchmarks/experiments/roofline.py [--threads 1] [--peer-seconds 28.6]
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

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
import vs_vllm

TARGET = 1.2

FMA_SOURCE = Path(__file__).resolve().parent / "fma_peak.cpp"  # FMA chains in registers


def fma_peak_gflops(threads: int = 1, repeats: int = 5, cpus: set[int] | None = None) -> float:
    """The fp32 FMA peak of `threads` cores together (GFLOP/s: at 1 the thread's CPU clock, else wall time, the
    loop run by that many threads at once: ctypes releases the GIL), or 0.0 where there is no FMA unit to use
    or the loop does not build. cpus: the CPUs each extra thread may run on (default: the caller's; a thread
    inherits its creator's mask, which an OpenMP runtime told to bind has narrowed to one CPU)."""
    from ladle.kernels.cpu_build import ARCH_FLAGS, compile_cached

    try:
        path, _ = compile_cached(FMA_SOURCE, "libladle_fma_peak", list(ARCH_FLAGS[0]))
    except (RuntimeError, OSError, subprocess.CalledProcessError):
        return 0.0
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

    def worker() -> None:
        if cpus and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, cpus)
        lib.ladle_fma_loop(iters)

    for _ in range(repeats):
        workers = [threading.Thread(target=worker) for _ in range(threads - 1)]
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


FUSED_KERNELS = ("add_rms_norm", "qk_norm_rope", "gated_activation")


def wrapped_attributes() -> list[tuple[object, str]]:
    """(module, attribute) of every function `install` replaces: what a caller must put back afterwards."""
    from ladle.kernels import cpu_fused, cpu_gemm, cpu_paged

    return [(cpu_gemm, "gemm"), (cpu_paged, "cpu_paged_attention"), *((cpu_fused, n) for n in FUSED_KERNELS)]


def accumulate(entry: list[float], *amounts: float) -> None:
    """Add amounts to a counter entry's fields in order (calls, seconds, then the part's own measures)."""
    for i, amount in enumerate(amounts):
        entry[i] += amount


def install(counters: Counters) -> None:
    """Wrap the ctypes kernels (module attributes: the models call them through their modules). The CPU
    layer stack (models/cpu_stack.py) calls them from C++, where no wrapper sees them: it is switched off,
    so the layers run op by op (the same kernels and bits, with the Python between them)."""
    from ladle.kernels import cpu_fused, cpu_gemm, cpu_layers, cpu_paged

    cpu_layers.set_enabled(False)

    gemm = cpu_gemm.gemm

    def timed_gemm(x, packed, act=None):
        t = counters.clock()
        out = gemm(x, packed, act)
        dt = counters.clock() - t
        m, n, k = x.shape[0], packed.out_features, packed.in_features
        flops = 2.0 * m * n * k
        # No rows: the kernel returns before reading the weight.
        floor = max(flops / counters.peak, packed.nbytes() / counters.bandwidth) if counters.peak and m else 0.0
        for key in (f"{n} x {k}{' (gated)' if act else ''}", f"rows {row_bucket(m)}"):
            accumulate(counters.gemm[key], 1, dt, flops, floor)
        return out

    cpu_gemm.gemm = timed_gemm
    attention = cpu_paged.cpu_paged_attention

    def timed_attention(q, k, v, kv_cache, meta, **kwargs):
        t = counters.clock()
        out = attention(q, k, v, kv_cache, meta, **kwargs)
        dt = counters.clock() - t
        kind, flops, kv_bytes = attention_work(q, k, kv_cache, meta)
        accumulate(counters.attn[kind], 1, dt, flops, kv_bytes)
        return out

    cpu_paged.cpu_paged_attention = timed_attention
    for name in FUSED_KERNELS:
        fn = getattr(cpu_fused, name)

        def timed(*args, _fn=fn, _name=name, **kwargs):
            t = counters.clock()
            out = _fn(*args, **kwargs)
            accumulate(counters.fused[_name], 1, counters.clock() - t)
            return out

        setattr(cpu_fused, name, timed)


def outside_cpu_gemm(model) -> list[str]:
    """The model's linear layers whose CPU forward does not run through kernels/cpu_gemm (packed for oneDNN,
    or not packed at all): their calls are not counted as linear work."""
    from ladle.kernels import cpu_gemm
    from ladle.models.linear import Linear

    return [name for name, m in model.named_modules()
            if isinstance(m, Linear) and not isinstance(m._packed, cpu_gemm.PackedWeight)]


def worker(args: argparse.Namespace) -> None:
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None  # before an OpenMP runtime binds
    import torch

    torch.set_num_threads(args.threads)
    from ladle.engine import CacheConfig, ChunkingConfig, EngineConfig, LLMEngine, ModelConfig, SamplingParams
    from ladle.kernels import cpu_gemm, cpu_paged

    missing = [name for name, ok in (("kernels/cpu_gemm", cpu_gemm.available()),
                                     ("kernels/cpu_paged", cpu_paged.load_library() is not None)) if not ok]
    if missing:
        raise SystemExit(f"roofline.py measures ladle's CPU kernels, and {' and '.join(missing)} "
                         "is not available here (it needs AVX-512 and a C++ compiler; see kernels/cpu_build.py): "
                         "nothing to measure")
    peak_one = fma_peak_gflops(1)
    peak = fma_peak_gflops(args.threads, cpus=cpus) if args.threads > 1 else peak_one
    bandwidth = read_bandwidth_gbs()
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
    outside = outside_cpu_gemm(eng.model)
    counters.clear()
    sp = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    w0, c0 = time.perf_counter(), clock()
    eng.generate(prompts, sp)
    seconds, wall = clock() - c0, time.perf_counter() - w0
    Path(args.out).write_text(json.dumps({
        "threads": args.threads, "peak_gflops": peak, "peak_one_gflops": peak_one, "bandwidth_gbs": bandwidth,
        "seconds": seconds, "wall_seconds": wall, "outside_cpu_gemm": outside,
        "gemm": dict(counters.gemm), "attention": dict(counters.attn), "fused": dict(counters.fused),
    }))


def run_worker(args: argparse.Namespace, model_dir: Path, work: Path) -> dict:
    from ladle.runner import startup

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


def rate(amount: float, seconds: float, unit: str) -> str:
    return f"{amount / seconds / 1e9:.1f} {unit}" if seconds > 0 else ""


def table(r: dict, peer_seconds: float | None) -> str:
    """The report of a worker's results: a markdown table, notes on what it could not count, the peer line."""
    peak, bw = r["peak_gflops"], r["bandwidth_gbs"]
    limits = peak > 0 and bw > 0  # 0: the FMA loop found no unit or did not build: no floors
    rows, notes, total_floor, parts = [], [], 0.0, 0.0

    def line(label, calls, work, seconds, speed, floor):
        over = f"{seconds - floor:.2f}" if floor is not None else ""
        rows.append(f"| {label} | {calls} | {work} | {seconds:.2f} | {speed} | "
                    f"{'' if floor is None else f'{floor:.2f}'} | {over} |")

    gemm = r["gemm"]
    for key in sorted(k for k in gemm if not k.startswith("rows")):
        calls, s, flops, floor = gemm[key]
        line(f"linear {key}", calls, f"{flops / 1e9:.0f} GFLOP", s, rate(flops, s, "GFLOP/s"), floor if limits else None)
    for key in ("rows 1-8", "rows 9-32", "rows 33-128", "rows 129+"):
        if key in gemm:
            calls, s, flops, floor = gemm[key]
            line(f"linear, {key}", calls, f"{flops / 1e9:.0f} GFLOP", s, rate(flops, s, "GFLOP/s"),
                 floor if limits else None)
    by_rows = [v for k, v in gemm.items() if k.startswith("rows")]
    g_s, g_f, g_floor = (sum(v[i] for v in by_rows) for i in (1, 2, 3))
    line("**linear, all**", sum(v[0] for v in by_rows), f"{g_f / 1e9:.0f} GFLOP", g_s, rate(g_f, g_s, "GFLOP/s"),
         g_floor if limits else None)
    total_floor += g_floor
    parts += g_s
    if r.get("outside_cpu_gemm"):
        names = r["outside_cpu_gemm"]
        notes.append(f"{len(names)} linear layer(s) ran outside kernels/cpu_gemm (their time is in the rest, "
                     f"uncounted): {', '.join(names[:6])}{' ...' if len(names) > 6 else ''}")
    for kind in ("calls with prefill rows", "calls of one-row queries only"):
        if kind not in r["attention"]:
            continue
        calls, s, flops, kv_bytes = r["attention"][kind]
        floor = flops / peak / 1e9 + kv_bytes / bw / 1e9 if limits else None
        work = " + ".join(w for w in (f"{flops / 1e9:.1f} GFLOP" if flops else "",
                                      f"{kv_bytes / 1e9:.2f} GB of K/V" if kv_bytes else "") if w)
        line(f"attention, {kind}", calls, work, s, "" if flops else rate(kv_bytes, s, "GB/s"), floor)
        total_floor += floor or 0.0
        parts += s
    for name, (calls, s) in sorted(r["fused"].items()):
        line(f"fused {name}", calls, "", s, "", None)
        parts += s
    total = r["seconds"]
    line("rest (Python, scheduling, sampling, torch ops)", "", "", total - parts, "", None)
    line("**the timed generate**", "", "", total, "", total_floor if limits else None)
    n = r["threads"]
    if not limits:
        notes.append("no floors: the FMA peak loop found no FMA unit or did not build here")
    elif n > 1 and peak < 0.9 * n * r["peak_one_gflops"]:
        notes.append(f"the FMA peak at {n} threads is {peak / r['peak_one_gflops']:.2f}x one thread's "
                     f"({r['peak_one_gflops']:.1f}): fewer free cores than threads, or threads bound to one CPU")
    clock = "CPU s" if n == 1 else "wall s"
    head = (f"{n} thread{'s' if n > 1 else ''}: FMA peak {peak:.1f} GFLOP/s, DRAM read {bw:.1f} GB/s; generate "
            + (f"{total:.2f} CPU s, {r['wall_seconds']:.2f} wall s" if n == 1 else f"{total:.2f} wall s")
            + ". Floors: linear FLOPs at the peak or the weight's bytes at the bandwidth, whichever is longer; "
            "prefill FLOPs at the peak plus decode K/V bytes at the bandwidth; the total's floor leaves out what "
            f"has none here (elementwise, the rest).\n\n| part | calls | work | {clock} | rate | floor s | "
            "over the floor s |\n|---|---|---|---|---|---|---|\n")
    text = head + "\n".join(rows) + "\n" + "".join(f"\nNote: {note}.\n" for note in notes)
    if peer_seconds:
        # Against the peer's wall time: this run's wall time, and the distance to the floors on that clock.
        need, wall = peer_seconds / TARGET, r["wall_seconds"]
        gap, above = wall - need, wall - total_floor
        text += (f"\n{TARGET}x over the peer's {peer_seconds:.2f} s (wall) needs {need:.2f} s: "
                 + (f"{gap:.2f} s less than this run's {wall:.2f} s wall"
                    + (f", {gap / above:.0%} of its {above:.2f} s over the floors." if limits and above > 0 else ".")
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
