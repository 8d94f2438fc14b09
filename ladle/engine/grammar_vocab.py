"""xgrammar's view of the engine's vocabulary, and the token restrictions ladle adds to its masks.

Built once per engine, the first time a request asks for structured output (engine/structured_output.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch


def tokenizer_info(tokenizer: Any, vocab_size: int, stop_ids: list[int]):
    """xgrammar's view of the vocabulary. vocab_size is the model's logits width: ids the tokenizer does
    not know (a padded LM head) are special to xgrammar, never allowed by a mask."""
    import xgrammar as xgr

    from ladle.models.tokenizer import ByteTokenizer, HFTokenizer  # engine -> models

    if isinstance(tokenizer, HFTokenizer):
        return xgr.TokenizerInfo.from_huggingface(
            tokenizer.tokenizer, vocab_size=vocab_size, stop_token_ids=stop_ids or None
        )
    if isinstance(tokenizer, ByteTokenizer):
        # Ids 0-255 are the bytes themselves. Everything else (<bos>/<eos>/<pad>, or a stand-in's ids
        # it cannot name) is an empty string, which xgrammar treats as special: never part of the text.
        # Stop ids are emptied too: with the stand-in, the model's EOS may be a byte (0x02) that must
        # end the text, not be text.
        vocab: list[bytes | str] = [bytes([i]) for i in range(256)]
        vocab += [""] * (min(tokenizer.vocab_size, vocab_size) - 256)
        for i in stop_ids:
            if 0 <= i < len(vocab):
                vocab[i] = ""
        return xgr.TokenizerInfo(
            vocab, xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=stop_ids or None
        )
    raise TypeError(f"structured output does not know the tokenizer {type(tokenizer).__name__}")


def _pack(allowed) -> torch.Tensor:
    """A bool vector over the vocabulary as one xgrammar bitmask row (bit j of word k = token 32k+j)."""
    import numpy as np

    words = (len(allowed) + 31) // 32
    padded = np.zeros(words * 32, dtype=bool)
    padded[: len(allowed)] = allowed
    bits = (padded.reshape(words, 32).astype(np.uint64) << np.arange(32, dtype=np.uint64)).sum(axis=1)
    return torch.from_numpy(bits.astype(np.uint32).view(np.int32).copy())


@dataclass
class VocabMasks:
    """Token restrictions ANDed onto xgrammar's masks, for two gaps in xgrammar 0.2.8:

    - It accepts UTF-8-encoded surrogates (ED A0..BF ..) as characters; Python, and every strict
      UTF-8 decoder, reads them as three U+FFFD, so a maxLength or a regex would no longer hold on the
      text. Tokens holding one are forbidden, and so is continuing a trailing ED byte with A0-BF.
    - Its rule for JSON strings with minLength/maxLength (any character but quote, backslash, CR, LF)
      lets raw control characters (0x00-0x1f) through, which JSON forbids. Compact JSON (see _compile)
      never contains one, so JSON rows forbid every token holding one.
    Stop ids stay allowed: they end the text, they are not part of it."""

    table: torch.Tensor  # [4, words]: row (is json) + 2 * (text ends with ED) is what a row may hold
    ends_with_ed: frozenset[int]

    @classmethod
    def build(cls, info: Any, vocab_size: int, stop_ids: list[int]) -> VocabMasks:
        import numpy as np

        surrogate = re.compile(rb"\xed[\xa0-\xbf]")
        every = np.ones(vocab_size, dtype=bool)
        no_ctrl = np.ones(vocab_size, dtype=bool)
        after_ed = np.ones(vocab_size, dtype=bool)
        ends_with_ed = set()
        for i, token in enumerate(info.decoded_vocab[:vocab_size]):
            if not token:
                continue
            if surrogate.search(token):
                every[i] = False
            if any(b < 0x20 for b in token):
                no_ctrl[i] = False
            if 0xA0 <= token[0] <= 0xBF:
                after_ed[i] = False
            if token[-1] == 0xED:
                ends_with_ed.add(i)
        stops = [i for i in stop_ids if 0 <= i < vocab_size]
        every[stops] = no_ctrl[stops] = after_ed[stops] = True
        json = every & no_ctrl
        rows = [every, json, every & after_ed, json & after_ed]
        return cls(torch.stack([_pack(r) for r in rows]), frozenset(ends_with_ed))


class VocabularyError(RuntimeError):
    """The engine's tokenizer could not be turned into xgrammar's vocabulary (no spec is at fault)."""
