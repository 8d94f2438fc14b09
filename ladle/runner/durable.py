"""Durable files: bytes flushed to the device before a rename points a name at them, and the rename flushed
after, so a power loss leaves the old file or the new one under a name, never one cut short."""

from __future__ import annotations

import logging
import os
from pathlib import Path

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
