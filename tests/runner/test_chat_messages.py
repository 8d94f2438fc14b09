"""Chat rows in the OpenAI shapes the ecosystem writes reach the chat template whole: content as a list of
text parts (joined by newlines, as vLLM joins them), an assistant turn of tool calls with null content, a tool
message with its tool_call_id and name. transformers' own rendering of the messages as vLLM hands them to
it is the reference."""

from __future__ import annotations

import copy
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ladle.runner.job import run_job
from ladle.runner.prompts import encode_prompt
from ladle.runner.sources.openai_batch import parse_line
from tests.runner.conftest import compose_cfg
from tests.runner.fake_engine import FakeEngine

TOOL_TURNS = [
    {"role": "system", "content": "You answer with tools."},
    {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}, {"type": "text", "text": "One word."}]},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "18 C"},
]
# What the template is given (vLLM's conversation): text parts joined by a newline (vLLM's "\n".join of the
# parts' texts for a template that takes content as a string), null content "", arguments a mapping.
AS_THE_TEMPLATE_SEES = [
    {"role": "system", "content": "You answer with tools."},
    {"role": "user", "content": "Weather in Paris?\nOne word."},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "18 C"},
]

# A tool-use template in the style of Qwen's and Llama 3.1's: it reads tool_calls, tool_call_id and name.
TOOL_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>"
    "{% if m['name'] is defined %}[{{ m['name'] }}]{% endif %}"
    "{% if m['tool_call_id'] is defined %}({{ m['tool_call_id'] }}){% endif %}"
    "{{ m['content'] }}"
    "{% if 'tool_calls' in m %}{% for c in m['tool_calls'] %}<call {{ c['id'] }}>{{ c['function']['name'] }}"
    "{{ c['function']['arguments'] | tojson }}</call>{% endfor %}{% endif %}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture(scope="module")
def hf_tokenizer():
    """A byte-level transformers tokenizer (any text encodes) with the tool-use template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from ladle.models.tokenizer import HFTokenizer

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    raw = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token=alphabet[0])
    tok.chat_template = TOOL_TEMPLATE
    return HFTokenizer(tok)


def test_tool_turns_and_text_parts_render_as_transformers_renders_them(hf_tokenizer):
    """Before: the text-part content and the null content were the row's error, and tool_calls,
    tool_call_id and name were cut away before the template."""
    enc = encode_prompt(copy.deepcopy(TOOL_TURNS), "auto", hf_tokenizer, False, "messages")
    assert enc.error is None, enc.error
    want = hf_tokenizer.tokenizer.apply_chat_template(AS_THE_TEMPLATE_SEES, add_generation_prompt=True,
                                                      tokenize=True, return_dict=False)
    assert enc.token_ids == list(want)
    text = hf_tokenizer.tokenizer.decode(enc.token_ids)
    assert '<call call_1>get_weather{"city": "Paris"}</call>' in text  # the arguments encoded once
    assert "<|tool|>[get_weather](call_1)18 C" in text and "<|user|>Weather in Paris?\nOne word." in text
    assert json.loads(enc.text) == AS_THE_TEMPLATE_SEES  # the prompt column shows what the template got


class RecordingTokenizer(FakeEngine().tokenizer.__class__):
    def __init__(self) -> None:
        self.seen: list[list[dict]] = []

    def apply_chat_template(self, messages: list[dict], **kw) -> list[int]:
        self.seen.append(copy.deepcopy(messages))
        return super().apply_chat_template(messages)


def run_and_record(tmp_path, *overrides: str) -> tuple[list[dict], list[list[dict]]]:
    engine = FakeEngine()
    engine.tokenizer = RecordingTokenizer()
    run_job(compose_cfg(*overrides, "workload.prompt_column=messages"), tmp_path / "out", engine=engine)
    rows = sorted(pq.read_table(tmp_path / "out" / "generations.parquet").to_pylist(), key=lambda r: r["index"])
    return rows, engine.tokenizer.seen


def test_a_jsonl_messages_column_in_the_openai_shapes_runs(tmp_path):
    path = tmp_path / "chats.jsonl"
    path.write_text("\n".join(json.dumps({"messages": m}) for m in (TOOL_TURNS, TOOL_TURNS[:2])) + "\n")
    rows, seen = run_and_record(tmp_path, "workload=jsonl", f"workload.path={path}")
    assert [r["error"] for r in rows] == [None, None]
    assert seen == [AS_THE_TEMPLATE_SEES, AS_THE_TEMPLATE_SEES[:2]]


def test_a_parquet_column_of_message_structs_drops_the_null_fields_each_message_lacks(tmp_path):
    """Arrow gives every struct every field: a user message has tool_calls=None there, which a template
    testing `'tool_calls' in message` must not see."""
    turns = [{**m, "content": m["content"] if isinstance(m["content"], str) or m["content"] is None
              else "Weather in Paris?\nOne word."} for m in TOOL_TURNS]
    path = tmp_path / "chats.parquet"
    pq.write_table(pa.table({"messages": [turns]}), path)
    assert pq.read_table(path).to_pylist()[0]["messages"][0]["tool_calls"] is None  # as Arrow stores it
    rows, seen = run_and_record(tmp_path, "workload=parquet", f"workload.path={path}")
    assert rows[0]["error"] is None and seen == [AS_THE_TEMPLATE_SEES]


@pytest.mark.parametrize("message,error", [
    ({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}, "has a part that is not text"),
    ({"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function",
                                                            "function": {"name": "f", "arguments": "{oops"}}]},
     "tool_calls[0].function.arguments is not JSON text"),
    ({"role": "assistant", "content": "x", "tool_calls": "f()"}, "tool_calls must be a list"),
    # arguments as JSON text are capped as any row's JSON is (before, 200 levels reached the template)
    ({"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function", "function": {
        "name": "f", "arguments": "[" * 200 + "]" * 200}}]}, "arguments is nested too deeply: more than 128 levels"),
])
def test_messages_no_template_can_take_are_the_rows_error(message, error):
    enc = encode_prompt([message], "auto", FakeEngine().tokenizer, False, "messages")
    assert enc.token_ids is None and error in enc.error, enc.error


def test_a_batch_line_passes_its_messages_whole():
    line = parse_line(json.dumps({"custom_id": "c", "method": "POST", "url": "/v1/chat/completions",
                                  "body": {"messages": TOOL_TURNS}}), 1, set())
    assert line.error is None and line.prompt == AS_THE_TEMPLATE_SEES


def test_a_message_with_null_or_no_content_is_empty_text_as_in_vllm():
    """vLLM reads a null or absent content as no text in any role; the template gets ""."""
    enc = encode_prompt([{"role": "user", "content": None}, {"role": "tool", "tool_call_id": "c"}], "auto",
                        FakeEngine().tokenizer, False, "messages")
    assert enc.error is None and FakeEngine().tokenizer.decode(enc.token_ids).count("<user>\n<tool>\n") == 1
