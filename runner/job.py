"""The job: config -> source -> arrivals -> engine -> sinks -> report.

The loop keeps three things apart:
- read-ahead: rows are read, tokenized and given their arrival time until `max_pending` requests are
  read but unfinished (requests waiting for their arrival + requests in the engine), so memory is
  bounded whatever the dataset's size;
- arrival: a request enters the engine once the engine's clock has passed its arrival time, with that
  time as its arrival (so queueing behind a busy engine counts in its TTFT);
- time: when the engine has nothing to do, the clock jumps to the next arrival
  (`clock.advance_to`: a virtual clock skips the gap, a wall clock sleeps).
Every finished request becomes a generations row and every engine step a steps row, written in row
groups; the sinks are finalised in a `finally`, so an interrupted run leaves readable files that the
next run into the same directory resumes from.
"""

from __future__ import annotations

import dataclasses
import heapq
import logging
import math
import re
import shlex
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow.compute as pc
from omegaconf import DictConfig, OmegaConf

from engine.sampling_params import SamplingParams
from runner.arrivals import ArrivalError, ArrivalStreams
from runner.config import ConfigError, JobConfig, check, engine_config, to_job_config, uses_load
from runner.prompts import encode_prompt
from runner.report import format_table, summarize, write_summary
from runner.sampling import base_params, row_params
from runner.sinks import (
    CONFIG_KEY,
    STEPS_SCHEMA,
    ParquetSink,
    generations_schema,
    previous_attempts,
    previous_batches,
    read_config_yaml,
    recover,
    sample_indices,
)
from runner.sources import Row, Source, open_source
from runner.sources.rows import duplicate_id_error, is_duplicate_id_error

CALIBRATION = "calibration.json"  # the arrival calibration a run used, reused when it resumes
log = logging.getLogger("ladle")

GENERATIONS = "generations.parquet"
STEPS = "steps.parquet"
SUMMARY = "summary.json"
NO_PROGRESS_LIMIT = 10_000  # consecutive engine steps without a token: the engine is stuck
# Resume keeps, per id, the samples already written as a bit mask (bit k: sample k; one int per id, as
# compact as the set of ids it replaces). An error row makes it ERRORED: done whatever the row's n.
ERRORED = -1


def is_done(written: int | None, n: int) -> bool:
    """Whether a row whose previous runs wrote these samples (bit mask) needs no more samples."""
    if written is None or written == ERRORED:
        return written is not None
    if n > written.bit_length():  # a sample index this high was never written (and no huge mask is built)
        return False
    full = (1 << n) - 1
    return written & full == full


def written_samples(written: int | None) -> frozenset[int]:
    if not written or written == ERRORED:
        return frozenset()
    return frozenset(k for k in range(written.bit_length()) if written >> k & 1)


@dataclass(slots=True)
class Pending:
    row: Row
    arrival: float  # seconds from the job's start
    token_ids: list[int] | None
    text: str | None
    params: SamplingParams | None
    error: str | None = None
    # -- issue 13 (features-io): n samples --
    skip: frozenset[int] = frozenset()  # sample indices a previous run already wrote (resume)
    remaining: int = 1  # samples not yet finished


@dataclass
class RunResult:
    out_dir: Path
    summary: dict[str, Any]
    files: dict[str, Path] = field(default_factory=dict)
    interrupted: bool = False


def make_engine(job: JobConfig) -> Any:
    from engine import LLMEngine
    from engine.clock import VirtualClock, WallClock
    from engine.config import EngineConfigError

    clock = VirtualClock() if job.clock == "virtual" else WallClock()
    try:
        return LLMEngine(engine_config(job), clock=clock)
    except EngineConfigError as e:  # settings, a model.path that is not there, memory: not a crash
        raise ConfigError(str(e)) from e


def vocab_size(engine: Any) -> int | None:
    for obj, name in ((engine, "vocab_size"), (engine.tokenizer, "vocab_size")):
        v = getattr(obj, name, None)
        if isinstance(v, int) and v > 0:
            return v
    try:
        return len(engine.tokenizer)
    except TypeError:
        return None


def _top(pairs: list[list[tuple[int, float]]] | None) -> list[list[dict[str, Any]]] | None:
    if pairs is None:
        return None
    return [[{"token_id": t, "logprob": lp} for t, lp in pos] for pos in pairs]


