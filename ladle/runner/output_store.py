"""output.path: where a run's outputs are kept when that is not the run directory (a store URI such as
s3://bucket/runs/x, or another local directory).

The run still writes into its run directory first (runner/writer.py: row groups streamed to `.tmp`
files, verified, renamed), which also keeps its log and plots. At the end of the run, complete or
interrupted, each output (generations.parquet, steps.parquet, summary.json, batch_output.jsonl) is
copied to output.path in 1 MiB chunks (memory bounded whatever its size) as `<name>.tmp`, then moved
onto its final name: a reader never sees a half-written object, and a failed copy leaves the previous
one. A run whose run directory holds no generations yet (a new machine, a new hydra.run.dir) first
copies the previous outputs from output.path into it, so resume reads what output.path holds.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pyarrow.fs as pafs

from ladle.runner.config import ConfigError, OutputConfig
from ladle.runner.redact import redact
from ladle.runner.sinks import GENERATIONS, STEPS, OutputError, tmp_path
from ladle.runner.storage import CREDENTIALS_HELP, Location, locate

log = logging.getLogger("ladle")

RESUMED_FROM = (GENERATIONS, STEPS)  # what a resume reads back
CHUNK = 1 << 20


def output_location(output: OutputConfig, out: Path) -> Location | None:
    """Where output.path points, checked before the model loads; None when it is unset or the run directory."""
    if not output.path:
        return None
    dest = locate(output.path, "output.path")
    if dest.local and Path(dest.path) == out.absolute():
        return None
    try:
        if dest.local:
            Path(dest.path).mkdir(parents=True, exist_ok=True)
        else:  # the bucket (or container) must exist: ladle never creates one
            bucket = dest.path.split("/", 1)[0]
            if dest.fs.get_file_info(bucket).type == pafs.FileType.NotFound:
                raise ConfigError(f"output.path={str(dest)!r}: bucket {bucket!r} does not exist; create it first")
    except OSError as e:
        raise ConfigError(f"output.path={str(dest)!r} cannot be written: {redact(str(e))}; {CREDENTIALS_HELP}") from None
    return dest


def fetch_previous(dest: Location, out: Path) -> list[str]:
    """Copy generations and steps from output.path into a run directory that has no generations of its own
    (its own, when present, are the newer: output.path only ever receives copies of them)."""
    if (out / GENERATIONS).exists() or tmp_path(out / GENERATIONS).exists():
        return []
    fetched = fetch(dest, RESUMED_FROM, out)
    if fetched:
        log.info("resuming from %s: copied %s into %s", dest, ", ".join(fetched), out)
    return fetched


def fetch(src: Location, names: tuple[str, ...], out: Path) -> list[str]:
    """Copy the objects `names` that `src` holds into `out` (each through a `.tmp` renamed onto its name)."""
    out.mkdir(parents=True, exist_ok=True)
    fetched = []
    for name in names:
        obj = src.child(name)
        if not obj.is_file():
            continue
        local = out / name
        pafs.copy_files(obj.path, tmp_path(local).as_posix(), source_filesystem=obj.fs,
                        destination_filesystem=pafs.LocalFileSystem(), chunk_size=CHUNK, use_threads=False)
        tmp_path(local).replace(local)
        fetched.append(name)
    return fetched


def publish(files: list[Path], dest: Location) -> list[Location]:
    """Copy each existing file to output.path, atomically per object (`.tmp`, then moved onto its name)."""
    done = []
    for f in files:
        if not f.is_file():
            continue
        target = dest.child(f.name)
        tmp = dest.child(f.name + ".tmp")
        try:
            pafs.copy_files(f.as_posix(), tmp.path, source_filesystem=pafs.LocalFileSystem(),
                            destination_filesystem=dest.fs, chunk_size=CHUNK, use_threads=False)
            dest.fs.move(tmp.path, target.path)
        except OSError as e:
            _discard(tmp)
            raise OutputError(f"copying {f.name} to {target} failed: {redact(str(e))}; the run directory keeps it "
                          f"and {target} is as it was") from None
        done.append(target)
    return done


def _discard(tmp: Location) -> None:
    try:
        tmp.fs.delete_file(tmp.path)
    except OSError:
        pass  # never created: nothing to remove
