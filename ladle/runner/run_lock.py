"""One job per run directory: an OS lock on `<run dir>/.ladle.lock`, held while the job runs.

A second job into the same directory (a resume command re-run too early) would otherwise take the
live job's `.tmp` files for a killed process's leftovers and delete them. `flock` is released by the
kernel when its holder exits, however it exits (SIGKILL, power loss: the lock is not on disk), so a
lock that can be taken is a dead owner's, and only then are leftovers recovered (runner/resume.py).
The file holds the owner's pid, for the refusal's message; it is never deleted (deleting it would let
two jobs lock two different files of the same name).
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from types import TracebackType
from typing import Self

from ladle.runner.config import ConfigError

LOCK_FILE = ".ladle.lock"


class RunDirBusy(ConfigError):
    """Another live job owns the run directory."""


class RunDirLock:
    """`with RunDirLock(out):` owns `out` for the block, or raises RunDirBusy naming the owner's pid."""

    def __init__(self, out: Path) -> None:
        self.path = Path(out) / LOCK_FILE
        self._fd: int | None = None

    def __enter__(self) -> Self:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise self._unusable(e) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise RunDirBusy(
                f"run directory {self.path.parent} is in use by another ladle job (pid {owner}); wait for it "
                "to finish (or stop it), then run the same command to resume, or use another hydra.run.dir"
            ) from None
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError as e:
            os.close(fd)  # releases the lock
            raise self._unusable(e) from None
        self._fd = fd
        return self

    def _unusable(self, e: OSError) -> ConfigError:
        """A directory the job cannot write its lock into (read-only, another user's, a full disk) cannot
        take its outputs either: said before anything runs."""
        return ConfigError(f"run directory {self.path.parent} cannot be used: writing {self.path.name} failed "
                           f"({e.strerror or e}); make the directory writable (or free space), or use another "
                           "hydra.run.dir")

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor releases the lock
            self._fd = None
