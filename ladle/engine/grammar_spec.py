"""A structured-output spec (json_schema, regex, choice or grammar) as xgrammar reads it: which field is
set, its cache key, its text, and whether it parses. No tokenizer is needed, so a config-wide spec is
checked before the model loads (runner/config.py) and the engine keys its compile cache here
(engine/structured_output.py)."""

from __future__ import annotations

import json
import re
from typing import Any

from ladle.engine.grammar_vocab import VocabularyError
from ladle.engine.json_schema_support import json_schema_problem
from ladle.engine.sampling_params import StructuredOutputs

INSTALL_HINT = "structured output needs xgrammar: pip install 'ladle[structured]'"


def spec_of(so: StructuredOutputs) -> tuple[str, Any]:
    """(kind, value) of the one field set (SamplingParams.problems() has checked there is exactly one)."""
    for kind in ("json_schema", "regex", "choice", "grammar"):
        value = getattr(so, kind)
        if value is not None:
            return kind, value
    raise ValueError("StructuredOutputs has no field set")


def cache_key(so: StructuredOutputs) -> str:
    """The spec as canonical JSON: equal specs (a schema as dict or as text, any key order) share a compile."""
    kind, value = spec_of(so)
    if kind == "json_schema" and isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            pass  # not JSON: compiling it reports the error; key on the raw text
    return json.dumps([kind, value], sort_keys=True, ensure_ascii=False)


def choice_grammar(choices: list[str]) -> str:
    """An EBNF alternation of the literal strings. JSON string quoting is also xgrammar's EBNF literal
    syntax (backslash, quote, control characters escaped; other characters, unicode included, as is)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in dict.fromkeys(choices))


def compile_error(kind: str, exc: BaseException) -> str:
    """'json_schema is not valid: <the compiler's reason>' without the C++ file/line prefix."""
    if isinstance(exc, VocabularyError):
        return f"structured output is not available for this model's tokenizer: {exc}"
    text = str(exc).strip()
    text = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", text)
    text = re.sub(r"^Check failed: \(.*?\) is false: ", "", text)
    text = text.splitlines()[0] if text else type(exc).__name__
    return f"{kind} is not valid: {text}"


def schema_text(schema: Any) -> str:
    """A json_schema as the text the compiler reads: as it is when text, else its JSON (a dict's int keys
    become strings, tuples lists). The one rule for the compile, the config check and the request's own
    copy of its params (engine/input_processor.own_copy), so all three judge the same schema. Raises
    TypeError / ValueError / RecursionError for a value JSON cannot write."""
    return schema if isinstance(schema, str) else json.dumps(schema)


def spec_error(so: StructuredOutputs) -> str | None:
    """Why the spec cannot compile, found by parsing it without a tokenizer (cheap: no model needed, so
    a config-wide spec is checked before the model loads); None when it parses."""
    try:
        import xgrammar as xgr
    except ImportError:
        return INSTALL_HINT
    kind, value = spec_of(so)
    if kind == "json_schema":
        try:
            value = schema_text(value)
        except (TypeError, ValueError, RecursionError) as exc:
            return f"json_schema cannot be written as JSON ({type(exc).__name__}: {exc}); give it as JSON text"
    if kind == "json_schema" and (problem := json_schema_problem(value)):
        return problem
    try:
        if kind == "json_schema":
            xgr.Grammar.from_json_schema(value, any_whitespace=False)
        elif kind == "regex":
            xgr.Grammar.from_regex(value)
        else:
            xgr.Grammar.from_ebnf(choice_grammar(list(value)) if kind == "choice" else value)
    except Exception as exc:  # noqa: BLE001 - the parser's message is the answer
        return compile_error(kind, exc)
    return None
