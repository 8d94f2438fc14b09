"""Tokenizers: transformers' AutoTokenizer for real models, a built-in byte-level one for the rest.

Both satisfy the `Tokenizer` protocol the engine and runner use. The byte tokenizer maps each UTF-8
byte to its own id (0-255) and adds <bos>=256, <eos>=257, <pad>=258; it is what the built-in `tiny`
model uses, and the stand-in for random-weight models whose tokenizer files are not available.
"""

from __future__ import annotations

import functools
import json
import warnings
from pathlib import Path
from typing import Any, ClassVar, Protocol, runtime_checkable

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


@runtime_checkable
class Tokenizer(Protocol):
    eos_token_ids: list[int]
    bos_token_id: int | None
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...

    def apply_chat_template(self, messages: list[dict[str, Any]], **template_kwargs: Any) -> list[int]: ...


class ByteTokenizer:
    """UTF-8 bytes as token ids, plus <bos>, <eos>, <pad>. Ids the table does not know decode to U+FFFD."""

    BOS, EOS, PAD = 256, 257, 258
    SPECIALS: ClassVar[dict[int, str]] = {256: "<bos>", 257: "<eos>", 258: "<pad>"}
    NUM_TOKENS = 259

    def __init__(self, vocab_size: int = NUM_TOKENS, specials: bool = True):
        """specials=False: a stand-in for a real model's missing tokenizer. Ids 256-258 are then that
        model's ordinary tokens, so they are not used as <bos> (never added) nor <eos> (never stop)."""
        if vocab_size < self.NUM_TOKENS:
            raise ValueError(
                f"the byte tokenizer needs a vocabulary of at least {self.NUM_TOKENS} tokens, the model has {vocab_size}"
            )
        self.vocab_size = vocab_size  # the model's; ids >= 259 exist but mean nothing here
        self.specials = specials
        self.eos_token_ids = [self.EOS] if specials else []
        self.bos_token_id = self.BOS if specials else None
        self.pad_token_id = self.PAD if specials else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.BOS, *ids] if add_special_tokens and self.specials else ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        parts: list[str] = []
        run = bytearray()
        for i in ids:
            i = int(i)
            if 0 <= i < 256:
                run.append(i)
                continue
            if run:
                parts.append(run.decode("utf-8", errors="replace"))
                run.clear()
            if i in self.SPECIALS and self.specials:
                if not skip_special_tokens:
                    parts.append(self.SPECIALS[i])
            else:
                parts.append("\ufffd")
        if run:
            parts.append(run.decode("utf-8", errors="replace"))
        return "".join(parts)

    def apply_chat_template(self, messages: list[dict[str, Any]], **template_kwargs: Any) -> list[int]:
        """'<|role|>\\ncontent\\n' per message, then '<|assistant|>\\n' for the reply (no template
        variables: template_kwargs are accepted and have nothing to change)."""
        text = "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages) + "<|assistant|>\n"
        return self.encode(text)


class HFTokenizer:
    """A transformers tokenizer behind the `Tokenizer` protocol."""

    def __init__(self, tokenizer: Any, extra_eos_ids: list[int] | None = None):
        self.tokenizer = tokenizer
        eos = [] if tokenizer.eos_token_id is None else [int(tokenizer.eos_token_id)]
        self.eos_token_ids = list(dict.fromkeys(eos + [int(i) for i in extra_eos_ids or []]))
        self.bos_token_id = tokenizer.bos_token_id
        self.pad_token_id = tokenizer.pad_token_id
        self.vocab_size = len(tokenizer)
        self._warned_template = False

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @functools.cached_property
    def cleans_up_spaces(self) -> bool:
        """Whether decode() rewrites spaces after decoding (" ." -> "."), as Llama 3's tokenizer does.

        Observed, not read from the flag: transformers decides per tokenizer type and version whether
        `clean_up_tokenization_spaces` is honoured (5.x ignores it for BPE models)."""
        if not getattr(self.tokenizer, "clean_up_tokenization_spaces", False):
            return False
        probe = self.encode("a . b , c ! d ? e n't f 's g 'm h 've i 're j ' k ' l", add_special_tokens=False)
        return self.decode(probe) != self.decode_raw(probe)

    def decode_raw(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """decode() without the clean-up of spaces: what incremental detokenisation windows need."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def clean_up(self, text: str) -> str:
        """The tokenizer's own clean-up: decode(ids) == clean_up(decode_raw(ids))."""
        return self.tokenizer.clean_up_tokenization(text)

    def apply_chat_template(self, messages: list[dict[str, Any]], **template_kwargs: Any) -> list[int]:
        """template_kwargs become variables of the Jinja template (e.g. enable_thinking=False)."""
        if self.tokenizer.chat_template is None:
            if not self._warned_template:
                warnings.warn("the tokenizer has no chat template; using 'role: content' lines", stacklevel=2)
                self._warned_template = True
            text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "
            return self.encode(text)
        ids = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False, **template_kwargs
        )
        return [int(i) for i in ids]


def _generation_eos(model_dir: Path) -> list[int]:
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return []
    eos = json.loads(path.read_text()).get("eos_token_id")
    if eos is None:
        return []
    return [int(eos)] if isinstance(eos, int) else [int(i) for i in eos]


def has_tokenizer_files(model_dir: Path) -> bool:
    return any((model_dir / name).is_file() for name in TOKENIZER_FILES)


def load_tokenizer(path: str | None, vocab_size: int, tokenizer: str | None = None) -> Tokenizer:
    """The tokenizer for a model.

    tokenizer: "byte" for the built-in byte tokenizer; a directory or cached repo id to load from; None
    to use the model's `path` when it has tokenizer files, else the byte tokenizer (with a warning when
    the model's vocabulary is a real one, i.e. larger than a byte vocabulary).
    """
    from ladle.models.loader import resolve_model_dir

    if tokenizer == "byte":
        return ByteTokenizer(vocab_size)
    source = tokenizer or path
    model_dir = None
    if source:
        try:
            model_dir = resolve_model_dir(source)
        except FileNotFoundError:
            if tokenizer:  # asked for explicitly: not finding it is an error
                raise
    if model_dir is not None and has_tokenizer_files(model_dir):
        from transformers import AutoTokenizer

        hf = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
        return HFTokenizer(hf, _generation_eos(model_dir))
    if tokenizer:
        raise FileNotFoundError(
            f"model.tokenizer={tokenizer!r}: no tokenizer files ({TOKENIZER_FILES}) in {model_dir}"
        )
    if vocab_size > 1024:
        warnings.warn(
            f"no tokenizer files for model.path={path!r}: using the built-in byte tokenizer for a model "
            f"with {vocab_size} tokens; prompts and outputs are bytes, not the model's real tokens",
            stacklevel=2,
        )
    # A stand-in: its <bos>/<eos> ids are ordinary tokens of this model (EOS comes from its config).
    return ByteTokenizer(vocab_size, specials=False)
