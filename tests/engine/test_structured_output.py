"""Structured output (json_schema, regex, choice, grammar) on tiny random models, whose unconstrained
output is random tokens: every output that finishes with "stop" must satisfy its spec, whatever the
chunking, prefix caching, preemption or sampling; a bad spec fails only its own request."""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path

import jsonschema
import pytest
import torch
import xgrammar as xgr
import yaml

from ladle.engine import CacheConfig, ChunkingConfig, EngineConfig, LLMEngine, ModelConfig, SamplingParams
from ladle.engine.request import Request, RequestMetrics
from ladle.engine.sampling_params import StructuredOutputs
from ladle.engine.structured_output import StructuredOutputManager, cache_key, choice_grammar
from ladle.models.tokenizer import ByteTokenizer
from tests.engine.helpers import drive, random_prompt, run_to_completion

TINY = yaml.safe_load((Path(__file__).parents[2] / "ladle" / "conf" / "model" / "tiny.yaml").read_text())

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "color": {"enum": ["red", "green", "blue"]},
    },
    "required": ["name", "age", "color"],
}
UNICODE_REGEX = r"[α-ω]{2,4}-é[0-9]{1,3}"  # xgrammar: [0-9] explicit (its \d, \w are ASCII; its . is DOTALL)
CHOICES = ["a", "ab", "abc", "b", "ba"]  # shared prefixes: the grammar must not stop early or run on
EBNF = 'root ::= "(" item (", " item){0,3} ")"\nitem ::= [0-9]{1,3} | "x"'  # bounded: random models ramble
EBNF_RE = r"\((?:[0-9]{1,3}|x)(?:, (?:[0-9]{1,3}|x)){0,3}\)"


