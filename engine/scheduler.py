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

from engine.config import EngineConfig
from engine.kv_cache import KVCacheManager
from engine.request import Request, RequestStatus


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_tokens: int  # tokens computed for it this step
    start: int  # num_computed_tokens before the step (position of its first token)
    is_prefill: bool

    @property
    def samples(self) -> bool:
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


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.chunking = config.chunking
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order; the last is the newest
        self._steps_since_prefill = 0

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- scheduling ------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        ch = self.chunking
        out = SchedulerOutput()
        budget = ch.step_budget(self.config.max_num_seqs, self.config.cache.max_model_len)

        # 1. Decodes, oldest first. A request that needs a block and finds none preempts the newest.
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
        budget -= len(decodes)

        # 2. Prefill chunks: partial prefills first, then admissions.
        prefill_cap = budget
        if decodes:
            if ch.decode_headroom is not None:
                prefill_cap = min(prefill_cap, ch.decode_headroom)
            if self._steps_since_prefill < ch.prefill_interval - 1:
                prefill_cap = 0
        chunks = 0
        max_chunks = ch.max_chunks_per_step or float("inf")
        max_partial = ch.max_partial_prefills or float("inf")

        def grant(remaining: int) -> int:
            if not ch.enabled:
                return remaining if remaining <= prefill_cap else 0
            return int(min(remaining, ch.size, prefill_cap))

        partial_after = 0  # requests that will still be mid-prefill after this step
        for req in self.running:
            if req.status is not RequestStatus.RUNNING or not req.is_prefilling:
                continue
            n = grant(req.num_tokens - req.num_computed_tokens) if chunks < max_chunks else 0
            if n > 0:
                out.scheduled.append(ScheduledRequest(req, n, req.num_computed_tokens, is_prefill=True))
                prefill_cap -= n
                chunks += 1
            if req.num_computed_tokens + n < req.num_tokens:
                partial_after += 1

        # Admissions: every rule is checked on a plan before anything is taken, so a request that is
        # refused (no room, no budget, too many partial prefills) leaves the pool and the prefix cache
        # exactly as they were.
        while self.waiting and chunks < max_chunks and prefill_cap > 0:
            req = self.waiting[0]
            if len(self.running) >= self.config.max_num_seqs:
                break
            plan = self.kv.plan_admission(req)
            if plan is None:
                break
            n = grant(req.num_tokens - plan.num_cached_tokens)
            if n == 0:  # e.g. an unchunked prompt larger than what is left of the budget
                break
            leaves_partial = plan.num_cached_tokens + n < req.num_tokens
            if leaves_partial and partial_after >= max_partial:
                break
            self.kv.commit_admission(req, plan)
            partial_after += leaves_partial
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            if req.metrics.first_scheduled_time is None:  # first admission, not a recompute
                out.cached_prompt_tokens += req.num_computed_tokens
                req.metrics.num_cached_tokens = req.num_computed_tokens
            out.scheduled.append(ScheduledRequest(req, n, req.num_computed_tokens, is_prefill=True))
            prefill_cap -= n
            chunks += 1

        if out.prefill_tokens:
            self._steps_since_prefill = 0
        else:
            self._steps_since_prefill += 1
        return out

    def _preempt(self, victim: Request, out: SchedulerOutput) -> None:
        """Free the victim's blocks; it goes back to the front of the queue to be recomputed."""
        self.running.remove(victim)
        self.kv.free(victim)
        victim.num_computed_tokens = 0
        victim.status = RequestStatus.WAITING
        victim.metrics.num_preemptions += 1
        self.waiting.appendleft(victim)
        out.preempted.append(victim)
        out.scheduled = [s for s in out.scheduled if s.request is not victim]

    def replace(self, parent: Request, running: list[Request], waiting: list[Request]) -> None:
        """n samples (engine/n_samples.py): the forked samples take the parent's place among the running
        requests; those without KV yet go to the front of the queue, to be computed like preempted ones."""
        i = self.running.index(parent)
        self.running[i : i + 1] = running
        for req in reversed(waiting):
            req.status = RequestStatus.WAITING
            self.waiting.appendleft(req)

    # -- bookkeeping -----------------------------------------------------------------------------
    def finish(self, req: Request) -> None:
        """Remove a finished (or failed) request and free its blocks."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.free(req)
        req.status = RequestStatus.FINISHED
