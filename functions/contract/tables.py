"""The records (``records.py``) as Arrow: the Parquet files' schemas, and spool lines read as tables.

pyarrow is loaded with this module, where tables are made or read (a flush, the analysis), not at a
replica's start: ~0.2 s of its CPU. Python values meet pyarrow only as Arrow scalars read by its JSON
reader (``arrow_scalar``): ``pa.scalar`` would look for pandas first and import it when installed.
"""

from __future__ import annotations

import functools
import io
import json
from typing import Any, Final

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pajson
from pydantic import BaseModel
from rollbox.functions.contract.records import SCHEMA_VERSION, TIMESTAMPS, StepRecord, UsageRecord

__all__ = ["STEP_SCHEMA", "USAGE_SCHEMA", "arrow_scalar", "arrow_table_of_lines"]


def _arrow_type(annotation: Any) -> pa.DataType:
    text = str(annotation)
    if "FileRef" in text:
        return pa.list_(pa.struct([("path", pa.string()), ("bytes", pa.int64())]))
    if text.startswith("list["):
        return pa.list_(pa.string())
    if "bool" in text:
        return pa.bool_()
    if "float" in text:
        return pa.float64()
    if "int" in text:
        return pa.int64()
    return pa.string()


_TS = pa.timestamp("us", tz="UTC")


def _schema(model: type[BaseModel]) -> pa.Schema:
    # experiment is the partition key: in the path, not in the file
    fields = [pa.field(name, _TS if name in TIMESTAMPS else _arrow_type(f.annotation), nullable=True)
              for name, f in model.model_fields.items() if name != "experiment"]
    return pa.schema(fields, metadata={"rollbox_schema_version": str(SCHEMA_VERSION),
                                       "rollbox_model": model.__name__})


STEP_SCHEMA: Final = _schema(StepRecord)
USAGE_SCHEMA: Final = _schema(UsageRecord)


def _defaults(model: type[BaseModel]) -> dict[str, Any]:
    """The model's non-null defaults: what a row that leaves the field out means."""
    out = {}
    for name, f in model.model_fields.items():
        if not f.is_required():
            value = f.get_default(call_default_factory=True)
            if value is not None:
                out[name] = value
    return out


_DEFAULTS: Final = {STEP_SCHEMA: _defaults(StepRecord), USAGE_SCHEMA: _defaults(UsageRecord)}


def arrow_scalar(value: Any, of: pa.DataType) -> pa.Scalar:
    """``value`` as an Arrow scalar of type ``of``, read by Arrow's JSON reader. ``pa.scalar`` (and a
    compute function given a Python value) looks for pandas first and imports it when installed:
    ~0.18 s of CPU and ~40 MiB of a replica, for nothing (no DataFrame is made here)."""
    return _arrow_values({"x": value}, [pa.field("x", of)])["x"]


def _arrow_values(values: dict[str, Any], fields: list[pa.Field]) -> dict[str, pa.Scalar]:
    schema = pa.schema([pa.field("v", pa.struct(fields))])
    row = pajson.read_json(io.BytesIO(json.dumps({"v": values}).encode()),
                           parse_options=pajson.ParseOptions(explicit_schema=schema))
    return {name: row.column("v")[0][name] for name in values}


@functools.cache
def _fill_values(schema: pa.Schema) -> dict[str, pa.Scalar]:
    """``_DEFAULTS`` of ``schema`` as Arrow scalars of its fields' types (``arrow_scalar``)."""
    defaults = _DEFAULTS.get(schema, {})
    return _arrow_values(defaults, [schema.field(name) for name in defaults]) if defaults else {}


_MICROS_PER_S: Final = arrow_scalar(1e6, pa.float64())


def _float_fields(schema: pa.Schema) -> list[pa.Field]:
    return [pa.field(f.name, pa.float64()) if f.name in TIMESTAMPS else f for f in schema]


def _timestamps(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """Unix-seconds columns (float64) as ``schema``'s UTC timestamps, and its metadata."""
    for name in TIMESTAMPS & set(schema.names):
        i = table.schema.get_field_index(name)
        micros = pc.cast(pc.round(pc.multiply(table[name], _MICROS_PER_S)), pa.int64())
        table = table.set_column(i, schema.field(name), micros.cast(schema.field(name).type))
    return table.replace_schema_metadata(schema.metadata)


def arrow_table_of_lines(data: bytes, schema: pa.Schema, key: str = "r") -> pa.Table:
    """JSON lines each holding a row under ``key`` (the spool's format) as a table of ``schema`` plus
    an ``experiment`` column (the partition key), parsed by Arrow's JSON reader: no Python object per
    row. Other keys of a line are skipped; a field the row lacks is null."""
    fields = [*_float_fields(schema), pa.field("experiment", pa.string())]
    parsed = pajson.read_json(
        io.BytesIO(data),
        read_options=pajson.ReadOptions(use_threads=False, block_size=min(len(data) + 1, 2**31 - 1)),
        parse_options=pajson.ParseOptions(explicit_schema=pa.schema([pa.field(key, pa.struct(fields))]),
                                          unexpected_field_behavior="ignore"))
    rows = parsed.column(key).combine_chunks()
    table = pa.Table.from_struct_array(rows) if len(rows) else pa.schema(fields).empty_table()
    for name, value in _fill_values(schema).items():  # a field the row left out: the model's default
        column = table[name]
        if column.null_count:
            i = table.schema.get_field_index(name)
            table = table.set_column(i, table.field(i), column.fill_null(value))
    return _timestamps(table, schema)