@pytest.fixture(scope="module")
def bpe_tokenizer_dir(tmp_path_factory) -> Path:
    """A byte-level BPE tokenizer (291 ids; the tiny HF models' logits are 384 wide), with </s> = 2
    as the tiny models' EOS: transformers' tokenizer path through xgrammar.TokenizerInfo.from_huggingface."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    raw.train_from_iterator(['{"name": "bob", "age": 7, "color": "red"}'] * 20 + ["the cat sat"] * 20, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    path = tmp_path_factory.mktemp("bpe_tokenizer")
    tok.save_pretrained(path)
    return path


def engine_for(model: str, tiny_hf_model_dir, bpe_dir: Path | None = None, *, num_blocks=None,
               prefix_caching=None, max_model_len=256, max_num_seqs=8, **chunking) -> LLMEngine:
    """model: "tiny" (built-in, byte tokenizer, 259 ids of 512 logits) or "hf" (tiny llama + BPE tokenizer)."""
    if model == "tiny":
        mc = ModelConfig(**TINY, device="cpu", dtype="float32")
    else:
        mc = ModelConfig(path=str(tiny_hf_model_dir("llama")), tokenizer=str(bpe_dir), device="cpu", dtype="float32")
    return LLMEngine(EngineConfig(
        model=mc,
        cache=CacheConfig(block_size=16, num_blocks=num_blocks, max_model_len=max_model_len,
                          prefix_caching=prefix_caching),
        chunking=ChunkingConfig(**chunking),
        max_num_seqs=max_num_seqs,
    ))


def prompts(eng: LLMEngine, n: int, length: int = 12) -> list[list[int]]:
    vocab = eng.tokenizer.vocab_size if isinstance(eng.tokenizer, ByteTokenizer) else len(eng.tokenizer.tokenizer)
    return [random_prompt(length + i % 5, seed=100 + i, vocab=min(vocab, 256)) for i in range(n)]


def sampling(temperature: float, seed: int | None, max_tokens: int = 64, **spec) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed,
                          structured=StructuredOutputs(**spec))


def run(eng: LLMEngine, prompt_list, params_list) -> list:
    ids = [eng.add_request(p, sp) for p, sp in zip(prompt_list, params_list)]
    done = run_to_completion(eng)
    return [done[i] for i in ids]


def check_json(out) -> dict:
    assert out.finish_reason == "stop", (out.finish_reason, out.text, out.error)
    value = json.loads(out.text)
    jsonschema.validate(value, SCHEMA)
    return value


def assert_prefix_of_grammar(eng: LLMEngine, spec: StructuredOutputs, token_ids: list[int]) -> None:
    """token_ids is a prefix of some string of the grammar (what a "length" finish leaves)."""
    matcher = xgr.GrammarMatcher(eng.structured._cache[cache_key(spec)].result())
    assert all(matcher.accept_token(t) for t in token_ids)


MODELS = ["tiny", "hf"]


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("chunk", [None, 5])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_outputs_validate(model, chunk, temperature, tiny_hf_model_dir, bpe_tokenizer_dir):
    chunking = {"enabled": False} if chunk is None else {"size": chunk}
    eng = engine_for(model, tiny_hf_model_dir, bpe_tokenizer_dir, **chunking)
    ps = prompts(eng, 6)
    outs = run(eng, ps, [sampling(temperature, seed=i, json_schema=SCHEMA) for i in range(len(ps))])
    values = [check_json(o) for o in outs]
    if temperature > 0:  # the constraint leaves room: different seeds, different objects
        assert len({json.dumps(v, sort_keys=True) for v in values}) > 1
    assert eng.structured.num_compiles == 1


@pytest.mark.parametrize("model", MODELS)
def test_regex_choice_and_grammar(model, tiny_hf_model_dir, bpe_tokenizer_dir):
    eng = engine_for(model, tiny_hf_model_dir, bpe_tokenizer_dir, size=7)
    ps = prompts(eng, 8)
    specs = [{"regex": UNICODE_REGEX}, {"choice": CHOICES}, {"grammar": EBNF}]
    params = [sampling(1.0, seed=i, max_tokens=48, **s) for s in specs for i in range(len(ps))]
    outs = run(eng, ps * len(specs), params)
    n = len(ps)
    for o in outs:
        assert o.finish_reason == "stop", (o.text, o.error)
    assert all(re.fullmatch(UNICODE_REGEX, o.text) for o in outs[:n]), [o.text for o in outs[:n]]
    assert all(o.text in CHOICES for o in outs[n : 2 * n])
    assert len({o.text for o in outs[n : 2 * n]}) > 1  # several choices drawn, prefixes included
    assert all(re.fullmatch(EBNF_RE, o.text) for o in outs[2 * n :]), [o.text for o in outs[2 * n :]]


def test_greedy_and_seeded_outputs_survive_preemption_and_prefix_caching(tiny_hf_model_dir, bpe_tokenizer_dir):
    """A tight cache preempts requests mid-generation; their KV is recomputed from the tokens they
    already have, and the grammar state must not be advanced again: outputs equal the roomy run's."""
    specs = [{"json_schema": SCHEMA}, {"regex": UNICODE_REGEX}, {"choice": CHOICES}, {"grammar": EBNF}]
    roomy = engine_for("tiny", tiny_hf_model_dir, size=16)
    preamble = random_prompt(32, seed=7, vocab=256)  # shared full blocks: prefix-cache hits
    ps = [preamble + p for p in prompts(roomy, 12)]
    params = [sampling(0.0 if i % 2 else 0.8, seed=i, max_tokens=60, **specs[i % len(specs)]) for i in range(len(ps))]
    ref = run(roomy, ps, params)
    tight = engine_for("tiny", tiny_hf_model_dir, num_blocks=14, prefix_caching=True, size=16, max_model_len=128)
    ids = [tight.add_request(p, sp) for p, sp in zip(ps, params)]
    driven = drive(tight)
    cached = sum(s.cached_prompt_tokens for s in driven.steps)
    outs = [driven.finished[i] for i in ids]
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    assert cached > 0
    for o, r in zip(outs, ref):
        assert o.output_token_ids == r.output_token_ids
        assert o.finish_reason == r.finish_reason == "stop", (o.text, o.error)
    for i, o in enumerate(outs):
        kind = specs[i % len(specs)]
        if "json_schema" in kind:
            check_json(o)
        elif "regex" in kind:
            assert re.fullmatch(UNICODE_REGEX, o.text)
        elif "choice" in kind:
            assert o.text in CHOICES
        else:
            assert re.fullmatch(EBNF_RE, o.text)
    assert tight.num_free_blocks() == tight.num_total_blocks()


