"""Tokenizers: the built-in byte tokenizer and transformers' tokenizers behind one protocol."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from ladle.models import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer

TEXT = "Héllo, wörld! 世界 🙂\n\ttabs & ünïcödé — end"


def test_byte_tokenizer_round_trips_non_ascii():
    tok = ByteTokenizer(512)
    ids = tok.encode(TEXT)
    assert ids[0] == tok.bos_token_id and all(0 <= i < 256 for i in ids[1:])
    assert len(ids) == 1 + len(TEXT.encode("utf-8"))
    assert tok.decode(ids) == TEXT
    assert tok.decode(ids, skip_special_tokens=False) == "<bos>" + TEXT
    assert tok.encode(TEXT, add_special_tokens=False) == ids[1:]
    assert isinstance(tok, Tokenizer)


def test_byte_tokenizer_decodes_incomplete_utf8_and_unknown_ids():
    tok = ByteTokenizer(512)
    emoji = list("🙂".encode())
    assert tok.decode(emoji[:2]) == "\ufffd"  # a cut multi-byte character: replaced, no exception
    assert tok.decode([*b"ok", 300, *b"!"]) == "ok\ufffd!"  # an id the byte table does not know
    assert tok.decode([*b"a", tok.EOS, *b"b"]) == "ab"
    assert tok.decode([*b"a", tok.EOS], skip_special_tokens=False) == "a<eos>"


def test_byte_chat_template():
    tok = ByteTokenizer(259)
    ids = tok.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    )
    assert tok.decode(ids) == "<|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\n"


def test_byte_tokenizer_needs_room_in_the_vocabulary():
    with pytest.raises(ValueError, match="259"):
        ByteTokenizer(200)


def test_load_tokenizer_falls_back_to_bytes():
    assert isinstance(load_tokenizer(None, 512, "byte"), ByteTokenizer)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert isinstance(load_tokenizer(None, 512), ByteTokenizer)  # tiny model: no warning
    with pytest.warns(UserWarning, match="byte tokenizer"):
        assert isinstance(load_tokenizer(None, 151936), ByteTokenizer)  # a real-size random model


@pytest.fixture(scope="module")
def hf_tokenizer_dir(tmp_path_factory):
    """A small word-level tokenizer with a chat template, saved as transformers saves real ones."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = [
        "<unk>",
        "<s>",
        "</s>",
        "<|user|>",
        "<|assistant|>",
        "<|end|>",
        "hello",
        "world",
        "how",
        "are",
        "you",
    ]
    raw = RawTokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    tok.add_special_tokens({"additional_special_tokens": ["<|user|>", "<|assistant|>", "<|end|>"]})
    tok.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    path = tmp_path_factory.mktemp("hf_tokenizer")
    tok.save_pretrained(path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 5]}))
    return path


def test_hf_tokenizer_from_a_model_directory(hf_tokenizer_dir):
    tok = load_tokenizer(str(hf_tokenizer_dir), 64)
    assert isinstance(tok, HFTokenizer) and isinstance(tok, Tokenizer)
    assert tok.eos_token_ids == [2, 5] and tok.bos_token_id == 1 and tok.vocab_size == 11
    ids = tok.encode("hello world", add_special_tokens=False)
    assert ids == [6, 7] and tok.decode(ids) == "hello world"
    chat = tok.apply_chat_template([{"role": "user", "content": "how are you"}])
    assert chat == [3, 8, 9, 10, 5, 4]
    assert tok.decode(chat, skip_special_tokens=True) == "how are you"


def test_explicit_tokenizer_that_cannot_be_found_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_tokenizer(None, 512, str(tmp_path / "missing"))


def test_byte_fallback_for_a_real_vocabulary_adds_no_special_ids():
    """A stand-in for a real model's missing tokenizer: 256-258 are that model's ordinary tokens, so
    they are neither an EOS that stops generation nor a BOS put before every prompt."""
    with pytest.warns(UserWarning, match="byte tokenizer"):
        tok = load_tokenizer(None, 151936)
    assert tok.eos_token_ids == [] and tok.bos_token_id is None
    assert tok.encode("hi") == [104, 105]
    assert tok.decode([104, 257, 105]) == "h\ufffdi"  # an id the stand-in cannot name
    explicit = load_tokenizer(None, 512, "byte")  # the built-in tiny model's own tokenizer keeps them
    assert explicit.eos_token_ids == [257] and explicit.encode("hi") == [256, 104, 105]


def test_engine_eos_ids_come_from_the_model_when_the_tokenizer_is_a_stand_in(tiny_hf_model_dir):
    from ladle.engine import CacheConfig, EngineConfig, LLMEngine, ModelConfig

    eng = LLMEngine(EngineConfig(model=ModelConfig(path=str(tiny_hf_model_dir("qwen3")), device="cpu"),
                                 cache=CacheConfig(max_model_len=256)))
    assert eng.eos_token_ids == set(eng.model.arch.eos_token_ids) and 257 not in eng.eos_token_ids
    assert eng.dtype == torch.float32  # dtype auto on CPU


def test_chat_template_kwargs_reach_the_template(hf_tokenizer_dir):
    """vLLM's chat_template_kwargs: template variables such as Qwen3's enable_thinking."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(hf_tokenizer_dir), local_files_only=True)
    hf.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
        "{% if enable_thinking is defined and not enable_thinking %} <|end|>{% endif %}"
    )
    tok = HFTokenizer(hf)
    msgs = [{"role": "user", "content": "hello"}]
    assert tok.apply_chat_template(msgs) == [3, 6, 5, 4]
    assert tok.apply_chat_template(msgs, enable_thinking=False) == [3, 6, 5, 4, 5]
    assert ByteTokenizer(512).apply_chat_template(msgs, enable_thinking=False) == ByteTokenizer(
        512).apply_chat_template(msgs)
