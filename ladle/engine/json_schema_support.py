"""Which JSON schemas the grammar engine can enforce: refuse the rest before compiling.

xgrammar (0.2.x) turns a JSON schema into a grammar, but some keywords it drops without a word: the
output then finishes "stop" and breaks its own schema. Each rule below was found by asking the
compiled grammar to accept an instance that violates the keyword (tests/engine/test_json_schema_support.py
keeps that evidence). A grammar stricter than the schema is fine (its outputs still validate: e.g.
xgrammar forbids properties a schema does not name); a laxer one is refused here, with the keyword,
where it is and what to write instead, as vLLM's xgrammar backend does.

The rules, per subschema:
- `enum`/`const`, `$ref`, `anyOf`/`oneOf`/`allOf` replace the schema they sit in: a constraint beside
  them is ignored. Beside a combinator or `$ref` only annotations are allowed; an `enum`/`const` may
  keep siblings when every listed value satisfies them (checked here with jsonschema).
- Without `type`, string/number/`required` constraints are ignored (`properties`/`items` imply the type).
  With a `type` that excludes their kind of value they constrain nothing (JSON Schema applies them to
  strings, numbers, objects only), so `{"type": "integer", "maxLength": 3}` is accepted as it stands.
- Not enforced at all: `uniqueItems`, `contains` (`minContains`/`maxContains` mean nothing without it),
  `dependentRequired`,
  `dependentSchemas`, `dependencies`, `not`, `if`/`then`/`else`, `$dynamicRef`; `pattern` together with
  `minLength`/`maxLength`; `format` together with `pattern`; `multipleOf` except a whole number on an
  integer; `required` naming a property not in `properties`; `allOf` of more than one schema; `oneOf`
  whose branches may overlap (it acts as `anyOf`); formats outside `ENFORCED_FORMATS`.
- `format` drops a `minLength`/`maxLength` beside it; refused only where that loses something: a
  minLength above the format's shortest string, a maxLength below its longest (FORMAT_LENGTHS; pydantic's
  AnyUrl, `"format": "uri", "minLength": 1`, loses nothing). A format of unbounded length with a
  maxLength is refused (the grammar would take longer strings).
- In a `pattern` (and a `patternProperties` key, a `propertyNames` pattern): lookarounds `(?=`, `(?!`,
  `(?<=`, `(?<!` (lookaheads are dropped with a warning, lookbehinds fail to compile), and a `^`/`$`
  that something may precede/follow in its alternative or in a repeated group (`a$b`, `^(^a)+$`: dropped
  with a warning, so "ab", "aa" pass).
  Every other construct the JSON-schema path does not take fails its compile with the reason (`\\b`,
  backreferences, `(?s)`), and the rest it enforces (`(?i)`, named groups, classes, `\\d`...). An escape it
  does not know (`\\Z`) matches the letter, as ECMA-262 (JSON Schema's regex dialect) says.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from typing import Any

# Keywords with no effect on validity (2020-12 annotations, plus OpenAPI/pydantic extras).
ANNOTATIONS = frozenset({
    "title", "description", "default", "examples", "deprecated", "readOnly", "writeOnly", "$comment",
    "$schema", "$id", "$anchor", "$vocabulary", "contentEncoding", "contentMediaType", "contentSchema",
    "discriminator", "$defs", "definitions", "nullable", "example",
})
NEVER = {
    "uniqueItems": "xgrammar does not enforce uniqueItems; drop it or check the outputs afterwards",
    "contains": "xgrammar does not enforce contains; use prefixItems or items instead",
    "dependentRequired": "xgrammar does not enforce dependentRequired; list the properties in required",
    "dependentSchemas": "xgrammar does not enforce dependentSchemas",
    "dependencies": "xgrammar does not enforce dependencies",
    "not": "xgrammar does not enforce not",
    "if": "xgrammar does not enforce if/then/else; use anyOf of the cases",
    "then": "xgrammar does not enforce if/then/else; use anyOf of the cases",
    "else": "xgrammar does not enforce if/then/else; use anyOf of the cases",
    "$dynamicRef": "xgrammar does not resolve $dynamicRef; use $ref",
    "$recursiveRef": "xgrammar does not resolve $recursiveRef; use $ref",
}
ENFORCED_FORMATS = frozenset({
    "email", "date", "date-time", "time", "duration", "uuid", "ipv4", "ipv6", "hostname", "uri",
    "uri-reference", "uri-template", "json-pointer", "relative-json-pointer",
})
# format -> (characters in its shortest string, in its longest or None: no bound) in the grammar xgrammar
# builds for it. Measured from that grammar (tests/engine/test_json_schema_support.py re-reads it): 0 where
# it takes "", the fewest characters where no escape can shorten its strings, else 1.
FORMAT_LENGTHS = {
    "email": (1, None), "date": (10, 10), "date-time": (20, None), "time": (9, None), "duration": (3, None),
    "uuid": (36, 36), "ipv4": (7, 15), "ipv6": (2, 39), "hostname": (1, None), "uri": (2, None),
    "uri-reference": (0, None), "uri-template": (0, None), "json-pointer": (0, None),
    "relative-json-pointer": (1, None),
}
STRING_KEYS = ("minLength", "maxLength", "pattern", "format")
NUMBER_KEYS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
REPLACING = ("$ref", "anyOf", "oneOf", "allOf")
# Keys that hold subschemas: a dict of them, a list of them, or one.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_ONE = ("items", "additionalProperties", "unevaluatedItems", "unevaluatedProperties", "propertyNames")


def json_schema_problem(schema: str | dict | bool) -> str | None:
    """Why the grammar engine would not enforce `schema` (naming the keyword and where it is), or None."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError:
            return None  # not JSON: the compiler's own message says so
    for path, node in _subschemas(schema, "#"):
        problem = _node_problem(node, schema)
        if problem:
            return f"json_schema at {path}: {problem}"
    return None


