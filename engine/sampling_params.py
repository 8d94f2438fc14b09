"""Per-request sampling and stopping parameters (vLLM's names and meanings)."""

from __future__ import annotations

from dataclasses import dataclass, field


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

    def problems(self) -> list[str]:
        """Every invalid field with its value and the allowed range (empty when valid)."""
        out = []
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            out.append(f"max_tokens={self.max_tokens!r} must be an integer >= 1")
        if self.temperature < 0:
            out.append(f"temperature={self.temperature} must be >= 0")
        if self.top_k < 0:
            out.append(f"top_k={self.top_k} must be >= 0 (0 = off)")
        if not 0 < self.top_p <= 1:
            out.append(f"top_p={self.top_p} must be in (0, 1]")
        if not 0 <= self.min_p <= 1:
            out.append(f"min_p={self.min_p} must be in [0, 1]")
        return out
