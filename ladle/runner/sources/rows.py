"""A row as every source yields it, and the mark a repeated id's row carries."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from ladle.runner.text import clean, clean_str


@dataclass(slots=True)
class Row:
    index: int  # position in the source, from 0
    id: str | None  # the id column's value, else str(index); None: a row with no id of its own (a batch line
    # without a usable custom_id, a null or missing id in workload.id_column: an error row), told apart by its index
    prompt: Any  # str | list[dict] | list[int] | None
    max_tokens: Any = None  # the max_tokens column's raw value, or a synthetic row's draw (None: the default)
    arrival: Any = None  # the trace column's raw value
    error: str | None = None  # the row could not be read (e.g. a bad JSON line)
    klass: str | None = None  # the request class (workload.class_column; a synthetic row's group)
    sampling: dict[str, Any] | None = None  # raw per-row sampling values by key (workload.columns)


def clean_row(row: Row) -> Row:
    """The row with every string in it made encodable as UTF-8 (runner/text.py: the one rule for text
    entering the job), in place."""
    row.id = None if row.id is None else clean_str(row.id)
    row.prompt, row.arrival, row.max_tokens = clean(row.prompt), clean(row.arrival), clean(row.max_tokens)
    row.error = None if row.error is None else clean_str(row.error)
    row.klass = None if row.klass is None else clean_str(row.klass)
    row.sampling = None if row.sampling is None else clean(row.sampling)
    return row


# A repeated id is an error row of its own. Resume tells the repeat's row from the id's own rows by how
# its error starts, so the message is made and recognised here only.
DUPLICATE_ID = "duplicate id "


def duplicate_id_error(rid: str, column: str | None) -> str:
    return f"{DUPLICATE_ID}{rid!r} in column {column!r}"


def is_duplicate_id_error(error: str | None) -> bool:
    return bool(error) and error.startswith(DUPLICATE_ID)


def klass(value: Any) -> str | None:
    """A class column's value as a request class (any value, as text; null is none)."""
    return None if value is None else str(value)


def batched(rows: Iterable[Row], size: int) -> Iterator[list[Row]]:
    """Rows in lists of `size` (the last one shorter), for sources that make rows one at a time."""
    batch: list[Row] = []
    for row in rows:
        batch.append(row)
        if len(batch) >= size:
            yield batch
            batch = []
    if batch:
        yield batch
