"""The one rule for text that enters the job: every string a sink writes is valid UTF-8 by construction.

A Python string can hold code points UTF-8 cannot encode: lone surrogates (U+D800-U+DFFF), which
valid JSON makes from `"\\ud800"`. Such a string kills whatever encodes it (the tokenizer, pyarrow
writing a row group, the batch output file). So every string a source yields is passed through
`clean` where it enters (runner/sources/base.py, for every kind), and the sinks clean again as a last
line of defence: each code point UTF-8 cannot encode becomes U+FFFD (the replacement character), one
for one. Everything else is kept as it is: NUL, non-characters (U+FFFE), astral characters.

Bytes that are not UTF-8 (an Arrow string column holding invalid bytes) are decoded the same way,
each invalid byte becoming U+FFFD (Python's `errors="replace"`).
"""

from __future__ import annotations

import re
from array import array
from typing import Any

REPLACEMENT = "\ufffd"
_UNENCODABLE = re.compile("[\ud800-\udfff]")
_SCALARS = (int, float, bool, type(None))


def clean_str(s: str) -> str:
    """`s` with every code point UTF-8 cannot encode replaced by U+FFFD."""
    if s.isascii():
        return s
    return _UNENCODABLE.sub(REPLACEMENT, s)


def clean(value: Any) -> Any:
    """`value` with `clean_str` applied to every string in it, dict keys and nested lists included
    (other values are returned as they are; a value without a bad string is returned unchanged)."""
    if isinstance(value, str):
        return clean_str(value)
    if isinstance(value, dict):
        return {clean(k): clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        if _all_ints(value):  # a prompt of token ids: a long list with no text in it
            return value
        items = [v if type(v) in _SCALARS else clean(v) for v in value]
        return items if isinstance(value, list) else tuple(items)
    return value


def _all_ints(values: list | tuple) -> bool:
    """Whether every item is an int, checked at C speed (array raises on any other item)."""
    try:
        array("q", values)
    except (TypeError, OverflowError):
        return False
    return True
