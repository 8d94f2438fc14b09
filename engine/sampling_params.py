"""Per-request sampling and stopping parameters (vLLM's names and meanings)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StructuredOutputs:            # exactly one field set
    json_schema: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None      # EBNF / GBNF text


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None  # per-request generator; None = engine's generator
    stop: list[str] = field(default_factory=list)  # stop strings; the text is cut before them
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    n: int = 1                      # samples per prompt; prompt prefilled once, KV shared
    logprobs: int | None = None     # None = off; k >= 0: chosen token's logprob + top-k alternatives
    prompt_logprobs: int | None = None  # None = off; k >= 0: logprob of every prompt token (+ top-k)
    structured: StructuredOutputs | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):  # vLLM accepts one stop string as a plain str
            self.stop = [self.stop]

    def problems(self) -> list[str]:
        """Every invalid field with its value and the allowed range (empty when valid)."""

        def number(x: object) -> bool:
            return isinstance(x, (int, float)) and not isinstance(x, bool)

        out = []
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            out.append(f"max_tokens={self.max_tokens!r} must be an integer >= 1")
        if not number(self.temperature) or self.temperature < 0:
            out.append(f"temperature={self.temperature!r} must be a number >= 0")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            out.append(f"top_k={self.top_k!r} must be an integer >= 0 (0 = off)")
        if not number(self.top_p) or not 0 < self.top_p <= 1:
            out.append(f"top_p={self.top_p!r} must be in (0, 1]")
        if not number(self.min_p) or not 0 <= self.min_p <= 1:
            out.append(f"min_p={self.min_p!r} must be in [0, 1]")
        if self.seed is not None and not isinstance(self.seed, int):
            out.append(f"seed={self.seed!r} must be an integer or None")
        if not isinstance(self.stop, (list, tuple)) or not all(isinstance(x, str) for x in self.stop):
            out.append(f"stop={self.stop!r} must be a list of strings")
        if not isinstance(self.stop_token_ids, (list, tuple)) or not all(
            isinstance(x, int) for x in self.stop_token_ids
        ):
            out.append(f"stop_token_ids={self.stop_token_ids!r} must be a list of integers")
        return out
