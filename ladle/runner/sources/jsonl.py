"""JSON Lines: the one line reader (also under workload=openai_batch), and the jsonl source.

A line is read as bytes and parsed only when its row is wanted (a replica parses only its own lines);
blank lines are no rows; a line that is not a JSON object becomes that row's error, never a stopped job.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass

from ladle.runner.config import WorkloadConfig
from ladle.runner.sources.base import (
    Source,
    find_files,
    is_null_id,
    limit_total,
    null_id_error,
    resolve_path,
    row_id,
)
from ladle.runner.sources.columns import check_trace_order, trace_order_columns
from ladle.runner.sources.compressed import open_lines, with_compressions
from ladle.runner.sources.rows import Row, batched, klass
from ladle.runner.sources.shard import Shard
from ladle.runner.storage import Location
from ladle.runner.text import TooDeep, load_json

JSONL_SUFFIXES = with_compressions((".jsonl", ".json", ".ndjson"))  # also .jsonl.gz, .json.zst, ...


@dataclass(slots=True)
class Line:
    index: int  # the row index: non-blank lines before this one, in all files in order
    path: Location
    lineno: int  # in its file, from 1
    raw: bytes  # unparsed, undecoded (a line that is not UTF-8 is that row's error)


def read_lines(files: list[Location], limit: int | None = None) -> Iterator[Line]:
    """Every non-blank line of the files (decompressed by their extension), in order, at most `limit` of them."""
    index = 0
    for f in files:
        with open_lines(f) as fh:
            for lineno, raw in enumerate(fh, 1):
                if not raw.strip():
                    continue
                if limit is not None and index >= limit:
                    return
                yield Line(index, f, lineno, raw)
                index += 1


def count_lines(files: list[Location]) -> int:
    n = 0
    for f in files:
        with open_lines(f) as fh:
            n += sum(1 for raw in fh if raw.strip())
    return n


def jsonl_files(workload: WorkloadConfig) -> list[Location]:
    return find_files(resolve_path(workload.path), JSONL_SUFFIXES, workload.kind)


def keys_seen(files: list[Location], wanted: list[str]) -> list[str]:
    """The keys of the lines' objects, read until every `wanted` key is among them (usually on line 1; a
    key no line has reads every line). A line is parsed only while no object was seen yet, or when its
    bytes could hold a key still missing: the key as JSON writes it, or a \\u escape."""
    missing, seen = set(wanted), {}
    needles = {k: json.dumps(k, ensure_ascii=False).encode() for k in wanted}
    first = True
    for line in read_lines(files):
        if not missing:
            break
        raw = line.raw
        if not (first or b"\\u" in raw or any(needles[k] in raw for k in missing)):
            continue
        try:
            obj = load_json(raw, whole=False)  # its keys are what is read here
        except ValueError:  # not JSON, not UTF-8 (a UnicodeDecodeError), nested too deeply: that row's error
            continue
        if isinstance(obj, dict):
            first = False
            seen.update(dict.fromkeys(obj))
            missing -= obj.keys()
    return list(seen)


def trace_batches(files: list[Location], workload: WorkloadConfig, size: int = 4096) -> Iterator[dict[str, list]]:
    """The columns `check_trace_order` reads, as lists of the lines' values (None where a line is no object)."""
    cols = trace_order_columns(workload)
    batch: dict[str, list] = {c: [] for c in cols}
    for line in read_lines(files, workload.limit):
        try:
            obj = load_json(line.raw, whole=False)  # only the arrival (and class) values are read
        except ValueError:  # not JSON, not UTF-8, nested too deeply: that row's error, no time
            obj = None
        for c in cols:
            batch[c].append(obj.get(c) if isinstance(obj, dict) else None)
        if len(batch[cols[0]]) == size:
            yield batch
            batch = {c: [] for c in cols}
    if batch[cols[0]]:
        yield batch


class JsonlSource(Source):
    """One object per line; its keys are the columns (a column is present when any line has it)."""

    def __init__(self, workload: WorkloadConfig, arrival_column: str | None, shard: Shard | None = None) -> None:
        super().__init__(workload, arrival_column, shard)
        self.files = jsonl_files(workload)
        where = str(self.files[0]) if len(self.files) == 1 else f"the {len(self.files)} files in {workload.path}"
        self.check_columns(keys_seen(self.files, self.columns), f"any line of {where}")
        if arrival_column is not None:  # the loop relies on a trace's order: every line is parsed once, now
            check_trace_order(workload, trace_batches(self.files, workload), where)
        self.description = f"jsonl {workload.path} ({len(self.files)} files)"
        self.num_rows = limit_total(count_lines(self.files), workload.limit)

    def read(self) -> Iterator[list[Row]]:
        lines = read_lines(self.files, self.workload.limit)
        return batched((self._row(line) for line in lines if self.owns(line.index)), self.workload.batch_size)

    def _row(self, line: Line) -> Row:
        c = self.workload
        try:
            # The depth cap is for the values a row is made from (sampling values: runner/sampling.py; a
            # prompt that cannot be encoded is the row's error), not for keys ladle never reads.
            obj = load_json(line.raw, whole=False)
            if not isinstance(obj, dict):
                raise TypeError(f"a JSON {type(obj).__name__}, not an object")
        except TooDeep as e:
            return self._bad_line(line, f"{line.path.name} line {line.lineno} is {e}")
        except (ValueError, TypeError) as e:
            return self._bad_line(line, f"{line.path.name} line {line.lineno} is not a JSON object: {e}")
        rid = obj.get(c.id_column) if c.id_column else None
        values = {k: obj.get(col) for k, col in self.sampling_columns.items()}
        error = None
        if c.id_column and is_null_id(rid):  # never the row index: that may be another row's id
            error = null_id_error(c.id_column, missing=c.id_column not in obj)
        return Row(index=line.index, id=row_id(rid, line.index, c.id_column), error=error,
                   prompt=obj.get(c.prompt_column), max_tokens=values.get("max_tokens"),
                   arrival=obj.get(self.arrival_column) if self.arrival_column else None,
                   klass=klass(obj.get(c.class_column)) if c.class_column else None, sampling=values or None)

    def _bad_line(self, line: Line, error: str) -> Row:
        """An unreadable line: with an id column it has no id (which no other row's id can be)."""
        return Row(index=line.index, id=None if self.workload.id_column else str(line.index), prompt=None,
                   error=error)
