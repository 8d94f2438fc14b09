"""runner/storage.py (URI -> filesystem) against a real S3 API server, and runner/redact.py."""

from __future__ import annotations

import logging

import pyarrow as pa
import pyarrow.fs as pafs
import pytest

from ladle.runner.config import ConfigError
from ladle.runner.redact import redact, redact_files, redact_record
from ladle.runner.storage import is_uri, list_files, locate


def test_local_paths_and_file_uris_are_the_local_filesystem(tmp_path):
    (tmp_path / "a.jsonl").write_text("{}\n")
    for given in (str(tmp_path / "a.jsonl"), f"file://{tmp_path}/a.jsonl"):
        loc = locate(given)
        assert isinstance(loc.fs, pafs.LocalFileSystem) and loc.local
        assert loc.path == (tmp_path / "a.jsonl").as_posix() and loc.is_file()
    assert not is_uri("C:\\data\\x.parquet") and not is_uri("rel/x") and is_uri("s3://b/k")


def test_s3_uri_reads_and_lists_through_the_standard_environment(s3):
    s3.put("d/part-1.jsonl", "{}\n")
    s3.put("d/sub/part-0.jsonl", "{}\n")
    s3.put("d/_SUCCESS.jsonl", "")
    s3.put("d/.hidden/x.jsonl", "")
    s3.put("d/notes.txt", "x")
    loc = locate(s3.uri("d"))
    assert isinstance(loc.fs, pafs.S3FileSystem) and not loc.local and loc.is_dir()
    assert [f.name for f in list_files(loc, (".jsonl",))] == ["part-1.jsonl", "part-0.jsonl"]
    one = locate(s3.uri("d/part-1.jsonl"))
    assert [f.uri for f in list_files(one, (".jsonl",))] == [s3.uri("d/part-1.jsonl")]
    with one.fs.open_input_stream(one.path) as fh:
        assert fh.read() == b"{}\n"


@pytest.mark.parametrize("uri", ["s3://AKIAEXAMPLEKEY:verysecretvalue@bucket/x.parquet",
                                 "s3://bucket/x.parquet?access_key=AKIAEXAMPLEKEY&secret_key=verysecretvalue"])
def test_credentials_in_a_uri_are_refused_without_showing_them(uri):
    with pytest.raises(ConfigError) as e:
        locate(uri, "workload.path")
    message = str(e.value)
    assert "workload.path" in message and "AWS_SECRET_ACCESS_KEY" in message
    assert "verysecretvalue" not in message and "AKIAEXAMPLEKEY" not in message


def test_unknown_scheme_names_the_value_and_what_to_install():
    with pytest.raises(ConfigError, match=r"output\.path='nosuchfs://b/x'.*no filesystem for nosuchfs://"):
        locate("nosuchfs://b/x", "output.path")


def test_redact_masks_uri_credentials_and_credential_variables(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_abcdefghijklmnop")
    text = ("read s3://AKIA123:sec/ret@bkt/k and gs://b/o?sig=abc123&x=1 with token hf_abcdefghijklmnop; "
            "plain s3://bkt/k stays")
    out = redact(text)
    for secret in ("AKIA123", "sec/ret", "abc123", "hf_abcdefghijklmnop"):
        assert secret not in out
    assert "s3://***@bkt/k" in out and "gs://b/o?sig=***&x=***" in out and "plain s3://bkt/k stays" in out


def test_redact_files_and_log_filter(tmp_path, caplog):
    (tmp_path / "overrides.yaml").write_text("- workload.path=s3://KEYID:SECRETVALUE@b/x\n")
    (tmp_path / "config.yaml").write_text("model: tiny\n")
    redact_files(tmp_path)
    assert "SECRETVALUE" not in (tmp_path / "overrides.yaml").read_text()
    assert (tmp_path / "config.yaml").read_text() == "model: tiny\n"
    record = logging.LogRecord("ladle", logging.INFO, __file__, 1, "source %s", ("s3://K:SECRETVALUE@b/x",), None)
    redact_record(record)
    assert "SECRETVALUE" not in record.getMessage()


def test_parquet_written_and_read_back_through_a_location(s3):
    import pyarrow.parquet as pq

    loc = locate(s3.uri("out/t.parquet"))
    pq.write_table(pa.table({"a": [1, 2]}), loc.path, filesystem=loc.fs)
    assert pq.read_table(loc.path, filesystem=loc.fs).column("a").to_pylist() == [1, 2]
    assert s3.list_keys("out/") == ["out/t.parquet"]
