"""The source base: rows in source order, in batches, numbered and limited, a shard's share only.

A kind (one module each) opens and checks its data in `__init__` (before any model loads), sets
`num_rows` when it is cheap to know, and implements `read()`. The functions here serve the kinds:
column batches -> rows (`rows_from_columns`, `numbered`, `arrow_rows`) and finding files.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa

from ladle.engine.sampling_params import SamplingParams
from ladle.runner.config import ConfigError, WorkloadConfig
from ladle.runner.redact import redact
from ladle.runner.sources.columns import check_column_types, check_columns, read_columns, sampling_columns
from ladle.runner.sources.rows import Row, clean_row, klass
from ladle.runner.sources.shard import Shard
from ladle.runner.sources.utf8 import pylist
from ladle.runner.storage import CREDENTIALS_HELP, Location, list_files, locate
from ladle.runner.text import clean_str


class Source:
    """`batches()` yields lists of rows in source order; `total` is their count when cheap to know."""

    description: str = ""

    def __init__(self, workload: WorkloadConfig, arrival_column: str | None, shard: Shard | None = None) -> None:
        self.workload = workload
        self.arrival_column = arrival_column
        self.shard = shard  # executor=ray: this replica's rows only
        self.num_rows: int | None = None  # rows of the whole source (workload.limit applied), when known
        # Set by the job before reading: synthetic rows draw token ids below the vocabulary size and
        # arrival rates from the calibration (a `load`); `rates` records what those resolved to.
        self.vocab_size: int | None = None
        self.calibration: Any = None
        self.rates: dict[str, float] = {}

    @property
    def total(self) -> int | None:
        """How many rows `batches()` yields (the shard's share), when known."""
        return self.num_rows if self.shard is None else self.shard.size(self.num_rows)

    @property
    def sampling_columns(self) -> dict[str, str]:
        """Sampling key -> column (workload.columns, with workload.max_tokens_column as max_tokens)."""
        return sampling_columns(self.workload)

    @property
    def value_names(self) -> dict[str, str]:
        """Sampling key -> where a row's value comes from, as error messages name it."""
        return {k: f"column {c!r}" for k, c in self.sampling_columns.items()}

    @property
    def columns(self) -> list[str]:
        return read_columns(self.workload, self.arrival_column)

    def row_base(self, base: SamplingParams, model: Any) -> SamplingParams:
        """The sampling params a row starts from (the config's; a format with its own defaults, such as
        openai_batch, puts them in), before its own values."""
        return base

    def owns(self, index: int) -> bool:
        """Whether row `index` is this source's to yield (a reader may skip others unread)."""
        return self.shard is None or self.shard.owns(index)

    def batches(self) -> Iterator[list[Row]]:
        """The rows, every string in them encodable as UTF-8 (runner/text.py), whatever the kind."""
        rows = self.read() if self.shard is None else self.shard.take(self.read())
        return ([clean_or_error(row) for row in batch] for batch in rows)

    def read(self) -> Iterator[list[Row]]:
        """The rows in source order, in batches of about workload.batch_size (the kind's reader)."""
        raise NotImplementedError

    # -- for the kinds --------------------------------------------------------------------------------
    def check_columns(self, available: list[str], where: str) -> None:
        check_columns(self.workload, self.arrival_column, available, where)

    def check_column_types(self, schema: pa.Schema, where: str) -> None:
        check_column_types(self.workload, schema, where)

    def rows_from_columns(self, cols: dict[str, list], start: int) -> list[Row]:
        """Rows from column lists (the columns of `columns`); the first one is row `start`."""
        c = self.workload
        ids = cols.get(c.id_column) if c.id_column else None
        arr = cols.get(self.arrival_column) if self.arrival_column else None
        cls = cols.get(c.class_column) if c.class_column else None
        sampling = {key: cols[col] for key, col in self.sampling_columns.items()}
        out = []
        for i in range(len(cols[c.prompt_column])):
            index = start + i
            rid = ids[i] if ids is not None else None  # None too where a file of a directory lacks the column
            values = {key: v[i] for key, v in sampling.items()}
            error = null_id_error(c.id_column) if c.id_column and is_null_id(rid) else None
            out.append(Row(index=index, id=row_id(rid, index, c.id_column), prompt=cols[c.prompt_column][i],
                           max_tokens=values.get("max_tokens"), arrival=arr[i] if arr is not None else None,
                           klass=None if cls is None else klass(cls[i]), sampling=values or None, error=error))
        return out

    def numbered(self, batches: Iterator[dict[str, list]]) -> Iterator[list[Row]]:
        """Column batches as rows, numbered from 0 and stopping at workload.limit."""
        limit = self.workload.limit
        start = 0
        for cols in batches:
            rows = self.rows_from_columns(cols, start)
            if limit is not None and start + len(rows) >= limit:
                rows = rows[: limit - start]
                if rows:
                    yield rows
                return
            start += len(rows)
            if rows:
                yield rows

    def arrow_rows(self, batches: Iterator[pa.RecordBatch | pa.Table]) -> Iterator[list[Row]]:
        """Arrow record batches (or tables) as rows (see `numbered`)."""
        cols = self.columns
        return self.numbered({name: pylist(b.column(name)) for name in cols} for b in batches)


def row_id(value: Any, index: int, id_column: str | None) -> str | None:
    """A row's id: its id column's value as text; the row index when no id column is set. A null id
    is None (the row's error, `null_id_error`): the index would take an id another row may hold."""
    if not id_column:
        return str(index)
    return None if is_null_id(value) else id_text(value)


def id_text(value: Any) -> str:
    """An id value as text. A whole-number float is the integer: pandas stores an integer column with a
    missing value as float64, and "101.0" would no longer join back to the source's 101."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def is_null_id(value: Any) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))  # NaN: pandas' null


def null_id_error(column: str, missing: bool = False) -> str:
    where = f"(this line has no key {column!r})" if missing else f"in column {column!r}"
    return (f"id is {'missing' if missing else 'null'} {where}; give every row an id, or unset "
            "workload.id_column to number the rows by position")


def clean_or_error(row: Row) -> Row:
    """The row cleaned (runner/text.py), or, if its values defeat that, an error row of its own: one
    row never stops the job."""
    try:
        return clean_row(row)
    except Exception as e:  # noqa: BLE001 - whatever the value, it is this row's error
        return Row(index=row.index, id=None if row.id is None else clean_str(str(row.id)), prompt=None,
                   error=row_failure("this row's values", e))


def row_failure(what: str, exc: BaseException) -> str:
    """A row's error for an exception nothing before foresaw (the job's backstop: the row is lost,
    never the job)."""
    if isinstance(exc, RecursionError):
        return f"{what} could not be processed: nested too deeply (RecursionError); flatten them"
    return f"{what} could not be processed: {type(exc).__name__}: {exc}"


def resolve_path(path: str) -> Location:
    """The local path or store URI (runner/storage.py) workload.path names; a ConfigError if it is not there."""
    loc = locate(path, "workload.path")
    try:
        there = loc.exists()
    except OSError as e:  # a store that refuses (credentials, an unknown bucket): the user's to fix
        raise ConfigError(f"workload.path={str(loc)!r} could not be read: {redact(str(e))}; {CREDENTIALS_HELP}") from None
    if not there:
        where = f"relative paths are from {Path.cwd()}" if loc.local else "checked through the store's API"
        raise ConfigError(f"workload.path={str(loc)!r} does not exist ({where})")
    return loc


def find_files(p: Location, suffixes: tuple[str, ...], kind: str) -> list[Location]:
    """`p` itself, or the files under it with these suffixes (hidden and `_` ones left out), sorted."""
    files = list_files(p, suffixes)
    if not files:
        plain = [s for s in suffixes if not any(s.startswith(t + ".") for t in suffixes)]  # not .jsonl.gz
        also = " (or compressed ones)" if len(plain) < len(suffixes) else ""
        raise ConfigError(f"workload.path={str(p)!r} has no {'/'.join(plain)} files{also} for workload.kind={kind}")
    return files


def limit_total(n: int | None, limit: int | None) -> int | None:
    if n is None:
        return limit
    return n if limit is None else min(n, limit)
