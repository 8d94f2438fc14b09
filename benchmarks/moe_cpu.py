"""The mixture-of-experts forward on the CPU: ladle's SparseMoE (tokens grouped by expert, each routed
expert's packed linear layers run once) against transformers' Qwen3MoeSparseMoeBlock (its experts as 3D
tensors, F.linear per routed expert) with the same weights, on a tiny and a mid-size shape, float32.

Both run one forward of T tokens; the two are alternated inside each repeat (the order rotates) and the
table gives medians and the median per-repeat ratio. The outputs are compared (max |difference|).

    .venv/bin/python benchmarks/moe_cpu.py [--quick] [--threads 1] [--repeats 7] [--write-docs]
"""

from __future__ import annotations

import argparse
import time

import benchutil
import torch
import transformers

from ladle.models import arch_from_config
from ladle.models.moe import SparseMoE

SHAPES = {  # name -> (hidden, experts, top_k, expert intermediate)
    "tiny": (64, 8, 2, 32),
    "mid": (1024, 64, 8, 512),
}


def pair(hidden: int, experts: int, top_k: int, inter: int) -> tuple[torch.nn.Module, SparseMoE]:
    """transformers' block with random weights, and ladle's with the same weights."""
    config = transformers.Qwen3MoeConfig(hidden_size=hidden, num_experts=experts, num_experts_per_tok=top_k,
                                         moe_intermediate_size=inter, norm_topk_prob=True, num_hidden_layers=1)
    torch.manual_seed(0)
    block = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock(config).eval()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.05)
    arch = arch_from_config({**config.to_dict(), "architectures": ["Qwen3MoeForCausalLM"]})
    ours = SparseMoE(arch).eval().requires_grad_(False)
    with torch.no_grad():
        ours.gate.weight.copy_(block.gate.weight)
        for e, expert in enumerate(ours.experts):
            expert.gate_up_proj.weight.copy_(block.experts.gate_up_proj[e])  # gate rows, then up rows
            expert.down_proj.weight.copy_(block.experts.down_proj[e])
    for module in ours.modules():
        if hasattr(module, "derive_weights"):
            module.derive_weights()  # packed once, as the loader does
    return block, ours


def timed(fn, x: torch.Tensor) -> float:
    start = time.perf_counter()
    fn(x)
    return time.perf_counter() - start


@torch.inference_mode()
def measure(shape: str, tokens: int, repeats: int) -> list:
    hidden, experts, top_k, inter = SHAPES[shape]
    block, ours = pair(hidden, experts, top_k, inter)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(tokens))
    systems = {"transformers": lambda t: block(t.unsqueeze(0)), "ladle": ours}
    diff = (systems["transformers"](x)[0] - ours(x)).abs().max().item()
    for fn in systems.values():  # warm-up (oneDNN primitives, allocator)
        fn(x)
    times: dict[str, list[float]] = {name: [] for name in systems}
    ratios = []
    for r in range(repeats):
        order = list(systems) if r % 2 == 0 else list(reversed(systems))
        run = {name: timed(systems[name], x) for name in order}
        for name, t in run.items():
            times[name].append(t)
        ratios.append(run["transformers"] / run["ladle"])
    hf_ms, ours_ms = (1e3 * benchutil.median(times[n]) for n in ("transformers", "ladle"))
    return [shape, tokens, hf_ms, ours_ms, benchutil.median(ratios), f"{diff:.1e}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--tokens", default="1,8,64,512")
    parser.add_argument("--quick", action="store_true", help="tiny shape, 3 repeats")
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args()
    threads = benchutil.set_threads(args.threads)
    shapes = ["tiny"] if args.quick else list(SHAPES)
    repeats = 3 if args.quick else args.repeats
    rows = [measure(s, int(t), repeats) for s in shapes for t in args.tokens.split(",")]
    headers = ["shape", "tokens", "transformers ms", "ladle ms", "speed-up (median of ratios)", "max abs diff"]
    shapes_text = ", ".join(f"{n}: hidden {h}, {e} experts, top {k}, expert intermediate {i}"
                            for n, (h, e, k, i) in SHAPES.items())
    body = f"threads {threads}, float32; {shapes_text}\n\n{benchutil.markdown_table(headers, rows)}\n"
    print(f"{benchutil.machine_markdown()}\n\n{body}")
    if args.write_docs:
        print("written to", benchutil.write_docs_section("moe_cpu", body))


if __name__ == "__main__":
    main()
