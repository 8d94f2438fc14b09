"""LLMEngine: add requests, step, read outputs. One step = schedule -> execute -> update."""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.clock import Clock, WallClock
from engine.config import EngineConfig, EngineConfigError
from engine.detokenizer import Detokenizer, DetokState, find_stop
from engine.kv_cache import KVCacheManager
from engine.logprobs import SampleLogprobs, TopK
from engine.memory import plan_kv_cache, profile_peak_bytes, prompt_logprob_bytes, sampler_bytes
from engine.model_runner import ModelRunner
from engine.n_samples import expand_rows, make_samples
from engine.profiling import compile_forward, warm_up_kernels
from engine.request import Request, RequestMetrics, RequestOutput, RequestStatus, StepStats
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerOutput
from engine.structured_output import StructuredOutputManager
from kernels import get_backend

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Drawn:
    """What the sampler drew in a step: a token (and logprobs, when asked) per sampling request;
    `forks` maps each parent forking this step to its n samples."""

    forks: dict[Request, list[Request]]
    tokens: dict[Request, int]
    logprobs: dict[Request, tuple[float, TopK]]


def resolve_device(device: str) -> torch.device:
    """'auto' -> CUDA when available, else CPU; an explicit CUDA device must exist."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"model.device={device!r} but CUDA is not available; use model.device=cpu or auto")
    return dev


class LLMEngine:
    def __init__(self, config: EngineConfig, clock: Clock | None = None) -> None:
        from models import load_model, load_tokenizer, resolve_architecture, resolve_dtype  # engine -> models

        self.config = config
        self.clock = clock or WallClock()
        mc = config.model
        try:  # the config phase: a mistake here is the user's to fix, found before any weight is loaded
            config.validate()
            self.device = resolve_device(mc.device)
            _dir, arch = resolve_architecture(mc.path, mc.architecture, mc.random_weights)
            self.arch = arch
            self.max_model_len = config.cache.max_model_len
            if self.max_model_len > arch.max_position_embeddings:
                raise EngineConfigError(
                    f"cache.max_model_len={self.max_model_len} exceeds the model's max_position_embeddings "
                    f"({arch.max_position_embeddings}); lower cache.max_model_len"
                )
            self.dtype = resolve_dtype(mc.dtype, self.device, arch)  # the one rule for dtype "auto"
            elem = torch.tensor([], dtype=self.dtype).element_size()
            self.memory_plan, num_blocks = plan_kv_cache(config, arch, elem, self.device)
            self.tokenizer = load_tokenizer(mc.path, vocab_size=arch.vocab_size, tokenizer=mc.tokenizer)
        except EngineConfigError:
            raise
        except (ValueError, FileNotFoundError) as e:
            raise EngineConfigError(str(e)) from e
        self.kernel_warmup_s = 0.0  # seconds compiling the Triton kernels before the first step (CUDA)
        self.model = load_model(mc.path, mc.architecture, dtype=self.dtype, device=self.device, seed=mc.seed,
                                random_weights=mc.random_weights)
        if self.device.type == "cuda":  # measure the largest step instead of estimating it (vLLM's profile run)
            step = config.chunking.step_budget(config.max_num_seqs, self.max_model_len)
            peak = profile_peak_bytes(self.model, step, self.max_model_len, mc.attention_backend)
            if get_backend(self.device, mc.attention_backend) == "triton":  # compile before the first step
                # The kernels are compiled per cache block size: warm up the one this run's cache has.
                block = self.max_model_len if config.cache.backend == "contiguous" else config.cache.block_size
                self.kernel_warmup_s = warm_up_kernels(self.model, self.max_model_len, config.max_num_seqs, step,
                                                       mc.attention_backend, block_size=block)
            peak += sampler_bytes(min(step, config.max_num_seqs), arch.vocab_size) + prompt_logprob_bytes(
                arch.vocab_size)
            self.memory_plan, num_blocks = plan_kv_cache(  # against the free memory measured before loading
                config, arch, elem, self.device, measured_activation_bytes=peak,
                available_bytes=self.memory_plan.available_bytes)
        self.compile_seconds: float | None = None  # model.compile: the warm-up's compile time, once
        if mc.compile:
            self.compile_seconds = compile_forward(self.model, mc.attention_backend)
            log.info("compiled forward in %.1f s", self.compile_seconds)
        self.eos_token_ids = set(arch.eos_token_ids or []) | set(getattr(self.tokenizer, "eos_token_ids", []) or [])
        self.vocab_size = arch.vocab_size
        self.kv = KVCacheManager(
            config.cache,
            num_layers=arch.num_layers,
            num_kv_heads=arch.num_kv_heads,
            head_dim=arch.head_dim,
            dtype=self.dtype,
            device=self.device,
            max_num_seqs=config.max_num_seqs,
            num_blocks=num_blocks,
        )
        self.scheduler = Scheduler(config, self.kv)
        # Logprobs report top-k alternatives among the ids the tokenizer knows (a padded LM head is wider).
        logprob_vocab = min(self.vocab_size, getattr(self.tokenizer, "vocab_size", None) or self.vocab_size)
        self.runner = ModelRunner(
            self.model, self.kv, self.device, config.chunking.ubatch, attention_backend=mc.attention_backend,
            logprob_vocab=logprob_vocab,
        )
        self.sampler = Sampler(config.seed, self.device)
        # Rows the sampler takes at once: what the memory plan budgets (memory.sampler_bytes).
        self.sample_rows = max(1, min(config.chunking.step_budget(config.max_num_seqs, self.max_model_len),
                                      config.max_num_seqs))
        self.detokenizer = Detokenizer(self.tokenizer)
        self.structured = StructuredOutputManager(self.tokenizer, self.vocab_size, sorted(self.eos_token_ids))
        self.requests: dict[str, Request] = {}
        self._detok: dict[Request, DetokState] = {}  # per sequence (the n samples of a request each have one)
        self._rejected: list[Request] = []
        self._ids = itertools.count()
        self._order = itertools.count()
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
        params = params or SamplingParams()
        rid = str(next(self._ids)) if request_id is None else str(request_id)
        if rid in self.requests:
            raise ValueError(f"request_id {rid!r} is already in use; give each request a unique id")
        error = None
        try:
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        except Exception as exc:  # noqa: BLE001 - any tokenizer failure is this request's error
            ids, error = [], f"could not tokenize the prompt: {exc}"
        arrival = self.clock.now() if arrival_time is None else float(arrival_time)
        req = Request(rid, ids, params, RequestMetrics(arrival_time=arrival), index=next(self._order))
        try:
            error = error or self._validate(req)
            if error is None and params.structured is not None:  # compile starts now, off the step's path
                error = self.structured.submit(req)
        except Exception as exc:  # noqa: BLE001 - e.g. a params object of the wrong kind
            error = f"invalid request: {type(exc).__name__}: {exc}"
        self.requests[rid] = req
        if error:
            req.status = RequestStatus.FINISHED
            req.finish_reason, req.error = "error", error
            self._rejected.append(req)
        else:
            self._detok[req] = DetokState.for_prompt(len(ids))
            self.scheduler.add(req)
        return rid

    def _validate(self, req: Request) -> str | None:
        problems = req.params.problems()
        if problems:
            return "invalid sampling params: " + "; ".join(problems)
        n = req.num_prompt_tokens
        if n == 0:
            return "empty prompt: give at least one token"
        bad = [t for t in req.prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            return f"prompt token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})"
        if n + req.params.max_tokens > self.max_model_len:
            return (
                f"prompt of {n} tokens + max_tokens={req.params.max_tokens} exceeds max_model_len="
                f"{self.max_model_len}; shorten the prompt, lower max_tokens or raise cache.max_model_len"
            )
        if self.kv.blocks_needed(n + req.params.max_tokens) > self.kv.num_blocks:
            return (
                f"prompt of {n} tokens + max_tokens={req.params.max_tokens} needs "
                f"{self.kv.blocks_needed(n + req.params.max_tokens)} KV blocks but the cache has "
                f"{self.kv.num_blocks}; raise cache.num_blocks or cache.memory_gb"
            )
        return None

    def abort_request(self, request_id: str) -> None:
        """Abort a request; for n > 1, all of its samples."""
        req = self.requests.get(request_id)
        if req is None:
            return
        for r in req.children or [req]:
            if not r.finished:
                self._finish(r, "abort", self.clock.now())

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work() or bool(self._rejected)

    @property
    def calibration_key(self) -> str:
        """What a timing of this engine depends on (a stored calibration is reused only for the same):
        the architecture's shapes, dtype, device, attention backend, torch's threads and the longest
        sequence (it caps the calibrated prefill). Not the weights' values, which do not change speed."""
        parts = {
            "arch": repr(self.arch), "dtype": str(self.dtype), "device": str(self.device),
            "backend": self.config.model.attention_backend, "threads": torch.get_num_threads(),
            "max_model_len": self.max_model_len, "compile": self.config.model.compile,
        }
        digest = hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]
        return f"{self.config.model.name}|{digest}"

    def time_forward(self, query_lens: list[int], seq_lens: list[int]) -> float:
        """Seconds of one forward of this shape on dummy tokens, outside the engine's cache and
        scheduler (sequence i computes its last query_lens[i] of seq_lens[i] tokens)."""
        from engine.profiling import dummy_forward

        return dummy_forward(self.model, query_lens, seq_lens, self.config.model.attention_backend)

    def num_free_blocks(self) -> int:
        return self.kv.pool.num_free

    def num_total_blocks(self) -> int:
        return self.kv.num_blocks

    # -- stepping --------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One engine step: schedule -> execute -> update. Returns the outputs it produced."""
        outputs = self._report_rejected()
        start, t0 = self.clock.now(), time.perf_counter()
        sched = self.scheduler.schedule()
        if not sched.scheduled:
            return outputs + self._idle()
        phases = {"schedule": time.perf_counter() - t0}
        try:
            drawn = self._execute(sched, phases)
        except Exception as exc:  # noqa: BLE001 - isolate: fail this step's requests, keep serving
            return outputs + self._fail_step(sched, exc, start, t0)
        # Tokens exist once sampled; the update's own time (detokenising, stop checks) still counts
        # toward the step, so the clock is advanced by it afterwards.
        return outputs + self._update(sched, drawn, start, self._end_step(t0), phases)

    def _report_rejected(self) -> list[RequestOutput]:
        """Requests refused at add_request are reported (finished, with their error) by the next step."""
        outputs = [self._output(r, [], "") for r in self._rejected]
        for r in self._rejected:
            r.metrics.finish_time = self.clock.now()
            self._release(r)
        self._rejected = []
        if self.structured.in_use:  # a spec that failed to compile fails its request before its prefill
            for req in self.structured.take_failed():
                outputs.append(self._end_by_grammar(req, "error", req.grammar.error, self.clock.now()))
        return outputs

    def _idle(self) -> list[RequestOutput]:
        self.last_step = None
        if not (self.scheduler.waiting and not self.scheduler.running):
            return []
        # The rules guarantee progress (validation keeps every request within the cache); should
        # that ever fail, the stuck request fails instead of the job spinning.
        req = self.scheduler.waiting[0]
        req.error = (f"request could not be scheduled ({req.num_tokens} tokens, "
                     f"{self.kv.pool.num_free}/{self.kv.num_blocks} KV blocks free)")
        self._finish(req, "error", self.clock.now())
        return [self._ended_output(req)]

    def _execute(self, sched: SchedulerOutput, phases: dict[str, float]) -> _Drawn:
        """The forward(s) and the sampler: the tokens (and logprobs) drawn for each sampling row."""
        t1 = time.perf_counter()
        logits = self.runner.execute(sched.scheduled)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        t2 = time.perf_counter()
        phases["prepare"] = self.runner.prepare_time
        phases["forward"] = t2 - t1 - self.runner.prepare_time
        items = [s.request for s in sched.scheduled if s.samples]
        forks = {r: make_samples(r, self.device) for r in items if r.forks}
        rows, samplers = expand_rows(items, forks)
        tokens, logprobs = self._sample(logits, rows, samplers)
        phases["sample"] = time.perf_counter() - t2
        return _Drawn(forks, dict(zip(samplers, tokens)), logprobs)

    def _sample(
        self, logits: torch.Tensor, rows: list[int] | None, samplers: list[Request]
    ) -> tuple[list[int], dict[Request, tuple[float, TopK]]]:
        """Draw a token per sampler from its logits row (`rows[i]`, or row i when rows is None): raw
        logprobs first, then grammar masks, then the sampler. The memory plan budgets the sampler for
        sample_rows rows (one per running sequence); forks repeat a parent's row n times, so the
        expanded rows are drawn sample_rows at a time."""
        tokens: list[int] = []
        logprobs: dict[Request, tuple[float, TopK]] = {}
        for lo in range(0, len(samplers), self.sample_rows):
            hi = min(lo + self.sample_rows, len(samplers))
            part = samplers[lo:hi]
            if rows is None and hi - lo == logits.shape[0]:
                chunk = logits  # the common case: every row once, no copy
            else:
                picked = rows[lo:hi] if rows is not None else list(range(lo, hi))
                chunk = logits[torch.tensor(picked, dtype=torch.long, device=logits.device)]
            sample_logprobs = SampleLogprobs.prepare(chunk, part, self.runner.logprob_vocab)  # raw logits
            if self.structured.in_use:
                self.structured.apply_masks(chunk, part)
            drawn = self.sampler.sample(chunk, part)
            tokens.extend(drawn)
            logprobs.update((part[i], lp) for i, lp in sample_logprobs.results(drawn).items())
        return tokens, logprobs

    def _fail_step(self, sched: SchedulerOutput, exc: Exception, start: float, t0: float) -> list[RequestOutput]:
        """A forward or the sampler raised: this step's requests fail, every other request goes on."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        error = f"step failed: {type(exc).__name__}: {exc}"
        now = self._end_step(t0)
        outputs, failed = [], []
        for s in sched.scheduled:
            s.request.error = error
            self._finish(s.request, "error", now)
            failed.append(s.request.request_id)
            outputs.append(self._ended_output(s.request))
        self._record(sched, start, now, failed)
        return outputs

    def _update(self, sched: SchedulerOutput, drawn: _Drawn, start: float, now: float,
                phases: dict[str, float]) -> list[RequestOutput]:
        """num_computed_tokens catches up, full blocks join the prefix cache, sampled tokens are
        appended, detokenised and checked for stops. One request's failure fails only that request."""
        t3 = time.perf_counter()
        outputs: list[RequestOutput] = []
        failed: list[str] = []
        for req, first, chosen, tops in self.runner.prompt_logprobs:
            if len(req.prompt_logprobs) == first:  # positions in order, each once
                req.prompt_logprobs.extend(chosen)
                req.prompt_top_logprobs.extend(tops)
        for s in sched.scheduled:
            req = s.request
            try:
                if req.metrics.first_scheduled_time is None:
                    req.metrics.first_scheduled_time = start
                req.num_computed_tokens += s.num_tokens
                if s.is_prefill:
                    req.metrics.num_prefill_chunks += 1
                self.kv.register_computed(req)
                if s.samples:
                    outputs.extend(self._after_sampling(req, drawn, now, failed))
            except Exception as exc:  # noqa: BLE001 - one request's bad update fails only that request
                outputs.append(self._fail_update(req, exc, now, failed))
        phases["update"] = time.perf_counter() - t3
        self.clock.step_finished(phases["update"])
        self._record(sched, start, self.clock.now(), failed)
        self.last_step.phase_times = phases
        return outputs

    def _end_step(self, t0: float) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.clock.step_finished(time.perf_counter() - t0)
        return self.clock.now()

    def _record(self, sched: SchedulerOutput, start: float, now: float, failed: list[str]) -> None:
        self._step_count += 1
        self.last_step = StepStats(
            step=self._step_count - 1,
            start_time=start,
            duration=now - start,
            decode_tokens=sched.decode_tokens,
            prefill_tokens=sched.prefill_tokens,
            prefill_requests=sum(1 for s in sched.scheduled if s.is_prefill),
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting),
            kv_blocks_used=self.kv.pool.num_used,
            scheduled=self._tokens_per_id(sched),
            cached_prompt_tokens=sched.cached_prompt_tokens,
            num_forwards=self.runner.num_forwards,
            preempted=[r.request_id for r in sched.preempted],
            failed=failed,
        )

    @staticmethod
    def _tokens_per_id(sched: SchedulerOutput) -> dict[str, int]:
        """Tokens computed per request id this step (the n samples of a request share its id)."""
        out: dict[str, int] = {}
        for s in sched.scheduled:
            out[s.request.request_id] = out.get(s.request.request_id, 0) + s.num_tokens
        return out

    # -- n samples, logprobs, scoring ---------------------------------------------------------------
    def _fail_update(self, req: Request, exc: Exception, now: float, failed: list[str]) -> RequestOutput:
        req.error = f"update failed: {type(exc).__name__}: {exc}"
        if not req.finished:
            self._finish(req, "error", now)
        failed.append(req.request_id)
        return self._ended_output(req)

    def _after_sampling(self, req: Request, drawn: _Drawn, now: float, failed: list[str]) -> list[RequestOutput]:
        """What a request's sampling row turns into: a token, n forked samples, or (scoring) the end.
        Once forked, each sample's token is its own: one that fails fails alone, its siblings go on."""
        if req.params.max_tokens == 0:  # scoring: the prompt's logprobs are all it wanted
            self._finish(req, "length", now)
            out = self._output(req, [], "")
            return [dataclasses.replace(out, sample_index=i) for i in range(req.params.n)]
        samples = drawn.forks.get(req, [req])
        if req in drawn.forks:
            self._fork(req, samples)
        outputs = []
        for r in samples:
            try:
                if r in drawn.logprobs:
                    r.logprobs.append(drawn.logprobs[r][0])
                    r.top_logprobs.append(drawn.logprobs[r][1])
                out = self._append_token(r, drawn.tokens[r], now)
                if out is not None:
                    outputs.append(out)
            except Exception as exc:  # noqa: BLE001 - one sample's bad update fails only that sample
                outputs.append(self._fail_update(r, exc, now, failed))
        return outputs

    def _fork(self, parent: Request, samples: list[Request]) -> None:
        """Replace a prefilled parent by its samples (engine/n_samples.py). Samples without room (a
        free block for their copy of the last block, a place within max_num_seqs) wait to be recomputed."""
        room = self.config.max_num_seqs - len(self.scheduler.running) + 1  # the parent's place is freed
        placed, deferred = [samples[0]], []
        for child in samples[1:]:
            if len(placed) < room and self.kv.fork(parent, child):
                placed.append(child)
            else:
                child.block_hashes = list(parent.block_hashes)
                deferred.append(child)
        self.kv.transfer(parent, samples[0])
        self.scheduler.replace(parent, placed, deferred)
        parent.children = samples
        parent.status = RequestStatus.FINISHED  # a handle now; its samples carry on
        self._detok.pop(parent, None)
        self.runner.release(parent.seq_key)
        for child in samples:
            child.metrics = dataclasses.replace(parent.metrics, token_times=[])  # the prefill's, shared history
            self._detok[child] = DetokState.for_prompt(child.num_prompt_tokens)

    def _append_token(self, req: Request, token: int, now: float) -> RequestOutput | None:
        """Take the sampled token; the step's output for the request (None for an unfinished
        final_only request)."""
        if req.grammar is not None:  # a failed compile, or a grammar with nothing left to allow
            ended = self.structured.verdict(req)
            if ended is not None:
                return self._end_by_grammar(req, *ended, now)
        req.output_token_ids.append(token)
        m = req.metrics
        m.token_times.append(now)
        if m.first_token_time is None:
            m.first_token_time = now
        p = req.params
        detok = self._detok[req]
        # Text is built as it comes only when someone reads it per step or a stop string must be
        # found; otherwise the flush at the end decodes the whole output once.
        streamed = p.output_kind == "delta" or bool(p.stop)
        new_text = self.detokenizer.step(detok, req.prompt_token_ids, req.output_token_ids) if streamed else ""
        reason = None
        grammar_ended = req.grammar is not None and self.structured.accept(req, token)  # took a stop token
        if grammar_ended or (not p.ignore_eos and token in self.eos_token_ids) or token in p.stop_token_ids:
            reason = "stop"
        elif len(req.output_token_ids) >= p.max_tokens or req.num_tokens >= self.max_model_len:
            reason = "length"
        if reason is not None:  # the last text now (stop strings are checked on it); _finish has none left
            new_text += self.detokenizer.flush(self._detok.pop(req), req.prompt_token_ids, req.output_token_ids)
        req.text += new_text
        if p.stop:
            cut = find_stop(req.text, len(new_text), p.stop)
            if cut is not None:
                req.text = req.text[:cut]
                reason = "stop"
                self._detok.pop(req, None)  # what it holds back lies past the stop string: not for _finish
        if reason is not None:
            self._finish(req, reason, now)
        # While a stop string could still complete, its possible start is held back, so the
        # reported deltas always add up to the final text.
        visible = len(req.text)
        if p.stop and reason is None:
            visible -= max(len(x) for x in p.stop) - 1
        emitted = req.num_emitted_chars
        req.num_emitted_chars = max(emitted, visible)
        if reason is None and p.output_kind == "final_only":
            return None
        return self._output(req, [token], req.text[emitted : req.num_emitted_chars])

    def _end_by_grammar(self, req: Request, reason: str, error: str | None, now: float) -> RequestOutput:
        """Finish a structured request without a new token."""
        req.error = error
        self._finish(req, reason, now)
        return self._ended_output(req)

    def _ended_output(self, req: Request) -> RequestOutput:
        """The output of a request that ended without a new token (failed, stuck, ended by its
        grammar): whatever text was held back (stop strings, an incomplete character) is released."""
        emitted = req.num_emitted_chars
        req.num_emitted_chars = len(req.text)
        return self._output(req, [], req.text[emitted:])

    def _finish(self, req: Request, reason: str, now: float) -> None:
        detok = self._detok.get(req)
        if detok is not None:  # text held back (or, final_only, never decoded) belongs to every ending
            try:
                req.text += self.detokenizer.flush(detok, req.prompt_token_ids, req.output_token_ids)
            except Exception as exc:  # noqa: BLE001 - the detokenizer is what failed this request
                log.debug("request %s: final text not flushed: %s", req.request_id, exc)
        req.finish_reason = reason
        req.metrics.finish_time = now
        self.scheduler.finish(req)
        self._release(req)

    def _release(self, req: Request) -> None:
        """A finished request is reported once; the engine keeps no reference to it afterwards (for
        n > 1, once all its samples are finished)."""
        self._detok.pop(req, None)
        self.runner.release(req.seq_key)
        owner = req.parent or req
        if all(c.finished for c in owner.children):
            self.requests.pop(req.request_id, None)

    def _output(self, req: Request, new_ids: list[int], new_text: str) -> RequestOutput:
        if getattr(req.params, "output_kind", "delta") == "final_only":  # its one output: all of it is new
            new_ids, new_text = list(req.output_token_ids), req.text[: req.num_emitted_chars]
        with_logprobs = getattr(req.params, "logprobs", None) is not None
        with_prompt_logprobs = getattr(req.params, "prompt_logprobs", None) is not None
        return RequestOutput(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            output_token_ids=req.output_token_ids,  # no copy per step: see RequestOutput
            text=req.text[: req.num_emitted_chars],
            new_token_ids=new_ids,
            new_text=new_text,
            finished=req.finished,
            finish_reason=req.finish_reason,
            error=req.error,
            metrics=req.metrics,
            sample_index=req.sample_index,
            # Not copies, like output_token_ids: the request's own lists, extended by later steps.
            logprobs=req.logprobs if with_logprobs else None,
            top_logprobs=req.top_logprobs if with_logprobs else None,
            # Complete once the prefill is done and never changed afterwards.
            prompt_logprobs=req.prompt_logprobs if with_prompt_logprobs else None,
            prompt_top_logprobs=req.prompt_top_logprobs if with_prompt_logprobs else None,
        )

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
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        done: dict[str, list[RequestOutput]] = {i: [] for i in ids}
        pending = set(ids)
        while pending and self.has_unfinished_requests():
            for out in self.step():
                if out.finished and out.request_id in done:
                    done[out.request_id].append(out)
            pending = {i for i in pending if i in self.requests}  # an id leaves once all its samples finish
        return [o for i in ids for o in sorted(done[i], key=lambda o: o.sample_index)]
