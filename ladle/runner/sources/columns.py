"""Which columns a workload reads, and whether each column's Arrow type can hold what it is read for.

Checked when a source opens, before the model loads: a missing column or a column no row of which could
be used (an integer prompt column, a timestamp trace column, a struct of temperatures, a boolean seed) is
a config error now, not an error row for every row later. The values themselves are parsed per row
(runner/prompts.py, runner/arrivals.py, runner/sampling.py); only a trace's order is read here, up front
(`check_trace_order`), since the loop relies on it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import pyarrow as pa

from ladle.runner.arrivals import trace_number
from ladle.runner.config import ConfigError, WorkloadConfig
from ladle.runner.sources.utf8 import pylist

_TYPE_HINT = {
    "number": "numbers or their text",
    "stop": "a string or a list of strings",
    "json_schema": "JSON text or a struct",
    "choice": "a list of strings or its JSON text",
    "text": "strings",
    "flag": "booleans or the text true / false",
    "logit_bias": "a map of token ids to numbers, a struct, or its JSON text",
}

_PROMPT_HINT = {
    "text": "text (a string column)",
    "chat": "chat messages (a list of {role, content} structs)",
    "tokens": "token ids (a list of integers)",
}


def sampling_columns(workload: WorkloadConfig) -> dict[str, str]:
    """Sampling key -> the column holding each row's value (workload.columns + max_tokens_column)."""
    cols = dict(workload.columns)
    if workload.max_tokens_column:
        cols.setdefault("max_tokens", workload.max_tokens_column)
    return cols


def trace_column(workload: WorkloadConfig) -> str | None:
    """The column holding each row's arrival time (arrivals.process=trace), else None (as open_source)."""
    return workload.arrivals.column if workload.arrivals.process == "trace" else None


def read_columns(workload: WorkloadConfig, arrival_column: str | None) -> list[str]:
    """Every column a row is made from, once each, in a fixed order."""
    w = workload
    cols = [w.prompt_column, w.id_column, arrival_column, w.class_column, *sampling_columns(w).values()]
    return list(dict.fromkeys(x for x in cols if x))


def check_columns(workload: WorkloadConfig, arrival_column: str | None, available: list[str], where: str) -> None:
    """Every column a workload key names is one of `available` (else a ConfigError naming the key)."""
    keys = {"prompt_column": workload.prompt_column, "id_column": workload.id_column,
            "max_tokens_column": workload.max_tokens_column, "arrivals.column": arrival_column,
            "class_column": workload.class_column, **{f"columns.{k}": v for k, v in workload.columns.items()}}
    for key, col in keys.items():
        if col is not None and col not in available:  # "" too: no column has an empty name
            raise ConfigError(f"workload.{key}={col!r} is not a column of {where}; "
                              f"its columns are: {', '.join(available) or '(none)'}")


def check_required_columns(workload: WorkloadConfig, arrival_column: str | None, available: list[str],
                           where: str) -> None:
    """One file of several has the columns every row needs: the prompt and a trace's arrival time. (A file
    without an optional column, such as the id or a sampling column, reads it as null, as Parquet does.)"""
    keys = {"prompt_column": workload.prompt_column, "arrivals.column": arrival_column}
    if workload.prompt_column == workload.id_column:  # executor=ray's id-only pass (executors/shards.py): optional
        keys.pop("prompt_column")
    for key, col in keys.items():
        if col is not None and col not in available:
            raise ConfigError(f"workload.{key}={col!r} is not a column of {where}, and every row needs it; "
                              f"that file's columns are: {', '.join(available) or '(none)'}; add the column "
                              "to it or move the file out of workload.path")


def check_column_types(workload: WorkloadConfig, schema: pa.Schema, where: str) -> None:
    """The prompt, trace and sampling columns' types can hold usable values (else a ConfigError). A column
    the schema lacks is left to `check_columns` (or reads as null in one file of several)."""
    names = set(schema.names)
    # The driver's id-only pass (executors/shards.py) reads the id column in the prompt's place.
    if workload.prompt_column in names and workload.prompt_column != workload.id_column:
        _check_prompt_type(workload, schema.field(workload.prompt_column).type, where)
    arrival = trace_column(workload)
    if arrival is not None and arrival in names:
        _check_trace_type(workload, schema.field(arrival).type, where)
    for key, col in sampling_columns(workload).items():
        if col not in names:
            continue
        t = schema.field(col).type
        if not usable_type(key, t):
            raise ConfigError(f"workload column {col!r} (sampling {key}) in {where} has type {t}, which "
                              f"cannot hold {key} values ({_TYPE_HINT[_type_group(key)]}); "
                              "point the key at another column or convert this one")


