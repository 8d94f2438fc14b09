"""Building an engine: check the config, plan memory, load the model, profile, warm up, compile, and
make the parts the engine steps with.

The config phase runs on config files alone, before any weight is loaded: a mistake there is the
user's to fix (EngineConfigError) and costs no load. On CUDA the memory plan is then redone against a
measured profile forward (vLLM's profile run), the Triton kernels are compiled for the cache's block
size, and with model.compile the forward is compiled in a warm-up, so no timed step waits for either.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

import torch

from ladle.engine.config import EngineConfig, EngineConfigError
from ladle.engine.input_processor import InputProcessor
from ladle.engine.kv_cache import KVCacheManager
from ladle.engine.kv_spec import KVCacheSpec
from ladle.engine.memory import (
    MemoryPlan,
    graph_pool_bytes,
    plan_kv_cache,
    profile_peak_bytes,
    prompt_logprob_bytes,
    sampler_bytes,
)
from ladle.engine.model_runner import ModelRunner
from ladle.engine.output_processor import OutputProcessor
from ladle.engine.profiling import compile_forward, warm_up_kernels
from ladle.engine.request import Request
from ladle.engine.sampler import Sampler
from ladle.engine.scheduler import Scheduler
from ladle.engine.structured_output import StructuredOutputManager
from ladle.engine.update import Updater
from ladle.kernels import get_backend
from ladle.kernels.cpu_build import build_error, load_library

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Planned:
    """The config phase's result: what the run is, decided before any weight is loaded."""

    arch: object  # ladle.models.ModelArch
    device: torch.device
    dtype: torch.dtype
    kv_spec: KVCacheSpec
    memory_plan: MemoryPlan
    num_blocks: int
    tokenizer: object


@dataclass(slots=True)
class EngineParts:
    planned: Planned
    model: torch.nn.Module
    kernel_warmup_s: float  # seconds compiling the Triton kernels before the first step (CUDA)
    compile_seconds: float | None  # model.compile: the warm-up's compile time
    kv: KVCacheManager
    scheduler: Scheduler
    model_runner: ModelRunner
    sampler: Sampler
    structured: StructuredOutputManager
    input_processor: InputProcessor
    output_processor: OutputProcessor
    updater: Updater
    requests: dict[str, Request] = field(default_factory=dict)
    graph_capture_s: float | None = None  # CUDA graphs: seconds capturing them (None: not used)


def build(config: EngineConfig) -> EngineParts:
    from ladle.models import load_model  # engine -> models
    from ladle.models.linear import packed_bytes_estimate

    mc = config.model
    planned = plan(config)
    model = load_model(mc.path, mc.architecture, dtype=planned.dtype, device=planned.device, seed=mc.seed,
                       random_weights=mc.random_weights,
                       pack_linear=planned.memory_plan.packed_weight_bytes > 0 or planned.device.type != "cpu")
    if config.deterministic:
        enable_deterministic(model)
    elif model.packed_weight_bytes() == 0 and packed_bytes_estimate(planned.arch, planned.dtype, planned.device):
        log.warning("linear layers run unpacked (~2x slower GEMMs): their packed copies do not fit in "
                    "memory beside the weights without shrinking the KV cache")
    warmup_s = 0.0
    if planned.device.type == "cuda":
        warmup_s = profile(config, model, planned)
    compile_s = None
    if mc.compile:
        compile_s = compile_forward(model, mc.attention_backend)
        log.info("compiled forward in %.1f s", compile_s)
    parts = assemble(config, planned, model, warmup_s, compile_s)
    parts.graph_capture_s = capture_graphs(config, parts)
    return parts


def plan(config: EngineConfig) -> Planned:
    """Validate, resolve the device, dtype and architecture, plan memory, load the tokenizer."""
    from ladle.models import (  # engine -> models
        load_tokenizer,
        resolve_architecture,
        resolve_device,
        resolve_dtype,
    )

    mc = config.model
    try:  # a mistake here is the user's to fix, found before any weight is loaded
        config.validate()
        device = resolve_device(mc.device)
        _dir, arch = resolve_architecture(mc.path, mc.architecture, mc.random_weights)
        max_len = config.cache.max_model_len
        if max_len > arch.max_position_embeddings:
            raise EngineConfigError(
                f"cache.max_model_len={max_len} exceeds the model's max_position_embeddings "
                f"({arch.max_position_embeddings}); lower cache.max_model_len"
            )
        dtype = resolve_dtype(mc.dtype, device, arch)  # the one rule for dtype "auto"
        if config.deterministic:
            check_resolved_deterministic(config, device, dtype, arch)
        spec = KVCacheSpec.build(config.cache, arch, dtype)
        memory_plan, num_blocks = plan_kv_cache(config, arch, spec, device)
        tokenizer = load_tokenizer(mc.path, vocab_size=arch.vocab_size, tokenizer=mc.tokenizer)
    except EngineConfigError:
        raise
    except (ValueError, FileNotFoundError) as e:
        raise EngineConfigError(str(e)) from e
    return Planned(arch, device, dtype, spec, memory_plan, num_blocks, tokenizer)


