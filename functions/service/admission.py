"""Admission control: refuse work early (429 + Retry-After) instead of queueing without bound.

Three caps: requests admitted and not yet answered (``max_queued``: waiting their turn or running),
requests running at once (``max_running``: the others wait in a FIFO queue, not started; a request
that has run ``TURN_S`` no longer counts, so programs that sleep or run long never hold the
queue), and live sandboxes. Creates and runs still in flight count as live until they return, so the cap holds
under a burst of concurrent creates. Draining (SIGTERM) refuses everything new, and hands every
request still waiting its turn back at once (503 + Retry-After: it was never started, so its retry
on another replica, or here after a restart, applies it once); only the running ones are waited for.
A full disk (the spool's, or the local store's) refuses work too: ``InsufficientStorage`` (507 +
Retry-After).
"""

from __future__ import annotations

import asyncio
import errno
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

from rollbox.functions.durable.capacity import DEFAULT_MAX_LIVE, LiveCap
from rollbox.runtime.errors import Overloaded, RollboxError, ShuttingDown

# A request that has run this long leaves its place among the --max-running to the next one waiting:
# what caps them is the CPU a burst of fresh requests (restoring, committing, short programs) shares,
# and a program that sleeps or runs for seconds (it has its own timeout) would only hold the queue.
TURN_S = 1.0
# --max-running's default: started requests per CPU the sandboxes get. A replica that starts every
# admitted request of a burst at once shares its CPUs among them all, so each one's reply waits until
# nearly all are done; taken in turn, replies come as each is done, at the same steps/s. After a scale
# from zero (2 replicas on 2 cores, ~130 requests held), with 16 at once per replica a step sent at the
# start was answered 1.80-1.85 s after it and half the wave's steps within 0.05-0.5 s; with 64 at once
# (the old default, Knative's containerConcurrency) 2.9-4.6 s and 1.1-10 s (loadtest/bench_capacity.py,
# docs/capacity.md). CPU per request is the same either way.
RUNNING_PER_CPU = 8

MiB = 1024 * 1024


@dataclass(frozen=True)
class ServiceConfig:
    """Caps and windows of one service process (every one is a ``rollbox serve`` flag)."""

    max_live: int = DEFAULT_MAX_LIVE  # the replica's LiveCap, which the durable layer asks too
    max_queued: int = 1024
    max_running: int = 0  # the rest of max_queued waits its turn, not started (handed back on drain); 0: auto
    turn_s: float = TURN_S  # a started request counts against max_running this long at most (0: to its end)
    max_body_bytes: int = 8 * MiB
    idempotency_entries: int = 100_000
    idempotency_ttl_s: float = 600.0
    idempotency_max_bytes: int = 256 * MiB
    retry_after_s: float = 1.0
    request_timeout_s: float = 15.0  # headers, and each wait for more of the body: longer is a 408
    request_deadline_s: float = 30.0  # an event's reply (429 at the latest), plus its exec timeout_s; 0: none
    compile_slots: int = 0  # language compiles run at once (/run_code, run events); 0: two per sandbox CPU


__all__ = ["Admission", "InsufficientStorage", "Rejected", "ServiceConfig", "disk_full"]


class InsufficientStorage(RollboxError):
    """A disk this server writes to is full (ENOSPC, EDQUOT): the step's row or state cannot be kept,
    so it was refused (nothing acknowledged); retry after ``retry_after_s`` (None: the error table's
    5 s), or on another replica."""

    def __init__(self, message: str, *, retry_after_s: float | None = None, **kw: str | None):
        super().__init__(message, **kw)
        self.retry_after_s = retry_after_s


def disk_full(exc: BaseException | None) -> bool:
    """Whether ``exc`` (or what caused it: a ``StoreError`` raised from an ``OSError``) is a full disk."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return False


class Rejected(RollboxError):
    """Admission refused the request; ``reason`` is a metric label: queue, live or draining.
    ``error`` is the runtime's exception it stands for (the service answers it from ERROR_TABLE)."""

    def __init__(self, reason: str, message: str, retry_after_s: float):
        super().__init__(message)
        self.reason = reason
        self.retry_after_s = retry_after_s

    @property
    def error(self) -> RollboxError:
        if self.reason == "draining":
            return ShuttingDown(self.message, retry_after_s=self.retry_after_s)
        return Overloaded(self.message, retry_after_s=self.retry_after_s)


