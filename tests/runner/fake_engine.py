"""A small stand-in for LLMEngine with the same API, for fast runner tests that need no model.

Byte-level tokenizer, chunked prefill, one decode token per step, a fixed cost per step on the clock.
Deterministic: the n-th output token of a request depends only on its prompt (and, for the n-samples
fields, its sample index and seed). n samples: the prompt is prefilled once, then forked. Logprobs are
made-up but deterministic functions of the token (`fake_logprob`); `structured.choice` makes the output
one of the choices; a json_schema that is not a mapping (or JSON text of one) fails the request.
"""

from __future__ import annotations

import dataclasses
import json
from typing import ClassVar

from ladle.engine.clock import Clock, VirtualClock
from ladle.engine.config import EngineConfig, ModelConfig
from ladle.engine.request import RequestMetrics, RequestOutput, StepStats
from ladle.engine.sampling_params import SamplingParams


class ByteTokenizer:
    eos_token_ids: ClassVar[list[int]] = [0]
    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i % 256 for i in ids).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        return self.encode("".join(f"<{m['role']}>{m['content']}\n" for m in messages) + "<assistant>")


def fake_logprob(token: int) -> float:
    return -((token % 10) + 1) / 10


def fake_top(token: int, k: int) -> list[tuple[int, float]]:
    """k alternatives, best first: the token itself, then its neighbours with lower logprobs."""
    return [(token + j, fake_logprob(token) - j) for j in range(k)]


class _Req:
    def __init__(self, rid: str, prompt: list[int], params: SamplingParams, arrival: float) -> None:
        self.id, self.prompt, self.params = rid, prompt, params
        self.out: list[int] = []
        self.computed = 0
        self.metrics = RequestMetrics(arrival_time=arrival)
        self.error: str | None = None
        self.finish_reason: str | None = None
        self.sample_index = 0
        self.forked = params.n <= 1  # n > 1: forked into n samples once the prompt is prefilled

    def _choice(self) -> bytes | None:
        p = self.params
        choice = p.structured.choice if p.structured is not None else None
        return choice[(self.sample_index + (p.seed or 0)) % len(choice)].encode() if choice else None

    def choice_done(self) -> bool:
        text = self._choice()
        return text is not None and len(self.out) >= len(text)

    def token(self) -> int:
        p = self.params
        text = self._choice()
        if text is not None:
            return text[len(self.out)] if len(self.out) < len(text) else 0
        return 32 + (sum(self.prompt) + 7 * len(self.out) + 13 * self.sample_index + 3 * (p.seed or 0)) % 90


