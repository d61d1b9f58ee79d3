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
    create                        commits the first generation hibernated: nothing runs in a new
                                  sandbox before its first step, which resumes it as any other
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
import logging
import os
import secrets
import socket
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, TypeVar

from prometheus_client import CollectorRegistry
from pydantic import BaseModel
from rollbox.functions.contract.eventref import EventRef
from rollbox.functions.contract.models import Conflict
from rollbox.functions.durable.capacity import LiveCap
from rollbox.functions.durable.generations import Generations
from rollbox.functions.durable.metrics import DurableMetrics
from rollbox.functions.durable.residency import Live, Residency
from rollbox.functions.durable.store import StateStore, recorded
from rollbox.runtime.errors import (
    IntegrityError,
    Overloaded,
    RollboxError,
    SandboxBusy,
    SandboxDied,
    SandboxGone,
    ShuttingDown,
    StoreError,
)
from rollbox.runtime.runtime import LimitsArg, Runtime, effective_limits
from rollbox.runtime.spec import ExecRequest, ExecResult, SandboxInfo, Usage
from rollbox.snapshots.state import (
    Objects,
    SandboxRecord,
    record_key,
)

if TYPE_CHECKING:
    from rollbox.functions.recording.steps import StepLog

__all__ = ["DurableRuntime"]

log = logging.getLogger("rollbox.durable")
M = TypeVar("M", bound=BaseModel)


class _RanBehind(RollboxError):
    """A step run on what its replica saw last of the sandbox, unread, lost its commit (``step``): caught
    there and run again on the newest state; never leaves this module."""


