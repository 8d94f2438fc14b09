"""Config composition: every group option composes and validates; mistakes fail naming the key."""

from __future__ import annotations

import pytest
from hydra.errors import ConfigCompositionException

from ladle.runner.config import CONF_DIR, ConfigError, check, engine_config, to_job_config
from tests.runner.conftest import compose_cfg


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def test_defaults():
    job = to_job_config(compose_cfg())
    assert job.model.name == "tiny" and job.cache.backend == "paged" and job.workload.name == "sample"
    assert job.clock == "virtual" and job.workload.arrivals.process == "offline"
    assert job.workload.path.endswith("runner/data/prompts.parquet")
    check(job)
    assert engine_config(job).chunking.size == 16


@pytest.mark.parametrize("group", ["cache", "chunking", "workload", "model", "experiment"])
def test_every_group_option_composes(group):
    options = _options(group)
    assert options
    for name in options:
        overrides = [f"{group}={name}"]
        if group == "workload" and name in ("parquet", "arrow", "hf_dataset", "jsonl", "openai_batch"):
            overrides.append("workload.path=some/where")
        job = to_job_config(compose_cfg(*overrides))
        if group != "model":  # real models want their weights; their schema still composed
            check(job)


def test_group_options_present():
    assert {"paged", "contiguous"} <= set(_options("cache"))
    assert {"default", "off", "small_chunks", "decode_priority", "one_prefill_at_a_time", "interleave"} <= set(
        _options("chunking"))
    # data sources in workload/, benchmark scenarios in experiment/, and no scenario among the sources
    scenarios = {"baseline", "continuous_batching", "paged_attention", "chunked_prefill", "prefix_caching",
                 "gpu_long_documents"}
    assert {"sample", "parquet", "arrow", "hf_dataset", "jsonl", "synthetic", "openai_batch"} <= set(_options("workload"))
    assert scenarios <= set(_options("experiment")) and not scenarios & set(_options("workload"))
    for name in _options("experiment"):  # a scenario may set any key of the job, so it is global
        assert (CONF_DIR / "experiment" / f"{name}.yaml").read_text().startswith("# @package _global_\n"), name
    job = to_job_config(compose_cfg("chunking=one_prefill_at_a_time"))
    assert job.chunking.max_partial_prefills == 1
    assert to_job_config(compose_cfg("chunking=interleave")).chunking.prefill_interval == 2
    assert to_job_config(compose_cfg("chunking=decode_priority")).chunking.decode_headroom is not None
    assert to_job_config(compose_cfg("chunking=off")).chunking.enabled is False


def test_benchmark_workload_shapes():
    cp = to_job_config(compose_cfg("experiment=chunked_prefill")).workload
    stream, long = cp.synthetic.groups
    assert stream.arrival is None and long.arrival.process == "poisson"
    assert long.min_prompt_len >= 2048 and cp.arrivals.process == "trace"
    pc = to_job_config(compose_cfg("experiment=prefix_caching")).workload.synthetic.groups[0]
    assert 1024 <= pc.shared_prefix_len <= 2048 and pc.prompt_len < 256


@pytest.mark.parametrize(("override", "key"), [
    ("chunking.sise=3", "sise"),
    ("chunking.size=abc", "chunking.size"),
    ("workload.arrivals.rate=fast", "workload.arrivals.rate"),
    ("output.row_group_size=1.5", "output.row_group_size"),
    ("max_num_seqs=many", "max_num_seqs"),
    ("sampling.temprature=0", "temprature"),
])
def test_wrong_key_or_type_fails_at_compose(override, key):
    with pytest.raises(ConfigCompositionException) as e:
        compose_cfg(override)
    text = str(e.value) + str(e.value.__cause__)
    assert key in text


@pytest.mark.parametrize(("overrides", "words"), [
    (["+foo=1"], "foo"),
    (["workload=parquet"], "workload.path"),
    (["workload.kind=csv"], "workload.kind"),
    (["workload.arrivals.process=uniform"], "workload.arrivals.process"),
    (["workload.arrivals.process=poisson", "workload.arrivals.rate=0"], "workload.arrivals.rate"),
    (["clock=sundial"], "clock"),
    (["chunking.size=0"], "chunking.size"),
    (["cache.backend=ring"], "cache.backend"),
    (["sampling.top_p=0"], "top_p"),
    (["max_pending=2"], "max_pending"),
    (["workload=openai_batch", "workload.path=x.jsonl", "workload.arrivals.process=trace"],
     "trace needs an arrival column"),  # was accepted: every line became an error row
])
def test_invalid_values_name_the_key(overrides, words):
    with pytest.raises(ConfigError, match=words.replace(".", r"\.")):
        check(to_job_config(compose_cfg(*overrides)))


def test_missing_source_and_column_fail_before_the_model(tmp_path, no_model_load):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from ladle.runner.executors.local import Local

    with pytest.raises(ConfigError, match="does not exist"):
        Local().run(compose_cfg("workload=parquet", f"workload.path={tmp_path}/nope.parquet"), tmp_path)
    pq.write_table(pa.table({"question": ["a"]}), tmp_path / "q.parquet")
    with pytest.raises(ConfigError, match=r"prompt_column='prompt' is not a column .*question"):
        Local().run(compose_cfg("workload=parquet", f"workload.path={tmp_path}/q.parquet"), tmp_path)
