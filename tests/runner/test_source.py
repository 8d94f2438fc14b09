"""Sources stream rows in source order, in batches, with the mapped columns; prompts encode or explain why not."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ladle.runner.config import ConfigError, SyntheticConfig, SyntheticGroup, WorkloadConfig
from ladle.runner.prompts import encode_prompt
from ladle.runner.sources import open_source
from tests.runner.conftest import PROMPTS
from tests.runner.fake_engine import ByteTokenizer


def rows(cfg: WorkloadConfig, vocab: int | None = None):
    src = open_source(cfg)
    src.vocab_size = vocab
    batches = list(src.batches())
    return src, batches, [r for b in batches for r in b]


@pytest.mark.parametrize(("kind", "path"), [
    ("parquet", "prompts.parquet"), ("parquet", "parts"), ("arrow", "prompts.arrow"), ("hf_dataset", "hf"),
    ("hf_dataset", "prompts.jsonl"), ("jsonl", "prompts.jsonl"),
])
def test_every_kind_reads_the_same_rows(kind, path, datasets_dir):
    cfg = WorkloadConfig(kind=kind, path=str(datasets_dir / path), prompt_column="question", id_column="qid",
                         max_tokens_column="max_tokens", batch_size=3)
    src, batches, got = rows(cfg)
    assert [r.prompt for r in got] == PROMPTS
    assert [r.id for r in got] == [f"q{i}" for i in range(8)]
    assert [r.index for r in got] == list(range(8))
    assert [r.max_tokens for r in got] == [None, 2, None, 3, None, None, 1, None]
    assert all(len(b) <= 3 for b in batches)  # streamed in batches of workload.batch_size
    assert src.total in (8, None)


def test_limit_and_row_index_ids(datasets_dir):
    cfg = WorkloadConfig(kind="parquet", path=str(datasets_dir / "prompts.parquet"), prompt_column="tokens",
                         limit=5, batch_size=2)
    src, _, got = rows(cfg)
    assert src.total == 5 and [r.id for r in got] == ["0", "1", "2", "3", "4"]
    assert got[0].prompt == list(PROMPTS[0].encode())


def test_trace_column_is_read(datasets_dir):
    cfg = WorkloadConfig(kind="jsonl", path=str(datasets_dir / "prompts.jsonl"), prompt_column="messages")
    cfg.arrivals.process, cfg.arrivals.column = "trace", "arrival_ms"
    _, _, got = rows(cfg)
    assert [r.arrival for r in got][:4] == [0.0, 5.0, 5.0, 40.0]
    assert got[0].prompt[1] == {"role": "user", "content": PROMPTS[0]}


def test_large_parquet_streams_in_batches(tmp_path):
    n = 20000
    pq.write_table(pa.table({"prompt": [f"p{i}" for i in range(n)]}), tmp_path / "big.parquet", row_group_size=1000)
    src = open_source(WorkloadConfig(kind="parquet", path=str(tmp_path / "big.parquet"), batch_size=128))
    it = src.batches()
    first = next(it)
    assert len(first) == 128 and first[0].prompt == "p0"
    assert sum(len(b) for b in it) == n - 128


def test_jsonl_bad_lines_become_row_errors(tmp_path):
    p = tmp_path / "x.jsonl"
    p.write_text('{"prompt": "a"}\n\nnot json\n[1, 2]\n{"other": 1}\n')
    _, _, got = rows(WorkloadConfig(kind="jsonl", path=str(p)))
    assert [r.index for r in got] == [0, 1, 2, 3]
    assert got[0].prompt == "a" and got[0].error is None
    assert "line 3" in got[1].error and "line 4" in got[2].error
    assert got[3].prompt is None and got[3].error is None  # missing key: a null prompt


def test_missing_column_and_path_are_config_errors(datasets_dir, tmp_path):
    with pytest.raises(ConfigError, match="'nope' is not a column.*question"):
        open_source(WorkloadConfig(kind="arrow", path=str(datasets_dir / "prompts.arrow"), prompt_column="nope"))
    with pytest.raises(ConfigError, match="id_column"):
        open_source(WorkloadConfig(kind="hf_dataset", path=str(datasets_dir / "hf"), prompt_column="question",
                                   id_column="uid"))
    with pytest.raises(ConfigError, match="does not exist"):
        open_source(WorkloadConfig(kind="jsonl", path=str(tmp_path / "none.jsonl")))
    with pytest.raises(ConfigError, match="no .arrow"):
        open_source(WorkloadConfig(kind="arrow", path=str(tmp_path)))


def test_synthetic_is_seeded_and_shaped():
    groups = [SyntheticGroup(name="a", num_requests=20, prompt_len=50, prompt_len_sigma=0.5, min_prompt_len=10,
                             max_prompt_len=80, shared_prefix_len=16, max_tokens=8, max_tokens_sigma=0.3),
              SyntheticGroup(name="b", num_requests=5, prompt_len=7)]
    cfg = WorkloadConfig(kind="synthetic", synthetic=SyntheticConfig(groups=groups, seed=1, min_token_id=3),
                         batch_size=4)
    src, batches, got = rows(cfg, vocab=100)
    assert src.total == 25 and len(got) == 25 and all(len(b) <= 4 for b in batches)
    a = [r for r in got if r.id.startswith("a-")]
    b = [r for r in got if r.id.startswith("b-")]
    assert all(r.prompt[:16] == a[0].prompt[:16] for r in a)  # the shared preamble
    assert all(10 <= len(r.prompt) - 16 <= 80 for r in a) and len({len(r.prompt) for r in a}) > 3
    assert all(len(r.prompt) == 7 and r.max_tokens is None for r in b)
    assert all(3 <= t < 100 for r in got for t in r.prompt)
    _, _, again = rows(cfg, vocab=100)
    assert [r.prompt for r in again] == [r.prompt for r in got]


def test_synthetic_group_arrivals_order_rows():
    from ladle.runner.config import ArrivalConfig

    groups = [SyntheticGroup(name="s", num_requests=2),
              SyntheticGroup(name="l", num_requests=4, arrival=ArrivalConfig(process="poisson", rate=10, start=0.1))]
    _, _, got = rows(WorkloadConfig(kind="synthetic", synthetic=SyntheticConfig(groups=groups)), vocab=50)
    assert [r.id for r in got[:2]] == ["s-0", "s-1"] and got[0].arrival == 0.0
    times = [r.arrival for r in got]
    assert times == sorted(times) and times[2] > 0.1


TOK = ByteTokenizer()


@pytest.mark.parametrize(("value", "fmt", "ids", "error"), [
    ("hi", "auto", [104, 105], None),
    ("hi", "text", [104, 105], None),
    ([5, 6], "auto", [5, 6], None),
    ([{"role": "user", "content": "hi"}], "auto", TOK.apply_chat_template([{"role": "user", "content": "hi"}]), None),
    (None, "auto", None, "null"),
    ("", "auto", [], "empty"),
    ("  \n", "auto", [], "empty"),
    ([], "auto", [], "empty"),
    ("hi", "tokens", None, "expected tokens"),
    (42, "auto", None, "is a int"),
    ([1.5, 2], "auto", None, None),  # a list of floats is none of the formats
    ([5, "x"], "tokens", None, "tokenized"),
    ([{"role": "user"}], "chat", None, "message 0"),
])
def test_encode_prompt(value, fmt, ids, error):
    enc = encode_prompt(value, fmt, TOK, False, "prompt")
    if error is None and ids is None:
        assert enc.error is not None
        return
    assert enc.token_ids == ids
    assert (enc.error is None) if error is None else (error in enc.error)


def test_encode_prompt_chat_template_and_text_column():
    enc = encode_prompt("hi", "auto", TOK, True, "prompt")
    assert enc.token_ids == TOK.apply_chat_template([{"role": "user", "content": "hi"}]) and enc.text == "hi"
    msgs = [{"role": "user", "content": "é"}]
    assert json.loads(encode_prompt(msgs, "chat", TOK, False, "m").text) == msgs


def test_chat_template_kwargs_from_the_workload_config():
    from ladle.runner.config import to_job_config
    from tests.runner.conftest import compose_cfg

    job = to_job_config(compose_cfg("workload.chat_template=true",
                                    "+workload.chat_template_kwargs.enable_thinking=false"))
    assert job.workload.chat_template_kwargs == {"enable_thinking": False}

    seen = {}

    class Recording:
        def apply_chat_template(self, messages, **kw):
            seen.update(kw)
            return [1, 2]

    enc = encode_prompt("hi", "auto", Recording(), True, "prompt", job.workload.chat_template_kwargs)
    assert enc.token_ids == [1, 2] and seen == {"enable_thinking": False}