def _logprob_columns(o: Any) -> dict[str, Any]:
    """The logprob columns of one finished output (null where not asked for)."""
    return {"logprobs": getattr(o, "logprobs", None), "top_logprobs": _top(getattr(o, "top_logprobs", None)),
            "prompt_logprobs": getattr(o, "prompt_logprobs", None),
            "prompt_top_logprobs": _top(getattr(o, "prompt_top_logprobs", None))}


def _rel(t: float | None, t0: float) -> float | None:
    return None if t is None else t - t0


class Job:
    def __init__(self, cfg: DictConfig, out_dir: str | Path, engine: Any = None,
                 extra: dict[str, Any] | None = None, calibration_path: Path | None = None,
                 source: Source | None = None) -> None:
        self.cfg = cfg
        self._source = source  # set by executors that give this job a share of the rows
        self.job = to_job_config(cfg)
        check(self.job)
        self.out_dir = Path(out_dir)
        self.engine = engine
        self.extra = dict(extra or {})
        self.calibration_path = calibration_path  # a sweep's runs share one arrival calibration
        self.config_yaml = OmegaConf.to_yaml(cfg, resolve=True)

    # ------------------------------------------------------------------------------------------------
    def run(self) -> RunResult:
        job, out = self.job, self.out_dir
        out.mkdir(parents=True, exist_ok=True)
        gen_path, steps_path = out / GENERATIONS, out / STEPS
        source = self._source or open_source(job.workload)  # checks paths and columns before the model loads
        log.info("source: %s%s", source.description, f", {source.total} rows" if source.total is not None else "")

        for p in (gen_path, steps_path):
            recover(p)
            if not job.output.resume and p.exists():
                p.unlink()
        if not job.output.resume:
            (out / CALIBRATION).unlink(missing_ok=True)
        self._warn_if_config_changed(gen_path)
        done = self._done_ids(gen_path)
        attempt = max(previous_attempts(gen_path), previous_attempts(steps_path))
        if done:
            log.info("resuming into %s: %d requests already done, attempt %d", out, len(done), attempt)

        threads = None
        if self.engine is None:
            from runner.threads import apply_threads

            threads = apply_threads(job.threads)
            log.info("loading model %s (CPU threads: %d)", job.model.name, threads["threads"])
            self.engine = make_engine(job)
        eng = self.engine
        source.vocab_size = vocab_size(eng)

        loop = _Loop(self, eng, source, done, attempt)
        if uses_load(job.workload):  # arrival rates relative to this machine: time the model first
            from runner.calibration import shared_calibration

            # The run's own copy first: a resumed run replays the arrivals it started with.
            loop.calibration = shared_calibration(eng, [out / CALIBRATION, self.calibration_path])
            source.calibration = loop.calibration
        meta = {CONFIG_KEY: self.config_yaml.encode()}
        gen = ParquetSink(gen_path, generations_schema(job.output.include_prompt), job.output.row_group_size, meta)
        try:
            steps = ParquetSink(steps_path, STEPS_SCHEMA, job.output.steps_row_group_size, meta)
        except BaseException:
            gen.close()
            raise
        self.gen, self.steps = gen, steps
        interrupted = copied = False
        rows_before = 0
        wall0 = time.perf_counter()
        try:
            for t in previous_batches(gen_path, True, job.output.retry_errors):
                gen.write_table(t)
            for t in previous_batches(steps_path, False):
                steps.write_table(t)
            copied = True
            rows_before = gen.rows_written
            loop.run()
        except KeyboardInterrupt:
            interrupted = True
        finally:
            loop.close()
            for sink in (gen, steps):
                if copied:
                    sink.close()
                else:  # until the previous rows are copied, the old files are the only complete ones
                    sink.abort()

        resume = resume_command(out, self.extra.get("overrides", []))
        if interrupted:  # the counts are read after the sinks closed: every buffered row is on disk now
            log.warning("interrupted: %d requests written by this run, %d in %s in all; to resume, run: %s",
                        gen.rows_written - rows_before if copied else 0, gen.rows_written if copied else 0,
                        gen_path, resume)
        extra = {
            "model": job.model.name,
            "workload": job.workload.name,
            "clock": job.clock,
            "max_model_len": getattr(eng, "max_model_len", None),
            "kv_blocks_total": _call(eng, "num_total_blocks"),
            "memory_plan_gib": _memory_plan(eng),
            "cpu_threads": threads,
            "compile_s": getattr(eng, "compile_seconds", None),  # model.compile: the warm-up's, once
            "arrival_calibration": _calibration(loop, source),
            "resumed": loop.resumed,
            "complete": not interrupted,
            "resume_command": None if not interrupted else resume,
            "wall_time_s": time.perf_counter() - wall0,
            "run_dir": str(out.resolve()),
            "config": {"max_num_seqs": job.max_num_seqs, "cache": dataclasses.asdict(job.cache),
                       "chunking": dataclasses.asdict(job.chunking)},
            **self.extra,
        }
        summary = summarize(gen_path, steps_path, extra)
        files = {"generations": gen_path, "steps": steps_path, "summary": out / SUMMARY}
        # -- issue 13 (features-io): OpenAI batch output, rebuilt from every row once the run is complete
        if job.workload.kind == "openai_batch" and not interrupted and self._source is None:
            from runner.batch_output import BATCH_OUTPUT, write_batch_output

            files["batch_output"] = write_batch_output(job.workload, gen_path, out / BATCH_OUTPUT,
                                                       eng.tokenizer, job.model.name)
        # -- end issue 13 --
        write_summary(summary, files["summary"])
        if job.output.plots and not interrupted:
            files.update(self._plots(gen_path, steps_path))
        if job.output.print_summary:
            print(format_table(summary))
            print(f"\noutputs in {out.resolve()}:")
            for name, p in files.items():
                print(f"  {name:<12} {p.name}")
        return RunResult(out, summary, files, interrupted)

    def _warn_if_config_changed(self, gen_path: Path) -> None:
        """Resuming with another model, sampling or dataset mixes rows of two experiments: say so."""
        previous = read_config_yaml(gen_path) if self.job.output.resume else None
        if not previous:
            return
        old, new = OmegaConf.create(previous), OmegaConf.create(self.config_yaml)
        for c in (old, new):
            for key in ("limit", "batch_size"):  # changing how much is read is what resuming is for
                c.workload.pop(key, None)
        changed = [k for k in ("model", "sampling", "workload") if old.get(k) != new.get(k)]
        if changed:
            log.warning("resuming into %s, whose rows were made with a different %s config; "
                        "use a new hydra.run.dir (or output.resume=false) to start over",
                        self.out_dir, "/".join(changed))

    # -- issue 13 (features-io): an id is done when all its samples are written --
    def _done_ids(self, gen_path: Path) -> dict[str, int]:
        """id -> the samples already written (bit mask; an error row's sample counts as written), ERRORED
        for an id whose only row is an error at sample 0 with no token: it failed before its prompt forked
        into samples, so that row stands for all n. Any other error row is that sample's alone."""
        done: dict[str, int] = {}
        failed_early: set[str] = set()  # ids with an error row at sample 0
        self.repeats_written: set[tuple[str, int]] = set()  # (id, index) of a repeated id's error row
        if self.job.output.resume:
            for t in previous_batches(gen_path, True, self.job.output.retry_errors):
                errs = pc.fill_null(pc.equal(t.column("finish_reason"), "error"), False).to_pylist()
                messages = t.column("error").to_pylist()
                indices = t.column("index").to_pylist() if "index" in t.schema.names else [None] * t.num_rows
                # A pre-fork failure drew no token; a sample failing after the fork had drawn its first.
                drew = (pc.fill_null(t.column("output_tokens"), 0).to_pylist() if "output_tokens" in t.schema.names
                        else [0] * t.num_rows)
                for rid, k, err, msg, i, n_out in zip(t.column("id").to_pylist(), sample_indices(t), errs, messages,
                                                      indices, drew, strict=True):
                    if err and is_duplicate_id_error(msg):  # the repeat's row, not the id's own
                        self.repeats_written.add((rid, i))
                    else:
                        done[rid] = done.get(rid, 0) | (1 << k)
                        if err and k == 0 and n_out == 0:
                            failed_early.add(rid)
        for rid in failed_early:
            if done[rid] == 1:
                done[rid] = ERRORED
        return done
    # -- end issue 13 --

    def _plots(self, gen_path: Path, steps_path: Path) -> dict[str, Path]:
        from runner.plots import plot_latency, plot_schedule

        title = f"{self.job.model.name} / {self.job.workload.name}"
        made = {}
        for name, plot, src in (("schedule", plot_schedule, steps_path), ("latency", plot_latency, gen_path)):
            try:
                made[name] = plot(src, self.out_dir / f"{name}.png", title)
            except Exception as e:  # noqa: BLE001 - a plot must never cost the run its outputs
                log.warning("%s plot failed: %s", name, e)
        return made


