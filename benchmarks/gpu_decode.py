"""GPU: decode step time against the HBM bound, eager vs CUDA graphs; split-KV vs 2D attention.

For each model preset (random weights of the real architecture, bf16), one engine with CUDA graphs:
B requests of --context prompt tokens are prefilled, then decode-only steps are timed, alternating the
graph path and eager forwards of the same engine (the runner's graphs switched off and on), so both
read the same weights and cache. The bound is the bytes a decode step must read (every weight once,
plus each sequence's KV cache) over the copy bandwidth measured in the same run (read + write bytes of
a 4 GiB device-to-device copy / its time).

Then the attention kernels alone on long contexts: the split-KV path (kernels/triton_split_kv.py) and
the 2D kernel forced (split disabled), decode batches of 1-8 at contexts 4k-32k (triton.testing.do_bench).

    python benchmarks/gpu_decode.py --models qwen3_0_6b qwen3_4b --batches 1 32 256
"""

from __future__ import annotations

import argparse
import time

import benchutil as bu
import torch

from ladle.engine import CacheConfig, ChunkingConfig, EngineConfig, LLMEngine, SamplingParams

DEVICE = "cuda"


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth() -> float:
    """Bytes per second of a device-to-device copy, counting bytes read and written."""
    n = 1 << 30
    src = torch.empty(n, dtype=torch.float32, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    torch.cuda.synchronize()
    return 2 * src.numel() * 4 * 10 / (time.perf_counter() - t)


def matmul_tflops() -> float:
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    for _ in range(3):
        a @ a
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        a @ a
    torch.cuda.synchronize()
    return 2 * 8192**3 * 10 / (time.perf_counter() - t) / 1e12


PHASES = ("schedule", "prepare", "forward", "sample", "update")


def timed_steps(eng: LLMEngine, n: int, phases: dict[str, list[float]] | None = None) -> list[float]:
    out = []
    for _ in range(n):
        sync()
        t = time.perf_counter()
        eng.step()
        sync()
        out.append(time.perf_counter() - t)
        s = eng.last_step
        assert s is not None and s.prefill_tokens == 0, "a timed step carried prefill tokens"
        if phases is not None:
            for k in PHASES:
                phases.setdefault(k, []).append(s.phase_times.get(k, 0.0))
    return out


def profile_steps(eng: LLMEngine, n: int, rows: int = 25, label: str = "graph") -> None:
    """A torch profiler table of n decode steps: which host ops and kernels a step spends its time on."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEVICE == "cuda" else [])
    with profile(activities=acts) as prof:
        timed_steps(eng, n)
    # On the GPU, by the kernels' own time: a graph launch is one host call, its kernels are the rows.
    key = "self_cuda_time_total" if DEVICE == "cuda" else "self_cpu_time_total"
    print(f"  profile of {n} {label} decode steps, by {key}:", flush=True)
    print(prof.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=70), flush=True)


def decode_rows(name: str, batches: list[int], context: int, steps: int, bandwidth: float,
                profile_batches: tuple[int, ...] = (), compile: bool = False) -> list[list]:
    arch = bu.preset_architecture(name)
    max_seqs = max(batches)
    max_len = context + 4 * steps + 64
    kv_tokens = max_seqs * (-(-max_len // 16) * 16)
    mc = bu.engine_model_config(arch, dtype="bfloat16")
    mc.device = DEVICE
    mc.compile = compile  # both rows then run the compiled forward: with graphs, and without
    t = time.perf_counter()
    eng = LLMEngine(EngineConfig(model=mc, cache=CacheConfig(max_model_len=max_len, num_blocks=kv_tokens // 16,
                                                             prefix_caching=False),
                                 chunking=ChunkingConfig(size=2048), max_num_seqs=max_seqs))
    build_s = time.perf_counter() - t
    recorded = getattr(eng.model_runner.graphs, "records_compiled", None)
    print(f"{name}: built in {build_s:.1f}s (Triton warm-up {eng.kernel_warmup_s:.1f}s, graph capture "
          f"{eng.graph_capture_s or 0:.1f}s; graphs of the {'compiled' if recorded else 'eager'} forward)", flush=True)
    weight_bytes = sum(p.numel() * p.element_size() for p in eng.model.parameters())
    kv_per_token = eng.kv_spec.bytes_per_token
    graphs = eng.model_runner.graphs
    gen = torch.Generator().manual_seed(0)
    rows = []
    for b in batches:
        params = SamplingParams(max_tokens=4 * steps + 16, temperature=0.0, ignore_eos=True)
        for _ in range(b):
            eng.add_request(bu.random_prompt(context, gen, arch["vocab_size"]), params)
        while True:  # prefill every prompt
            eng.step()
            s = eng.last_step
            if eng.scheduler.num_waiting == 0 and s is not None and s.prefill_tokens == 0:
                break
        times = {"graphs": [], "eager": []}
        phases: dict[str, list[float]] = {}
        for r in range(4):  # alternate: graphs, eager, eager, graphs
            for mode in (("graphs", "eager") if r % 2 == 0 else ("eager", "graphs")):
                eng.model_runner.graphs = graphs if mode == "graphs" else None
                times[mode] += timed_steps(eng, max(1, steps // 4), phases if mode == "graphs" else None)
        eng.model_runner.graphs = graphs
        print(f"  batch {b}, graph steps' phases (median ms): "
              + ", ".join(f"{k} {bu.median(v) * 1e3:.2f}" for k, v in phases.items()), flush=True)
        if b in profile_batches:
            profile_steps(eng, 4)
            if compile:
                eng.model_runner.graphs = None
                profile_steps(eng, 4, label="compiled, no graph,")
                eng.model_runner.graphs = graphs
        for rid in list(eng.requests):
            eng.abort_request(rid)
        while eng.has_unfinished_requests():
            eng.step()
        read = weight_bytes + b * (context + steps) * kv_per_token
        bound = read / bandwidth
        g, e = bu.median(times["graphs"]), bu.median(times["eager"])
        rows.append([name, b, context, f"{g * 1e3:.2f}", f"{e * 1e3:.2f}", f"{bound * 1e3:.2f}",
                     f"{g / bound:.2f}x", f"{e / bound:.2f}x"])
        print("  " + " | ".join(str(x) for x in rows[-1]), flush=True)
    del eng
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return rows


def time_attention(b: int, ctx: int, policy) -> tuple[float, torch.Tensor]:
    """Microseconds of one decode attention call (b rows of context ctx) under a split policy, and its output."""
    import triton.testing

    from ladle.kernels import AttentionMetadata, triton_launch
    from ladle.kernels.triton_attention import triton_attention

    heads, kv_heads, dim, bs = 32, 8, 128, 16
    gen = torch.Generator(device="cuda").manual_seed(0)
    blocks = -(-ctx // bs)
    cache = torch.randn(2, b * blocks, bs, kv_heads, dim, dtype=torch.bfloat16, device="cuda", generator=gen)
    tables = [list(range(i * blocks, (i + 1) * blocks)) for i in range(b)]
    q = torch.randn(b, heads, dim, dtype=torch.bfloat16, device="cuda", generator=gen)
    k = torch.randn(b, kv_heads, dim, dtype=torch.bfloat16, device="cuda", generator=gen)
    v = torch.randn(b, kv_heads, dim, dtype=torch.bfloat16, device="cuda", generator=gen)

    saved = triton_launch.DEFAULT_POLICY
    triton_launch.DEFAULT_POLICY = policy
    # Metadata built once and its launch plan kept (as every layer after a forward's first): the
    # kernels' time and their Python launch, not the host's metadata build.
    meta = AttentionMetadata.build([1] * b, [ctx] * b, tables, bs, device="cuda", backend="triton")

    def call() -> torch.Tensor:
        return triton_attention(q, k, v, cache, meta, scale=dim**-0.5)

    try:
        out = call()
        return triton.testing.do_bench(call, warmup=5, rep=50) * 1e3, out
    finally:
        triton_launch.DEFAULT_POLICY = saved


def attention_rows(contexts: list[int], batches: list[int]) -> list[list]:
    from ladle.kernels import triton_launch

    rows = []
    for ctx in contexts:
        for b in batches:
            split_us, split_out = time_attention(b, ctx, triton_launch.SplitPolicy())
            flat_us, flat_out = time_attention(b, ctx, triton_launch.SplitPolicy(max_segments=1))
            err = float((split_out.float() - flat_out.float()).abs().max())
            kv_bytes = 2 * b * ctx * 8 * 128 * 2
            rows.append([ctx, b, f"{split_us:.1f}", f"{flat_us:.1f}", f"{flat_us / split_us:.2f}x",
                         f"{kv_bytes / (split_us * 1e-6) / 1e12:.2f}", f"{err:.1e}"])
            print("  " + " | ".join(str(x) for x in rows[-1]), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=["qwen3_0_6b", "qwen3_4b"])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32, 256])
    ap.add_argument("--context", type=int, default=512, help="prompt tokens of each decoding request")
    ap.add_argument("--steps", type=int, default=16, help="timed decode steps per mode and batch")
    ap.add_argument("--attention-contexts", type=int, nargs="+", default=[4096, 16384, 32768])
    ap.add_argument("--attention-batches", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--skip-attention", action="store_true")
    ap.add_argument("--compile", action="store_true",
                    help="model.compile=true: graphs record the compiled forward, the eager rows run it without graphs")
    ap.add_argument("--profile-batches", type=int, nargs="*", default=[],
                    help="after timing these batches, print a torch profiler table of 4 graph steps")
    ap.add_argument("--cpu-dry-run", action="store_true", help="check the script's logic on the CPU (tiny model)")
    args = ap.parse_args()
    bu.quiet_random_weights()
    if args.cpu_dry_run:
        global DEVICE
        DEVICE = "cpu"
        bw = 1e11
    else:
        print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}")
        bw = copy_bandwidth()
        print(f"copy bandwidth (read + write): {bw / 1e12:.2f} TB/s; bf16 8192^3 matmul: "
              f"{matmul_tflops():.0f} TFLOP/s")
    rows = []
    for name in args.models:
        rows += decode_rows(name, args.batches, args.context, args.steps, bw, tuple(args.profile_batches), args.compile)
    print()
    plain = "compiled, no graphs" if args.compile else "eager"
    print(bu.markdown_table(["model", "batch", "context", "graphs ms", f"{plain} ms", "HBM bound ms",
                             "graphs / bound", f"{plain} / bound"], rows))
    if not args.skip_attention:
        print("\nattention, decode rows, 32 q / 8 kv heads x 128, bf16:")
        arows = attention_rows(args.attention_contexts, args.attention_batches)
        print(bu.markdown_table(["context", "batch", "split-KV us", "2D us", "2D / split", "split KV TB/s",
                                 "max |diff|"], arows))


if __name__ == "__main__":
    main()
