"""What a runtime keeps resident: warm pools of ready sandboxes, one per (snapshot, limits), and the
set of layers its zygotes and sandboxes have mounted (which the layer cache must never evict)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rollbox.runtime.execution import Sandbox
from rollbox.runtime.pool import Pool
from rollbox.runtime.snapshot import SnapshotView
from rollbox.runtime.spec import Limits

if TYPE_CHECKING:
    from rollbox.runtime.runtime import Runtime

__all__ = ["Residency"]


class Residency:
    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self.pools: dict[Any, Pool] = {}
        self._layers_in_use: frozenset[str] = frozenset()

    def pool_for(self, view: SnapshotView, limits: Limits) -> Pool:
        """The warm pool of ``view``'s sandboxes with ``limits`` (started on first use)."""
        key = (view.id, limits)
        pool = self.pools.get(key)
        if pool is None:
            rt = self.rt

            async def make() -> Sandbox:
                return await rt.restorer.restore(view, limits)

            cfg = rt.config
            pool = Pool(key, make, min_size=cfg.pool_min, max_size=cfg.pool_max, window_s=cfg.pool_window_s,
                        idle_s=cfg.pool_idle_s)
            pool.start()
            self.pools[key] = pool
        return pool

    async def prewarm(self, view: SnapshotView, count: int, timeout_s: float) -> None:
        """Keep at least ``count`` ready sandboxes of ``view`` (its default limits) in its pool."""
        pool = self.pool_for(view, view.limits)
        pool.keep_at_least(count)
        await self.rt.restorer.zygote(view)
        await pool.wait_ready(count, timeout_s)

    def sizes(self) -> dict[str, int]:
        return {str(k[0]): len(p.ready) for k, p in self.pools.items()}

    async def close(self) -> None:
        for pool in list(self.pools.values()):
            await pool.close()
        self.pools.clear()

    def layers_in_use(self) -> frozenset[str]:
        """Layer ids that a zygote or a sandbox of this runtime has mounted (or is about to): never
        evict these. Safe to call from any thread: it reads a set the event loop replaces whole."""
        return self._layers_in_use

    def before_restore(self, view: SnapshotView) -> None:
        """``view``'s layers are about to be mounted."""
        if not set(view.layers) <= self._layers_in_use:
            self.note_layers(view)

    def note_layers(self, view: SnapshotView | None = None) -> None:
        """On the event loop: recompute the layers in use (plus ``view``'s, about to be mounted)."""
        rt = self.rt
        used = {layer for z in rt.zygotes.values() for layer in z.view.layers}
        used |= {layer for sb in rt.sandboxes.values() for layer in sb.view.layers}
        used |= {layer for pool in self.pools.values() for sb in pool.ready for layer in sb.view.layers}
        if view is not None:
            used |= set(view.layers)
        self._layers_in_use = frozenset(used)
