"""executor=local: one engine in this process runs the job (runner/loop.py) into the run directory.

Also what each executor=ray replica runs over its share of the rows, with its own engine and source.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from ladle.runner.calibration import CALIBRATION
from ladle.runner.config import ConfigError, JobConfig, engine_config, uses_load
from ladle.runner.executors.base import Executor, Ran, try_plot
from ladle.runner.loop import Loop
from ladle.runner.redact import redact
from ladle.runner.resume import job_resume_command, prepare_run_dir
from ladle.runner.sinks import GENERATIONS, STEPS
from ladle.runner.sources import Source, open_source
from ladle.runner.writer import RunWriter

log = logging.getLogger("ladle")


def make_engine(job: JobConfig) -> Any:
    from ladle.engine import LLMEngine
    from ladle.engine.clock import VirtualClock, WallClock
    from ladle.engine.config import EngineConfigError

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


class Local(Executor):
    """`engine`: reuse this one (else one is built from the config); `source`: run these rows (a replica's
    share; else the workload's source); `calibration_path`: a sweep's shared arrival calibration."""

    def __init__(self, engine: Any = None, extra: dict[str, Any] | None = None,
                 calibration_path: Path | None = None, source: Source | None = None) -> None:
        super().__init__(extra)
        self.engine, self.calibration_path, self.source = engine, calibration_path, source

    def execute(self, cfg: DictConfig, job: JobConfig, out: Path) -> Ran:
        out.mkdir(parents=True, exist_ok=True)
        source = self.source or open_source(job.workload)  # checks paths and columns before the model loads
        log.info("source: %s%s", source.description, f", {source.total} rows" if source.total is not None else "")
        config_yaml = redact(OmegaConf.to_yaml(cfg, resolve=True))  # stored in the outputs: no credentials
        resume = prepare_run_dir(out, job.output, config_yaml)
        threads = self._load_engine(job)
        source.vocab_size = vocab_size(self.engine)
        calibration = None
        if not job.output.resume:  # starting over times the model again (removed only now that it loaded)
            (out / CALIBRATION).unlink(missing_ok=True)
        if uses_load(job.workload):  # arrival rates relative to this machine: time the model first
            from ladle.runner.calibration import shared_calibration

            # The run's own copy first: a resumed run replays the arrivals it started with.
            calibration = shared_calibration(self.engine, [out / CALIBRATION, self.calibration_path])
            source.calibration = calibration
        writer = RunWriter(out, job.output, config_yaml, resume.attempt)
        loop = Loop(self.engine, job, source, resume, writer, calibration)
        wall0 = time.perf_counter()
        interrupted = _drive(loop, writer)
        resume_cmd = job_resume_command(out, self.extra)
        if interrupted:
            log.warning("interrupted: %d requests written by this run, %d in %s in all; to resume, run: %s",
                        writer.rows_this_run, writer.rows_total, out / GENERATIONS, resume_cmd)
        info = {**self._info(job, loop, source, threads), "complete": not interrupted,
                "resume_command": resume_cmd if interrupted else None, "wall_time_s": time.perf_counter() - wall0,
                "run_dir": str(out.resolve()), "config": _config_info(job), **self.extra}
        files = {}
        if job.workload.kind == "openai_batch" and not interrupted and source.shard is None:
            from ladle.runner.batch_output import BATCH_OUTPUT, write_batch_output

            files["batch_output"] = write_batch_output(job.workload, out / GENERATIONS, out / BATCH_OUTPUT,
                                                       self.engine.tokenizer, job.model.name)
        return Ran(out, info, interrupted, files)

    def _load_engine(self, job: JobConfig) -> dict[str, Any] | None:
        """Build the engine unless one was given; the torch threads it was given (None: not built here)."""
        if self.engine is not None:
            return None
        from ladle.runner.threads import apply_threads

        threads = apply_threads(job.threads)
        log.info("loading model %s (CPU threads: %d)", job.model.name, threads["threads"])
        self.engine = make_engine(job)
        return threads

    def _info(self, job: JobConfig, loop: Loop, source: Source, threads: dict[str, Any] | None) -> dict[str, Any]:
        eng = self.engine
        return {
            "model": job.model.name, "workload": job.workload.name, "clock": job.clock,
            "max_model_len": getattr(eng, "max_model_len", None), "kv_blocks_total": _call(eng, "num_total_blocks"),
            "memory_plan_gib": _memory_plan(eng), "cpu_threads": threads,
            "compile_s": getattr(eng, "compile_seconds", None),  # model.compile: the warm-up's, once
            "cuda_graph_capture_s": getattr(eng, "graph_capture_s", None),  # CUDA graphs: null when not used
            "arrival_calibration": _calibration(loop, source), "resumed": loop.requests.resumed,
        }

    def plots(self, job: JobConfig, ran: Ran) -> dict[str, Path]:
        from ladle.runner.plots import plot_latency, plot_schedule

        title = f"{job.model.name} / {job.workload.name}"
        return {**try_plot("schedule", lambda: plot_schedule(ran.out / STEPS, ran.out / "schedule.png", title)),
                **try_plot("latency", lambda: plot_latency(ran.out / GENERATIONS, ran.out / "latency.png", title))}


def _drive(loop: Loop, writer: RunWriter) -> bool:
    """Copy the previous rows, run the loop, close the files whatever happens; whether it was interrupted
    (also by an interrupt while the files closed: they are finalised all the same)."""
    interrupted = False
    try:
        writer.copy_previous()
        loop.run()
    except KeyboardInterrupt:
        interrupted = True
    finally:
        try:
            loop.close()
        except KeyboardInterrupt:
            interrupted = True
        finally:
            writer.close()
    return interrupted or writer.interrupted


def _config_info(job: JobConfig) -> dict[str, Any]:
    return {"max_num_seqs": job.max_num_seqs, "cache": dataclasses.asdict(job.cache),
            "chunking": dataclasses.asdict(job.chunking)}


def _calibration(loop: Loop, source: Source) -> dict[str, Any] | None:
    """The calibration and the rates the `load` arrival processes resolved to (requests per second)."""
    cal = loop.requests.streams.calibration
    if cal is None:
        return None
    return {**cal.as_dict(), "rates_per_s": {**loop.requests.streams.rates, **source.rates}}


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
