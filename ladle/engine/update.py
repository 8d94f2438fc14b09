"""The update: where request state advances after a step (vLLM's Scheduler.update_from_output,
nano-vllm's Scheduler.postprocess).

For every scheduled request num_computed_tokens catches up and newly full blocks join the prefix
cache; prompt logprobs are appended; a request that sampled takes its token (or forks into its n
samples first, engine/n_samples.py), its grammar advances, and the output side (engine/
output_processor.py) turns it into text and says whether it ended. Every ending goes through
`finish`. One request's failure fails only that request (after the fork, only that sample).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ladle.engine.kv_cache import KVCacheManager
from ladle.engine.logprobs import TopK
from ladle.engine.model_runner import RunnerOutput
from ladle.engine.n_samples import all_finished, fork, per_sample
from ladle.engine.output_processor import OutputProcessor
from ladle.engine.request import Request, RequestOutput
from ladle.engine.sampler import Drawn
from ladle.engine.scheduler import Scheduler, SchedulerOutput
from ladle.engine.structured_output import StructuredOutputManager


@dataclass(slots=True)
class StepResult:
    """What a step's execute phase produced."""

    ran: RunnerOutput  # the forwards: logits rows, prompt logprobs, timings
    forks: dict[Request, list[Request]]  # each parent forking this step -> its n samples
    drawn: Drawn  # a token (and logprobs, when asked) per sampling request


@dataclass(slots=True)
class Update:
    outputs: list[RequestOutput] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)  # ids of requests that failed in the step


class Updater:
    def __init__(self, scheduler: Scheduler, kv: KVCacheManager, output: OutputProcessor,
                 structured: StructuredOutputManager, release_row: Callable[[object], None],
                 requests: dict[str, Request]) -> None:
        self.scheduler = scheduler
        self.kv = kv
        self.output = output
        self.structured = structured
        self.release_row = release_row  # the model runner's persistent block-table row of a sequence
        self.requests = requests  # the engine's live requests by id

    # -- a step ----------------------------------------------------------------------------------
    def update_from_output(self, sched: SchedulerOutput, result: StepResult, start: float, now: float) -> Update:
        update = Update()
        for p in result.ran.prompt_logprobs:
            req = p.request
            if len(req.prompt_logprobs) == p.first:  # positions in order, each once
                req.prompt_logprobs.extend(p.logprobs)
                req.prompt_top_logprobs.extend(p.top)
        for s in sched.scheduled:
            req = s.request
            try:
                if req.metrics.first_scheduled_time is None:
                    req.metrics.first_scheduled_time = start
                req.num_computed_tokens += s.num_tokens
                if s.is_prefill:
                    req.metrics.num_prefill_chunks += 1
                self.kv.register_computed(req)
                if s.produces_token:
                    self._sampled(req, result, now, update)
            except Exception as exc:  # noqa: BLE001 - one request's bad update fails only that request
                self._fail(req, exc, now, update)
        return update

    def fail_step(self, sched: SchedulerOutput, exc: Exception, now: float) -> Update:
        """A forward or the sampler raised: this step's requests fail, every other request goes on."""
        update = Update()
        error = f"step failed: {type(exc).__name__}: {exc}"
        for s in sched.scheduled:
            update.outputs.append(self.end(s.request, "error", now, error))
            update.failed.append(s.request.request_id)
        return update

    def _sampled(self, req: Request, result: StepResult, now: float, update: Update) -> None:
        """What a request's sampling row turns into: a token, n forked samples, or (scoring) the end.
        Once forked, each sample's token is its own: one that fails fails alone, its siblings go on."""
        if req.params.max_tokens == 0:  # scoring: the prompt's logprobs are all it wanted
            self.finish(req, "length", now)
            update.outputs.extend(per_sample(self.output.output(req, [], ""), req.params.n))
            return
        samples = result.forks.get(req)
        if samples is not None:
            fork(req, samples, self.scheduler, self.kv)
            self._end_sequence(req)
            for child in samples:
                self.output.start(child)
        drawn = result.drawn
        for r in samples or [req]:
            try:
                out = self._take_token(r, drawn.tokens[r], now, drawn.logprobs.get(r))
                if out is not None:
                    update.outputs.append(out)
            except Exception as exc:  # noqa: BLE001 - one sample's bad update fails only that sample
                self._fail(r, exc, now, update)

    def _take_token(self, req: Request, token: int, now: float,
                    logprobs: tuple[float, TopK] | None = None) -> RequestOutput | None:
        """The sampled token (with its logprobs, when asked) joins the request; the step's output for
        it (None for an unfinished final_only request)."""
        if req.grammar is not None:  # a failed compile, a grammar with nothing left, the model's end
            ended = self.structured.verdict(req, token)
            if ended is not None:
                return self.end(req, ended[0], now, ended[1])
        # The grammar takes the token first: one it rejects (raises) never lands in the output, nor
        # does its logprob (output_token_ids and logprobs always have the same length).
        grammar_ended = req.grammar is not None and self.structured.accept(req, token)  # took a stop token
        req.output_token_ids.append(token)
        if logprobs is not None:
            req.logprobs.append(logprobs[0])
            req.top_logprobs.append(logprobs[1])
        m = req.metrics
        m.token_times.append(now)
        if m.first_token_time is None:
            m.first_token_time = now
        reason = self.output.take_token(req, token, grammar_ended)
        if reason is not None:
            self.finish(req, reason, now)
        return self.output.token_output(req, token, reason)

    def _fail(self, req: Request, exc: Exception, now: float, update: Update) -> None:
        req.error = f"update failed: {type(exc).__name__}: {exc}"
        if not req.finished:
            self.finish(req, "error", now)
        update.failed.append(req.request_id)
        update.outputs.append(self.output.ended_output(req))

    # -- endings ---------------------------------------------------------------------------------
    def report_refused(self, refused: list[Request], now: float) -> list[RequestOutput]:
        """Requests refused at add_request (finished, with their error), and those whose grammar
        failed to compile, which fail before their prefill."""
        outputs = [self.output.output(r, [], "") for r in refused]
        for r in refused:
            r.metrics.finish_time = now
            self.release(r)
        if self.structured.in_use:
            for req in self.structured.take_failed():
                outputs.append(self.end(req, "error", now, req.grammar.error))
        return outputs

    def end(self, req: Request, reason: str, now: float, error: str | None = None) -> RequestOutput:
        """Finish a request without a new token; its output releases any text held back."""
        req.error = error
        self.finish(req, reason, now)
        return self.output.ended_output(req)

    def finish(self, req: Request, reason: str, now: float) -> None:
        """Every ending: the text held back is flushed, the blocks freed, the request released."""
        self.output.flush(req)
        req.finish_reason = reason
        req.metrics.finish_time = now
        self.scheduler.finish(req)
        self.release(req)

    def release(self, req: Request) -> None:
        """A finished request is reported once; the engine keeps no reference to it afterwards (for
        n > 1, once all its samples are finished)."""
        self._end_sequence(req)
        if all_finished(req):
            self.requests.pop(req.request_id, None)

    def _end_sequence(self, req: Request) -> None:
        self.output.drop(req)
        self.release_row(req.seq_key)
