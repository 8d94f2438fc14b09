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
  `minLength`/`maxLength`; `format` together with `pattern`, `minLength` or `maxLength`; regex syntax its
  regex parser refuses (lookahead, lookbehind) in a `pattern` or a `patternProperties` key; `multipleOf` except a whole number on an integer; `required` naming a
  property not in `properties`; `allOf` of more than one schema; `oneOf` whose branches may overlap
  (it acts as `anyOf`); formats outside `ENFORCED_FORMATS`.
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


def _pattern_problem(pattern: str) -> str | None:
    """Regex syntax the grammar engine would ignore inside a schema (lookarounds: it logs a warning and
    drops them, so the grammar is laxer than the pattern) but refuses as a regex: ask its regex parser."""
    try:
        import xgrammar as xgr
    except ImportError:
        return None  # structured output then fails as a whole, with the install hint
    try:
        xgr.Grammar.from_regex(pattern)
    except Exception as exc:  # noqa: BLE001 - the parser's reason is the message
        reason = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", str(exc).strip()).splitlines()[0]
        return f"'pattern' {pattern!r} is not enforced by the grammar engine ({reason}); rewrite it without that"
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
    if "string" in types and "format" in node and (dropped := [k for k in ("pattern", "minLength", "maxLength")
                                                            if k in node]):
        return (f"'format' together with {dropped[0]!r} drops the {dropped[0]!r}; keep only the format, or "
                f"replace both by one 'pattern' that spells the format and the constraint")
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
