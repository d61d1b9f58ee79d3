"""The step log: turns each handled event into a ``StepRecord`` row and each ended sandbox life into a
``UsageRecord`` row, and hands them to the ``Recorder``.

The service opens a ``StepContext`` per event (a context variable, so the durable layer reached
through the handler sees it). Which row is written when:

    durable create/exec/destroy/snapshot   the row is spooled just before the step's state is committed
                                           (``before_commit``), the commit settles it; spooling and the
                                           store write run side by side, the reply waits for both
    a reply the durable layer found in     no row: the step was recorded when it ran
    the store (a redelivered event)
    anything else answered (run, fork,     the row is spooled after the handler, before the reply
    durability off, final errors)
    retryable errors (409, 429, 503, ...)  no row: nothing happened, the retry is the step
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import time
from collections import OrderedDict
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel
from rollbox.functions.contract.models import (
    SANDBOX_CREATE,
    SANDBOX_DESTROY,
    SANDBOX_EXEC,
    SANDBOX_RUN,
    SANDBOX_SNAPSHOT,
    AnnotateData,
    ErrorData,
    ForkRecord,
    RunData,
    SnapshotRecord,
)
from rollbox.functions.contract.records import DEFAULT_EXPERIMENT, to_json
from rollbox.functions.recording.recorder import Recorder, Token, usage_row
from rollbox.runtime.spec import ExecRequest, ExecResult, Limits, SandboxInfo, Usage
from rollbox.snapshots.state import SandboxRecord

__all__ = ["StepContext", "StepLog", "current_step"]

# events whose one durable commit carries their row (fork commits once per child: recorded after)
_COMMIT_ROWS = {SANDBOX_CREATE, SANDBOX_EXEC, SANDBOX_DESTROY, SANDBOX_SNAPSHOT}


@dataclass
class StepContext:
    event_type: str
    source: str
    event_id: str
    event_time: float
    data: BaseModel
    t0: float = field(default_factory=time.perf_counter)
    queued_ms: float = 0.0
    replayed: bool = False  # the durable layer answered with the recorded reply
    token: Token | None = None  # the row spooled before a durable commit
    result: BaseModel | None = None  # the handler's reply data
    spooled: asyncio.Future[None] | None = None
    held: list[tuple[str, dict[str, Any]]] = field(default_factory=list)  # rows spooled with the step's own
    open: bool = True  # until the event is answered (a task it started may outlive it, with this context)


current_step: ContextVar[StepContext | None] = ContextVar("rollbox_current_step", default=None)


def event_time(value: Any) -> float:
    """A CloudEvent ``time`` (RFC 3339) as unix seconds; now if absent or unreadable."""
    if isinstance(value, str) and value:
        with contextlib.suppress(ValueError):
            return dt.datetime.fromisoformat(value.upper().replace("Z", "+00:00")).timestamp()
    return time.time()


class StepLog:
    def __init__(self, recorder: Recorder, *, env_version: Callable[[str], dict[str, Any] | None] | None = None,
                 labels: Callable[[str], dict[str, str] | None] | None = None):
        self.recorder = recorder
        self.replica = recorder.replica
        self._env_version = env_version
        self._labels_of = labels
        self._meta: OrderedDict[str, tuple[dict[str, str], str | None, str | None]] = OrderedDict()
        self._versions: dict[str, str] = {}

    # --------------------------------------------------------------------------- the service
    def begin(self, event_type: str, source: str, event_id: str, time_attr: Any, data: BaseModel) -> StepContext:
        ctx = StepContext(event_type, source, event_id, event_time(time_attr), data)
        current_step.set(ctx)
        return ctx

    async def finish(self, ctx: StepContext, status: int, reply: BaseModel | None) -> None:
        """After the handler, before the reply: the event's row is on disk when this returns (or the
        event needs none: a recorded reply from the store)."""
        if ctx.replayed:
            return
        if ctx.token is not None and ctx.spooled is not None and status == 200:
            await ctx.spooled  # spooled before its commit, which succeeded
            return
        # (a failed commit settled its row as dropped; the error, if final, is a row of its own)
        rows, ctx.held = [*ctx.held, ("step", self.row(ctx, status, reply, None))], []
        ctx.open = False
        _, fut = self.recorder.append(rows)
        await fut

    def end(self, ctx: StepContext) -> None:
        """The event is answered: rows it held that no step row took with it (a run answered with a
        retryable error still used its sandbox) are spooled now, with the next fsync."""
        ctx.open = False
        if ctx.held:
            rows, ctx.held = ctx.held, []
            self.recorder.append(rows, now=False)

    # ----------------------------------------------------------------------- the durable layer
    async def before_commit(self, record: SandboxRecord, reply: BaseModel | None, mine: bool) -> Token | None:
        """Spool what the commit of ``record`` acknowledges: the step's row (``mine``: the commit of the
        current event), and the usage record of a sandbox that ends. Returns the token to settle."""
        rows: list[tuple[str, dict[str, Any]]] = []
        ctx = current_step.get()
        if mine and ctx is not None and ctx.event_type in _COMMIT_ROWS and ctx.token is None:
            rows.append(("step", self.row(ctx, 200, reply, record)))
        if record.state == "destroyed" and isinstance(reply, Usage):
            rows.append(("usage", self.usage_row(reply, record.limits, "sandbox", usage_id=record.sandbox_id)))
        if not rows:
            return None
        token, fut = self.recorder.append(rows, pending=(record.sandbox_id, record.generation))
        if mine and ctx is not None and rows[0][0] == "step":
            ctx.token, ctx.spooled = token, fut
        return token

    def settle(self, token: Token | None, committed: bool | None) -> None:
        self.recorder.settle(token, committed)

    def replayed(self) -> None:
        ctx = current_step.get()
        if ctx is not None:
            ctx.replayed = True

    def queued(self, seconds: float) -> None:
        ctx = current_step.get()
        if ctx is not None:
            ctx.queued_ms += seconds * 1000

    # ------------------------------------------------------------------------------ the runtime
    def life_ended(self, usage: Usage, limits: Limits, kind: str) -> None:
        """A sandbox life that no durable state outlives (a one-shot run; any with durability off)."""
        row = self.usage_row(usage, limits, kind, usage_id=f"{usage.sandbox_id}/{time.time_ns()}")
        ctx = current_step.get()
        if ctx is not None and ctx.open and ctx.token is None:
            ctx.held.append(("usage", row))  # spooled with the event's own row (StepLog.finish, or end)
        else:
            self.recorder.append([("usage", row)], now=False)  # shares the next fsync

    def usage_row(self, usage: Usage, limits: Limits, kind: str, *, usage_id: str) -> dict[str, Any]:
        return usage_row(usage, limits, kind=kind, replica=self.replica, prices=self.recorder.prices,
                         usage_id=usage_id)

    # ----------------------------------------------------------------------------------- rows
    def _sandbox_meta(self, sid: str | None) -> tuple[dict[str, str], str | None, str | None]:
        if sid is None:
            return {}, None, None
        hit = self._meta.get(sid)
        if hit is not None:
            self._meta.move_to_end(sid)
            return hit
        meta = self._labels_of(sid) if self._labels_of is not None else None
        return (meta or {}), None, None

    def _keep_meta(self, sid: str, meta: dict[str, str], snapshot: str | None, forked_from: str | None) -> None:
        self._meta[sid] = (meta, snapshot, forked_from)
        self._meta.move_to_end(sid)
        while len(self._meta) > 65536:
            self._meta.popitem(last=False)

    def row(self, ctx: StepContext, status: int, reply: BaseModel | None,
            record: SandboxRecord | None) -> dict[str, Any]:
        data = ctx.data
        fields = data.__dict__  # a pydantic model's fields (getattr of a missing one raises inside pydantic: slow)
        sid: str | None = fields.get("sandbox_id") or (reply.__dict__.get("sandbox_id") if reply is not None else None)
        meta: dict[str, str]
        snapshot: str | None
        forked_from: str | None
        if record is not None:
            meta, snapshot, forked_from = dict(record.metadata), record.snapshot, record.forked_from
        else:
            meta, snapshot, forked_from = self._sandbox_meta(sid)
        given = fields.get("metadata")
        if isinstance(given, dict) and given:
            meta = dict(given)
        if isinstance(reply, SandboxInfo):
            meta, snapshot, forked_from = dict(reply.metadata), reply.snapshot_id, reply.forked_from
        now = time.time()
        row: dict[str, Any] = {
            "experiment": meta.get("experiment") or DEFAULT_EXPERIMENT, "episode": meta.get("episode"),
            "task": meta.get("task"), "sandbox_id": sid,
            "step": record.generation if record is not None else None,
            "event_source": ctx.source, "event_id": ctx.event_id, "event_type": ctx.event_type,
            "event_time": ctx.event_time, "recorded_at": now, "status": status, "replica": self.replica,
            "snapshot_id": snapshot, "forked_from": forked_from,
            "queued_ms": round(ctx.queued_ms, 3),
            "total_ms": round((time.perf_counter() - ctx.t0) * 1000, 3),
        }
        if isinstance(data, ExecRequest):
            row.update(code=data.code, command=data.command, stdin=data.stdin, timeout_s=data.timeout_s,
                       files_in=[{"path": p, "bytes": len(c.encode())} for p, c in data.files.items()],
                       files_in_text=to_json(data.files) if data.files else None,
                       env=to_json(data.env) if data.env else None, read_files=list(data.read_files))
        if isinstance(data, RunData) and data.limits is not None:
            row["limits"] = to_json(data.limits.model_dump(exclude_unset=True))
        outcome = fields.get("outcome")
        if outcome is not None:
            row.update(reward=outcome.reward, labels=to_json(outcome.labels) if outcome.labels else None)
        if isinstance(data, AnnotateData):
            row.update(experiment=data.experiment or DEFAULT_EXPERIMENT, episode=data.episode, reward=data.reward,
                       labels=to_json(data.labels) if data.labels else None)
        if isinstance(reply, ErrorData):
            row.update(error_code=reply.code, error=reply.message[:2000])
        elif isinstance(reply, ExecResult):
            row.update(
                exit_code=reply.exit_code, stdout=reply.stdout, stderr=reply.stderr,
                stdout_truncated=reply.stdout_truncated, stderr_truncated=reply.stderr_truncated,
                timed_out=reply.timed_out, oom_killed=reply.oom_killed,
                files_out=[{"path": p, "bytes": None if t is None else len(t.encode())}
                           for p, t in reply.files.items()],
                files_out_text=to_json(reply.files) if reply.files else None,
                snapshot_id=reply.snapshot_id or snapshot, forked_from=reply.forked_from or forked_from,
                create_ms=reply.create_ms, resume_ms=reply.resume_ms, resumed=reply.resumed,
                exec_ms=round(reply.wall_s * 1000, 3), wall_s=reply.wall_s, cpu_s=reply.cpu_s,
                peak_memory_bytes=reply.peak_memory_bytes)
        elif isinstance(reply, SandboxInfo):
            row.update(create_ms=reply.create_ms, env_version=to_json(reply.env_version),
                       limits=to_json(reply.limits.model_dump()))
        elif isinstance(reply, Usage):
            row.update(wall_s=reply.wall_s, cpu_s=reply.cpu_s, peak_memory_bytes=reply.peak_memory_bytes)
        elif isinstance(reply, SnapshotRecord):
            row.update(labels=row.get("labels") or to_json({"new_snapshot_id": reply.snapshot_id}))
        elif isinstance(reply, ForkRecord):
            row.update(labels=to_json({"children": [i.sandbox_id for i in reply.sandboxes]}),
                       snapshot_id=reply.snapshot_id)
            for info in reply.sandboxes:
                self._keep_meta(info.sandbox_id, dict(info.metadata), info.snapshot_id, info.forked_from)
        if row.get("env_version") is None and row.get("snapshot_id"):
            row["env_version"] = self._version_json(row["snapshot_id"])
        if sid is not None and status == 200 and (meta or snapshot) and ctx.event_type != SANDBOX_RUN:
            # (a one-shot run's sandbox is gone: nothing later asks for its labels)
            self._keep_meta(sid, meta, row.get("snapshot_id"), row.get("forked_from"))
        return row  # StepRecord's fields; those left out take the model's defaults (the flush fills them in)

    def _version_json(self, snapshot_id: str) -> str | None:
        """The snapshot's VERSION block as JSON (snapshots are immutable: kept once made)."""
        hit = self._versions.get(snapshot_id)
        if hit is None and self._env_version is not None:
            hit = to_json(self._env_version(snapshot_id) or None)
            if hit is not None:
                self._versions[snapshot_id] = hit
                if len(self._versions) > 4096:
                    self._versions.pop(next(iter(self._versions)))
        return hit

