"""OpenAI Batch API files: read the input JSONL as a source, write the matching output JSONL.

Input, one request per line (https://platform.openai.com/docs/api-reference/batch/request-input):
    {"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "...", "messages": [...], "max_completion_tokens": 64, "temperature": 0.7, ...}}
`url` is /v1/chat/completions (body.messages; the chat template is applied) or /v1/completions
(body.prompt: text or token ids). The body's sampling fields become the row's sampling values (they
override the config's `sampling` defaults); fields ladle has no use for (model, user, penalties,
stream...) are ignored. A line that cannot run (not JSON, no custom_id, a duplicate custom_id, another
url, a bad body) becomes an error row and an error line in the output, never a stopped job.

Output (`batch_output.jsonl` in the run directory, the format `vllm run-batch` and OpenAI write), one
line per input line in input order:
    {"id": "batch_req_<line>", "custom_id": "r1",
     "response": {"status_code": 200, "request_id": "req_<line>", "body": <chat.completion | text_completion>},
     "error": null}
and for a failed request `"response": {"status_code": 400, "request_id": ..., "body": null}` with
`"error": {"code": "invalid_request" | "generation_failed", "message": ...}`. The n samples of a request
are its `choices`. It is rebuilt from generations.parquet at the end of every complete run (written to
a .tmp, then renamed), so a resumed run's file covers every line.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from runner.config import WorkloadConfig
from runner.source import JSONL_SUFFIXES, Row, Source, _files, _limit_total, _resolve

BATCH_OUTPUT = "batch_output.jsonl"
CHAT_URL, COMPLETIONS_URL = "/v1/chat/completions", "/v1/completions"
URLS = (CHAT_URL, COMPLETIONS_URL)


class BadLine(ValueError):
    """A batch input line that cannot be run (the message becomes its error)."""


@dataclass
class BatchLine:
    """One parsed input line: what to run, or why it cannot run."""

    lineno: int  # from 1, counting non-blank lines of all files in order
    custom_id: str | None
    url: str | None = None
    prompt: Any = None  # chat messages, text, or token ids
    sampling: dict[str, Any] = field(default_factory=dict)
    error: str | None = None

    @property
    def row_id(self) -> str:
        """The generations id: the custom_id, or `<line N>` for a line that cannot run under it."""
        return f"<line {self.lineno}>" if self.error else str(self.custom_id)


def _content(m: Any, i: int) -> dict[str, str]:
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise BadLine(f"body.messages[{i}] is not a {{role, content}} object")
    c = m.get("content")
    if isinstance(c, list):  # content parts: only text parts can be run
        texts = []
        for part in c:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise BadLine(f"body.messages[{i}].content has a part that is not text: {part!r:.80}")
            texts.append(part["text"])
        c = "".join(texts)
    if c is None:
        c = ""
    if not isinstance(c, str):
        raise BadLine(f"body.messages[{i}].content must be a string or a list of text parts")
    return {"role": m["role"], "content": c}


def _sampling(body: dict[str, Any], chat: bool) -> dict[str, Any]:
    """The body's sampling fields by ladle's sampling keys (values checked later, per row)."""
    s: dict[str, Any] = {}
    mt = body.get("max_completion_tokens") if chat else None
    mt = mt if mt is not None else body.get("max_tokens")
    if mt is not None:
        s["max_tokens"] = mt
    for key in ("temperature", "top_p", "n", "stop", "seed", "top_k", "min_p"):
        if body.get(key) is not None:
            s[key] = body[key]
    if chat:
        if body.get("logprobs") not in (None, False):
            if body["logprobs"] is not True:
                raise BadLine(f"body.logprobs={body['logprobs']!r} must be true or false (chat completions)")
            s["logprobs"] = body.get("top_logprobs") or 0
        elif body.get("top_logprobs"):
            raise BadLine("body.top_logprobs needs body.logprobs=true")
    elif body.get("logprobs") is not None:
        s["logprobs"] = body["logprobs"]
    rf = body.get("response_format")
    if rf is not None:
        kind = rf.get("type") if isinstance(rf, dict) else None
        if kind == "json_schema":
            js = rf.get("json_schema")
            if not isinstance(js, dict) or not isinstance(js.get("schema"), (dict, bool)):
                raise BadLine("body.response_format.json_schema.schema is missing (an object is needed)")
            s["json_schema"] = js["schema"]
        elif kind == "json_object":
            s["json_schema"] = {"type": "object"}
        elif kind != "text":
            raise BadLine(f"body.response_format={rf!r:.80}: type must be text, json_object or json_schema")
    return s


def parse_line(text: str, lineno: int, seen: set[str]) -> BatchLine:
    """One input line as a BatchLine (never raises; `seen` collects the custom_ids so far)."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        return BatchLine(lineno, None, error=f"line {lineno} is not valid JSON: {e}")
    if not isinstance(obj, dict):
        return BatchLine(lineno, None, error=f"line {lineno} is a JSON {type(obj).__name__}, not an object")
    cid = obj.get("custom_id")
    if not isinstance(cid, str) or not cid:
        return BatchLine(lineno, None if cid is None else str(cid),
                         error=f"line {lineno} has no custom_id (a non-empty string is needed)")
    if cid in seen:
        return BatchLine(lineno, cid, error=f"line {lineno}: custom_id {cid!r} is a duplicate of an earlier line")
    seen.add(cid)
    line = BatchLine(lineno, cid, url=obj.get("url"))
    try:
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
            line.prompt = [_content(m, i) for i, m in enumerate(msgs)]
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
        line.sampling = _sampling(body, chat)
    except BadLine as e:
        line.error = f"line {lineno} (custom_id {cid!r}): {e}"
        line.prompt = None
    return line


