"""The scheduler: which requests get how many tokens in the next step.

Every step, in this order:
1. Decodes: each running request past its prompt gets 1 token. One that cannot get a KV slot
   preempts the newest running request (blocks freed, recomputed later).
2. Continuing partial prefills (oldest first), then new admissions (arrival order), each getting
   min(remaining, chunking.size, budget left, decode-headroom cap left).
3. Never an empty step while work is pending.
The step is then executed as one flattened batch; `update` advances num_computed_tokens.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from ladle.engine.config import ChunkingConfig, EngineConfig
from ladle.engine.kv_cache import KVCacheManager
from ladle.engine.request import Request, RequestStatus

INF = float("inf")


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_tokens: int  # tokens computed for it this step
    start: int  # num_computed_tokens before the step (position of its first token)
    is_prefill: bool

    @property
    def produces_token(self) -> bool:
        """Whether this step produces the request's next token (last prefill chunk, or decode)."""
        return self.start + self.num_tokens == self.request.num_tokens


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)  # decodes first, then prefills
    preempted: list[Request] = field(default_factory=list)
    cached_prompt_tokens: int = 0  # prompt tokens admitted from the prefix cache this step

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def decode_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled if not s.is_prefill)

    @property
    def prefill_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled if s.is_prefill)


@dataclass(slots=True)
class PrefillBudget:
    """What one step has left for prefill chunks (mini-sglang's PrefillAdder): tokens, chunks, and
    prefills that may still be unfinished after the step. `try_add` grants a request its chunk and
    charges it; a float is infinite (a cap that is off)."""

    tokens: int
    chunks: float
    partials: float
    chunk_size: int
    chunked: bool

    @classmethod
    def for_step(cls, ch: ChunkingConfig, tokens: int, decoding: bool, steps_since_prefill: int) -> PrefillBudget:
        """tokens: the step budget less its decodes. While decodes run, prefill takes at most the decode
        headroom, and only every prefill_interval-th step."""
        if decoding:
            if ch.decode_headroom is not None:
                tokens = min(tokens, ch.decode_headroom)
            if steps_since_prefill < ch.prefill_interval - 1:
                tokens = 0
        return cls(tokens, ch.max_chunks_per_step or INF, ch.max_partial_prefills or INF, ch.size, ch.enabled)

    def has_room(self) -> bool:
        return self.tokens > 0 and self.chunks > 0

    def try_add(self, remaining: int, *, admitting: bool) -> int:
        """Tokens granted to a prefill with `remaining` tokens to compute (0: none this step). A running
        prefill counts as partial whether it gets tokens or not; a new one is refused (0, nothing
        charged) rather than exceed max_partial_prefills."""
        n = self._grant(remaining) if self.chunks > 0 else 0
        partial = n < remaining
        if admitting and (n == 0 or (partial and self.partials <= 0)):
            return 0
        if n > 0:
            self.tokens -= n
            self.chunks -= 1
        self.partials -= partial
        return n

    def _grant(self, remaining: int) -> int:
        if not self.chunked:  # a prompt is prefilled whole or not at all
            return remaining if remaining <= self.tokens else 0
        return int(min(remaining, self.chunk_size, self.tokens))


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.chunking = config.chunking
        self.max_num_seqs = config.max_num_seqs
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order; the last is the newest
        self._steps_since_prefill = 0

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def stuck_request(self) -> Request | None:
        """The request that should be admitted next while nothing runs and no step could be scheduled."""
        return self.waiting[0] if self.waiting and not self.running else None

    # -- scheduling ------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        decodes = self._schedule_decodes(out)
        step = self.chunking.step_budget(self.max_num_seqs, self.config.cache.max_model_len)
        budget = PrefillBudget.for_step(self.chunking, step - len(decodes), bool(decodes), self._steps_since_prefill)
        self._continue_prefills(budget, out)
        self._admit(budget, out)
        if out.prefill_tokens:
            self._steps_since_prefill = 0
        else:
            self._steps_since_prefill += 1
        return out

    def _schedule_decodes(self, out: SchedulerOutput) -> list[Request]:
        """Each running request past its prompt gets 1 token, oldest first. One that needs a block and
        finds none preempts the newest (possibly itself)."""
        decodes: list[Request] = []
        for req in list(self.running):
            if req.status is not RequestStatus.RUNNING or req.is_prefilling:
                continue
            while not self.kv.ensure_capacity(req, req.num_tokens):
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is req:
                    break
            if req.status is RequestStatus.RUNNING:
                decodes.append(req)
        for req in decodes:
            out.scheduled.append(ScheduledRequest(req, 1, req.num_computed_tokens, is_prefill=False))
        return decodes

    def _continue_prefills(self, budget: PrefillBudget, out: SchedulerOutput) -> None:
        """Started prefills (oldest first) get their next chunk."""
        for req in self.running:
            if req.status is not RequestStatus.RUNNING or not req.is_prefilling:
                continue
            n = budget.try_add(req.num_tokens - req.num_computed_tokens, admitting=False)
            if n > 0:
                out.scheduled.append(ScheduledRequest(req, n, req.num_computed_tokens, is_prefill=True))

    def _admit(self, budget: PrefillBudget, out: SchedulerOutput) -> None:
        """Waiting requests in arrival order, until one does not fit (no overtaking). Every rule is
        checked on a plan before anything is taken, so a refused request (no room, no budget, too many
        partial prefills) leaves the pool and the prefix cache exactly as they were."""
        while self.waiting and budget.has_room() and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            plan = self.kv.plan_admission(req)
            if plan is None:
                break
            n = budget.try_add(req.num_tokens - plan.num_cached_tokens, admitting=True)
            if n == 0:  # e.g. an unchunked prompt larger than what is left of the budget
                break
            self.kv.commit_admission(req, plan)
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            if req.metrics.first_scheduled_time is None:  # first admission, not a recompute
                out.cached_prompt_tokens += req.num_computed_tokens
                req.metrics.num_cached_tokens = req.num_computed_tokens
            out.scheduled.append(ScheduledRequest(req, n, req.num_computed_tokens, is_prefill=True))

    def _preempt(self, victim: Request, out: SchedulerOutput) -> None:
        """Free the victim's blocks; it goes back to the front of the queue to be recomputed."""
        self.running.remove(victim)
        self.kv.free(victim)
        victim.num_computed_tokens = 0
        victim.metrics.num_preemptions += 1
        self.requeue([victim])
        out.preempted.append(victim)
        out.scheduled = [s for s in out.scheduled if s.request is not victim]

    # -- bookkeeping -----------------------------------------------------------------------------
    def requeue(self, requests: list[Request]) -> None:
        """Requests without KV go to the front of the queue, in order, to be computed when admitted."""
        for req in reversed(requests):
            req.status = RequestStatus.WAITING
            self.waiting.appendleft(req)

    def replace_running(self, old: Request, running: list[Request], requeued: list[Request]) -> None:
        """A running request is replaced by others (its n samples, engine/n_samples.py): those with KV
        take its place among the running requests, the others are requeued."""
        i = self.running.index(old)
        self.running[i : i + 1] = running
        self.requeue(requeued)

    def finish(self, req: Request) -> None:
        """Remove a finished (or failed) request and free its blocks."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.free(req)
        req.status = RequestStatus.FINISHED
