"""OpenAI Batch API input files as a source: one request per line, its sampling from the body.

Input, one request per line (https://platform.openai.com/docs/api-reference/batch/request-input):
    {"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "...", "messages": [...], "max_completion_tokens": 64, "temperature": 0.7, ...}}
`url` is /v1/chat/completions (body.messages; the chat template is applied) or /v1/completions
(body.prompt: text or token ids). The body's sampling fields become the row's sampling values, and the
fields the format defines take its defaults, not the config's (runner/sources/openai_body.py); fields
ladle has no use for (model, user, penalties, stream...) are ignored. A line that cannot run (not JSON,
no custom_id, a duplicate custom_id, another url, a bad body) becomes an error row and an error line in
the output, never a stopped job. A row's id is its line's custom_id; a line without a usable one has
no id (null), which no custom_id can collide with; a duplicate's error row has the repeated id, told
apart by its row index as any repeated id's is.

The output file is written by runner/batch_output.py.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ladle.engine.sampling_params import SamplingParams
from ladle.runner.chat import BadMessage, chat_messages
from ladle.runner.config import WorkloadConfig
from ladle.runner.sources.base import Source, limit_total, row_failure
from ladle.runner.sources.jsonl import count_lines, jsonl_files, read_lines
from ladle.runner.sources.openai_body import BODY_KEYS, BadLine, body_sampling, format_defaults
from ladle.runner.sources.rows import Row, batched, duplicate_id_error
from ladle.runner.sources.shard import Shard
from ladle.runner.text import TooDeep, clean, load_json

log = logging.getLogger("ladle")

CHAT_URL, COMPLETIONS_URL = "/v1/chat/completions", "/v1/completions"
URLS = (CHAT_URL, COMPLETIONS_URL)


@dataclass
class BatchLine:
    """One parsed input line: what to run, or why it cannot run."""

    lineno: int  # from 1, counting non-blank lines of all files in order
    custom_id: str | None  # as the output file shows it
    url: str | None = None
    prompt: Any = None  # chat messages, text, or token ids
    sampling: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    row_id: str | None = None  # the generations id: the custom_id when the line has a usable one
    echo: bool = False  # completions: the prompt goes before the completion (and its logprobs)


def _messages(msgs: list[Any]) -> list[dict[str, Any]]:
    """The messages as the template takes them (runner/chat.py: whole, text parts joined)."""
    try:
        return chat_messages(msgs, "body.messages[{i}]")
    except BadMessage as e:
        raise BadLine(str(e)) from None


def parse_line(text: str, lineno: int, seen: set[str]) -> BatchLine:
    """One input line as a BatchLine (never raises; `seen` collects the custom_ids so far)."""
    try:
        obj = clean(load_json(text))  # where its strings enter: runner/text.py's rule
    except TooDeep as e:
        return BatchLine(lineno, None, error=f"line {lineno} is {e}")
    except ValueError as e:
        return BatchLine(lineno, None, error=f"line {lineno} is not valid JSON: {e}")
    if not isinstance(obj, dict):
        return BatchLine(lineno, None, error=f"line {lineno} is a JSON {type(obj).__name__}, not an object")
    cid = obj.get("custom_id")
    if not isinstance(cid, str) or not cid:
        return BatchLine(lineno, None if cid is None else str(cid),
                         error=f"line {lineno} has no custom_id (a non-empty string is needed)")
    if cid in seen:
        return BatchLine(lineno, cid, row_id=cid, error=f"{duplicate_id_error(cid, 'custom_id')}: line {lineno} "
                                                        "repeats an earlier line's")
    seen.add(cid)
    line = BatchLine(lineno, cid, url=obj.get("url"), row_id=cid)
    try:
        _parse_request(obj, line)
    except BadLine as e:
        line.error = f"line {lineno} (custom_id {cid!r}): {e}"
        line.prompt = None
    except Exception as e:  # noqa: BLE001 - a body nothing above foresaw is this line's error, not the batch's
        line.error = f"line {lineno} (custom_id {cid!r}): {row_failure('its body', e)}"
        line.prompt = None
    return line


def _parse_request(obj: dict[str, Any], line: BatchLine) -> None:
    if obj.get("method", "POST") != "POST":
        raise BadLine(f"method={obj.get('method')!r} is not supported: use POST")
    if line.url not in URLS:
        raise BadLine(f"url={line.url!r} is not supported: use {' or '.join(URLS)}")
    body = obj.get("body")
    if not isinstance(body, dict):
        raise BadLine("body is missing or not an object")
    chat = line.url == CHAT_URL
    if "messages" in body and "prompt" in body:
        raise BadLine("body has both messages and prompt: give one (messages for chat, prompt for completions)")
    if chat:
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise BadLine(f"body.messages must be a non-empty list for {CHAT_URL}")
        line.prompt = _messages(msgs)
    else:
        p = body.get("prompt")
        if isinstance(p, list) and p and all(isinstance(x, str) for x in p):
            if len(p) != 1:
                raise BadLine(f"body.prompt holds {len(p)} prompts: give one prompt per line")
            p = p[0]
        if not (isinstance(p, str) or (isinstance(p, list) and p and all(
                isinstance(x, int) and not isinstance(x, bool) for x in p))):
            raise BadLine(f"body.prompt must be a string or a list of token ids for {COMPLETIONS_URL}")
        line.prompt = p
        line.echo = body.get("echo") is True
    line.sampling = body_sampling(body, chat)


def parse_lines(files: list[Path], limit: int | None = None) -> Iterator[BatchLine]:
    """Every non-blank line of the files, parsed (a line that is not UTF-8 is an error line too)."""
    seen: set[str] = set()
    for line in read_lines(files, limit):
        n = line.index + 1
        try:
            text = line.raw.decode("utf-8-sig" if line.lineno == 1 else "utf-8")  # a BOM may start each file
        except UnicodeDecodeError as e:
            yield BatchLine(n, None, error=f"line {n} is not UTF-8 text: {e}")
            continue
        yield parse_line(text, n, seen)


class OpenAIBatchSource(Source):
    """The input JSONL as rows: id = custom_id, prompt = messages | text | token ids, sampling from body."""

    def __init__(self, workload: WorkloadConfig, arrival_column: str | None, shard: Shard | None = None) -> None:
        super().__init__(workload, arrival_column, shard)
        self.files = jsonl_files(workload)
        self.description = f"openai_batch {workload.path} ({len(self.files)} files)"
        self.num_rows = limit_total(count_lines(self.files), workload.limit)

    @property
    def value_names(self) -> dict[str, str]:
        return {**{k: f"body.{k}" for k in BODY_KEYS},
                "max_tokens": "body.max_tokens / max_completion_tokens", "logprobs": "body.logprobs / top_logprobs",
                "prompt_logprobs": "body.logprobs (echo)", "json_schema": "body.response_format"}

    def row_base(self, base: SamplingParams, model: Any) -> SamplingParams:
        """The fields the format defines take its defaults (openai_body.py), not the config's."""
        defaults = format_defaults(model)
        shown = ", ".join(f"{k}={defaults[k]}" for k in ("temperature", "top_p", "top_k", "min_p"))
        log.info("openai_batch: lines that leave them out sample with %s (the format's defaults)", shown)
        return dataclasses.replace(base, **defaults)

    def read(self) -> Iterator[list[Row]]:
        # Every line is parsed, a shard's too: a custom_id is a duplicate of any earlier line's.
        rows = (Row(index=line.lineno - 1, id=line.row_id, prompt=line.prompt, error=line.error,
                    sampling=line.sampling or None) for line in parse_lines(self.files, self.workload.limit))
        return batched(rows, self.workload.batch_size)
