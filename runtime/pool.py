"""The warm pool: ready sandboxes per hot (snapshot, limits), sized by demand, drained when idle.

Target size follows Little's law: N = Q x T_task / T_limit, where Q is the number of acquisitions in
the last window of T_limit seconds and T_task the measured time to restore one sandbox; at least the
largest burst (a fork of N at once) seen in that window; clamped to [min, max]. After ``idle_s``
without an acquisition the target falls to ``min`` (0 by default): scale-to-zero on one box.

Failures are not silent: a build that fails is counted (``build_failures``) and the first of a run
of failures is logged with its snapshot, limits and cause (then once more when builds work again);
a wait for N ready sandboxes (``Runtime.prewarm``) that times out is counted (``prewarm_shortfalls``)
and logged. ``rollbox serve`` exports both counters in /metrics, per snapshot.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any

from rollbox.runtime.execution import Sandbox

log = logging.getLogger("rollbox.runtime.pool")


class Pool:
    REFILL_DELAY_S = 0.02

    def __init__(self, key: Any, make: Callable[[], Awaitable[Sandbox]], *, min_size: int, max_size: int,
                 window_s: float, idle_s: float, build_concurrency: int = 2):
        self.key = key
        self._make = make
        self.min_size = min_size
        self.max_size = max_size
        self.window_s = window_s
        self.idle_s = idle_s
        self.ready: collections.deque[Sandbox] = collections.deque()
        self.acquired: collections.deque[float] = collections.deque()
        self.bursts: collections.deque[tuple[float, int]] = collections.deque()
        self.t_task_s = 0.010
        self.building = 0
        self.build_concurrency = build_concurrency
        self.last_acquire = 0.0
        self.hits = 0
        self.misses = 0
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._builds: set[asyncio.Task[Any]] = set()
        self.closed = False
        self.build_failures = 0  # sandboxes this pool failed to build, ever
        self.prewarm_shortfalls = 0  # waits for N ready sandboxes that timed out, ever
        self.failing = False  # the last build failed (its cause in last_error); logged once per run
        self.last_error = ""

    @property
    def snapshot_id(self) -> str:
        """The snapshot this pool's sandboxes are restored from (the runtime keys pools by
        (snapshot id, limits))."""
        return str(self.key[0] if isinstance(self.key, tuple) else self.key)

    def _context(self) -> dict[str, Any]:
        limits = self.key[1] if isinstance(self.key, tuple) and len(self.key) > 1 else None
        dump = getattr(limits, "model_dump", None)
        return {"snapshot_id": self.snapshot_id, "limits": dump() if callable(dump) else limits,
                "ready": len(self.ready), "building": self.building, "build_failures": self.build_failures}

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    def target(self, now: float | None = None) -> int:
        now = time.monotonic() if now is None else now
        while self.acquired and self.acquired[0] < now - self.window_s:
            self.acquired.popleft()
        if now - self.last_acquire > self.idle_s:
            return self.min_size
        while self.bursts and self.bursts[0][0] < now - self.window_s:
            self.bursts.popleft()
        q = len(self.acquired)
        n = math.ceil(q * self.t_task_s / self.window_s) + (1 if q else 0)
        n = max([n, *(size for _, size in self.bursts)])
        return max(self.min_size, min(self.max_size, n))

    def keep_at_least(self, n: int) -> None:
        """Keep at least ``n`` ready sandboxes from now on (prewarm)."""
        self.min_size = max(self.min_size, n)

    def note_burst(self, size: int) -> None:
        """``size`` sandboxes were asked for at once (a fork): keep that many ready while it recurs."""
        self.bursts.append((time.monotonic(), size))
        self._wake.set()

    def take(self) -> Sandbox | None:
        """A ready sandbox, or None (the caller restores one directly)."""
        now = time.monotonic()
        self.acquired.append(now)
        self.last_acquire = now
        while self.ready:
            sb = self.ready.popleft()
            # its zygote gone (crashed, killed), a ready sandbox cannot be trusted even while its init is
            # still up: it dies with the zygote a moment later (on a busy host, after it is handed out), and
            # a one-shot run's exit only that zygote can report
            if sb.alive() and (sb.source is None or sb.source.alive):
                self.hits += 1
                self._wake.set()
                return sb
            self._discard(sb)
        self.misses += 1
        self._wake.set()
        return None

    def _discard(self, sb: Sandbox) -> None:
        """A ready sandbox that died (its zygote crashed, say): release what it holds."""
        task = asyncio.get_running_loop().create_task(sb.close("died"))
        self._builds.add(task)
        task.add_done_callback(self._builds.discard)

    def observe_restore(self, seconds: float) -> None:
        self.t_task_s = 0.8 * self.t_task_s + 0.2 * seconds

    async def wait_ready(self, n: int, timeout_s: float = 30.0) -> bool:
        """Wait until ``n`` sandboxes are ready. False if ``timeout_s`` passed first: then the shortfall
        is logged (how many are ready, why builds fail if they do) and counted."""
        deadline = time.monotonic() + timeout_s
        while len(self.ready) < n and time.monotonic() < deadline:
            self._wake.set()
            await asyncio.sleep(0.002)
        if len(self.ready) >= n:
            return True
        self.prewarm_shortfalls += 1
        log.warning(f"warm pool of {self.snapshot_id} has {len(self.ready)} of the {n} ready sandboxes asked for "
                    f"after {timeout_s} s", extra={"fields": {**self._context(), "wanted": n, "timeout_s": timeout_s,
                                                             "last_error": self.last_error or None}})
        return False

    async def _build_one(self) -> None:
        try:
            t0 = time.monotonic()
            sb = await self._make()
            self.observe_restore(time.monotonic() - t0)
            if self.bursts:  # this snapshot is being forked: warm the path a fork takes (~1 ms per fork-16)
                await sb.prime()
            if self.closed:
                await sb.close("shutdown")
            else:
                self.ready.append(sb)
            if self.failing:
                self.failing = False
                log.info(f"warm pool of {self.snapshot_id} builds sandboxes again", extra={"fields": self._context()})
        except Exception as exc:
            if not self.closed:
                self.build_failures += 1
                self.last_error = f"{type(exc).__name__}: {exc}"
                if not self.failing:  # once per run of failures, not every retry
                    self.failing = True
                    log.warning(f"warm pool of {self.snapshot_id} cannot build a sandbox; retrying every 0.5 s "
                                f"while sandboxes of it are wanted: {self.last_error}",
                                exc_info=True, extra={"fields": self._context()})
            await asyncio.sleep(0.5)  # the zygote is restarting or the host is out of room: back off
        finally:
            self.building -= 1
            self._wake.set()

    async def _run(self) -> None:
        while not self.closed:
            # A burst (a fork of 16, say) is still being served: let it have the CPU, refill after.
            quiet = self.last_acquire + self.REFILL_DELAY_S - time.monotonic()
            if quiet > 0:
                await asyncio.sleep(quiet)
            for sb in [sb for sb in self.ready if not sb.alive()]:
                self.ready.remove(sb)
                self._discard(sb)
            target = self.target()
            have = len(self.ready) + self.building
            while have < target and self.building < self.build_concurrency:
                self.building += 1
                have += 1
                t = asyncio.create_task(self._build_one())
                self._builds.add(t)
                t.add_done_callback(self._builds.discard)
            # drain one at a time, asking for the target again after each close: a prewarm or a burst
            # of demand while a close is awaited raises it, and the drain stops there
            while len(self.ready) > self.target():
                sb = self.ready.pop()
                await sb.close("idle")
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), 1.0)

    async def close(self) -> None:
        """Stop refilling and destroy what the pool holds (the loop finishes its current step: a
        sandbox half-destroyed by a cancellation would leak)."""
        self.closed = True
        self._wake.set()
        if self._task:
            await self._task
        for t in list(self._builds):
            with contextlib.suppress(BaseException):
                await t
        while self.ready:
            await self.ready.pop().close("shutdown")