def attention_backend(config: EngineConfig, device: torch.device) -> str:
    """The backend name the model runner passes to every forward. Deterministic mode pins the resolved
    cpu_paged kernel, so neither set_backend() nor LADLE_ATTENTION_BACKEND can swap it afterwards."""
    return get_backend(device, config.model.attention_backend) if config.deterministic else config.model.attention_backend


def check_resolved_deterministic(config: EngineConfig, device: torch.device, dtype: torch.dtype, arch) -> None:
    """Deterministic mode's conditions on what "auto" resolved to (EngineConfigError naming the fix)."""
    if device.type != "cpu":
        raise EngineConfigError(
            f"deterministic=true runs on CPU only, but model.device={config.model.device!r} resolved to "
            f"{device} (batch invariance on CUDA is not implemented or tested): set model.device=cpu")
    if dtype != torch.float32:
        raise EngineConfigError(
            f"deterministic=true needs float32, but model.dtype={config.model.dtype!r} resolved to {dtype}: "
            "set model.dtype=float32")
    backend = get_backend(device, config.model.attention_backend)
    if backend != "cpu_paged" or load_library() is None:
        raise EngineConfigError(
            f"deterministic=true needs the cpu_paged attention kernel, but attention resolves to {backend!r}"
            f" (kernel build error: {build_error()}; LADLE_ATTENTION_BACKEND="
            f"{os.environ.get('LADLE_ATTENTION_BACKEND')!r}): install a C++ compiler so kernels/cpu_build.py "
            "can build it, unset LADLE_ATTENTION_BACKEND, or set deterministic=false")
    if arch.head_dim > 1024 or arch.num_heads % arch.num_kv_heads:
        raise EngineConfigError(
            f"deterministic=true: the cpu_paged kernel does not take this model's heads (head_dim "
            f"{arch.head_dim}, {arch.num_heads} query / {arch.num_kv_heads} KV heads); set deterministic=false")


def enable_deterministic(model: torch.nn.Module) -> None:
    """Switch the model's ops to their batch-invariant forms; the model's refusal becomes a config error."""
    try:
        model.set_deterministic(True)
    except (ValueError, RuntimeError) as e:
        raise EngineConfigError(
            f"deterministic=true cannot hold on this machine: {e}. Fixes: model.device=cpu and "
            "model.dtype=float32, a torch build with oneDNN (torch.backends.mkldnn), enough memory for "
            "the packed linear weights, or deterministic=false") from e


def profile(config: EngineConfig, model: torch.nn.Module, planned: Planned) -> float:
    """CUDA: measure the largest step instead of estimating it, compile the Triton kernels for the
    cache's block size, and redo the memory plan against the free memory measured before loading.
    Returns the kernels' warm-up seconds."""
    mc, arch, max_len = config.model, planned.arch, config.cache.max_model_len
    step = config.chunking.step_budget(config.max_num_seqs, max_len)
    peak = profile_peak_bytes(model, step, max_len, mc.attention_backend)
    warmup_s = 0.0
    if uses_graphs(config, planned.device):
        # The graphs keep a private pool beside the eager steps' memory: the activations of a forward of
        # their largest bucket (mixed-step or decode), which scale with the tokens measured.
        peak += graph_pool_bytes(peak, step, graph_tokens(config))
    if get_backend(planned.device, mc.attention_backend) == "triton":
        warmup_s = warm_up_kernels(model, max_len, config.max_num_seqs, step, mc.attention_backend,
                                   block_size=planned.kv_spec.block_tokens)
    peak += sampler_bytes(min(step, config.max_num_seqs), arch.vocab_size)
    peak += prompt_logprob_bytes(arch.vocab_size)
    planned.memory_plan, planned.num_blocks = plan_kv_cache(
        config, arch, planned.kv_spec, planned.device, measured_activation_bytes=peak,
        available_bytes=planned.memory_plan.available_bytes)
    return warmup_s


def uses_graphs(config: EngineConfig, device: torch.device) -> bool:
    """Decode steps replay CUDA graphs: on CUDA, with model.cuda_graphs, through the Triton kernels."""
    mc = config.model
    return device.type == "cuda" and mc.cuda_graphs and get_backend(device, mc.attention_backend) == "triton"


