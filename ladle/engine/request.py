"""A request's state as it moves through the engine, and what the engine reports about it.

Scheduling needs one number: `num_computed_tokens`, how many of the request's tokens (prompt, then
generated) are in the KV cache. The request is prefilling while that is below the prompt length.
Chunking, prefix-cache hits and preemption are all just moves of that number.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from ladle.engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # not yet admitted, or preempted and waiting to be recomputed
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True)
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    finish_time: float | None = None
    num_prefill_chunks: int = 0  # prefill steps, counting recomputation after preemption
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at first admission


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    # All generated so far. Not a copy: on an unfinished output it is the request's own list, which
    # the next step extends (copying it every step would cost O(output) per request per step).
    output_token_ids: list[int]
    text: str  # detokenised output so far (stop string cut off)
    new_token_ids: list[int]  # tokens appended by this step
    new_text: str  # text appended by this step
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "error" | "abort"
    error: str | None
    metrics: RequestMetrics
    sample_index: int = 0               # request_id is the id given to add_request, same for all n samples
    logprobs: list[float] | None = None        # per generated token: logprob of the chosen token
    top_logprobs: list[list[tuple[int, float]]] | None = None   # per generated token: top-k (token_id, logprob), best first
    prompt_logprobs: list[float | None] | None = None           # per prompt position i: log P(prompt[i] | prompt[:i]); [0] is None
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None  # per prompt position; [0] is []


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    index: int = 0  # admission order, for stable ordering
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    num_cached_blocks: int = 0  # leading blocks already registered in the prefix cache
    block_hashes: list[bytes] = field(default_factory=list)  # prefix-cache keys of the full blocks so far
    finish_reason: str | None = None
    error: str | None = None
    text: str = ""  # detokenised output (stop string cut off)
    num_emitted_chars: int = 0  # prefix of `text` already reported (the rest may start a stop string)
    # Per-request RNG state (torch.Generator) when params.seed is set; set by the sampler.
    generator: object | None = None
    # -- n samples (engine/n_samples.py) and logprobs --
    sample_index: int = 0
    children: list[Request] = field(default_factory=list)  # n > 1: the samples forked after the prefill
    parent: Request | None = None  # a sample: the request that prefilled its prompt
    logprobs: list[float] = field(default_factory=list)  # per generated token (params.logprobs set)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    # Prompt logprobs computed so far, in position order ([0] is None); a prefix of the prompt.
    prompt_logprobs: list[float | None] = field(default_factory=lambda: [None])
    prompt_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=lambda: [[]])
    # Structured output: its GrammarState (engine/structured_output.py), None without a spec.
    grammar: object | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens start..end-1 of prompt + output, copying only those (never the whole sequence)."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]

    def token_at(self, i: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[i] if i < n else self.output_token_ids[i - n]

    @property
    def is_prefilling(self) -> bool:
        """True while the cache lacks tokens that are already known (prompt, or output after preemption)."""
        return not self.output_token_ids or self.num_tokens - self.num_computed_tokens > 1

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def seq_key(self) -> str | tuple[str, int]:
        """Identifies one sequence (the n samples of a request share its request_id)."""
        return self.request_id if self.parent is None else (self.request_id, self.sample_index)

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt logprobs asked for and not all computed yet: its prefill must not skip positions
        (no prefix-cache hits), and each prefill chunk yields logprobs for its positions."""
        return self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens


@dataclass(slots=True)
class StepStats:
    """What one engine step did (the runner writes one steps.parquet row from it)."""

    step: int
    start_time: float
    duration: float
    decode_tokens: int
    prefill_tokens: int
    prefill_requests: int
    running: int
    waiting: int
    kv_blocks_used: int
    scheduled: dict[str, int]  # request id -> tokens computed this step
    cached_prompt_tokens: int = 0  # prompt tokens taken from the prefix cache by admissions this step
    num_forwards: int = 1  # > 1 when chunking.ubatch splits the step
    preempted: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    # Wall seconds per phase: schedule, prepare (batch + metadata), forward, sample, update.
    phase_times: dict[str, float] = field(default_factory=dict)