class FakeEngine:
    def __init__(self, max_num_seqs: int = 4, chunk: int = 32, max_model_len: int = 256,
                 clock: Clock | None = None, step_cost: float = 1e-3) -> None:
        self.tokenizer = ByteTokenizer()
        self.max_model_len = max_model_len
        self.clock = clock or VirtualClock()
        self.max_num_seqs, self.chunk, self.step_cost = max_num_seqs, chunk, step_cost
        self.waiting: list[_Req] = []
        self.running: list[_Req] = []
        self.failed: list[_Req] = []
        self.last_step: StepStats | None = None
        self.steps = 0
        self.max_waiting = 0  # most requests ever queued (the runner's read-ahead bound shows here)
        self.params_seen: dict[str, SamplingParams] = {}  # request id -> the params it was added with

    # what runner/calibration.engine_key reads: a fake has no shapes, one fixed key
    arch, dtype, device = "fake", "float32", "cpu"
    config = EngineConfig(model=ModelConfig(name="fake"))

    def time_forward(self, query_lens: list[int], seq_lens: list[int]) -> float:
        """The stand-in's cost model: step_cost per 32 tokens (what its steps take on the virtual clock)."""
        return self.step_cost * max(1, sum(query_lens) / 32)

    def num_total_blocks(self) -> int:
        return 1000

    def num_free_blocks(self) -> int:
        return 1000 - self._blocks()

    def _blocks(self) -> int:
        return sum((r.computed + 15) // 16 for r in self.running)

    def add_request(self, prompt, params: SamplingParams, request_id: str | None = None,
                    arrival_time: float | None = None) -> str:
        rid = request_id or f"r{self.steps}-{len(self.waiting)}"
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        r = _Req(rid, ids, params, self.clock.now() if arrival_time is None else arrival_time)
        if not ids:
            r.error = "prompt is empty"
        elif len(ids) + params.max_tokens > self.max_model_len:
            r.error = f"prompt of {len(ids)} tokens + max_tokens {params.max_tokens} > max_model_len {self.max_model_len}"
        elif any(not 0 <= t < 256 for t in ids):
            r.error = "token id out of vocabulary"
        elif params.max_tokens < 1 and params.prompt_logprobs is None:
            r.error = "max_tokens < 1"
        elif params.n < 1:
            r.error = f"n={params.n} must be >= 1"
        elif params.structured is not None and params.structured.json_schema is not None:
            schema = params.structured.json_schema
            try:
                schema = json.loads(schema) if isinstance(schema, str) else schema
                assert isinstance(schema, (dict, bool))
            except (ValueError, AssertionError):
                r.error = f"structured output: json_schema {schema!r:.40} does not compile"
        self.params_seen[rid] = params
        (self.failed if r.error else self.waiting).append(r)
        self.max_waiting = max(self.max_waiting, len(self.waiting))
        return rid

    def abort_request(self, request_id: str) -> None:
        self.waiting = [r for r in self.waiting if r.id != request_id]
        self.running = [r for r in self.running if r.id != request_id]

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self.failed)

    def _output(self, r: _Req, new: list[int], finished: bool) -> RequestOutput:
        p = r.params
        lp, plp = p.logprobs, p.prompt_logprobs
        return RequestOutput(
            r.id, r.prompt, list(r.out), self.tokenizer.decode(r.out), new, self.tokenizer.decode(new), finished,
            r.finish_reason, r.error, r.metrics, sample_index=r.sample_index,
            logprobs=None if lp is None else [fake_logprob(t) for t in r.out],
            top_logprobs=None if lp is None else [fake_top(t, lp) for t in r.out],
            prompt_logprobs=None if plp is None else [None] + [fake_logprob(t) for t in r.prompt[1:]],
            prompt_top_logprobs=None if plp is None else [[]] + [fake_top(t, plp) for t in r.prompt[1:]])

    def _fork(self, r: _Req) -> list[_Req]:
        samples = []
        for i in range(r.params.n):
            c = _Req(r.id, r.prompt, r.params, r.metrics.arrival_time)
            c.computed, c.sample_index, c.forked = r.computed, i, True
            c.metrics = dataclasses.replace(r.metrics, token_times=[])
            samples.append(c)
        return samples

    def step(self) -> list[RequestOutput]:
        now = self.clock.now()
        outs = []
        for r in self.failed:
            r.finish_reason, r.metrics.finish_time = "error", now
            outs.append(self._output(r, [], True))
        self.failed = []
        while self.waiting and len(self.running) < self.max_num_seqs:
            self.running.append(self.waiting.pop(0))
        if not self.running:
            return outs
        scheduled, decode, prefill, prefill_reqs = {}, 0, 0, 0
        for r in self.running:
            if r.computed < len(r.prompt):
                n = min(self.chunk, len(r.prompt) - r.computed)
                prefill += n
                prefill_reqs += 1
                r.metrics.num_prefill_chunks += 1
                if r.metrics.first_scheduled_time is None:
                    r.metrics.first_scheduled_time = now
            else:
                n = 1
                decode += 1
            scheduled[r.id] = scheduled.get(r.id, 0) + n  # the n samples of a request share its id
            r.computed += n
        duration = self.step_cost * (1 + 0.01 * (decode + prefill))
        self.clock.step_finished(duration)
        end = self.clock.now()
        self.last_step = StepStats(self.steps, now, duration, decode, prefill, prefill_reqs, len(self.running),
                                   len(self.waiting), self._blocks(), scheduled)
        self.steps += 1
        still = []
        running = []
        for r in self.running:
            if r.computed >= len(r.prompt) and r.params.max_tokens == 0:  # scoring: prompt logprobs only
                r.finish_reason, r.metrics.finish_time = "length", end
                for i in range(r.params.n):
                    r.sample_index = i
                    outs.append(self._output(r, [], True))
                continue
            running += [r] if r.forked or r.computed < len(r.prompt) else self._fork(r)
        for r in running:
            if r.computed >= len(r.prompt):
                tok = r.token()
                r.out.append(tok)
                r.metrics.token_times.append(end)
                if r.metrics.first_token_time is None:
                    r.metrics.first_token_time = end
                chosen = r.choice_done()
                done = chosen or len(r.out) >= r.params.max_tokens
                if done:
                    r.finish_reason, r.metrics.finish_time = "stop" if chosen else "length", end
                outs.append(self._output(r, [tok], done))
                if done:
                    continue
            still.append(r)
        self.running = still
        return outs
