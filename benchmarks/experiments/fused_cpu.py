"""The fused CPU elementwise kernels (kernels/cpu_fused.py) against the torch ops they replace, alternated.

Model: vs_vllm.py's random Qwen3 (8 layers, hidden 1024, intermediate 3072, 16 heads / 8 KV heads x 64,
qk-norm, vocab 32,000), fp32. Per op, on one decoder layer's own modules, the same call with the fused
path switched on and off (cpu_fused.set_enabled), order rotating every repeat, median ms per call:
- residual add + RMSNorm [rows, 1024] (RMSNorm.add_and_norm; twice per layer);
- qk RMSNorm + RoPE over the 24 q/k heads of the qkv output [rows, 32 x 64] (Attention._qk_norm_rope);
- RoPE alone over the same heads (Llama's case: the same module without its q/k norms);
- SiLU(gate) * up from the gate|up output [rows, 2 x 3072] (MLP's torch path: act(gate) * up);
then one layer's sum of them, and a whole forward of a mixed step (one prefill chunk + 32 decodes,
`rows` tokens in all) with the fused path on and off, greedy tokens of its last rows compared.

    PYTHONPATH=benchmarks .venv/bin/python benchmarks/experiments/fused_cpu.py [--rows-list 512,32] [--threads-list 1,2] [--repeats 7] [--write-docs]
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import benchutil as bu
import torch

from ladle.engine.kv_cache import layer_cache
from ladle.kernels import AttentionMetadata, cpu_fused
from ladle.models import load_model

ARCH = {
    "architectures": ["Qwen3ForCausalLM"], "hidden_size": 1024, "intermediate_size": 3072,
    "num_hidden_layers": 8, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 64,
    "vocab_size": 32000, "max_position_embeddings": 4096, "tie_word_embeddings": False,
    "rms_norm_eps": 1e-6, "rope_theta": 1_000_000.0,
}
BLOCK = 16
DECODES = 32


def time_ms(fn, n: int) -> float:
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n * 1e3


@torch.inference_mode()
def alternate(fns: dict, repeats: int, budget_s: float = 0.15) -> dict[tuple[str, bool], tuple[float, float]]:
    """ms per call of each fn (name -> callable), fused on and off alternated, repeats times:
    {(name, on): (median, best)} over the repeats."""
    for fn in fns.values():
        for on in (True, False):
            cpu_fused.set_enabled(on)
            fn()
    once = max(time_ms(fn, 1) for fn in fns.values())
    n = max(1, min(500, int(budget_s * 1e3 / max(once, 1e-3))))
    times: dict[tuple[str, bool], list[float]] = {}
    for r in range(repeats):
        for on in ((True, False) if r % 2 == 0 else (False, True)):
            cpu_fused.set_enabled(on)
            for name, fn in fns.items():
                times.setdefault((name, on), []).append(time_ms(fn, n))
    cpu_fused.set_enabled(True)
    return {key: (statistics.median(v), min(v)) for key, v in times.items()}


def op_cases(model, rows: int, gen: torch.Generator) -> dict[str, object]:
    layer = model.model.layers[0]
    attn, mlp, norm = layer.self_attn, layer.mlp, layer.post_attention_layernorm
    h, d = ARCH["hidden_size"], ARCH["head_dim"]
    heads = ARCH["num_attention_heads"] + ARCH["num_key_value_heads"]
    x, residual = torch.randn(rows, h, generator=gen), torch.randn(rows, h, generator=gen)
    qkv = torch.randn(rows, (heads + ARCH["num_key_value_heads"]) * d, generator=gen)
    qk = qkv[:, : heads * d].view(rows, heads, d)
    cos, sin = next(iter(model.rope.values()))(torch.randint(0, 4096, (rows,), generator=gen), 4096, torch.float32)
    gate_up = torch.randn(rows, 2 * ARCH["intermediate_size"], generator=gen)
    q_norm, k_norm = attn.q_norm, attn.k_norm

    def rope_only():  # the same module as Llama's (no q/k norm)
        attn.q_norm = attn.k_norm = None
        try:
            return attn._qk_norm_rope(qk, cos, sin)
        finally:
            attn.q_norm, attn.k_norm = q_norm, k_norm

    def act():
        if cpu_fused.enabled():
            return cpu_fused.gated_activation(gate_up, mlp.act_name)
        gate, up = gate_up.chunk(2, dim=-1)
        return mlp.act(gate) * up

    return {
        "residual add + RMSNorm": lambda: norm.add_and_norm(x, residual),
        "qk RMSNorm + RoPE": lambda: attn._qk_norm_rope(qk, cos, sin),
        "RoPE only (Llama)": rope_only,
        "SiLU(gate) * up": act,
    }


def mixed_step(model, rows: int, gen: torch.Generator):
    """A forward of one prefill chunk (rows - 32 tokens, context 0) and 32 decodes (context 200)."""
    chunk = max(1, rows - DECODES)
    q_lens = [chunk] + [1] * DECODES
    seq_lens = [chunk] + [201] * DECODES
    per_seq = max(-(-s // BLOCK) for s in seq_lens)
    tables = [list(range(1 + i * per_seq, 1 + (i + 1) * per_seq)) for i in range(len(q_lens))]
    shape = (2, per_seq * len(q_lens) + 1, BLOCK, ARCH["num_key_value_heads"], ARCH["head_dim"])
    # The engine's cache layout (head-major blocks, engine/kv_cache.layer_cache): the forward it times.
    caches = [layer_cache(shape, torch.float32, torch.device("cpu")).copy_(torch.randn(shape, generator=gen))
              for _ in range(ARCH["num_hidden_layers"])]
    ids = torch.randint(3, ARCH["vocab_size"], (sum(q_lens),), generator=gen)
    positions = torch.cat([torch.arange(chunk)] + [torch.tensor([200])] * DECODES)
    last = torch.tensor(q_lens).cumsum(0) - 1

    def step():
        meta = AttentionMetadata.build(q_lens, seq_lens, tables, BLOCK)
        return model.compute_logits(model(ids, positions, caches, meta)[last]).argmax(-1)

    return step


LAYER = {"residual add + RMSNorm": 2, "qk RMSNorm + RoPE": 1, "SiLU(gate) * up": 1}
LAYER_ROW = "one Qwen3 layer (2 norms + qk + act)"


def measure_ops(model, threads: int, rows: int, repeats: int, gen: torch.Generator) -> list[list]:
    """Table rows for each op and one layer's sum of them: median and best, torch and fused."""
    cases = op_cases(model, rows, gen)
    med = alternate(cases, repeats)
    for on in (True, False):
        med[LAYER_ROW, on] = tuple(sum(n * med[(name, on)][i] for name, n in LAYER.items()) for i in (0, 1))
    table = []
    for name in [*cases, LAYER_ROW]:
        (t, tb), (f, fb) = med[(name, False)], med[(name, True)]
        table.append([threads, rows, name, round(t, 4), round(f, 4), f"{t / f:.2f}x",
                      round(tb, 4), round(fb, 4), f"{tb / fb:.2f}x"])
        print(table[-1], flush=True)
    return table


