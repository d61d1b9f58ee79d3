"""What rollbox records: one step record per handled event, one usage record per sandbox life.

Both are pydantic models (the documented, versioned schema; ``python -m rollbox.functions.contract.schemas``
publishes them as JSON Schema beside the event schemas); ``tables.py`` has them as Arrow schemas (the
Parquet files)::

    trajectories/experiment=<e>/date=<yyyy-mm-dd>/<spool segment>.parquet   StepRecord rows
    usage/experiment=<e>/date=<yyyy-mm-dd>/<spool segment>.parquet          UsageRecord rows

``experiment`` and ``date`` are hive partition keys: they are in the path, not in the files (pandas,
pyarrow datasets and duckdb's ``hive_partitioning`` add them back as columns). A sandbox without an
``experiment`` label is filed under ``experiment=default``. ``schema_version`` changes when a column
changes meaning or goes away; new columns may be added within a version.
"""

from __future__ import annotations

import datetime as dt
import json
from typing import Any, Final

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "DEFAULT_EXPERIMENT",
    "SCHEMA_VERSION",
    "USAGE_TYPE",
    "FileRef",
    "StepRecord",
    "UsageRecord",
    "usage_event",
]

SCHEMA_VERSION: Final = 1
DEFAULT_EXPERIMENT: Final = "default"
USAGE_TYPE: Final = "dev.rollbox.usage"  # the CloudEvent type of a usage record (OpenMeter ingests these)
TIMESTAMPS: Final = frozenset({"event_time", "recorded_at", "ended_at"})  # unix seconds in rows, UTC in files


class FileRef(BaseModel):
    model_config = ConfigDict(frozen=True)

    path: str
    bytes: int | None = Field(description="its size; None: it was asked for and did not exist")


class StepRecord(BaseModel):
    """One handled event of a sandbox (create, exec, run, snapshot, fork, destroy, annotate): what was
    asked, what came back, on what, how long it took and what it used."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    schema_version: int = SCHEMA_VERSION
    # who
    experiment: str = Field(description="partition key (in the path): the sandbox's `experiment` label")
    episode: str | None = Field(default=None, description="the sandbox's `episode` label")
    task: str | None = Field(default=None, description="the sandbox's `task` label")
    sandbox_id: str | None = None
    step: int | None = Field(default=None, description="the sandbox's generation after this step (0: create)")
    # the event
    event_source: str
    event_id: str
    event_type: str
    event_time: float = Field(description="unix seconds: the event's `time`, else when it arrived")
    recorded_at: float = Field(description="unix seconds: when the reply was made")
    # the action
    code: str | None = None
    command: str | None = None
    stdin: str | None = None
    files_in: list[FileRef] = Field(default_factory=list)
    files_in_text: str | None = Field(default=None, description="JSON of the files written before, path -> text")
    read_files: list[str] = Field(default_factory=list)
    env: str | None = Field(default=None, description="JSON of the environment variables the step set")
    timeout_s: float | None = None
    limits: str | None = Field(default=None, description="create, run: JSON of the sandbox's limits")
    # the observation
    status: int = Field(description="HTTP status of the reply (200, or the error's)")
    error_code: str | None = None
    error: str | None = Field(default=None, description="the error reply's message")
    exit_code: int | None = None
    stdout: str | None = Field(default=None, description="as kept (capped at the sandbox's output limit)")
    stderr: str | None = None
    stdout_truncated: bool | None = None
    stderr_truncated: bool | None = None
    timed_out: bool | None = None
    oom_killed: bool | None = None
    files_out: list[FileRef] = Field(default_factory=list)
    files_out_text: str | None = Field(default=None, description="JSON of the files read back, path -> text")
    # on what
    snapshot_id: str | None = None
    env_version: str | None = Field(default=None, description="JSON of the snapshot's VERSION block")
    forked_from: str | None = None
    replica: str
    # timings (ms) and resources
    queued_ms: float | None = Field(default=None, description="waiting for this sandbox's previous step")
    create_ms: float | None = None
    resume_ms: float | None = None
    exec_ms: float | None = None
    total_ms: float
    resumed: bool | None = None
    wall_s: float | None = None
    cpu_s: float | None = None
    peak_memory_bytes: int | None = None
    # an outcome a trainer attached (destroy's `outcome`, or dev.rollbox.episode.annotate)
    reward: float | None = None
    labels: str | None = Field(default=None, description="JSON object of string labels")


class UsageRecord(BaseModel):
    """One sandbox life, metered to the second (hibernated time excluded). As a CloudEvent it is
    ``type`` dev.rollbox.usage, ``subject`` the sandbox id, ``id`` = ``usage_id`` and this as data."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    schema_version: int = SCHEMA_VERSION
    usage_id: str = Field(description="stable per sandbox life: a retried destroy does not bill twice")
    experiment: str
    episode: str | None = None
    task: str | None = None
    sandbox_id: str
    snapshot_id: str
    kind: str = Field(description="sandbox (create ... destroy) or run (one-shot)")
    reason: str = Field(description="destroyed | lifetime | idle | died | shutdown | run")
    ended_at: float = Field(description="unix seconds")
    wall_s: float = Field(description="live seconds (hibernated time excluded)")
    billed_s: int = Field(description="wall_s rounded up to the second (at least 1; 0 for a durable sandbox "
                                      "destroyed or expired before anything ran in it)")
    cpu_max_cores: float
    memory_max_bytes: int
    vcpu_s: float = Field(description="billed_s x cpu_max_cores")
    gib_s: float = Field(description="billed_s x memory_max_bytes / GiB")
    cost_usd: float = Field(description="vcpu_s x price per vCPU-s + gib_s x price per GiB-s")
    cpu_s: float = Field(description="CPU seconds actually used")
    peak_memory_bytes: int
    execs: int
    replica: str


def usage_event(row: dict[str, Any]) -> dict[str, Any]:
    """A usage record as a structured CloudEvent (JSON): ``type`` dev.rollbox.usage, ``subject`` the
    sandbox id, ``id`` the usage id (a retried ingestion does not bill twice), ``time`` its end; the
    record as ``data``. What OpenMeter's CloudEvents ingestion takes, one event per sandbox life."""
    def iso(v: Any) -> Any:
        if isinstance(v, int | float) and not isinstance(v, bool):
            return dt.datetime.fromtimestamp(v, dt.UTC).isoformat()
        return v.isoformat() if hasattr(v, "isoformat") else v

    data = {k: (iso(v) if k in TIMESTAMPS else v) for k, v in row.items() if k != "date"}
    return {"specversion": "1.0", "type": USAGE_TYPE, "source": f"/rollbox/{row.get('replica') or 'rollbox'}",
            "id": row["usage_id"], "subject": row["sandbox_id"], "time": iso(row["ended_at"]),
            "datacontenttype": "application/json", "data": data}


def to_json(value: Any) -> str | None:
    return None if value is None else json.dumps(value, sort_keys=True, separators=(",", ":"))