def _check_prompt_type(workload: WorkloadConfig, t: pa.DataType, where: str) -> None:
    fmt = workload.prompt_format
    if prompt_type_ok(t, fmt):
        return
    wanted = " or ".join(_PROMPT_HINT.values()) if fmt == "auto" else _PROMPT_HINT[fmt]
    raise ConfigError(f"workload.prompt_column={workload.prompt_column!r} in {where} has type {t}, which "
                      f"cannot hold prompts: with workload.prompt_format={fmt} it must hold {wanted}; point "
                      "workload.prompt_column at the prompt column or convert this one")


def _storage(t: pa.DataType) -> pa.DataType:
    """An extension type (e.g. arrow.json over strings) as the type its values are read as."""
    return t.storage_type if isinstance(t, pa.BaseExtensionType) else t


def prompt_type_ok(t: pa.DataType, fmt: str) -> bool:
    """Whether a column of type `t` can hold prompts of format `fmt` (auto: any of them); a null column
    holds only nulls, each one its row's error."""
    t = _storage(t)
    if pa.types.is_null(t):
        return True
    kinds = {"text": _is_text(t), "chat": _is_list_of(t, pa.types.is_struct),
             "tokens": _is_list_of(t, pa.types.is_integer)}
    return any(kinds.values()) if fmt == "auto" else kinds.get(fmt, False)


def _check_trace_type(workload: WorkloadConfig, t: pa.DataType, where: str) -> None:
    if trace_type_ok(t):
        return
    col, unit = workload.arrivals.column, workload.arrivals.unit
    temporal = pa.types.is_temporal(t) or (pa.types.is_dictionary(t) and pa.types.is_temporal(t.value_type))
    fix = ("convert it to seconds from the trace's start (e.g. pandas: (t - t.min()).dt.total_seconds()), or "
           "to milliseconds with workload.arrivals.unit=ms" if temporal else
           "point workload.arrivals.column at a column of numbers (or their text)")
    raise ConfigError(f"workload.arrivals.column={col!r} in {where} has type {t}, which cannot hold trace "
                      f"arrival times: they are numbers in workload.arrivals.unit={unit}; {fix}")


def trace_type_ok(t: pa.DataType) -> bool:
    """Whether a column of type `t` can hold trace arrival times (numbers or their text; runner/arrivals.py)."""
    t = _storage(t)
    if pa.types.is_dictionary(t):
        t = t.value_type
    return pa.types.is_null(t) or _is_number(t) or _is_text(t)


def _is_number(t: pa.DataType) -> bool:
    return pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_decimal(t)


def _is_text(t: pa.DataType) -> bool:
    if pa.types.is_dictionary(t):
        t = t.value_type
    return pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t)


def _is_list_of(t: pa.DataType, item: Any) -> bool:
    """A list of any layout whose items pass `item`."""
    listed = (pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)
              or pa.types.is_list_view(t) or pa.types.is_large_list_view(t))
    return listed and item(t.value_type)


def _type_group(key: str) -> str:
    if key in ("stop", "json_schema", "choice", "logit_bias"):
        return key
    if key in ("include_stop_str_in_output", "skip_special_tokens"):
        return "flag"
    return "text" if key in ("regex", "grammar") else "number"


def usable_type(key: str, t: pa.DataType) -> bool:
    """Whether a column of Arrow type `t` can hold values for sampling `key` (runner/sampling.py parses
    them per row; this only refuses types no row of which could be used)."""
    text = pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t)
    if pa.types.is_null(t) or text or pa.types.is_dictionary(t):
        return True
    group = _type_group(key)
    if group == "number":
        return _is_number(t)
    if group in ("stop", "choice"):  # a list of any layout whose items can be strings
        return _is_list_of(t, lambda v: usable_type("regex", v))
    if group == "json_schema":  # a struct reads as a mapping (a map as a list of pairs); `true` = any
        return pa.types.is_struct(t) or pa.types.is_boolean(t)
    if group == "flag":
        return pa.types.is_boolean(t)
    if group == "logit_bias":  # a map reads as a list of (key, value) pairs, a struct as a mapping
        return pa.types.is_map(t) or pa.types.is_struct(t)
    return False


