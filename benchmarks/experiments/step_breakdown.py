"""Where a step's time goes: per-phase breakdown, op profile, and the forward's share of matmul peak.

For each model (default: the built-in `tiny` model, where Python overhead dominates, and the
Qwen3-0.6B architecture with random weights, fp32), steps of LLMEngine are timed in these states:

- decode batch 1, 16 and 64 (prompts of --context tokens, every request decoding);
- a mixed step: 16 decodes + one prefill chunk of --chunk tokens of a longer prompt.

Each row is the median over --steps steps of StepStats.phase_times (schedule, prepare = flattened
batch + attention metadata, forward, sample, update). A torch.profiler pass over the same kinds of
steps gives the ops that dominate (self CPU time per step).

Then the forward's efficiency on prefill-heavy work: torch matmul GFLOP/s is measured on this CPU with
the model's own linear shapes at the step's token count; a prefill-only step's useful FLOPs are
2 * (decoder matmul parameters) * tokens + attention (4 * heads * head_dim per visible query-key pair)
+ the LM head on its sampled rows; the fraction is (FLOPs / forward seconds) / matmul GFLOP/s.

    PYTHONPATH=benchmarks .venv/bin/python benchmarks/experiments/step_breakdown.py --quick
    PYTHONPATH=benchmarks .venv/bin/python benchmarks/experiments/step_breakdown.py --write-docs
"""

from __future__ import annotations

import argparse
import math
import time

import benchutil as bu
import torch
import torch.nn.functional as F

from ladle.engine import CacheConfig, ChunkingConfig, EngineConfig, LLMEngine, SamplingParams
from ladle.models.op_count import decode_ops_per_layer

PHASES = ["schedule", "prepare", "forward", "sample", "update"]


def model_arch(name: str) -> dict:
    return bu.preset_architecture(name)


def make_engine(arch: dict, dtype: str, max_num_seqs: int, chunk: int, max_model_len: int, tokens: int):
    cfg = EngineConfig(
        model=bu.engine_model_config(arch, dtype=dtype),
        cache=CacheConfig(num_blocks=math.ceil(tokens / 16) + max_num_seqs + 8, max_model_len=max_model_len),
        chunking=ChunkingConfig(size=chunk),
        max_num_seqs=max_num_seqs,
    )
    return LLMEngine(cfg)


def start_decoders(eng: LLMEngine, batch: int, context: int, max_tokens: int, gen: torch.Generator) -> None:
    """Add `batch` requests and step until every one of them is decoding."""
    vocab = eng.vocab_size
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        eng.add_request(bu.random_prompt(context, gen, vocab), sp, request_id=f"d{batch}-{i}")
    while True:
        eng.step()
        s = eng.last_step
        if s.prefill_tokens == 0 and s.decode_tokens == batch:
            return


def collect(eng: LLMEngine, n: int, want) -> list:
    out = []
    guard = 0
    while len(out) < n:
        eng.step()
        guard += 1
        if guard > 50 * n:
            raise RuntimeError("the engine never reached the wanted step shape")
        s = eng.last_step
        if want(s):
            out.append(s)
    return out


def abort_all(eng: LLMEngine) -> None:
    for rid in list(eng.requests):
        eng.abort_request(rid)
    while eng.has_unfinished_requests():
        eng.step()


