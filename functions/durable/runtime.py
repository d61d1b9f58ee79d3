"""Durable sandboxes: the store is the truth, a replica's live sandboxes are a cache of it.

``DurableRuntime`` stands between the service and the embedded ``Runtime``. Every step of a sandbox
(create, exec, snapshot, fork, destroy) ends with a commit of its new state — its files as a diff
over its snapshot, limits, metadata, usage so far, the events it acknowledged and this step's reply —
as generation n+1 in the store (``rollbox.snapshots.state``), with a create-only write; only then is
the reply sent. So:

    any replica serves any step   a sandbox not live here is resumed from its newest generation:
                                  a sandbox of its snapshot (from the warm pool) gets its files
                                  injected, as a fork child does; processes of earlier steps are gone
    stale copies are noticed      before a step on a live copy at generation n, generation n+1 must
                                  not exist (else the copy is dropped and the sandbox resumed)
    exactly once                  two replicas racing for generation n+1: one commits, the other keeps
                                  nothing and answers 409 sandbox_busy; a redelivered event finds its
                                  reply in the sandbox's records (ids of created sandboxes are derived
                                  from the event, so a redelivered create finds its sandbox too; a
                                  fork's children are new at each attempt, found through the parent)
    hibernate                     a live copy idle for ``hibernate_after_s``, or the least recently
                                  used idle one when the live cap is reached, is ended (nothing is
                                  written: its state is that of its last acknowledged step)
    pass through                  an exec that resumes a sandbox idle longer than a live copy lasts
                                  here runs as the resumed sandbox's init, which hibernates it when
                                  the step ends (the reply says ``hibernated``): at that pace a live
                                  copy would be hibernated before its next step anyway
    drain                         ``hibernate_all`` on SIGTERM: scale-down loses nothing
    expiry                        lifetime and idle limits hold across hibernation; a sweeper writes
                                  the tombstone of expired sandboxes and removes the records of
                                  destroyed ones after ``tombstone_ttl_s``

One-shot ``run`` events keep no durable state (nothing outlives them) and go straight through.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import math
import os
import secrets
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from prometheus_client import CollectorRegistry, Counter, Histogram
from pydantic import BaseModel, ValidationError
from rollbox.functions.handlers.routing import EventRef, current_event
from rollbox.functions.recording.aiosync import AsyncFsync
from rollbox.functions.service.idempotency import Conflict
from rollbox.runtime.errors import (
    IntegrityError,
    Overloaded,
    RollboxError,
    SandboxBusy,
    SandboxDied,
    SandboxGone,
    SandboxNotFound,
    ShuttingDown,
    StoreError,
)
from rollbox.runtime.runtime import LimitsArg, Runtime, effective_limits
from rollbox.runtime.spec import ExecRequest, ExecResult, SandboxInfo, Usage
from rollbox.snapshots.calls import StoreCalls, StoreDeadline
from rollbox.snapshots.state import (
    REFRESH_AFTER_S,
    SMALL_SCAN,
    FileHashes,
    Files,
    LocalObjects,
    Objects,
    SandboxRecord,
    StepUsage,
    UpperTooLarge,
    blob_key,
    check_content,
    diff_of,
    generation_of,
    place_contents,
    prefill_hashes,
    record_key,
    scan_upper,
)

if TYPE_CHECKING:
    from rollbox.functions.recording.steps import StepLog

__all__ = ["DurableRuntime"]

log = logging.getLogger("rollbox.durable")
# what a store call of this layer is doing, for the 503 a hung store gets
_DOING = {"_get": "reading a sandbox's state", "_get_blob": "reading a sandbox's files",
          "_put_blob": "writing a sandbox's files", "put_new": "committing a sandbox's step",
          "keys": "listing sandbox state", "delete": "deleting sandbox state"}
M = TypeVar("M", bound=BaseModel)
AIO_COMMITS = 32  # local commits syncing at once (the AIO context has room for 64 syncs in flight)
# how long an eviction under pressure tells how long idle live copies last here (``_passes``)
PRESSURE_MEMORY_S = 10.0
# at the live cap with every live sandbox running a step, a request that needs one waits this long for
# a step to end before it gets 429: steps end within moments, a retry after Retry-After takes a second
ROOM_WAIT_S = 5.0
_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


def _recorded(model: type[M], record: SandboxRecord) -> M:
    """The reply ``record`` holds, as this version's ``model``. Fields it does not know (a newer
    replica wrote the record: a rolling upgrade) are left out, at any depth, rather than refused; a
    reply that does not fit otherwise is corrupt state (502), not a crash."""
    data: Any = copy.deepcopy(record.reply)
    for _ in range(16):
        try:
            return model.model_validate(data)
        except ValidationError as exc:
            errors = exc.errors(include_url=False, include_input=False)
            if not errors or any(e["type"] != "extra_forbidden" for e in errors):
                raise IntegrityError(f"sandbox {record.sandbox_id}: the reply recorded in generation "
                                     f"{record.generation} is not a {model.__name__}: {str(exc)[:300]}",
                                     sandbox_id=record.sandbox_id) from None
            for e in errors:  # each names the path of a field this version does not have
                *path, name = e["loc"]
                parent = data
                for part in path:
                    parent = parent[part]
                parent.pop(name, None)
    raise IntegrityError(f"sandbox {record.sandbox_id}: the reply recorded in generation {record.generation} "
                         f"does not fit {model.__name__}", sandbox_id=record.sandbox_id)


class _Metrics:
    def __init__(self, registry: CollectorRegistry | None):
        r = registry or CollectorRegistry()
        self.resumes = Counter("rollbox_resumes", "Sandboxes resumed from their durable state", registry=r)
        self.hibernations = Counter("rollbox_hibernations",
                                    "Live sandboxes ended with their state in the store: idle, pressure (at the "
                                    "live cap), step (passed through), drain",
                                    ["reason"], registry=r)
        self.resume_seconds = Histogram("rollbox_resume_seconds", "Time to resume a sandbox from the store",
                                        buckets=_LATENCY, registry=r)
        self.store_write_seconds = Histogram("rollbox_state_write_seconds",
                                             "Time to commit a step's state to the store", buckets=_LATENCY,
                                             registry=r)
        self.conflicts = Counter("rollbox_state_conflicts",
                                 "Steps not committed because another replica committed that generation first",
                                 registry=r)
        self.stale = Counter("rollbox_stale_copies", "Live copies dropped because another replica moved on",
                             registry=r)


@dataclass
class _Live:
    """A sandbox this replica holds live, and its newest committed generation."""

    record: SandboxRecord
    hashes: FileHashes = field(default_factory=dict)
    since: float = field(default_factory=time.monotonic)  # usage accounted up to here
    cpu_s: float = 0.0  # CPU seconds of this life already in ``record.usage``
    last_used: float = field(default_factory=time.monotonic)
    resume_ms: float | None = None  # set by a resume, reported by the step that caused it
    passing: bool = False  # resumed for one exec that runs as its init: it hibernates when the step ends


class DurableRuntime:
    """The service's runtime when durability is on (``--durability step``): see the module docstring."""

    def __init__(self, rt: Runtime, objects: Objects, *, hibernate_after_s: float = 30.0,
                 sweep_interval_s: float = 60.0, tombstone_ttl_s: float = 600.0, replica: str | None = None,
                 io_threads: int = 8, registry: CollectorRegistry | None = None):
        self.rt = rt
        self.objects = objects
        self._local = isinstance(objects, LocalObjects)  # records are local files (see _read)
        self.hibernate_after_s = hibernate_after_s
        self.sweep_interval_s = sweep_interval_s
        self.tombstone_ttl_s = tombstone_ttl_s
        self.replica = replica or f"{socket.gethostname()}-{os.getpid()}"
        self.live: dict[str, _Live] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._busy: set[str] = set()
        self._adopted: dict[str, list[str]] = {}  # parent -> fork children committed in its running step
        self._calls = StoreCalls(io_threads, name="rollbox-state")  # store calls, each with a deadline
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="rollbox-scan")  # reading upper dirs
        self._blobs_known: dict[str, float] = {}  # blob -> when it was last written or refreshed here
        self._tasks: list[asyncio.Task[None]] = []
        self._seen: OrderedDict[str, SandboxRecord] = OrderedDict()
        # sandbox id -> (newest generation seen here, Unix time before which the sweep has nothing to do
        # with it: it cannot expire, or its tombstone is kept, until then). The sweep reads only the
        # records of sandboxes that passed that time or moved on, not every sandbox in the store.
        self._due: dict[str, tuple[int, float]] = {}
        self._blob_cache: OrderedDict[str, bytes] = OrderedDict()  # content-addressed, so never stale
        self._blob_cache_bytes = 0
        self._blob_lock = threading.Lock()
        self.blob_cache_max_bytes = 64 * 1024 * 1024
        self.metrics = _Metrics(registry)
        self.journal: StepLog | None = None  # trajectories and the usage ledger, when recording is on
        self._evicted: tuple[float, float] | None = None  # the last eviction under pressure (_make_room)
        self._passing_share = 0.0  # of recent steps, those that passed through (a moving average): _defers_create
        self._room: asyncio.Future[None] | None = None  # done when a step ends: _make_room waits on it
        self._aio: AsyncFsync | None = None  # the local store's commits sync through it (_put_record)
        # each commit has one sync in flight at a time; the AIO context holds MAX_EVENTS: the rest wait here
        self._aio_slots = asyncio.Semaphore(AIO_COMMITS)
        rt.on_reaped = self._reaped

    # ------------------------------------------------------------------------------ lifecycle
    def bind_metrics(self, registry: CollectorRegistry) -> None:
        """Register this layer's metrics in the service's registry (the service is made after us)."""
        self.metrics = _Metrics(registry)

    async def start(self) -> None:
        if self._local:
            try:
                self._aio = AsyncFsync(asyncio.get_running_loop())
            except OSError as exc:
                log.info("local store: commits sync in a thread (Linux AIO unavailable: %s)", exc)
        self._tasks = [asyncio.create_task(self._hibernate_loop()), asyncio.create_task(self._sweep_loop())]

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self._pool.shutdown(wait=True)
        self._calls.shutdown()  # a call stuck on a hung store ends with its socket timeout
        if self._aio is not None and not self._aio.busy:
            self._aio.close()
            self._aio = None

    async def hibernate_all(self, reason: str = "drain") -> int:
        """End every idle live sandbox (on SIGTERM, after in-flight events: every acknowledged step is in
        the store already, so scale-down and scale-to-zero lose nothing)."""
        sids = [sid for sid in self.live if sid not in self._busy]
        for sid in sids:
            self._hibernate(sid, reason)
        return len(sids)

    # ------------------------------------------------------------------------- the API (service)
    def live_count(self) -> int:
        return self.rt.live_count()

    def running_count(self) -> int:
        """Sandboxes running a step or being created here: what admission's live cap limits (idle
        ones are hibernated to make room, so they do not count)."""
        return len(self._busy)

    def pool_sizes(self) -> dict[str, int]:
        return self.rt.pool_sizes()

    async def run(self, request: ExecRequest, snapshot: str = "python", limits: LimitsArg = None,
                  metadata: dict[str, str] | None = None) -> ExecResult:
        await self._make_room()
        try:
            return await self.rt.run(request, snapshot=snapshot, limits=limits, metadata=metadata)
        finally:
            self._room_may_be_free()  # (a run's sandbox is gone: its slot is free)

    async def create(self, snapshot: str = "python", limits: LimitsArg = None,
                     metadata: dict[str, str] | None = None) -> SandboxInfo:
        ev = current_event.get()
        sid = ev.next_sandbox_id() if ev is not None else "sb-" + secrets.token_hex(10)
        async with self._holding(sid):
            if ev is not None:
                first = await self._read(sid, 0)
                if first is not None:  # a redelivered create: the sandbox it made, as it replied then
                    self._note_replay()
                    return await self._replayed(first, ev, SandboxInfo) or _recorded(SandboxInfo, first)
            deferred = self._defers_create()
            if deferred:
                info = await self._deferred(snapshot, limits, metadata, sid)
                live = _Live(record=self._first_record(info, None))
            else:
                await self._make_room()
                info = await self.rt.create(snapshot, limits, metadata, sandbox_id=sid)
                live = self._new_live(info, None)
            try:
                await self._commit(live, info, ev, scan=False)
            except SandboxBusy:  # the same event, at the same time, on another replica: its sandbox
                first = await self._read(sid, 0)
                if first is None or first.reply is None:
                    raise
                self._note_replay()
                return _recorded(SandboxInfo, first)
            if deferred:
                self.metrics.hibernations.labels("create").inc()
            return info

    async def exec(self, sandbox_id: str, request: ExecRequest) -> ExecResult:
        async def action(live: _Live) -> ExecResult:
            result = await self.rt.exec(sandbox_id, request, last=live.passing)
            if live.passing:  # its init ended with the step; the sandbox lives on in the store
                return result.model_copy(update={"resumed": True, "resume_ms": live.resume_ms,
                                                 "sandbox_alive": True, "hibernated": True})
            if live.resume_ms is not None:
                result = result.model_copy(update={"resumed": True, "resume_ms": live.resume_ms})
            return result

        # (files to read back are read by the agent after the program: that step cannot pass through)
        return await self.step(sandbox_id, action, ExecResult, may_pass=not request.read_files)

    async def destroy(self, sandbox_id: str) -> Usage:
        ev = current_event.get()
        async with self._holding(sandbox_id):
            live = await self._fresh_live(sandbox_id)
            head = live.record if live is not None else await self._head(sandbox_id)
            if ev is not None and (replay := await self._replayed(head, ev, Usage)) is not None:
                return replay
            if head.state == "destroyed":  # repeating a destroy returns the same record
                self._note_replay()
                usage = _recorded(Usage, head)
                if ev is not None:  # noted as any event is: sent again anywhere (other content: a 409), the same
                    await self._commit(_Live(record=head), usage, ev, scan=False, state="destroyed",
                                       reason=head.reason, journal=False)
                return usage
            if live is not None:
                local = await self.rt.destroy(sandbox_id, reason="destroyed")
                self._account(live, local.cpu_s, local.peak_memory_bytes)
            usage = self._usage(head if live is None else live.record, "destroyed")
            tomb = live or _Live(record=head)
            self.live.pop(sandbox_id, None)
            await self._commit(tomb, usage, ev, scan=False, state="destroyed", reason="destroyed")
            return usage

    def fork_ids(self, count: int) -> list[str]:
        """Ids for the children of a live fork: new at each attempt. A fork that was acknowledged is
        answered again from its parent's records; one that was not (it lost its parent's commit to
        another replica, or its replica died) may have committed its children already, and a retry
        that reused their ids could never commit them."""
        return ["sb-" + secrets.token_hex(10) for _ in range(count)]

    async def adopt(self, children: list[SandboxInfo], forked_from: str) -> None:
        """Commit the first generation of each fork child (live here, its parent's files injected).
        Until the parent's step is committed they are its to disown (``step``)."""
        self._adopted[forked_from] = [info.sandbox_id for info in children]

        async def one(info: SandboxInfo) -> None:
            live = self._new_live(info, forked_from)
            async with self._holding(info.sandbox_id):
                await self._commit(live, info, None)

        results = await asyncio.gather(*(one(i) for i in children), return_exceptions=True)
        if failed := [r for r in results if isinstance(r, BaseException)]:
            for info in children:
                self._drop(info.sandbox_id, "fork failed")
            raise failed[0]

    async def _disown(self, children: list[str]) -> None:
        """A fork's step was not committed (another replica committed that generation of the parent
        first): its children, committed already, are nobody's. Their records go (no reply names
        them), and their live copies. Only on that sure loss: a commit past the store's deadline may
        have landed, naming them."""
        for sid in children:
            self._drop(sid, "fork not committed")
            self._seen.pop(sid, None)
            self._due.pop(sid, None)
        try:
            await self._io(self.objects.delete, [record_key(sid, 0) for sid in children])
        except (StoreError, OSError) as exc:  # they expire as any idle sandbox does
            log.warning("could not remove the records of %d children of a fork that was not committed: %s",
                        len(children), exc)

    def _new_live(self, info: SandboxInfo, forked_from: str | None) -> _Live:
        """The live copy of a sandbox just made here, before its first generation is committed."""
        self._not_metered(info.sandbox_id)
        live = _Live(record=self._first_record(info, forked_from))
        self.live[info.sandbox_id] = live
        return live

    @staticmethod
    def _first_record(info: SandboxInfo, forked_from: str | None) -> SandboxRecord:
        now = time.time()
        return SandboxRecord(sandbox_id=info.sandbox_id, generation=-1, snapshot=info.snapshot_id, limits=info.limits,
                             metadata=info.metadata, forked_from=forked_from, created_at=now, last_used=now)

    def _defers_create(self) -> bool:
        """Whether a create commits its sandbox hibernated, making no live copy: when most recent steps
        here passed through. Their sandboxes had sat idle for longer than a live copy lasts here (the
        trainers think for longer than that), so a live copy made now would be hibernated, or pushed
        out to make room, before its first step, with all the work of making it for nothing (and
        pushing out the copy another sandbox's next step may still find). Its first step resumes it
        as any other. Otherwise (steps find their live copies) a create makes one, as before."""
        return self._passing_share >= 0.5

    def _note_passing(self, passing: bool) -> None:
        self._passing_share = 0.8 * self._passing_share + 0.2 * passing

    async def _deferred(self, snapshot: str, limits: LimitsArg, metadata: dict[str, str] | None,
                        sid: str) -> SandboxInfo:
        """The reply of a create committed hibernated: its snapshot resolved and its limits checked as
        a live create's are; the isolation report is the runtime's (what its sandboxes get)."""
        t0 = time.perf_counter()
        if not self.rt.started or self.rt.closing:
            raise ShuttingDown("runtime is not started" if not self.rt.started else "runtime is shutting down")
        view = await self.rt.resolve(snapshot)
        return SandboxInfo(sandbox_id=sid, snapshot_id=view.id, env_version=dict(view.version),
                           limits=effective_limits(view, limits), metadata=dict(metadata or {}), pooled=False,
                           create_ms=round((time.perf_counter() - t0) * 1000, 3),
                           isolation=self.rt.isolation_report(), hibernated=True)

    async def step(self, sandbox_id: str, action: Callable[[_Live], Awaitable[M]], model: type[M],
                   may_pass: bool = False, room: int = 0) -> M:
        """Run one step on a sandbox's newest state and commit it before returning its reply: the
        sandbox is resumed first if it is not live here (or its copy here is stale); a redelivered
        event gets its recorded reply without running. ``may_pass``: the step may pass through
        (``_passes``). ``room``: live sandboxes the step makes beside this one (a fork's children),
        made room for as a create's are (idle ones hibernated)."""
        ev = current_event.get()
        async with self._holding(sandbox_id):
            live, replay = await self._prepare(sandbox_id, ev, model, may_pass)
            if replay is not None:
                return replay
            assert live is not None
            if room:
                cap = self.rt.config.max_live
                if room + 1 > cap:
                    raise Overloaded(f"{room} new sandboxes beside sandbox {sandbox_id} do not fit under this "
                                     f"replica's live cap ({cap}, --max-live)", retry_after_s=1.0)
                await self._make_room(room)
            passing = live.passing
            try:
                try:
                    reply = await action(live)
                except SandboxDied:
                    self._cut_short(sandbox_id, live)
                    raise
                finally:
                    live.last_used = time.monotonic()
                    live.passing = False  # for this step only (one refused before it ran leaves a live copy)
                self._cut_short(sandbox_id, live)
                await self._commit(live, reply, ev)
            except (SandboxBusy, SandboxGone):  # another replica committed this generation: nothing is kept
                await self._disown(self._adopted.pop(sandbox_id, []))
                raise
            finally:
                self._adopted.pop(sandbox_id, None)
            live.resume_ms = None
            if passing:
                self._drop(sandbox_id, "hibernated")
                self.metrics.hibernations.labels("step").inc()
            return reply

    def _cut_short(self, sandbox_id: str, live: _Live) -> None:
        """SandboxGone if the sandbox's lifetime passed while this step ran and the runtime's reaper
        ended it (the step's result is then that of a kill, or SandboxDied): the step is not
        acknowledged, and the answer is the one every replica gives for the sandbox from now on."""
        why = live.record.expired(time.time())
        sb = self.rt.sandboxes.get(sandbox_id)
        if why is not None and (sb is None or not sb.alive()):
            raise SandboxGone(f"sandbox {sandbox_id} expired ({why} limit) during this step",
                              sandbox_id=sandbox_id, reason=why)

    async def ensure_live(self, sandbox_id: str) -> None:
        """Resume the sandbox here if it is not live (the snapshot and fork handlers need it live)."""
        async with self._holding(sandbox_id):
            await self._prepare(sandbox_id, None, BaseModel)

    async def _prepare(self, sandbox_id: str, ev: EventRef | None, model: type[M],
                       may_pass: bool = False) -> tuple[_Live | None, M | None]:
        """(the live copy to run a step on, None), or (None, the recorded reply of ``ev``)."""
        live = await self._fresh_live(sandbox_id)
        head = live.record if live is not None else await self._head(sandbox_id)
        if ev is not None and (replay := await self._replayed(head, ev, model)) is not None:
            return None, replay
        if head.state == "destroyed":
            raise SandboxGone(f"sandbox {sandbox_id} was destroyed ({head.reason})",
                              sandbox_id=sandbox_id, reason=head.reason or "destroyed")
        why = head.expired(time.time())  # (a live copy too: the runtime's reaper looks only now and then)
        if why is not None:
            await self._expire(head, why, live)
            raise SandboxGone(f"sandbox {sandbox_id} expired ({why} limit)", sandbox_id=sandbox_id, reason=why)
        if live is None:
            passing = may_pass and self._passes(head)
            if may_pass:
                self._note_passing(passing)
            live = await self._resume(head, spare=not passing)
            live.passing = passing
        elif may_pass:  # its live copy lasted until this step
            self._note_passing(False)
        return live, None

    def _passes(self, head: SandboxRecord) -> bool:
        """Whether a step that resumes this sandbox passes through: runs as the resumed sandbox's init
        (one process, no worker forked) and hibernates it when it ends. So it does when the sandbox sat
        idle longer than an idle live copy lasts here — ``--hibernate-after-s``, or under pressure the
        idle time at which the least recently used ones are being hibernated: at the trainer's pace,
        it would be hibernated again before its next step, with all the work of a live copy for
        nothing. (A step after a short pause keeps its sandbox live, as before.)"""
        lasts = self.hibernate_after_s or math.inf
        if self._evicted is not None:
            at, idle_s = self._evicted
            if time.monotonic() - at < max(PRESSURE_MEMORY_S, 4 * idle_s):
                lasts = min(lasts, idle_s)
        return time.time() - head.last_used >= lasts

    # ----------------------------------------------------------------------------- internals

    async def _io(self, fn: Callable[..., Any], *args: Any) -> Any:
        """A store call, off the event loop, with a deadline (``StoreDeadline``: a hung store is a 503)."""
        return await self._calls.run(fn, *args, doing=_DOING.get(getattr(fn, "__name__", ""), "reading sandbox state"))

    async def _read(self, sandbox_id: str, generation: int) -> SandboxRecord | None:
        """A sandbox's record of one generation. The local store's is a small local file, read and
        parsed on the event loop: less work than a thread's round trip, whose hand-offs of the GIL
        cost the loop more than the read (measured); S3's off the loop, with a deadline."""
        if self._local:
            return self._get(sandbox_id, generation)
        result: SandboxRecord | None = await self._io(self._get, sandbox_id, generation)
        return result

    async def _disk(self, fn: Callable[..., Any], *args: Any) -> Any:  # local files, off the event loop
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    @contextlib.asynccontextmanager
    async def _holding(self, sandbox_id: str) -> Any:
        lock = self._locks.setdefault(sandbox_id, asyncio.Lock())
        t0 = time.perf_counter()
        async with lock:
            if self.journal is not None:
                self.journal.queued(time.perf_counter() - t0)
            self._busy.add(sandbox_id)
            try:
                yield
            finally:
                self._busy.discard(sandbox_id)
                self._room_may_be_free()
        if not lock.locked() and not lock._waiters and sandbox_id not in self.live:
            self._locks.pop(sandbox_id, None)

    def _get(self, sandbox_id: str, generation: int) -> SandboxRecord | None:
        key = record_key(sandbox_id, generation)
        data = self.objects.get(key)
        return None if data is None else SandboxRecord.from_bytes(data, key)

    async def _head(self, sandbox_id: str) -> SandboxRecord:
        """The newest generation of a sandbox not live here; SandboxNotFound if it never existed.
        From a generation seen here before (a record read or written; the record itself is kept for
        the 4096 most recent, its generation for many more), reading forward costs a GET per
        generation and one that finds nothing; else the sandbox's records are listed first."""
        head: SandboxRecord | None = self._seen.get(sandbox_id)
        if head is None and (due := self._due.get(sandbox_id)) is not None:
            head = await self._read(sandbox_id, due[0])  # the generation seen here last
        if head is None:
            keys = await self._io(self.objects.keys, f"sandboxes/{sandbox_id}/")
            gens = sorted(g for k in keys if (g := generation_of(k)) is not None)
            if not gens:
                raise SandboxNotFound(f"no sandbox {sandbox_id!r}", sandbox_id=sandbox_id)
            head = await self._read(sandbox_id, gens[-1])
            if head is None:  # removed between the listing and the read (the sweeper)
                raise SandboxGone(f"sandbox {sandbox_id} was destroyed", sandbox_id=sandbox_id)
        while (newer := await self._read(sandbox_id, head.generation + 1)) is not None:
            head = newer  # committed elsewhere since
        self._remember(head)
        return head

    def _remember(self, record: SandboxRecord) -> None:
        """Keep the newest record seen of a sandbox (bounded): its next resume here skips the listing."""
        self._note_due(record)
        self._seen[record.sandbox_id] = record
        self._seen.move_to_end(record.sandbox_id)
        while len(self._seen) > 4096:
            self._seen.popitem(last=False)

    def _note_due(self, record: SandboxRecord) -> None:
        """Note a sandbox's generation and when the sweep may next have to do with it (``_due``)."""
        if record.state == "destroyed":
            due = record.last_used + self.tombstone_ttl_s
        else:
            due = min(record.created_at + record.limits.lifetime_s, record.last_used + record.limits.idle_s)
        self._due[record.sandbox_id] = (record.generation, due)
        while len(self._due) > 1_000_000:
            self._due.pop(next(iter(self._due)))

    async def _fresh_live(self, sandbox_id: str) -> _Live | None:
        """The live copy here, if it is still the newest generation and its sandbox still runs."""
        live = self.live.get(sandbox_id)
        if live is None:
            return None
        if sandbox_id not in self.rt.sandboxes or not self.rt.sandboxes[sandbox_id].alive():
            self._drop(sandbox_id, "died")
            return None
        newer = await self._read(sandbox_id, live.record.generation + 1)
        if newer is not None:  # another replica moved it on: never run a step on this copy
            self.metrics.stale.inc()
            self._remember(newer)
            self._drop(sandbox_id, "stale")
            return None
        return live

    async def _replayed(self, head: SandboxRecord, ev: EventRef, model: type[M]) -> M | None:
        """The recorded reply of ``ev`` if this sandbox acknowledged it (read from the generation that
        holds it); an event with the same identity but other content is refused."""
        seen = head.events.get(ev.key)
        if seen is None:
            return None
        if len(seen) > 1 and seen[1] != ev.fingerprint:
            raise Conflict(f"an event with source {ev.source!r} and id {ev.id!r} was already handled "
                           "with different content; give a new event a new id")
        gen = int(seen[0])
        rec = head if gen == head.generation else await self._read(head.sandbox_id, gen)
        if rec is None or rec.reply is None:
            raise IntegrityError(f"sandbox {head.sandbox_id}: the record holding the reply of event "
                                 f"{ev.id!r} (generation {gen}) is missing", sandbox_id=head.sandbox_id)
        self._note_replay()
        return _recorded(model, rec)

    def _note_replay(self) -> None:
        if self.journal is not None:  # answered from the store: the step was recorded when it ran
            self.journal.replayed()

    def _not_metered(self, sandbox_id: str) -> None:
        """A durable sandbox's lives on replicas are one life, billed once when it ends (``_commit`` of
        its tombstone), not by the runtime at each hibernation."""
        sb = self.rt.sandboxes.get(sandbox_id)
        if sb is not None:
            sb.bill_elsewhere()

    def _drop(self, sandbox_id: str, reason: str) -> None:
        """Forget the live copy here without committing (stale, conflicted, died, hibernated): its id
        is free at once, its sandbox ends in the background."""
        self.live.pop(sandbox_id, None)
        self.rt.discard(sandbox_id, reason)

    def _account(self, live: _Live, life_cpu_s: float, peak: int) -> None:
        """Fold this life's usage since the last commit into ``live.record.usage``."""
        now = time.monotonic()
        u = live.record.usage
        live.record = live.record.model_copy(update={"usage": StepUsage(
            live_s=u.live_s + (now - live.since),
            cpu_s=u.cpu_s + max(0.0, life_cpu_s - live.cpu_s),
            peak_memory_bytes=max(u.peak_memory_bytes, peak),
            execs=u.execs)})
        live.since = now
        live.cpu_s = life_cpu_s

    def _usage(self, record: SandboxRecord, reason: str) -> Usage:
        u = record.usage
        return Usage(sandbox_id=record.sandbox_id, snapshot_id=record.snapshot, metadata=record.metadata,
                     wall_s=round(u.live_s, 6), cpu_s=round(u.cpu_s, 6), peak_memory_bytes=u.peak_memory_bytes,
                     billed_s=max(1, math.ceil(u.live_s)), execs=u.execs, reason=reason)

    async def _commit(self, live: _Live, reply: BaseModel | None, ev: EventRef | None, *, scan: bool = True,
                      state: str = "live", reason: str | None = None, journal: bool = True) -> None:
        """Write the sandbox's next generation (create-only). Any failure drops the live copy: its
        files may hold a step that was not acknowledged, so the next step resumes from the store.
        ``journal``: spool the step's row and usage (off for a record that only notes an event)."""
        prev = live.record
        sid = prev.sandbox_id
        gen = prev.generation + 1
        t0 = time.perf_counter()
        token = None
        writing = False
        steps = self.journal if journal else None
        try:
            sb = self.rt.sandboxes.get(sid)
            if sb is not None and state == "live":
                self._account(live, sb.cpu_s, sb.peak_memory_bytes)
            files = prev.files
            inline: dict[str, bytes] = {}
            if scan and sb is not None:
                files, inline = await self._scan(sid, live, gen)
            events = dict(prev.events)
            if ev is not None:
                events[ev.key] = [gen, ev.fingerprint]
            usage_now = live.record.usage
            if isinstance(reply, ExecResult):
                usage_now = usage_now.model_copy(update={"execs": usage_now.execs + 1})
            record = live.record.model_copy(update={
                "generation": gen, "state": state, "reason": reason, "files": files if state == "live" else Files(),
                "inline": inline, "events": events, "last_used": time.time(), "usage": usage_now,
                "reply": None if reply is None else reply.model_dump(mode="json"), "writer": self.replica})
            if steps is not None:  # spooled beside the write; the reply waits for both
                token = await steps.before_commit(record, reply, ev is not None)
            writing = True
            ok = await self._put_record(record_key(sid, gen), record.to_bytes())
        except BaseException as exc:
            if steps is not None:  # a write past its deadline may still land: the flush asks the store
                steps.settle(token, None if writing and isinstance(exc, StoreDeadline) else False)
            if state == "live":
                self._drop(sid, "commit failed")
            raise
        finally:
            self.metrics.store_write_seconds.observe(time.perf_counter() - t0)
        if steps is not None:
            steps.settle(token, ok)
        if not ok:
            self.metrics.conflicts.inc()
            self._drop(sid, "conflict")
            if state == "live":  # a step lost to the sandbox's end (a destroy, an expiry elsewhere): that is final
                with contextlib.suppress(StoreError):
                    winner = await self._read(sid, gen)
                    if winner is not None and winner.state == "destroyed":
                        self._remember(winner)
                        raise SandboxGone(f"sandbox {sid} ended ({winner.reason}) while this step ran; nothing of "
                                          "it was kept", sandbox_id=sid, reason=winner.reason or "destroyed")
            raise SandboxBusy(f"sandbox {sid}: another replica committed step {gen} first; nothing of this "
                              "request was kept, retry it", sandbox_id=sid)
        live.record = record
        self._remember(record)

    async def _put_record(self, key: str, data: bytes) -> bool:
        """The create-only write of a record. On the local store it runs on the event loop and its two
        disk syncs go through Linux AIO: a thread's round trip per commit cost the loop more (GIL
        hand-offs) than the writes. Elsewhere (S3, or no AIO) a store call off the loop. Both with the
        store's deadline (``StoreDeadline``: a write past it may still land)."""
        if self._aio is None:
            ok: bool = await self._io(self.objects.put_new, key, data)
            return ok
        assert isinstance(self.objects, LocalObjects)
        try:
            async with asyncio.timeout(self._calls.deadline_s), self._aio_slots:
                return await self.objects.put_new_synced(key, data, self._aio.synced)
        except TimeoutError:
            raise StoreDeadline(f"the store did not answer within {self._calls.deadline_s:g} s while "
                                "committing a sandbox's step") from None

    async def _scan(self, sandbox_id: str, live: _Live, gen: int) -> tuple[Files, dict[str, bytes]]:
        """The sandbox's files, read while it is held still (or, once it died, through its upper
        directory's descriptor); (files, inline contents). New large contents are uploaded as blobs
        before it may run again or its descriptor is closed: their paths lead into it."""
        def scan(upper: str, small: bool = False) -> tuple[Files, dict[str, bytes], dict[str, str]]:
            files, paths = scan_upper(upper, live.hashes, small)
            inline, blobs = place_contents(files, live.record if live.record.generation >= 0 else None, gen, paths)
            return files, inline, blobs

        async def scanned(upper: str) -> tuple[Files, dict[str, bytes]]:
            try:  # most steps change a few small files: scanned here, no thread's round trip
                files, inline, blobs = scan(upper, small=True)
            except UpperTooLarge:
                files, inline, blobs = await self._disk(scan, upper)
            for sha, path in blobs.items():
                if time.monotonic() - self._blobs_known.get(sha, float("-inf")) >= REFRESH_AFTER_S:
                    await self._io(self._put_blob, sha, path)
            return files, inline

        try:
            async with self.rt.frozen(sandbox_id) as sb:
                return await scanned(sb.upper_path)
        except SandboxDied:  # nothing runs in it any more: its files can be read as they are
            dead = self.rt.sandboxes.get(sandbox_id)
            if dead is None or dead.upper_fd < 0:
                raise
            fd = os.dup(dead.upper_fd)  # the runtime's reaper may end the dead sandbox (and close its fd) meanwhile
            try:
                return await scanned(f"/proc/self/fd/{fd}/upper")
            finally:
                os.close(fd)

    def _put_blob(self, sha: str, path: str) -> None:
        with open(path, "rb") as f:
            data = f.read()
        check_content(sha, data, path)
        self.objects.put_content(blob_key(sha), data)  # an old copy is rewritten: its expiry restarts
        self._blobs_known[sha] = time.monotonic()
        while len(self._blobs_known) > 1_000_000:
            self._blobs_known.pop(next(iter(self._blobs_known)))
        self._cache_blob(sha, data)

    def _cache_blob(self, sha: str, data: bytes) -> None:
        """Keep recent blobs (bounded, least recently used out first): a sandbox resumed again on this
        replica reads its large files from memory, not the store. Called from store threads."""
        with self._blob_lock:
            if sha in self._blob_cache or len(data) > self.blob_cache_max_bytes // 4:
                return
            self._blob_cache[sha] = data
            self._blob_cache_bytes += len(data)
            while self._blob_cache_bytes > self.blob_cache_max_bytes:
                _, old = self._blob_cache.popitem(last=False)
                self._blob_cache_bytes -= len(old)

    def _get_blob(self, sha: str) -> bytes | None:
        with self._blob_lock:
            data = self._blob_cache.get(sha)
            if data is not None:
                self._blob_cache.move_to_end(sha)
                return data
        data = self.objects.get(blob_key(sha))
        if data is not None:
            data = check_content(sha, data, f"blob {sha}")
            self._cache_blob(sha, data)
        return data

    async def _resume(self, head: SandboxRecord, spare: bool = True) -> _Live:
        """A live copy of ``head``: a sandbox of its snapshot and limits with its files injected."""
        t0 = time.perf_counter()
        sid = head.sandbox_id
        contents = await self._contents(head)
        await self._make_room()
        await self.rt.take(head.snapshot, head.limits, head.metadata, sandbox_id=sid, forked_from=head.forked_from,
                           step_next=spare)
        self._not_metered(sid)
        sb = self.rt.sandboxes.get(sid)
        if sb is not None:  # its lifetime counts from the sandbox's create, not from this resume (the reaper's)
            sb.backdate(max(0.0, time.time() - head.created_at))
        try:
            if head.files.entries or head.files.whiteouts or head.files.opaque:
                diff = diff_of(head.files, contents)
                try:
                    await self.rt.inject(sid, diff)
                finally:
                    os.close(diff.fd)
        except BaseException:
            with contextlib.suppress(RollboxError):
                await self.rt.destroy(sid, reason="resume failed")
            raise
        live = _Live(record=head)
        sb = self.rt.sandboxes.get(sid)
        if sb is not None and sb.upper_fd >= 0:  # the injected files are known: the first commit reads none
            try:  # a stat per entry: a small upper here, no thread's round trip
                prefill_hashes(sb.upper_path, head.files, live.hashes, SMALL_SCAN[0])
            except UpperTooLarge:
                await self._disk(prefill_hashes, sb.upper_path, head.files, live.hashes)
        live.resume_ms = round((time.perf_counter() - t0) * 1000, 3)
        self.live[sid] = live
        self.metrics.resumes.inc()
        self.metrics.resume_seconds.observe(time.perf_counter() - t0)
        return live

    async def _contents(self, head: SandboxRecord) -> dict[str, bytes]:
        """Every file content ``head`` names: inline in its records, or blobs."""
        sid = head.sandbox_id
        gens = {e.generation for e in head.files.entries if e.kind == "f" and e.generation is not None}
        need_blobs = {e.sha for e in head.files.entries if e.kind == "f" and e.generation is None}
        records = {head.generation: head}
        # one order for the reads and for pairing their results: a set of ints iterates unsorted
        # once they pass its table size (list({3, 9}) == [9, 3]), which paired records with wrong generations
        older = sorted(gens - {head.generation})
        fetched = await asyncio.gather(*(self._read(sid, g) for g in older))
        for g, rec in zip(older, fetched, strict=True):
            if rec is None:
                raise IntegrityError(f"sandbox {sid}: record {g} holding file contents is missing", sandbox_id=sid)
            records[g] = rec
        contents: dict[str, bytes] = {}
        for e in head.files.entries:
            if e.kind == "f" and e.generation is not None and e.sha not in contents:
                contents[e.sha] = records[e.generation].inline[e.sha]  # checked when the record was read
        blobs = sorted(need_blobs)
        datas = await asyncio.gather(*(self._io(self._get_blob, s) for s in blobs))
        for sha, data in zip(blobs, datas, strict=True):
            if data is None:
                raise IntegrityError(f"sandbox {sid}: blob {sha} is missing from the store", sandbox_id=sid)
            contents[sha] = data
        return contents

    async def _make_room(self, n: int = 1) -> None:
        """Room for ``n`` more live sandboxes: at the live cap, hibernate the least recently used idle
        ones instead of refusing. If every live sandbox is running a step, wait for one to end (up to
        ``ROOM_WAIT_S``, then 429)."""
        cap = self.rt.config.max_live
        deadline: float | None = None
        while len(self.rt.sandboxes) + self.rt._creating + n > cap:
            idle = [(live.last_used, sid) for sid, live in self.live.items() if not self._wanted(sid)]
            if not idle:
                loop = asyncio.get_running_loop()
                deadline = deadline if deadline is not None else loop.time() + ROOM_WAIT_S
                if loop.time() >= deadline:
                    raise Overloaded(f"{len(self.rt.sandboxes)} sandboxes are running steps (cap {cap})",
                                     retry_after_s=1.0)
                if self._room is None or self._room.done():
                    self._room = loop.create_future()
                # woken when a step ends; and a look every 0.25 s (a sandbox may also end on its own)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout_at(min(deadline, loop.time() + 0.25)):
                        await asyncio.shield(self._room)
                continue
            last_used, sid = min(idle)
            now = time.monotonic()
            ewma = now - last_used if self._evicted is None else 0.8 * self._evicted[1] + 0.2 * (now - last_used)
            self._evicted = (now, ewma)  # (when, how long the evicted had been idle): see _passes
            self._hibernate(sid, "pressure")

    def _wanted(self, sandbox_id: str) -> bool:
        """Running a step, or a step waits for it: not to be hibernated to make room."""
        if sandbox_id in self._busy:
            return True
        lock = self._locks.get(sandbox_id)
        return lock is not None and (lock.locked() or bool(getattr(lock, "_waiters", None)))

    def _room_may_be_free(self) -> None:
        """A step ended (its sandbox is idle, or gone): whoever waits for room looks again."""
        if self._room is not None and not self._room.done():
            self._room.set_result(None)

    def _hibernate(self, sandbox_id: str, reason: str) -> None:
        """End an idle live copy. Nothing is written: its durable state is that of its last
        acknowledged step, committed then (what a background process wrote since was never
        acknowledged, and processes do not survive a resume anyway). The sandbox ends in the
        background, so making room costs the request that needs it nothing."""
        if sandbox_id in self._busy or sandbox_id not in self.live:
            return
        self._drop(sandbox_id, "hibernated")
        self.metrics.hibernations.labels(reason).inc()

    async def _expire(self, head: SandboxRecord, why: str, live: _Live | None = None) -> None:
        """Write the tombstone of a sandbox whose lifetime or idle limit passed (while it hibernated, or
        before the runtime's reaper ended its live copy here: then it ends now)."""
        tomb = _Live(record=head)
        if live is not None:
            self.live.pop(head.sandbox_id, None)
            with contextlib.suppress(RollboxError):
                local = await self.rt.destroy(head.sandbox_id, reason=why)
                self._account(live, local.cpu_s, local.peak_memory_bytes)
            tomb = live
        usage = self._usage(tomb.record, why)
        with contextlib.suppress(SandboxBusy):
            await self._commit(tomb, usage, None, scan=False, state="destroyed", reason=why)

    async def _reaped(self, sandbox_id: str, reason: str, usage: Usage) -> None:
        """The runtime's reaper ended a live copy for its lifetime or idle limit: record it gone."""
        live = self.live.pop(sandbox_id, None)
        if live is None:
            return
        try:
            async with self._holding(sandbox_id):
                self._account(live, usage.cpu_s, usage.peak_memory_bytes)
                await self._commit(live, self._usage(live.record, reason), None, scan=False,
                                   state="destroyed", reason=reason)
        except (RollboxError, OSError) as exc:
            log.warning("could not record that %s expired (%s): %s", sandbox_id, reason, exc)

    async def _hibernate_loop(self) -> None:
        while True:
            await asyncio.sleep(min(1.0, (self.hibernate_after_s or 4.0) / 4))
            if not self.hibernate_after_s:
                continue
            now = time.monotonic()
            for sid, live in list(self.live.items()):
                if sid not in self._busy and now - live.last_used >= self.hibernate_after_s:
                    self._hibernate(sid, "idle")

    async def _sweep_loop(self) -> None:
        while True:
            await asyncio.sleep(self.sweep_interval_s)
            try:
                await self.sweep()
            except (StoreError, OSError) as exc:
                log.warning("sweeping durable state failed: %s", exc)

    async def sweep(self) -> dict[str, int]:
        """Expire hibernated sandboxes past their limits; remove destroyed ones' records after the
        tombstone TTL (a redelivered event finds its reply until then)."""
        keys: list[str] = await self._io(self.objects.keys, "sandboxes/")
        by_sid: dict[str, dict[int, str]] = {}
        for k in keys:
            if (g := generation_of(k)) is not None:
                by_sid.setdefault(k.split("/")[1], {})[g] = k
        expired = removed = 0
        now = time.time()
        for sid, gens in by_sid.items():
            if sid in self.live or sid in self._busy:
                continue
            known = self._due.get(sid)
            if known is not None and known[0] == max(gens) and now < known[1]:
                continue  # nothing changed since it was read or written here, and it is not due
            head = await self._read(sid, max(gens))
            if head is None:
                continue
            self._note_due(head)  # (not _remember: a sweep must not push resumed sandboxes out of _seen)
            if head.state == "destroyed":
                if now - head.last_used > self.tombstone_ttl_s:
                    await self._io(self.objects.delete, list(gens.values()))
                    self._due.pop(sid, None)
                    self._seen.pop(sid, None)
                    removed += 1
            elif (why := head.expired(now)) is not None:
                async with self._holding(sid):
                    await self._expire(head, why)
                expired += 1
        return {"expired": expired, "removed": removed}
