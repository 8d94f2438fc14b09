"""A row's prompt as token ids, or the reason it cannot be one.

A prompt is text (str), chat messages (a list of {role, content, ...} in OpenAI's shapes, runner/chat.py;
the tokenizer's chat template is applied) or token ids (a list of int). A null, empty or wrongly typed prompt, or one the tokenizer or
template fails on, becomes an error message for the row's output: one bad row never stops the job.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from ladle.runner.chat import chat_messages


@dataclass(slots=True)
class Encoded:
    token_ids: list[int] | None
    text: str | None  # what the `prompt` output column shows (chat: the messages as JSON)
    error: str | None = None


def _kind_of(value: Any) -> str | None:
    if isinstance(value, str):
        return "text"
    if isinstance(value, (list, tuple, np.ndarray)):
        if len(value) == 0:
            return "empty"
        first = value[0]
        if isinstance(first, dict):
            return "chat"
        if isinstance(first, (int, np.integer)) and not isinstance(first, bool):
            return "tokens"
    return None


def encode_prompt(value: Any, fmt: str, tokenizer: Any, chat_template: bool, column: str,
                  chat_template_kwargs: dict[str, Any] | None = None) -> Encoded:
    """One row's prompt as token ids, or the reason it cannot be (never raises).

    chat_template_kwargs go to the template as variables (vLLM's chat_template_kwargs), e.g.
    {"enable_thinking": False} for Qwen3."""
    kw = chat_template_kwargs or {}
    if value is None:
        return Encoded(None, None, f"prompt is null (column {column!r})")
    kind = _kind_of(value)
    if kind == "empty" or (kind == "text" and not value.strip()):
        return Encoded([], value if kind == "text" else None, f"prompt is empty (column {column!r})")
    if kind is None or (fmt != "auto" and kind != fmt):
        want = "text, chat messages or token ids" if fmt == "auto" else fmt
        return Encoded(None, None, f"prompt in column {column!r} is a {type(value).__name__}, "
                                   f"expected {want} (workload.prompt_format={fmt})")
    try:
        if kind == "tokens":
            ids = [int(x) for x in value]
            if not all(isinstance(x, (int, np.integer)) and not isinstance(x, bool) for x in value):
                raise ValueError("token ids must all be integers")
            return Encoded(ids, None)
        if kind == "chat":
            msgs = chat_messages(list(value))  # each message whole, text parts joined (runner/chat.py)
            text = json.dumps(msgs, ensure_ascii=False, default=str)
            return Encoded(list(tokenizer.apply_chat_template(msgs, **kw)), text)
        if chat_template:
            return Encoded(list(tokenizer.apply_chat_template([{"role": "user", "content": value}], **kw)), value)
        return Encoded(list(tokenizer.encode(value)), value)
    except Exception as e:  # noqa: BLE001 - a tokenizer or template failure is this row's error, not the job's
        return Encoded(None, value if isinstance(value, str) else None, f"prompt could not be tokenized: {e}")
