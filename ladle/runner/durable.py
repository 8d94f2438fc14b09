"""Durable files: a `.tmp` moved into place once complete, its bytes flushed to the device before the
rename points the name at them and the rename flushed after, so a power loss leaves the old file or the
new one under the name, never one cut short; and the recovery of a `.tmp` a dead process left."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

log = logging.getLogger("ladle")


def fsync_path(path: Path) -> None:
    """Flush a file's bytes to the device (OSError, e.g. ENOSPC, when they cannot be)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sync_dir(directory: Path) -> None:
    """Flush a directory's entries (a rename into it) to the device; a filesystem that cannot sync a
    directory (some network ones) only loses the rename's durability, which recover() makes up for."""
    try:
        fsync_path(directory)
    except OSError as e:
        log.debug("syncing %s failed: %s", directory, e)


def tmp_path(path: Path) -> Path:
    return path.with_name(path.name + ".tmp")


def readable(path: Path) -> pq.ParquetFile | None:
    """The file if it is a complete Parquet file, else None (missing, or cut off before its footer)."""
    try:
        return pq.ParquetFile(path) if path.exists() else None
    except (pa.ArrowInvalid, OSError):
        return None


def recover(path: Path) -> None:
    """Make `path` the latest complete file before a run writes into it again.

    A readable `.tmp` is a run that finished writing but died before its rename: it already holds every
    row of `path` (each run copies the previous file first), so it replaces `path`. An unreadable one
    (the process was killed mid-write) is removed: its rows are computed again.
    """
    tmp = tmp_path(path)
    if tmp.exists():
        if readable(tmp) is not None:
            fsync_path(tmp)
            os.replace(tmp, path)
            sync_dir(path.parent)
        else:
            tmp.unlink()
