"""Parquet (a file or a directory of parts, through pyarrow.dataset) and Arrow IPC files, memory-mapped."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pyarrow as pa

from ladle.runner.config import ConfigError, WorkloadConfig
from ladle.runner.sources.base import Source, find_files, limit_total, resolve_path
from ladle.runner.sources.columns import (
    check_required_columns,
    check_trace_order,
    column_batches,
    trace_order_columns,
)
from ladle.runner.sources.parquet_files import open_dataset, partition_values
from ladle.runner.sources.rows import Row
from ladle.runner.sources.shard import Shard
from ladle.runner.sources.utf8 import pylist
from ladle.runner.storage import Location

ARROW_SUFFIXES = (".arrow", ".feather", ".ipc")


class ParquetSource(Source):
    """A Parquet file or a directory of parts (sources/parquet_files.py: data files only, one unified
    schema, hive partition keys as columns), read through pyarrow.dataset."""

    def __init__(self, workload: WorkloadConfig, arrival_column: str | None, shard: Shard | None = None) -> None:
        super().__init__(workload, arrival_column, shard)
        self.dataset = open_dataset(resolve_path(workload.path), workload.path)
        self.check_columns(self.dataset.schema.names, repr(workload.path))
        self.check_column_types(self.dataset.schema, repr(workload.path))
        self.partitions = {str(frag.path): partition_values(frag) for frag in self.dataset.get_fragments()}
        if len(self.partitions) > 1:  # a part may lack a column the others have: check each part's own
            for frag in self.dataset.get_fragments():
                names = [*frag.physical_schema.names, *self.partitions[str(frag.path)]]
                check_required_columns(workload, arrival_column, names, repr(frag.path))
                self.check_column_types(frag.physical_schema, repr(frag.path))
        if arrival_column is not None:
            cols = trace_order_columns(workload)
            scanner = self.dataset.scanner(columns=cols, batch_size=65536, use_threads=False)
            check_trace_order(workload, column_batches(scanner.to_batches(), cols), repr(workload.path))
        self.description = f"parquet {workload.path} ({len(self.dataset.files)} files)"
        self.num_rows = limit_total(self.dataset.count_rows(), workload.limit)

    def read(self) -> Iterator[list[Row]]:
        if self.shard is not None:
            return self._shard_rows(self.shard)
        # use_threads=False keeps the row order (ids default to the row index) and bounds read-ahead.
        scanner = self.dataset.scanner(columns=self.columns, batch_size=self.workload.batch_size, use_threads=False)
        return self.arrow_rows(scanner.to_batches())

    def _shard_rows(self, shard: Shard) -> Iterator[list[Row]]:
        """Only the row groups holding a row of the shard (row counts come from the footers)."""
        import pyarrow.parquet as pq

        limit = self.workload.limit
        offset = 0  # global index of the row group's first row, in the order the scanner reads
        for frag in self.dataset.get_fragments():
            pf = pq.ParquetFile(frag.path, filesystem=self.dataset.filesystem)
            for rg in range(pf.num_row_groups):
                n = pf.metadata.row_group(rg).num_rows
                end = offset + n if limit is None else min(offset + n, limit)
                if shard.routing.owns_any(shard.k, offset, end):
                    for rows in self._row_group_rows(pf, rg, offset, str(frag.path)):
                        yield [r for r in rows if limit is None or r.index < limit]
                offset += n
                if limit is not None and offset >= limit:
                    return

    def _row_group_rows(self, pf: Any, rg: int, start: int, path: str) -> Iterator[list[Row]]:
        """One row group's rows, each column as the whole dataset types it (a part's partition key from its
        directory; a column the part lacks is null), numbered from `start`."""
        cols, schema, keys = self.columns, self.dataset.schema, self.partitions[path]
        have = [c for c in cols if c in pf.schema_arrow.names]
        for b in pf.iter_batches(batch_size=self.workload.batch_size, row_groups=[rg], columns=have,
                                 use_threads=False):
            values = {c: pylist(b.column(c).cast(schema.field(c).type)) if c in have
                      else [keys.get(c)] * b.num_rows for c in cols}
            yield self.rows_from_columns(values, start)
            start += b.num_rows


class ArrowSource(Source):
    """Arrow IPC files (random-access "file" format or the "stream" format HF datasets write), memory-mapped."""

    def __init__(self, workload: WorkloadConfig, arrival_column: str | None, shard: Shard | None = None) -> None:
        super().__init__(workload, arrival_column, shard)
        self.files = find_files(resolve_path(workload.path), ARROW_SUFFIXES, "arrow")
        # As Parquet reads a directory: the first file's columns are the dataset's; every file must have the
        # ones every row needs, and a file without an optional one reads it as null.
        self.check_columns(_open(self.files[0]).schema.names, repr(str(self.files[0])))
        total = 0
        for f in self.files:
            schema = _open(f).schema
            check_required_columns(workload, arrival_column, schema.names, repr(str(f)))
            self.check_column_types(schema, repr(str(f)))
            total += sum(b.num_rows for b in _iter_file(f))  # zero-copy: only headers are read
        self.num_rows = limit_total(total, workload.limit)
        if arrival_column is not None:
            cols = trace_order_columns(workload)
            check_trace_order(workload, column_batches(self._batches(cols), cols), repr(workload.path))
        self.description = f"arrow {workload.path} ({len(self.files)} files)"

    def _batches(self, columns: list[str]) -> Iterator[pa.RecordBatch]:
        """Every file's batches with just `columns` (null where a file lacks one), memory-mapped."""
        for f in self.files:
            for b in _iter_file(f):
                yield pa.RecordBatch.from_arrays(
                    [b.column(c) if c in b.schema.names else pa.nulls(b.num_rows) for c in columns], names=columns)

    def read(self) -> Iterator[list[Row]]:
        bs = self.workload.batch_size

        def sliced() -> Iterator[pa.RecordBatch]:
            for b in self._batches(self.columns):
                for off in range(0, b.num_rows, bs):
                    yield b.slice(off, bs)

        return self.arrow_rows(sliced())


def _open(f: Location) -> pa.ipc.RecordBatchFileReader | pa.ipc.RecordBatchStreamReader:
    source = f.open_random()
    try:
        return pa.ipc.open_file(source)
    except pa.ArrowInvalid:
        source.seek(0)
        try:
            return pa.ipc.open_stream(source)
        except pa.ArrowInvalid as e:
            raise ConfigError(f"{f} is not an Arrow IPC file or stream: {e}") from None


def _iter_file(f: Location) -> Iterator[pa.RecordBatch]:
    reader = _open(f)
    if isinstance(reader, pa.ipc.RecordBatchFileReader):
        for i in range(reader.num_record_batches):
            yield reader.get_batch(i)
    else:
        yield from reader
