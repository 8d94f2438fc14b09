"""Every JSON Schema 2020-12 keyword a user may write is either enforced by the grammar (a violating
instance is rejected by the compiled grammar, and sampled outputs validate with jsonschema) or refused
before compiling with a message that names it. The refusals carry their evidence: the grammar accepts
an instance that breaks the keyword."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import jsonschema
import pytest
import xgrammar as xgr
import yaml

from ladle.engine import CacheConfig, ChunkingConfig, EngineConfig, LLMEngine, ModelConfig, SamplingParams
from ladle.engine.json_schema_support import ENFORCED_FORMATS, FORMAT_LENGTHS, NEVER, json_schema_problem
from ladle.engine.sampling_params import StructuredOutputs
from tests.engine.helpers import random_prompt, run_to_completion

TINY = yaml.safe_load((Path(__file__).parents[2] / "ladle" / "conf" / "model" / "tiny.yaml").read_text())
OBJ_A = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}


def grammar_accepts(schema: dict | bool, instance) -> bool:
    grammar = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
    return xgr.testing._is_grammar_accept_string(grammar, json.dumps(instance))


def valid(schema, instance) -> bool:
    """jsonschema's verdict under the schema's own draft ($schema; 2020-12 when it names none)."""
    draft = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    return draft(schema, format_checker=draft.FORMAT_CHECKER).is_valid(instance)


# keyword -> (schema, an instance that violates it but that the grammar accepts)
REFUSED = {
    "uniqueItems": ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, [1, 1]),
    "contains": ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 1}}, [2]),
    "dependentRequired": ({**OBJ_A, "dependentRequired": {"a": ["b"]}}, {"a": 1}),
    "dependentSchemas": ({**OBJ_A, "dependentSchemas": {"a": {"required": ["b"]}}}, {"a": 1}),
    "not": ({"type": "integer", "not": {"const": 3}}, 3),
    "if": ({"type": "integer", "if": {"minimum": 5}, "then": {"maximum": 5}}, 6),
    "else": ({"type": "integer", "if": {"minimum": 5}, "then": {"maximum": 5}, "else": {"const": 0}}, 3),
    "dependencies": ({"$schema": "http://json-schema.org/draft-07/schema#", **OBJ_A, "dependencies": {"a": ["b"]}},
                     {"a": 1}),
    "$dynamicRef": ({"$defs": {"n": {"$dynamicAnchor": "n", "type": "integer", "minimum": 3}}, "type": "object",
                     "properties": {"x": {"$dynamicRef": "#n"}}}, {"x": 1}),
    "$recursiveRef": ({"$schema": "https://json-schema.org/draft/2019-09/schema", "type": "object",
                       "properties": {"c": {"$recursiveRef": "#"}}, "additionalProperties": False}, {"c": {"x": 1}}),
    "allOf": ({"allOf": [{"type": "integer"}, {"type": "integer", "minimum": 3}]}, 2),
    "oneOf": ({"oneOf": [{"type": "integer"}, {"type": "integer", "minimum": 0}]}, 1),
    "$ref": ({"$defs": {"p": {"type": "integer"}}, "$ref": "#/$defs/p", "minimum": 3}, 1),
    "'pattern' together with 'minLength'": ({"type": "string", "pattern": "^[a-z]+$", "minLength": 3}, "ab"),
    "'pattern' together with 'minLength'/'maxLength'": (
        {"type": "string", "pattern": "^[a-z]+$", "maxLength": 2}, "abc"),
    "'required' names 'b'": ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["b"]},
                             {"a": 1}),
    "multipleOf": ({"type": "number", "multipleOf": 0.5}, 1.25),
    "'multipleOf': 2.5": ({"type": "integer", "multipleOf": 2.5}, 3),
    "format 'idn-email'": ({"type": "string", "format": "idn-email"}, "x"),
    "format 'regex'": ({"type": "string", "format": "regex"}, "("),
    "'minimum' without": ({"minimum": 3}, 2),
    "'minLength' without": ({"minLength": 3}, "ab"),
    "'required' without": ({"required": ["a"]}, {}),
    "enum value 'a'": ({"type": "string", "enum": ["a", "bb"], "minLength": 2}, "a"),
    "const value 'abc'": ({"const": "abc", "maxLength": 1}, "abc"),
    "'minimum' beside 'anyOf'": ({"anyOf": [{"type": "integer"}], "minimum": 3}, 1),
    # a format's grammar drops the lengths beside it: refused where the format's own strings break them
    "format 'date' drops 'maxLength': 5": ({"type": "string", "format": "date", "maxLength": 5}, "2024-01-01"),
    "format 'date' drops 'minLength': 11": ({"type": "string", "format": "date", "minLength": 11}, "2024-01-01"),
    "format 'ipv4' drops 'maxLength': 14": ({"type": "string", "format": "ipv4", "maxLength": 14}, "255.255.255.255"),
    "format 'uri' drops 'minLength': 3": ({"type": "string", "format": "uri", "minLength": 3}, "a:"),
    "format 'email' drops 'minLength': 4": ({"type": "string", "format": "email", "minLength": 4}, "a@b"),
    # pydantic's HttpUrl: a uri has no length bound in the grammar, so the maxLength is lost
    "format 'uri' drops 'maxLength': 2083": ({"type": "string", "format": "uri", "minLength": 1, "maxLength": 2083},
                                             "https://example.com/" + "a" * 2083),
    "'format' together with 'pattern'": ({"type": "string", "format": "date", "pattern": "^1999-"}, "2024-01-01"),
    # lookaheads are dropped with a warning; anchors the grammar ignores where something precedes/follows them
    "lookaround '(?!' at position 1": ({"type": "string", "pattern": "^(?!x)[a-z]+$"}, "xyz"),
    "lookaround '(?=' at position 1": ({"type": "string", "pattern": "x(?=a)"}, "x"),
    "lookaround '(?!' at position 3": ({"type": "string", "pattern": r"^\)(?!a)[a-z]$"}, ")a"),
    "'patternProperties' key": ({"type": "object", "patternProperties": {"^(?!x)[a-z]+$": {"type": "integer"}},
                                 "additionalProperties": False}, {"xa": 1}),
    "#/propertyNames: 'pattern' '^(?!x)[a-z]+$' has a lookaround": (
        {"type": "object", "propertyNames": {"pattern": "^(?!x)[a-z]+$"}}, {"xa": 1}),
    "'$' at position 1": ({"type": "string", "pattern": "a$b"}, "ab"),
    "'^' at position 2": ({"type": "string", "pattern": "a?^b"}, "ab"),
    "'$' at position 3": ({"type": "string", "pattern": "^(a$|b)c$"}, "ac"),
    "repeats a group holding the anchor at position 2": ({"type": "string", "pattern": "^(^a)+$"}, "aa"),
    "repeats a group holding the anchor at position 5": ({"type": "string", "pattern": "^(?:a$){2}"}, "aa"),
    "reads it as a repeat": ({"type": "string", "pattern": "^a{2, 3}$"}, "aa"),  # literal text to JSON Schema
}


@pytest.mark.parametrize("keyword", sorted(REFUSED))
def test_unenforced_keywords_are_refused_by_name(keyword):
    schema, violating = REFUSED[keyword]
    assert not valid(schema, violating)
    # the evidence: left to the grammar engine, this violating value would finish "stop"
    assert grammar_accepts(schema, violating), f"xgrammar now enforces {keyword}: lift the refusal"
    problem = json_schema_problem(schema)
    assert problem is not None and keyword.split(" without")[0].split(" beside")[0] in problem, problem
    assert json_schema_problem(json.dumps(schema)) == problem  # a JSON string is read the same way


def test_every_keyword_on_the_deny_list_has_its_evidence():
    """NEVER is the deny-list: each keyword on it is refused above with a grammar that lets a violation
    through (`then` goes with `if`/`else`: alone it means nothing to JSON Schema either)."""
    assert set(NEVER) - {"then"} <= set(REFUSED)


# keyword -> (schema, an instance the grammar must reject, an instance it must accept)
ENFORCED = {
    "type": ({"type": "integer"}, "1", 1),
    "type list": ({"type": ["integer", "null"]}, "a", None),
    "enum": ({"enum": ["red", "green", 3]}, "blue", 3),
    "const": ({"const": "abc"}, "abd", "abc"),
    "enum beside keywords it meets": ({"type": "string", "enum": ["ab", "cd"], "minLength": 2}, "a", "cd"),
    "minLength": ({"type": "string", "minLength": 3}, "ab", "abc"),
    "maxLength": ({"type": "string", "maxLength": 2}, "abc", "ab"),
    "pattern": ({"type": "string", "pattern": "^[a-z]{3,5}$"}, "ab", "abcd"),
    # regex syntax the JSON-schema path takes exactly (its own regex front end, not Grammar.from_regex's)
    "pattern (?i)": ({"type": "string", "pattern": "(?i)^[a-f0-9]{4}$"}, "abz1", "AB12"),
    "pattern named group": ({"type": "string", "pattern": r"^(?P<year>\d{4})-\d{2}$"}, "24-01", "2024-01"),
    "pattern escaped (?=": ({"type": "string", "pattern": r"^\(?=a$"}, "a", "(=a"),
    "pattern (?= in a class": ({"type": "string", "pattern": "^[(?=]x$"}, "x", "(x"),
    "pattern anchored alternatives": ({"type": "string", "pattern": "^a$|^b$"}, "ab", "b"),
    "pattern anchors in a group": ({"type": "string", "pattern": "(^(?:a|b)$)"}, "ab", "a"),
    "pattern ^ and $ in a class": ({"type": "string", "pattern": "^[$^]x$"}, "x", "$x"),
    "pattern escaped $": ({"type": "string", "pattern": r"^a\$b$"}, "ab", "a$b"),
    "pattern optional group holding ^": ({"type": "string", "pattern": "^(?:^a)?b$"}, "aab", "ab"),
    "format email": ({"type": "string", "format": "email"}, "not an email", "a@b.co"),
    "format date": ({"type": "string", "format": "date"}, "2024-13-45x", "2024-01-02"),
    "format uuid": ({"type": "string", "format": "uuid"}, "x", "123e4567-e89b-12d3-a456-426614174000"),
    "format ipv4": ({"type": "string", "format": "ipv4"}, "1.2.3", "1.2.3.4"),
    "minimum": ({"type": "integer", "minimum": 5}, 4, 5),
    "maximum": ({"type": "number", "maximum": 1.5}, 1.75, 1.5),
    "exclusiveMinimum": ({"type": "number", "exclusiveMinimum": 0}, 0, 0.5),
    "exclusiveMaximum": ({"type": "integer", "exclusiveMaximum": 5}, 5, 4),
    "multipleOf (integer)": ({"type": "integer", "multipleOf": 3}, 7, 6),
    "items": ({"type": "array", "items": {"type": "integer"}}, ["x"], [1, 2]),
    "prefixItems": ({"type": "array", "prefixItems": [{"type": "integer"}], "items": False}, ["a"], [1]),
    "minItems": ({"type": "array", "items": {"type": "integer"}, "minItems": 2}, [1], [1, 2]),
    "maxItems": ({"type": "array", "items": {"type": "integer"}, "maxItems": 1}, [1, 2], [1]),
    "unevaluatedItems": ({"type": "array", "prefixItems": [{"type": "integer"}], "unevaluatedItems": False},
                         [1, 2], [1]),
    "properties": (OBJ_A, {"a": "x"}, {"a": 1}),
    "required": ({**OBJ_A, "required": ["a"]}, {"b": 1}, {"a": 1}),
    "additionalProperties": ({**OBJ_A, "additionalProperties": False}, {"a": 1, "c": 2}, {"a": 1}),
    "additionalProperties schema": ({"type": "object", "additionalProperties": {"type": "integer"}},
                                    {"k": "x"}, {"k": 1}),
    "propertyNames": ({"type": "object", "propertyNames": {"pattern": "^[a-z]+$"}}, {"A": 1}, {"ab": 1}),
    "unevaluatedProperties": ({**OBJ_A, "unevaluatedProperties": False}, {"a": 1, "c": 2}, {"a": 1}),
    "anyOf": ({"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 1}]}, "ab", 1),
    "oneOf disjoint types": ({"oneOf": [{"type": "integer"}, {"type": "string"}]}, None, "x"),
    "oneOf discriminated": ({"oneOf": [
        {"type": "object", "properties": {"k": {"const": "a"}, "x": {"type": "integer"}}, "required": ["k", "x"]},
        {"type": "object", "properties": {"k": {"const": "b"}}, "required": ["k"]}]}, {"k": "c"}, {"k": "b"}),
    "allOf of one": ({"allOf": [{"type": "integer", "minimum": 3}]}, 2, 3),
    "$ref": ({"$defs": {"p": {"type": "integer", "minimum": 3}}, "$ref": "#/$defs/p", "description": "d"}, 2, 3),
    # A keyword for another kind of value than the type admits constrains nothing: accepted, not refused.
    "maxLength on an integer": ({"type": "integer", "maxLength": 2}, "ab", 123456),
    "maxLength on null": ({"type": "null", "maxLength": 1}, "a", None),
    "minimum on a string": ({"type": "string", "minimum": 3}, 1, "x"),
    "required on an integer": ({"type": "integer", "required": ["a"]}, {"a": 1}, 5),
    "format on an integer": ({"type": "integer", "format": "int32"}, "x", 7),
    "minContains without contains": ({"type": "array", "items": {"type": "integer"}, "minContains": 0}, ["x"], [1]),
    "annotations": ({"type": "integer", "title": "t", "description": "d", "default": 1, "examples": [1],
                     "deprecated": False, "readOnly": True, "$comment": "c"}, "x", 1),
}


def assert_accepted_and_held(schema, bad, good) -> None:
    """Not refused, and the grammar agrees with the schema on both instances."""
    assert json_schema_problem(schema) is None
    assert valid(schema, good) and grammar_accepts(schema, good)
    assert not valid(schema, bad) and not grammar_accepts(schema, bad)


@pytest.mark.parametrize("keyword", sorted(ENFORCED))
def test_enforced_keywords_are_accepted_and_hold(keyword):
    assert_accepted_and_held(*ENFORCED[keyword])


# A length bound beside a format is dropped by the grammar, harmlessly where every string of the format
# meets it: (schema, an instance the bound forbids that the grammar rejects anyway, one it accepts).
HARMLESS = {
    "uri minLength 1 (pydantic AnyUrl)": ({"type": "string", "format": "uri", "minLength": 1}, "", "a:"),
    "uri minLength 2": ({"type": "string", "format": "uri", "minLength": 2}, "a", "a:"),
    "email minLength 1": ({"type": "string", "format": "email", "minLength": 1}, "", "a@b"),
    "hostname minLength 1": ({"type": "string", "format": "hostname", "minLength": 1}, "", "a"),
    "date maxLength 10": ({"type": "string", "format": "date", "maxLength": 10}, "2024-01-011", "2024-01-02"),
    "date minLength 10 maxLength 64": ({"type": "string", "format": "date", "minLength": 10, "maxLength": 64},
                                       "2024-1-2", "2024-01-02"),
    "date-time minLength 20": ({"type": "string", "format": "date-time", "minLength": 20},
                               "2024-01-01T00:00:0Z", "2024-01-01T00:00:00Z"),
    "uuid minLength 36 maxLength 36": ({"type": "string", "format": "uuid", "minLength": 36, "maxLength": 36},
                                       "123e4567-e89b-12d3-a456-42661417400", "123e4567-e89b-12d3-a456-426614174000"),
    "ipv4 maxLength 15": ({"type": "string", "format": "ipv4", "maxLength": 15}, "255.255.255.2555", "255.255.255.255"),
    "ipv6 maxLength 39": ({"type": "string", "format": "ipv6", "maxLength": 39},
                          "1111:2222:3333:4444:5555:6666:7777:88889", "1111:2222:3333:4444:5555:6666:7777:8888"),
}


@pytest.mark.parametrize("name", sorted(HARMLESS))
def test_a_length_every_string_of_its_format_meets_is_accepted(name):
    assert_accepted_and_held(*HARMLESS[name])


_EBNF_TOKEN = re.compile(r'"(?:\\.|[^"\\])*"|\[(?:\\.|[^\]\\])*\]|\w+|\{\d+, -?\d+\}|\(=|[()|*+?]|\s+')
_EBNF_ESCAPE = re.compile(r"\\(x[0-9a-fA-F]{2}|u[0-9a-fA-F]{4}|U[0-9a-fA-F]{8}|.)")


def string_widths(schema: dict) -> tuple[float, float, bool]:
    """(fewest, most) characters xgrammar's grammar for a string schema puts between the quotes, read off
    its EBNF (most: inf where a rule recurs), and whether one may be a backslash (a JSON escape: then a
    grammar character need not be a string character, and only `most` bounds the string)."""
    rules = {}
    for line in str(xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)).splitlines():
        name, _, body = line.partition(" ::= ")
        tokens = _EBNF_TOKEN.findall(body)
        assert "".join(tokens) == body, line  # every character of the rule is read
        rules[name] = [t for t in tokens if not t.isspace()]
    assert rules["root"] == ["(", "(", '"\\""', "root_1", '"\\""', ")", ")"], rules["root"]
    backslash = False

    def alt(toks, i, stack):
        lo, hi, i = seq(toks, i, stack)
        while i < len(toks) and toks[i] == "|":
            lo2, hi2, i = seq(toks, i + 1, stack)
            lo, hi = min(lo, lo2), max(hi, hi2)
        return lo, hi, i

    def seq(toks, i, stack):
        lo = hi = 0
        while i < len(toks) and toks[i] not in ("|", ")"):
            a_lo, a_hi, i = atom(toks, i, stack)
            while i < len(toks) and (toks[i] in ("*", "+", "?") or toks[i].startswith("{")):
                q = toks[i]
                m, n = {"*": (0, -1), "+": (1, -1), "?": (0, 1)}.get(q) or map(int, q[1:-1].split(","))
                a_lo = 0 if m == 0 else a_lo * m
                a_hi = 0 if n == 0 else math.inf if n == -1 else a_hi * n
                i += 1
            lo, hi = lo + a_lo, hi + a_hi
        return lo, hi, i

    def atom(toks, i, stack):
        nonlocal backslash
        t = toks[i]
        if t in ("(", "(="):
            lo, hi, j = alt(toks, i + 1, stack)
            assert toks[j] == ")"
            return (0, 0, j + 1) if t == "(=" else (lo, hi, j + 1)
        if t.startswith('"'):
            named = {"n": "\n", "r": "\r", "t": "\t", "0": "\0"}
            text = _EBNF_ESCAPE.sub(lambda m: chr(int(m[1][1:], 16)) if len(m[1]) > 1 else named.get(m[1], m[1]),
                                    t[1:-1])
            backslash = backslash or "\\" in text
            return len(text), len(text), i + 1
        if t.startswith("["):
            backslash = backslash or re.fullmatch(t, "\\") is not None
            return 1, 1, i + 1
        if t in stack:
            return math.inf, math.inf, i + 1  # a shortest derivation never nests a rule in itself
        lo, hi, j = alt(rules[t], 0, stack | {t})
        assert j == len(rules[t]), (t, rules[t][j:])
        return lo, hi, i + 1

    lo, hi, _ = atom(["root_1"], 0, frozenset())
    return lo, hi, backslash


def test_a_length_that_is_no_integer_is_left_to_the_compile_error():
    for bound in (36.0, "36", True):
        schema = {"type": "string", "format": "uuid", "maxLength": bound}
        assert json_schema_problem(schema) is None
        with pytest.raises(RuntimeError, match="must be an integer"):
            xgr.Grammar.from_json_schema(json.dumps(schema))


def test_string_widths_reads_the_grammar():
    assert string_widths({"type": "string", "format": "date"}) == (10, 10, False)
    assert string_widths({"type": "string", "format": "hostname"})[1] == math.inf
    assert string_widths({"type": "string", "format": "email"})[2]  # its quoted local part has escapes


@pytest.mark.parametrize("fmt", sorted(ENFORCED_FORMATS))
def test_format_lengths_are_those_of_the_grammar(fmt):
    """FORMAT_LENGTHS is what makes a length beside a format harmless: its shortest must not exceed, its
    longest not undercut, those of the strings xgrammar's grammar for the format takes."""
    shortest, longest = FORMAT_LENGTHS[fmt]
    lo, hi, backslash = string_widths({"type": "string", "format": fmt})
    assert grammar_accepts({"type": "string", "format": fmt}, "") == (shortest == 0)
    # without escapes a grammar character is a string character; with them, only "" is measured
    assert shortest == (lo if not backslash else min(lo, 1))
    assert longest == (None if hi == math.inf else hi)  # escapes only make strings shorter than hi


