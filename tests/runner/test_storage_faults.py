"""Output files under storage faults: a write that fails (a full disk) never replaces complete output."""

from __future__ import annotations

import errno
import io
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ladle.runner.job import run_job
from ladle.runner.sinks import OutputError
from tests.runner.conftest import compose_cfg
from tests.runner.fake_engine import FakeEngine

ROOT = Path(__file__).resolve().parents[2]


class FullDisk(io.RawIOBase):
    """A file that takes `budget` bytes, then writes what fits and raises ENOSPC, as a full disk does."""

    def __init__(self, path: str | Path, budget: int) -> None:
        super().__init__()
        self.f, self.left = open(path, "wb"), budget  # noqa: SIM115 - closed by close()

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        b = bytes(b)
        if len(b) > self.left:
            self.f.write(b[: self.left])
            self.left = 0
            raise OSError(errno.ENOSPC, "No space left on device")
        self.left -= len(b)
        return self.f.write(b)

    def close(self) -> None:
        self.f.close()
        super().close()


def fill_disk_at(monkeypatch, name: str, budget: int) -> None:
    """Every new `<name>.tmp` the sinks open takes only `budget` bytes."""
    real = pq.ParquetWriter

    def writer(where, schema, **kw):
        if Path(str(where)).name == name + ".tmp":
            where = FullDisk(where, budget)
        return real(where, schema, **kw)

    monkeypatch.setattr(pq, "ParquetWriter", writer)


def source(tmp_path: Path, n: int) -> Path:
    p = tmp_path / "p.parquet"
    pq.write_table(pa.table({"prompt": [f"question number {i}?" for i in range(n)]}), p)
    return p


@pytest.mark.parametrize("name", ["generations.parquet", "steps.parquet"])
def test_a_full_disk_during_a_resume_keeps_the_complete_files(tmp_path, monkeypatch, name):
    """A resumed run's writes fail part-way: the earlier complete generations and steps files stay byte for
    byte, no .tmp is left, and the job raises naming the file and the cause. The next run resumes from
    them (before, the footerless .tmp replaced the file and the next resume started from zero)."""
    src, out = source(tmp_path, 40), tmp_path / "out"
    cfg = lambda limit: compose_cfg("workload=parquet", f"workload.path={src}", f"workload.limit={limit}",
                                    "output.row_group_size=4", "output.steps_row_group_size=4")
    run_job(cfg(20), out, engine=FakeEngine(max_num_seqs=3))
    before = {n: (out / n).read_bytes() for n in ("generations.parquet", "steps.parquet")}
    fill_disk_at(monkeypatch, name, (out / name).stat().st_size + 200)  # room for the copy and a little more
    with pytest.raises(OutputError) as e:
        run_job(cfg(40), out, engine=FakeEngine(max_num_seqs=3))
    assert name in str(e.value) and "No space left on device" in str(e.value), e.value
    assert "kept" in str(e.value)
    assert {n: (out / n).read_bytes() for n in before} == before
    assert not list(out.glob("*.tmp"))
    monkeypatch.undo()  # space again: the same command resumes from the 20 rows kept
    result = run_job(cfg(40), out, engine=FakeEngine(max_num_seqs=3))
    assert result.summary["resumed"] == 20 and pq.read_table(out / "generations.parquet").num_rows == 40


def test_a_file_whose_row_count_is_wrong_is_not_moved_into_place(tmp_path, monkeypatch):
    """A writer that closes without an error but loses rows (its footer counts fewer) fails verification."""
    from ladle.runner.sinks import ParquetSink

    path = tmp_path / "g.parquet"
    pq.write_table(pa.table({"a": ["old"]}), path)
    sink = ParquetSink(path, pa.schema([("a", pa.string())]), 2, {})
    for i in range(5):
        sink.write({"a": str(i)})
    sink.rows_written += 1  # one row the file does not hold
    with pytest.raises(OutputError, match="holds 5 rows, 6 were written"):
        sink.close()
    assert pq.read_table(path).column("a").to_pylist() == ["old"] and not sink.tmp.exists()


FULL_DISK_SCRIPT = """
import sys
from pathlib import Path
import pyarrow.parquet as pq
from tests.runner.test_storage_faults import FullDisk
budget = int(sys.argv.pop(1))
real = pq.ParquetWriter
def writer(where, schema, **kw):
    if Path(str(where)).name == "generations.parquet.tmp":
        where = FullDisk(where, budget)
    return real(where, schema, **kw)
pq.ParquetWriter = writer
from ladle.runner import cli
sys.argv = ["ladle", *sys.argv[1:]]
cli.main()
"""


