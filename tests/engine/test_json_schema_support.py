"""Every JSON Schema 2020-12 keyword a user may write is either enforced by the grammar (a violating
instance is rejected by the compiled grammar, and sampled outputs validate with jsonschema) or refused
before compiling with a message that names it. The refusals carry their evidence: the grammar accepts
an instance that breaks the keyword."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import xgrammar as xgr
import yaml

from engine import CacheConfig, ChunkingConfig, EngineConfig, LLMEngine, ModelConfig, SamplingParams
from engine.json_schema_support import json_schema_problem
from engine.sampling_params import StructuredOutputs
from tests.engine.helpers import random_prompt, run_to_completion

TINY = yaml.safe_load((Path(__file__).parents[2] / "conf" / "model" / "tiny.yaml").read_text())
OBJ_A = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}


def grammar_accepts(schema: dict | bool, instance) -> bool:
    grammar = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
    return xgr.testing._is_grammar_accept_string(grammar, json.dumps(instance))


def valid(schema, instance) -> bool:
    checker = jsonschema.Draft202012Validator.FORMAT_CHECKER
    return jsonschema.Draft202012Validator(schema, format_checker=checker).is_valid(instance)


# keyword -> (schema, an instance that violates it but that the grammar accepts)
REFUSED = {
    "uniqueItems": ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, [1, 1]),
    "contains": ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 1}}, [2]),
    "dependentRequired": ({**OBJ_A, "dependentRequired": {"a": ["b"]}}, {"a": 1}),
    "dependentSchemas": ({**OBJ_A, "dependentSchemas": {"a": {"required": ["b"]}}}, {"a": 1}),
    "not": ({"type": "integer", "not": {"const": 3}}, 3),
    "if": ({"type": "integer", "if": {"minimum": 5}, "then": {"maximum": 5}}, 6),
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
    "'format' together with 'maxLength'": ({"type": "string", "format": "date", "maxLength": 5}, "2024-01-01"),
    "'format' together with 'minLength'": ({"type": "string", "format": "date", "minLength": 11}, "2024-01-01"),
    "'format' together with 'pattern'": ({"type": "string", "format": "date", "pattern": "^1999-"}, "2024-01-01"),
    "Lookahead is not supported": ({"type": "string", "pattern": "^(?!x)[a-z]+$"}, "xyz"),
    "'patternProperties' key": ({"type": "object", "patternProperties": {"^(?!x)[a-z]+$": {"type": "integer"}},
                                 "additionalProperties": False}, {"xa": 1}),
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


@pytest.mark.parametrize("keyword", sorted(ENFORCED))
def test_enforced_keywords_are_accepted_and_hold(keyword):
    schema, bad, good = ENFORCED[keyword]
    assert json_schema_problem(schema) is None
    assert valid(schema, good) and grammar_accepts(schema, good)
    assert not valid(schema, bad) and not grammar_accepts(schema, bad)


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
    from engine.structured_output import spec_error

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
