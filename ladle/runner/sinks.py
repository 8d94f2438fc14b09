"""Parquet sinks: rows written in row groups to `<name>.tmp`, finalised by close + os.replace.

A sink always closes its writer (the job closes it in a `finally`), so Ctrl-C leaves a complete,
readable file holding every row written so far. A file reaches its final name only once verified: its
footer reads back and holds the rows written. A write that failed (a full disk, an I/O error) leaves the
previous file as it was and raises `OutputError`. Resume reads the finished ids back, and the next run
copies the old rows into its new file before appending, so a run directory always has one file per
kind whose rows are unique by id. A process killed outright (SIGKILL, power loss) leaves a `.tmp`
without its footer: its rows are lost and recomputed by the next run, the finished file is intact.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ladle.runner.durable import fsync_path, readable, sync_dir, tmp_path
from ladle.runner.text import clean

log = logging.getLogger("ladle")

CONFIG_KEY = b"ladle.config"
GENERATIONS = "generations.parquet"  # one row per finished request (per sample)
STEPS = "steps.parquet"  # one row per engine step

# One top-k alternative: (token id, raw logprob); a position's list is best first.
TOP_LOGPROB = pa.struct([pa.field("token_id", pa.int32()), pa.field("logprob", pa.float32())])

GENERATIONS_FIELDS = [
    pa.field("id", pa.string()),
    pa.field("index", pa.int64()),  # the row's position in the source
    pa.field("prompt", pa.string()),  # dropped when output.include_prompt=false
    pa.field("prompt_tokens", pa.int32()),
    pa.field("output_text", pa.string()),
    pa.field("output_token_ids", pa.list_(pa.int32())),
    pa.field("output_tokens", pa.int32()),
    pa.field("finish_reason", pa.string()),
    pa.field("error", pa.string()),
    pa.field("arrival_s", pa.float64()),
    pa.field("first_scheduled_s", pa.float64()),
    pa.field("first_token_s", pa.float64()),
    pa.field("finish_s", pa.float64()),
    pa.field("token_times_s", pa.list_(pa.float64())),
    pa.field("ttft_s", pa.float64()),
    pa.field("tpot_s", pa.float64()),
    pa.field("e2e_s", pa.float64()),
    pa.field("num_prefill_chunks", pa.int32()),
    pa.field("num_preemptions", pa.int32()),
    pa.field("num_cached_tokens", pa.int32()),
    pa.field("class", pa.string()),  # the request class: workload.class_column, or a synthetic row's group
    pa.field("attempt", pa.int32()),  # 0 for the first run into this directory, 1 for the first resume, ...
    # n samples and logprobs: always present, null when not asked for
    pa.field("sample_index", pa.int32()),  # 0..n-1: one row per sample of the row (sampling.n)
    pa.field("logprobs", pa.list_(pa.float32())),  # per generated token: its raw logprob (sampling.logprobs)
    pa.field("top_logprobs", pa.list_(pa.list_(TOP_LOGPROB))),  # per generated token: top-k, best first
    pa.field("prompt_logprobs", pa.list_(pa.float32())),  # per prompt token: log P(t_i | t_<i); [0] is null
    pa.field("prompt_top_logprobs", pa.list_(pa.list_(TOP_LOGPROB))),  # per prompt token; [0] is []
]

STEPS_FIELDS = [
    pa.field("attempt", pa.int32()),
    pa.field("step", pa.int64()),
    pa.field("start_s", pa.float64()),
    pa.field("duration_s", pa.float64()),
    pa.field("decode_tokens", pa.int32()),
    pa.field("prefill_tokens", pa.int32()),
    pa.field("prefill_requests", pa.int32()),
    pa.field("running", pa.int32()),
    pa.field("waiting", pa.int32()),
    pa.field("kv_blocks_used", pa.int32()),
    pa.field("cached_prompt_tokens", pa.int32()),
    pa.field("num_forwards", pa.int32()),
    pa.field("arrived", pa.int32()),  # requests added to the engine since the previous step
    pa.field("scheduled_ids", pa.list_(pa.string())),
    pa.field("scheduled_tokens", pa.list_(pa.int32())),
    pa.field("preempted", pa.list_(pa.string())),
    pa.field("failed", pa.list_(pa.string())),
]


def generations_schema(include_prompt: bool) -> pa.Schema:
    return pa.schema([f for f in GENERATIONS_FIELDS if include_prompt or f.name != "prompt"])


STEPS_SCHEMA = pa.schema(STEPS_FIELDS)


def conform(table: pa.Table | pa.RecordBatch, schema: pa.Schema) -> pa.Table:
    """`table` with exactly `schema`'s columns: missing ones null, extra ones dropped, types cast."""
    cols = []
    for f in schema:
        if f.name in table.schema.names:
            cols.append(table.column(f.name).cast(f.type))
        else:
            cols.append(pa.nulls(table.num_rows, f.type))
    return pa.Table.from_arrays(cols, schema=schema)


