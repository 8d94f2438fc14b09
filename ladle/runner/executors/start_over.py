"""executor=ray with output.resume=false: the new attempt's replicas write into a staging directory, and
the run directory's previous output (merged files, replicas' files, routing) stays as it was until the
attempt has written.

executor=local keeps its previous files until the new ones close (runner/writer.py); the same rule here,
one level up: once any replica of the new attempt has closed its files (or the attempt is complete),
the staged replicas replace the old ones and are merged. An attempt that wrote nothing (Ray did not
start, every replica failed before writing, Ctrl-C while the models load) leaves everything as it was.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from ladle.runner.sinks import GENERATIONS, STEPS

STAGING = ".start_over"  # <out>/.start_over/replicas/r<k>/: the replicas of an attempt not yet adopted


def staging_root(out: Path) -> Path:
    return out / STAGING


def begin(out: Path) -> Path:
    """A fresh staging root (a killed earlier attempt's leftovers dropped), for the replicas to write in
    as they would in `out`."""
    drop_stale(out)  # an earlier adoption cut short is finished first: its replicas are the output now
    root = staging_root(out)
    root.mkdir(parents=True)
    return root


def drop_stale(out: Path) -> None:
    """A resumed run continues the adopted replicas: an attempt that never replaced them is dropped; one
    whose adoption was cut short (its mark, the retired directory, is there) is adopted to the end."""
    old, new, retired = _dirs(out)
    if retired.exists():
        if new.exists() and not old.exists():
            os.replace(new, old)
        for name in (GENERATIONS, STEPS):  # the previous attempt's merge, as adopt() drops it
            (out / name).unlink(missing_ok=True)
        shutil.rmtree(retired, ignore_errors=True)
    shutil.rmtree(staging_root(out), ignore_errors=True)


def _dirs(out: Path) -> tuple[Path, Path, Path]:
    """The replicas in use, the staged ones, and where the replaced ones wait while they are swapped."""
    return out / "replicas", staging_root(out) / "replicas", out / (STAGING + ".retired")


def wrote(out: Path) -> bool:
    """Whether a replica of the staged attempt closed its files (a killed replica's `.tmp` does not count,
    as a killed local job's `.tmp` does not replace its previous file)."""
    return any((staging_root(out) / "replicas").glob(f"r*/{GENERATIONS}"))


def adopt(out: Path) -> None:
    """The staged replicas replace the previous ones; the merged files of the previous attempt go, so the
    merge that follows describes this attempt alone (a crash from here on leaves replicas a resume merges)."""
    old, new, retired = _dirs(out)
    shutil.rmtree(retired, ignore_errors=True)
    new.mkdir(parents=True, exist_ok=True)
    if old.exists():
        os.replace(old, retired)
    else:
        retired.mkdir()  # the mark that the swap began, for drop_stale to finish it if the process dies here
    os.replace(new, old)
    for name in (GENERATIONS, STEPS):
        (out / name).unlink(missing_ok=True)
    shutil.rmtree(retired, ignore_errors=True)
    shutil.rmtree(staging_root(out), ignore_errors=True)
