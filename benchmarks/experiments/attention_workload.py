"""vs_vllm.py's workload's attention, replayed through the cpu_paged kernel and a baseline revision's.

The schedule is recorded once: the engine (chunked prefill, step budget 512, max_num_seqs 64, paged
cache of block 16, prefix caching off) runs the workload's 32 prompts (benchmarks/vs_vllm.py's, seed 0,
~12,000 tokens) x 32 greedy tokens on a tiny random Qwen3 of one layer (the schedule is the
scheduler's, not the model's), and each forward's query and sequence lengths are kept. Then every
forward's attention is replayed at the real model's shapes (16 heads / 8 KV heads x 64, fp32, 8 layers,
each layer its own paged cache, new keys/values written by the call) on random data, through each
kernel in turn (the order alternates every repeat). Reported: seconds in forwards that carry a prefill
chunk, in decode-only forwards, the total, and GFLOP/s of the prefill chunks' attention.

Each layer's cache holds the blocks the schedule needs, scattered at random, not the engine's whole pool in
allocation order: effects of the pool's size on the layout (the K and V planes' distance, engine/kv_cache.py,
docs/design-notes.md) do not show here.

    PYTHONPATH=.:benchmarks .venv/bin/python benchmarks/experiments/attention_workload.py --baseline REV [--threads 1] [--clock cpu]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import benchutil as bu
import torch
from attention_cpu import attention_fns, baseline_kernel, in_layout

from ladle.kernels import AttentionMetadata, cpu_layers, cpu_paged

HEADS, KV_HEADS, HEAD_DIM, LAYERS, BLOCK = 16, 8, 64, 8, 16


def record_schedule() -> list[tuple[list[int], list[int]]]:
    """(query lens, seq lens) of every forward of the workload, from the engine's own scheduler."""
    import vs_vllm
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from ladle.engine import CacheConfig, ChunkingConfig, EngineConfig, LLMEngine, ModelConfig, SamplingParams

    model_dir = Path(tempfile.mkdtemp(prefix="attention-workload-"))
    torch.manual_seed(0)
    # Two layers: the last one attends only with the rows that are read (AttentionMetadata.outputs);
    # the first is every layer before it, the full schedule kept here.
    arch = dict(vs_vllm.ARCH, hidden_size=128, intermediate_size=256, num_hidden_layers=2, head_dim=8)
    Qwen3ForCausalLM(Qwen3Config(**arch)).save_pretrained(model_dir, safe_serialization=True)
    prompts = vs_vllm.make_prompts(32, 12000, 0, arch["vocab_size"])
    forwards: list[tuple[list[int], list[int]]] = []
    kernel = cpu_paged.cpu_paged_attention

    first_layer: list[AttentionMetadata] = []

    def recording(q, k, v, kv_cache, meta, **kw):
        prev = first_layer[-1] if first_layer else None
        last_layer = prev is not None and (meta is prev or (prev.outputs is not None and meta is prev.outputs.meta))
        if not last_layer:
            first_layer.append(meta)
            forwards.append((meta.query_start_loc.diff().tolist(), meta.seq_lens.tolist()))
        return kernel(q, k, v, kv_cache, meta, **kw)

    cpu_paged.cpu_paged_attention = recording
    # The layer stack calls the kernel from C++ (kernels/cpu_layers): the first layer must run op by op
    # here, or only the last layer's (output rows only) calls would be recorded.
    stack_was = cpu_layers.enabled()
    cpu_layers.set_enabled(False)
    try:
        eng = LLMEngine(EngineConfig(
            model=ModelConfig(name="schedule", path=str(model_dir), tokenizer="byte", dtype="float32", device="cpu"),
            cache=CacheConfig(backend="paged", block_size=BLOCK, max_model_len=4096, prefix_caching=False),
            chunking=ChunkingConfig(enabled=True, size=512, token_budget=512), max_num_seqs=64))
        eng.generate(prompts, SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))
    finally:
        cpu_paged.cpu_paged_attention = kernel
        cpu_layers.set_enabled(stack_was)
    if not any(max(q) > 1 for q, _ in forwards):
        raise SystemExit("recorded no forward with a prefill chunk: the recording missed the first layer's calls")
    return forwards


