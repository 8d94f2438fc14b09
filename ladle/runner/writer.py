"""The run's two output files while it runs: generations.parquet and steps.parquet.

Both are opened together, start with a copy of the previous runs' rows (resume), take this run's rows
tagged with its attempt number, and are closed together in a `finally`: an interrupted run leaves
readable files. Both are verified before either is moved into place (runner/sinks.py): a write that
failed leaves both previous files as they were. Until the previous rows are copied, the old files are
the only complete ones, so a run stopped before that leaves them as they were.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from ladle.runner.config import OutputConfig
from ladle.runner.records import unwritable_row
from ladle.runner.sinks import (
    CONFIG_KEY,
    GENERATIONS,
    STEPS,
    STEPS_SCHEMA,
    OutputError,
    ParquetSink,
    generations_schema,
    previous_batches,
)
from ladle.runner.text import clean_str


class RunWriter:
    def __init__(self, out: Path, output: OutputConfig, config_yaml: str, attempt: int) -> None:
        self.attempt = attempt
        self.resume, self.retry_errors = output.resume, output.retry_errors
        # The resolved config, in each file's schema metadata (a path from the command line may hold
        # bytes that are not UTF-8: cleaned like any text the job writes).
        meta = {CONFIG_KEY: clean_str(config_yaml).encode()}
        schema = generations_schema(output.include_prompt)
        self.gen = ParquetSink(out / GENERATIONS, schema, output.row_group_size, meta, repair=unwritable_row)
        try:
            self.steps = ParquetSink(out / STEPS, STEPS_SCHEMA, output.steps_row_group_size, meta)
        except BaseException:
            self.gen.abort()  # never close: the empty new file would replace the previous runs' rows
            raise
        self.copied = False
        self.rows_before = 0  # generations rows the previous runs left
        self.interrupted = False  # an interrupt arrived while the files closed

    def copy_previous(self) -> None:
        """Start each file with the previous runs' rows (unique; errored ones dropped with retry_errors); none
        when not resuming: this run's files then replace theirs when they close."""
        if self.resume:
            for t in previous_batches(self.gen.path, True, self.retry_errors):
                self.gen.write_table(t)
            for t in previous_batches(self.steps.path, False):
                self.steps.write_table(t)
        self.copied = True
        self.rows_before = self.gen.rows_written

    def generation(self, row: dict[str, Any]) -> None:
        self.gen.write({**row, "attempt": self.attempt})

    def step(self, row: dict[str, Any]) -> None:
        self.steps.write({**row, "attempt": self.attempt})

    def close(self) -> None:
        """Both files are verified before either replaces its previous one: a failure in one keeps both
        previous files (a steps file never describes rows the generations file lacks). An interrupt while
        they close (Ctrl-C or SIGTERM again) is held until both are done (`interrupted` says so): cut
        short, one file could be renamed and the other not."""
        sinks = (self.gen, self.steps)
        if not self.copied:  # stopped while copying the previous rows: the previous files are the complete ones
            for sink in sinks:
                self._uninterrupted(sink.abort)
            failed = [s.failure(f"{type(s.error).__name__}: {s.error}") for s in sinks if s.error is not None]
            if failed:  # a full disk during the copy is a failed write like any other, not a crash
                raise OutputError("; ".join(map(str, failed)))
            return
        failures = []
        for sink in sinks:
            try:
                self._uninterrupted(sink.finish)
            except OutputError as e:
                failures.append(str(e))
        if failures:
            for sink in sinks:
                self._uninterrupted(sink.abort)
            raise OutputError("; ".join(failures))
        for sink in sinks:
            try:
                self._uninterrupted(sink.commit)
            except OSError as e:  # both files are complete: the next run's recovery finishes the move
                raise OutputError(f"moving {sink.tmp} into place failed ({e}); it is complete and kept: run the "
                                  "same command again, which moves it into place and resumes") from e

    def _uninterrupted(self, step: Callable[[], None]) -> None:
        """Run a closing step to its end: each step can be called again after an interrupt cut it."""
        while True:
            try:
                return step()
            except KeyboardInterrupt:
                self.interrupted = True

    @property
    def rows_total(self) -> int:
        """Generations rows in the file (read after close: every buffered row is on disk then)."""
        return self.gen.rows_written if self.copied else 0

    @property
    def rows_this_run(self) -> int:
        return self.gen.rows_written - self.rows_before if self.copied else 0