def mixed_graph_tokens(config: EngineConfig) -> int:
    """The largest mixed-step graph's tokens: model.mixed_graph_tokens within the step budget and ubatch
    (a forward never carries more); 0: none."""
    ch = config.chunking
    step = ch.step_budget(config.max_num_seqs, config.cache.max_model_len)
    return min(config.model.mixed_graph_tokens, step, ch.ubatch or step)


def graph_tokens(config: EngineConfig) -> int:
    """Tokens of the largest forward any graph records: what the graphs' shared pool holds."""
    from ladle.engine.mixed_graphs import token_buckets

    mixed = mixed_graph_tokens(config)
    return max(config.max_num_seqs, token_buckets(mixed)[-1] if mixed else 0)


def graphs_capturable(model: torch.nn.Module) -> bool:
    """Every layer of the model can be recorded in a CUDA graph (a layer says so by `graph_capturable`)."""
    return all(getattr(m, "graph_capturable", True) for m in model.modules())


def capture_graphs(config: EngineConfig, parts: EngineParts) -> float | None:
    """CUDA with model.cuda_graphs and the Triton kernels: capture the mixed-step graphs, then the decode
    graphs into the same pool, over the engine's own KV cache (the graphs record its addresses). Returns
    the seconds it took, or None if not used."""
    from ladle.engine.cuda_graphs import DecodeGraphs
    from ladle.engine.mixed_graphs import MixedGraphs

    if not uses_graphs(config, parts.planned.device):
        return None
    if not graphs_capturable(parts.model):
        log.info("CUDA graphs off: the model has layers a graph cannot record (mixture-of-experts routing reads "
                 "per-expert token counts on the host); its steps run eagerly")
        return None
    mc, kv, cache, runner = config.model, parts.kv, config.cache, parts.model_runner
    seconds, pool = 0.0, None
    if (mixed_tokens := mixed_graph_tokens(config)) > 0:
        mixed = MixedGraphs(parts.model, kv.kv_caches, kv.block_size, cache.max_model_len, config.max_num_seqs,
                            mixed_tokens, mc.attention_backend)
        seconds, pool = mixed.capture(), mixed.pool
        runner.mixed_graphs = mixed
        log.info("captured %d CUDA graphs (steps with prefill chunks up to %d tokens) in %.1f s",
                 len(mixed.sizes), mixed.sizes[-1], seconds)
    graphs = DecodeGraphs(parts.model, kv.kv_caches, kv.block_size, cache.max_model_len, config.max_num_seqs,
                          mc.attention_backend)
    decode_s = graphs.capture(pool)
    runner.graphs = graphs
    log.info("captured %d CUDA graphs (decode batches up to %d) of the %s forward in %.1f s", len(graphs.sizes),
             graphs.sizes[-1], "compiled" if graphs.records_compiled else "eager", decode_s)
    return seconds + decode_s


def assemble(config: EngineConfig, planned: Planned, model: torch.nn.Module, warmup_s: float,
             compile_s: float | None) -> EngineParts:
    """The parts the engine steps with, around the loaded model."""
    arch, tokenizer, device = planned.arch, planned.tokenizer, planned.device
    max_len = config.cache.max_model_len
    eos = set(arch.eos_token_ids or []) | set(getattr(tokenizer, "eos_token_ids", []) or [])
    kv = KVCacheManager(planned.kv_spec, planned.num_blocks, device=device,
                        prefix_caching=config.cache.prefix_caching_enabled)
    scheduler = Scheduler(config, kv)
    # Logprobs report top-k alternatives among the ids the tokenizer knows (a padded LM head is wider).
    logprob_vocab = min(arch.vocab_size, getattr(tokenizer, "vocab_size", None) or arch.vocab_size)
    runner = ModelRunner(model, kv, device, config.chunking.ubatch,
                         attention_backend=attention_backend(config, device), logprob_vocab=logprob_vocab)
    # Rows the sampler takes at once: what the memory plan budgets (memory.sampler_bytes).
    rows = max(1, min(config.chunking.step_budget(config.max_num_seqs, max_len), config.max_num_seqs))
    sampler = Sampler(config.seed, device, max_rows=rows, logprob_vocab=logprob_vocab)
    structured = StructuredOutputManager(tokenizer, arch.vocab_size, sorted(eos))
    output = OutputProcessor(tokenizer, eos, max_len)
    requests: dict[str, Request] = {}
    return EngineParts(
        planned, model, warmup_s, compile_s, kv, scheduler, runner, sampler, structured,
        InputProcessor(tokenizer, arch.vocab_size, max_len, kv, structured,
                       seed_unseeded=config.seed if config.deterministic else None), output,
        Updater(scheduler, kv, output, structured, runner.release, requests), requests,
    )