class OutputError(RuntimeError):
    """An output file could not be written completely; the previous one (if any) was kept."""


# What pyarrow raises for a row it cannot encode (a string UTF-8 cannot hold, a value of the wrong type).
UNWRITABLE = (pa.ArrowException, UnicodeError, TypeError, ValueError, OverflowError)


class ParquetSink:
    """`repair(row, error)`: the row to write instead of one pyarrow cannot encode even with its strings
    cleaned (runner/text.py); None drops such a row with a warning. Either way the rows beside it are
    written: one bad row never costs its row group."""

    def __init__(self, path: Path, schema: pa.Schema, row_group_size: int, metadata: dict[bytes, bytes],
                 repair: Callable[[dict[str, Any], Exception], dict[str, Any]] | None = None) -> None:
        self.path = Path(path)
        self.tmp = tmp_path(self.path)
        self.schema = schema.with_metadata(metadata)
        self.row_group_size = row_group_size
        self.repair = repair
        self._rows: list[dict[str, Any]] = []
        try:
            self._writer: pq.ParquetWriter | None = pq.ParquetWriter(self.tmp, self.schema)
        except OSError as e:  # a full disk, a read-only directory: before any row is computed
            self.tmp.unlink(missing_ok=True)
            raise OutputError(f"cannot create {self.tmp}: {e}; the previous {self.path.name} is kept as it was "
                              "(free space or fix the cause, then run the same command again)") from e
        self.rows_written = 0
        self._inflight = 0  # rows of a write an interrupt may have cut: on disk or not
        self.error: BaseException | None = None  # the first write that failed: the file is not finalised
        self._checked = False  # the closed .tmp was verified and flushed (finish may run again after an interrupt)

    def write(self, row: dict[str, Any]) -> None:
        self._rows.append(row)
        if len(self._rows) >= self.row_group_size:
            self.flush()

    def write_table(self, table: pa.Table) -> None:
        """Append existing rows (resume copies the previous run's file this way)."""
        self.flush()
        if table.num_rows:
            self._write(conform(table, self.schema).replace_schema_metadata(self.schema.metadata))

    def flush(self) -> None:
        if self._rows:
            assert self._writer is not None
            # Taken out of the buffer first: a Ctrl-C right after the write must not write them twice.
            rows, self._rows = self._rows, []
            try:
                table = pa.Table.from_pylist(rows, schema=self.schema)
            except UNWRITABLE:  # find the rows pyarrow cannot encode; write the others as they are
                table = pa.Table.from_pylist([r for r in map(self._writable, rows) if r is not None],
                                             schema=self.schema)
            self._write(table)

    def _write(self, table: pa.Table) -> None:
        """One write to the file, counted; a failure marks the sink failed (it will not be finalised)."""
        assert self._writer is not None
        if self.error is not None:
            raise OutputError(f"{self.path.name}: an earlier write failed: {self.error}")
        self._inflight = table.num_rows
        try:
            self._writer.write_table(table, row_group_size=self.row_group_size)
        except KeyboardInterrupt:
            raise  # the file is checked at close: the rows are counted whether or not they reached it
        except BaseException as e:
            self.error = e
            raise
        self.rows_written += self._inflight
        self._inflight = 0

    def _writable(self, row: dict[str, Any]) -> dict[str, Any] | None:
        """The row if pyarrow can encode it, else its cleaned form, else `repair`'s row (None: dropped)."""
        if self._encode_error(row) is None:
            return row
        cleaned = clean(row)
        error = self._encode_error(cleaned)
        if error is None:
            log.warning("%s: a row held text UTF-8 cannot encode; written with U+FFFD", self.path.name)
            return cleaned
        if self.repair is not None:
            fixed = self.repair(cleaned, error)
            if self._encode_error(fixed) is None:
                return fixed
        log.warning("%s: dropped a row that cannot be written: %s", self.path.name, error)
        return None

    def _encode_error(self, row: dict[str, Any]) -> Exception | None:
        try:
            pa.Table.from_pylist([row], schema=self.schema)
        except UNWRITABLE as e:
            return e
        return None

    def close(self) -> None:
        """Flush, close, verify and atomically move the file into place (safe to call twice)."""
        self.finish()
        self.commit()

    def finish(self) -> None:
        """Flush and close the `.tmp` and check it: a footer that reads back, holding the rows written.
        On any failure the `.tmp` is deleted (the finished file stays as it was) and OutputError says why."""
        if self._writer is not None:
            self._close_writer()
        if self._checked:
            return
        problem = self._verify() or self._sync()
        if problem is not None:
            self.tmp.unlink(missing_ok=True)
            raise self.failure(problem)
        self._checked = True

    def failure(self, problem: str) -> OutputError:
        kept = f"the previous {self.path.name} is kept as it was" if self.path.exists() else "nothing was kept"
        return OutputError(f"writing {self.path} failed ({problem}); {kept}. Free space or fix the cause, then "
                           "run the same command again: it resumes from the rows kept")

    def _close_writer(self) -> None:
        """Flush the buffered rows and write the footer, whatever interrupts the flush."""
        assert self._writer is not None
        try:
            self.flush()
        except KeyboardInterrupt:
            pass  # a second Ctrl-C: the file is closed and checked all the same
        except Exception:
            if self.error is None:
                raise
        finally:
            try:
                self._writer.close()
            except Exception as e:  # noqa: BLE001 - a footer that could not be written
                self.error = self.error or e
            self._writer = None

    def _verify(self) -> str | None:
        """Why the closed `.tmp` is not complete, or None: a failed write, no footer, a row count not
        the one written (`_inflight`: a write an interrupt cut may or may not have landed)."""
        if self.error is not None:
            return f"{type(self.error).__name__}: {self.error}"
        pf = readable(self.tmp)
        if pf is None:
            return f"{self.tmp.name} has no readable Parquet footer"
        on_disk = pf.metadata.num_rows
        if not self.rows_written <= on_disk <= self.rows_written + self._inflight:
            return f"{self.tmp.name} holds {on_disk} rows, {self.rows_written} were written"
        self.rows_written = on_disk
        return None

    def _sync(self) -> str | None:
        """Why the `.tmp` could not be flushed to the device, or None (a caching disk may report ENOSPC only here)."""
        try:
            fsync_path(self.tmp)
        except OSError as e:
            return f"{type(e).__name__}: {e}"
        return None

    def commit(self) -> None:
        """Move the verified, flushed `.tmp` into place (after `finish`; nothing to do when already moved)."""
        if self.tmp.exists():
            os.replace(self.tmp, self.path)
            sync_dir(self.path.parent)

    def abort(self) -> None:
        """Close and delete the .tmp file, leaving the finished file (if any) as it was."""
        self._checked = True  # nothing left to check or move
        if self._writer is not None:
            try:
                self._writer.close()
            except Exception as e:  # noqa: BLE001 - the file is deleted either way
                log.debug("%s: closing a discarded file failed: %s", self.tmp.name, e)
            self._writer = None
        self.tmp.unlink(missing_ok=True)