@pytest.mark.parametrize("budget", [0, 10])  # full before the file's magic bytes; before its first row group
def test_the_cli_exits_non_zero_naming_the_write_that_failed(tmp_path, budget):
    out = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, "-c", FULL_DISK_SCRIPT, str(budget), f"hydra.run.dir={out}", "workload.limit=2",
                        "sampling.max_tokens=2", "output.plots=false", "output.print_summary=false",
                        "output.progress=false"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
                          check=False)
    assert p.returncode == 1, p.stderr[-3000:]
    assert "ladle: error:" in p.stderr and "generations.parquet" in p.stderr, p.stderr[-3000:]
    assert "No space left on device" in p.stderr and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert not (out / "generations.parquet").exists() and not (out / "generations.parquet.tmp").exists()


def fsync_fails_for(monkeypatch, name: str, calls: list[str]) -> None:
    """os.fsync records what it syncs and raises ENOSPC for `<name>.tmp`, as a disk that took the writes
    into its cache (delayed allocation, NFS) reports a full disk only when they are flushed."""
    real = os.fsync

    def fsync(fd: int) -> None:
        target = os.readlink(f"/proc/self/fd/{fd}")
        calls.append(target)
        if Path(target).name == name + ".tmp":
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)


@pytest.mark.parametrize("name", ["generations.parquet", "steps.parquet"])
def test_a_full_disk_found_when_the_file_is_flushed_keeps_the_complete_files(tmp_path, monkeypatch, name):
    """Every write and the footer succeed, the flush to the device fails: the file must not replace the
    previous one (before, nothing flushed it: the rename went ahead and the bytes could be lost later)."""
    src, out = source(tmp_path, 12), tmp_path / "out"
    cfg = lambda limit: compose_cfg("workload=parquet", f"workload.path={src}", f"workload.limit={limit}",
                                    "output.row_group_size=4")
    run_job(cfg(6), out, engine=FakeEngine(max_num_seqs=3))
    before = {n: (out / n).read_bytes() for n in ("generations.parquet", "steps.parquet")}
    calls: list[str] = []
    fsync_fails_for(monkeypatch, name, calls)
    with pytest.raises(OutputError, match=f"{name}.*No space left on device.*kept"):
        run_job(cfg(12), out, engine=FakeEngine(max_num_seqs=3))
    assert {n: (out / n).read_bytes() for n in before} == before
    assert not list(out.glob("*.tmp"))


def test_each_file_is_flushed_before_its_rename_and_the_directory_after(tmp_path, monkeypatch):
    """The order a power loss cannot undo: the new bytes on the device, then the name pointing at them."""
    src, out = source(tmp_path, 4), tmp_path / "out"
    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(("sync", os.readlink(f"/proc/self/fd/{fd}"))),
                                                 real_fsync(fd))[1])
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append(("rename", str(a))), real_replace(a, b))[1])
    run_job(compose_cfg("workload=parquet", f"workload.path={src}"), out, engine=FakeEngine(max_num_seqs=3))
    for name in ("generations.parquet", "steps.parquet"):
        tmp = str((out / (name + ".tmp")).resolve())
        assert ("rename", str(out / (name + ".tmp"))) in events, events
        renamed = events.index(("rename", str(out / (name + ".tmp"))))
        assert ("sync", tmp) in events[:renamed], events
        assert ("sync", str(out.resolve())) in events[renamed:], events


@pytest.mark.parametrize("where", ["generations.parquet", "steps.parquet"])
def test_a_second_interrupt_while_the_files_close_still_finalises_both(tmp_path, monkeypatch, where):
    """Ctrl-C (or SIGTERM) pressed again while the files are being closed: both files are still closed,
    checked and moved into place together, and the run reports itself interrupted. Before, the interrupt
    left the closing file's .tmp unrenamed and the other one never closed, so the next run's recovery
    could take the new generations with the old steps (or none)."""
    from ladle.runner.sinks import ParquetSink

    src, out = source(tmp_path, 12), tmp_path / "out"
    cfg = lambda limit: compose_cfg("workload=parquet", f"workload.path={src}", f"workload.limit={limit}",
                                    "output.row_group_size=4", "output.steps_row_group_size=4")
    run_job(cfg(6), out, engine=FakeEngine(max_num_seqs=3))
    real, pressed, verified = ParquetSink._verify, [], []

    def verify(self):
        if self.path.name == where and not pressed:
            pressed.append(True)
            raise KeyboardInterrupt  # arrives just as this file's writer closed, before its check
        verified.append(self.path.name)
        return real(self)

    monkeypatch.setattr(ParquetSink, "_verify", verify)
    try:
        result = run_job(cfg(12), out, engine=FakeEngine(max_num_seqs=3))
    except KeyboardInterrupt:
        result = None
    assert pressed and result is not None and result.interrupted, "the interrupt escaped the files' close"
    assert sorted(verified) == ["generations.parquet", "steps.parquet"]  # no file moved into place unchecked
    assert not list(out.glob("*.tmp"))
    gen, steps = pq.read_table(out / "generations.parquet"), pq.read_table(out / "steps.parquet")
    assert gen.num_rows == 12 and sorted(set(gen.column("attempt").to_pylist())) == [0, 1]
    assert sorted(set(steps.column("attempt").to_pylist())) == [0, 1]