def test_bad_spec_fails_only_its_request_before_its_prefill(tiny_hf_model_dir):
    eng = engine_for("tiny", tiny_hf_model_dir)
    ps = prompts(eng, 5)
    params = [
        sampling(0.0, None, json_schema={"type": "strin"}),
        sampling(0.0, None, regex="(unclosed"),
        sampling(0.0, None, grammar='root ::= missing_rule'),
        sampling(0.0, None, json_schema="{not json"),
        sampling(0.0, None, json_schema=SCHEMA),
    ]
    outs = run(eng, ps, params)
    assert [o.finish_reason for o in outs] == ["error"] * 4 + ["stop"]
    assert outs[0].error.startswith("json_schema is not valid:") and "strin" in outs[0].error
    assert outs[1].error.startswith("regex is not valid:") and "parenthesis" in outs[1].error
    assert outs[2].error.startswith("grammar is not valid:") and "missing_rule" in outs[2].error
    assert outs[3].error.startswith("json_schema is not valid:") and "not json" in outs[3].error
    assert all(o.output_token_ids == [] for o in outs[:4])
    check_json(outs[4])
    # Failed before its prefill: a compile that is already done fails the request at the next step.
    rid = eng.add_request(ps[0], params[0])
    eng.requests[rid].grammar.compiled.exception()  # wait for the (cached) compile
    out = {o.request_id: o for o in eng.step()}[rid]
    assert out.finish_reason == "error" and out.metrics.first_scheduled_time is None


@pytest.mark.parametrize(
    "spec,message",
    [
        (StructuredOutputs(), "set exactly one of json_schema, regex, choice, grammar (got none)"),
        (StructuredOutputs(regex="a", choice=["a"]), "(got regex, choice)"),
        (StructuredOutputs(choice=[]), "structured.choice=[] must be a non-empty list"),
        (StructuredOutputs(choice=["a", ""]), "must hold non-empty strings only"),
        (StructuredOutputs(regex=""), "structured.regex='' must be a non-empty string"),
        (StructuredOutputs(json_schema=5), "json_schema must be a JSON string or a dict"),
        ({"regex": "a"}, "must be a StructuredOutputs"),
    ],
)
def test_invalid_specs_are_the_requests_error(spec, message, tiny_hf_model_dir):
    eng = engine_for("tiny", tiny_hf_model_dir)
    good = eng.add_request([1, 2, 3], sampling(0.0, None, max_tokens=4, choice=["x"]))
    bad = eng.add_request([1, 2, 3], SamplingParams(structured=spec))
    done = run_to_completion(eng)
    assert done[bad].finish_reason == "error" and message in done[bad].error
    assert done[good].text == "x" and done[good].finish_reason == "stop"


def test_same_spec_is_compiled_once(tiny_hf_model_dir):
    eng = engine_for("tiny", tiny_hf_model_dir)
    text = json.dumps({"required": SCHEMA["required"], "type": "object", "properties": SCHEMA["properties"]})
    specs = [{"json_schema": SCHEMA}, {"json_schema": text}, {"json_schema": dict(SCHEMA)},
             {"choice": ["p", "q"]}, {"choice": ["p", "q"]}]
    ps = prompts(eng, len(specs))
    outs = run(eng, ps, [sampling(0.0, None, **s) for s in specs])
    assert eng.structured.num_compiles == 2
    for o in outs[:3]:
        check_json(o)
    assert {o.text for o in outs[3:]} <= {"p", "q"}