def test_pattern_scan_reads_escapes_classes_and_groups():
    refused = [r"(?=a)", r"(?!a)b", r"(?<=a)b", r"(?<!a)b", r"\\(?=a)", r"[](?=a)", r"[^]](?=a)", r"[\]](?!a)",
               r"(?:x|(?=a))", r"a$b", r"a^b", r"$a", r"a^", r"(a)^b", r"a(^b)", r"(a$)b", r"^(?:x|a$)c",
               r"^(^a)*$", r"(?:(a$))+", r"(^a){2,}", r"(^a){1,3}"]
    accepted = [r"\(?=a", r"[(?=]", r"[(?!]", r"[a(?<=]", r"\\\(?=a", r"(?<n>a)", r"(?P<year>\d{4})",
                r"(?i)^a$", r"^a$|^b$", r"(^a$)", r"^^a$$", r"^(?:a|b)$", r"[$^]", r"a\$b\^", r"^a{2,3}$",
                r"(?:^a|^b)c$", r"^a(?:b$|c$)", r"^(?:^a)?b$", r"(^a){1}", r"(^a){1,1}", r"^(a)+$", r"^(?:a|b){2,}$"]
    for pattern in refused:
        assert json_schema_problem({"type": "string", "pattern": pattern}) is not None, pattern
    for pattern in accepted:
        assert json_schema_problem({"type": "string", "pattern": pattern}) is None, pattern


