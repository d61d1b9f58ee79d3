"""Lifetimes: a runtime's reaper ends sandboxes past their lifetime or idle limit, or whose init
died, and sweeps what runtimes that died left behind (``owners``: cgroups, zygote staging
directories, fork scratch layers)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING

from rollbox.runtime import owners, tasks
from rollbox.runtime.execution import SandboxState
from rollbox.runtime.inside import proto

if TYPE_CHECKING:
    from rollbox.runtime.runtime import Runtime

__all__ = ["Reaper"]

log = logging.getLogger("rollbox.runtime")


class Reaper:
    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self.sweeper = owners.Sweep()  # leftovers of runtimes that died (cgroups, staging dirs, scratch layers)
        self._leftovers = 0
        self._swept = 0.0
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Sweep once, then reap every ``reaper_interval_s``."""
        self._leftovers = await asyncio.to_thread(self.sweep)
        self._swept = time.monotonic()
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task:
            await tasks.stop([self._task])

    def sweep(self) -> int:
        """Remove what runtimes that died left behind (``owners``: found by who made them, not by a
        pid that may be a zombie or reused): sandbox cgroups (processes still in one are killed, the
        cgroup goes on a later sweep), zygote staging directories and fork scratch layers. Returns
        how many remain; the reaper sweeps again until none do (and every 30 s anyway)."""
        rt = self.rt
        cgroups = rt.cgroups.leftovers()
        staging = rt.config.state_dir / "zygotes"
        dirs = list(staging.iterdir()) if staging.is_dir() else []
        trees = list(rt.layer_root.glob(proto.SCRATCH_PREFIX + "*"))
        return self.sweeper.run(cgroups, dirs, trees)

    async def _loop(self) -> None:
        rt = self.rt
        while True:
            await asyncio.sleep(rt.config.reaper_interval_s)
            rt.residency.note_layers()
            now = time.monotonic()
            # what dead runtimes left: again soon while some of it stays, at once when a runtime whose
            # things the last sweep left alone has died since, else every 30 s
            if now - self._swept >= (1.0 if self._leftovers else 30.0) or self.sweeper.owner_died():
                self._swept = now
                try:
                    self._leftovers = await asyncio.to_thread(self.sweep)
                except Exception:
                    log.exception("sweeping leftovers failed")
            for sid, sb in list(rt.sandboxes.items()):
                reason = None
                if now - sb.created_at > sb.limits.lifetime_s:
                    reason = "lifetime"
                elif not sb.busy and now - sb.last_used > sb.limits.idle_s:
                    reason = "idle"
                elif sb.state is SandboxState.DIED and not sb.busy:
                    reason = "died"
                if reason and rt.sandboxes.get(sid) is sb:  # (not a copy resumed under its id meanwhile)
                    with contextlib.suppress(Exception):
                        usage = await rt.destroy(sid, reason=reason)
                        if rt.on_reaped is not None and reason in ("lifetime", "idle"):
                            await rt.on_reaped(sid, reason, usage)
