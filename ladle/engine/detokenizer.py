"""Incremental detokenisation and stop strings.

Text deltas come from decoding a short window of recent tokens (prefix/read offsets, as in vLLM and
TGI): a delta is released only when it does not end in an incomplete UTF-8 sequence, so each character
appears exactly once and multi-token characters are never split.

Windows are decoded *raw*, without the tokenizer's clean-up of spaces: HF tokenizers with
`clean_up_tokenization_spaces=True` (Llama 3's ship that way) rewrite text across a window's boundary
(" ." -> "."), so deltas of cleaned windows lose or repeat characters. The clean-up is a string rewrite
applied to the whole text; it is applied here to the raw text in pieces cut where no rewrite can
straddle the cut, so the deltas add up to exactly `tokenizer.decode(output_ids)`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

# A cut keeps this many raw characters back: a clean-up rule that could still match text arriving
# later starts inside them (HF's longest rule, " n't", is 4 characters).
CLEANUP_HOLDBACK = 8


@dataclass(slots=True)
class DetokState:
    """Offsets into prompt + output ids. They start at the output: the text of a request is
    `tokenizer.decode(output_ids)`, which for SentencePiece-style tokenizers drops the first token's
    leading space; decoding with prompt context would keep it and differ from that."""

    prefix_offset: int
    read_offset: int
    pending: str = ""  # raw text not yet cleaned up and released (clean-up tokenizers only)
    skip_special: bool = True  # special tokens' text left out (vLLM's skip_special_tokens)

    @staticmethod
    def for_prompt(num_prompt_tokens: int, skip_special: bool = True) -> DetokState:
        return DetokState(prefix_offset=num_prompt_tokens, read_offset=num_prompt_tokens, skip_special=skip_special)


def _window(prompt: Sequence[int], output: Sequence[int], start: int, end: int | None = None) -> list[int]:
    """Tokens [start, end) of prompt + output, without building prompt + output (O(window))."""
    n = len(prompt)
    end = n + len(output) if end is None else end
    if start >= n:
        return list(output[start - n : end - n])
    return list(prompt[start:end]) + list(output[: max(0, end - n)])


class Detokenizer:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._decode_raw: Callable[[list[int]], str] = getattr(tokenizer, "decode_raw", tokenizer.decode)
        self._clean_up: Callable[[str], str] | None = (
            tokenizer.clean_up if getattr(tokenizer, "cleans_up_spaces", False) else None
        )

    def step(self, state: DetokState, prompt: Sequence[int], output: Sequence[int]) -> str:
        """Text produced by the output tokens appended since the last call."""
        prefix = self._decode(state, _window(prompt, output, state.prefix_offset, state.read_offset))
        full = self._decode(state, _window(prompt, output, state.prefix_offset))
        raw = ""
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            state.prefix_offset = state.read_offset
            state.read_offset = len(prompt) + len(output)
            raw = full[len(prefix) :]
        return self._release(state, raw, final=False)

    def flush(self, state: DetokState, prompt: Sequence[int], output: Sequence[int]) -> str:
        """Whatever text is held back at the end (an incomplete character, text a clean-up rule could
        still rewrite) when a request ends."""
        prefix = self._decode(state, _window(prompt, output, state.prefix_offset, state.read_offset))
        full = self._decode(state, _window(prompt, output, state.prefix_offset))
        state.prefix_offset = state.read_offset = len(prompt) + len(output)
        raw = full[len(prefix) :] if len(full) > len(prefix) else ""
        return self._release(state, raw, final=True)

    def _decode(self, state: DetokState, ids: list[int]) -> str:
        # The flag is passed only when it is not the default: a tokenizer may not take it.
        return self._decode_raw(ids) if state.skip_special else self._decode_raw(ids, skip_special_tokens=False)

    def _release(self, state: DetokState, raw: str, final: bool) -> str:
        if self._clean_up is None:
            return raw
        text = state.pending + raw
        cut = len(text) if final else self._safe_cut(text)
        state.pending = text[cut:]
        return self._clean_up(text[:cut]) if cut else ""

    def _safe_cut(self, text: str) -> int:
        """A position where cleaning up the two sides separately equals cleaning up the whole, far
        enough from the end that text still to come cannot form a rule across it; 0 if none."""
        limit = len(text) - CLEANUP_HOLDBACK
        clean = self._clean_up
        whole = None
        for cut in (limit, text.rfind(" ", 0, max(limit, 0) + 1)):
            if cut <= 0:
                continue
            whole = clean(text) if whole is None else whole
            if clean(text[:cut]) + clean(text[cut:]) == whole:
                return cut
        return 0


def find_stop(text: str, new_len: int, stops: list[str], include: bool = False) -> int | None:
    """Where the text is cut for the earliest stop string: where it starts (or, `include`, where it
    ends), searching only where the new text could complete one; None if there is none."""
    best: tuple[int, int] | None = None
    for s in stops:
        if not s:
            continue
        lo = max(0, len(text) - new_len - len(s) + 1)
        i = text.find(s, lo)
        if i != -1 and (best is None or i < best[0]):
            best = (i, len(s))
    if best is None:
        return None
    return best[0] + best[1] if include else best[0]
