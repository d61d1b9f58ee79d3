"""The warm pool: ready sandboxes per hot (snapshot, limits), sized by demand, drained when idle.

Target size follows Little's law: N = Q x T_task / T_limit, where Q is the number of acquisitions in
the last window of T_limit seconds and T_task the measured time to restore one sandbox; at least the
largest burst (a fork of N at once) seen in that window; clamped to [min, max]. After ``idle_s``
without an acquisition the target falls to ``min`` (0 by default): scale-to-zero on one box.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any

from rollbox.runtime.execution import Sandbox


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
            if sb.alive():
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

    async def wait_ready(self, n: int, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while len(self.ready) < n and time.monotonic() < deadline:
            self._wake.set()
            await asyncio.sleep(0.002)

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
        except Exception:
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
            while len(self.ready) > target:
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