def _subschemas(node: Any, path: str) -> Iterator[tuple[str, dict]]:
    if not isinstance(node, dict):
        return
    yield path, node
    for key in _SCHEMA_MAPS:
        if isinstance(node.get(key), dict):
            for name, sub in node[key].items():
                yield from _subschemas(sub, f"{path}/{key}/{name}")
    for key in _SCHEMA_LISTS:
        if isinstance(node.get(key), list):
            for i, sub in enumerate(node[key]):
                yield from _subschemas(sub, f"{path}/{key}/{i}")
    for key in _SCHEMA_ONE:
        sub = node.get(key)
        if key == "propertyNames" and isinstance(sub, dict) and "type" not in sub:
            sub = {"type": "string", **sub}  # a property name is a string: its constraints apply
        yield from _subschemas(sub, f"{path}/{key}")


def _types(node: dict) -> set[str]:
    t = node.get("type")
    return {t} if isinstance(t, str) else set(t) if isinstance(t, list) else set()


def _node_problem(node: dict, root: Any) -> str | None:
    for key, why in NEVER.items():
        if key in node and not (key == "uniqueItems" and node[key] is False):
            return f"{key!r} is not supported: {why}"
    if isinstance(node.get("patternProperties"), dict):
        for key in node["patternProperties"]:
            if isinstance(key, str) and (problem := _pattern_problem(key)):
                return problem.replace("'pattern'", "'patternProperties' key", 1)
    for key in REPLACING:
        if key in node:
            extra = sorted(k for k in node if k not in ANNOTATIONS and k != key)
            if extra:
                return (f"{extra[0]!r} beside {key!r} is ignored by the grammar engine; move it into "
                        f"the {'referenced schema' if key == '$ref' else 'subschemas'}")
    if "allOf" in node and len(node["allOf"]) != 1:
        return "'allOf' of several schemas is not enforced (only the first is); merge them into one schema"
    if "oneOf" in node:
        return _one_of_problem(node["oneOf"], root)
    if "enum" in node or "const" in node:
        return _enum_problem(node)
    return _typed_problem(node)


