"""Where data lives: a local path or a URI (s3://, gs://, az://, hf://, file://) -> a pyarrow filesystem
and the path inside it.

Readers get one interface whatever the store: pyarrow's own filesystems for local files, S3 and GCS,
and fsspec's (wrapped in pyarrow's `PyFileSystem`) for Azure (adlfs) and the Hugging Face Hub
(huggingface_hub). Credentials come only from each store's standard environment: `AWS_*` (including
`AWS_ENDPOINT_URL` for an S3-compatible server), Google's application default credentials,
`AZURE_STORAGE_*`, `HF_TOKEN`. A URI that carries credentials itself (`s3://key:secret@bucket/...`, a
`?secret_key=` query) is refused: they would end up in logs and saved configs (runner/redact.py).
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO
from urllib.parse import urlsplit

import pyarrow as pa
import pyarrow.fs as pafs

from ladle.runner.config import ConfigError
from ladle.runner.redact import carries_credentials, redact

# scheme -> (fsspec protocol, the package that provides it) for stores pyarrow has no filesystem of its own for
FSSPEC_SCHEMES = {"az": ("az", "adlfs"), "abfs": ("abfs", "adlfs"), "abfss": ("abfss", "adlfs"),
                  "hf": ("hf", "huggingface_hub")}
PYARROW_SCHEMES = ("s3", "gs", "gcs")
CREDENTIALS_HELP = ("credentials come from the store's environment: AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY "
                    "/ AWS_SESSION_TOKEN / AWS_PROFILE (and AWS_ENDPOINT_URL for an S3-compatible server), "
                    "Google application default credentials (GOOGLE_APPLICATION_CREDENTIALS), "
                    "AZURE_STORAGE_ACCOUNT_NAME / AZURE_STORAGE_ACCOUNT_KEY, HF_TOKEN")


@dataclass(frozen=True)
class Location:
    """A file or directory in a filesystem; `uri` is how the user wrote it (redact it before showing it)."""

    fs: pafs.FileSystem
    path: str
    uri: str

    @property
    def local(self) -> bool:
        return isinstance(self.fs, pafs.LocalFileSystem)

    @property
    def name(self) -> str:
        return self.path.rstrip("/").rsplit("/", 1)[-1]

    def child(self, name: str) -> Location:
        return Location(self.fs, f"{self.path.rstrip('/')}/{name}", f"{self.uri.rstrip('/')}/{name}")

    def info(self) -> pafs.FileInfo:
        return self.fs.get_file_info(self.path)

    def exists(self) -> bool:
        return self.info().type != pafs.FileType.NotFound

    def is_file(self) -> bool:
        return self.info().type == pafs.FileType.File

    def is_dir(self) -> bool:
        return self.info().type == pafs.FileType.Directory

    @property
    def suffix(self) -> str:
        return Path(self.name).suffix

    def open_lines(self) -> BinaryIO:
        """A buffered binary reader (iterates over lines); a remote object streams, never read whole."""
        if self.local:
            return open(self.path, "rb")
        return io.BufferedReader(self.fs.open_input_stream(self.path), buffer_size=1 << 20)

    def open_random(self) -> pa.NativeFile:
        """A random-access reader: memory-mapped when local, ranged reads from a store."""
        return pa.memory_map(self.path, "r") if self.local else self.fs.open_input_file(self.path)

    def __str__(self) -> str:
        return redact(self.uri)


def is_uri(text: str) -> bool:
    """Whether `text` names a store by scheme (a Windows drive letter such as C:\\ is a local path)."""
    scheme = urlsplit(text).scheme
    return len(scheme) > 1 and "://" in text


def locate(uri: str, key: str = "path") -> Location:
    """The filesystem and path `uri` names; a ConfigError naming `key` (redacted) for what cannot be opened."""
    if not is_uri(uri):
        return _local(uri)
    parts = urlsplit(uri)
    scheme = parts.scheme.lower()
    shown = redact(uri)
    if carries_credentials(uri):
        raise ConfigError(f"{key}={shown!r} carries credentials or options in the URI; give the plain URI "
                          f"({scheme}://bucket/path) and put {CREDENTIALS_HELP}")
    if scheme == "file":
        return _local(parts.path)
    if not parts.netloc:
        raise ConfigError(f"{key}={shown!r} names no bucket or container: write {scheme}://<bucket>/<path>")
    if scheme in PYARROW_SCHEMES:
        try:
            fs, path = pafs.FileSystem.from_uri(f"{'gs' if scheme == 'gcs' else scheme}://{parts.netloc}{parts.path}")
        except (OSError, ValueError) as e:
            raise ConfigError(f"{key}={shown!r} could not be opened: {redact(str(e))}; {CREDENTIALS_HELP}") from None
        return Location(fs, path, uri)
    return Location(_fsspec(scheme, key, shown), f"{parts.netloc}{parts.path}", uri)


def _local(path: str) -> Location:
    p = Path(path).expanduser().absolute()
    return Location(pafs.LocalFileSystem(), p.as_posix(), str(path))


def _fsspec(scheme: str, key: str, shown: str) -> pafs.FileSystem:
    import fsspec

    protocol, package = FSSPEC_SCHEMES.get(scheme, (scheme, None))
    try:
        fs = fsspec.filesystem(protocol)
    except (ImportError, ValueError) as e:
        need = f"`pip install {package}` (or ladle's `objects` extra)" if package else "a scheme ladle reads"
        raise ConfigError(f"{key}={shown!r}: no filesystem for {scheme}:// ({redact(str(e))}); needs {need}") from None
    return pafs.PyFileSystem(pafs.FSSpecHandler(fs))


def list_files(loc: Location, suffixes: tuple[str, ...]) -> list[Location]:
    """`loc` itself when it is a file, else the files under it with these suffixes (hidden and `_` ones
    left out, as Spark and pyarrow.dataset do), sorted by path."""
    if loc.is_file():
        return [loc]
    infos = loc.fs.get_file_info(pafs.FileSelector(loc.path, recursive=True))
    base = loc.path.rstrip("/") + "/"
    out = []
    for info in infos:
        rel = info.path[len(base):] if info.path.startswith(base) else info.base_name
        if (info.type == pafs.FileType.File and info.base_name.lower().endswith(suffixes)  # `.jsonl.gz` is one
                and not any(part.startswith((".", "_")) for part in rel.split("/"))):
            out.append(loc.child(rel))
    return sorted(out, key=lambda f: f.path)