def test_length_leaves_a_prefix_when_the_spec_needs_more_tokens(tiny_hf_model_dir):
    """Only outputs longer than max_tokens satisfy the schema: the output is a prefix ("length")."""
    eng = engine_for("tiny", tiny_hf_model_dir)
    spec = StructuredOutputs(json_schema={"type": "string", "minLength": 40})
    outs = run(eng, prompts(eng, 3), [SamplingParams(max_tokens=10, temperature=1.0, seed=i, structured=spec)
                                      for i in range(3)])
    for o in outs:
        assert o.finish_reason == "length" and len(o.output_token_ids) == 10
        assert o.text.startswith('"')
        assert_prefix_of_grammar(eng, spec, o.output_token_ids)


def test_padding_ids_beyond_the_tokenizer_are_masked(tiny_hf_model_dir):
    """The tiny model's logits are 512 wide, its byte tokenizer knows 259 ids: even when the model
    prefers a padding id, a grammar row never samples one."""
    eng = engine_for("tiny", tiny_hf_model_dir)
    req = Request("r", [1], sampling(0.0, None, regex="[a-z]+"), RequestMetrics(arrival_time=0.0))
    assert eng.structured.submit(req) is None
    logits = torch.zeros(2, 512)
    logits[:, 300] = 100.0  # a padding id the model "likes" best
    logits[:, ord("q")] = 1.0
    plain = Request("p", [1], SamplingParams(), RequestMetrics(arrival_time=0.0))
    before = logits.clone()
    eng.structured.apply_masks(logits, [req, plain])
    allowed = (logits[0] > float("-inf")).nonzero().flatten().tolist()
    assert allowed == list(range(ord("a"), ord("z") + 1))
    assert logits[0].argmax().item() == ord("q")
    assert torch.equal(logits[1], before[1])  # a row without a grammar is untouched


def test_eos_is_allowed_only_when_the_grammar_accepts_and_ignore_eos_still_stops(tiny_hf_model_dir):
    eng = engine_for("tiny", tiny_hf_model_dir)
    req = Request("r", [1], sampling(0.0, None, regex="ab?"), RequestMetrics(arrival_time=0.0))
    eng.structured.submit(req)
    eos = ByteTokenizer.EOS

    def allowed() -> set[int]:
        logits = torch.zeros(1, 512)
        eng.structured.apply_masks(logits, [req])
        return set((logits[0] > float("-inf")).nonzero().flatten().tolist())

    assert allowed() == {ord("a")}
    assert not eng.structured.accept(req, ord("a"))
    assert allowed() == {ord("b"), eos}
    # ignore_eos: the grammar still ends the output when it takes the stop token.
    out = run(eng, [[1, 2, 3]], [SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True,
                                                structured=StructuredOutputs(choice=["yes", "no"]))])[0]
    assert out.finish_reason == "stop" and out.text in ("yes", "no") and out.output_token_ids[-1] == eos


def test_a_grammar_without_any_stop_token_ends_the_output_itself():
    """A vocabulary with no EOS at all: once the grammar allows nothing more, the request stops."""
    mgr = StructuredOutputManager(ByteTokenizer(259, specials=False), 259, eos_ids=[])
    req = Request("r", [1], sampling(0.0, None, regex="ab"), RequestMetrics(arrival_time=0.0))
    mgr.submit(req)
    for token in b"ab":
        logits = torch.zeros(1, 259)
        mgr.apply_masks(logits, [req])
        assert (logits[0] > float("-inf")).nonzero().flatten().tolist() == [token]
        assert mgr.verdict(req, token) is None
        mgr.accept(req, token)
    mgr.apply_masks(torch.zeros(1, 259), [req])
    assert mgr.verdict(req, 0) == ("stop", None)


