"""Per-request sampling and stopping parameters (vLLM's names and meanings)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

OUTPUT_KINDS = ("delta", "final_only")
# Temperatures below this sample greedily (vLLM's _SAMPLING_EPS): dividing logits by a smaller one
# overflows float32 to inf, and the softmax of that is NaN.
GREEDY_BELOW = 1e-5
# The largest temperature: the sampler divides float32 logits by it, and a larger one is inf there
# (-inf / inf is NaN: a draw outside the grammar's mask). torch.finfo(torch.float32).max.
FLOAT32_MAX = 3.4028234663852886e38


@dataclass
class StructuredOutputs:            # exactly one field set
    json_schema: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None      # EBNF / GBNF text


@dataclass
class SamplingParams:
    """vLLM's names and meanings. The logits of a draw are processed in vLLM V1's order: logit_bias,
    min_tokens, the penalties (greedy rows included), then temperature, min_p, top_k, top_p."""

    max_tokens: int | None = 16  # None = up to max_model_len (the prompt's room)
    temperature: float = 1.0  # 0 (below GREEDY_BELOW) = greedy
    top_k: int = 0  # 0 or -1 = off; ties with the k-th logit are kept
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None  # per-request generator; None = engine's generator
    stop: list[str] = field(default_factory=list)  # stop strings; the text is cut before them
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0  # EOS and stop_token_ids masked, stop strings unchecked, before this many tokens
    presence_penalty: float = 0.0  # minus this for every token already in the output
    frequency_penalty: float = 0.0  # minus this times the token's count in the output
    repetition_penalty: float = 1.0  # logits of prompt and output tokens: positive / it, negative * it
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    include_stop_str_in_output: bool = False  # keep the stop string (or the stop token's text)
    skip_special_tokens: bool = True  # special tokens' text left out of the output text
    n: int = 1                      # samples per prompt; prompt prefilled once, KV shared
    logprobs: int | None = None     # None = off; k >= 0: chosen token's logprob + top-k alternatives
    prompt_logprobs: int | None = None  # None = off; k >= 0: logprob of every prompt token (+ top-k)
    structured: StructuredOutputs | None = None
    # "delta": an output every step (new tokens and text); "final_only": one output when the request
    # finishes, and without stop strings no text until then (vLLM's RequestOutputKind; what
    # LLM.generate and ladle's runner use: the per-step text is work nobody reads).
    output_kind: str = "delta"

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):  # vLLM accepts one stop string as a plain str
            self.stop = [self.stop]

    @property
    def greedy(self) -> bool:
        """Whether the request takes the argmax (temperature 0, or too small to divide by)."""
        return self.temperature < GREEDY_BELOW

    def problems(self) -> list[str]:
        """Every invalid field with its value and the allowed range (empty when valid)."""

        def number(x: object) -> bool:
            return isinstance(x, (int, float)) and not isinstance(x, bool)

        def count(x: object) -> bool:
            return isinstance(x, int) and not isinstance(x, bool)

        out = []
        # -- n / logprobs / prompt_logprobs / scoring --
        if self.max_tokens is not None and (not count(self.max_tokens) or self.max_tokens < 0):
            out.append(f"max_tokens={self.max_tokens!r} must be an integer >= 1, or None (up to max_model_len)")
        elif self.max_tokens == 0 and self.prompt_logprobs is None:
            out.append("max_tokens=0 is only for scoring: set prompt_logprobs (e.g. 0), or max_tokens >= 1")
        if not count(self.n) or self.n < 1:
            out.append(f"n={self.n!r} must be an integer >= 1 (samples per prompt)")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and (not count(k) or k < 0):
                out.append(f"{name}={k!r} must be None (off) or an integer >= 0 (top-k alternatives)")
        # (> FLOAT32_MAX first: math.isfinite raises on an int too large for a float)
        t = self.temperature
        if not number(t) or t > FLOAT32_MAX or not math.isfinite(t) or t < 0:
            out.append(f"temperature={t!r} must be a finite number >= 0 and at most {FLOAT32_MAX:.7g} "
                       f"(float32's largest; 0 = greedy)")
        if not count(self.top_k) or self.top_k < -1:
            out.append(f"top_k={self.top_k!r} must be an integer >= 1, or 0 / -1 (off: every token)")
        if not number(self.top_p) or not 0 < self.top_p <= 1:
            out.append(f"top_p={self.top_p!r} must be in (0, 1]")
        if not number(self.min_p) or not 0 <= self.min_p <= 1:
            out.append(f"min_p={self.min_p!r} must be in [0, 1]")
        if self.seed is not None and (not count(self.seed) or not -(2**63) <= self.seed < 2**64):
            # torch.Generator.manual_seed takes [-2**63, 2**64): a larger seed would fail the whole step
            out.append(f"seed={self.seed!r} must be None or an integer in [-2**63, 2**64)")
        out.extend(self._stop_problems())
        out.extend(self._processing_problems(number, count))
        if self.output_kind not in OUTPUT_KINDS:
            out.append(f"output_kind={self.output_kind!r} must be one of {', '.join(OUTPUT_KINDS)}")
        # -- structured output --
        if self.structured is not None:
            if not isinstance(self.structured, StructuredOutputs):
                out.append(f"structured={self.structured!r} must be a StructuredOutputs or None")
            else:
                out.extend(structured_problems(self.structured))
        return out


    def _stop_problems(self) -> list[str]:
        out = []
        if not isinstance(self.stop, (list, tuple)) or not all(isinstance(x, str) for x in self.stop):
            out.append(f"stop={self.stop!r} must be a list of strings")
        if not isinstance(self.stop_token_ids, (list, tuple)) or not all(
                isinstance(x, int) and not isinstance(x, bool) for x in self.stop_token_ids):  # True is not id 1
            out.append(f"stop_token_ids={self.stop_token_ids!r} must be a list of integers")
        return out

    def _processing_problems(self, number, count) -> list[str]:
        """min_tokens, the penalties, logit_bias and the text switches (vLLM's ranges)."""
        out = []
        if not count(self.min_tokens) or self.min_tokens < 0:
            out.append(f"min_tokens={self.min_tokens!r} must be an integer >= 0")
        elif count(self.max_tokens) and self.min_tokens > self.max_tokens:
            out.append(f"min_tokens={self.min_tokens} must be at most max_tokens={self.max_tokens}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not number(v) or not -2.0 <= v <= 2.0:
                out.append(f"{name}={v!r} must be in [-2, 2] (0 = off)")
        r = self.repetition_penalty
        if not number(r) or not 0 < r <= FLOAT32_MAX:  # (NaN fails the comparison too)
            out.append(f"repetition_penalty={r!r} must be a finite number > 0 (1 = off)")
        bias = self.logit_bias
        if bias is not None and (not isinstance(bias, dict) or not all(
                count(k) and number(v) and -FLOAT32_MAX <= v <= FLOAT32_MAX for k, v in bias.items())):
            out.append(f"logit_bias={bias!r:.200} must be a mapping of integer token ids to finite numbers")
        for name in ("include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                out.append(f"{name}={getattr(self, name)!r} must be true or false")
        return out


def structured_problems(spec: StructuredOutputs) -> list[str]:
    """What is wrong with the spec before compiling it (compile errors come from the grammar compiler)."""
    fields = {k: getattr(spec, k) for k in ("json_schema", "regex", "choice", "grammar")}
    given = [k for k, v in fields.items() if v is not None]
    if len(given) != 1:
        names = ", ".join(given) if given else "none"
        return [f"structured: set exactly one of json_schema, regex, choice, grammar (got {names})"]
    kind, value = given[0], fields[given[0]]
    if kind == "json_schema" and not isinstance(value, (str, dict)):
        return [f"structured.json_schema must be a JSON string or a dict, got {type(value).__name__}"]
    if kind in ("regex", "grammar") and (not isinstance(value, str) or not value.strip()):
        return [f"structured.{kind}={value!r} must be a non-empty string"]
    if kind == "choice":
        if not isinstance(value, (list, tuple)) or not value:
            return [f"structured.choice={value!r} must be a non-empty list of strings"]
        if not all(isinstance(c, str) and c for c in value):
            return [f"structured.choice={value!r} must hold non-empty strings only"]
    return []