class Replay:
    """Random q/k/v per forward and one paged cache per layer, each sequence's blocks fixed."""

    def __init__(self, forwards: list[tuple[list[int], list[int]]], gen: torch.Generator) -> None:
        longest: dict[int, int] = {}
        for _, seq_lens in forwards:  # a forward lists the running sequences, in admission order
            for i, n in enumerate(seq_lens):
                longest[i] = max(longest.get(i, 0), n)
        # Slot i (the i-th sequence of a forward) gets blocks for the longest sequence it ever holds.
        need = [-(-longest[i] // BLOCK) for i in range(len(longest))]
        perm = torch.randperm(sum(need), generator=gen).tolist()
        self.tables, at = [], 0
        for n in need:
            self.tables.append(perm[at : at + n])
            at += n
        shape = (2, len(perm), BLOCK, KV_HEADS, HEAD_DIM)
        self.caches = [torch.randn(shape, generator=gen) for _ in range(LAYERS)]  # token-major
        self.steps = []
        for qls, sls in forwards:
            t = sum(qls)
            meta = AttentionMetadata.build(qls, sls, self.tables[: len(qls)], BLOCK)
            qkv = [torch.randn(t, h, HEAD_DIM, generator=gen) for h in (HEADS, KV_HEADS, KV_HEADS)]
            pairs = sum(q * (s - q) + q * (q + 1) // 2 for q, s in zip(qls, sls) if q > 1)
            self.steps.append((max(qls) > 1, meta, qkv, 4 * pairs * HEADS * HEAD_DIM * LAYERS))

    def layer_caches(self, engine_layout: bool) -> list[torch.Tensor]:
        """Each kernel its own copy of the caches, in the layout it reads (attention_cpu.in_layout)."""
        return [in_layout(c.clone(), engine_layout) for c in self.caches]

    def run(self, fn, caches: list[torch.Tensor], clock, outputs: list | None = None) -> tuple[float, float]:
        """Seconds in prefill-carrying forwards and in decode-only ones; every call's output appended to
        `outputs` when given (the warm-up's, for the bit check)."""
        spent = {True: 0.0, False: 0.0}
        for prefill, meta, (q, k, v), _ in self.steps:
            meta.cache.clear()
            start = clock()
            for layer in range(LAYERS):
                out = fn(q, k, v, caches[layer], meta, scale=HEAD_DIM**-0.5)
                if outputs is not None:
                    outputs.append(out)
            spent[prefill] += clock() - start
        return spent[True], spent[False]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline", metavar="REV", help="git revision of the kernel to compare (default: torch)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--clock", choices=["wall", "cpu"], default="wall")
    args = p.parse_args()
    if args.clock == "cpu" and args.threads != 1:
        p.error("--clock cpu times one thread: use it with --threads 1")
    forwards = record_schedule()
    torch.set_num_threads(args.threads)
    fns = attention_fns(baseline_kernel(args.baseline) if args.baseline else None)
    replay = Replay(forwards, torch.Generator().manual_seed(0))
    gflop = sum(s[3] for s in replay.steps) / 1e9
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    print(f"{len(forwards)} forwards ({sum(s[0] for s in replay.steps)} with a prefill chunk), {LAYERS} layers, "
          f"{gflop:.1f} GFLOP of prefill attention; {args.threads} thread(s), {args.clock} clock; "
          f"load average {bu.load_average()}")
    names = list(fns)
    caches = {name: replay.layer_caches(engine_layout) for name, (_, engine_layout) in fns.items()}
    outs: dict[str, list[torch.Tensor]] = {name: [] for name in names}
    for name in names:  # warm-up (and the kernel's first build), keeping every output
        replay.run(fns[name][0], caches[name], clock, outs[name])
    a, b = outs.values()
    same = sum(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    same = f"{same} / {len(a)}"
    del outs, a, b
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
    for r in range(args.repeats):
        for name in names if r % 2 == 0 else names[::-1]:
            times[name].append(replay.run(fns[name][0], caches[name], clock))
    rows = []
    for name in names:
        pre = statistics.median(t[0] for t in times[name])
        dec = statistics.median(t[1] for t in times[name])
        tot = statistics.median(t[0] + t[1] for t in times[name])
        rows.append([name, f"{pre:.3f}", f"{dec:.3f}", f"{tot:.3f}", f"{gflop / pre:.1f}"])
    ratio = statistics.median(a[0] + a[1] for a in times[names[0]]) / statistics.median(
        b[0] + b[1] for b in times["cpu_paged"])
    print(bu.markdown_table(["kernel", "prefill forwards s", "decode forwards s", "total s",
                             "GFLOP/s (prefill forwards)"], rows))
    print(f"\ncpu_paged speed vs {names[0]}: {ratio:.2f}x (medians of {args.repeats}); "
          f"(forward, layer) outputs bitwise equal: {same}")


if __name__ == "__main__":
    main()
