"""GPU measurements of chunked prefill (called by benchmarks/gpu/chunked_prefill.sh; each part writes a JSON
file and prints a markdown table):

- `peak`: the device's bf16 matmul rate (8192^3) and copy bandwidth, the denominators of the others.
- `mixed-step`: a step of one 512-token prefill chunk beside 32 decodes (Qwen3-4B shape, random weights,
  bf16), wall time with the mixed-step CUDA graphs and without (eager), against the GPU time of its
  kernels (torch profiler, eager steps: the same kernels a replay runs).
- `throughput`: offline throughput on ShareGPT-like prompt lengths (lognormal, median 256, capped at
  2048), ladle against transformers' continuous batching (`generate_batch`) in the same run, each as
  tokens/s and as a fraction of the measured matmul peak (2 x linear parameters FLOPs a token).

`--smoke` runs every part at a toy size on the CPU (tiny model, float32), to check the script end to end
where no GPU is at hand; its numbers mean nothing.

    python benchmarks/gpu/chunked_prefill.py peak mixed-step throughput --out $OUT
    python benchmarks/gpu/chunked_prefill.py --smoke peak mixed-step throughput --out /tmp/smoke
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchutil, throughput_vs_transformers
import benchutil as bu
import throughput_vs_transformers as tvt

from ladle.engine import CacheConfig, ChunkingConfig, EngineConfig, LLMEngine, SamplingParams


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def peak(args) -> dict:
    """bf16 matmul TFLOP/s and copy bandwidth of this device (float32 and small on the CPU)."""
    n = 512 if args.smoke else 8192
    dtype = torch.float32 if args.smoke else torch.bfloat16
    a = torch.randn(n, n, dtype=dtype, device=args.device)
    for _ in range(3):
        a @ a
    sync(args.device)
    t = time.perf_counter()
    for _ in range(10):
        a @ a
    sync(args.device)
    tflops = 2 * n**3 * 10 / (time.perf_counter() - t) / 1e12
    src = torch.empty((1 << 20) if args.smoke else (1 << 30), dtype=torch.float32, device=args.device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync(args.device)
    t = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    sync(args.device)
    bandwidth = 2 * src.numel() * 4 * 10 / (time.perf_counter() - t)
    result = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
              "matmul_tflops": tflops, "copy_bandwidth_tb_s": bandwidth / 1e12}
    print(bu.markdown_table(["device", "matmul TFLOP/s", "copy TB/s"],
                            [[result["device"], f"{tflops:.0f}", f"{bandwidth / 1e12:.2f}"]]))
    return result


def mixed_engine(args, chunk: int, decodes: int, long_len: int) -> LLMEngine:
    arch = bu.preset_architecture(args.model)
    mc = bu.engine_model_config(arch, dtype=args.dtype)
    mc.device = args.device
    max_len = long_len + 64
    blocks = (decodes + 1) * -(-max_len // 16) + 16
    return LLMEngine(EngineConfig(
        model=mc, cache=CacheConfig(max_model_len=max_len, num_blocks=blocks, prefix_caching=False),
        chunking=ChunkingConfig(size=chunk, token_budget=chunk + decodes), max_num_seqs=decodes + 1))


def mixed_steps(eng: LLMEngine, prompt: list[int], device: str, chunk: int, decodes: int) -> list[float]:
    """Prefill `prompt` beside the running decodes; the wall seconds of its steps of exactly one full
    chunk and every decode."""
    eng.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    times = []
    while True:
        sync(device)
        t = time.perf_counter()
        eng.step()
        sync(device)
        s = eng.last_step
        if s.prefill_tokens == chunk and s.decode_tokens == decodes:
            times.append(time.perf_counter() - t)
        if s.prefill_tokens == 0:
            return times


def kernel_seconds(prof) -> float:
    """GPU time of the profiled kernels and copies (0 on the CPU)."""
    total = 0.0
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", None)
        total += (us if us is not None else getattr(e, "self_cuda_time_total", 0.0)) or 0.0
    return total / 1e6


def mixed_step(args) -> dict:
    """One 512-token chunk + 32 decodes: wall time with and without the mixed-step graphs, and kernel time."""
    from torch.profiler import ProfilerActivity, profile

    chunk, decodes = (32, 4) if args.smoke else (512, 32)
    long_len, rounds = chunk * 8, 3
    eng = mixed_engine(args, chunk, decodes, long_len)
    arch, gen = bu.preset_architecture(args.model), torch.Generator().manual_seed(0)
    runner = eng.model_runner
    graphs = runner.mixed_graphs
    params = SamplingParams(max_tokens=(2 * rounds + 2) * 8 + 32, temperature=0.0, ignore_eos=True)
    for _ in range(decodes):
        eng.add_request(bu.random_prompt(128, gen, arch["vocab_size"]), params)
    while eng.scheduler.num_waiting or eng.last_step is None or eng.last_step.prefill_tokens:
        eng.step()
    times: dict[str, list[float]] = {"graphs": [], "eager": []}
    for r in range(rounds):  # alternate, so both see the same decode contexts on average
        for mode in ("graphs", "eager") if r % 2 == 0 else ("eager", "graphs"):
            runner.mixed_graphs = graphs if mode == "graphs" else None
            times[mode] += mixed_steps(eng, bu.random_prompt(long_len, gen, arch["vocab_size"]), args.device,
                                       chunk, decodes)
    runner.mixed_graphs = None  # profile eager steps: their kernels are a replay's, each visible
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
    with profile(activities=acts) as prof:
        profiled = mixed_steps(eng, bu.random_prompt(long_len, gen, arch["vocab_size"]), args.device, chunk, decodes)
    runner.mixed_graphs = graphs
    steps_in_profile = max(1, len(profiled))
    kernel = kernel_seconds(prof) / steps_in_profile  # includes the final partial steps' share: an upper bound
    g, e = bu.median(times["graphs"]), bu.median(times["eager"])
    result = {"model": args.model, "chunk": chunk, "decodes": decodes, "graphs_ms": g * 1e3, "eager_ms": e * 1e3,
              "kernel_ms": kernel * 1e3, "mixed_graphs": graphs is not None,
              "graphs_over_kernel": g / kernel if kernel else None, "eager_over_kernel": e / kernel if kernel else None,
              "steps": {k: len(v) for k, v in times.items()}}
    if args.device == "cuda":
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=15, max_name_column_width=60))
    print(bu.markdown_table(
        ["model", "step", "graphs ms", "eager ms", "GPU kernels ms", "graphs / kernels", "eager / kernels"],
        [[args.model, f"{chunk} + {decodes} decodes", f"{g * 1e3:.2f}", f"{e * 1e3:.2f}", f"{kernel * 1e3:.2f}",
          f"{g / kernel:.2f}x" if kernel else "n/a", f"{e / kernel:.2f}x" if kernel else "n/a"]]))
    return result


def throughput(args) -> dict:
    """ladle vs transformers' continuous batching on the same prompts, one round each, and as a fraction of
    the matmul peak measured in this run."""
    arch = bu.preset_architecture(args.model)
    n, median, cap, out_len = (8, 32, 96, 8) if args.smoke else (args.num_requests, 256, 2048, args.output_len)
    prompts = tvt.make_prompts(n, median, 1.0, cap, 4, arch["vocab_size"], 0)
    prompt_tokens, output_tokens = sum(map(len, prompts)), out_len * n
    max_model_len = max(map(len, prompts)) + out_len
    elem = 4 if args.dtype == "float32" else 2
    kv_per_token = 2 * arch["num_hidden_layers"] * arch["num_key_value_heads"] * arch["head_dim"] * elem
    kv_tokens = max(min(sum(len(p) + out_len for p in prompts), int(args.kv_gib * 2**30 // kv_per_token)),
                    math.ceil(max_model_len / 256) * 256)
    opts = SimpleNamespace(dtype=args.dtype, device=args.device, token_budget=args.token_budget,
                           max_num_seqs=args.max_num_seqs, hf_attn="paged|sdpa", hf_page_size=256)
    rate = args.peak_tflops * 1e12 if args.peak_tflops else None
    flops_per_token = 2 * bu.linear_params(arch)
    rows, result = [], {"model": args.model, "requests": n, "prompt_tokens": prompt_tokens,
                        "output_tokens": output_tokens, "systems": {}}
    with tempfile.TemporaryDirectory(prefix="ladle-bench-") as tmp:
        tvt.save_random_model(arch, args.dtype, 0, Path(tmp), 0.1)
        for cls in (tvt.Ladle, tvt.Transformers):
            system = cls(Path(tmp), opts, kv_tokens, max_model_len)
            system.run([p[:16] for p in prompts[:2]], 2)  # warm-up: allocations, kernel choice
            sync(args.device)
            t = time.perf_counter()
            system.run(prompts, out_len)
            sync(args.device)
            dt = time.perf_counter() - t
            total = (prompt_tokens + output_tokens) / dt
            frac = total * flops_per_token / rate if rate else None
            result["systems"][system.name] = {"seconds": dt, "output_tok_s": output_tokens / dt, "total_tok_s": total,
                                              "fraction_of_matmul_peak": frac}
            rows.append([system.name, f"{dt:.1f}", f"{output_tokens / dt:.0f}", f"{total:.0f}",
                         f"{frac:.3f}" if frac else "n/a"])
            print(f"  {system.name}: {dt:.1f} s", flush=True)
            del system
            if args.device == "cuda":
                torch.cuda.empty_cache()
    s = result["systems"]
    result["ladle_over_transformers"] = s["ladle"]["total_tok_s"] / s["transformers"]["total_tok_s"]
    print(f"{args.model}, {n} prompts ({prompt_tokens} tokens), {out_len} output tokens each, {args.dtype}:")
    print(bu.markdown_table(["system", "seconds", "output tok/s", "total tok/s", "fraction of matmul peak"], rows))
    print(f"ladle / transformers: {result['ladle_over_transformers']:.2f}x")
    return result


PARTS = {"peak": peak, "mixed-step": mixed_step, "throughput": throughput}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("parts", nargs="+", choices=sorted(PARTS))
    ap.add_argument("--model", default="qwen3_4b", help="a conf/model preset with an architecture")
    ap.add_argument("--num-requests", type=int, default=1000)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--token-budget", type=int, default=2048)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--kv-gib", type=float, default=20.0, help="cap on each system's KV cache")
    ap.add_argument("--peak-tflops", type=float, default=None, help="the matmul rate (default: `peak` of this run)")
    ap.add_argument("--smoke", action="store_true", help="toy sizes on the CPU (tiny model, float32)")
    ap.add_argument("--out", default="gpu-out", help="folder for the JSON results")
    args = ap.parse_args()
    bu.quiet_random_weights()
    args.device, args.dtype = ("cpu", "float32") if args.smoke else ("cuda", "bfloat16")
    if args.smoke:
        args.model = "tiny"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for part in args.parts:
        if part == "throughput" and args.peak_tflops is None:
            args.peak_tflops = peak(args)["matmul_tflops"]
        t = time.perf_counter()
        result = PARTS[part](args)
        result["seconds"] = time.perf_counter() - t
        name = part if part == "peak" else f"{part}_{args.model}"
        (out / f"{name}.json").write_text(json.dumps(result, indent=2))
        if part == "peak":
            args.peak_tflops = result["matmul_tflops"]


if __name__ == "__main__":
    main()
