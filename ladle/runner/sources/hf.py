"""HF `datasets`: a `save_to_disk` directory (memory-mapped Arrow) or local data files streamed by
`load_dataset(..., streaming=True)`."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from ladle.runner.config import ConfigError, WorkloadConfig
from ladle.runner.sources.base import Source, limit_total, resolve_path
from ladle.runner.sources.columns import check_trace_order, column_batches, trace_order_columns
from ladle.runner.sources.compressed import data_suffix
from ladle.runner.sources.rows import Row
from ladle.runner.sources.shard import Shard

HF_BUILDERS = {".json": "json", ".jsonl": "json", ".ndjson": "json", ".csv": "csv", ".tsv": "csv",
               ".parquet": "parquet", ".arrow": "arrow", ".txt": "text"}
# A file's builder options its extension implies, as datasets pairs them for a directory: `.tsv` is tab-separated.
HF_BUILDER_OPTIONS = {(".tsv", "csv"): {"sep": "\t"}}


class HFDatasetSource(Source):
    def __init__(self, workload: WorkloadConfig, arrival_column: str | None, shard: Shard | None = None) -> None:
        import datasets

        super().__init__(workload, arrival_column, shard)
        p = resolve_path(workload.path)
        where = p.path if p.local else p.uri  # datasets opens store URIs itself (fsspec, the same environment)
        self.streaming = not (p.is_dir() and (p.child("state.json").exists() or p.child("dataset_dict.json").exists()))
        if not self.streaming:
            ds = datasets.load_from_disk(where)
            if isinstance(ds, datasets.DatasetDict):
                ds = ds[self._pick_split(list(ds.keys()))]
            self.num_rows = limit_total(len(ds), workload.limit)
            names = list(ds.column_names)
        else:
            split = workload.split or "train"
            suffix = data_suffix(p)  # datasets decompresses data files by their extension (.jsonl.gz)
            builder = workload.hf_builder or (HF_BUILDERS.get(suffix) if p.is_file() else None)
            try:
                if builder:
                    options = HF_BUILDER_OPTIONS.get((suffix, builder), {})
                    ds = datasets.load_dataset(builder, data_files=where, split=split, streaming=True, **options)
                else:
                    ds = datasets.load_dataset(where, split=split, streaming=True)
            except Exception as e:  # noqa: BLE001 - datasets raises many kinds; the message is what matters
                raise ConfigError(f"workload.path={workload.path!r} could not be loaded with datasets "
                                  f"(set workload.hf_builder=json|csv|parquet|text?): {e}") from None
            try:
                names = list(ds.column_names or []) or list(next(iter(ds)).keys())
            except Exception as e:  # noqa: BLE001 - the first rows datasets could not read
                raise ConfigError(_unreadable(workload, e)) from None
        self.check_columns(names, repr(workload.path))
        if not self.streaming:  # only a saved dataset's types are the data's own (a stream's are guessed)
            self.check_column_types(ds.features.arrow_schema, repr(workload.path))
        self.dataset = ds.select_columns(self.columns)
        if arrival_column is not None:
            self._check_trace_order(ds)
        self.description = f"hf_dataset {workload.path}" + (" (streaming)" if self.streaming else "")

    def _check_trace_order(self, ds: Any) -> None:
        """The trace column alone (memory-mapped when saved; a stream is read through once)."""
        cols = trace_order_columns(self.workload)
        batches = ds.select_columns(cols).with_format("arrow").iter(batch_size=65536)
        if self.streaming:
            batches = self._guarded(batches)
        check_trace_order(self.workload, column_batches(batches, cols), repr(self.workload.path))

    def _pick_split(self, splits: list[str]) -> str:
        w = self.workload
        if w.split:
            if w.split not in splits:
                raise ConfigError(f"workload.split={w.split!r} is not a split of {w.path!r}: {splits}")
            return w.split
        if "train" in splits or len(splits) != 1:
            if "train" not in splits:
                raise ConfigError(f"{w.path!r} has splits {splits}: choose one with workload.split=")
            return "train"
        return splits[0]

    def read(self) -> Iterator[list[Row]]:
        # Arrow batches either way: strings whose bytes are not UTF-8 are decoded by the base (sources/utf8.py),
        # where datasets' own conversion to Python would raise.
        batches = self.dataset.with_format("arrow").iter(batch_size=self.workload.batch_size)
        return self.arrow_rows(self._guarded(batches) if self.streaming else batches)

    def _guarded(self, batches: Iterator) -> Iterator:
        """A streamed dataset's batches; datasets failing to read on (e.g. JSON holding a lone surrogate,
        which its JSON reader refuses) stops the job as a data error (exit 2), the rows so far written."""
        try:
            yield from batches
        except Exception as e:  # noqa: BLE001 - datasets raises many kinds; the message is what matters
            raise ConfigError(_unreadable(self.workload, e)) from None


def _unreadable(workload: WorkloadConfig, e: Exception) -> str:
    return (f"workload.path={workload.path!r}: datasets could not read the data ({type(e).__name__}: {e}); "
            "fix the file, or read it with another workload.kind (jsonl reads JSON Lines datasets refuses)")
