"""A Parquet dataset as the tools that wrote it mean it: which files are data, one schema, partitions.

- Data files: under a directory, files with a Parquet suffix or Parquet's magic bytes, outside hidden
  and `_` names (Spark's `_SUCCESS`, `.crc` checksums, `_metadata`); anything else (`stats.json`) is
  skipped with one log line naming it, as Spark, Ray Data and HF datasets read such directories.
- One schema: the parts' schemas unified with permissive promotion (an all-null column in one part
  takes the type the others give it, int32 + int64 -> int64, int + float -> float), so no part is cast
  to another part's null type mid-job; a dictionary (pandas categorical) column reads as its values. Types that cannot be unified (string in one part, int64 in
  another) are a ConfigError naming both files and types, before the model loads.
- A table format's directory (Delta Lake's `_delta_log/`, Hudi's `.hoodie/`, Iceberg's `metadata/`) is refused:
  its files include rows the table removed, which only its log tells apart.
- Parts with no rows are left out (their schema, even one without the prompt column, does not count).
- Hive partitions: `key=value` directories (pandas `partition_cols`, Spark, Ray Data) are columns.
"""

from __future__ import annotations

import logging
from typing import Any

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from ladle.runner.config import ConfigError
from ladle.runner.redact import redact
from ladle.runner.storage import Location

log = logging.getLogger("ladle")

PARQUET_SUFFIXES = (".parquet", ".parq", ".pq")
MAGIC = b"PAR1"


def is_parquet(f: Location) -> bool:
    if f.name.lower().endswith(PARQUET_SUFFIXES):
        return True
    try:
        with f.fs.open_input_stream(f.path) as fh:
            return fh.read(4) == MAGIC
    except OSError:
        return False


def data_files(p: Location) -> tuple[list[Location], list[Location]]:
    """(the Parquet data files under `p`, sorted; the other files, skipped); `p` itself when a file."""
    if p.is_file():
        return [p], []
    base = p.path.rstrip("/") + "/"
    data, skipped = [], []
    for info in sorted(p.fs.get_file_info(pafs.FileSelector(p.path, recursive=True)), key=lambda i: i.path):
        if info.type != pafs.FileType.File:
            continue
        rel = info.path[len(base):] if info.path.startswith(base) else info.base_name
        f = p.child(rel)
        hidden = any(part.startswith((".", "_")) for part in rel.split("/"))
        (skipped if hidden or not is_parquet(f) else data).append(f)
    return data, skipped


def unified_schema(files: list[Location]) -> pa.Schema:
    """The parts' schemas unified with permissive promotion, or a ConfigError naming the conflict."""
    schemas = [_decoded(pq.read_schema(f.path, filesystem=f.fs)) for f in files]
    try:
        return pa.unify_schemas(schemas, promote_options="permissive")
    except (pa.ArrowTypeError, pa.ArrowInvalid):
        raise ConfigError(_conflict(files, schemas)) from None


def _decoded(schema: pa.Schema) -> pa.Schema:
    """Dictionary columns as their values' type: a pandas categorical in one part and plain strings in
    another are one string column (the values read the same either way)."""
    return pa.schema([f.with_type(f.type.value_type) if pa.types.is_dictionary(f.type) else f for f in schema],
                     metadata=schema.metadata)


def _conflict(files: list[Location], schemas: list[pa.Schema]) -> str:
    """Which column has types that cannot be unified, in which two files."""
    first: dict[str, tuple[Location, pa.Schema]] = {}  # column -> (a file, its one-column schema so far)
    for f, schema in zip(files, schemas, strict=True):
        for field in schema:
            one = pa.schema([field])
            if field.name not in first:
                first[field.name] = (f, one)
                continue
            where, seen = first[field.name]
            try:
                first[field.name] = (where, pa.unify_schemas([seen, one], promote_options="permissive"))
            except (pa.ArrowTypeError, pa.ArrowInvalid):
                return (f"the Parquet parts disagree on column {field.name!r}: it is {seen.field(0).type} in {where} "
                        f"and {field.type} in {f}, which cannot be read as one type; rewrite the parts with one type "
                        "for it, or point workload.path at parts that agree")
    return "the Parquet parts' schemas cannot be unified"  # pragma: no cover - unify_schemas failed on no column


# A table format's log beside its Parquet files: the files hold rows the table has since deleted or replaced.
TABLE_LOGS = {"_delta_log": "a Delta Lake table", ".hoodie": "an Apache Hudi table",
              "metadata": "an Apache Iceberg table", "_spark_metadata": "a Spark streaming sink's output"}


