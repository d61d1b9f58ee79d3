"""A spool segment's lines as Parquet files: what a flush writes (``flush.py``).

pyarrow is loaded with this module: by the flush's warm-up a few seconds after a start, or by the first
flush, not by the start itself (~0.2 s of a replica's CPU, and its start is what a scale from zero waits for).
"""

from __future__ import annotations

import datetime as dt
import io
from collections.abc import Iterator
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from rollbox.functions.contract.records import DEFAULT_EXPERIMENT
from rollbox.functions.contract.tables import STEP_SCHEMA, USAGE_SCHEMA, arrow_scalar, arrow_table_of_lines
from rollbox.functions.recording.spool import KINDS, spool_line

__all__ = ["SCHEMAS", "Files", "files_of", "partitions", "warm_up"]

SCHEMAS = {"step": STEP_SCHEMA, "usage": USAGE_SCHEMA}  # the schema of each spool kind (spool.KINDS)
assert SCHEMAS.keys() == KINDS.keys()
_KIND_PREFIX = {kind: b'{"k":"%s"' % kind.encode() for kind in KINDS}
_UNREADABLE = (pa.ArrowException, ValueError, TypeError, OverflowError)


@dataclass
class Files:
    """What a segment's lines become: Parquet files (kind, experiment, date, bytes), and per kind the
    lines Arrow cannot read as its schema, as they are."""

    parts: list[tuple[str, str, str, bytes]] = field(default_factory=list)
    rejected: dict[str, list[bytes]] = field(default_factory=dict)


def files_of(lines: list[bytes]) -> Files:
    """``lines`` (spool lines of any kind) as one Parquet file per (kind, experiment, date)."""
    out = Files()
    for kind, schema in SCHEMAS.items():
        mine = [line for line in lines if line.startswith(_KIND_PREFIX[kind])]
        if not mine:
            continue
        try:
            table = arrow_table_of_lines(b"".join(mine), schema)
        except _UNREADABLE:
            mine, out.rejected[kind] = _sort_lines(mine, schema)
            if not mine:
                continue
            table = arrow_table_of_lines(b"".join(mine), schema)
        out.parts.extend((kind, experiment, date, data) for (experiment, date), data in partitions(table, schema))
    return out


def _sort_lines(lines: list[bytes], schema: pa.Schema) -> tuple[list[bytes], list[bytes]]:
    """(Lines Arrow reads as ``schema``, lines it does not), each tried alone."""
    good: list[bytes] = []
    bad: list[bytes] = []
    for line in lines:
        line = line if line.endswith(b"\n") else line + b"\n"
        try:
            arrow_table_of_lines(line, schema)
        except _UNREADABLE:
            bad.append(line)
        else:
            good.append(line)
    return good, bad


def partitions(table: pa.Table, schema: pa.Schema) -> Iterator[tuple[tuple[str, str], bytes]]:
    """``table`` (rows of ``schema`` plus their experiment) as Parquet files, one per (experiment, date)."""
    when = "recorded_at" if "recorded_at" in schema.names else "ended_at"
    string = pa.string()  # (Arrow scalars, not Python values: see arrow_scalar)
    dates = pc.strftime(table[when], format="%Y-%m-%d").fill_null(
        arrow_scalar(dt.datetime.now(dt.UTC).strftime("%Y-%m-%d"), string))
    experiments = table["experiment"].fill_null(arrow_scalar(DEFAULT_EXPERIMENT, string))
    table = table.select(schema.names)
    # (one key column and its distinct values, not Table.group_by: that loads pyarrow.dataset, and pandas)
    keys = pc.binary_join_element_wise(dates, experiments, arrow_scalar("/", string))
    for key in pc.unique(keys).to_pylist():
        date, experiment = key.split("/", 1)  # (a date has no "/")
        buf = io.BytesIO()
        pq.write_table(table.filter(pc.equal(keys, arrow_scalar(key, string))), buf, compression="zstd")
        yield (experiment, date), buf.getvalue()


def warm_up() -> None:
    """Write each kind's table once, in memory, as a flush does: pyarrow loads its compute kernels and
    Parquet writer lazily, which would otherwise land on the first flush under load."""
    files_of([spool_line(kind, {}) for kind in KINDS])
