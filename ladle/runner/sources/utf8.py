"""Arrow columns as Python values, when a string in them holds bytes that are not UTF-8.

Arrow strings are meant to be UTF-8, but a Parquet or Arrow file written without validation can hold
any bytes, and pyarrow then raises UnicodeDecodeError converting the batch: the whole job would die on
one bad value. Such a column is converted with each invalid byte decoded as U+FFFD (runner/text.py's
rule), in strings at any depth of lists, structs and dictionaries.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc


def pylist(column: pa.Array | pa.ChunkedArray) -> list[Any]:
    """`column.to_pylist()`, with bytes that are not UTF-8 in its strings decoded as U+FFFD."""
    try:
        return column.to_pylist()
    except UnicodeDecodeError:
        chunks = column.chunks if isinstance(column, pa.ChunkedArray) else [column]
        return [v for chunk in chunks for v in _repaired(chunk)]


def _repaired(arr: pa.Array) -> list[Any]:
    try:
        return valid_utf8(arr).to_pylist()
    except NotImplementedError:  # a layout valid_utf8 does not rebuild: value by value, a bad one null
        return [_as_py(x) for x in arr]


def _as_py(scalar: pa.Scalar) -> Any:
    try:
        return scalar.as_py()
    except UnicodeDecodeError:
        return None


def _is_text(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t)


def valid_utf8(arr: pa.Array) -> pa.Array:
    """`arr` with the strings at any depth made valid UTF-8 (NotImplementedError: a layout not handled)."""
    t = arr.type
    if _is_text(t):
        raw = arr.cast(pa.large_binary()).to_pylist()  # string -> binary: no validation, no copy of text
        return pa.array([None if b is None else b.decode("utf-8", "replace") for b in raw], pa.large_string())
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        # Offsets from 0 over flatten()'s values (a sliced array's own offsets cannot take a mask).
        lengths = pc.fill_null(pc.list_value_length(arr), 0).to_numpy(zero_copy_only=False)
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        cls, width = (pa.ListArray, pa.int32()) if pa.types.is_list(t) else (pa.LargeListArray, pa.int64())
        return cls.from_arrays(pa.array(offsets, width), valid_utf8(arr.flatten()), mask=arr.is_null())
    if pa.types.is_fixed_size_list(t):
        size = t.list_size
        values = arr.values.slice(arr.offset * size, len(arr) * size)
        return pa.FixedSizeListArray.from_arrays(valid_utf8(values), size, mask=arr.is_null())
    if pa.types.is_struct(t):
        return pa.StructArray.from_arrays([valid_utf8(f) for f in arr.flatten()], names=[f.name for f in t],
                                          mask=arr.is_null())
    if pa.types.is_dictionary(t):
        return pa.DictionaryArray.from_arrays(arr.indices, valid_utf8(arr.dictionary))
    if pa.types.is_nested(t) or pa.types.is_union(t):
        raise NotImplementedError(str(t))
    return arr  # no strings inside