def test_model_without_tokenizer_files_stops_on_its_config_eos(tiny_hf_model_dir):
    """The byte stand-in for a model without tokenizer files: the model's EOS (id 2) is also the byte
    0x02; under a grammar it is only the stop token, never text."""
    path = tiny_hf_model_dir("qwen3")
    eng = LLMEngine(EngineConfig(model=ModelConfig(path=str(path), device="cpu", dtype="float32"),
                                 cache=CacheConfig(max_model_len=128)))
    outs = run(eng, prompts(eng, 4), [sampling(1.0, seed=i, regex="[a-z]{3,5}") for i in range(4)])
    for o in outs:
        assert o.finish_reason == "stop" and o.output_token_ids[-1] == 2
        assert re.fullmatch("[a-z]{3,5}", bytes(o.output_token_ids[:-1]).decode())


def test_abort_while_the_compile_is_pending(tiny_hf_model_dir):
    eng = engine_for("tiny", tiny_hf_model_dir, size=4)  # a 12-token prompt takes 3 prefill steps
    gate = threading.Event()
    compile_fn = eng.structured._compile

    def slow_compile(so):
        gate.wait(timeout=30)
        return compile_fn(so)

    eng.structured._compile = slow_compile
    ps = prompts(eng, 3)
    slow = eng.add_request(ps[0], sampling(0.0, None, regex="[0-9]{4}"))
    plain = eng.add_request(ps[1], SamplingParams(max_tokens=5, temperature=0.0))
    eng.step()  # slow's prefill runs while its grammar compiles
    assert not eng.requests[slow].grammar.compiled.done() and eng.requests[slow].num_computed_tokens == 4
    eng.abort_request(slow)
    gate.set()
    after = eng.add_request(ps[2], sampling(0.0, None, regex="[0-9]{4}"))  # same spec: the same compile
    done = run_to_completion(eng)
    assert slow not in done and slow not in eng.requests  # aborted: gone, never reported by step()
    assert done[plain].finish_reason == "length"
    assert done[after].finish_reason == "stop" and re.fullmatch("[0-9]{4}", done[after].text)
    assert eng.structured.num_compiles == 1


def test_choice_grammar_escapes_literals():
    choices = ['say "hi"', "back\\slash", "new\nline", "tab\t", "é—ü", "a|b", "(x)*"]
    grammar = xgr.Grammar.from_ebnf(choice_grammar(choices))
    info = xgr.TokenizerInfo([bytes([i]) for i in range(256)] + [""], stop_token_ids=[256])
    compiled = xgr.GrammarCompiler(info).compile_grammar(grammar)
    for c in choices:
        m = xgr.GrammarMatcher(compiled)
        assert all(m.accept_token(b) for b in c.encode()) and m.is_completed(), c
    m = xgr.GrammarMatcher(compiled)
    assert m.accept_token(ord("a")) and not m.is_completed()  # "a|b" is one literal, not an alternation


def test_json_strings_never_hold_raw_control_characters_or_surrogates(tiny_hf_model_dir):
    """xgrammar 0.2.8 lets both into a string with maxLength (see VocabMasks); the masks keep them out,
    and many seeded samples of such a schema all parse and validate."""
    eng = engine_for("tiny", tiny_hf_model_dir)
    schema = {"type": "string", "maxLength": 6}
    req = Request("r", [1], sampling(0.0, None, json_schema=schema), RequestMetrics(arrival_time=0.0))
    eng.structured.submit(req)

    def allowed() -> set[int]:
        logits = torch.zeros(1, 512)
        eng.structured.apply_masks(logits, [req])
        return set((logits[0] > float("-inf")).nonzero().flatten().tolist())

    eng.structured.accept(req, ord('"'))
    inside = allowed()
    assert not inside & set(range(0x20)) and ord("a") in inside and 0xED in inside
    eng.structured.accept(req, 0xED)  # a lead byte: U+D000-U+D7FF may follow, surrogates may not
    after_ed = allowed()
    assert after_ed == set(range(0x80, 0xA0))
    outs = run(eng, prompts(eng, 40), [sampling(1.0, seed=i, json_schema=schema) for i in range(40)])
    for o in outs:
        assert o.finish_reason == "stop"
        jsonschema.validate(json.loads(o.text), schema)


