"""output_kind="final_only" (vLLM's RequestOutputKind.FINAL_ONLY): one output per finished request,
the same tokens and text as "delta", and no per-step detokenising unless a stop string needs it."""

from __future__ import annotations

import dataclasses

import pytest

from ladle.engine import SamplingParams
from ladle.models.tokenizer import HFTokenizer
from tests.engine.helpers import drive, make_engine, use_tokenizer
from tests.engine.test_detokenizer import BUILDERS, CORPUS, _build


def _run(eng, prompts, params):
    """Every output of every step, per request id, in order."""
    ids = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
    run = drive(eng)
    return [run.of(i) for i in ids]


def _scripted(tiny_hf_model_dir, monkeypatch, kind):
    """An engine whose 'model' emits CORPUS text through a clean-up tokenizer (text the clean-up rewrites)."""
    hf = _build(kind, "forced")
    eng = make_engine(tiny_hf_model_dir("qwen3"))
    tok = HFTokenizer(hf)
    use_tokenizer(eng, tok)
    script = hf.encode(CORPUS[1] + " " + CORPUS[0], add_special_tokens=False)
    monkeypatch.setattr(eng.sampler, "sample", lambda logits, reqs: [script[len(r.output_token_ids)] for r in reqs])
    return eng, hf, script


@pytest.mark.parametrize("stop", [[], ["we're"]])
@pytest.mark.parametrize("kind", sorted(BUILDERS))
def test_final_only_gives_the_delta_runs_tokens_and_text_in_one_output(tiny_hf_model_dir, monkeypatch, kind, stop):
    eng, hf, script = _scripted(tiny_hf_model_dir, monkeypatch, kind)
    prompt = hf.encode("Hello , world", add_special_tokens=False)
    base = SamplingParams(max_tokens=len(script), temperature=0.0, ignore_eos=True, stop=stop)
    [delta] = _run(eng, [prompt], [base])
    [final] = _run(eng, [prompt], [dataclasses.replace(base, output_kind="final_only")])
    assert len(delta) > 1 and len(final) == 1 and final[0].finished
    last = delta[-1]
    assert final[0].output_token_ids == last.output_token_ids and final[0].finish_reason == last.finish_reason
    assert final[0].text == last.text == "".join(o.new_text for o in delta)
    assert final[0].new_text == final[0].text and final[0].new_token_ids == final[0].output_token_ids
    if not stop:
        assert final[0].text == hf.decode(script, skip_special_tokens=True)
    else:
        assert final[0].finish_reason == "stop" and "we're" not in final[0].text


def test_final_only_without_stop_strings_never_detokenises_per_step(tiny_hf_model_dir, monkeypatch):
    eng = make_engine(tiny_hf_model_dir("qwen3"))
    calls = {"step": 0, "flush": 0}
    for name in calls:
        real = getattr(eng.output_processor.detokenizer, name)

        def counted(*a, _real=real, _name=name, **k):
            calls[_name] += 1
            return _real(*a, **k)

        monkeypatch.setattr(eng.output_processor.detokenizer, name, counted)
    params = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, output_kind="final_only")] * 3
    outs = _run(eng, ["abc", "hello there", "x"], params)
    assert [len(o) for o in outs] == [1, 1, 1] and all(len(o[0].output_token_ids) == 12 for o in outs)
    assert calls == {"step": 0, "flush": 3}


def test_final_only_with_n_samples_and_generate(tiny_hf_model_dir):
    eng = make_engine(tiny_hf_model_dir("qwen3"))
    p = SamplingParams(max_tokens=6, temperature=1.0, seed=3, n=3)
    delta = eng.generate(["the same prompt"], p)
    [final] = _run(eng, ["the same prompt"], [dataclasses.replace(p, output_kind="final_only")])
    assert sorted(o.sample_index for o in final) == [0, 1, 2]
    by_index = {o.sample_index: o for o in final}
    assert [(o.output_token_ids, o.text) for o in delta] == [(by_index[i].output_token_ids, by_index[i].text)
                                                             for i in range(3)]


def test_an_unknown_output_kind_is_the_requests_error(tiny_hf_model_dir):
    eng = make_engine(tiny_hf_model_dir("qwen3"))
    [out] = eng.generate(["x"], SamplingParams(output_kind="cumulative"))
    assert out.finish_reason == "error" and "output_kind='cumulative' must be one of delta, final_only" in out.error


@pytest.mark.parametrize("kind", ["delta", "final_only"])
def test_a_grammar_that_ends_without_a_token_keeps_its_text(tiny_hf_model_dir, kind):
    """With no stop token in the vocabulary the grammar ends the request itself: its text is the
    decode of its tokens in both kinds."""
    pytest.importorskip("xgrammar")
    from ladle.engine.sampling_params import StructuredOutputs
    from ladle.engine.structured_output import StructuredOutputManager

    eng = make_engine(tiny_hf_model_dir("qwen3"))
    eng.output_processor.eos_token_ids = set()
    eng.structured = StructuredOutputManager(eng.tokenizer, eng.vocab_size, [])  # no stop token at all
    p = SamplingParams(max_tokens=32, temperature=0.0, output_kind=kind,
                       structured=StructuredOutputs(choice=["yes", "no"]))
    [out] = _run(eng, ["answer:"], [p])
    final = out[-1]
    assert final.finished and final.finish_reason == "stop"
    assert final.text in ("yes", "no") and final.text == eng.tokenizer.decode(final.output_token_ids)


@pytest.mark.parametrize("kind", ["delta", "final_only"])
def test_an_aborted_or_failed_request_reports_the_text_of_its_tokens(tiny_hf_model_dir, monkeypatch, kind):
    """A failed step ended requests without flushing the detokenizer: text held back (an incomplete
    UTF-8 sequence; final_only: everything) was lost from the error output."""
    eng = make_engine(tiny_hf_model_dir("qwen3"))
    p = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, output_kind=kind)
    rid = eng.add_request("hello", p)
    for _ in range(8):
        eng.step()
    req = eng.requests[rid]
    monkeypatch.setattr(eng.model_runner, "execute", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom")))
    [out] = [o for o in eng.step() if o.request_id == rid]
    assert out.finish_reason == "error" and len(out.output_token_ids) >= 5
    assert out.text == eng.tokenizer.decode(out.output_token_ids) == req.text


@pytest.mark.parametrize("output_kind", ["delta", "final_only"])
@pytest.mark.parametrize("kind", sorted(BUILDERS))
def test_a_stop_string_ends_the_text_where_it_starts(tiny_hf_model_dir, monkeypatch, kind, output_kind):
    """_finish flushed the detokenizer after a stop string's cut: the text held back past the stop
    string (clean-up pending text, an incomplete character) was appended after the cut."""
    eng, hf, script = _scripted(tiny_hf_model_dir, monkeypatch, kind)
    full = hf.decode(script, skip_special_tokens=True)
    stop = full.split()[2]
    p = SamplingParams(max_tokens=len(script), temperature=0.0, ignore_eos=True, stop=[stop],
                       output_kind=output_kind)
    [outs] = _run(eng, [hf.encode("Hello", add_special_tokens=False)], [p])
    assert outs[-1].finish_reason == "stop" and outs[-1].text == full[: full.index(stop)]
    if output_kind == "delta":
        assert "".join(o.new_text for o in outs) == outs[-1].text
