"""Input files in the shapes other tools write them: tab-separated text read by hf_dataset."""

from __future__ import annotations

import pytest

from ladle.runner.config import WorkloadConfig
from ladle.runner.sources import open_source


def rows_of(source) -> list[tuple]:
    return [(r.index, r.id, r.prompt, r.error) for b in source.batches() for r in b]


@pytest.mark.parametrize("builder", [None, "csv"])
def test_a_tsv_file_is_read_tab_separated(tmp_path, builder):
    """Before, the header became one column named `prompt\\tid` (the comma-separated default)."""
    path = tmp_path / "data.tsv"
    path.write_text("prompt\tid\nhello, world\t7\nbonjour\t8\n")
    w = WorkloadConfig(kind="hf_dataset", path=str(path), id_column="id", hf_builder=builder)
    assert rows_of(open_source(w)) == [(0, "7", "hello, world", None), (1, "8", "bonjour", None)]
