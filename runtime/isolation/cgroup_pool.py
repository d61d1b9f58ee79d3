"""The cgroups of sandboxes, one owner: made, lent to a sandbox, taken back, kept for reuse or removed.

    pool = CgroupPool(keep=64, background=spawn)
    pool.open(backend)        # cgroups.select's backend, or None: no cgroups
    group = pool.acquire(name, memory_bytes, pids_max, cpu_cores)  # a reused empty group, or a new one
    pool.release(group)       # the sandbox ended: kept for the next once empty, else removed
    pool.drop(group)          # removed, never reused (a spawn that failed, a group that is suspect)
    pool.leftovers()          # groups of runtimes that died (the sweep removes them)
    pool.held()               # every group directory this pool holds: lent, being emptied, kept
    await pool.close()

A reused group saves a mkdir and an rmdir per sandbox; its counters are read as deltas. This is the
only code that makes, configures, reclaims or removes cgroup directories; sandboxes read theirs
(stats, pids, boost) through the ``Group`` they were lent.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import time
from collections.abc import Callable, Coroutine, Iterator
from typing import Any

from rollbox.runtime.isolation.cgroupfs import Backend, Group, has_children

__all__ = ["RELEASE_WAIT_S", "REMOVE_WAIT_S", "CgroupPool"]

log = logging.getLogger("rollbox.runtime")

# How long a released cgroup's killed processes may take to leave before it is removed rather than
# reused (a fork bomb's pid namespace tears down in seconds; past it, removal is tried and logged).
RELEASE_WAIT_S = 30.0
# How long removing a group may retry (EBUSY) while its processes, killed, finish exiting: past it the
# group is logged and left (a process stuck in the kernel). Without a child group in it, removal
# fails only while it holds processes.
REMOVE_WAIT_S = 30.0


class CgroupPool:
    """``keep``: at most this many emptied groups are kept for reuse. ``background``: runs the
    release of a group that is not empty yet (the runtime's tasks, which its close awaits)."""

    def __init__(self, *, keep: int, background: Callable[[Coroutine[Any, Any, None]], None]) -> None:
        self.backend: Backend | None = None
        self.keep = keep
        self._background = background
        self.free: list[Group] = []  # empty groups of ended sandboxes, reused: no mkdir/rmdir
        self.lent: set[Group] = set()  # in a sandbox (live, pooled or being restored)
        self.releasing: set[Group] = set()  # waiting for their last processes to leave
        self.restoring: dict[str, Group | None] = {}  # sandboxes being restored right now, with their group
        self.failures = 0  # groups that would not go (each logged)
        self.stuck: set[Group] = set()  # ... those groups, left in place
        self._told: set[str] = set()  # stuck groups' paths named in a log of the parent they keep
        self.reusing = False  # emptied groups are kept (from open until close)

    def open(self, backend: Backend | None) -> None:
        """Make groups with ``backend`` (None: sandboxes get none) and keep emptied ones for reuse."""
        self.backend = backend
        self.reusing = True

    def acquire(self, name: str, memory_bytes: int, pids_max: int, cpu_cores: float) -> Group | None:
        """A group for a new sandbox with these limits: a kept one (whose pids.peak, which is never
        reset, is below ``pids_max``: else it could not tell that this sandbox reached its limit), or a
        new one named ``name``. None without a backend. OSError: it could not be configured."""
        group = None
        while self.free:
            group = self.free.pop()
            if group.pids_peak() < pids_max:
                break
            self.drop(group)
            group = None
        if group is not None:
            try:
                group.configure(memory_bytes, pids_max, cpu_cores)
            except OSError:
                self.drop(group)
                raise
        elif self.backend:
            group = self.backend.prepare(name, memory_bytes, pids_max, cpu_cores)
        if group is not None:
            self.lent.add(group)
        return group

    @contextlib.contextmanager
    def restore(self, sandbox_id: str, group: Group | None) -> Iterator[None]:
        """While the sandbox ``sandbox_id`` is being restored (into ``group``)."""
        self.restoring[sandbox_id] = group
        try:
            yield
        finally:
            self.restoring.pop(sandbox_id, None)

    def drop(self, group: Group) -> None:
        """Remove a group rather than reuse it: a spawn that failed may still have a child on its way
        into it (it writes itself in first), and a group that could not be configured is suspect."""
        group.reusable = False
        self.release(group)

    def release(self, group: Group) -> None:
        """Keep an emptied group for the next sandbox (its counters are read as deltas), or remove it.
        One that is not empty yet (its sandbox's processes still exiting) is emptied in the background."""
        self.lent.discard(group)
        if group.reusable and group.is_empty() and self.reusing and len(self.free) < self.keep \
                and not group.needs_reclaim():
            self._keep(group)
            return
        self.releasing.add(group)
        self._background(self._release_later(group))

    def _keep(self, group: Group) -> None:
        group.boost(False)  # a reused group starts at the equal weight
        self.free.append(group)

    async def _release_later(self, group: Group) -> None:
        """Wait (up to RELEASE_WAIT_S) for a released group's last processes to leave, then keep it or
        remove it. Its sandbox has ended: whatever is still in it is killed (again) and gets the CPU
        to exit (``unthrottle``); it runs nothing of the sandbox's any more."""
        try:
            wait_s = 0.01
            deadline = time.monotonic() + RELEASE_WAIT_S
            if not group.is_empty():
                group.unthrottle()
            # the last processes of a killed sandbox may take a while to leave (a fork bomb's: seconds)
            while not group.is_empty() and time.monotonic() < deadline:
                group.kill()
                await asyncio.sleep(wait_s)
                wait_s = min(wait_s * 1.5, 0.4)  # a cgroup read each time: slower under load, not more often
            if group.reusable and group.is_empty() and self.reusing and len(self.free) < self.keep:
                if group.needs_reclaim():
                    await asyncio.to_thread(group.reclaim)
                self._keep(group)
            else:
                await self._remove(group)
        finally:
            self.releasing.discard(group)

    async def _remove(self, group: Group) -> None:
        """Remove a group for good: what is left in it is killed and its removal retried while its
        processes leave, for up to REMOVE_WAIT_S. One that will not go (a process that will not exit,
        a child group in it) is logged once, counted, and left in place (``stuck``)."""
        deadline = time.monotonic() + REMOVE_WAIT_S
        if not group.is_empty():
            group.unthrottle()
        while True:
            try:
                await asyncio.to_thread(group.close)  # (kills, then retries EBUSY for a few seconds)
                self.stuck.discard(group)
                return
            except OSError as exc:
                if exc.errno != errno.EBUSY or time.monotonic() >= deadline or has_children(group.paths()):
                    self.stuck.add(group)
                    self.failures += 1
                    log.warning("a sandbox cgroup stays behind: %s", exc.strerror or exc,
                                extra={"fields": {"cgroup": group.paths(), "errno": exc.errno}})
                    return
            await asyncio.sleep(0.1)

    def leftovers(self) -> list[str]:
        """Group directories under the backend's parent left by runtimes that died (``owners``)."""
        return self.backend.leftovers() if self.backend else []

    def held(self) -> set[str]:
        """Every group directory this pool holds: lent, restoring, being emptied, kept for reuse."""
        groups = [*self.lent, *self.restoring.values(), *self.releasing, *self.free]
        return {path for g in groups if g is not None for path in g.paths()}

    def stop_reuse(self) -> None:
        """From now on released groups are removed, not kept (the runtime is closing)."""
        self.reusing = False

    async def close(self) -> None:
        """Remove the kept groups and let go of the backend (after every release has finished): its
        parent is removed unless other runtimes' groups are in it; one that stays because a group of
        this pool could not be removed says so (the group was logged already)."""
        self.reusing = False
        for group in [*self.free, *self.lent]:  # (lent: none once every sandbox has ended)
            await self._remove(group)
        self.free.clear()
        self.lent.clear()
        if self.backend:
            stays = self.backend.close()
            ours = sorted({p for g in self.stuck for p in g.paths()} & set(stays) - self._told)
            self._told.update(ours)
            if ours:  # (once: close may be called again)
                log.warning("the sandbox cgroup parent stays behind, holding cgroups that would not go: %s",
                            " ".join(ours), extra={"fields": {"cgroup": ours}})