def measure_states(eng: LLMEngine, batches: list[int], mixed_batch: int, chunk: int, context: int,
                   steps: int, profile_steps: int, warmup: int = 2, long_context: int = 0):
    """Returns {state: [StepStats]} and {state: profiler key averages (or None)}. One engine throughout;
    the requests of a state are aborted before the next state starts."""
    gen = torch.Generator().manual_seed(0)
    results, profiles = {}, {}
    n_decode = steps + profile_steps + warmup
    for b in batches:
        start_decoders(eng, b, context, n_decode + 4, gen)
        collect(eng, warmup, lambda s: True)
        results[f"decode {b}"] = collect(eng, steps, lambda s, b=b: s.decode_tokens == b and s.prefill_tokens == 0)
        profiles[f"decode {b}"] = profile(eng, profile_steps) if profile_steps else None
        abort_all(eng)
    if long_context:
        # The same decode batch as "decode {mixed_batch}", but one of its requests has a long context.
        b = mixed_batch
        start_decoders(eng, b - 1, context, n_decode + 16 + long_context // chunk, gen)
        eng.add_request(bu.random_prompt(long_context, gen, eng.vocab_size),
                        SamplingParams(max_tokens=n_decode + 4, temperature=0.0, ignore_eos=True), request_id="lc")
        collect(eng, 1, lambda s, b=b: s.decode_tokens == b and s.prefill_tokens == 0)
        collect(eng, warmup, lambda s: True)
        key = f"decode {b}, one at {long_context} context"
        results[key] = collect(eng, steps, lambda s, b=b: s.decode_tokens == b and s.prefill_tokens == 0)
        profiles[key] = profile(eng, profile_steps) if profile_steps else None
        abort_all(eng)
    # Mixed: `mixed_batch` decodes plus one chunk of a long prompt per step.
    n_chunks = steps + profile_steps + warmup + 1
    start_decoders(eng, mixed_batch, context, 4 * n_chunks + 8, gen)
    eng.add_request(bu.random_prompt(chunk * n_chunks, gen, eng.vocab_size), SamplingParams(max_tokens=1),
                    request_id="long")
    key = f"mixed {mixed_batch} + {chunk} (context {warmup * chunk}-{(warmup + steps - 1) * chunk})"

    def is_mixed(s):
        return s.decode_tokens == mixed_batch and s.prefill_tokens == chunk

    collect(eng, warmup, is_mixed)
    results[key] = collect(eng, steps, is_mixed)
    profiles[key] = profile(eng, profile_steps) if profile_steps else None
    abort_all(eng)
    return results, profiles


def profile(eng: LLMEngine, n: int):
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(n):
            eng.step()
    return prof.key_averages(), n


def phase_rows(results: dict) -> list[list]:
    rows = []
    for state, stats in results.items():
        tokens = stats[0].decode_tokens + stats[0].prefill_tokens
        ph = {p: bu.median(s.phase_times.get(p, 0.0) for s in stats) * 1e3 for p in PHASES}
        total = bu.median(sum(s.phase_times.values()) for s in stats) * 1e3
        outside = total - ph["forward"]
        rows.append([state, tokens, total] + [ph[p] for p in PHASES]
                    + [f"{100 * outside / total:.1f}%", total / tokens])
    return rows


def top_ops(prof, limit: int = 8) -> list[list]:
    averages, n = prof
    events = [e for e in averages if e.key.startswith("aten::") or e.key.startswith("mkldnn")]
    total = sum(e.self_cpu_time_total for e in averages)
    events.sort(key=lambda e: e.self_cpu_time_total, reverse=True)
    rows = []
    for e in events[:limit]:
        rows.append([e.key, e.self_cpu_time_total / 1e3 / n, f"{100 * e.self_cpu_time_total / total:.1f}%",
                     round(e.count / n)])
    ops = sum(e.count for e in averages if e.key.startswith("aten::")) / n
    rows.append(["(all aten ops: calls per step)", total / 1e3 / n, "100%", round(ops)])
    return rows


# -- matmul peak and prefill efficiency ----------------------------------------------------------------
def linear_shapes(arch: dict) -> list[tuple[int, int]]:
    """(in, out) of each per-token matmul of one decoder layer."""
    h = arch["hidden_size"]
    d = arch.get("head_dim") or h // arch["num_attention_heads"]
    q, kv, inter = arch["num_attention_heads"] * d, arch["num_key_value_heads"] * d, arch["intermediate_size"]
    return [(h, q), (h, kv), (h, kv), (q, h), (h, inter), (h, inter), (inter, h)]


def matmul_gflops(arch: dict, tokens: int, dtype: torch.dtype, seconds: float = 1.0) -> float:
    """Effective GFLOP/s of torch on one layer's linears (F.linear, as the model calls them) at `tokens` rows."""
    shapes = linear_shapes(arch)
    xs = {k: torch.randn(tokens, k, dtype=dtype) for k in {i for i, _ in shapes}}
    ws = [torch.randn(o, i, dtype=dtype) for i, o in shapes]
    flops = sum(2 * tokens * i * o for i, o in shapes)

    def layer():
        for (i, _), w in zip(shapes, ws):
            F.linear(xs[i], w)

    layer()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds or n < 2:
        layer()
        n += 1
    return flops * n / (time.perf_counter() - t0) / 1e9


def prefill_flops(arch: dict, tokens: int, context: int, sampled_rows: int) -> float:
    h = arch["hidden_size"]
    d = arch.get("head_dim") or h // arch["num_attention_heads"]
    heads = arch["num_attention_heads"]
    pairs = tokens * context + tokens * (tokens + 1) / 2  # visible (query, key) pairs, causal
    attn = 4 * heads * d * pairs * arch["num_hidden_layers"]
    return 2 * bu.linear_params(arch) * tokens + attn + 2 * h * arch["vocab_size"] * sampled_rows


def prefill_efficiency(eng: LLMEngine, arch: dict, dtype: str, tokens: int, contexts: list[int],
                       repeats: int) -> list[list]:
    """Prefill-only steps of `tokens` tokens (the engine's chunk size) at each context; torch matmul
    throughput on the same shapes measured right after each."""
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    rows = []
    gen = torch.Generator().manual_seed(1)
    for ctx in contexts:
        fwd, peak = [], []
        for r in range(repeats):
            eng.add_request(bu.random_prompt(ctx + tokens, gen, arch["vocab_size"]), SamplingParams(max_tokens=1),
                            request_id=f"p{ctx}-{r}")
            last = None
            while eng.has_unfinished_requests():
                eng.step()
                last = eng.last_step or last
            # The prompt's last step is the chunk of `tokens` tokens at context `ctx` (and it samples).
            fwd.append(last.phase_times["forward"])
            peak.append(matmul_gflops(arch, tokens, torch_dtype, seconds=0.5))
        flops = prefill_flops(arch, tokens, ctx, 1)
        f = bu.median(fwd)
        p = bu.median(peak)
        rows.append([f"{tokens} tokens at context {ctx}", flops / 1e9, f, flops / f / 1e9, p,
                     f"{100 * flops / f / 1e9 / p:.0f}%"])
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer steps; the 0.6B model only at batch 1/16 (< 2 min)")
    ap.add_argument("--write-docs", action="store_true", help="write the report to benchmarks/results/")
    ap.add_argument("--models", nargs="+", default=["tiny", "qwen3_0_6b"], help="conf/model presets")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--mixed-batch", type=int, default=16)
    ap.add_argument("--long-context", type=int, default=4096,
                    help="small models only: a decode batch of --mixed-batch where one request has this "
                         "context (0 = skip)")
    ap.add_argument("--chunk", type=int, default=512, help="prefill chunk of the mixed step and of the "
                    "prefill-only steps (quick: 64 for the 0.6B model)")
    ap.add_argument("--context", type=int, default=None, help="prompt tokens of each decoding request "
                    "(default 128 for small models, 32 for the 0.6B one; quick 16 for it)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per state (default 8, 3 for the 0.6B "
                    "model; quick 3 and 2)")
    ap.add_argument("--profile-steps", type=int, default=None, help="profiled steps per state (default 2, 1 for "
                    "the 0.6B model)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (0 = torch default)")
    args = ap.parse_args()
    q = args.quick
    threads = bu.set_threads(args.threads)
    bu.quiet_random_weights()

    sections = []
    for name in args.models:
        arch = model_arch(name)
        big = bu.linear_params(arch) > 50e6
        batches = [b for b in args.batches if not (q and big and b > 16)]
        chunk = min(args.chunk, 64) if (q and big) else args.chunk
        context = args.context or ((16 if q else 32) if big else 128)
        steps = args.steps or ((2 if q else 3) if big else (3 if q else 8))
        profile_steps = args.profile_steps if args.profile_steps is not None else (1 if big else 2)
        print(f"\n== {name}: {bu.describe_arch(arch)}, {args.dtype}, torch threads {threads}", flush=True)
        t0 = time.perf_counter()
        warmup = 1 if big else 2
        n_decode = steps + profile_steps + warmup + 8
        n_chunks = steps + profile_steps + warmup + 1
        eff_ctx = [0] if q else [0, 3 * chunk]
        kv_tokens = max(max(batches) * (context + n_decode + 16), args.mixed_batch * (context + 4 * n_chunks + 16)
                        + chunk * n_chunks, max(eff_ctx) + chunk) + 64
        long_context = 0 if big else args.long_context
        kv_tokens += long_context + args.mixed_batch * (long_context // chunk + 16) + n_decode + 16
        max_len = max(context + 4 * n_chunks + 16, chunk * n_chunks, max(eff_ctx) + chunk,
                      long_context + n_decode + 16, context + n_decode + 16 + long_context // chunk + 16) + 16
        arch["max_position_embeddings"] = max(arch["max_position_embeddings"], max_len)  # tiny has 4096
        eng = make_engine(arch, args.dtype, max(*batches, args.mixed_batch + 1), chunk, max_len, kv_tokens)
        ops = decode_ops_per_layer(eng.model, [context] * 4)
        ops_line = (f"aten ops per decoder layer, decode forward of 4 sequences (eager, models/op_count.py): "
                    f"{ops['compute']:.1f} compute + {ops['views']:.1f} view ops")
        print(ops_line)
        results, profiles = measure_states(eng, batches, args.mixed_batch, chunk, context, steps, profile_steps,
                                           warmup, long_context)
        headers = ["state", "tokens", "step ms"] + [f"{p} ms" for p in PHASES] + ["outside forward",
                                                                                 "ms per token"]
        table = bu.markdown_table(headers, phase_rows(results))
        print(table)
        prof_tables = []
        for state, prof in profiles.items():
            if prof is None or not (state == f"decode {max(batches)}" or state.startswith("mixed")
                                    or state == "decode 1" or "context" in state):
                continue
            pt = bu.markdown_table(["op", "self ms per step", "share", "calls per step"], top_ops(prof))
            prof_tables.append((state, pt))
            print(f"\nprofile, {state}:\n{pt}")
        eff = prefill_efficiency(eng, arch, args.dtype, chunk, eff_ctx, 1 if (q or big) else 2)
        del eng
        eff_table = bu.markdown_table(["prefill-only step", "GFLOP", "forward s", "forward GFLOP/s",
                                       "torch matmul GFLOP/s (same shapes)", "fraction"], eff)
        print(f"\n{eff_table}\n({time.perf_counter() - t0:.0f}s)")
        sections.append((name, arch, table, prof_tables, eff_table, context, steps, ops_line))

    if args.write_docs:
        cmd = f"PYTHONPATH=benchmarks .venv/bin/python benchmarks/experiments/step_breakdown.py{' --quick' if q else ''} --write-docs"
        lines = [f"Command: `{cmd}` (torch threads {threads}, {args.dtype}).", ""]
        for name, arch, table, prof_tables, eff_table, context, steps, ops_line in sections:
            lines += [f"### {name}: {bu.describe_arch(arch)}", "", ops_line + ".", "",
                      f"Decoding requests have {context}-token prompts; medians over {steps} steps per state.", "",
                      table, ""]
            for state, pt in prof_tables:
                lines += [f"Op profile, {state} (torch.profiler, self CPU time):", "", pt, ""]
            lines += [("Forward efficiency on prefill-only steps (FLOPs = 2 x decoder-matmul params x tokens + "
                      "attention + LM head on the sampled row; torch matmul measured on the same linear shapes "
                      "and token count right after):"), "", eff_table, ""]
        body = "\n".join(lines)
        print("wrote", bu.write_docs_section("step_breakdown", body))


if __name__ == "__main__":
    main()
