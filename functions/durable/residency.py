"""Residency policy: which sandboxes are live on this replica, and when they stop being.

A live copy is a cache of a sandbox's newest generation in the store (``store``). ``Residency`` holds
them (``live``), serialises the steps on each sandbox (``holding``), and ends them without writing
anything (their state is that of their last acknowledged step):

    make room       at the live cap (``LiveCap``), the least recently used idle copies are hibernated;
                    with every live sandbox running a step, a request waits up to ``ROOM_WAIT_S``
    hibernate       a copy idle for ``hibernate_after_s`` (a loop), all idle ones on drain
    pass through    a step resuming a sandbox idle longer than a live copy lasts here runs as its
                    init and hibernates it (``passes``)
    sweep           expire hibernated sandboxes past their limits (``expire``: the API commits the
                    tombstone), remove destroyed ones' records after the tombstone TTL; a large store
                    a range per round, shared by the replicas (``sweeping``)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rollbox.functions.durable.capacity import LiveCap
from rollbox.functions.durable.metrics import DurableMetrics
from rollbox.functions.durable.store import StateStore
from rollbox.functions.durable.sweeping import CLAIMS, SHARDS, SweepPlan, stale_claims
from rollbox.runtime import tasks
from rollbox.runtime.errors import Overloaded, StoreError
from rollbox.runtime.runtime import Runtime
from rollbox.snapshots.state import FileHashes, SandboxRecord, generation_of

if TYPE_CHECKING:
    from rollbox.functions.recording.steps import StepLog

__all__ = ["PRESSURE_MEMORY_S", "ROOM_WAIT_S", "SWEEP_REST", "SWEEP_UNKNOWN_READS", "Live", "Residency"]

log = logging.getLogger("rollbox.durable")
# how long an eviction under pressure tells how long idle live copies last here (``passes``)
PRESSURE_MEMORY_S = 10.0
# at the live cap with every live sandbox running a step, a request that needs one waits this long for
# a step to end before it gets 429: steps end within moments, a retry after Retry-After takes a second
ROOM_WAIT_S = 5.0
# a sweep round lists every sandbox record in the store, or a range of them: the next round waits at least
# this many times as long as the last one took (sweeping runs at most 1/(1 + SWEEP_REST) of the time), and
# a whole pass at least the --sweep-interval-s
SWEEP_REST = 19.0
# of the sandboxes nothing is known of here, a sweep reads this many (the longest untouched first)
SWEEP_UNKNOWN_READS = 256


@dataclass
class Live:
    """A sandbox this replica holds live, and its newest committed generation."""

    record: SandboxRecord
    hashes: FileHashes = field(default_factory=dict)
    since: float = field(default_factory=time.monotonic)  # usage accounted up to here
    cpu_s: float = 0.0  # CPU seconds of this life already in ``record.usage``
    last_used: float = field(default_factory=time.monotonic)
    resume_ms: float | None = None  # set by a resume, reported by the step that caused it
    passing: bool = False  # resumed for one exec that runs as its init: it hibernates when the step ends
    trusted: bool = False  # this step runs on what was seen here last, unread (``StateStore.trusts_seen``)
    unconfirmed: bool = False  # ... or on a generation not known to be the newest (``StateStore.newest``)


class Residency:
    """The live copies of this replica and the policy that ends them: see the module docstring.
    ``expire(head, why)``: commit the tombstone of a hibernated sandbox past its limits (the API's)."""

    def __init__(self, rt: Runtime, store: StateStore, metrics: DurableMetrics, *, cap: LiveCap,
                 expire: Callable[[SandboxRecord, str], Awaitable[None]], hibernate_after_s: float = 30.0,
                 sweep_interval_s: float = 60.0, journal: StepLog | None = None):
        self.rt = rt
        self.store = store
        self.metrics = metrics
        self.cap = cap
        self._expire = expire
        self.hibernate_after_s = hibernate_after_s
        self.sweep_interval_s = sweep_interval_s
        self.journal = journal
        self.live: dict[str, Live] = {}
        self.locks: dict[str, asyncio.Lock] = {}
        self.busy: set[str] = set()
        self.evicted: tuple[float, float] | None = None  # the last eviction under pressure (make_room)
        self._room: asyncio.Future[None] | None = None  # done when a step ends: make_room waits on it
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._hibernate_loop()), asyncio.create_task(self._sweep_loop())]

    async def close(self) -> None:
        await tasks.stop(self._tasks)

    def running_count(self) -> int:
        """Sandboxes running a step or being created here: what admission's live cap limits (idle
        ones are hibernated to make room, so they do not count)."""
        return len(self.busy)

    async def hibernate_all(self, reason: str = "drain") -> int:
        """End every idle live sandbox (on SIGTERM, after in-flight events: every acknowledged step is in
        the store already, so scale-down and scale-to-zero lose nothing)."""
        sids = [sid for sid in self.live if sid not in self.busy]
        for sid in sids:
            self.hibernate(sid, reason)
        return len(sids)

    @contextlib.asynccontextmanager
    async def holding(self, sandbox_id: str) -> Any:
        lock = self.locks.setdefault(sandbox_id, asyncio.Lock())
        t0 = time.perf_counter()
        async with lock:
            if self.journal is not None:
                self.journal.queued(time.perf_counter() - t0)
            self.busy.add(sandbox_id)
            try:
                yield
            finally:
                self.busy.discard(sandbox_id)
                self.room_may_be_free()
        if not lock.locked() and not lock._waiters and sandbox_id not in self.live:
            self.locks.pop(sandbox_id, None)

    async def make_room(self, n: int = 1) -> None:
        """Room for ``n`` more live sandboxes: at the live cap, hibernate the least recently used idle
        ones instead of refusing. If every live sandbox is running a step, wait for one to end (up to
        ``ROOM_WAIT_S``, then 429)."""
        cap = self.cap.max_live
        deadline: float | None = None
        while not self.cap.fits(len(self.rt.sandboxes) + self.rt.creating, n):
            idle = [(live.last_used, sid) for sid, live in self.live.items() if not self.wanted(sid)]
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
            ewma = now - last_used if self.evicted is None else 0.8 * self.evicted[1] + 0.2 * (now - last_used)
            self.evicted = (now, ewma)  # (when, how long the evicted had been idle): see passes
            self.hibernate(sid, "pressure")

    def wanted(self, sandbox_id: str) -> bool:
        """Running a step, or a step waits for it: not to be hibernated to make room."""
        if sandbox_id in self.busy:
            return True
        lock = self.locks.get(sandbox_id)
        return lock is not None and (lock.locked() or bool(getattr(lock, "_waiters", None)))

    def room_may_be_free(self) -> None:
        """A step ended (its sandbox is idle, or gone): whoever waits for room looks again."""
        if self._room is not None and not self._room.done():
            self._room.set_result(None)

    def hibernate(self, sandbox_id: str, reason: str) -> None:
        """End an idle live copy. Nothing is written: its durable state is that of its last
        acknowledged step, committed then (what a background process wrote since was never
        acknowledged, and processes do not survive a resume anyway). The sandbox ends in the
        background, so making room costs the request that needs it nothing."""
        if sandbox_id in self.busy or sandbox_id not in self.live:
            return
        self.drop(sandbox_id, "hibernated")
        self.metrics.hibernations.labels(reason).inc()

    def drop(self, sandbox_id: str, reason: str) -> None:
        """Forget the live copy here without committing (stale, conflicted, died, hibernated): its id
        is free at once, its sandbox ends in the background."""
        self.live.pop(sandbox_id, None)
        self.rt.discard(sandbox_id, reason)

    def passes(self, head: SandboxRecord) -> bool:
        """Whether a step that resumes this sandbox passes through: runs as the resumed sandbox's init
        (one process, no worker forked) and hibernates it when it ends. So it does when the sandbox sat
        idle longer than an idle live copy lasts here — ``--hibernate-after-s``, or under pressure the
        idle time at which the least recently used ones are being hibernated: at the trainer's pace,
        it would be hibernated again before its next step, with all the work of a live copy for
        nothing. (A step after a short pause keeps its sandbox live, as before.)"""
        lasts = self.hibernate_after_s or math.inf
        if self.evicted is not None:
            at, idle_s = self.evicted
            if time.monotonic() - at < max(PRESSURE_MEMORY_S, 4 * idle_s):
                lasts = min(lasts, idle_s)
        return time.time() - head.last_used >= lasts

    async def _hibernate_loop(self) -> None:
        while True:
            await asyncio.sleep(min(1.0, (self.hibernate_after_s or 4.0) / 4))
            if not self.hibernate_after_s:
                continue
            now = time.monotonic()
            for sid, live in list(self.live.items()):
                if sid not in self.busy and now - live.last_used >= self.hibernate_after_s:
                    self.hibernate(sid, "idle")

    async def _sweep_loop(self) -> None:
        """The sweep, round after round, as ``sweeping.SweepPlan`` paces it: the whole store while its
        listing is short, else a range of it per round, claimed first (the replicas share the ranges).
        A listing costs the store and this replica CPU for every key, so the rounds of a pass take at
        least SWEEP_REST times as long as their listings took."""
        plan = SweepPlan(self.sweep_interval_s, SWEEP_REST)
        while True:
            await asyncio.sleep(plan.wait_s)
            t0 = time.monotonic()
            bounds = plan.bounds()
            listed = False
            try:
                if bounds is not None and plan.shard == 0:  # once a pass: claims no claimant will delete
                    await self.store.drop(stale_claims(await self.store.keys(CLAIMS), time.time()))
                if bounds is None or await self.store.claim(*plan.claim(time.time())):
                    listed = True
                    done = await self.sweep(bounds)
                    took = time.monotonic() - t0
                    if took >= 1.0 or done["expired"] or done["removed"] or done["unread"]:
                        where = "all" if bounds is None else f"{plan.shard + 1} of {SHARDS}"
                        log.info("swept durable state", extra={"fields": {**done, "range": where, "s": round(took, 3)}})
            except (StoreError, OSError) as exc:
                log.warning("sweeping durable state failed: %s", exc)
            plan.done(time.monotonic() - t0, listed)

    async def sweep(self, bounds: tuple[str | None, str | None] | None = None) -> dict[str, int]:
        """Expire hibernated sandboxes past their limits; remove destroyed ones' records after the
        tombstone TTL (a redelivered event finds its reply until then). The store is listed (a page at a
        time) with each record's write time, all of it or the keys within ``bounds`` (after, before;
        ``sweeping.key_range``); a sandbox's newest record is read only when it may be due:
        when the record seen here, or the sandbox's limits seen here counted from the newest record's
        write time, say so. Sandboxes nothing is known of here (a replica that just started) are read
        oldest first, at most ``SWEEP_UNKNOWN_READS`` per whole sweep, and 1/SHARDS of that per range (the
        later ones at later sweeps; a step on one reads it anyway)."""
        by_sid: dict[str, dict[int, str]] = {}
        written: dict[str, float] = {}  # sandbox -> its newest record's write time
        after, before = bounds or (None, None)
        async for page in self.store.listing("sandboxes/", after, before):
            for k, mtime in page:
                if (g := generation_of(k)) is not None:
                    sid = k.split("/")[1]
                    gens = by_sid.setdefault(sid, {})
                    gens[g] = k
                    if g >= max(gens):
                        written[sid] = mtime
        expired = removed = 0
        now = time.time()
        unknown: list[tuple[float, str]] = []
        for i, (sid, gens) in enumerate(by_sid.items()):
            if i % 1000 == 999:
                await asyncio.sleep(0)  # (the loop serves steps between every 1,000 sandboxes looked at)
            if sid in self.live or sid in self.busy:
                continue
            due = self.store.due_at(sid, max(gens), written[sid])
            if due is None:
                unknown.append((written[sid], sid))
            elif now >= due:
                e, r = await self._sweep_one(sid, gens, now)
                expired, removed = expired + e, removed + r
        unknown.sort()
        budget = SWEEP_UNKNOWN_READS if bounds is None else max(1, SWEEP_UNKNOWN_READS // SHARDS)
        for _, sid in unknown[:budget]:
            if sid in self.live or sid in self.busy:
                continue
            e, r = await self._sweep_one(sid, by_sid[sid], now)
            expired, removed = expired + e, removed + r
        unread = max(0, len(unknown) - budget)
        return {"sandboxes": len(by_sid), "expired": expired, "removed": removed, "unread": unread}

    async def _sweep_one(self, sid: str, gens: dict[int, str], now: float) -> tuple[int, int]:
        """Read a sandbox's newest record; expire it or remove its records if due. (expired, removed)."""
        head = await self.store.read(sid, max(gens))
        if head is None:
            return 0, 0
        self.store.note_due(head)  # (not remember: a sweep must not push resumed sandboxes out of seen)
        if head.state == "destroyed":
            if now - head.last_used > self.store.tombstone_ttl_s:
                await self.store.io(self.store.objects.delete, list(gens.values()))
                self.store.forget(sid)
                return 0, 1
        elif (why := head.expired(now)) is not None:
            async with self.holding(sid):
                await self._expire(head, why)
            return 1, 0
        return 0, 0

