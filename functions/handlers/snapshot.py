"""The snapshot event family: snapshot (checkpoint a live sandbox) and fork (N sandboxes at once).

    snapshot  hold the sandbox still (``Runtime.frozen``) -> commit its overlay upper directory as a
              layer over its parent (``snapshots.checkpoint``) in the local store -> let it run again
              -> push the snapshot and its ancestors to S3 when the store is S3
    fork      of a live sandbox: ``Runtime.fork`` (its diff copied once, under every child);
              of a snapshot: ``Runtime.create`` N times, concurrently. All or nothing either way.

These handlers need the snapshot store as well as the runtime, so this module exports
``routes(snapshots)`` rather than a fixed ``ROUTES``: the server binds them to its ``Snapshots``.
Errors are the runtime's and the stores' own (``rollbox.runtime.errors``); the service maps them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import time
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any, Protocol

from rollbox.functions.contract.models import (
    SANDBOX_FORK,
    SANDBOX_SNAPSHOT,
    ForkData,
    ForkRecord,
    SandboxInfo,
    SnapshotData,
    SnapshotRecord,
)
from rollbox.functions.durable.runtime import DurableRuntime
from rollbox.functions.handlers.routing import EventRef, Route, SandboxRuntime, route
from rollbox.runtime.errors import RollboxError, SnapshotNotFound, StoreError
from rollbox.runtime.inside.proto import split_fork_view_id
from rollbox.runtime.runtime import LimitsArg
from rollbox.runtime.snapshot import ROLLBOX_VERSION, SnapshotView
from rollbox.runtime.spec import DEFAULT_LIMITS, Usage
from rollbox.snapshots.cache import LayerCache
from rollbox.snapshots.calls import StoreCalls
from rollbox.snapshots.checkpoint import checkpoint
from rollbox.snapshots.manifest import Manifest, Version, Warm
from rollbox.snapshots.resolver import BUILTIN, SLOW_LINK_BYTES_S
from rollbox.snapshots.store import copy_snapshot

__all__ = ["SnapshotRuntime", "Snapshots", "builtin_manifest", "routes"]

logger = logging.getLogger("rollbox.functions")  # the service's (service.logs formats it)


class SnapshotRuntime(Protocol):
    """What these handlers need of ``rollbox.runtime.runtime.Runtime`` itself (not the durable layer
    in front of it)."""

    layer_root: Path

    async def create(
        self, snapshot: str = ..., limits: LimitsArg = ..., metadata: dict[str, str] | None = ...
    ) -> SandboxInfo: ...

    async def destroy(self, sandbox_id: str) -> Usage: ...

    def get(self, sandbox_id: str) -> Any: ...

    def frozen(self, sandbox_id: str) -> AbstractAsyncContextManager[Any]: ...

    async def fork(
        self, sandbox_id: str, count: int, metadata: dict[str, str] | None = ...,
        sandbox_ids: list[str] | None = ...,
    ) -> list[SandboxInfo]: ...

    async def resolve(self, snapshot: str) -> SnapshotView: ...


def builtin_manifest(view: SnapshotView) -> Manifest:
    """The built-in ``python`` snapshot as a manifest (no layers, the host's Python), so that a
    sandbox restored from it can be checkpointed: its children restore from the same zygote."""
    python = str(view.version.get("python", sys.version.split()[0]))
    return Manifest(
        base="host",
        layers=(),
        warm_layers=0,
        warm=Warm(),
        env=dict(view.env),
        limits=DEFAULT_LIMITS,
        version=Version(base="host", python=python, packages={}, rollbox=ROLLBOX_VERSION),
    )


class Snapshots:
    """The runtime plus the store its snapshots live in: ``cache.local`` (where checkpoints are
    committed; its ``layers/`` is the runtime's layer root) and ``cache.remote`` (S3, or None)."""

    def __init__(self, runtime: SnapshotRuntime, cache: LayerCache, durable: DurableRuntime | None = None):
        self.rt = runtime
        self.cache = cache
        self.durable = durable  # when set, every step commits the sandbox's state (functions/durable/runtime.py)
        self.calls = StoreCalls(2, name="rollbox-push")

    @property
    def store_url(self) -> str:
        return (self.cache.remote or self.cache.local).url

    # ------------------------------------------------------------------------------ snapshot
    async def snapshot(self, data: SnapshotData) -> SnapshotRecord:
        t0 = time.perf_counter()
        view: SnapshotView = self.rt.get(data.sandbox_id).view
        base_id, scratches = split_fork_view_id(view.id)
        # the parent, and a live fork's scratch layers (immutable) as intermediate snapshots
        parent = await asyncio.to_thread(self._parent, view, base_id, scratches)
        t1 = time.perf_counter()
        async with self.rt.frozen(data.sandbox_id) as sb:
            t_frozen = time.perf_counter()
            child = await asyncio.to_thread(checkpoint, self.cache.local, parent, sb.upper_path, name=data.name,
                                            remap=sb.owner_shift)
            checkpoint_ms = (time.perf_counter() - t_frozen) * 1000
        if self.cache.remote is not None:  # the store's own pool, with a deadline: a hung store is a 503
            await self.calls.run(self._push, child, data.name, doing=f"pushing snapshot {child.id}",
                                 deadline_s=self.calls.deadline_s + child.size_bytes / SLOW_LINK_BYTES_S)
        top = child.layers[-1]
        logger.debug(
            "snapshot",
            extra={"fields": {"sandbox_id": data.sandbox_id, "snapshot_id": child.id,
                              "parent_ms": round((t1 - t0) * 1000, 3)}},
        )
        return SnapshotRecord(
            snapshot_id=child.id,
            parent_id=child.parent,
            sandbox_id=data.sandbox_id,
            name=data.name,
            layer_id=top.id,
            layer_bytes=top.size_bytes,
            size_bytes=child.size_bytes,
            env_version=child.version.model_dump(mode="json"),
            store=self.store_url,
            checkpoint_ms=round(checkpoint_ms, 3),
            total_ms=round((time.perf_counter() - t0) * 1000, 3),
        )

    def _parent(self, view: SnapshotView, base_id: str, scratches: list[str]) -> Manifest:
        # an id: the local copy the sandbox was restored from
        parent = builtin_manifest(view) if base_id == BUILTIN else self.cache.manifest(base_id)
        for scratch in scratches:
            parent = checkpoint(self.cache.local, parent, self.rt.layer_root / scratch)
        return parent

    def _push(self, child: Manifest, name: str | None) -> None:
        """Copy the snapshot and the ancestors S3 lacks (so its tree resolves there too), then the name."""
        remote = self.cache.remote
        assert remote is not None
        try:
            sid: str | None = child.id
            while sid is not None and not remote.has_manifest(sid):
                try:
                    manifest = copy_snapshot(self.cache.local, remote, sid, tmp_dir=str(self.cache.local.root / "tmp"))
                except SnapshotNotFound:
                    break  # an ancestor known only to the store it came from
                sid = manifest.parent
            if name is not None:
                remote.set_name(name, child.id)
        except StoreError as exc:
            raise type(exc)(
                f"snapshot {child.id} was committed locally but not pushed to {remote.url}: {exc.message}",
                snapshot_id=child.id, layer_id=exc.layer_id) from exc

    # ---------------------------------------------------------------------------------- fork
    async def fork(self, data: ForkData, sandbox_ids: list[str] | None = None,
                   event: EventRef | None = None) -> ForkRecord:
        """``event``: the fork's own, from which a durable fork of a snapshot derives its children's
        ids (a live fork's children get ``sandbox_ids``)."""
        t0 = time.perf_counter()
        if data.sandbox_id is not None:
            parent_view: SnapshotView = self.rt.get(data.sandbox_id).view
            infos = await self.rt.fork(data.sandbox_id, data.count, metadata=data.metadata or None,
                                       sandbox_ids=sandbox_ids)
            return ForkRecord(sandbox_id=data.sandbox_id, snapshot_id=parent_view.id, sandboxes=infos,
                              fork_ms=round((time.perf_counter() - t0) * 1000, 3))
        assert data.snapshot is not None
        view = await self.rt.resolve(data.snapshot)  # once: one 404 or one pull, not N
        overrides = data.limits.model_dump(exclude_unset=True) if data.limits is not None else None
        infos = await self._create_all(view.id, data.count, overrides, data.metadata, event)
        return ForkRecord(sandbox_id=None, snapshot_id=view.id, sandboxes=infos,
                          fork_ms=round((time.perf_counter() - t0) * 1000, 3))

    async def _create_all(self, snapshot: str, count: int, limits: dict[str, Any] | None,
                          metadata: dict[str, str], event: EventRef | None) -> list[SandboxInfo]:
        durable = self.durable  # durable: each child's state committed, its id from the event
        made_by = (durable.create(snapshot, limits, metadata, event=event) if durable is not None
                   else self.rt.create(snapshot, limits, metadata) for _ in range(count))
        results = await asyncio.gather(*made_by, return_exceptions=True)
        made = [r for r in results if isinstance(r, SandboxInfo)]
        if len(made) == count:
            return made
        for info in made:  # all or nothing (not as the fork's event: it is no destroy's)
            with contextlib.suppress(RollboxError):
                await (durable or self.rt).destroy(info.sandbox_id)
        raise next(r for r in results if isinstance(r, BaseException))


def routes(snapshots: Snapshots) -> tuple[Route, ...]:
    """The family's routes, bound to ``snapshots`` (the runtime the service passes is the same one)."""

    durable = snapshots.durable

    async def snapshot(_rt: SandboxRuntime, data: SnapshotData, event: EventRef | None = None) -> SnapshotRecord:
        if durable is None:
            return await snapshots.snapshot(data)
        return await durable.step(data.sandbox_id, lambda _live: snapshots.snapshot(data), SnapshotRecord,
                                  event=event)

    async def fork(rt: SandboxRuntime, data: ForkData, event: EventRef | None = None) -> ForkRecord:
        record = await fork_all(data, event)
        if data.include_isolation:
            return record
        return record.model_copy(update={"sandboxes": [info.brief() for info in record.sandboxes]})

    async def fork_all(data: ForkData, event: EventRef | None) -> ForkRecord:
        if durable is None or data.sandbox_id is None:
            return await snapshots.fork(data, event=event)
        parent = data.sandbox_id

        async def forking(_live: Any) -> ForkRecord:
            assert durable is not None
            record = await snapshots.fork(data, sandbox_ids=durable.fork_ids(data.count))
            await durable.adopt(record.sandboxes, forked_from=parent)
            return record

        return await durable.step(parent, forking, ForkRecord, room=data.count, event=event)

    return (
        route(SANDBOX_SNAPSHOT, snapshot),
        route(SANDBOX_FORK, fork, creates_sandbox=True),
    )
