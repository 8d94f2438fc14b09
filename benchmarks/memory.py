"""Peak memory of prefilling one long prompt: whole (chunking.enabled=false) vs chunked at 256/512/1024.

Each configuration runs in a fresh subprocess: it builds the engine (random weights; the KV cache is
allocated and zero-filled, so its pages are resident), prefills a 16-token warm-up prompt, resets the
process's peak-RSS mark (writing 5 to /proc/self/clear_refs, which resets the high-water mark that
resource.getrusage reports as ru_maxrss), takes that as the baseline, prefills the one long prompt
(max_tokens=1) and reads ru_maxrss again. Peak minus baseline is the transient memory of the prefill:
activations, attention temporaries, gathers.

The model has Qwen3-0.6B's layer shapes (hidden 1024, 16 heads / 8 KV heads x 128, intermediate 3072,
vocab 151936) but only --layers layers (default 2), fp32: activation memory is per layer and transient, so
depth changes the time, not the peak, and 2 layers keep a 16k-token whole prefill within a minute or two
on this CPU.

    .venv/bin/python benchmarks/memory.py --quick
    .venv/bin/python benchmarks/memory.py --write-docs
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import time

import benchutil as bu
import torch


def architecture(layers: int) -> dict:
    return bu.qwen3_architecture(num_hidden_layers=layers)


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024
    return math.nan


def maxrss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def child(args) -> None:
    bu.set_threads(args.threads)
    bu.quiet_random_weights()
    from ladle.engine import CacheConfig, ChunkingConfig, EngineConfig, LLMEngine, SamplingParams

    arch = architecture(args.layers)
    chunking = ChunkingConfig(enabled=False) if args.chunk == 0 else ChunkingConfig(size=args.chunk)
    max_len = args.length + 16
    cfg = EngineConfig(
        model=bu.engine_model_config(arch),
        cache=CacheConfig(num_blocks=math.ceil(max_len / 16) + 4, max_model_len=max_len),
        chunking=chunking,
        max_num_seqs=2,
    )
    eng = LLMEngine(cfg)
    gen = torch.Generator().manual_seed(0)
    sp = SamplingParams(max_tokens=1, temperature=0.0)
    eng.add_request(bu.random_prompt(16, gen, arch["vocab_size"]), sp, request_id="warmup")
    while eng.has_unfinished_requests():
        eng.step()
    prompt = bu.random_prompt(args.length, gen, arch["vocab_size"])
    peak_before_reset = maxrss_mib()
    reset = reset_peak()
    baseline = maxrss_mib()
    current = rss_mib()
    t0 = time.perf_counter()
    eng.add_request(prompt, sp, request_id="long")
    steps = 0
    while eng.has_unfinished_requests():
        eng.step()
        steps += 1
    seconds = time.perf_counter() - t0
    peak = maxrss_mib()
    print(json.dumps({
        "length": args.length, "chunk": args.chunk, "baseline_mib": baseline, "rss_mib": current,
        "peak_mib": peak, "delta_mib": peak - baseline, "reset": reset, "load_peak_mib": peak_before_reset,
        "kv_mib": eng.kv.bytes / 2**20, "seconds": seconds, "steps": steps,
    }))


def run_child(args, length: int, chunk: int) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--length", str(length), "--chunk", str(chunk),
           "--layers", str(args.layers), "--threads", str(args.threads)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"child {length}/{chunk} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def label(chunk: int) -> str:
    return "whole" if chunk == 0 else f"chunk {chunk}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="2k and 4k prompts, 1 layer, chunks 256/1024 (< 2 min)")
    ap.add_argument("--write-docs", action="store_true", help="write the report to benchmarks/results/")
    ap.add_argument("--lengths", type=int, nargs="+", default=None, help="default 8192 16384 (quick 2048 4096)")
    ap.add_argument("--chunks", type=int, nargs="+", default=None, help="default 256 512 1024 (quick 256 1024)")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default 2; quick 1)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (0 = torch default)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--length", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--chunk", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.layers = args.layers or (1 if args.quick else 2)
    if args.child:
        child(args)
        return
    args.lengths = args.lengths or ([2048, 4096] if args.quick else [8192, 16384])
    args.chunks = args.chunks or ([256, 1024] if args.quick else [256, 512, 1024])
    arch = architecture(args.layers)
    print(f"model: {bu.describe_arch(arch)}, fp32, torch threads {args.threads}; one fresh process per row")
    rows = []
    for length in args.lengths:
        base = None
        for chunk in [0, *args.chunks]:
            r = run_child(args, length, chunk)
            if chunk == 0:
                base = r
            ratio = r["delta_mib"] / base["delta_mib"] if base and base["delta_mib"] > 0 else math.nan
            print(f"  {length:>6} {label(chunk):>10}: baseline {r['baseline_mib']:.0f} MiB (KV {r['kv_mib']:.0f}), "
                  f"peak {r['peak_mib']:.0f} MiB, +{r['delta_mib']:.0f} MiB, {r['seconds']:.1f}s in {r['steps']} "
                  f"steps{'' if r['reset'] else ' (peak mark NOT reset)'}", flush=True)
            rows.append([length, label(chunk), r["baseline_mib"], r["kv_mib"], r["peak_mib"], r["delta_mib"],
                         "-" if chunk == 0 else f"{ratio:.2f}", r["seconds"], r["steps"]])
    table = bu.markdown_table(["prompt tokens", "prefill", "baseline RSS MiB", "of which KV MiB", "peak RSS MiB",
                               "peak - baseline MiB", "vs whole", "seconds", "steps"], rows)
    print()
    print(table)
    if args.write_docs:
        cmd = f".venv/bin/python benchmarks/memory.py{' --quick' if args.quick else ''} --write-docs"
        body = "\n".join([
            f"Command: `{cmd}` (torch threads {args.threads}).",
            "",
            (f"- Model: {bu.describe_arch(arch)}, fp32: Qwen3-0.6B's layer shapes with {args.layers} layer(s), "
             "so activations are those of the real model's layers (they are per layer and transient) while a "
             "16k-token prefill stays affordable on this CPU."),
            ("- One fresh process per row. Baseline = ru_maxrss after loading the model, allocating (zeroing) the "
             "KV cache, a 16-token warm-up and resetting the peak mark (/proc/self/clear_refs = 5); peak = "
             "ru_maxrss after prefilling the prompt (max_tokens=1). Single request, so whole = one step of all "
             "its tokens; chunk N = chunking.size=N."),
            "",
            table,
        ])
        print("wrote", bu.write_docs_section("memory", body))


if __name__ == "__main__":
    main()