_LOOKAROUNDS = ("(?=", "(?!", "(?<=", "(?<!")
# A group's opening: "(", "(?:", "(?>", "(?|", "(?<name>", "(?P<name>", "(?i:"; flags alone "(?i)" open none.
_GROUP_HEAD = re.compile(r"\((?:\?(?:P?<(?![=!])[^>]*>|[A-Za-z-]*:|[>|]))?")
_FLAGS = re.compile(r"\(\?[A-Za-z-]+\)")
_REPEAT = re.compile(r"\{\d+(?:,\d*)?\}")
# A repeat with spaces inside ({2, 3}): literal text to ECMA-262 (and to jsonschema), a repeat to xgrammar.
_SPACED_REPEAT = re.compile(r"\{\s*\d+\s*(?:,\s*\d*\s*)?\}")


def _pattern_problem(pattern: str) -> str | None:
    """Regex syntax xgrammar's JSON-schema path would drop without an error, leaving the grammar laxer than
    the pattern: lookarounds (a lookbehind fails to compile, refused here too for a clearer message), and an
    anchor it ignores where ignoring it loses something (`^` after, `$` before something in its branch)."""
    tokens = []  # (kind, position): "atom" (may consume characters), "open", "close", "|", "^", "$"
    # Per open group (the pattern itself first): where its first anchor is, nested groups' included;
    # `closed`: that of the group the last ")" closed. A repeat after ")" reads it: one pass, linear.
    anchors: list[int | None] = [None]
    closed: int | None = None
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "\\":
            tokens.append(("atom", i))
            i += 2
        elif c == "[":  # a class ends at the first unescaped "]", even right after "[" or "[^" (ECMA-262)
            j = i + 2 if pattern.startswith("[^", i) else i + 1
            while j < n and pattern[j] != "]":
                j += 2 if pattern[j] == "\\" else 1
            tokens.append(("atom", i))
            i = j + 1
        elif c == "(":
            look = next((x for x in _LOOKAROUNDS if pattern.startswith(x, i)), None)
            if look:
                return (f"'pattern' {pattern!r} has a lookaround {look!r} at position {i}, which the grammar "
                        f"engine does not enforce; rewrite the pattern without it")
            if flags := _FLAGS.match(pattern, i):
                i = flags.end()
                continue
            tokens.append(("open", i))
            anchors.append(None)
            i = _GROUP_HEAD.match(pattern, i).end()
        elif c == "{" and not _REPEAT.match(pattern, i) and (spaced := _SPACED_REPEAT.match(pattern, i)):
            return (f"'pattern' {pattern!r} has {spaced.group()!r} at position {i}: the grammar engine reads it as a "
                    f"repeat, JSON Schema's regex as literal text; write the repeat without spaces, or escape "
                    f"the brace (\\{{) for the text")
        elif c in "*+?" or (c == "{" and _REPEAT.match(pattern, i)):
            end = i + 1 if c in "*+?" else _REPEAT.match(pattern, i).end()
            bounds = pattern[i + 1:end - 1].split(",")
            repeats = c in "*+" or (c == "{" and (bounds[-1] == "" or int(bounds[-1]) > 1))
            # a group again after itself: its anchors are then preceded/followed by it
            if repeats and tokens and tokens[-1][0] == "close" and closed is not None:
                return (f"'pattern' {pattern!r} repeats a group holding the anchor at position {closed}, "
                        f"which the grammar engine ignores there (and would take strings the pattern "
                        f"rejects); move the anchor out of the group")
            i = end
        else:
            kind = {")": "close"}.get(c, c if c in "|^$" else "atom")
            tokens.append((kind, i))
            if kind in "^$" and anchors[-1] is None:
                anchors[-1] = i
            elif kind == "close" and len(anchors) > 1:
                closed = anchors.pop()
                if anchors[-1] is None:
                    anchors[-1] = closed
            i += 1
    swapped = {"open": "close", "close": "open"}
    for anchor, stream in (("^", tokens), ("$", [(swapped.get(k, k), at) for k, at in reversed(tokens)])):
        at = _stray_anchor(stream, anchor)
        if at is not None:
            where = "start" if anchor == "^" else "end"
            return (f"'pattern' {pattern!r} has a {anchor!r} at position {at} that is not at the {where} of the "
                    f"pattern or of an alternative; the grammar engine ignores it (and would take strings "
                    f"the pattern rejects); remove it")
    return None


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


