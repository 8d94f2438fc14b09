"""Streamed text equals the tokenizer's own decode, for tokenizers that rewrite text when decoding.

Tokenizers are built in code with the `tokenizers` library (no downloads) and wrapped as transformers'
PreTrainedTokenizerFast, with clean_up_tokenization_spaces on and off.
"""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from ladle.engine import SamplingParams
from ladle.engine.detokenizer import Detokenizer, DetokState
from ladle.models.tokenizer import HFTokenizer
from tests.engine.helpers import drive, make_engine, use_tokenizer

CORPUS = [
    "Hello , world . Don't stop ! It's fine ; we're here , aren't we ?",
    "Ça va ? Très bien . Naïve café , jalapeño 日本語のテキスト 🙂 emoji 👍🏽 .",
    "I 'm sure you 've seen it . He said ' yes ' and left .",
    "numbers 1 , 2 , 3 . done !",
] * 20


def _word_level(clean: bool) -> PreTrainedTokenizerFast:
    words = sorted({w for line in CORPUS for w in line.split()})
    vocab = {"[UNK]": 0, "[EOS]": 1, **{w: i + 2 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="[EOS]",
                                   clean_up_tokenization_spaces=clean)


def _byte_level_bpe(clean: bool) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["[EOS]"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="[EOS]", clean_up_tokenization_spaces=clean)


def _sentencepiece_style(clean: bool) -> PreTrainedTokenizerFast:
    """Metaspace ('▁' for spaces) with byte fallback, decoded as Llama 2 / Gemma do."""
    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    bytes_ = [f"<0x{i:02X}>" for i in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=380, special_tokens=["<unk>", "[EOS]", *bytes_])
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="[EOS]",
                                   clean_up_tokenization_spaces=clean)


BUILDERS = {"word_level": _word_level, "byte_level_bpe": _byte_level_bpe, "sentencepiece": _sentencepiece_style}


def _sequences(hf: PreTrainedTokenizerFast, n: int = 25) -> list[list[int]]:
    """Real text (whose tokens the clean-up rewrites) and random ids (which split multi-byte characters)."""
    rng = random.Random(0)
    out = [hf.encode(line, add_special_tokens=False) for line in CORPUS[:4]]
    out += [[rng.randrange(len(hf)) for _ in range(rng.randint(1, 40))] for _ in range(n)]
    return out


def _stream(tok: HFTokenizer, prompt: list[int], output: list[int]) -> list[str]:
    detok, state = Detokenizer(tok), DetokState.for_prompt(len(prompt))
    deltas = [detok.step(state, prompt, output[: i + 1]) for i in range(len(output))]
    return [*deltas, detok.flush(state, prompt, output)]


def _build(kind: str, clean: str) -> PreTrainedTokenizerFast:
    """clean: off | on | forced (transformers 5 honours the flag for WordPiece/WordLevel models only,
    unless forced, as Llama 3's BPE tokenizer was cleaned up under transformers 4)."""
    hf = BUILDERS[kind](clean != "off")
    if clean == "forced":
        hf.clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output = True
    return hf


@pytest.mark.parametrize("clean", ["on", "off", "forced"])
@pytest.mark.parametrize("kind", sorted(BUILDERS))
def test_deltas_add_up_to_the_tokenizers_decode(kind, clean):
    hf = _build(kind, clean)
    tok = HFTokenizer(hf)
    assert tok.cleans_up_spaces is (clean == "forced" or (clean == "on" and kind == "word_level"))
    for seq in _sequences(hf):
        prompt, output = seq[: len(seq) // 3], seq[len(seq) // 3 :]
        deltas = _stream(tok, prompt, output)
        assert "".join(deltas) == hf.decode(output, skip_special_tokens=True), (kind, clean, output)


def test_the_old_window_deltas_lost_text_a_clean_up_rewrote():
    """The case that was wrong: ' ' then '.' then 'x' streamed as ' ' + '' + 'x' (the '.' was lost)."""
    hf = _word_level(True)
    ids = hf.encode("Hello , world . Don't", add_special_tokens=False)
    assert "".join(_stream(HFTokenizer(hf), [], ids)) == "Hello, world. Don't" == hf.decode(ids)


@pytest.mark.parametrize("kind", sorted(BUILDERS))
def test_engine_text_equals_decode_of_the_output_ids(tiny_hf_model_dir, monkeypatch, kind):
    """Through LLMEngine, with the model's sampled tokens forced to a script: the streamed deltas add
    up to the final text, and the final text is tokenizer.decode(output_token_ids)."""
    hf = _build(kind, "forced")
    eng = make_engine(tiny_hf_model_dir("qwen3"))
    tok = HFTokenizer(hf)
    use_tokenizer(eng, tok)
    script = hf.encode(CORPUS[1] + " " + CORPUS[0], add_special_tokens=False)
    assert max(script) < eng.vocab_size
    monkeypatch.setattr(eng.sampler, "sample", lambda logits, reqs: [script[len(r.output_token_ids)] for r in reqs])
    rid = eng.add_request(hf.encode("Hello , world", add_special_tokens=False),
                          SamplingParams(max_tokens=len(script), temperature=0.0, ignore_eos=True))
    run = drive(eng)
    deltas, final = [o.new_text for o in run.outputs], run.finished[rid]
    assert final.request_id == rid and final.output_token_ids == script
    assert "".join(deltas) == final.text == hf.decode(script, skip_special_tokens=True)
