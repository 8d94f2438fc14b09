"""Memory planning: will the weights, the KV cache and the largest step fit, before any is allocated?

`plan_memory` is a pure function of the model's shapes, the KV-cache spec (engine/kv_spec.py), the
config and the bytes available, so it is tested with made-up numbers. This is the only place the KV
cache is sized. The builder (engine/builder.py) calls it before loading the model: a run that cannot
fit stops at once with the numbers and the fixes instead of swapping or dying mid-job. When the KV
cache size is left to ladle (no cache.num_blocks / cache.memory_gb) it is shrunk to what is left.

On CUDA the estimate of a step's activations is replaced by a measurement (vLLM's profile run): the
builder runs one forward at the step budget's width after loading the weights and sizes the KV cache
from the free memory that remains (see `profile_peak_bytes`).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from ladle.engine.config import EngineConfigError
from ladle.engine.kv_spec import KVCacheSpec

GIB = 2**30
CPU_KV_CAP_GB = 4.0  # the default CPU KV cache when no size is given (it is also capped by what is free)
CUDA_UTILIZATION = 0.90  # of the GPU's free memory at start, like vLLM's gpu_memory_utilization
HOST_HEADROOM_GB = 1.0  # kept free on the host for Python, the tokenizer, the dataset's read-ahead


@dataclass(slots=True)
class ModelShape:
    """What the estimate needs from a model's architecture."""

    num_parameters: int
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int


@dataclass(slots=True)
class MemoryPlan:
    weights_bytes: int
    activation_bytes: int  # the largest step's (estimated; measured on CUDA)
    kv_bytes_per_token: int
    kv_tokens: int  # tokens the KV cache will hold
    available_bytes: int
    device: str
    packed_weight_bytes: int = 0  # of weights_bytes: the CPU linear layers' packed copies (0: not packed)

    @property
    def kv_bytes(self) -> int:
        return self.kv_tokens * self.kv_bytes_per_token

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.activation_bytes + self.kv_bytes


class InsufficientMemory(EngineConfigError):
    """The run cannot fit (a config the user can change: a ValueError, reported as a config error)."""


SAMPLER_BYTES_PER_LOGIT = 32  # float32 logits, probs, noise, sorted copy, int64 order, cumsum, logprobs


def sampler_bytes(rows: int, vocab_size: int) -> int:
    """The sampler's transient tensors for `rows` sampling rows (the profile run measures only the
    forward and the LM head, so this is added to it). The engine never samples more rows at once
    (Sampler.max_rows): n > 1 forks, which repeat a row n times, are drawn in groups of that many."""
    return rows * vocab_size * SAMPLER_BYTES_PER_LOGIT


# Logits engine/logprobs.py materialises at once for prompt logprobs ([rows, vocab], ~128 MiB in float32).
PROMPT_LOGPROB_LOGITS = 2**25


