"""The driver's pass for executor=ray: which rows of each replica's share repeat an earlier id.

A replica reads its own share (`ladle.runner.sources.Shard`: Parquet replicas read only their row groups,
JSONL replicas parse only their lines, other sources are streamed and filtered), so a repeat of an id
in another replica's rows is found here, once, over the id column alone, and handed to the replicas.
"""

from __future__ import annotations

import dataclasses

from ladle.runner.config import WorkloadConfig
from ladle.runner.sources import open_source
from ladle.runner.sources.shard import Routing


def duplicate_indices(w: WorkloadConfig, routing: Routing) -> dict[int, set[int]]:
    """Per replica, the indices of its rows whose id appeared at a lower index (executor=local makes
    those error rows). Reads the id column alone; holds the set of ids, as executor=local does."""
    if not w.id_column or w.kind == "synthetic":  # synthetic ids are unique by construction
        return {}
    only_ids = dataclasses.replace(w, prompt_column=w.id_column, max_tokens_column=None, class_column=None,
                                   class_arrivals={}, arrivals=dataclasses.replace(w.arrivals, process="offline"))
    seen: set[str] = set()
    dups: dict[int, set[int]] = {}
    for batch in open_source(only_ids).batches():
        for r in batch:
            if r.id is None:  # a null id is its own row's error already, and no other row's duplicate
                continue
            if r.id in seen:
                dups.setdefault(routing.owner(r.index), set()).add(r.index)
            seen.add(r.id)
    return dups