def _table_format(p: Location) -> str | None:
    """The table format whose log `p` holds (its Parquet files alone are not the table), if any."""
    for log_dir, name in TABLE_LOGS.items():
        d = p.child(log_dir)
        if d.is_dir() and (log_dir != "metadata" or any(
                i.base_name.endswith(".metadata.json") for i in p.fs.get_file_info(pafs.FileSelector(d.path)))):
            return f"{name} (it has {log_dir}/)"
    return None


def open_dataset(p: Location, path_text: str) -> ds.Dataset:
    """The dataset of `p`'s data files with one unified schema and hive partition keys as columns."""
    if p.is_dir() and (table := _table_format(p)) is not None:
        raise ConfigError(f"workload.path={redact(path_text)!r} is {table}: its Parquet files also hold rows the table "
                          "has deleted or replaced (or a failed batch wrote), which only its log tells apart; write "
                          "the table out as plain Parquet (e.g. Spark's df.write.parquet(...)) and point "
                          "workload.path there")
    files, skipped = data_files(p)
    base = p.path.rstrip("/") + "/"
    if skipped:
        log.info("workload.path=%s: skipped %d files that are not Parquet data: %s", redact(path_text), len(skipped),
                 ", ".join(f.path[len(base):] for f in skipped[:10]) + (" ..." if len(skipped) > 10 else ""))
    if not files:
        raise ConfigError(f"workload.path={redact(path_text)!r} has no Parquet data files"
                          + (f" (skipped: {', '.join(f.name for f in skipped[:5])})" if skipped else ""))
    try:
        files = _without_empty(files, p, path_text)
        schema = unified_schema(files)
        names = [f.path for f in files]
        if p.is_file():
            return ds.dataset(names, schema=schema, format="parquet", filesystem=p.fs)
        partitioning, keys = _hive_keys(names, p, path_text)
        schema = _with_partitions(schema, keys, path_text)
        return ds.dataset(names, schema=schema, format="parquet", partitioning=partitioning,
                          partition_base_dir=p.path, filesystem=p.fs)
    except (pa.ArrowInvalid, OSError) as e:
        raise ConfigError(f"workload.path={redact(path_text)!r} is not readable as Parquet: {redact(str(e))}") from None


def _without_empty(files: list[Location], base: Location, path_text: str) -> list[Location]:
    """The parts that hold rows (all of them when none does). A part with no rows (Spark's and Ray Data's
    empty partitions, a pandas frame with no columns) adds nothing, so its schema must not stop the job."""
    empty = [f for f in files if pq.read_metadata(f.path, filesystem=f.fs).num_rows == 0]
    if not empty or len(empty) == len(files):
        return files
    prefix = base.path.rstrip("/") + "/"
    log.info("workload.path=%s: skipped %d Parquet parts with no rows: %s", redact(path_text), len(empty),
             ", ".join(f.path[len(prefix):] for f in empty[:10]) + (" ..." if len(empty) > 10 else ""))
    return [f for f in files if f not in empty]


def _hive_keys(names: list[str], base: Location, path_text: str) -> tuple[ds.Partitioning | None, pa.Schema]:
    """The hive partitioning of the files under `base`, and the schema of the keys their directories name
    (pyarrow types them: `year=2024` is an integer). No key directory: (None, an empty schema)."""
    try:
        found = ds.dataset(names, format="parquet", partitioning=ds.HivePartitioning.discover(infer_dictionary=False),
                           partition_base_dir=base.path, filesystem=base.fs)
    except pa.ArrowTypeError as e:  # a key is also a column of the first file, with another type
        raise _key_conflict(path_text, e) from None
    named = {k for frag in found.get_fragments() for k in partition_values(frag)}
    if not named or found.partitioning is None:
        return None, pa.schema([])
    # partitioning.schema is the keys' schema; only keys some directory names are taken from it.
    return found.partitioning, pa.schema([f for f in found.partitioning.schema if f.name in named])


def _with_partitions(schema: pa.Schema, keys: pa.Schema, path_text: str) -> pa.Schema:
    """The files' schema plus the partition keys (a key the files also hold must unify with it)."""
    try:
        return pa.unify_schemas([schema, keys], promote_options="permissive")
    except (pa.ArrowTypeError, pa.ArrowInvalid) as e:
        raise _key_conflict(path_text, e) from None


def _key_conflict(path_text: str, e: Exception) -> ConfigError:
    return ConfigError(f"workload.path={path_text!r}: a partition directory's key is also a column of the files, "
                       f"with another type ({e}); rename the column or the directories")


def partition_values(fragment: Any) -> dict[str, Any]:
    """The hive partition keys of one file of the dataset (empty for an unpartitioned one)."""
    return ds.get_partition_keys(fragment.partition_expression) or {}