def test_a_full_disk_while_the_previous_rows_are_copied_is_a_failed_write(tmp_path):
    """The disk fills before a resume has copied the previous rows into its new file: the CLI names the
    failed write (`ladle: error:`, exit 1), not a bare OSError traceback, and the previous files stay
    byte for byte. (A subprocess: the CLI's exit and message are what the user sees.)"""
    out = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    args = [f"hydra.run.dir={out}", "sampling.max_tokens=2", "output.plots=false", "output.print_summary=false",
            "output.progress=false", "output.row_group_size=1"]
    run = lambda *a: subprocess.run([sys.executable, *a], cwd=ROOT, env=env, capture_output=True, text=True,
                                    timeout=300, check=False)
    first = run("-m", "ladle", *args, "workload.limit=6")
    assert first.returncode == 0, first.stderr[-3000:]
    before = {n: (out / n).read_bytes() for n in ("generations.parquet", "steps.parquet")}
    p = run("-c", FULL_DISK_SCRIPT, "100", *args, "workload.limit=12")  # the header fits, the copy does not
    assert p.returncode == 1, p.stderr[-3000:]
    assert "ladle: error: writing" in p.stderr and "generations.parquet failed" in p.stderr, p.stderr[-3000:]
    assert "No space left on device" in p.stderr and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert {n: (out / n).read_bytes() for n in before} == before
    assert not list(out.glob("*.tmp"))


def test_a_rename_that_fails_between_the_two_files_is_a_failed_write_the_next_run_completes(tmp_path, monkeypatch):
    """generations.parquet moved into place, then moving steps.parquet fails (an I/O error): the job raises
    the failed write naming the file (before, a bare OSError traceback), and the next run takes the
    complete steps .tmp left behind, so both files hold the same attempts again."""
    src, out = source(tmp_path, 12), tmp_path / "out"
    cfg = lambda limit: compose_cfg("workload=parquet", f"workload.path={src}", f"workload.limit={limit}")
    run_job(cfg(6), out, engine=FakeEngine(max_num_seqs=3))
    real = os.replace

    def replace(a, b):
        if Path(a).name == "steps.parquet.tmp":
            raise OSError(errno.EIO, "Input/output error")
        real(a, b)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(OutputError, match="steps.parquet.*Input/output error.*same command"):
        run_job(cfg(12), out, engine=FakeEngine(max_num_seqs=3))
    monkeypatch.undo()
    run_job(cfg(12), out, engine=FakeEngine(max_num_seqs=3))
    gen, steps = pq.read_table(out / "generations.parquet"), pq.read_table(out / "steps.parquet")
    assert gen.num_rows == 12 and set(gen.column("attempt").to_pylist()) == {0, 1}
    assert set(steps.column("attempt").to_pylist()) == {0, 1}  # the second run's steps were not lost


def test_a_full_disk_when_the_summary_is_written_is_a_failed_write(tmp_path, monkeypatch):
    """The Parquet files are in place, then summary.json does not fit: the job names the failed write
    (OutputError, `ladle: error:`) instead of a bare OSError traceback, and leaves no summary.json.tmp."""
    from pathlib import Path as P

    src, out = source(tmp_path, 4), tmp_path / "out"
    real = P.write_text

    def write_text(self, *a, **kw):
        if self.name == "summary.json.tmp":
            real(self, "{")  # what fitted
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, *a, **kw)

    monkeypatch.setattr(P, "write_text", write_text)
    with pytest.raises(OutputError, match="summary.json failed .*No space left on device.*complete"):
        run_job(compose_cfg("workload=parquet", f"workload.path={src}"), out, engine=FakeEngine(max_num_seqs=3))
    assert pq.read_table(out / "generations.parquet").num_rows == 4 and not (out / "summary.json.tmp").exists()
