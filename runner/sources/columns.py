"""Which columns a workload reads, and whether a sampling column's Arrow type can hold its key's values.

Checked when a source opens, before the model loads: a missing column or a column no row of which could
be used (a struct of temperatures, a boolean seed) is a config error now, not an error row for every
row later. The values themselves are parsed per row (runner/sampling.py).
"""

from __future__ import annotations

import pyarrow as pa

from runner.config import ConfigError, WorkloadConfig

_TYPE_HINT = {
    "number": "numbers or their text",
    "stop": "a string or a list of strings",
    "json_schema": "JSON text or a struct",
    "choice": "a list of strings or its JSON text",
    "text": "strings",
}


def sampling_columns(workload: WorkloadConfig) -> dict[str, str]:
    """Sampling key -> the column holding each row's value (workload.columns + max_tokens_column)."""
    cols = dict(workload.columns)
    if workload.max_tokens_column:
        cols.setdefault("max_tokens", workload.max_tokens_column)
    return cols


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
        if col and col not in available:
            raise ConfigError(f"workload.{key}={col!r} is not a column of {where}; "
                              f"its columns are: {', '.join(available) or '(none)'}")


def check_column_types(workload: WorkloadConfig, schema: pa.Schema, where: str) -> None:
    """Every sampling column's type can hold a usable value of its key (else a ConfigError)."""
    for key, col in sampling_columns(workload).items():
        t = schema.field(col).type
        if not usable_type(key, t):
            raise ConfigError(f"workload column {col!r} (sampling {key}) in {where} has type {t}, which "
                              f"cannot hold {key} values ({_TYPE_HINT[_type_group(key)]}); "
                              "point the key at another column or convert this one")


def _type_group(key: str) -> str:
    if key in ("stop", "json_schema", "choice"):
        return key
    return "text" if key in ("regex", "grammar") else "number"


def usable_type(key: str, t: pa.DataType) -> bool:
    """Whether a column of Arrow type `t` can hold values for sampling `key` (runner/sampling.py parses
    them per row; this only refuses types no row of which could be used)."""
    text = pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t)
    if pa.types.is_null(t) or text or pa.types.is_dictionary(t):
        return True
    group = _type_group(key)
    if group == "number":
        return pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_decimal(t)
    if group in ("stop", "choice"):  # a list of any layout whose items can be strings
        listed = (pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)
                  or pa.types.is_list_view(t) or pa.types.is_large_list_view(t))
        return listed and usable_type("regex", t.value_type)
    if group == "json_schema":  # a struct reads as a mapping (a map as a list of pairs); `true` = any
        return pa.types.is_struct(t) or pa.types.is_boolean(t)
    return False