class DurableRuntime:
    """The service's runtime when durability is on (``--durability step``): see the module docstring.
    Its parts: ``store`` (records, blobs: ``store.py``), ``residency`` (live copies, make-room,
    hibernate, sweep: ``residency.py``), ``generations`` (a step committed as the next generation, a
    generation resumed: ``generations.py``); this class is the API: a step on the newest state."""

    def __init__(self, rt: Runtime, objects: Objects, *, hibernate_after_s: float = 30.0,
                 sweep_interval_s: float = 60.0, tombstone_ttl_s: float = 600.0, replica: str | None = None,
                 io_threads: int = 8, registry: CollectorRegistry | None = None, cap: LiveCap | None = None,
                 journal: StepLog | None = None):
        """``cap``: the replica's live cap, which the service's admission asks too. ``journal``: the
        step log (trajectories and the usage ledger) when recording is on. ``registry``: where this
        layer's metrics go (the service's)."""
        self.rt = rt
        self.replica = replica or f"{socket.gethostname()}-{os.getpid()}"
        self.journal = journal
        self.metrics = DurableMetrics(registry)
        self.store = StateStore(objects, tombstone_ttl_s=tombstone_ttl_s, io_threads=io_threads)
        if not self.store.local:
            self.metrics.watch_store(objects.requests_sent)
        self.residency = Residency(rt, self.store, self.metrics, cap=cap or LiveCap(), expire=self._expire,
                                   hibernate_after_s=hibernate_after_s, sweep_interval_s=sweep_interval_s,
                                   journal=journal)
        self.cap = self.residency.cap
        self.live = self.residency.live  # (the same dict: the API reads and adds live copies)
        self._adopted: dict[str, list[str]] = {}  # parent -> fork children committed in its running step
        self.generations = Generations(rt, self.store, self.residency, self.metrics, replica=self.replica,
                                       journal=journal)
        rt.on_reaped = self._reaped

    # ------------------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        self.store.start()
        self.residency.start()

    async def close(self) -> None:
        await self.residency.close()
        self.generations.close()
        self.store.close()

    async def hibernate_all(self, reason: str = "drain") -> int:
        """End every idle live sandbox (on SIGTERM: see ``Residency.hibernate_all``)."""
        return await self.residency.hibernate_all(reason)

    async def sweep(self, bounds: tuple[str | None, str | None] | None = None) -> dict[str, int]:
        return await self.residency.sweep(bounds)

    # ------------------------------------------------------------------------- the API (service)
    def live_count(self) -> int:
        return self.rt.live_count()

    def running_count(self) -> int:
        """Sandboxes running a step or being created here: what admission's live cap limits."""
        return self.residency.running_count()

    def pool_sizes(self) -> dict[str, int]:
        return self.rt.pool_sizes()

    async def run(self, request: ExecRequest, snapshot: str = "python", limits: LimitsArg = None,
                  metadata: dict[str, str] | None = None) -> ExecResult:
        await self.residency.make_room()
        try:
            return await self.rt.run(request, snapshot=snapshot, limits=limits, metadata=metadata)
        finally:
            self.residency.room_may_be_free()  # (a run's sandbox is gone: its slot is free)

    async def create(self, snapshot: str = "python", limits: LimitsArg = None,
                     metadata: dict[str, str] | None = None, *, event: EventRef | None = None,
                     live_copy: bool = False) -> SandboxInfo:
        """A new sandbox, its first generation committed. With ``event``, its id is derived from the
        event (the event's n-th create): the same event again, here or on any replica, gets the
        sandbox it made, as it replied then. Without, a random id.

        A create runs nothing in its sandbox, so it restores none: its snapshot is resolved and its
        limits checked as a live create's are (the same errors, at create), its first generation is
        committed hibernated, and its first step (or fork, snapshot) resumes it as any hibernated
        sandbox is resumed. Trainers think for longer between steps than a live copy lasts, so a copy
        made now would be hibernated before the first step anyway. ``live_copy``: restore it now
        (a caller about to use it at once); the reply then comes from the live sandbox."""
        ev = event
        sid = ev.next_sandbox_id() if ev is not None else "sb-" + secrets.token_hex(10)
        async with self.residency.holding(sid):
            # No read first: a redelivered create learns of its sandbox from the create-only write
            # below (412), unless the sandbox is live here (then a create would be refused)
            if ev is not None and sid in self.rt.sandboxes and (made := await self._made(sid, ev)) is not None:
                return made
            if not live_copy:  # nothing runs in it yet: its first step (or fork, snapshot) resumes it
                info = await self._deferred(snapshot, limits, metadata, sid)
                live = Live(record=self._first_record(info, None))
            else:
                await self.residency.make_room()
                info = await self.rt.create(snapshot, limits, metadata, sandbox_id=sid)
                live = self._new_live(info, None)
            try:
                await self.generations.commit(live, info, ev, scan=False)
            except SandboxBusy:  # the same event, before or at the same time: the sandbox it made
                if ev is None or (made := await self._made(sid, ev)) is None:
                    raise
                return made
            if not live_copy:
                self.metrics.hibernations.labels("create").inc()
            return info

    async def exec(self, sandbox_id: str, request: ExecRequest, *, event: EventRef | None = None) -> ExecResult:
        async def action(live: Live) -> ExecResult:
            result = await self.rt.exec(sandbox_id, request, last=live.passing)
            if live.passing:  # its init ended with the step; the sandbox lives on in the store
                return result.model_copy(update={"resumed": True, "resume_ms": live.resume_ms,
                                                 "sandbox_alive": True, "hibernated": True})
            if live.resume_ms is not None:
                result = result.model_copy(update={"resumed": True, "resume_ms": live.resume_ms})
            return result

        # (files to read back are read by the agent after the program: that step cannot pass through)
        return await self.step(sandbox_id, action, ExecResult, may_pass=not request.read_files, event=event,
                               may_trust=True)

    async def destroy(self, sandbox_id: str, *, event: EventRef | None = None) -> Usage:
        """Commit the sandbox's tombstone as an exec commits a step: on what this replica saw last of it,
        unread, while its steps keep finding it there (``StateStore.trusts_seen``), else on the first
        newer generation read (``StateStore.newest``); a commit that finds it ran behind (412) does it
        again on the newest, read. Repeating a destroy returns the same usage."""
        async with self.residency.holding(sandbox_id):
            try:
                return await self._destroy(sandbox_id, event, self.store.trusts_seen(), ahead=True)
            except _RanBehind:
                self.store.note_behind(True)
            return await self._destroy(sandbox_id, event, False)

    async def _head(self, sandbox_id: str, trust: bool,
                    ahead: bool) -> tuple[Live | None, SandboxRecord, bool, bool]:
        """(its live copy here or None, the generation a step or destroy goes on, whether that head is
        trusted rather than read as the newest, whether it is confirmed the newest): the live copy's
        record, else (``trust``) what this replica saw last, unread, else the newest read (``ahead``:
        the first newer one found, unconfirmed)."""
        live = await self._fresh_live(sandbox_id, trust)
        seen = self.store.seen_record(sandbox_id) if trust and live is None else None
        confirmed = True
        if live is not None:
            head = live.record
        elif seen is not None:
            head = seen
        else:
            head, confirmed = await self.store.newest(sandbox_id, confirm=not ahead)
        return live, head, (trust and (live is not None or seen is not None)) or not confirmed, confirmed

    async def _destroy(self, sandbox_id: str, ev: EventRef | None, trust: bool, ahead: bool = False) -> Usage:
        live, head, trusted, confirmed = await self._head(sandbox_id, trust, ahead)
        try:
            usage = await self._tombstone(sandbox_id, ev, live, head)
        except SandboxBusy as exc:  # another replica committed that generation first: nothing was kept
            if trusted:
                raise _RanBehind("ran behind the newest generation", sandbox_id=sandbox_id) from exc
            raise
        if trusted and confirmed:
            self.store.note_behind(False)
        return usage

    async def _tombstone(self, sandbox_id: str, ev: EventRef | None, live: Live | None,
                         head: SandboxRecord) -> Usage:
        if ev is not None and (replay := await self._replayed(head, ev, Usage)) is not None:
            return replay
        if head.state == "destroyed":  # repeating a destroy returns the same record
            self._note_replay()
            usage = recorded(Usage, head)
            if ev is not None:  # noted as any event is: sent again anywhere (other content: a 409), the same
                await self.generations.commit(Live(record=head), usage, ev, scan=False, state="destroyed",
                                   reason=head.reason, journal=False)
            return usage
        if live is not None:
            local = await self.rt.destroy(sandbox_id, reason="destroyed")
            self.generations.account(live, local.cpu_s, local.peak_memory_bytes)
        usage = self.generations.usage(head if live is None else live.record, "destroyed")
        tomb = live or Live(record=head)
        self.live.pop(sandbox_id, None)
        await self.generations.commit(tomb, usage, ev, scan=False, state="destroyed", reason="destroyed")
        return usage

    async def _made(self, sid: str, ev: EventRef) -> SandboxInfo | None:
        """The sandbox a create event made before, as it replied then (None if it made none)."""
        first = await self.store.read(sid, 0)
        if first is None or first.reply is None:
            return None
        self._note_replay()
        return await self._replayed(first, ev, SandboxInfo) or recorded(SandboxInfo, first)

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
            async with self.residency.holding(info.sandbox_id):
                await self.generations.commit(live, info, None)

        results = await asyncio.gather(*(one(i) for i in children), return_exceptions=True)
        if failed := [r for r in results if isinstance(r, BaseException)]:
            for info in children:
                self.residency.drop(info.sandbox_id, "fork failed")
            raise failed[0]

    async def _disown(self, children: list[str]) -> None:
        """A fork's step was not committed (another replica committed that generation of the parent
        first): its children, committed already, are nobody's. Their records go (no reply names
        them), and their live copies. Only on that sure loss: a commit past the store's deadline may
        have landed, naming them."""
        for sid in children:
            self.residency.drop(sid, "fork not committed")
            self.store.forget(sid)
        try:
            await self.store.io(self.store.objects.delete, [record_key(sid, 0) for sid in children])
        except (StoreError, OSError) as exc:  # they expire as any idle sandbox does
            log.warning("could not remove the records of %d children of a fork that was not committed: %s",
                        len(children), exc)

    def _new_live(self, info: SandboxInfo, forked_from: str | None) -> Live:
        """The live copy of a sandbox just made here, before its first generation is committed."""
        self.generations.not_metered(info.sandbox_id)
        live = Live(record=self._first_record(info, forked_from))
        self.live[info.sandbox_id] = live
        return live

    @staticmethod
    def _first_record(info: SandboxInfo, forked_from: str | None) -> SandboxRecord:
        now = time.time()
        return SandboxRecord(sandbox_id=info.sandbox_id, generation=-1, snapshot=info.snapshot_id, limits=info.limits,
                             metadata=info.metadata, forked_from=forked_from, created_at=now, last_used=now)

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

    async def step(self, sandbox_id: str, action: Callable[[Live], Awaitable[M]], model: type[M],
                   may_pass: bool = False, room: int = 0, event: EventRef | None = None,
                   may_trust: bool = False) -> M:
        """Run one step on a sandbox's newest state and commit it before returning its reply: the
        sandbox is resumed first if it is not live here (or its copy here is stale); a redelivered
        event gets its recorded reply without running. ``may_pass``: the step may pass through
        (``_passes``). ``room``: live sandboxes the step makes beside this one (a fork's children),
        made room for as a create's are (idle ones hibernated). ``event``: the request's, under which
        the reply is recorded (and found again when it is redelivered). ``may_trust``: the step may run
        on what this replica saw last of the sandbox, unread (``StateStore.trusts_seen``): if its commit
        finds that another replica had moved on, nothing of it is kept and it runs again, once, on the
        newest (only for a step whose running leaves nothing outside its sandbox: an exec)."""
        async with self.residency.holding(sandbox_id):
            rerun = may_trust and room == 0  # a commit that finds it ran behind may run it again
            trust = rerun and self.store.trusts_seen()
            try:
                return await self._step(sandbox_id, action, model, may_pass, room, event, trust, rerun)
            except _RanBehind:  # (or lost a race): nothing of it was kept; again on the newest, read
                self.store.note_behind(True)
            return await self._step(sandbox_id, action, model, may_pass, room, event, False)

    async def _step(self, sandbox_id: str, action: Callable[[Live], Awaitable[M]], model: type[M],
                    may_pass: bool, room: int, ev: EventRef | None, trust: bool, ahead: bool = False) -> M:
        live, replay = await self._prepare(sandbox_id, ev, model, may_pass, trust, ahead)
        if replay is not None:
            return replay
        assert live is not None
        if room:
            if not self.cap.fits(0, room + 1):
                raise Overloaded(f"{room} new sandboxes beside sandbox {sandbox_id} do not fit under this "
                                 f"replica's live cap ({self.cap.max_live}, --max-live)", retry_after_s=1.0)
            await self.residency.make_room(room)
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
            await self.generations.commit(live, reply, ev)
        except (SandboxBusy, SandboxGone) as exc:  # another replica committed this generation: nothing is kept
            await self._disown(self._adopted.pop(sandbox_id, []))
            if live.trusted and isinstance(exc, SandboxBusy):
                raise _RanBehind("ran behind the newest generation", sandbox_id=sandbox_id) from exc
            raise
        finally:
            self._adopted.pop(sandbox_id, None)
        if live.trusted and not live.unconfirmed:  # (an unconfirmed head was counted as found behind)
            self.store.note_behind(False)
        live.trusted = live.unconfirmed = False
        live.resume_ms = None
        if passing:
            self.residency.drop(sandbox_id, "hibernated")
            self.metrics.hibernations.labels("step").inc()
        return reply

    def _cut_short(self, sandbox_id: str, live: Live) -> None:
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
        async with self.residency.holding(sandbox_id):
            await self._prepare(sandbox_id, None, BaseModel)

    async def _prepare(self, sandbox_id: str, ev: EventRef | None, model: type[M],
                       may_pass: bool = False, trust: bool = False,
                       ahead: bool = False) -> tuple[Live | None, M | None]:
        """(the live copy to run a step on, None), or (None, the recorded reply of ``ev``). ``trust``:
        on what this replica saw last of the sandbox, unread (``step``). ``ahead``: on the first
        generation found after it, unconfirmed (``StateStore.newest``; ``step`` runs it again if its
        commit finds another came first)."""
        live, head, trusted, confirmed = await self._head(sandbox_id, trust, ahead)
        if trusted and head.state != "destroyed" and head.expired(time.time()) is not None:
            return await self._prepare(sandbox_id, ev, model, may_pass)  # an expiry is decided on the newest, read
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
            passing = may_pass and self.residency.passes(head)
            live = await self.generations.resume(head, spare=not passing)
            live.passing = passing
        live.trusted = trusted
        live.unconfirmed = not confirmed
        return live, None

    # ----------------------------------------------------------------------------- internals
    async def _fresh_live(self, sandbox_id: str, trust: bool = False) -> Live | None:
        """The live copy here, if it is still the newest generation (unread with ``trust``: ``step``)
        and its sandbox still runs."""
        live = self.live.get(sandbox_id)
        if live is None:
            return None
        if sandbox_id not in self.rt.sandboxes or not self.rt.sandboxes[sandbox_id].alive():
            self.residency.drop(sandbox_id, "died")
            return None
        if trust:
            return live
        newer = await self.store.read(sandbox_id, live.record.generation + 1)
        self.store.note_behind(newer is not None)
        if newer is not None:  # another replica moved it on: never run a step on this copy
            self.metrics.stale.inc()
            self.store.remember(newer)
            self.residency.drop(sandbox_id, "stale")
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
        rec = head if gen == head.generation else await self.store.read(head.sandbox_id, gen)
        if rec is None or rec.reply is None:
            raise IntegrityError(f"sandbox {head.sandbox_id}: the record holding the reply of event "
                                 f"{ev.id!r} (generation {gen}) is missing", sandbox_id=head.sandbox_id)
        self._note_replay()
        return recorded(model, rec)

    def _note_replay(self) -> None:
        if self.journal is not None:  # answered from the store: the step was recorded when it ran
            self.journal.replayed()

    async def _expire(self, head: SandboxRecord, why: str, live: Live | None = None) -> None:
        """Write the tombstone of a sandbox whose lifetime or idle limit passed (while it hibernated, or
        before the runtime's reaper ended its live copy here: then it ends now)."""
        tomb = Live(record=head)
        if live is not None:
            self.live.pop(head.sandbox_id, None)
            with contextlib.suppress(RollboxError):
                local = await self.rt.destroy(head.sandbox_id, reason=why)
                self.generations.account(live, local.cpu_s, local.peak_memory_bytes)
            tomb = live
        usage = self.generations.usage(tomb.record, why)
        with contextlib.suppress(SandboxBusy):
            await self.generations.commit(tomb, usage, None, scan=False, state="destroyed", reason=why)

    async def _reaped(self, sandbox_id: str, reason: str, usage: Usage) -> None:
        """The runtime's reaper ended a live copy for its lifetime or idle limit: record it gone."""
        live = self.live.pop(sandbox_id, None)
        if live is None:
            return
        try:
            async with self.residency.holding(sandbox_id):
                self.generations.account(live, usage.cpu_s, usage.peak_memory_bytes)
                await self.generations.commit(live, self.generations.usage(live.record, reason), None, scan=False,
                                   state="destroyed", reason=reason)
        except (RollboxError, OSError) as exc:
            log.warning("could not record that %s expired (%s): %s", sandbox_id, reason, exc)