class Admission:
    """``running()``: the sandboxes that count against ``cap`` (those running a step or being made;
    the durable layer hibernates idle ones to make room)."""

    def __init__(self, *, cap: LiveCap, max_queued: int, retry_after_s: float, running: Callable[[], int],
                 max_running: int | None = None, turn_s: float = TURN_S):
        """``max_running``: requests started at once (default ``max_queued``: every admitted one); one
        that has run ``turn_s`` leaves its place to the next."""
        if max_queued < 1:
            raise ValueError("max_queued must be >= 1")
        if max_running is not None and max_running < 1:
            raise ValueError("max_running must be >= 1")
        self.cap = cap
        self.max_queued = max_queued
        self.max_running = max_running or max_queued
        self.turn_s = turn_s  # (0: never)
        self.outlasted = 0  # requests that ran past turn_s and left their place
        self.retry_after_s = retry_after_s
        self._running = running
        self.inflight = 0  # admitted, not answered: started (``started``) or waiting their turn
        self.started = 0
        self.creating = 0
        self.draining = False
        self.handed_back = 0  # waiting requests refused by the drain
        self._turns: deque[tuple[asyncio.Future[None], bool]] = deque()  # (woken when started, ends a sandbox)
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def waiting(self) -> int:
        """Admitted requests waiting their turn (not started)."""
        return sum(1 for fut, _ in self._turns if not fut.done())

    @asynccontextmanager
    async def admit(self, *, creates_sandbox: bool, ends_sandbox: bool = False) -> AsyncIterator[None]:
        """Enter once the request may start: at once under ``max_running``, else after those ahead of
        it. ``ends_sandbox`` (destroy) is admitted while draining: it frees what draining waits for.
        Raises ``Rejected`` (the drain) while it waits: it was not started."""
        self.check_draining(ends_sandbox=ends_sandbox)
        if self.inflight >= self.max_queued:
            raise Rejected(
                "queue",
                f"too many requests in flight (cap {self.max_queued}); retry later",
                self.retry_after_s,
            )
        if creates_sandbox and not self.cap.fits(self._running() + self.creating):
            raise Rejected(
                "live",
                f"too many live sandboxes (cap {self.cap.max_live}); destroy some or retry later",
                self.retry_after_s,
            )
        self.inflight += 1
        self.creating += creates_sandbox
        self._idle.clear()
        try:
            await self._turn(ends_sandbox)
            place = [True]  # (held: given back once, by whichever comes first)
            timer = (asyncio.get_running_loop().call_later(self.turn_s, self._outlast, place)
                     if self.turn_s > 0 else None)
            try:
                yield
            finally:
                if timer is not None:
                    timer.cancel()
                self._give_back(place)
        finally:
            self.inflight -= 1
            self.creating -= creates_sandbox
            if self.inflight == 0:
                self._idle.set()

    async def _turn(self, ends_sandbox: bool) -> None:
        if self.started < self.max_running and not self._turns:
            self.started += 1
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (fut, ends_sandbox)
        self._turns.append(entry)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled() and fut.exception() is None:  # its turn came as it was cancelled
                self._done()
            raise
        finally:
            if entry in self._turns:
                self._turns.remove(entry)

    def _outlast(self, place: list[bool]) -> None:
        if place[0]:
            self.outlasted += 1
            self._give_back(place)

    def _give_back(self, place: list[bool]) -> None:
        if place[0]:
            place[0] = False
            self._done()

    @property
    def running(self) -> int:
        """Admitted requests started (those past ``turn_s`` included)."""
        return self.inflight - self.waiting

    def _done(self) -> None:
        """A started request ended: the next one waiting starts."""
        self.started -= 1
        while self._turns and self.started < self.max_running:
            fut, _ = self._turns.popleft()
            if not fut.done():
                self.started += 1
                fut.set_result(None)

    def check_draining(self, *, ends_sandbox: bool) -> None:
        """While draining, refuse all but what ends a sandbox (it frees what draining waits for). The
        one rule, asked as soon as an event's type is known (nothing is read or validated for an event
        refused anyway) and again on admission (an event that got that far as draining began)."""
        if self.draining and not ends_sandbox:
            raise Rejected("draining", "draining; only destroy events are still accepted", self.retry_after_s)

    def start_draining(self) -> int:
        """Refuse new work, and hand back at once every request still waiting its turn (but destroys):
        each gets ``Rejected("draining")``, nothing of it ran. Returns how many were handed back."""
        self.draining = True
        kept: deque[tuple[asyncio.Future[None], bool]] = deque()
        n = 0
        for fut, ends_sandbox in self._turns:
            if ends_sandbox or fut.done():
                kept.append((fut, ends_sandbox))
                continue
            fut.set_exception(Rejected(
                "draining", "draining; this request had not started (nothing of it was applied): retry it",
                self.retry_after_s))
            n += 1
        self._turns = kept
        self.handed_back += n
        return n

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until nothing admitted is in flight; False if ``timeout_s`` passed first."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return True