def _typed_problem(node: dict) -> str | None:
    types = _types(node)
    # Untyped, a node admits any value and the grammar drops these keywords: laxer than the schema. Typed
    # without their kind (a maxLength on an integer), they hold for every value the type admits anyway.
    untyped = not types
    for key in STRING_KEYS:
        if key in node and untyped:
            return f"{key!r} without \"type\": \"string\" is ignored by the grammar engine; add the type"
    for key in NUMBER_KEYS:
        if key in node and untyped:
            return f"{key!r} without \"type\": \"integer\" or \"number\" is ignored; add the type"
    if "required" in node and untyped and "properties" not in node:
        return "'required' without \"type\": \"object\" is ignored by the grammar engine; add the type"
    if "string" in types and "pattern" in node and ("minLength" in node or "maxLength" in node):
        return ("'pattern' together with 'minLength'/'maxLength' drops the lengths; "
                "write the lengths into the pattern (e.g. ^[a-z]{3,8}$)")
    if "string" in types and "format" in node and "pattern" in node:
        return ("'format' together with 'pattern' drops the 'pattern'; keep only the format, or replace both "
                "by one 'pattern' that spells the format and the constraint")
    if "string" in types and node.get("format") in FORMAT_LENGTHS:
        for key in ("minLength", "maxLength"):
            if key in node and (problem := _format_length_problem(node["format"], key, node[key])):
                return problem
    if "string" in types and isinstance(node.get("pattern"), str) and (problem := _pattern_problem(node["pattern"])):
        return problem
    if "string" in types and "format" in node and node["format"] not in ENFORCED_FORMATS:
        return (f"format {node['format']!r} is not enforced; use one of {sorted(ENFORCED_FORMATS)} "
                f"or a 'pattern'")
    if "multipleOf" in node and types & {"integer", "number"}:
        m = node["multipleOf"]
        whole = isinstance(m, int) or (isinstance(m, float) and math.isfinite(m) and m.is_integer())
        if types != {"integer"} or not whole:
            return (f"'multipleOf': {m!r} is only enforced as a whole number on \"type\": \"integer\" "
                    f"(this schema has type {sorted(types)})")
    if types and "object" not in types:
        return None  # 'required' constrains objects only
    props = node.get("properties") if isinstance(node.get("properties"), dict) else {}
    for name in node.get("required") or []:
        if name not in props:
            return (f"'required' names {name!r}, which is not in 'properties' (the grammar engine "
                    f"would not produce it); add it to 'properties'")
    return None


def _format_length_problem(fmt: str, key: str, bound: Any) -> str | None:
    """The grammar of a format ignores a length beside it: refused where the format's own strings break it."""
    shortest, longest = FORMAT_LENGTHS[fmt]
    if not isinstance(bound, int) or isinstance(bound, bool):
        return None  # not an integer (36.0 too): the compile fails, saying so
    if key == "minLength" and bound <= shortest:
        return None  # the format's strings all have that many characters
    if key == "maxLength" and longest is not None and bound >= longest:
        return None
    instead = ("or replace the format by one 'pattern' that spells it with the length in a repeat "
               "(e.g. {1,2000}), without minLength/maxLength")
    if key == "minLength":
        return (f"format {fmt!r} drops 'minLength': {bound!r} (its shortest strings have {shortest} characters); "
                f"drop minLength or lower it to {shortest}, {instead}")
    if longest is None:
        return (f"format {fmt!r} drops 'maxLength': {bound!r} (a {fmt} may be any length, so longer strings "
                f"would pass); drop maxLength and check lengths afterwards, {instead}")
    return (f"format {fmt!r} drops 'maxLength': {bound!r} (its strings have up to {longest} characters); "
            f"drop maxLength or raise it to {longest}, {instead}")


