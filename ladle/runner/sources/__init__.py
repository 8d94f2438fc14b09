"""Sources: stream a dataset's rows in batches, whatever it is stored in.

One module per kind: Parquet and Arrow files (arrow.py), HF `datasets` (hf.py), JSONL (jsonl.py, also
the line reader of openai_batch.py), OpenAI batch input files (openai_batch.py) and synthetic
random-token prompts (synthetic.py). Every source yields lists of `Row` (rows.py) one batch at a time
and never holds more than a batch or two in memory, so a dataset larger than memory streams through.
The base (base.py) numbers rows, applies workload.limit and a replica's `Shard` (shard.py); columns.py
checks the columns a workload names when the source opens, before the model loads.
"""

from __future__ import annotations

from ladle.runner.config import WorkloadConfig
from ladle.runner.sources.arrow import ArrowSource, ParquetSource
from ladle.runner.sources.base import Source
from ladle.runner.sources.hf import HFDatasetSource
from ladle.runner.sources.jsonl import JsonlSource
from ladle.runner.sources.openai_batch import OpenAIBatchSource
from ladle.runner.sources.rows import Row
from ladle.runner.sources.shard import Shard
from ladle.runner.sources.synthetic import SyntheticSource

SOURCES: dict[str, type[Source]] = {
    "parquet": ParquetSource,
    "arrow": ArrowSource,
    "hf_dataset": HFDatasetSource,
    "jsonl": JsonlSource,
    "openai_batch": OpenAIBatchSource,
    "synthetic": SyntheticSource,
}

__all__ = ["SOURCES", "Row", "Shard", "Source", "open_source"]


def open_source(workload: WorkloadConfig, shard: Shard | None = None) -> Source:
    """Open (and check the columns of) the workload's source, before any model is loaded; with a shard,
    the source yields only that replica's rows."""
    arrival_column = workload.arrivals.column if workload.arrivals.process == "trace" else None
    return SOURCES[workload.kind](workload, arrival_column, shard)