def resume_command(out_dir: Path, overrides: list[str]) -> str:
    """The exact command that resumes a run into out_dir (the same overrides, the same directory)."""
    kept = [o for o in overrides if not o.startswith(("hydra.run.dir=", "hydra.sweep.dir="))]
    return shlex.join(["python", "-m", "runner", *kept, f"hydra.run.dir={hydra_quoted(str(out_dir.resolve()))}"])


def hydra_quoted(value: str) -> str:
    """A string as a quoted Hydra override value: `=`, `,`, brackets and spaces in a path stay literal.
    Inside Hydra's quotes a backslash escapes the quote and the backslashes right before it."""
    escaped = re.sub(r"(\\*)'", lambda m: m.group(1) * 2 + "\\'", value)
    escaped = re.sub(r"(\\+)$", lambda m: m.group(1) * 2, escaped)
    return f"'{escaped}'"


def _calibration(loop: _Loop, source: Source) -> dict[str, Any] | None:
    """The calibration and the rates the `load` arrival processes resolved to (requests per second)."""
    if loop.calibration is None:
        return None
    rates = {**(loop.streams.rates if loop.streams else {}), **getattr(source, "rates", {})}
    return {**loop.calibration.as_dict(), "rates_per_s": rates}


def _memory_plan(eng: Any) -> dict[str, float] | None:
    plan = getattr(eng, "memory_plan", None)
    if plan is None:
        return None
    gib = 2**30
    return {"weights": plan.weights_bytes / gib, "kv_cache": plan.kv_bytes / gib,
            "largest_step": plan.activation_bytes / gib, "available": plan.available_bytes / gib}