def test_lookbehinds_are_refused_before_a_compile_that_would_fail():
    for pattern in ("(?<=a)b", "(?<!a)b"):
        assert "lookaround" in json_schema_problem({"type": "string", "pattern": pattern})
        with pytest.raises(RuntimeError, match="Lookbehind"):
            xgr.Grammar.from_json_schema(json.dumps({"type": "string", "pattern": pattern}))


def test_rules_apply_in_every_subschema():
    deep = {"type": "object", "properties": {"xs": {"type": "array", "items": {"anyOf": [
        {"type": "string"}, {"$ref": "#/$defs/n"}]}}}, "$defs": {"n": {"type": "array", "uniqueItems": True}}}
    assert "#/$defs/n" in json_schema_problem(deep) and "uniqueItems" in json_schema_problem(deep)
    deep["$defs"]["n"]["uniqueItems"] = False  # false is no constraint at all
    assert json_schema_problem(deep) is None
    assert json_schema_problem(True) is None and json_schema_problem("not json") is None


@pytest.fixture(scope="module")
def tiny_engine() -> LLMEngine:
    return LLMEngine(EngineConfig(
        model=ModelConfig(**TINY, device="cpu", dtype="float32"),
        cache=CacheConfig(block_size=16, max_model_len=256), chunking=ChunkingConfig(size=7), max_num_seqs=8,
    ))


