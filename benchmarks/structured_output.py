"""Throughput cost of structured output: the same requests with and without a JSON schema, one run.

For each vocabulary, `--requests` requests (the same random prompts, same max_tokens, temperature 1,
seeded) run to completion through LLMEngine, once plain (ignore_eos) and once with a JSON schema (an
object with a bounded string, a bounded integer, an enum and a string longer than max_tokens, so that
both runs generate exactly requests x max_tokens tokens in the same batch shapes), alternating `--repeats` times in one process; each
run uses a fresh engine that has already compiled the schema once (the compile is timed apart: the
first compile also builds the vocabulary's TokenizerInfo). Reported: generated tokens per second, the
median per-step 'sample' phase (which includes the masks), the masks' own median time per step
(StructuredOutputManager.apply_masks: fill every row's bitmask, apply them) and the ratio; then the
mask fill's cost per row at three places of the schema (xgrammar's cost depends on the grammar state).

Vocabularies: `byte` is the built-in tiny model (vocab 512, byte tokenizer, 259 ids); `bpe` is the
same model shape with a byte-level BPE tokenizer trained here on the venv's Python sources
(`--bpe-vocab` ids, cached under /tmp), closer to a real vocabulary for the mask's cost.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/structured_output.py
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import benchutil as bu
import torch

from ladle.engine import CacheConfig, ChunkingConfig, EngineConfig, LLMEngine, ModelConfig, SamplingParams
from ladle.engine.request import Request, RequestMetrics
from ladle.engine.sampling_params import StructuredOutputs

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "color": {"enum": ["red", "green", "blue"]},
        "notes": {"type": "string", "minLength": 4096},  # never complete: every request runs max_tokens
    },
    "required": ["name", "age", "color", "notes"],
}


def bpe_tokenizer(vocab: int) -> Path:
    """A byte-level BPE tokenizer with `vocab` ids trained on Python sources (built once, cached)."""
    path = Path(f"/tmp/ladle_bench_bpe_{vocab}")
    if (path / "tokenizer.json").is_file():
        return path
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    files = sorted(str(p) for p in (Path(sys.prefix) / "lib").rglob("*.py"))[:4000]
    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    raw.train(files, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    tok.save_pretrained(path)
    return path


def engine(kind: str, args) -> LLMEngine:
    arch = bu.preset_architecture("tiny")
    if kind == "byte":
        mc = ModelConfig(name="tiny", path=None, architecture=arch, tokenizer="byte", dtype="float32", device="cpu")
    else:
        arch.update(vocab_size=args.bpe_vocab, bos_token_id=1, eos_token_id=2, pad_token_id=0)
        mc = ModelConfig(name="tiny-bpe", path=None, architecture=arch, tokenizer=str(bpe_tokenizer(args.bpe_vocab)),
                         dtype="float32", device="cpu")
    return LLMEngine(EngineConfig(model=mc, cache=CacheConfig(max_model_len=args.prompt_len + args.max_tokens + 16),
                                  chunking=ChunkingConfig(size=2048), max_num_seqs=args.requests))


def run(eng: LLMEngine, prompts: list[list[int]], structured: bool, max_tokens: int) -> dict:
    so = StructuredOutputs(json_schema=SCHEMA) if structured else None
    mask_times: list[float] = []
    apply_masks = eng.structured.apply_masks

    def timed_apply_masks(logits, requests):  # the masks' own cost, apart from the noisy step
        t = time.perf_counter()
        apply_masks(logits, requests)
        mask_times.append(time.perf_counter() - t)

    eng.structured.apply_masks = timed_apply_masks
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        eng.add_request(p, SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=i, ignore_eos=True,
                                          structured=so))
    tokens, samples, finished = 0, [], []
    while eng.has_unfinished_requests():
        for out in eng.step():
            tokens += len(out.new_token_ids)
            if out.finished:
                finished.append(out)
        if eng.last_step is not None:
            samples.append(eng.last_step.phase_times.get("sample", 0.0))
    wall = time.perf_counter() - t0
    del eng.structured.apply_masks
    assert all(o.finish_reason == "length" for o in finished), [(o.finish_reason, o.error) for o in finished]
    return {"tok_s": tokens / wall, "tokens": tokens, "sample_ms": statistics.median(samples) * 1e3,
            "step_ms": wall / len(samples) * 1e3,
            "mask_ms": statistics.median(mask_times) * 1e3 if structured else 0.0}


def fill_cost(eng: LLMEngine, rows: int, repeats: int = 5) -> list[tuple[str, float]]:
    """Milliseconds per row to fill the mask of `rows` matchers (one batched call, median of repeats)
    at three places of SCHEMA: before the object, inside the bounded "name" string, inside "notes"."""
    import xgrammar as xgr

    mgr = eng.structured
    req = Request("fill", [1], SamplingParams(structured=StructuredOutputs(json_schema=SCHEMA)),
                  RequestMetrics(arrival_time=0.0))
    mgr.submit(req)
    compiled = req.grammar.compiled.result()
    out = []
    for label, prefix in [("start", ""), ('in "name" (maxLength 12)', '{"name": "ab'),
                          ('in "notes" (minLength 4096)', '{"name": "ab", "age": 7, "color": "red", "notes": "ab')]:
        ids = eng.tokenizer.encode(prefix, add_special_tokens=False) if prefix else []
        matchers = [xgr.GrammarMatcher(compiled) for _ in range(rows)]
        for m in matchers:
            assert all(m.accept_token(t) for t in ids), prefix
        bitmask = xgr.allocate_token_bitmask(rows, eng.vocab_size)
        filler = xgr.BatchGrammarMatcher(max_threads=mgr.xgrammar_threads)
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            filler.batch_fill_next_token_bitmask(matchers, bitmask)
            times.append(time.perf_counter() - t)
        out.append((label, statistics.median(times) / rows * 1e3))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocabs", nargs="+", default=["byte", "bpe"], choices=["byte", "bpe"])
    ap.add_argument("--bpe-vocab", type=int, default=32768)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1, help="discarded leading repeats (allocator, caches)")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    threads = bu.set_threads(args.threads)
    bu.quiet_random_weights()
    print(f"{args.requests} requests x prompt {args.prompt_len} / max_tokens {args.max_tokens}, temperature 1, "
          f"fp32 CPU, {threads} thread(s), {args.repeats} alternating repeats after {args.warmup} discarded")
    print("| vocab | first compile s | run | plain tok/s | json tok/s | json/plain | tokens each | "
          "step ms plain | json | sample ms/step plain | json | masks ms/step |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    fills: dict[str, list[tuple[str, float]]] = {}
    for kind in args.vocabs:
        gen = torch.Generator().manual_seed(0)
        probe = engine(kind, args)
        prompts = [bu.random_prompt(args.prompt_len, gen, 256) for _ in range(args.requests)]
        import xgrammar  # noqa: F401 - its import (about a second) is not the compile

        req = Request("probe", prompts[0], SamplingParams(structured=StructuredOutputs(json_schema=SCHEMA)),
                      RequestMetrics(arrival_time=0.0))
        t0 = time.perf_counter()
        probe.structured.submit(req)
        req.grammar.compiled.result()  # TokenizerInfo + the vocabulary masks + this schema
        first = time.perf_counter() - t0
        ratios = []
        for r in range(-args.warmup, args.repeats):
            res = {}
            for structured in ([False, True] if r % 2 == 0 else [True, False]):
                eng = engine(kind, args)
                eng.structured = probe.structured  # compiled already: the steady state, not the compile
                res[structured] = run(eng, prompts, structured, args.max_tokens)
            assert res[True]["tokens"] == res[False]["tokens"]
            if r < 0:
                continue
            ratio = res[True]["tok_s"] / res[False]["tok_s"]
            ratios.append(ratio)
            print(f"| {kind} | {first:.2f} | {r} | {res[False]['tok_s']:.0f} | {res[True]['tok_s']:.0f} | "
                  f"{ratio:.2f} | {res[False]['tokens']} | {res[False]['step_ms']:.2f} | {res[True]['step_ms']:.2f} | "
                  f"{res[False]['sample_ms']:.2f} | {res[True]['sample_ms']:.2f} | {res[True]['mask_ms']:.2f} |", flush=True)
        print(f"| {kind} | | median | | | **{statistics.median(ratios):.2f}** | | | | | | |", flush=True)
        fills[kind] = fill_cost(probe, args.requests)
    print(f"\nmask fill per row, {args.requests} rows in one batched call, xgrammar threads "
          f"{probe.structured.xgrammar_threads}, ms")
    print("| vocab | " + " | ".join(label for label, _ in next(iter(fills.values()))) + " |")
    print("|---|" + "---:|" * len(next(iter(fills.values()))))
    for kind, row in fills.items():
        print(f"| {kind} | " + " | ".join(f"{ms:.3f}" for _, ms in row) + " |")


if __name__ == "__main__":
    main()
