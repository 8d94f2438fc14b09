"""When a JSON schema's `oneOf` is safe to enforce as `anyOf` (which is what xgrammar does): no value can
match two of its branches, because their types differ, their const/enum values differ, or a property
both require has const/enum values that differ (a discriminator)."""

from __future__ import annotations

import json
from typing import Any


def schema_types(node: dict) -> set[str]:
    t = node.get("type")
    return {t} if isinstance(t, str) else set(t) if isinstance(t, list) else set()


def one_of_problem(branches: list, root: Any) -> str | None:
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
    types = schema_types(node)
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
