"""Engine configuration. These dataclasses are also the Hydra schema of the runner's config groups.

Every user-settable value is checked in `validate()`, which raises ValueError naming the key, the
value and the allowed range, so a bad config fails before any model is loaded.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


class EngineConfigError(ValueError):
    """A setting the user can change is wrong or cannot be served (raised before weights are loaded,
    except the memory check after a CUDA profile run). Any other error while building an engine is a
    real failure, not a config problem."""


def _check(ok: bool, key: str, value: Any, allowed: str) -> None:
    if not ok:
        raise EngineConfigError(f"{key}={value!r} is invalid: {allowed}")


@dataclass
class ModelConfig:
    name: str = "tiny"
    path: str | None = None  # HF model directory, or a repo id found in the local HF cache; null = random weights
    architecture: dict[str, Any] | None = None  # config.json keys, for path=null or a path without config.json
    random_weights: bool = False  # random weights even when path names a checkpoint (timings only)
    tokenizer: str | None = None  # tokenizer directory; null = the model's; "byte" = built-in byte-level
    dtype: str = "auto"  # auto (the checkpoint's bf16/fp16 on CUDA, fp32 on CPU) | float32 | bfloat16 | float16
    device: str = "auto"  # auto (CUDA if present) | cpu | cuda | cuda:N
    seed: int = 0  # random-weight initialisation
    attention_backend: str = "auto"  # auto (triton on CUDA, cpu_paged on CPU) | triton | cpu_paged | torch
    compile: bool = False  # run the forward through torch.compile (compiled once in a warm-up at start)
    cuda_graphs: bool = True  # CUDA: replay decode-only steps from graphs captured per batch size (vLLM's
    # default; false = every forward eager, vLLM's enforce_eager). Ignored on CPU.
    # CUDA graphs: forwards with prefill chunks replay graphs keyed by padded token count up to this many
    # tokens (within the step budget and chunking.ubatch); 0 = decode-only graphs.
    mixed_graph_tokens: int = 2048

    def validate(self) -> None:
        _check(self.path is not None or self.architecture is not None, "model.path", self.path,
               "set model.path to a model directory or HF repo id, or give model.architecture")
        _check(self.dtype in ("auto", "float32", "bfloat16", "float16"), "model.dtype", self.dtype,
               "one of auto, float32, bfloat16, float16")
        _check(self.device == "auto" or self.device == "cpu" or self.device.startswith("cuda"),
               "model.device", self.device, "auto, cpu, cuda or cuda:N")
        _check(self.attention_backend in ("auto", "triton", "cpu_paged", "torch"), "model.attention_backend",
               self.attention_backend, "one of auto, triton, cpu_paged, torch")
        _check(isinstance(self.compile, bool), "model.compile", self.compile, "true or false")
        _check(isinstance(self.cuda_graphs, bool), "model.cuda_graphs", self.cuda_graphs, "true or false")
        _check(isinstance(self.mixed_graph_tokens, int) and self.mixed_graph_tokens >= 0,
               "model.mixed_graph_tokens", self.mixed_graph_tokens, "an integer >= 0 (0: decode-only graphs)")


@dataclass
class CacheConfig:
    backend: str = "paged"  # paged | contiguous
    block_size: int = 16  # tokens per block (paged); contiguous uses one block of max_model_len
    num_blocks: int | None = None  # explicit pool size; else from memory_gb; else enough for max_num_seqs
    memory_gb: float | None = None
    max_model_len: int = 4096  # longest prompt + output a request may have
    prefix_caching: bool | None = None  # null = on for paged, off for contiguous

    def validate(self) -> None:
        _check(self.backend in ("paged", "contiguous"), "cache.backend", self.backend, "one of paged, contiguous")
        _check(self.block_size >= 1, "cache.block_size", self.block_size, "must be >= 1")
        _check(self.num_blocks is None or self.num_blocks >= 1, "cache.num_blocks", self.num_blocks,
               "must be >= 1 or null")
        _check(self.memory_gb is None or self.memory_gb > 0, "cache.memory_gb", self.memory_gb, "must be > 0 or null")
        _check(self.max_model_len >= 2, "cache.max_model_len", self.max_model_len, "must be >= 2")
        _check(not (self.backend == "contiguous" and self.prefix_caching), "cache.prefix_caching",
               self.prefix_caching, "prefix caching needs cache.backend=paged (blocks are shared)")

    @property
    def prefix_caching_enabled(self) -> bool:
        return self.backend == "paged" if self.prefix_caching is None else bool(self.prefix_caching)


@dataclass
class ChunkingConfig:
    enabled: bool = True  # false: a prompt is prefilled whole in one step
    size: int = 512  # most prompt tokens one request gets per step
    # Most tokens (decodes + prefill chunks) one step carries. null = derived (see step_budget): the
    # chunk size, so a step is one chunk's worth of work as in Sarathi, and sweeping `size` changes it.
    token_budget: int | None = None
    max_chunks_per_step: int | None = None  # most requests prefilling in one step
    max_partial_prefills: int | None = None  # most started-but-unfinished prefills at once
    decode_headroom: int | None = None  # prefill tokens per step are capped at this while decodes run
    prefill_interval: int = 1  # prefill only every k-th step while decodes run
    ubatch: int | None = None  # physical forward width; a step runs as forwards of at most this many tokens

    def validate(self, max_num_seqs: int) -> None:
        _check(self.size >= 1, "chunking.size", self.size, "must be >= 1")
        _check(self.token_budget is None or self.token_budget >= max_num_seqs, "chunking.token_budget",
               self.token_budget, f"must be >= max_num_seqs ({max_num_seqs}) so every decode fits, or null")
        _check(self.max_chunks_per_step is None or self.max_chunks_per_step >= 1, "chunking.max_chunks_per_step",
               self.max_chunks_per_step, "must be >= 1 or null")
        _check(self.max_partial_prefills is None or self.max_partial_prefills >= 1,
               "chunking.max_partial_prefills", self.max_partial_prefills, "must be >= 1 or null")
        _check(self.decode_headroom is None or self.decode_headroom >= 1, "chunking.decode_headroom",
               self.decode_headroom, "must be >= 1 or null")
        _check(self.prefill_interval >= 1, "chunking.prefill_interval", self.prefill_interval, "must be >= 1")
        _check(self.ubatch is None or self.ubatch >= 1, "chunking.ubatch", self.ubatch, "must be >= 1 or null")

    def step_budget(self, max_num_seqs: int, max_model_len: int) -> int:
        """Tokens one step may carry. An explicit token_budget wins (vLLM's max_num_batched_tokens);
        otherwise the chunk size (Sarathi: the step's budget is the chunk), raised to max_num_seqs so
        every running decode fits. Unchunked, a whole prompt must fit beside every running decode:
        max_model_len + max_num_seqs (with max_model_len alone a long prompt would wait for decodes).
        Never unbounded: a step's activations grow with its tokens, and an unbounded step is an OOM
        on a GPU (every waiting prompt admitted in one step)."""
        if self.token_budget is not None:
            return self.token_budget
        if not self.enabled:
            return max_model_len + max_num_seqs
        return max(self.size, max_num_seqs)


@dataclass
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    chunking: ChunkingConfig = field(default_factory=ChunkingConfig)
    max_num_seqs: int = 64  # most requests running at once
    seed: int = 0  # sampling seed for requests without their own
    # Batch-invariant mode: a request's logits are bitwise the same whatever the schedule
    # (chunk size, budget, ubatch, batch, prefix hits, preemption, fork, cache backend). CPU float32 only.
    deterministic: bool = False

    def validate(self) -> None:
        _check(self.max_num_seqs >= 1, "max_num_seqs", self.max_num_seqs, "must be >= 1")
        _check(isinstance(self.deterministic, bool), "deterministic", self.deterministic, "true or false")
        self.model.validate()
        if self.deterministic:
            check_deterministic(self.model)
        self.cache.validate()
        self.chunking.validate(self.max_num_seqs)
        ch, max_len = self.chunking, self.cache.max_model_len
        _check(ch.enabled or ch.token_budget is None or ch.token_budget >= max_len,
               "chunking.token_budget", ch.token_budget,
               f"with chunking.enabled=false a whole prompt must fit one step: use >= cache.max_model_len "
               f"({max_len}), null, or enable chunking")
        # Unchunked, a prompt longer than the headroom could never be cut to fit it: it would wait
        # for every decode to finish while first-come-first-served admission blocks the queue behind it.
        _check(ch.enabled or ch.decode_headroom is None or ch.decode_headroom >= max_len,
               "chunking.decode_headroom", ch.decode_headroom,
               f"with chunking.enabled=false a whole prompt must fit the headroom: use >= cache.max_model_len "
               f"({max_len}), null, or enable chunking (chunking.enabled=true)")


def check_deterministic(mc: ModelConfig) -> None:
    """The settings deterministic mode can hold its guarantee under (checked on the config alone;
    the builder checks the resolved device, dtype and attention backend again after resolving them)."""
    _check(not mc.device.startswith("cuda"), "model.device", mc.device,
           "deterministic=true runs on CPU only (batch-invariant GEMMs and attention are not implemented "
           "or tested on CUDA): set model.device=cpu, or deterministic=false")
    _check(mc.dtype in ("auto", "float32"), "model.dtype", mc.dtype,
           "deterministic=true needs float32 (the batch-invariant oneDNN linear path is float32 only): "
           "set model.dtype=float32, or deterministic=false")
    _check(mc.attention_backend in ("auto", "cpu_paged"), "model.attention_backend", mc.attention_backend,
           "deterministic=true needs the cpu_paged attention kernel (the torch reference and Triton are not "
           "batch-invariant): set model.attention_backend=cpu_paged (or auto), or deterministic=false")
    _check(not mc.compile, "model.compile", mc.compile,
           "deterministic=true runs eager (compiled numerics differ from eager and are not covered by the "
           "engine's invariance tests): set model.compile=false, or deterministic=false")