SAMPLED = ["enum", "const", "pattern", "format date", "minimum", "exclusiveMinimum", "multipleOf (integer)",
           "prefixItems", "minItems", "maxItems", "required", "additionalProperties schema", "propertyNames",
           "anyOf", "oneOf discriminated", "allOf of one", "$ref"]


def test_sampled_outputs_validate(tiny_engine):
    """A random model at temperature 1 explores each grammar (all keywords in one batch): every
    "stop" output validates, and every keyword gets some."""
    ids = {}
    for k, keyword in enumerate(SAMPLED):
        so = StructuredOutputs(json_schema=ENFORCED[keyword][0])
        for s in range(4):
            sp = SamplingParams(max_tokens=48, temperature=1.0, seed=s, structured=so)
            ids[tiny_engine.add_request(random_prompt(8, seed=100 * k + s, vocab=256), sp)] = keyword
    done = run_to_completion(tiny_engine)
    stopped = {keyword: 0 for keyword in SAMPLED}
    for rid, keyword in ids.items():
        out = done[rid]
        if out.finish_reason == "stop":
            stopped[keyword] += 1
            assert valid(ENFORCED[keyword][0], json.loads(out.text)), (keyword, out.text)
    assert all(stopped.values()), stopped


def test_a_request_with_an_unenforced_schema_fails_alone_before_compiling(tiny_engine):
    from ladle.engine.structured_output import spec_error

    bad = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
    assert "uniqueItems" in spec_error(StructuredOutputs(json_schema=bad))  # the config-wide check
    compiles = tiny_engine.structured.num_compiles
    refused = tiny_engine.add_request(random_prompt(8, seed=1, vocab=256), SamplingParams(
        max_tokens=8, structured=StructuredOutputs(json_schema=bad)))
    plain = tiny_engine.add_request(random_prompt(8, seed=2, vocab=256), SamplingParams(max_tokens=4))
    done = run_to_completion(tiny_engine)
    assert done[refused].finish_reason == "error" and "uniqueItems" in done[refused].error
    assert done[plain].finish_reason == "length"
    assert tiny_engine.structured.num_compiles == compiles  # refused before any compile started


def test_deeply_nested_groups_are_scanned_in_one_pass():
    """The scan walked back over a group at every repeat after it: a 6 KB pattern of 2,000 nested repeated
    groups took ~1 s inside add_request (xgrammar compiles it in 20 ms)."""
    depth = 3000
    assert json_schema_problem({"type": "string", "pattern": "(" * depth + "a" + ")+" * depth}) is None
    problem = json_schema_problem({"type": "string", "pattern": "(" * depth + "^a" + ")+" * depth})
    assert problem is not None and "repeats a group holding the anchor at position 3000" in problem