def _enum_problem(node: dict) -> str | None:
    """enum/const replace the node: its other constraints hold only if every listed value meets them."""
    rest = {k: v for k, v in node.items() if k not in ("enum", "const") and k not in ANNOTATIONS}
    if not rest:
        return None
    import jsonschema

    values = [node["const"]] if "const" in node else list(node.get("enum") or [])
    check = jsonschema.Draft202012Validator(rest)
    for value in values:
        if not check.is_valid(value):
            key = "const" if "const" in node else "enum"
            return (f"{key} value {value!r} breaks the keywords beside it ({sorted(rest)}), which the "
                    f"grammar engine ignores; remove the value or the keywords")
    return None


def _one_of_problem(branches: list, root: Any) -> str | None:
    """oneOf is enforced as anyOf: sound only when no value can match two branches."""
    resolved = [_resolve(b, root) for b in branches]
    for i in range(len(resolved)):
        for j in range(i + 1, len(resolved)):
            if not _disjoint(resolved[i], resolved[j]):
                return (f"'oneOf' branches {i} and {j} may both match a value, and the grammar engine "
                        f"enforces oneOf as anyOf; use 'anyOf', or make the branches disjoint (different "
                        f"types, or a required property with a different 'const' in each)")
    return None


def _resolve(node: Any, root: Any, depth: int = 0) -> Any:
    """Follow a local $ref ("#/$defs/x", "#/definitions/x"); anything else is returned as it is."""
    while isinstance(node, dict) and isinstance(node.get("$ref"), str) and node["$ref"].startswith("#/") and depth < 32:
        target: Any = root
        for part in node["$ref"][2:].split("/"):
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(target, dict) or part not in target:
                return node
            target = target[part]
        node, depth = target, depth + 1
    return node


def _value_types(node: Any) -> set[str] | None:
    """The JSON types a branch admits (integer counted as number too); None when it admits any."""
    if not isinstance(node, dict):
        return None
    if "const" in node or "enum" in node:
        values = [node["const"]] if "const" in node else list(node.get("enum") or [])
        return {_type_of(v) for v in values} | ({"number"} if any(_type_of(v) == "integer" for v in values) else set())
    types = _types(node)
    if not types:
        return None
    return types | ({"integer"} if "number" in types else set()) | ({"number"} if "integer" in types else set())


def _type_of(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
        return "integer"
    return {float: "number", str: "string", list: "array", dict: "object"}.get(type(value), "unknown")


def _disjoint(a: Any, b: Any) -> bool:
    ta, tb = _value_types(a), _value_types(b)
    if ta is not None and tb is not None and not ta & tb:
        return True
    if _const_values(a) and _const_values(b):  # e.g. {"const": 1} vs {"enum": [2, 3]}
        return not _const_values(a) & _const_values(b)
    return _discriminated(a, b)


def _const_values(node: Any) -> set[str]:
    if not isinstance(node, dict):
        return set()
    values = [node["const"]] if "const" in node else node.get("enum") if isinstance(node.get("enum"), list) else []
    return {json.dumps(_canonical(v), sort_keys=True) for v in values}


def _canonical(value: Any) -> Any:
    """JSON Schema equality: 1 and 1.0 are the same value."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list):
        return [_canonical(v) for v in value]
    if isinstance(value, dict):
        return {k: _canonical(v) for k, v in value.items()}
    return value


def _discriminated(a: Any, b: Any) -> bool:
    """Two object branches with a property required in both whose const/enum values do not meet."""
    if not (isinstance(a, dict) and isinstance(b, dict)):
        return False
    pa, pb = a.get("properties") or {}, b.get("properties") or {}
    shared = set(a.get("required") or []) & set(b.get("required") or [])
    return any(
        _const_values(pa.get(k)) and _const_values(pb.get(k)) and not _const_values(pa[k]) & _const_values(pb[k])
        for k in shared
    )