def test_each_of_n_samples_has_its_own_grammar_state(tiny_hf_model_dir):
    """n > 1: the samples fork after one prefill; each draws its own tokens under its own matcher
    (one matcher shared by the samples would be advanced by every sample's token)."""
    eng = engine_for("tiny", tiny_hf_model_dir, num_blocks=12, max_model_len=128, size=16)
    ps = prompts(eng, 4)
    params = [SamplingParams(n=4, max_tokens=60, temperature=1.0, seed=i,
                             structured=StructuredOutputs(json_schema=SCHEMA)) for i in range(4)]
    outs = eng.generate(ps, params)
    assert len(outs) == 16
    for o in outs:
        check_json(o)
    assert len({o.text for o in outs}) > 4


def test_a_tokenizer_xgrammar_cannot_use_is_named_not_blamed_on_the_spec():
    mgr = StructuredOutputManager(object(), 16, eos_ids=[1])
    req = Request("r", [1], sampling(0.0, None, regex="a"), RequestMetrics(arrival_time=0.0))
    assert mgr.submit(req) is None
    assert not req.grammar.ready()
    assert req.grammar.error.startswith("structured output is not available for this model's tokenizer")
    assert "regex is not valid" not in req.grammar.error


def test_the_compile_cache_is_bounded(monkeypatch):
    import ladle.engine.structured_output as so

    monkeypatch.setattr(so, "CACHE_SIZE", 2)
    mgr = StructuredOutputManager(ByteTokenizer(), 259, eos_ids=[257])
    for regex in ["a", "b", "c", "a", "c"]:  # "a" was evicted by "c"; "c" is still cached
        mgr.submit(Request("r", [1], sampling(0.0, None, regex=regex), RequestMetrics(arrival_time=0.0)))
    assert mgr.num_compiles == 4 and len(mgr._cache) == 2


def test_a_grammar_that_matches_nothing_fails_before_its_prefill_naming_itself(tiny_hf_model_dir):
    """An empty language: before, it failed after its prefill blaming "stop tokens [EOS]", which the
    user never listed and cannot remove."""
    eng = engine_for("tiny", tiny_hf_model_dir)
    bad = eng.add_request([1, 2, 3], sampling(0.0, None, regex="[^\\x00-\\U0010FFFF]"))
    good = eng.add_request([1, 2, 3], sampling(0.0, None, max_tokens=4, choice=["x"]))
    eng.requests[bad].grammar.compiled.exception()  # the compile runs on a thread: on a loaded machine
    done = run_to_completion(eng)                   # a first step could otherwise come before it ends
    assert done[bad].finish_reason == "error" and "regex matches no text" in done[bad].error, done[bad].error
    assert "stop" not in done[bad].error and done[bad].metrics.first_scheduled_time is None
    assert done[good].text == "x"


def test_a_token_the_grammar_rejects_never_reaches_the_output(tiny_hf_model_dir, monkeypatch):
    eng = engine_for("tiny", tiny_hf_model_dir)
    rid = eng.add_request([1, 2, 3], sampling(0.0, None, max_tokens=8, choice=["yes", "no"]))

    def reject(req, token):
        raise RuntimeError(f"the choice grammar rejected token {token}")

    monkeypatch.setattr(eng.updater.structured, "accept", reject)
    out = run_to_completion(eng)[rid]
    assert out.finish_reason == "error" and "rejected token" in out.error
    assert out.output_token_ids == [] and out.text == ""  # before: the rejected token was in the text


@pytest.mark.parametrize("n", [1, 2])
def test_a_token_the_grammar_rejects_leaves_no_logprob(tiny_hf_model_dir, monkeypatch, n):
    """Before, the logprob was appended before the grammar took the token: a rejected token's logprob
    stayed in the output, one more than its tokens (for n > 1, in each sample's)."""
    eng = engine_for("tiny", tiny_hf_model_dir)
    params = SamplingParams(max_tokens=8, temperature=0.0 if n == 1 else 1.0, seed=3, n=n, logprobs=1,
                            structured=StructuredOutputs(choice=["yes", "no"]))
    eng.add_request([1, 2, 3], params)

    def reject(req, token):
        raise RuntimeError(f"the choice grammar rejected token {token}")

    monkeypatch.setattr(eng.updater.structured, "accept", reject)
    outs = [o for _ in range(50) for o in eng.step() if o.finished]
    assert len(outs) == n and not eng.has_unfinished_requests()
    for out in outs:
        assert out.finish_reason == "error" and "rejected token" in out.error
        assert out.output_token_ids == [] and out.logprobs == [] and out.top_logprobs == []


