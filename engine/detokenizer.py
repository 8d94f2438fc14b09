"""Incremental detokenisation and stop strings.

Text deltas come from decoding a short window of recent tokens (prefix/read offsets, as in vLLM
and TGI): a delta is released only when it does not end in an incomplete UTF-8 sequence, so each
character appears exactly once and multi-token characters are never split.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class DetokState:
    """Offsets into prompt + output ids. Starting a few prompt tokens back gives the tokenizer the
    context it needs (e.g. SentencePiece's leading-space handling) for the first output token."""

    prefix_offset: int
    read_offset: int

    @staticmethod
    def for_prompt(num_prompt_tokens: int) -> DetokState:
        return DetokState(prefix_offset=max(0, num_prompt_tokens - 5), read_offset=num_prompt_tokens)


class Detokenizer:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def step(self, state: DetokState, token_ids: list[int]) -> str:
        """New text produced by the tokens appended to token_ids (prompt + output) since the last call."""
        decode = self.tokenizer.decode
        prefix = decode(token_ids[state.prefix_offset : state.read_offset])
        full = decode(token_ids[state.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            state.prefix_offset = state.read_offset
            state.read_offset = len(token_ids)
            return full[len(prefix) :]
        return ""

    def flush(self, state: DetokState, token_ids: list[int]) -> str:
        """Whatever text is held back at the end (e.g. an incomplete character) when a request ends."""
        decode = self.tokenizer.decode
        prefix = decode(token_ids[state.prefix_offset : state.read_offset])
        full = decode(token_ids[state.prefix_offset :])
        state.prefix_offset = state.read_offset = len(token_ids)
        return full[len(prefix) :] if len(full) > len(prefix) else ""


def find_stop(text: str, new_len: int, stops: list[str]) -> int | None:
    """Index where the earliest stop string starts, searching only where the new text could complete one."""
    best = None
    for s in stops:
        if not s:
            continue
        lo = max(0, len(text) - new_len - len(s) + 1)
        i = text.find(s, lo)
        if i != -1 and (best is None or i < best):
            best = i
    return best