def previous_batches(path: Path, unique_ids: bool, skip_errors: bool = False,
                     batch_size: int = 4096) -> Iterator[pa.Table]:
    """The rows of the previous runs in `path`, optionally unique by (id, index, sample_index) and
    without errored rows (a file from before sample_index existed counts every row as sample 0).

    The row index is part of the key because a repeated id is written twice (the repeat as an error
    row, often before the first one finishes): both rows are kept, as executor=ray's merge does."""
    pf = readable(path)
    if pf is None:
        return
    seen: set[tuple[str, int, int]] = set()
    for batch in pf.iter_batches(batch_size=batch_size):
        t = pa.Table.from_batches([batch])
        if unique_ids:
            ids = t.column("id").to_pylist()
            errs = [False] * len(ids)
            if skip_errors and "finish_reason" in t.schema.names:
                errs = pc.fill_null(pc.equal(t.column("finish_reason"), "error"), False).to_pylist()
            index = t.column("index").to_pylist() if "index" in t.schema.names else [0] * t.num_rows
            keep = []
            for key, err in zip(zip(ids, index, sample_indices(t), strict=True), errs, strict=True):
                keep.append(key not in seen and not err)
                if keep[-1]:
                    seen.add(key)
            t = t.filter(pa.array(keep, pa.bool_()))
        if t.num_rows:
            yield t


def sample_indices(t: pa.Table) -> list[int]:
    """Each row's sample_index (0 where null or where the file predates the column)."""
    if "sample_index" not in t.schema.names:
        return [0] * t.num_rows
    return pc.fill_null(t.column("sample_index"), 0).to_pylist()


def previous_attempts(path: Path) -> int:
    """How many runs already wrote into this file (max attempt + 1; 0 when there is none)."""
    pf = readable(path)
    if pf is None or "attempt" not in pf.schema_arrow.names:
        return 0
    best = pc.max(pf.read(columns=["attempt"]).column("attempt")).as_py()
    return 0 if best is None else best + 1


def read_config_yaml(path: Path) -> str | None:
    """The resolved job config stored in a sink's schema metadata."""
    pf = readable(path)
    if pf is None:
        return None
    meta = pf.schema_arrow.metadata or {}
    raw = meta.get(CONFIG_KEY)
    return raw.decode() if raw else None
