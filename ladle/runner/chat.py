"""Chat messages as the chat template receives them, from the OpenAI shapes the ecosystem writes.

Each message reaches the template whole (`tool_calls`, `tool_call_id`, `name` and any other key), as vLLM
passes it. Only these are normalised:
- `content`: a list of text parts is their texts joined by newlines, as vLLM joins them (non-text parts,
  images, cannot run: the row's error); null or absent is "", as in vLLM (an assistant turn that only
  calls tools has none);
- a key whose value is null is left out: a Parquet or Arrow column of message structs has every field
  in every message, null where that message has none, and a template that tests `'tool_calls' in
  message` must not see one there;
- a tool call's `function.arguments` given as JSON text is parsed into a mapping, as vLLM does before
  the template (tool-use templates render the mapping; text would be encoded twice).
"""

from __future__ import annotations

from typing import Any

from ladle.runner.text import TooDeep, load_json


class BadMessage(ValueError):
    """A message no template can be given (the text names the message: `where`)."""


def chat_messages(value: list[Any], where: str = "message {i}") -> list[dict[str, Any]]:
    """Every message of a row, normalised; `where` names message i in an error (`body.messages[{i}]`)."""
    return [chat_message(m, where.format(i=i)) for i, m in enumerate(value)]


def chat_message(m: Any, where: str) -> dict[str, Any]:
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise BadMessage(f"{where} is not a {{role, content}} object with a string role: {m!r:.80}")
    msg = {k: v for k, v in m.items() if v is not None}
    msg["content"] = content_text(m.get("content"), where)
    if "tool_calls" in msg:
        msg["tool_calls"] = _tool_calls(msg["tool_calls"], where)
    return msg


def content_text(content: Any, where: str) -> str:
    """A message's content as text: a string as it is, text parts joined by "\n" (vLLM's join), null as ""."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, (list, tuple)):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise BadMessage(f"{where}.content has a part that is not text: {part!r:.80}")
            texts.append(part["text"])
        return "\n".join(texts)
    raise BadMessage(f"{where}.content must be a string or a list of text parts, not a {type(content).__name__}")


def _tool_calls(calls: Any, where: str) -> list[Any]:
    if not isinstance(calls, (list, tuple)) or not all(isinstance(c, dict) for c in calls):
        raise BadMessage(f"{where}.tool_calls must be a list of tool call objects: {calls!r:.80}")
    return [_tool_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(calls)]


def _tool_call(call: dict[str, Any], where: str) -> dict[str, Any]:
    """The call with its function's arguments as a mapping (absent or empty: {})."""
    fn = call.get("function")
    if not isinstance(fn, dict):
        return call
    args = fn.get("arguments")
    if isinstance(args, str) and args.strip():
        try:
            args = load_json(args)  # capped as every row's JSON is (runner/text.py): the template walks it
        except TooDeep as e:
            raise BadMessage(f"{where}.function.arguments is {e}") from None
        except ValueError as e:
            raise BadMessage(f"{where}.function.arguments is not JSON text: {e}") from None
    elif not args:
        args = {}
    return {**call, "function": {**fn, "arguments": args}}
