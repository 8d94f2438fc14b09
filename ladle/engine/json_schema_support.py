"""Which JSON schemas the grammar engine can enforce: refuse the rest, by keyword, before compiling.

xgrammar (the range pinned in pyproject.toml) turns a JSON schema into a grammar, but drops some keywords
without a word: the output then finishes "stop" and breaks its own schema. A grammar stricter than the
schema is fine (its outputs still validate); a laxer one is refused here, naming the keyword, where it is
and what to write instead. The deny-list is data (NEVER, the keyword groups below); each entry has its
evidence in tests/engine/test_json_schema_support.py: a compiled grammar that accepts an instance
breaking the keyword, so a new xgrammar that starts enforcing one fails that test and lifts the refusal.

Beyond the keywords never enforced, per subschema:
- `enum`/`const`, `$ref`, `anyOf`/`oneOf`/`allOf` replace the schema they sit in: beside a combinator or
  `$ref` only annotations may stand; beside `enum`/`const`, keywords every listed value meets (jsonschema).
- Without `type`, string/number/`required` keywords are ignored; with a type that excludes their kind of
  value they constrain nothing (`{"type": "integer", "maxLength": 3}` is accepted as it is).
- Pairs that drop one side: `pattern` with `minLength`/`maxLength`, `format` with `pattern`, `format` with
  a length its strings can break (FORMAT_LENGTHS). Also refused: `multipleOf` but a whole number on an
  integer, `required` naming a property not in `properties`, `allOf` of several, `oneOf` whose branches
  may overlap (engine/json_schema_oneof.py), formats outside ENFORCED_FORMATS, and regex syntax in a
  `pattern` the grammar drops (engine/regex_support.py).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from typing import Any

from ladle.engine.json_schema_oneof import one_of_problem, schema_types
from ladle.engine.regex_support import pattern_problem

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


def _node_problem(node: dict, root: Any) -> str | None:
    for key, why in NEVER.items():
        if key in node and not (key == "uniqueItems" and node[key] is False):
            return f"{key!r} is not supported: {why}"
    if isinstance(node.get("patternProperties"), dict):
        for key in node["patternProperties"]:
            if isinstance(key, str) and (problem := pattern_problem(key)):
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
        return one_of_problem(node["oneOf"], root)
    if "enum" in node or "const" in node:
        return _enum_problem(node)
    return _typed_problem(node)


def _typed_problem(node: dict) -> str | None:
    types = schema_types(node)
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
    if "string" in types and isinstance(node.get("pattern"), str) and (problem := pattern_problem(node["pattern"])):
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
