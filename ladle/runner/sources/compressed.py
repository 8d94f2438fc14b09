"""Compressed line files, decompressed as they are read (pandas, datasets and pyarrow read them so).

The file name's last extension names the compression: `.gz`, `.bz2`, `.xz`, `.zst`. A file whose bytes
are compressed but whose name does not say so (or in a format not read here: zip, lz4) is a ConfigError
naming the file and the fix, not a file of unreadable lines.
"""

from __future__ import annotations

import io
import lzma
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

import pyarrow as pa

from ladle.runner.config import ConfigError
from ladle.runner.storage import Location

CODECS = {".gz": "gzip", ".bz2": "bz2", ".xz": "xz", ".zst": "zstd"}  # extension -> codec
# The first bytes of each format; bz2's stream header is "BZh", a block size digit, then the block magic.
MAGIC = ((b"\x1f\x8b", "gzip"), (b"\x28\xb5\x2f\xfd", "zstd"), (b"\xfd7zXZ\x00", "xz"),
         (b"PK\x03\x04", "zip"), (b"\x04\x22\x4d\x18", "lz4"))
READ_BUFFER = 1 << 20


def with_compressions(suffixes: tuple[str, ...]) -> tuple[str, ...]:
    """The suffixes, each also followed by every compression's extension (`.jsonl`, `.jsonl.gz`, ...)."""
    return suffixes + tuple(s + c for s in suffixes for c in CODECS)


def data_suffix(path: Location) -> str:
    """The extension naming the data's format, under a compression's: `.jsonl` for `data.jsonl.gz`."""
    suffixes = [s.lower() for s in Path(path.name).suffixes]
    if len(suffixes) > 1 and suffixes[-1] in CODECS:
        return suffixes[-2]
    return suffixes[-1] if suffixes else ""


def sniffed(head: bytes) -> str | None:
    """The compression format these first bytes of a file are in, if any."""
    if head[:3] == b"BZh" and head[3:4].isdigit() and head[4:10] == b"1AY&SY":
        return "bz2"
    return next((name for magic, name in MAGIC if head.startswith(magic)), None)


def _open(loc: Location) -> BinaryIO:
    """The file's decompressed bytes, streamed (a store's object is never read whole)."""
    codec = CODECS.get(loc.suffix.lower())
    raw = loc.open_lines()
    if codec is None:
        found = sniffed(raw.peek(10)[:10])
        if found is not None:
            raw.close()
            fix = ("unpack it" if found not in CODECS.values()
                   else f"name it with its compression's extension ({loc.name}{_ext(found)})")
            raise ConfigError(f"{loc} is {found}-compressed but its name does not say so: {fix}; "
                              f"compressed files are read by their extension ({', '.join(CODECS)})")
        return raw
    if codec == "xz":  # not one of pyarrow's codecs
        return lzma.open(raw, "rb")
    return io.BufferedReader(pa.input_stream(raw, compression=codec), READ_BUFFER)


def _ext(codec: str) -> str:
    return next(ext for ext, c in CODECS.items() if c == codec)


@contextmanager
def open_lines(loc: Location) -> Iterator[BinaryIO]:
    """`loc` opened for reading its decompressed bytes; compressed data that is cut off or corrupt is a
    ConfigError naming the file (found by the first full read, before the model loads)."""
    fh = _open(loc)
    try:
        yield fh
    except (OSError, EOFError, lzma.LZMAError, pa.ArrowInvalid) as e:
        raise ConfigError(f"{loc} could not be decompressed ({type(e).__name__}: {e}); the file is cut off or "
                          "corrupt: write it again") from None
    finally:
        fh.close()
