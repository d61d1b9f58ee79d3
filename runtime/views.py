"""Snapshot views a runtime has resolved: by id (content-addressed, immutable, kept) and by name
(for a few seconds, then asked again). One store lookup per name at a time; a name seen before is
answered with its last view when the store is slow."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from rollbox.runtime.inside import proto
from rollbox.runtime.snapshot import SnapshotResolver, SnapshotView

__all__ = ["Views"]

log = logging.getLogger("rollbox.runtime")


class Views:
    def __init__(self, resolver: SnapshotResolver) -> None:
        self.resolver = resolver
        self._views: dict[str, tuple[SnapshotView, float | None]] = {}  # key -> (view, when resolved by name)
        self._resolving: dict[str, asyncio.Future[SnapshotView]] = {}  # one store lookup per name at a time

    def env_version(self, snapshot_id: str) -> dict[str, Any] | None:
        """The VERSION block of a snapshot this runtime has resolved (None if it has not)."""
        hit = self._views.get(snapshot_id)
        return dict(hit[0].version) if hit is not None else None

    async def resolve(self, snapshot: str) -> SnapshotView:
        """The snapshot's view; a resolver that may download (S3) is asked off the event loop.
        Views are cached by id (content-addressed, immutable) and by name for a few seconds."""
        now = time.monotonic()
        hit = self._views.get(snapshot)
        if hit is not None and (hit[1] is None or now - hit[1] < 5.0):
            return hit[0]
        resolve_async = getattr(self.resolver, "resolve_async", None)
        if resolve_async is None:
            return self._keep_view(snapshot, self.resolver.resolve(snapshot), now)
        task = self._resolving.get(snapshot)
        if task is None:
            task = self._resolving[snapshot] = asyncio.ensure_future(resolve_async(snapshot))
            task.add_done_callback(lambda t: self._resolved(snapshot, t, now))
        if hit is None:
            view: SnapshotView = await asyncio.shield(task)
            return view
        try:  # a name seen before: its last view serves if the store is slow to say where it points now
            return await asyncio.wait_for(asyncio.shield(task), 0.5)
        except TimeoutError:
            log.warning("the store is slow resolving %r: using its last known snapshot %s", snapshot, hit[0].id)
            return hit[0]

    def _resolved(self, snapshot: str, task: asyncio.Future[SnapshotView], asked: float) -> None:
        self._resolving.pop(snapshot, None)
        if not task.cancelled() and task.exception() is None:
            self._keep_view(snapshot, task.result(), asked)

    def _keep_view(self, snapshot: str, view: SnapshotView, now: float) -> SnapshotView:
        self._views[view.id] = (view, None)
        if snapshot != view.id:
            self._views[snapshot] = (view, now)
        return view

    def forget_names(self) -> None:
        """Resolve every name afresh (its store changed: the server attached S3 to its cache); views
        by id stay (content-addressed)."""
        self._views = {k: v for k, v in self._views.items() if v[1] is None}

    def register(self, view: SnapshotView) -> None:
        """Make a snapshot known without the resolver (a fork's scratch layer, say)."""
        self._views[view.id] = (view, None)

    def forget_fork(self, scratch: str) -> None:
        """Forget the view of a fork made over the scratch layer ``scratch`` (which is going)."""
        for view_id in [k for k in self._views if proto.is_view_of_scratch(k, scratch)]:
            del self._views[view_id]