def trace_order_columns(workload: WorkloadConfig) -> list[str]:
    """What `check_trace_order` reads: the trace column, and the class column when some classes have an
    arrival process of their own (their rows do not follow the trace)."""
    cols = [workload.arrivals.column]
    if workload.class_arrivals and workload.class_column:
        cols.append(workload.class_column)
    return list(dict.fromkeys(cols))


def check_trace_order(workload: WorkloadConfig, batches: Iterable[dict[str, Any]], where: str) -> None:
    """The trace's arrival times do not decrease in row order (else a ConfigError naming the first row that
    arrives before an earlier one). The loop reads rows in order, a bounded window ahead, and lets time pass
    to the earliest arrival it has read: a row arriving earlier than rows before it could be read only
    after the clock had passed its arrival, and its TTFT would count made-up queueing.

    `batches`: `trace_order_columns` -> values (Arrow arrays or Python lists) in row order from row 0.
    Values that are no time (null, NaN, negative, not a number) are their rows' errors and are skipped, as
    are the rows of classes with their own arrival process; workload.limit is applied."""
    col, limit = workload.arrivals.column, workload.limit
    own = set(workload.class_arrivals) if workload.class_column else set()
    last, last_row, start = -math.inf, -1, 0
    for batch in batches:
        t = _times(batch[col])
        n = len(t)
        if limit is not None:
            t = t[: max(0, limit - start)]
        rows = np.arange(start, start + len(t))
        with np.errstate(invalid="ignore"):
            keep = np.isfinite(t) & (t >= 0)
        if own:
            keep &= np.array([v is None or str(v) not in own for v in _pylist(batch[workload.class_column])[: len(t)]],
                             dtype=bool)
        times, rows = t[keep], rows[keep]
        if times.size:
            bad = np.flatnonzero(np.diff(np.concatenate(([last], times))) < 0)
            if bad.size:
                i = int(bad[0])
                prev, prev_row = (last, last_row) if i == 0 else (times[i - 1], rows[i - 1])
                _out_of_order(workload, int(rows[i]), float(times[i]), int(prev_row), float(prev), where)
            last, last_row = float(times[-1]), int(rows[-1])
        start += n
        if limit is not None and start >= limit:
            return


def _out_of_order(workload: WorkloadConfig, row: int, t: float, prev_row: int, prev: float, where: str) -> None:
    col, unit = workload.arrivals.column, workload.arrivals.unit
    raise ConfigError(f"workload.arrivals.column={col!r} in {where} is not in arrival order: row {row} (from 0) "
                      f"arrives at {t:g} {unit}, before row {prev_row} at {prev:g} {unit}; rows are read in "
                      f"order, so a trace must be sorted by its arrival time: sort the dataset by {col!r}")


def _times(values: Any) -> np.ndarray:
    """A batch of trace values as float64 (NaN where a value is no number)."""
    if isinstance(values, pa.ChunkedArray):
        values = values.combine_chunks()
    if isinstance(values, pa.Array):
        if pa.types.is_dictionary(values.type):
            values = values.dictionary_decode()
        if _is_number(values.type):
            return values.cast(pa.float64(), safe=False).to_numpy(zero_copy_only=False)
    return np.array([_time(v) for v in _pylist(values)], dtype=np.float64)


def _time(v: Any) -> float:
    number = trace_number(v)  # as the loop reads a trace value
    return math.nan if number is None else number


def _pylist(values: Any) -> list[Any]:
    return pylist(values) if isinstance(values, (pa.Array, pa.ChunkedArray)) else list(values)


def column_batches(batches: Iterable[pa.RecordBatch | pa.Table], columns: list[str]) -> Iterator[dict[str, Any]]:
    """Arrow batches as `check_trace_order` takes them."""
    return ({c: b.column(c) for c in columns} for b in batches)
