"""Secrets out of everything ladle shows or saves: logs, error messages, summary.json, the config stored
in the outputs and the config Hydra saves in the run directory.

A secret reaches a string two ways: inside a URI (`s3://KEY:SECRET@bucket/...`, `...?secret_key=...`,
a signed URL's `?sig=`), or as the value of a store's credential variable (`AWS_SECRET_ACCESS_KEY`,
`HF_TOKEN`, ...) that some message quotes. `redact` replaces both with `***`.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

MASK = "***"
# The environment variables the stores read credentials from (runner/storage.py): their values are secrets.
SECRET_VARIABLES = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ACCESS_KEY_ID", "HF_TOKEN",
                    "HUGGING_FACE_HUB_TOKEN", "AZURE_STORAGE_ACCOUNT_KEY", "AZURE_STORAGE_KEY",
                    "AZURE_STORAGE_CONNECTION_STRING", "AZURE_STORAGE_SAS_TOKEN", "AZURE_CLIENT_SECRET",
                    "GOOGLE_API_KEY")
# scheme://user[:password]@ -> scheme://***@ (the user part of a store URI is an access key id). An AWS
# secret may hold "/", so everything up to the "@" goes (a path holding "@" is masked too: safe side).
_USERINFO = re.compile(r"(?P<scheme>\b[a-zA-Z][a-zA-Z0-9+.-]*://)[^\s@'\"]+@")
# ?k=v&k2=v2 after a URI's path: every value hidden (options of store URIs are credentials or endpoints)
_QUERY = re.compile(r"(?P<scheme>\b[a-zA-Z][a-zA-Z0-9+.-]*://[^\s'\"?]*)\?(?P<query>[^\s'\"]*)")
_SHORTEST_SECRET = 8  # shorter values are not masked: "***" in place of every "0" would help nobody


def _mask_query(m: re.Match[str]) -> str:
    pairs = [p.split("=", 1)[0] + f"={MASK}" for p in m.group("query").split("&") if p]
    return f"{m.group('scheme')}?{'&'.join(pairs)}"


def carries_credentials(uri: str) -> bool:
    """Whether a URI holds a user part (`KEY:SECRET@`, where the secret may hold "/") or a query."""
    return bool(_USERINFO.match(uri) or _QUERY.match(uri))


def redact(text: str) -> str:
    """`text` with the credentials in its URIs and the values of the stores' credential variables masked."""
    text = _USERINFO.sub(lambda m: f"{m.group('scheme')}{MASK}@", text)
    text = _QUERY.sub(_mask_query, text)
    for name in SECRET_VARIABLES:
        value = os.environ.get(name)
        if value and len(value) >= _SHORTEST_SECRET and value in text:
            text = text.replace(value, MASK)
    return text


def redact_files(directory: Path) -> None:
    """Rewrite every file in `directory` (Hydra's saved config.yaml, hydra.yaml, overrides.yaml) whose
    text holds a secret; Hydra writes them before the job runs, from the command line as it was given."""
    if not directory.is_dir():
        return
    for f in directory.iterdir():
        if f.is_file():
            text = f.read_text(encoding="utf-8", errors="surrogateescape")
            clean = redact(text)
            if clean != text:
                tmp = f.with_name(f.name + ".tmp")
                tmp.write_text(clean, encoding="utf-8", errors="surrogateescape")
                os.replace(tmp, f)


def redact_record(record: logging.LogRecord) -> logging.LogRecord:
    """The record with its message formatted and redacted (when it held a secret)."""
    message = record.getMessage()
    clean = redact(message)
    if clean != message:
        record.msg, record.args = clean, None
    return record


def install_log_redaction() -> None:
    """Every log record made from now on is redacted as it is created, whatever logger or handler takes it
    (Hydra replaces its handlers per job and logs a sweep's overrides before any job runs)."""
    make = logging.getLogRecordFactory()
    if getattr(make, "redacts", False):
        return

    def factory(*args: object, **kwargs: object) -> logging.LogRecord:
        return redact_record(make(*args, **kwargs))

    factory.redacts = True  # type: ignore[attr-defined]
    logging.setLogRecordFactory(factory)
