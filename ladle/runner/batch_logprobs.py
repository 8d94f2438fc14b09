"""A batch output choice's `logprobs`, in the two shapes of the OpenAI API, from a generations row.

Chat completions: `{"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}`.
Completions: `{tokens, token_logprobs, top_logprobs: [{token: logprob}], text_offset}`; with `echo` the
prompt's tokens come first, the first of them with null logprobs (nothing predicts it), as OpenAI and vLLM
write a scoring line's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class Echo:
    """A completions line's prompt, put before the completion (`echo: true`)."""

    text: str
    token_ids: list[int]


def _token(tokenizer: Any, tid: int) -> dict[str, Any]:
    text = tokenizer.decode([tid])
    return {"token": text, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(r: dict[str, Any], tokenizer: Any) -> dict[str, Any] | None:
    if r.get("logprobs") is None:
        return None
    content = []
    tops = r.get("top_logprobs") or [[] for _ in r["logprobs"]]
    for tid, lp, top in zip(r["output_token_ids"], r["logprobs"], tops, strict=False):
        content.append({**_token(tokenizer, tid), "logprob": lp,
                        "top_logprobs": [{**_token(tokenizer, t["token_id"]), "logprob": t["logprob"]}
                                         for t in (top or [])]})
    return {"content": content}


def _top_dict(top: list[dict[str, Any]] | None, tokenizer: Any) -> dict[str, float]:
    return {tokenizer.decode([t["token_id"]]): t["logprob"] for t in (top or [])}


def completion_logprobs(r: dict[str, Any], tokenizer: Any, echo: Echo | None = None,
                        wanted: bool = False) -> dict[str, Any] | None:
    """`wanted`: the line asked for logprobs (a scoring line has no generated token to show it by)."""
    if r.get("logprobs") is None and not wanted:
        return None
    ids = list(r["output_token_ids"] or [])
    logprobs = list(r.get("logprobs") or [])
    tops = [_top_dict(top, tokenizer) for top in (r.get("top_logprobs") or [[] for _ in ids])]
    if echo is not None:
        prompt_lps = list(r.get("prompt_logprobs") or [None] * len(echo.token_ids))
        prompt_tops = r.get("prompt_top_logprobs") or [[] for _ in echo.token_ids]
        ids = echo.token_ids + ids
        logprobs = prompt_lps + logprobs
        tops = [None if i == 0 else _top_dict(top, tokenizer) for i, top in enumerate(prompt_tops)] + tops
    tokens = [tokenizer.decode([t]) for t in ids]
    offsets, pos = [], 0
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    return {"tokens": tokens, "token_logprobs": logprobs, "text_offset": offsets, "top_logprobs": tops}