def prompt_logprob_bytes(vocab_size: int) -> int:
    """Prompt logprobs' transient tensors: one bounded piece of logits in the model's dtype, its float32
    copy and its log_softmax (12 bytes a logit at most). The profile run does not ask for them."""
    rows = max(1, PROMPT_LOGPROB_LOGITS // vocab_size)
    return rows * vocab_size * 12


def graph_pool_bytes(step_peak_bytes: int, step_tokens: int, graph_tokens: int) -> int:
    """The CUDA graphs' shared pool, kept beside the eager steps' memory: the activations of a forward of
    the largest graph's tokens, scaled from the profile run's peak at the step budget's width."""
    return math.ceil(step_peak_bytes * min(1.0, graph_tokens / max(1, step_tokens)))


def activation_bytes(shape: ModelShape, step_tokens: int, max_num_seqs: int, max_model_len: int,
                     elem: int) -> int:
    """Peak transient memory of one forward of `step_tokens` tokens, with a safety factor of 2.

    Per token: the residual stream and a normed copy, q/k/v, the attention output, and the MLP's
    gate/up/product; the sampler's float32 copies of at most one logits row per running sequence and
    the bounded piece of prompt-logprob logits; the CPU reference
    attention gathers one sequence's context keys and values (float32) per layer.
    """
    s = shape
    per_token = (4 * s.hidden_size + (s.num_heads + 2 * s.num_kv_heads) * s.head_dim
                 + s.num_heads * s.head_dim + 3 * s.intermediate_size)
    hidden = step_tokens * per_token * elem
    logits = sampler_bytes(min(step_tokens, max_num_seqs), s.vocab_size)
    context = 2 * max_model_len * s.num_kv_heads * s.head_dim * 4
    return 2 * (hidden + logits + context) + prompt_logprob_bytes(s.vocab_size)  # that one is exact


def plan_memory(shape: ModelShape, spec: KVCacheSpec, *, device: str, available_bytes: int, step_tokens: int,
                max_num_seqs: int, kv_tokens_wanted: int, kv_size_given: bool,
                measured_activation_bytes: int | None = None, packed_weight_bytes: int = 0) -> MemoryPlan:
    """The memory the run will take, the KV cache sized to fit; raises InsufficientMemory naming the fixes.

    kv_tokens_wanted: what the config asks for (explicit size, or enough for every sequence at full
    length within the default cap). kv_size_given: the user set cache.num_blocks / memory_gb, so the
    cache is not shrunk behind their back: it must fit as asked. packed_weight_bytes: the CPU linear
    layers' packed copies held beside the weights (models/linear.py).
    """
    elem = spec.element_size  # weights and KV cache share the model's dtype
    weights = shape.num_parameters * elem + packed_weight_bytes
    act = measured_activation_bytes if measured_activation_bytes is not None else activation_bytes(
        shape, step_tokens, max_num_seqs, spec.max_model_len, elem)
    per_token, block = spec.bytes_per_token, spec.block_tokens
    room = available_bytes - weights - act
    min_tokens = spec.blocks_for(spec.max_model_len) * block  # one sequence at full length
    kv_tokens = kv_tokens_wanted
    if not kv_size_given and room < kv_tokens * per_token:
        kv_tokens = max(0, room // per_token // block * block)
    plan = MemoryPlan(weights, act, per_token, kv_tokens, available_bytes, device, packed_weight_bytes)
    if plan.total_bytes > available_bytes or kv_tokens < min(min_tokens, kv_tokens_wanted):
        raise InsufficientMemory(_explain(plan, max(kv_tokens_wanted, min_tokens), elem, kv_size_given))
    return plan


def _explain(plan: MemoryPlan, kv_tokens: int, elem: int, kv_size_given: bool) -> str:
    def gb(b: float) -> str:
        return f"{b / GIB:.1f} GiB"

    kv = kv_tokens * plan.kv_bytes_per_token
    need = plan.weights_bytes + plan.activation_bytes + kv
    where = "free GPU memory" if plan.device.startswith("cuda") else "available host memory"
    fixes = []
    if elem == 4:
        fixes.append("model.dtype=bfloat16 (halves weights and KV" + (
            "; slow on CPU)" if not plan.device.startswith("cuda") else ")"))
    fixes.append("a smaller cache (cache.memory_gb=..., cache.max_model_len=..., max_num_seqs=...)" if kv_size_given
                 else "cache.max_model_len=... (one full-length sequence must fit)")
    fixes.append("a smaller step (chunking.token_budget=...)")
    fixes.append("a smaller model")
    return (f"the run needs about {gb(need)} (weights {gb(plan.weights_bytes)} + KV cache {gb(kv)} for "
            f"{kv_tokens} tokens + largest step {gb(plan.activation_bytes)}) but {gb(plan.available_bytes)} of "
            f"{where} is there to use. Fixes: " + "; ".join(fixes) + ".")


def available_host_bytes() -> int:
    """MemAvailable, within the process's cgroup limit, less a headroom for the rest of the job."""
    avail = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    if avail is None:  # not Linux: trust the physical size
        avail = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    limit = _cgroup_room()
    if limit is not None:
        avail = min(avail, limit)
    return max(0, avail - int(HOST_HEADROOM_GB * GIB))


def _cgroup_room() -> int | None:
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            raw = f.read().strip()
        if raw == "max":
            return None
        with open("/sys/fs/cgroup/memory.current") as f:
            return int(raw) - int(f.read().strip())
    except (OSError, ValueError):
        return None


def profile_peak_bytes(model, num_tokens: int, max_model_len: int, backend: str = "auto") -> int | None:
    """Run one forward of `num_tokens` prompt tokens (sequences of at most max_model_len) and return
    the peak memory it allocated beyond the weights, on CUDA (None elsewhere: the CPU has no such
    counter, the estimate stands). Its KV cache is a throwaway one just large enough (not counted)."""
    import torch

    from ladle.engine.profiling import BLOCK, dummy_forward, prefill_shape

    device = next(model.parameters()).device
    lens = prefill_shape(num_tokens, max_model_len)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    dummy_forward(model, lens, lens, backend, every_row=True)  # every row: the upper bound
    if not cuda:
        return None
    blocks = sum(math.ceil(n / BLOCK) for n in lens)
    cache_bytes = blocks * BLOCK * model.arch.kv_cache_bytes_per_token(next(model.parameters()).dtype)
    return torch.cuda.max_memory_allocated(device) - base - cache_bytes


def shape_of(arch) -> ModelShape:
    # intermediate_size: the MLP's activations per token (an MoE's top-k copies, models/config.py)
    return ModelShape(arch.num_parameters(), arch.num_layers, arch.hidden_size, arch.mlp_activation_width(),
                      arch.num_heads, arch.num_kv_heads, arch.head_dim, arch.vocab_size)


def plan_kv_cache(config, arch, spec: KVCacheSpec, device, measured_activation_bytes: int | None = None,
                  available_bytes: int | None = None) -> tuple[MemoryPlan, int]:
    """The memory plan of an engine config and the number of KV blocks it gives the cache.

    Wanted: cache.num_blocks, else cache.memory_gb, else every sequence at full length (max_num_seqs
    x max_model_len), capped at CPU_KV_CAP_GB on CPU; a size ladle chose is shrunk to what fits.
    """
    cache = config.cache
    block_tokens, page = spec.block_tokens, spec.page_bytes
    given = cache.num_blocks is not None or cache.memory_gb is not None
    if cache.num_blocks is not None:
        wanted = cache.num_blocks * block_tokens
    elif cache.memory_gb is not None:
        wanted = _blocks_within(spec, int(cache.memory_gb * GIB), device) * block_tokens
        if wanted < block_tokens:
            raise InsufficientMemory(
                f"cache.memory_gb={cache.memory_gb} holds no block of {block_tokens} tokens "
                f"({page / 2**20:.1f} MiB each); raise cache.memory_gb")
    else:
        wanted = config.max_num_seqs * spec.blocks_for(cache.max_model_len) * block_tokens
        if device.type != "cuda":
            wanted = min(wanted, _blocks_within(spec, int(CPU_KV_CAP_GB * GIB), device) * block_tokens)
    if available_bytes is None:
        available_bytes = _available(device)
    def plan_with(packed: int) -> MemoryPlan:
        return plan_memory(
            shape_of(arch), spec, device=str(device), available_bytes=available_bytes,
            step_tokens=config.chunking.step_budget(config.max_num_seqs, cache.max_model_len),
            max_num_seqs=config.max_num_seqs, kv_tokens_wanted=wanted, kv_size_given=given,
            measured_activation_bytes=measured_activation_bytes, packed_weight_bytes=packed)

    packed = _packed_bytes(arch, spec, device)
    if packed and getattr(config, "deterministic", False):  # the batch-invariant GEMMs are the packed ones
        try:
            return _blocks(plan_with(packed), block_tokens)
        except InsufficientMemory as e:
            raise InsufficientMemory(
                f"deterministic=true needs the linear layers' packed copies ({packed / GIB:.2f} GiB) beside "
                f"the weights: {e}") from e
    plan = plan_with(0)
    if packed:
        # The packed copies double fp32 weights' memory. They are kept only where they cost the KV
        # cache nothing: a smaller cache (fewer sequences at once) costs more than ~2x slower GEMMs.
        try:
            with_packed = plan_with(packed)
        except InsufficientMemory:
            with_packed = None
        if with_packed is not None and with_packed.kv_tokens >= plan.kv_tokens:
            plan = with_packed
    return _blocks(plan, block_tokens)


def _blocks_within(spec: KVCacheSpec, budget: int, device) -> int:
    """The most blocks whose pool fits `budget` bytes, the CPU cache's gap between planes included
    (KVCacheSpec.gap_bytes: under 2 MiB a layer)."""
    blocks = budget // spec.page_bytes
    while blocks > 0:
        over = blocks * spec.page_bytes + spec.gap_bytes(blocks, device.type) - budget
        if over <= 0:
            break
        blocks -= -(-over // spec.page_bytes)
    return max(blocks, 0)


def _blocks(plan: MemoryPlan, block_tokens: int) -> tuple[MemoryPlan, int]:
    return plan, max(1, plan.kv_tokens // block_tokens)


def _packed_bytes(arch, spec: KVCacheSpec, device) -> int:
    """The packed linear weights the CPU fast path adds (float32 only: the KV cache shares the dtype)."""
    import torch

    from ladle.models.linear import packed_bytes_estimate

    return packed_bytes_estimate(arch, torch.float32, device) if spec.element_size == 4 else 0


def return_free_host_memory() -> None:
    """Hand malloc's free pages back to the OS, so MemAvailable counts what an earlier engine freed: tcmalloc
    (the CLI preloads it) keeps some freed spans in its page heap, glibc the top of its heap, until asked."""
    import ctypes

    try:
        process = ctypes.CDLL(None)  # the symbols of every library loaded into this process
    except OSError:
        return
    release = getattr(process, "MallocExtension_ReleaseFreeMemory", None)  # tcmalloc's C API
    if release is not None:
        release()
        return
    trim = getattr(process, "malloc_trim", None)  # glibc
    if trim is not None:
        trim(0)


def _available(device) -> int:
    import gc

    # An earlier engine of this process (a Hydra multirun's previous job, a notebook's) may be garbage that
    # waits for a collection (a compiled model is a reference cycle: model._compiled -> model): collect it
    # before reading what is free, on either device.
    gc.collect()
    if device.type != "cuda":
        return_free_host_memory()
        return available_host_bytes()
    import torch

    # The driver counts what torch's caching allocator holds as used, freed or not: hand it back first.
    torch.cuda.empty_cache()
    free, _total = torch.cuda.mem_get_info(device)
    return int(free * CUDA_UTILIZATION)
