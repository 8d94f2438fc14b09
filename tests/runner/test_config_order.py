"""Config errors come before the model loads, and the tests prove the order: the model loader fails the
test if it runs (`no_model_load`, with its positive control here)."""

from __future__ import annotations

import pytest

from ladle.runner.config import ConfigError
from ladle.runner.job import run_job
from tests.runner.conftest import ModelLoaded, compose_cfg


def test_the_fixture_fails_a_job_that_loads_the_model(tmp_path, no_model_load):
    """Positive control: a valid config does reach the loader, and the fixture stops it there."""
    with pytest.raises(ModelLoaded):
        run_job(compose_cfg("workload.limit=1"), tmp_path / "out")


@pytest.mark.parametrize(("ids", "bad"), [([257, 512], "[512]"), ([-1, 3], "[-1]"), ([10**12], "[1000000000000]")])
def test_config_stop_token_ids_outside_the_vocabulary_are_a_config_error_before_the_model_loads(
        tmp_path, no_model_load, ids, bad):
    """An id outside the vocabulary passed the checks: with a structured spec xgrammar then raised
    building the matcher, outside any guard (every step failed), after the model had loaded."""
    over = f"sampling.stop_token_ids=[{','.join(map(str, ids))}]"
    with pytest.raises(ConfigError) as e:
        run_job(compose_cfg(over, "sampling.structured.regex='[a-z]+'"), tmp_path / "out")
    msg = str(e.value)
    assert "sampling.stop_token_ids" in msg and bad in msg and "vocabulary [0, 512)" in msg, msg
    assert not (tmp_path / "out" / "generations.parquet").exists()


def test_config_stop_token_ids_inside_the_vocabulary_run(tmp_path, engine):
    run_job(compose_cfg("workload.limit=2", "sampling.stop_token_ids=[0,257,511]"), tmp_path / "out", engine=engine)
    assert (tmp_path / "out" / "generations.parquet").exists()


def test_a_model_path_that_is_not_there_is_still_named_when_stop_token_ids_are_checked(tmp_path, no_model_load):
    with pytest.raises(ConfigError, match="/no/such/model"):
        run_job(compose_cfg("model.path=/no/such/model", "sampling.stop_token_ids=[1]"), tmp_path / "out")


@pytest.mark.parametrize(("over", "needle"), [
    ("sampling.logit_bias={600: 1.0}", "sampling.logit_bias=[600]: [600] outside the vocabulary [0, 512)"),
    ("sampling.logit_bias={5: x}", "sampling: logit_bias="),
    ("sampling.repetition_penalty=0", "repetition_penalty=0"),
    ("sampling.min_tokens=100", "min_tokens=100 must be at most max_tokens=4"),
    ("sampling.presence_penalty=3", "presence_penalty=3.0 must be in [-2, 2]"),
])
def test_bad_processing_keys_are_a_config_error_before_the_model_loads(tmp_path, no_model_load, over, needle):
    with pytest.raises(ConfigError) as e:
        run_job(compose_cfg(over), tmp_path / "out")
    assert needle in str(e.value), str(e.value)


def test_vllms_top_k_minus_one_and_max_tokens_null_reach_the_loader(tmp_path, no_model_load):
    """Both were config errors; with vLLM's meanings they are valid (the loader is reached)."""
    with pytest.raises(ModelLoaded):
        run_job(compose_cfg("workload.limit=1", "sampling.top_k=-1", "sampling.max_tokens=null",
                            "sampling.logit_bias={65: 2.5}", "sampling.min_tokens=2"), tmp_path / "out")
