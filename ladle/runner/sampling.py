"""Sampling parameters of each request: the config's defaults, overridden by the row's own columns.

`workload.columns` names a column per sampling key (`{temperature: temp, json_schema: schema}`); a row's
value replaces the default, a null keeps it. A value that cannot be used (a float seed 1.5, a NaN
temperature, a schema that is not JSON) is that row's error, with a message naming the column and the
value; it never stops the job.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from decimal import Decimal
from typing import Any

import numpy as np
from omegaconf import DictConfig, ListConfig, OmegaConf

from ladle.engine.sampling_params import SamplingParams, StructuredOutputs
from ladle.runner.text import TooDeep, check_depth, load_json

STRUCTURED_KEYS = ("json_schema", "regex", "choice", "grammar")
INT_KEYS = ("max_tokens", "top_k", "seed", "n", "logprobs", "prompt_logprobs", "min_tokens")
FLOAT_KEYS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
BOOL_KEYS = ("include_stop_str_in_output", "skip_special_tokens")
COLUMN_KEYS = (*INT_KEYS, *FLOAT_KEYS, *BOOL_KEYS, "stop", "logit_bias", *STRUCTURED_KEYS)
# Most samples per prompt: the engine forks all n at once when the prompt is prefilled, so a row asking
# for millions would exhaust memory and stop the job (a run needing more writes the row several times).
MAX_N = 1024


class BadValue(ValueError):
    """A value that cannot be the sampling key it is given for (the message says what it must be)."""


def _plain(x: Any) -> Any:
    return OmegaConf.to_container(x, resolve=True) if isinstance(x, (DictConfig, ListConfig)) else x


def as_int(value: Any) -> int:
    """An integer, from an int, an integral float (1.0: Parquet/pandas turn int columns with nulls into
    floats) or a decimal string; never from a bool, 1.5, NaN."""
    if isinstance(value, (bool, np.bool_)):
        raise BadValue("must be an integer, not a boolean")
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating, Decimal)):  # Decimal: Parquet DECIMAL columns
        finite = value.is_finite() if isinstance(value, Decimal) else math.isfinite(value)
        if finite and value == int(value):
            return int(value)
        raise BadValue("must be an integer")
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            raise BadValue("must be an integer") from None
    raise BadValue(f"must be an integer, not a {type(value).__name__}")


def as_float(value: Any) -> float:
    if isinstance(value, (bool, np.bool_)):
        raise BadValue("must be a number, not a boolean")
    if isinstance(value, str):
        try:
            value = float(value.strip())
        except ValueError:
            raise BadValue("must be a number") from None
    if isinstance(value, Decimal):  # Parquet DECIMAL columns
        value = float(value)
    if not isinstance(value, (int, float, np.integer, np.floating)):
        raise BadValue(f"must be a number, not a {type(value).__name__}")
    if not math.isfinite(value):
        raise BadValue("must be a finite number")
    return float(value)


def as_bool(value: Any) -> bool:
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    raise BadValue("must be true or false")


def as_logit_bias(value: Any) -> dict[int, float]:
    """Token id -> bias: a mapping (OpenAI's JSON has string keys, "50256": -100), its JSON text, or an
    Arrow map column's list of (key, value) pairs."""
    value = _plain(value)
    if isinstance(value, str):
        value = _load(value)
    if isinstance(value, (list, tuple, np.ndarray)) and all(isinstance(x, (list, tuple)) and len(x) == 2
                                                             for x in value):
        value = dict(value)
    if not isinstance(value, dict):
        raise BadValue("must map token ids to numbers (a mapping, or its JSON text)")
    try:  # a null bias is no bias: an Arrow struct gives each row the other rows' keys as nulls
        return {as_int(k): as_float(v) for k, v in value.items() if v is not None}
    except BadValue as e:
        raise BadValue(f"must map integer token ids to finite numbers (a key or value {e})") from None


def as_stop(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    value = _plain(value)
    if isinstance(value, (list, tuple, np.ndarray)) and all(isinstance(x, str) for x in value):
        return list(value)
    raise BadValue("must be a string or a list of strings")


def as_schema(value: Any) -> dict:
    """A JSON schema: a mapping, or JSON text of one (`true` is the schema that accepts anything)."""
    value = _plain(value)
    if isinstance(value, str):
        value = _load(value)
    else:  # a mapping (a JSONL object, an Arrow struct) goes to recursive walks as text would
        _check_depth(value)
    if value is True:  # the engine takes objects only; {} is the same schema
        return {}
    if value is False:
        raise BadValue("is the schema no output satisfies: give an object schema")
    if isinstance(value, dict):
        return value
    raise BadValue("must be a JSON schema: an object, or its JSON text")


def _load(text: str) -> Any:
    try:
        return load_json(text)
    except TooDeep as e:
        raise BadValue(f"is {e}") from None
    except ValueError as e:
        raise BadValue(f"is not valid JSON ({e})") from None


def _check_depth(value: Any) -> None:
    try:
        check_depth(value)
    except TooDeep as e:
        raise BadValue(f"is {e}") from None


def as_text(value: Any) -> str:
    if isinstance(value, str) and value:
        return value
    raise BadValue("must be a non-empty string")


def as_choice(value: Any) -> list[str]:
    value = _plain(value)
    if isinstance(value, str):  # a JSON list in a text column
        try:
            value = load_json(value)
        except TooDeep as e:
            raise BadValue(f"is {e}") from None
        except ValueError:
            raise BadValue("must be a list of strings (or its JSON text)") from None
    if isinstance(value, (list, tuple, np.ndarray)) and len(value) and all(isinstance(x, str) for x in value):
        return list(value)
    raise BadValue("must be a non-empty list of strings")


def as_token_ids(value: Any) -> list[int]:
    """A list of token ids (vLLM's stop_token_ids)."""
    value = _plain(value)
    if not isinstance(value, (list, tuple, np.ndarray)):
        raise BadValue("must be a list of integer token ids")
    try:
        return [as_int(x) for x in value]
    except BadValue as e:
        raise BadValue(f"must be a list of integer token ids (an item {e})") from None


# ignore_eos and stop_token_ids are read from an OpenAI batch line's body (vLLM's extra fields), not columns.
CONVERTERS: dict[str, Callable[[Any], Any]] = {
    **{k: as_int for k in INT_KEYS}, **{k: as_float for k in FLOAT_KEYS}, **{k: as_bool for k in BOOL_KEYS},
    "ignore_eos": as_bool, "stop_token_ids": as_token_ids, "stop": as_stop, "logit_bias": as_logit_bias,
    "json_schema": as_schema, "regex": as_text, "choice": as_choice, "grammar": as_text,
}


def _is_null(value: Any) -> bool:
    return value is None


def structured_of(values: dict[str, Any]) -> StructuredOutputs | None:
    """The one structured-output spec among `values` (already converted), None if none is set."""
    given = {k: values[k] for k in STRUCTURED_KEYS if values.get(k) is not None}
    if len(given) > 1:
        raise BadValue(f"sets {' and '.join(given)}: set at most one of {', '.join(STRUCTURED_KEYS)}")
    return StructuredOutputs(**given) if given else None


def base_params(cfg: Any) -> SamplingParams:
    """The config's `sampling` node (ladle.runner.config.SamplingConfig) as SamplingParams.

    Raises ValueError naming the structured key when its value cannot be used."""
    fields = {f.name for f in dataclasses.fields(SamplingParams)} - {"structured"}
    kw = {k: _plain(getattr(cfg, k)) for k in fields if hasattr(cfg, k)}
    s = cfg.structured
    values = {}
    for k in STRUCTURED_KEYS:
        v = _plain(getattr(s, k))
        if v is not None:
            try:
                values[k] = CONVERTERS[k](v)
            except BadValue as e:
                raise ValueError(f"{k}={v!r:.200} {e}") from None
    try:
        structured = structured_of(values)
    except BadValue as e:
        raise ValueError(str(e)) from None
    # The job writes finished requests only: per-step outputs and their text would be work nobody reads.
    kw["output_kind"] = "final_only"
    if kw.get("logit_bias") is not None:  # a config mapping's keys may be text ("50256": -100)
        try:
            kw["logit_bias"] = as_logit_bias(kw["logit_bias"]) or None
        except BadValue as e:
            raise ValueError(f"logit_bias={kw['logit_bias']!r:.200} {e}") from None
    return SamplingParams(**kw, structured=structured)


def param_problems(p: SamplingParams) -> list[str]:
    """SamplingParams.problems() plus the checks of the per-row fields (n, logprobs, structured output; the
    engine branches add the same to problems(); a key it already reports is not reported twice)."""
    out = p.problems()
    if p.max_tokens == 0 and p.prompt_logprobs is not None:  # scoring (allowed by the contract)
        out = [x for x in out if not x.startswith("max_tokens=")]
    reported = {x.split("=", 1)[0] for x in out}

    def add(key: str, msg: str) -> None:
        if key not in reported:
            out.append(msg)

    count = (lambda x: isinstance(x, int) and not isinstance(x, bool))
    if not count(p.n) or p.n < 1:
        add("n", f"n={p.n!r} must be an integer >= 1 (samples per prompt)")
    elif p.n > MAX_N:
        add("n", f"n={p.n} is more than {MAX_N} samples per prompt: lower it, or repeat the row with "
                 "other seeds")
    for name in ("logprobs", "prompt_logprobs"):
        k = getattr(p, name)
        if k is not None and (not count(k) or k < 0):
            add(name, f"{name}={k!r} must be null (off) or an integer >= 0 (top-k alternatives)")
    if p.max_tokens == 0 and p.prompt_logprobs is None:
        out = [x for x in out if not x.startswith("max_tokens=")]
        out.append("max_tokens=0 is only for scoring: set prompt_logprobs (e.g. 0), or max_tokens >= 1")
    return out


def column_names(columns: dict[str, str]) -> dict[str, str]:
    """Sampling key -> how an error message names where a row's value came from."""
    return {k: f"column {c!r}" for k, c in columns.items()}


def row_params(base: SamplingParams, values: dict[str, Any], names: dict[str, str],
               index: int) -> tuple[SamplingParams, str | None]:
    """One row's SamplingParams: `base` with the row's non-null values (raw, by sampling key), and the
    seed `base.seed + index` unless the row has its own. `names` says where each value came from (see
    column_names). Returns (params, error message naming the value and where it came from)."""
    kw: dict[str, Any] = {}
    if base.seed is not None:
        kw["seed"] = base.seed + index
    bad = []
    for key, raw in values.items():
        if _is_null(raw):
            continue
        try:
            kw[key] = CONVERTERS[key](raw)
        except BadValue as e:
            bad.append(f"{names.get(key, 'the row')} (sampling {key}) holds {_show(raw)}, which {e}")
    if bad:
        return base, "; ".join(bad)
    row_structured = {k: kw.pop(k) for k in STRUCTURED_KEYS if k in kw}
    if row_structured:
        try:
            kw["structured"] = structured_of(row_structured)
        except BadValue as e:
            return base, f"this row {e} (from {', '.join(names.get(k, k) for k in row_structured)})"
    params = dataclasses.replace(base, **kw)
    problems = param_problems(params)
    if problems:
        given = {k for k, v in values.items() if not _is_null(v)}
        named = [f"{p} (from {names[k]})" if (k := _problem_key(p)) in given and k in names else p
                 for p in problems]
        return base, "invalid sampling for this row: " + "; ".join(named)
    return params, None


def _problem_key(problem: str) -> str:
    """The sampling key a problem is about: 'top_k=-1 must ...' -> top_k, 'structured.choice=[''] ...'
    or 'structured.json_schema must ...' -> choice / json_schema."""
    return problem.split("=", 1)[0].split(" ", 1)[0].removeprefix("structured.")


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."