def test_a_grammar_that_ends_the_request_instead_of_its_token_leaves_no_logprob(tiny_hf_model_dir):
    """The grammar's verdict (here: stuck after "{a" or "{b", as the "}" it needs before the "x" is one of
    the stop_token_ids) ends the request without its last drawn token; before, that token's logprob was
    in the output all the same."""
    eng = engine_for("tiny", tiny_hf_model_dir)
    params = SamplingParams(max_tokens=30, temperature=0.0, stop_token_ids=[ord("}")], logprobs=2,
                            structured=StructuredOutputs(regex=r"\{[ab]\}x"))
    rid = eng.add_request([1, 2, 3], params)
    out = run_to_completion(eng)[rid]
    assert out.finish_reason == "error" and out.text in ("{a", "{b"), (out.finish_reason, out.text)
    assert len(out.logprobs) == len(out.top_logprobs) == len(out.output_token_ids) == 2


def test_a_stop_token_the_grammar_needs_first_is_named_before_the_prefill(tiny_hf_model_dir):
    """The regex is fine, but its first byte "x" is one of the request's stop_token_ids (taken out of the
    grammar's vocabulary): the error names them, not the regex (before: "regex matches no text ... fix
    the regex"). A regex that matches nothing says so still, stop_token_ids or not."""
    eng = engine_for("tiny", tiny_hf_model_dir)
    collide = eng.add_request([1, 2, 3], SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=[ord("x")],
                                                        structured=StructuredOutputs(regex="x[a-z]{2}")))
    empty = eng.add_request([1, 2, 3], SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=[ord("x")],
                                                      structured=StructuredOutputs(regex="[^\\x00-\\U0010FFFF]")))
    good = eng.add_request([1, 2, 3], SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=[ord("!")],
                                                     structured=StructuredOutputs(regex="x[a-z]{2}")))
    for rid in (collide, empty):
        eng.requests[rid].grammar.compiled.exception()  # compiled (on its thread) before the first step
    done = run_to_completion(eng)
    err = done[collide].error
    assert done[collide].finish_reason == "error" and done[collide].metrics.first_scheduled_time is None
    assert f"stop_token_ids [{ord('x')}]" in err and "remove them" in err and "matches no text" not in err, err
    assert done[empty].finish_reason == "error" and "regex matches no text" in done[empty].error
    assert done[good].finish_reason == "stop" and re.match("x[a-z]{2}", done[good].text), done[good].text


