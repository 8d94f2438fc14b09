"""Which `pattern` regexes xgrammar's JSON-schema path enforces as JSON Schema means them: refuse the rest.

That path drops some regex syntax with no more than a log line, leaving the grammar laxer than the pattern
(tests/engine/test_json_schema_support.py holds, per construct, a string the grammar takes and the pattern
rejects): lookarounds `(?=`, `(?!` (a lookbehind `(?<=`, `(?<!` fails its compile; refused here too, for a
clearer message), a `^`/`$` that something may precede/follow in its alternative or in a repeated group
(`a$b`, `^(^a)+$`), and a repeat written with spaces (`{2, 3}`: literal text to ECMA-262). The log line
cannot replace this scan: xgrammar logs it for anchors it enforces correctly too (`^a$|^b$`).
Every other construct it does not take fails its compile with the reason (`\\b`, backreferences, `(?s)`).
"""

from __future__ import annotations

import re

_LOOKAROUNDS = ("(?=", "(?!", "(?<=", "(?<!")
# A group's opening: "(", "(?:", "(?>", "(?|", "(?<name>", "(?P<name>", "(?i:"; flags alone "(?i)" open none.
_GROUP_HEAD = re.compile(r"\((?:\?(?:P?<(?![=!])[^>]*>|[A-Za-z-]*:|[>|]))?")
_FLAGS = re.compile(r"\(\?[A-Za-z-]+\)")
_REPEAT = re.compile(r"\{\d+(?:,\d*)?\}")
# A repeat with spaces inside ({2, 3}): literal text to ECMA-262 (and to jsonschema), a repeat to xgrammar.
_SPACED_REPEAT = re.compile(r"\{\s*\d+\s*(?:,\s*\d*\s*)?\}")


class _Unenforced(Exception):
    """A construct of the pattern the grammar would not enforce (the message names it)."""


def pattern_problem(pattern: str) -> str | None:
    """Why xgrammar's JSON-schema path would enforce `pattern` more laxly than JSON Schema does, or None."""
    try:
        tokens = _Scan(pattern).tokens()
    except _Unenforced as exc:
        return f"'pattern' {pattern!r} {exc}"
    swapped = {"open": "close", "close": "open"}
    for anchor, stream in (("^", tokens), ("$", [(swapped.get(k, k), at) for k, at in reversed(tokens)])):
        at = _stray_anchor(stream, anchor)
        if at is not None:
            where = "start" if anchor == "^" else "end"
            return (f"'pattern' {pattern!r} has a {anchor!r} at position {at} that is not at the {where} of the "
                    f"pattern or of an alternative; the grammar engine ignores it (and would take strings "
                    f"the pattern rejects); remove it")
    return None


class _Scan:
    """One left-to-right pass over a pattern (linear: deep nesting stays cheap). It yields the tokens the
    anchor check reads, (kind, position) with kind "atom" (may consume characters), "open", "close", "|",
    "^" or "$", and raises _Unenforced at a lookaround, a spaced repeat, or a repeated group holding an
    anchor."""

    def __init__(self, pattern: str):
        self.pattern = pattern
        self.out: list[tuple[str, int]] = []
        # Per open group (the pattern itself first): where its first anchor is, nested groups' included;
        # `closed`: that of the group the last ")" closed, which a repeat right after it reads.
        self.anchors: list[int | None] = [None]
        self.closed: int | None = None

    def tokens(self) -> list[tuple[str, int]]:
        p, i = self.pattern, 0
        while i < len(p):
            c = p[i]
            if c == "\\":
                self.out.append(("atom", i))
                i += 2
            elif c == "[":
                self.out.append(("atom", i))
                i = _class_end(p, i)
            elif c == "(":
                i = self._group(i)
            elif c in "*+?" or (c == "{" and _REPEAT.match(p, i)):
                i = self._repeat(i)
            elif c == "{" and (spaced := _SPACED_REPEAT.match(p, i)):
                raise _Unenforced(f"has {spaced.group()!r} at position {i}: the grammar engine reads it as a repeat, "
                                  f"JSON Schema's regex as literal text; write the repeat without spaces, or escape "
                                  f"the brace (\\{{) for the text")
            else:
                self._plain(c, i)
                i += 1
        return self.out

    def _group(self, i: int) -> int:
        look = next((x for x in _LOOKAROUNDS if self.pattern.startswith(x, i)), None)
        if look:
            raise _Unenforced(f"has a lookaround {look!r} at position {i}, which the grammar engine does not "
                              f"enforce; rewrite the pattern without it")
        if flags := _FLAGS.match(self.pattern, i):
            return flags.end()
        self.out.append(("open", i))
        self.anchors.append(None)
        return _GROUP_HEAD.match(self.pattern, i).end()

    def _repeat(self, i: int) -> int:
        c = self.pattern[i]
        end = i + 1 if c in "*+?" else _REPEAT.match(self.pattern, i).end()
        bounds = self.pattern[i + 1:end - 1].split(",")
        repeats = c in "*+" or (c == "{" and (bounds[-1] == "" or int(bounds[-1]) > 1))
        # a group again after itself: its anchors are then preceded/followed by it
        if repeats and self.out and self.out[-1][0] == "close" and self.closed is not None:
            raise _Unenforced(f"repeats a group holding the anchor at position {self.closed}, which the grammar "
                              f"engine ignores there (and would take strings the pattern rejects); move the "
                              f"anchor out of the group")
        return end

    def _plain(self, c: str, i: int) -> None:
        kind = "close" if c == ")" else c if c in "|^$" else "atom"
        self.out.append((kind, i))
        if kind in "^$" and self.anchors[-1] is None:
            self.anchors[-1] = i
        elif kind == "close" and len(self.anchors) > 1:
            self.closed = self.anchors.pop()
            if self.anchors[-1] is None:
                self.anchors[-1] = self.closed


def _class_end(pattern: str, i: int) -> int:
    """The index after a class "[...]": it ends at the first unescaped "]", even right after "[" or "[^"
    (ECMA-262)."""
    j = i + 2 if pattern.startswith("[^", i) else i + 1
    while j < len(pattern) and pattern[j] != "]":
        j += 2 if pattern[j] == "\\" else 1
    return j + 1


def _stray_anchor(tokens: list[tuple[str, int]], anchor: str) -> int | None:
    """Where `anchor` follows, in its own branch, something that may consume characters (for "$", the
    tokens come reversed). Ignoring such an anchor makes the grammar laxer; elsewhere it only restates
    the whole-string match the grammar enforces anyway."""
    stack = [[False, False, False]]  # per open group: consumed before it, consumed in this branch, consumes
    for kind, at in tokens:
        frame = stack[-1]
        if kind == "atom":
            frame[1] = frame[2] = True
        elif kind == "open":
            stack.append([frame[1], frame[1], False])
        elif kind == "|":
            frame[1] = frame[0]
        elif kind == "close" and len(stack) > 1:
            stack.pop()
            stack[-1][1] = stack[-1][1] or frame[2]
            stack[-1][2] = stack[-1][2] or frame[2]
        elif kind == anchor and frame[1]:
            return at
    return None
