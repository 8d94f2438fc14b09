"""The one rule for text that enters the job: every string a sink writes is valid UTF-8 by construction.

A Python string can hold code points UTF-8 cannot encode: lone surrogates (U+D800-U+DFFF), which
valid JSON makes from `"\\ud800"`. Such a string kills whatever encodes it (the tokenizer, pyarrow
writing a row group, the batch output file). So every string a source yields is passed through
`clean` where it enters (runner/sources/base.py, for every kind), and the sinks clean again as a last
line of defence: each code point UTF-8 cannot encode becomes U+FFFD (the replacement character), one
for one. Everything else is kept as it is: NUL, non-characters (U+FFFE), astral characters.

Bytes that are not UTF-8 (an Arrow string column holding invalid bytes) are decoded the same way,
each invalid byte becoming U+FFFD (Python's `errors="replace"`).

A row's JSON text (a JSONL line, an openai_batch line, a json_schema or choice cell) is parsed by one
function, `load_json`: a value nested deeper than MAX_JSON_DEPTH is that row's error (`TooDeep`, a
ValueError), never a RecursionError that stops the job here or in a walk further on.
"""

from __future__ import annotations

import json
import re
from array import array
from itertools import chain
from typing import Any

REPLACEMENT = "\ufffd"
_UNENCODABLE = re.compile("[\ud800-\udfff]")
_SCALARS = (int, float, bool, type(None))

# Levels of arrays and objects inside each other a row's JSON value may have. Real rows nest a few
# (chat messages 3, a JSON schema tens); the cap keeps the recursive walks a value meets later (the
# engine's schema checks and its copy of the sampling params, ~2 frames a level; the grammar compiler)
# far inside Python's stack: 1000 frames, of which a ~500-level schema already takes them all.
MAX_JSON_DEPTH = 128


class TooDeep(ValueError):
    """A row's JSON value nests deeper than MAX_JSON_DEPTH (or than the parser's stack allows)."""

    def __init__(self) -> None:
        super().__init__(f"nested too deeply: more than {MAX_JSON_DEPTH} levels of arrays and objects inside each "
                         f"other (ladle's limit for a row's JSON value); flatten the value")


def load_json(text: str | bytes, whole: bool = True) -> Any:
    """`json.loads(text)` for JSON that comes from a row: raises TooDeep (a ValueError) for a value
    nested deeper than MAX_JSON_DEPTH, ValueError for text that is not JSON. whole=False: the cap is
    left to the caller, for the parts it uses (a JSONL line's other keys may nest as they like); only
    a value past the parser's own stack is TooDeep then."""
    try:
        value = json.loads(text)
    except RecursionError:  # deeper than the C parser's stack: far past the cap
        raise TooDeep() from None
    brackets = ("[", "{") if isinstance(text, str) else (b"[", b"{")
    # only with this many brackets can it nest that deep: walk it then (most rows never are)
    if whole and sum(text.count(b) for b in brackets) > MAX_JSON_DEPTH:
        check_depth(value)
    return value


def check_depth(value: Any) -> None:
    """Raise TooDeep if `value` (lists, tuples, dicts) nests deeper than MAX_JSON_DEPTH (iterative)."""
    stack = [(value, 1)] if isinstance(value, (dict, list, tuple)) else []
    while stack:
        node, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise TooDeep()
        items = node.values() if isinstance(node, dict) else node
        stack.extend((x, depth + 1) for x in items if isinstance(x, (dict, list, tuple)))


def clean_str(s: str) -> str:
    """`s` with every code point UTF-8 cannot encode replaced by U+FFFD."""
    if s.isascii():
        return s
    return _UNENCODABLE.sub(REPLACEMENT, s)


def clean(value: Any) -> Any:
    """`value` with `clean_str` applied to every string in it, dict keys and nested lists included
    (other values are returned as they are; a value without a bad string is returned unchanged).

    Iterative, not recursive: a row's value may be nested as deeply as its JSON parser allowed, and
    a walk one Python frame per level would stop the job with a RecursionError."""
    if isinstance(value, str):
        return clean_str(value)
    if not _is_container(value):
        return value
    done: list[Any] = []  # the cleaned top value, once built
    stack = [_Frame(value)]
    while stack:
        frame = stack[-1]
        for item in frame.items:
            if type(item) in _SCALARS:
                frame.out.append(item)
            elif isinstance(item, str):
                frame.out.append(clean_str(item))
            elif _is_container(item):
                stack.append(_Frame(item))  # cleaned first; this frame's items resume after it
                break
            else:
                frame.out.append(item)
        else:
            stack.pop()
            (stack[-1].out if stack else done).append(frame.build())
    return done[0]


def _is_container(value: Any) -> bool:
    """A dict, or a list / tuple that may hold text (a prompt of token ids is kept as it is)."""
    return isinstance(value, dict) or (isinstance(value, (list, tuple)) and not _all_ints(value))


class _Frame:
    """One container being cleaned: its items in order (a dict's keys and values alternating), and
    the cleaned ones so far."""

    __slots__ = ("items", "out", "source")

    def __init__(self, source: dict | list | tuple) -> None:
        self.source = source
        self.items = iter(chain.from_iterable(source.items()) if isinstance(source, dict) else source)
        self.out: list[Any] = []

    def build(self) -> Any:
        if isinstance(self.source, dict):
            return dict(zip(self.out[::2], self.out[1::2], strict=True))
        return self.out if isinstance(self.source, list) else tuple(self.out)


def _all_ints(values: list | tuple) -> bool:
    """Whether every item is an int, checked at C speed (array raises on any other item)."""
    try:
        array("q", values)
    except (TypeError, OverflowError):
        return False
    return True