def read_lines(files: list[Path], limit: int | None = None) -> Iterator[BatchLine]:
    """Every non-blank line of the files, parsed (a line that is not UTF-8 is an error line too)."""
    seen: set[str] = set()
    n = 0
    for f in files:
        with open(f, "rb") as fh:
            for lineno, raw in enumerate(fh):
                if not raw.strip():
                    continue
                if limit is not None and n >= limit:
                    return
                n += 1
                try:
                    text = raw.decode("utf-8-sig" if lineno == 0 else "utf-8")  # a BOM may start each file
                except UnicodeDecodeError as e:
                    yield BatchLine(n, None, error=f"line {n} is not UTF-8 text: {e}")
                    continue
                yield parse_line(text, n, seen)


def _count_lines(f: Path) -> int:
    with open(f, "rb") as fh:
        return sum(1 for t in fh if t.strip())


class OpenAIBatchSource(Source):
    """The input JSONL as rows: id = custom_id, prompt = messages | text | token ids, sampling from body."""

    def __init__(self, cfg: WorkloadConfig, arrival_column: str | None) -> None:
        super().__init__(cfg, arrival_column)
        self.files = _files(_resolve(cfg.path), JSONL_SUFFIXES, "openai_batch")
        self.description = f"openai_batch {cfg.path} ({len(self.files)} files)"
        self.total = _limit_total(sum(_count_lines(f) for f in self.files), cfg.limit)

    @property
    def value_names(self) -> dict[str, str]:
        return {**{k: f"body.{k}" for k in ("temperature", "top_p", "n", "stop", "seed", "top_k", "min_p")},
                "max_tokens": "body.max_tokens / max_completion_tokens", "logprobs": "body.logprobs / top_logprobs",
                "json_schema": "body.response_format"}

    def batches(self) -> Iterator[list[Row]]:
        batch: list[Row] = []
        for index, line in enumerate(read_lines(self.files, self.cfg.limit)):
            batch.append(Row(index=index, id=line.row_id, prompt=line.prompt, error=line.error,
                             sampling=line.sampling or None))
            if len(batch) >= self.cfg.batch_size:
                yield batch
                batch = []
        if batch:
            yield batch


# ---------------------------------------------------------------------------------------------------------
# output


OUTPUT_COLUMNS = ["id", "sample_index", "prompt_tokens", "output_text", "output_token_ids", "output_tokens",
                  "finish_reason", "error", "logprobs", "top_logprobs"]