def _call(obj: Any, name: str) -> Any:
    f = getattr(obj, name, None)
    return f() if callable(f) else None


class _Loop:
    """Feeds the engine from the source by arrival time and writes what comes out."""

    def __init__(self, job: Job, eng: Any, source: Source, done: dict[str, int], attempt: int) -> None:
        self.job, self.eng, self.source, self.done, self.attempt = job, eng, source, done, attempt
        self.cfg = job.job
        self.calibration: Any = None  # runner.calibration.Calibration when an arrival process has a `load`
        self.streams: ArrivalStreams | None = None
        self.clock = eng.clock
        self.t0 = self.clock.now()  # reset when the loop starts
        self.max_pending = self.cfg.max_pending or 4 * self.cfg.max_num_seqs
        self.heap: list[tuple[float, int, Pending]] = []  # (absolute arrival, source order, request)
        self.in_engine: dict[str, Pending] = {}
        self.failed: dict[str, Pending] = {}  # requests that reported an error: later samples still get rows
        self.resumed = 0
        self.arrived = 0  # requests added since the last step
        self.last_step: int | None = None
        self.output_tokens = 0
        self.bar = self._progress_bar()
        self._postfix_at = 0.0

    def _progress_bar(self) -> Any:
        from tqdm import tqdm

        out = self.cfg.output
        total = None if self.source.total is None else max(0, self.source.total - len(self.done))
        disable = not out.progress or not sys.stderr.isatty()
        return tqdm(total=total, unit="req", desc="requests", disable=disable, dynamic_ncols=True, leave=False)

    def close(self) -> None:
        """Abort what is still in the engine (after an interrupt), so the engine can be used again."""
        self.bar.close()
        abort = getattr(self.eng, "abort_request", None)
        if abort is not None:
            for rid in self.in_engine:
                abort(rid)
        self.in_engine.clear()

    # -- reading -----------------------------------------------------------------------------------------
    def _requests(self) -> Iterator[Pending]:
        w = self.cfg.workload
        base = base_params(self.cfg.sampling)
        names = self.source.value_names
        if w.ignore_eos is not None:
            base = dataclasses.replace(base, ignore_eos=w.ignore_eos)
        streams = ArrivalStreams(w.arrivals, w.class_arrivals if w.class_column else {}, self.calibration)
        self.streams = streams
        tok = self.eng.tokenizer
        seen: set[str] | None = set() if w.id_column else None

        def encode(row: Row) -> Any:
            return encode_prompt(row.prompt, w.prompt_format, tok, w.chat_template, w.prompt_column,
                                 w.chat_template_kwargs)

        def sampling(row: Row) -> tuple[SamplingParams, str | None]:
            values = dict(row.sampling or {})
            if row.max_tokens is not None:
                values.setdefault("max_tokens", row.max_tokens)
            return row_params(base, values, names, row.index)

        repeats_written = getattr(self.job, "repeats_written", set())
        for batch in self.source.batches():
            params = {row.index: sampling(row) for row in batch}
            # A repeated id (here, or marked by an executor's shard) is an error row of its own: done
            # when that row was written; the id's written samples are its first row's.
            repeats = {row.index for row in batch if is_duplicate_id_error(row.error)}
            if seen is not None:
                for row in batch:
                    if row.id in seen:
                        repeats.add(row.index)
                    seen.add(row.id)
            done = {row.index for row in batch
                    if ((row.id, row.index) in repeats_written if row.index in repeats
                        else is_done(self.done.get(row.id), params[row.index][0].n))}
            # Encoded first: a `load` arrival rate needs the mean prompt length of its rows.
            encoded = {row.index: encode(row) for row in batch if row.index not in done or streams.unresolved()}
            if streams.unresolved():
                lengths: dict[str | None, list[int]] = {}
                for row in batch:
                    enc = encoded[row.index]
                    if enc.token_ids and not enc.error:
                        lengths.setdefault(streams.key(row.klass), []).append(len(enc.token_ids))
                streams.resolve(lengths)
            for row in batch:
                error = row.error
                try:
                    arrival = streams.next(row.klass, row.arrival)
                except ArrivalError as e:
                    arrival, error = math.nan, error or str(e)
                if row.index in done:
                    self.resumed += 1
                    continue
                if row.index in repeats:
                    error = error or duplicate_id_error(row.id, w.id_column)
                enc = encoded[row.index]
                error = error or enc.error
                p, p_error = params[row.index]
                error = error or p_error
                skip = frozenset() if row.index in repeats else written_samples(self.done.get(row.id))
                yield Pending(row, arrival, enc.token_ids, enc.text, p, error, skip, p.n)

    # -- the loop -------------------------------------------------------------------------------------
    def run(self) -> None:
        eng, clock = self.eng, self.clock
        self.t0 = clock.now()  # times in the outputs are from here
        requests = self._requests()
        exhausted = False
        seq = 0
        idle_steps = 0
        while True:
            while not exhausted and len(self.heap) + len(self.in_engine) < self.max_pending:
                p = next(requests, None)
                if p is None:
                    exhausted = True
                elif p.error is not None:
                    self._write_error(p)
                else:
                    heapq.heappush(self.heap, (self.t0 + p.arrival, seq, p))
                    seq += 1
            now = clock.now()
            while self.heap and self.heap[0][0] <= now:
                t, _, p = heapq.heappop(self.heap)
                eng.add_request(p.token_ids, p.params, request_id=p.row.id, arrival_time=t)
                self.in_engine[p.row.id] = p
                self.arrived += 1
            if eng.has_unfinished_requests():
                outputs = eng.step()
                progressed = self._record_step()
                for o in outputs:
                    if o.finished:
                        self._write_output(o)
                idle_steps = 0 if (outputs or progressed) else idle_steps + 1
                if idle_steps > NO_PROGRESS_LIMIT:
                    raise RuntimeError(f"the engine made no progress in {NO_PROGRESS_LIMIT} steps with "
                                       f"{len(self.in_engine)} unfinished requests")
            elif self.heap:
                clock.advance_to(self.heap[0][0])
            elif exhausted:
                return

    # -- writing ------------------------------------------------------------------------------------
    def _record_step(self) -> bool:
        s = self.eng.last_step
        if s is None or s.step == self.last_step:
            return False
        self.last_step = s.step
        self.job.steps.write({
            "attempt": self.attempt, "step": s.step, "start_s": s.start_time - self.t0, "duration_s": s.duration,
            "decode_tokens": s.decode_tokens, "prefill_tokens": s.prefill_tokens,
            "prefill_requests": s.prefill_requests, "running": s.running, "waiting": s.waiting,
            "kv_blocks_used": s.kv_blocks_used, "cached_prompt_tokens": s.cached_prompt_tokens,
            "num_forwards": s.num_forwards, "arrived": self.arrived,
            "scheduled_ids": list(s.scheduled), "scheduled_tokens": list(s.scheduled.values()),
            "preempted": list(s.preempted), "failed": list(s.failed),
        })
        self.arrived = 0
        return s.decode_tokens + s.prefill_tokens > 0

    def _write_error(self, p: Pending) -> None:
        arrival = None if math.isnan(p.arrival) else p.arrival
        self._write_row(p, {
            "prompt_tokens": None if p.token_ids is None else len(p.token_ids), "output_text": "",
            "output_token_ids": [], "output_tokens": 0, "finish_reason": "error", "error": p.error,
            "arrival_s": arrival, "finish_s": arrival, "token_times_s": [], "num_prefill_chunks": 0,
            "num_preemptions": 0, "num_cached_tokens": 0,
        })

    def _write_output(self, o: Any) -> None:
        # -- issue 13 (features-io): n finished outputs per request, one row each --
        p = self.in_engine.get(o.request_id) or self.failed.get(o.request_id)
        if p is None:  # a request someone else put into a shared engine: not this job's row
            log.warning("ignoring output of request %r, which this job did not add", o.request_id)
            return
        sample = getattr(o, "sample_index", 0) or 0
        p.remaining -= 1
        if p.remaining <= 0 or o.finish_reason == "error":
            # an error before the fork is the only output of all n samples; one after it, just its own
            self.in_engine.pop(o.request_id, None)
            if o.finish_reason == "error" and p.remaining > 0:
                self.failed[o.request_id] = p
        if sample in p.skip:  # written by a previous run (a resumed row whose other samples were missing)
            return
        # -- end issue 13 --
        m, t0 = o.metrics, self.t0
        times = [t - t0 for t in m.token_times]
        n = len(o.output_token_ids)
        first_token = _rel(m.first_token_time, t0)
        arrival = m.arrival_time - t0
        finish = _rel(m.finish_time, t0)
        self.output_tokens += n
        self._write_row(p, {
            "prompt_tokens": len(o.prompt_token_ids), "output_text": o.text,
            "output_token_ids": list(o.output_token_ids), "output_tokens": n,
            "finish_reason": o.finish_reason, "error": o.error, "arrival_s": arrival,
            "first_scheduled_s": _rel(m.first_scheduled_time, t0), "first_token_s": first_token,
            "finish_s": finish, "token_times_s": times,
            "ttft_s": None if first_token is None else first_token - arrival,
            "tpot_s": (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None,
            "e2e_s": None if finish is None else finish - arrival,
            "num_prefill_chunks": m.num_prefill_chunks, "num_preemptions": m.num_preemptions,
            "num_cached_tokens": m.num_cached_tokens, "sample_index": sample, **_logprob_columns(o),
        })

    def _write_row(self, p: Pending, values: dict[str, Any]) -> None:
        row = {"id": p.row.id, "index": p.row.index, "class": p.row.klass, "attempt": self.attempt,
               "sample_index": 0, **values}
        if self.cfg.output.include_prompt:
            row["prompt"] = p.text
        self.job.gen.write(row)
        if row["sample_index"] == 0:  # the bar counts requests (its total), not their n samples
            self.bar.update(1)
        now = time.monotonic()
        if now - self._postfix_at > 0.5 and not self.bar.disable:
            self._postfix_at = now
            elapsed = self.clock.now() - self.t0
            if elapsed > 0:
                self.bar.set_postfix_str(f"{self.output_tokens / elapsed:.1f} tok/s", refresh=False)


def run_job(cfg: DictConfig, out_dir: str | Path, engine: Any = None,
            extra: dict[str, Any] | None = None, calibration_path: Path | None = None) -> RunResult:
    """Run the job described by a composed config into `out_dir` (see `Job`); executor=ray runs it on
    data-parallel replicas (runner/executors/ray_executor.py)."""
    from runner.executors.checks import check_executor

    job = to_job_config(cfg)
    check(job)
    check_executor(job)
    if job.executor.kind == "ray":
        from runner.executors.ray_executor import run_ray

        return run_ray(cfg, out_dir, extra)
    return Job(cfg, out_dir, engine=engine, extra=extra, calibration_path=calibration_path).run()
