"""executor=ray's start over (runner/executors/start_over.py) stopped part-way through adopting the new
attempt: the next run finishes the adoption instead of losing both attempts' replicas."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ladle.runner.executors import start_over


def _files(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("had_previous", [True, False])
def test_an_adoption_killed_between_its_renames_is_finished_by_the_next_run(tmp_path, monkeypatch, had_previous):
    """Killed after the old replicas moved aside and before the new ones moved in: the resume's clean-up
    (drop_stale) must put the new attempt's replicas in place. Before, it deleted the staging directory,
    and the old replicas sat in .start_over.retired, read by nothing: both attempts' rows were gone."""
    if had_previous:
        (tmp_path / "replicas" / "r0").mkdir(parents=True)
        (tmp_path / "replicas" / "r0" / "generations.parquet").write_bytes(b"old rows")
    (start_over.begin(tmp_path) / "replicas" / "r0").mkdir(parents=True)
    (tmp_path / ".start_over" / "replicas" / "r0" / "generations.parquet").write_bytes(b"new rows")
    real, calls = os.replace, []

    def killed_at_the_second_rename(a, b):
        calls.append(a)
        if len(calls) == (2 if had_previous else 1):
            raise SystemExit("killed")  # the process ends here
        real(a, b)

    monkeypatch.setattr(os, "replace", killed_at_the_second_rename)
    with pytest.raises(SystemExit):
        start_over.adopt(tmp_path)
    monkeypatch.undo()
    start_over.drop_stale(tmp_path)  # what the next run (a resume) does first
    assert _files(tmp_path) == {"replicas/r0/generations.parquet": b"new rows"}


def test_starting_over_again_after_a_cut_adoption_keeps_the_adopted_replicas_until_it_writes(tmp_path, monkeypatch):
    """The run after the cut adoption starts over again (output.resume=false): its staging begins after the
    cut adoption is finished, so if this attempt writes nothing the adopted replicas are still the output."""
    (start_over.begin(tmp_path) / "replicas" / "r0").mkdir(parents=True)
    (tmp_path / ".start_over" / "replicas" / "r0" / "generations.parquet").write_bytes(b"new rows")
    real = os.replace
    monkeypatch.setattr(os, "replace", lambda a, b: (_ for _ in ()).throw(SystemExit("killed")))
    with pytest.raises(SystemExit):
        start_over.adopt(tmp_path)
    monkeypatch.setattr(os, "replace", real)
    start_over.begin(tmp_path)  # the next attempt, which then writes nothing
    start_over.drop_stale(tmp_path)
    assert _files(tmp_path) == {"replicas/r0/generations.parquet": b"new rows"}


def test_an_attempt_that_never_began_its_adoption_is_still_dropped(tmp_path):
    (tmp_path / "replicas" / "r0").mkdir(parents=True)
    (tmp_path / "replicas" / "r0" / "generations.parquet").write_bytes(b"old rows")
    (start_over.begin(tmp_path) / "replicas" / "r0").mkdir(parents=True)
    (tmp_path / ".start_over" / "replicas" / "r0" / "generations.parquet.tmp").write_bytes(b"cut off")
    start_over.drop_stale(tmp_path)
    assert _files(tmp_path) == {"replicas/r0/generations.parquet": b"old rows"}
