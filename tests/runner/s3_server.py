"""An S3 API server for tests: moto's ThreadedMotoServer on 127.0.0.1 at a free port.

    def test_x(s3):                 # AWS_ENDPOINT_URL and dummy keys set for this test
        uri = s3.put("data/x.parquet", table)     # -> "s3://<bucket>/data/x.parquet"

Every test gets a bucket of its own; the server starts once for all the tests. Readers reach it the way
they reach AWS: through the standard AWS_* variables, which pyarrow, s3fs and boto3 all read.
"""

from __future__ import annotations

import io
import uuid
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

KEYS = {"AWS_ACCESS_KEY_ID": "testing-key-id", "AWS_SECRET_ACCESS_KEY": "testing-secret-key",
        "AWS_DEFAULT_REGION": "us-east-1", "AWS_REGION": "us-east-1"}


@dataclass
class Bucket:
    name: str
    client: Any  # boto3's S3 client, talking to the server

    def uri(self, key: str = "") -> str:
        return f"s3://{self.name}/{key}"

    def put(self, key: str, data: bytes | str | pa.Table, **parquet: Any) -> str:
        """Store `data` (bytes, text, or a table written as Parquet) under `key`; its s3:// URI."""
        if isinstance(data, pa.Table):
            buf = io.BytesIO()
            pq.write_table(data, buf, **parquet)
            data = buf.getvalue()
        body = data.encode() if isinstance(data, str) else data
        self.client.put_object(Bucket=self.name, Key=key, Body=body)
        return self.uri(key)

    def get(self, key: str) -> bytes:
        return self.client.get_object(Bucket=self.name, Key=key)["Body"].read()

    def list_keys(self, prefix: str = "") -> list[str]:
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.name, Prefix=prefix)
        return sorted(o["Key"] for page in pages for o in page.get("Contents", []))


@pytest.fixture(scope="session")
def s3_endpoint():
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def s3(s3_endpoint, monkeypatch) -> Bucket:
    import boto3

    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)
    for name, value in KEYS.items():
        monkeypatch.setenv(name, value)
    client = boto3.client("s3", endpoint_url=s3_endpoint)
    name = f"ladle-{uuid.uuid4().hex[:12]}"
    client.create_bucket(Bucket=name)
    return Bucket(name, client)
