"""An OpenAI batch line's body as sampling values, and the defaults the format gives the fields it leaves out.

A batch file must run as it would on OpenAI or `vllm run-batch`. The fields the format defines take the
line's value, else the format's default: vLLM's (the model's generation_config.json for temperature,
top_p, top_k, min_p and repetition_penalty), else OpenAI's (temperature 1, top_p 1; no top-k, min-p,
penalty, logit_bias, stop or logprobs; one sample; no response_format). The config's `sampling` applies only to what the format leaves to the
server: max_tokens (ladle's bound on every output), seed (`sampling.seed + line`, unseeded otherwise),
prompt_logprobs, and vLLM's stop_token_ids and ignore_eos where a line does not set them.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

log = logging.getLogger("ladle")

MAX_LOGPROBS = 20  # top_logprobs (chat) and logprobs (completions) at most: OpenAI's and vLLM's cap

# The format's own defaults for the fields it defines (SamplingParams names).
FORMAT_DEFAULTS: dict[str, Any] = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "n": 1, "stop": [],
                                   "logprobs": None, "structured": None, "presence_penalty": 0.0,
                                   "frequency_penalty": 0.0, "repetition_penalty": 1.0, "logit_bias": None,
                                   "min_tokens": 0, "include_stop_str_in_output": False, "skip_special_tokens": True}
# What vLLM takes from generation_config.json.
GENERATION_CONFIG_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
# The body's sampling fields read as they are: OpenAI's, and vLLM's extra ones its server accepts.
BODY_KEYS = ("temperature", "top_p", "n", "stop", "seed", "top_k", "min_p", "presence_penalty", "frequency_penalty",
             "logit_bias", "repetition_penalty", "min_tokens", "include_stop_str_in_output", "skip_special_tokens",
             "stop_token_ids", "ignore_eos")  # (these two: the config's when the line leaves them out)


class BadLine(ValueError):
    """A batch input line that cannot be run (the message becomes its error)."""


def format_defaults(model: Any) -> dict[str, Any]:
    """The defaults of the fields the format defines, for `model` (a ModelConfig): its generation_config's
    sampling values where it has them (as vLLM), else OpenAI's."""
    return {**FORMAT_DEFAULTS, **generation_defaults(model)}


def generation_defaults(model: Any) -> dict[str, Any]:
    """temperature, top_p, top_k, min_p from the model's generation_config.json (config files only)."""
    from ladle.models import resolve_architecture

    try:
        model_dir, _ = resolve_architecture(model.path, model.architecture, model.random_weights)
        path = model_dir / "generation_config.json" if model_dir is not None else None
        config = json.loads(Path(path).read_text()) if path is not None and path.exists() else {}
    except (OSError, ValueError, KeyError) as e:  # the engine reports a model it cannot find
        log.warning("could not read the model's generation_config.json (%s): OpenAI's defaults apply", e)
        return {}
    out = {}
    for key in GENERATION_CONFIG_KEYS:
        v = config.get(key) if isinstance(config, dict) else None
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            out[key] = max(int(v), 0) if key == "top_k" else float(v)  # top_k -1 (vLLM's off) is 0 here
    return out


def _max_tokens(body: dict[str, Any], chat: bool) -> Any:
    mt = body.get("max_completion_tokens") if chat else None
    return mt if mt is not None else body.get("max_tokens")


def _check_cap(key: str, k: Any) -> None:
    if isinstance(k, int) and not isinstance(k, bool) and k > MAX_LOGPROBS:
        raise BadLine(f"body.{key}={k} is more than {MAX_LOGPROBS} (OpenAI's and vLLM's limit)")


def _logprobs(body: dict[str, Any], chat: bool, s: dict[str, Any]) -> None:
    """chat: logprobs true + top_logprobs k; completions: logprobs k, with echo also the prompt's."""
    if chat:
        if body.get("logprobs") not in (None, False):
            if body["logprobs"] is not True:
                raise BadLine(f"body.logprobs={body['logprobs']!r} must be true or false (chat completions)")
            _check_cap("top_logprobs", body.get("top_logprobs"))
            s["logprobs"] = body.get("top_logprobs") or 0
        elif body.get("top_logprobs"):
            raise BadLine("body.top_logprobs needs body.logprobs=true")
        return
    if body.get("logprobs") is not None:
        _check_cap("logprobs", body["logprobs"])
        s["logprobs"] = body["logprobs"]
        if body.get("echo") is True:  # the prompt's tokens get their logprobs too (vLLM, OpenAI)
            s["prompt_logprobs"] = body["logprobs"]


def _response_format(rf: Any, s: dict[str, Any]) -> None:
    kind = rf.get("type") if isinstance(rf, dict) else None
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict) or not isinstance(js.get("schema"), (dict, bool)):
            raise BadLine("body.response_format.json_schema.schema is missing (an object is needed)")
        s["json_schema"] = js["schema"]
    elif kind == "json_object":
        s["json_schema"] = {"type": "object"}
    elif kind != "text":
        raise BadLine(f"body.response_format={rf!r:.80}: type must be text, json_object or json_schema")


def _clamped(bias: Any) -> Any:
    """A number clamped to OpenAI's logit_bias range [-100, 100], as vLLM's server does to every bias
    (SamplingParams.from_optional); anything else is left for validation to name."""
    number = bias
    if isinstance(bias, str):  # vLLM's request model reads "500" as 500.0
        try:
            number = float(bias)
        except ValueError:
            return bias
    if isinstance(number, bool) or not isinstance(number, (int, float)) or (isinstance(number, float)
                                                                           and math.isnan(number)):
        return bias
    return float(min(100, max(-100, number)))  # (an int past float's range compares, never converts)


def body_sampling(body: dict[str, Any], chat: bool) -> dict[str, Any]:
    """The body's sampling fields by ladle's sampling keys (values checked later, per row)."""
    s: dict[str, Any] = {}
    mt = _max_tokens(body, chat)
    if mt is not None:
        s["max_tokens"] = mt
    if mt == 0 and not isinstance(mt, bool):  # scoring: completions with echo, as vLLM
        if chat or body.get("echo") is not True:
            raise BadLine("max_tokens=0 generates nothing: only a /v1/completions line with echo: true (and "
                          "logprobs: k to score the prompt) may ask for no tokens")
        s["prompt_logprobs"] = 0  # the engine scores the prompt; with logprobs given, reported below
    for key in BODY_KEYS:
        if body.get(key) is not None:
            s[key] = body[key]
    if isinstance(s.get("logit_bias"), dict):
        s["logit_bias"] = {k: _clamped(v) for k, v in s["logit_bias"].items()}
    _logprobs(body, chat, s)
    if body.get("response_format") is not None:
        _response_format(body["response_format"], s)
    return s