def _token(tokenizer: Any, tid: int) -> dict[str, Any]:
    text = tokenizer.decode([tid])
    return {"token": text, "bytes": list(text.encode("utf-8"))}


def _chat_logprobs(r: dict[str, Any], tokenizer: Any) -> dict[str, Any] | None:
    if r.get("logprobs") is None:
        return None
    content = []
    tops = r.get("top_logprobs") or [[] for _ in r["logprobs"]]
    for tid, lp, top in zip(r["output_token_ids"], r["logprobs"], tops, strict=False):
        content.append({**_token(tokenizer, tid), "logprob": lp,
                        "top_logprobs": [{**_token(tokenizer, t["token_id"]), "logprob": t["logprob"]}
                                         for t in (top or [])]})
    return {"content": content}


def _completion_logprobs(r: dict[str, Any], tokenizer: Any) -> dict[str, Any] | None:
    if r.get("logprobs") is None:
        return None
    tokens = [tokenizer.decode([t]) for t in r["output_token_ids"]]
    offsets, pos = [], 0
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    tops = r.get("top_logprobs") or [[] for _ in tokens]
    return {"tokens": tokens, "token_logprobs": list(r["logprobs"]), "text_offset": offsets,
            "top_logprobs": [{tokenizer.decode([t["token_id"]]): t["logprob"] for t in (top or [])} for top in tops]}


def _body(line: BatchLine, samples: list[dict[str, Any]], model: str, created: int, tokenizer: Any) -> dict:
    chat = line.url == CHAT_URL
    choices = []
    for k, r in enumerate(samples):
        choice: dict[str, Any] = {"index": k, "finish_reason": r["finish_reason"]}
        if chat:
            choice["message"] = {"role": "assistant", "content": r["output_text"]}
            choice["logprobs"] = _chat_logprobs(r, tokenizer)
        else:
            choice["text"] = r["output_text"]
            choice["logprobs"] = _completion_logprobs(r, tokenizer)
        choices.append(choice)
    prompt = samples[0]["prompt_tokens"] or 0
    completion = sum(r["output_tokens"] or 0 for r in samples)
    return {"id": f"{'chatcmpl' if chat else 'cmpl'}-{line.lineno}", "object": "chat.completion" if chat
            else "text_completion", "created": created, "model": model, "choices": choices,
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}}


def _error_line(line: BatchLine, code: str, message: str) -> dict[str, Any]:
    return {"id": f"batch_req_{line.lineno}", "custom_id": line.custom_id,
            "response": {"status_code": 400, "request_id": f"req_{line.lineno}", "body": None},
            "error": {"code": code, "message": message}}


def write_batch_output(cfg: WorkloadConfig, gen_path: Path, out_path: Path, tokenizer: Any, model: str) -> Path:
    """The output JSONL for the input file(s) of `cfg`, from generations.parquet, written atomically."""
    rows: dict[str, list[dict[str, Any]]] = {}
    pf = pq.ParquetFile(gen_path)
    for batch in pf.iter_batches(columns=OUTPUT_COLUMNS):
        for r in batch.to_pylist():
            rows.setdefault(r["id"], []).append(r)
    created = int(time.time())
    tmp = out_path.with_name(out_path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        for line in read_lines(_files(_resolve(cfg.path), JSONL_SUFFIXES, "openai_batch"), cfg.limit):
            if line.error:
                out = _error_line(line, "invalid_request", line.error)
            else:
                got = {r["sample_index"] or 0: r for r in rows.get(line.row_id, [])}
                samples = [got[k] for k in sorted(got)]
                ok = [r for r in samples if r["finish_reason"] != "error"]
                if not ok:
                    message = samples[0]["error"] if samples else "no output was written for this request"
                    out = _error_line(line, "invalid_request" if samples else "generation_failed", message)
                else:
                    out = {"id": f"batch_req_{line.lineno}", "custom_id": line.custom_id,
                           "response": {"status_code": 200, "request_id": f"req_{line.lineno}",
                                        "body": _body(line, ok, model, created, tokenizer)},
                           "error": None}
            fh.write(json.dumps(out, ensure_ascii=False) + "\n")
    os.replace(tmp, out_path)
    return out_path
