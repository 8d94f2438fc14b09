"""One interface for every executor: `run(cfg, out)` runs the job's requests (`execute`, the executor's
own part) and then the tail they share, written once here: the summary, plots, printing and result."""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from ladle.runner.config import JobConfig, check, to_job_config
from ladle.runner.output_store import fetch_previous, output_location, publish
from ladle.runner.report import SUMMARY, format_table, summarize, write_summary
from ladle.runner.run_lock import RunDirLock
from ladle.runner.sinks import GENERATIONS, STEPS
from ladle.runner.storage import Location

log = logging.getLogger("ladle")


@dataclass
class RunResult:
    out_dir: Path
    summary: dict[str, Any]
    files: dict[str, Path] = field(default_factory=dict)
    interrupted: bool = False


@dataclass(slots=True)
class Ran:
    """What an executor's `execute` leaves for the shared tail."""

    out: Path  # the run directory, holding generations.parquet and steps.parquet
    info: dict[str, Any]  # the summary's run-level fields (model, clock, complete, ...)
    interrupted: bool = False
    files: dict[str, Path] = field(default_factory=dict)  # outputs besides generations, steps and summary
    notes: list[str] = field(default_factory=list)  # printed below the summary table
    # A run that failed: the error is raised once the summary (which it may quote) is written.
    error: Callable[[dict[str, Any]], Exception] | None = None


class Executor(ABC):
    """Where a job's requests run; `extra` goes into the summary as it is (e.g. the CLI's overrides)."""

    def __init__(self, extra: dict[str, Any] | None = None) -> None:
        self.extra = dict(extra or {})

    def run(self, cfg: DictConfig, out_dir: str | Path) -> RunResult:
        job = to_job_config(cfg)
        check(job)
        dest = output_location(job.output, Path(out_dir))  # output.path checked before the model loads
        with RunDirLock(Path(out_dir)):  # before anything in the directory is read, recovered or replaced
            if dest is not None and job.output.resume:
                fetch_previous(dest, Path(out_dir))
            ran = self.execute(cfg, job, Path(out_dir))
            summary, files = self._tail(job, ran, dest)
        return RunResult(ran.out, summary, files, ran.interrupted)

    def _tail(self, job: JobConfig, ran: Ran, dest: Location | None) -> tuple[dict[str, Any], dict[str, Path]]:
        """The summary, plots and printed table of a run whose requests ran (still under the lock); the
        outputs copied to output.path (`dest`), complete or interrupted, before a failure is raised."""
        gen, steps = ran.out / GENERATIONS, ran.out / STEPS
        info = ran.info if dest is None else {**ran.info, "output_path": str(dest)}
        summary = summarize(gen, steps if steps.exists() else None, info)
        files = {"generations": gen, "steps": steps, "summary": ran.out / SUMMARY, **ran.files}
        write_summary(summary, files["summary"])
        if dest is not None:
            publish([gen, steps, files["summary"], *ran.files.values()], dest)
        if ran.error is not None:
            raise ran.error(summary)
        if job.output.plots and not ran.interrupted:
            files.update(self.plots(job, ran))
        if job.output.print_summary:
            print(format_table(summary))
            for line in ran.notes:
                print(line)
            print(f"\noutputs in {ran.out.resolve()}:")
            for name, p in files.items():
                print(f"  {name:<12} {p.relative_to(ran.out)}")
            if dest is not None:
                print(f"copied to {dest}")
        return summary, files

    @abstractmethod
    def execute(self, cfg: DictConfig, job: JobConfig, out: Path) -> Ran:
        """Run the requests into `out`; returns once every output file but the summary is written."""

    def plots(self, job: JobConfig, ran: Ran) -> dict[str, Path]:
        """The run's PNG plots by name (made only for a complete run with output.plots)."""
        return {}


def try_plot(name: str, make: Callable[[], Path]) -> dict[str, Path]:
    """{name: the plot's path}, or {} with a warning: a plot must never cost the run its outputs."""
    try:
        return {name: make()}
    except Exception as e:  # noqa: BLE001
        log.warning("%s plot failed: %s", name, e)
        return {}