def test_the_requests_copy_holds_a_dict_schema_as_its_json_text_and_its_own_lists(tiny_hf_model_dir):
    """add_request deep-copied the params: ~62 ms a request for a 512 KB schema (4x the cache key's
    json.dumps) and an error for a schema a deep copy cannot take. Now a dict schema is frozen as its JSON
    text (what the compile reads: the same grammar, key and refusals) and the lists are copied: what the
    caller changes afterwards reaches no request."""

    class NoDeepCopy(dict):
        def __deepcopy__(self, memo):
            raise TypeError("no deep copy")

    schema = NoDeepCopy(type="object", properties={"a": {"enum": ["x", "y"]}}, required=["a"],
                        additionalProperties=False)
    choices, stop = ["yes", "no"], ["zz"]
    eng = engine_for("tiny", tiny_hf_model_dir)
    a = eng.add_request([1, 2, 3], SamplingParams(max_tokens=64, temperature=0.0, stop=stop,
                                                  structured=StructuredOutputs(json_schema=schema)))
    b = eng.add_request([1, 2, 3], sampling(1.0, 5, max_tokens=8, choice=choices))
    # A tuple is a list to the compile: its subschemas are checked as a list's (before, not at all).
    tup = eng.add_request([1, 2, 3], sampling(0.0, None, json_schema={"anyOf": ({"type": "array", "uniqueItems": True},)}))
    unencodable = eng.add_request([1, 2, 3], sampling(0.0, None, json_schema={"enum": {1, 2}}))
    frozen = eng.requests[a].params.structured
    assert frozen.json_schema == json.dumps(schema) and cache_key(frozen) == cache_key(StructuredOutputs(json_schema=schema))
    schema["properties"]["a"]["enum"] = ["zzz"]
    choices[:], stop[:] = ["maybe"], ["x"]
    done = run_to_completion(eng)
    assert done[a].finish_reason == "stop" and json.loads(done[a].text)["a"] in ("x", "y"), done[a].text
    assert done[b].finish_reason == "stop" and done[b].text in ("yes", "no")
    assert done[tup].finish_reason == "error" and "uniqueItems" in done[tup].error, done[tup].error
    err = done[unencodable].error
    assert "cannot be copied" in err and "TypeError" in err and "structured.json_schema as JSON text" in err, err


def test_a_stop_token_the_grammar_needs_before_its_end_fails_the_request_naming_it(tiny_hf_model_dir):
    """stop_token_ids holds "}", which the regex needs before its last byte: the grammar can never
    complete, so the request fails naming the collision instead of finishing "stop" with "{b"."""
    eng = engine_for("tiny", tiny_hf_model_dir)
    spec = StructuredOutputs(regex=r"\{[ab]\}x")
    params = SamplingParams(max_tokens=30, temperature=0.0, stop_token_ids=[ord("}")], structured=spec)
    rid = eng.add_request([1, 2, 3], params)
    out = run_to_completion(eng)[rid]
    assert out.finish_reason == "error" and out.text in ("{a", "{b"), (out.finish_reason, out.text)
    assert "stop_token_ids" in out.error and str(ord("}")) in out.error


def test_a_stop_token_that_completes_the_grammar_ends_it_as_stop_with_matching_text(tiny_hf_model_dir):
    """stop_token_ids holds "}", the regex's last byte: xgrammar (>= 0.2.9) allows a stop token where its
    own text completes the grammar, so the request takes it and finishes "stop" with a full match, the
    stop token's text included (as vLLM keeps a stop token that is not a special token)."""
    eng = engine_for("tiny", tiny_hf_model_dir)
    spec = StructuredOutputs(regex=r"\{[ab]\}")
    params = SamplingParams(max_tokens=30, temperature=0.0, stop_token_ids=[ord("}")], logprobs=1, structured=spec)
    rid = eng.add_request([1, 2, 3], params)
    out = run_to_completion(eng)[rid]
    assert out.finish_reason == "stop" and out.error is None, (out.finish_reason, out.error)
    assert re.fullmatch(r"\{[ab]\}", out.text), out.text
    assert out.output_token_ids[-1] == ord("}") and len(out.logprobs) == len(out.output_token_ids) == 3


def test_the_config_check_judges_a_dict_schema_as_the_engine_holds_it():
    """The engine holds a dict schema as its JSON text (int keys as strings, tuples as lists); the config
    check judged the dict itself: an int property key was refused there and accepted by the engine."""
    from ladle.engine.structured_output import spec_error

    schema = {"type": "object", "properties": {1: {"type": "integer"}}, "required": ["1"]}
    assert spec_error(StructuredOutputs(json_schema=schema)) is None
    looking = {"type": "object", "properties": {"a": {"anyOf": ({"type": "string", "pattern": "^(?!x)a$"},)}}}
    assert "lookaround" in spec_error(StructuredOutputs(json_schema=looking))
    assert "cannot be written as JSON" in spec_error(StructuredOutputs(json_schema={"enum": {1, 2}}))
