"""LLMEngine: add requests, step, read outputs. One step = schedule -> execute -> update.

The parts are built by engine/builder.py; the engine only wires a step through them:
- schedule: engine/scheduler.py (who gets how many tokens),
- execute: engine/model_runner.py (the forwards) and engine/sampler.py (the draw; n-sample forks
  repeat a parent's row, engine/n_samples.py),
- update: engine/update.py (request state advances, text and endings via engine/output_processor.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from ladle.engine.builder import build
from ladle.engine.clock import Clock, WallClock
from ladle.engine.config import EngineConfig
from ladle.engine.n_samples import expand_rows, make_forks, sequences
from ladle.engine.request import Request, RequestOutput, StepStats
from ladle.engine.sampling_params import SamplingParams
from ladle.engine.scheduler import SchedulerOutput
from ladle.engine.step_timer import StepTimer
from ladle.engine.structured_output import StructuredOutputManager
from ladle.engine.update import StepResult, Update


class LLMEngine:
    def __init__(self, config: EngineConfig, clock: Clock | None = None) -> None:
        self.config = config
        self.clock = clock or WallClock()
        parts = build(config)
        planned = parts.planned
        self.arch, self.device, self.dtype = planned.arch, planned.device, planned.dtype
        self.kv_spec, self.memory_plan = planned.kv_spec, planned.memory_plan
        self.model = parts.model
        self.kernel_warmup_s, self.compile_seconds = parts.kernel_warmup_s, parts.compile_seconds
        self.graph_capture_s = parts.graph_capture_s  # CUDA graphs' capture seconds (None: not used)
        self.kv, self.scheduler = parts.kv, parts.scheduler
        self.model_runner, self.sampler = parts.model_runner, parts.sampler
        self.input_processor, self.output_processor = parts.input_processor, parts.output_processor
        self.updater = parts.updater
        self._structured = parts.structured
        self.requests = parts.requests  # live requests by id (the updater drops finished ones)
        self._refused: list[Request] = []
        self._step_count = 0
        self.last_step: StepStats | None = None

    # -- requests --------------------------------------------------------------------------------
    def add_request(
        self,
        prompt: Sequence[int] | str,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        arrival_time: float | None = None,
    ) -> str:
        """Queue a request. Bad input never raises: the request comes back from the next step()
        finished with finish_reason "error" and a message saying what to fix."""
        rid = self.input_processor.request_id(request_id, self.requests)
        if rid in self.requests:
            raise ValueError(f"request_id {rid!r} is already in use; give each request a unique id")
        arrival = self.clock.now() if arrival_time is None else float(arrival_time)
        req = self.input_processor.process(rid, prompt, params or SamplingParams(), arrival)
        self.requests[rid] = req
        if req.finished:
            self._refused.append(req)
        else:
            self.output_processor.start(req)
            self.scheduler.add(req)
        return rid

    def abort_request(self, request_id: str) -> None:
        """Abort a request; for n > 1, all of its samples."""
        req = self.requests.get(request_id)
        if req is None:
            return
        if any(r is req for r in self._refused):
            # Refused at add_request, its error not reported yet: aborting drops that report too, so the
            # id is free again and nothing is left unfinished (a job interrupted before its first step).
            self._refused = [r for r in self._refused if r is not req]
            self.updater.release(req)
            return
        for r in sequences(req):
            if not r.finished:
                self.updater.finish(r, "abort", self.clock.now())

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work() or bool(self._refused)

    # -- stepping --------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One engine step: schedule -> execute -> update. Returns the outputs it produced."""
        outputs = self._report_refused()
        timer = StepTimer(self.clock, self.device)
        sched = self.scheduler.schedule()
        if not sched.scheduled:
            return outputs + self._idle()
        timer.lap("schedule")
        try:
            result = self._execute(sched, timer)
        except Exception as exc:  # noqa: BLE001 - isolate: fail this step's requests, keep serving
            return outputs + self._fail_step(sched, exc, timer)
        update = self.updater.update_from_output(sched, result, timer.start, timer.compute_done())
        timer.update_done()
        self._record(sched, timer.start, self.clock.now(), update, result.ran.num_forwards, timer.phases)
        return outputs + update.outputs

    def _execute(self, sched: SchedulerOutput, timer: StepTimer) -> StepResult:
        """The forwards, then a token drawn per sampling row (n-sample parents fork: their row repeats)."""
        ran = self.model_runner.execute(sched.scheduled)
        timer.forwards_done(ran.prepare_time)
        sampling = [s.request for s in sched.scheduled if s.produces_token]
        forks = make_forks(sampling, self.device)
        rows, drawers = expand_rows(sampling, forks)
        mask = self._structured.apply_masks if self._structured.in_use else None
        drawn = self.sampler.draw(ran.logits, rows, drawers, mask, self.output_processor.eos_token_ids)
        timer.lap("sample")
        return StepResult(ran, forks, drawn)

    def _fail_step(self, sched: SchedulerOutput, exc: Exception, timer: StepTimer) -> list[RequestOutput]:
        """A forward or the sampler raised: the step's requests fail (no forward is counted as done)."""
        now = timer.compute_done()
        update = self.updater.fail_step(sched, exc, now)
        self._record(sched, timer.start, now, update, num_forwards=0, phases={})
        return update.outputs

    def _report_refused(self) -> list[RequestOutput]:
        outputs = self.updater.report_refused(self._refused, self.clock.now())
        self._refused = []
        return outputs

    def _idle(self) -> list[RequestOutput]:
        """Nothing could be scheduled. The rules guarantee progress (validation keeps every request
        within the cache); should that ever fail, the stuck request fails instead of the job spinning."""
        self.last_step = None
        req = self.scheduler.stuck_request()
        if req is None:
            return []
        error = (f"request could not be scheduled ({req.num_tokens} tokens, "
                 f"{self.kv.num_free_blocks}/{self.kv.num_blocks} KV blocks free)")
        return [self.updater.end(req, "error", self.clock.now(), error)]

    def _record(self, sched: SchedulerOutput, start: float, end: float, update: Update, num_forwards: int,
                phases: dict[str, float]) -> None:
        self._step_count += 1
        per_id: dict[str, int] = {}  # tokens computed per request id (the n samples of a request share it)
        for s in sched.scheduled:
            per_id[s.request.request_id] = per_id.get(s.request.request_id, 0) + s.num_tokens
        self.last_step = StepStats(
            step=self._step_count - 1, start_time=start, duration=end - start,
            decode_tokens=sched.decode_tokens, prefill_tokens=sched.prefill_tokens,
            prefill_requests=sum(1 for s in sched.scheduled if s.is_prefill),
            running=self.scheduler.num_running, waiting=self.scheduler.num_waiting,
            kv_blocks_used=self.kv.num_used_blocks, scheduled=per_id,
            cached_prompt_tokens=sched.cached_prompt_tokens, num_forwards=num_forwards,
            preempted=[r.request_id for r in sched.preempted], failed=update.failed,
            phase_times=phases,
        )

    # -- properties ------------------------------------------------------------------------------
    @property
    def structured(self) -> StructuredOutputManager:
        return self._structured

    @structured.setter
    def structured(self, manager: StructuredOutputManager) -> None:
        """Use another manager (its compiled grammars: engines of one tokenizer may share one)."""
        self._structured = self.input_processor.structured = self.updater.structured = manager

    @property
    def tokenizer(self):
        return self.input_processor.tokenizer

    @property
    def vocab_size(self) -> int:
        return self.arch.vocab_size

    @property
    def max_model_len(self) -> int:
        return self.config.cache.max_model_len

    @property
    def eos_token_ids(self) -> set[int]:
        return self.output_processor.eos_token_ids

    def time_forward(self, query_lens: list[int], seq_lens: list[int]) -> float:
        """Seconds of one forward of this shape on dummy tokens, outside the engine's cache and
        scheduler (sequence i computes its last query_lens[i] of seq_lens[i] tokens); its last layer
        computes the sampling rows only, as a step's forward does (without prompt logprobs)."""
        from ladle.engine.profiling import dummy_forward

        return dummy_forward(self.model, query_lens, seq_lens, self.config.model.attention_backend, every_row=False)

    def num_free_blocks(self) -> int:
        return self.kv.num_free_blocks

    def num_total_blocks(self) -> int:
        return self.kv.num_blocks

    # -- convenience -----------------------------------------------------------------------------
    def generate(
        self, prompts: Sequence[str] | Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams]
    ) -> list[RequestOutput]:
        """Run prompts to completion; outputs in input order (a prompt with n > 1 gives its n samples in
        sample_index order; one output if it failed before its prefill finished)."""
        plist = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"got {len(plist)} SamplingParams for {len(prompts)} prompts")
        # Only finished outputs are returned: no per-step outputs (as vLLM's LLM.generate).
        plist = [dataclasses.replace(p, output_kind="final_only")
                 if isinstance(p, SamplingParams) and p.output_kind == "delta" else p for p in plist]
        ids: list[str] = []
        try:
            for p, sp in zip(prompts, plist):
                ids.append(self.add_request(p, sp))
        except BaseException:
            for rid in ids:  # none of this call's requests is left queued with nobody to collect it
                self.abort_request(rid)
            raise
        done: dict[str, list[RequestOutput]] = {i: [] for i in ids}
        pending = set(ids)
        while pending and self.has_unfinished_requests():
            for out in self.step():
                if out.finished and out.request_id in done:
                    done[out.request_id].append(out)
            pending = {i for i in pending if i in self.requests}  # an id leaves once all its samples finish
        return [o for i in ids for o in sorted(done[i], key=lambda o: o.sample_index)]