def measure_forward(model, threads: int, rows: int, repeats: int, gen: torch.Generator) -> list:
    step = mixed_step(model, rows, gen)
    tokens = {}
    for on in (True, False):
        cpu_fused.set_enabled(on)
        with torch.inference_mode():
            tokens[on] = step()
    fwd = alternate({"forward": step}, repeats, budget_s=0.5)
    (t, tb), (f, fb) = fwd[("forward", False)], fwd[("forward", True)]
    row = [threads, rows, round(t, 2), round(f, 2), f"{t / f:.3f}x", round(t - f, 2), round(tb, 2),
           round(fb, 2), f"{tb / fb:.3f}x", "yes" if torch.equal(tokens[True], tokens[False]) else "NO"]
    print(row, flush=True)
    return row


def docs_body(args, info: dict, ops_md: str, fwd_md: str) -> str:
    return (
        f"`PYTHONPATH=benchmarks .venv/bin/python benchmarks/experiments/fused_cpu.py --rows-list {args.rows_list} --threads-list "
        f"{args.threads_list} --repeats {args.repeats}`: vs_vllm.py's random Qwen3 (8 layers, hidden 1024, "
        f"intermediate 3072, 16 heads / 8 KV heads x 64, qk-norm, vocab 32,000), fp32, torch "
        f"{torch.__version__} (capability {torch.backends.cpu.get_cpu_capability()}). Each op is one "
        f"decoder layer's own module called with the fused path on and off (kernels/cpu_fused.py; "
        f"{info['isa']}, exp/tanh: {info['math']}), alternated; ms per call, the median and the best of "
        f"{args.repeats} repeats (the best is the less disturbed by other jobs on the shared cores); "
        f"load average at the end {bu.load_average()}.\n\n{ops_md}\n\n"
        f"A whole forward of a mixed step (one prefill chunk of rows - 32 tokens + 32 decodes at context "
        f"200; the LM head on the 33 last rows), fused on and off alternated ({args.forward_repeats} "
        f"repeats):\n\n{fwd_md}"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows-list", default="512,32")
    p.add_argument("--threads-list", default="1,2")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--forward-repeats", type=int, default=5)
    p.add_argument("--write-docs", action="store_true")
    args = p.parse_args()
    warnings.filterwarnings("ignore")
    ints = lambda s: [int(v) for v in s.split(",")]
    model = load_model(None, ARCH, torch.float32, "cpu", seed=0)
    info = cpu_fused.build_info()
    print(f"fused kernels: {info}; load average {bu.load_average()}")
    table, forwards = [], []
    for threads in ints(args.threads_list):
        torch.set_num_threads(threads)
        for rows in ints(args.rows_list):
            gen = torch.Generator().manual_seed(rows)
            table += measure_ops(model, threads, rows, args.repeats, gen)
            forwards.append(measure_forward(model, threads, rows, args.forward_repeats, gen))
    ops_md = bu.markdown_table(["threads", "rows", "op", "torch ms (median)", "fused ms (median)", "speedup",
                                "torch ms (best)", "fused ms (best)", "speedup (best)"], table)
    fwd_md = bu.markdown_table(["threads", "rows", "torch ops ms (median)", "fused ms (median)", "speedup",
                                "saved ms", "torch ops ms (best)", "fused ms (best)", "speedup (best)",
                                "same greedy tokens"], forwards)
    print(ops_md + "\n\n" + fwd_md)
    if args.write_docs:
        print("wrote", bu.write_docs_section("fused_cpu", docs_body(args, info, ops_md, fwd_md)))


if __name__ == "__main__":
    main()
