"""The runtime's ``SnapshotResolver`` over a store: name or id -> ``SnapshotView``, pulling lazily.

Layers are made present in the local store (pulled from the remote through the cache when one is
configured) before the view is returned; the view's ``layer_root`` is the local store's
``layers/``. Snapshots built on the host (``base: host``) get the host's read-only binds and masks
computed here, on the restoring machine, and are refused when this host's Python differs from the
one their packages were built for. An unknown ``python`` falls back to the runtime's built-in view.

The runtime asks ``resolve_async``: the store calls run on the resolver's own ``StoreCalls`` pool
with deadlines (the manifest: a few seconds; the layers: that plus their size at a slow link's
speed). When the store does not answer in time, a snapshot this host already holds (its name's
last known id, its manifest and every layer in the local store) is used as it is, and the built-in
``python`` falls back to the host's; anything else is 503 ``store_unavailable``.
"""

from __future__ import annotations

import asyncio
import logging
import sys

from rollbox.runtime.errors import InvalidRequest, SnapshotNotFound, StoreError, StoreUnavailable
from rollbox.runtime.snapshot import SnapshotView, WarmRecipe, host_python_view
from rollbox.snapshots.cache import LayerCache
from rollbox.snapshots.calls import StoreCalls
from rollbox.snapshots.manifest import Manifest
from rollbox.snapshots.store_local import LocalStore

BUILTIN = "python"
log = logging.getLogger(__name__)


MiB = 1024 * 1024
SLOW_LINK_BYTES_S = 8 * MiB  # a layer download's deadline counts its size at this speed


class StoreResolver:
    def __init__(self, store: LayerCache | LocalStore, calls: StoreCalls | None = None):
        self.cache = store if isinstance(store, LayerCache) else LayerCache(store)
        self.calls = calls or StoreCalls(name="rollbox-resolve")

    @property
    def layer_root(self) -> str:
        return self.cache.local.layer_root

    def resolve(self, name_or_id: str) -> SnapshotView:
        try:
            manifest = self.cache.manifest(name_or_id)
        except (SnapshotNotFound, StoreUnavailable) as exc:
            if name_or_id == BUILTIN:  # not in the store, or the store is down: the built-in one
                if isinstance(exc, StoreUnavailable):
                    log.warning("using the built-in %r snapshot: %s", BUILTIN, exc.message)
                return host_python_view(self.layer_root)
            raise
        self.cache.ensure([ref.id for ref in manifest.layers],
                          sizes={ref.id: ref.size_bytes for ref in manifest.layers})
        return view_of(manifest, self.layer_root)

    async def resolve_async(self, name_or_id: str) -> SnapshotView:
        calls = self.calls
        try:
            manifest = await calls.run(self.cache.manifest, name_or_id,
                                       doing=f"resolving snapshot {name_or_id!r}")
        except (SnapshotNotFound, StoreUnavailable) as exc:
            if isinstance(exc, StoreUnavailable):
                held = await asyncio.to_thread(self._held, name_or_id)
                if held is not None:
                    log.warning("using snapshot %r as held here (%s): %s", name_or_id, held.id, exc.message)
                    return held
            if name_or_id == BUILTIN:
                if isinstance(exc, StoreUnavailable):
                    log.warning("using the built-in %r snapshot: %s", BUILTIN, exc.message)
                return host_python_view(self.layer_root)
            raise
        sizes = {ref.id: ref.size_bytes for ref in manifest.layers}
        missing = [i for i in sizes if not self.cache.local.has_layer(i)]
        if missing:
            deadline = calls.deadline_s + sum(sizes[i] for i in missing) / SLOW_LINK_BYTES_S
            await calls.run(lambda: self.cache.ensure(list(sizes), sizes=sizes),
                            doing=f"pulling the layers of {manifest.id}", deadline_s=deadline)
        else:
            await asyncio.to_thread(self.cache.ensure, list(sizes), sizes=sizes)  # local only: touch, evict
        return view_of(manifest, self.layer_root)

    def _held(self, name_or_id: str) -> SnapshotView | None:
        """The snapshot as this host holds it, if it holds all of it (the store did not answer)."""
        local = self.cache.local
        try:
            manifest = local.get_manifest(local.resolve_id(name_or_id))
        except (SnapshotNotFound, StoreError):
            return None
        if not all(local.has_layer(ref.id) for ref in manifest.layers):
            return None
        return view_of(manifest, self.layer_root)


def view_of(manifest: Manifest, layer_root: str) -> SnapshotView:
    """The runtime's view of a manifest whose layers are under ``layer_root``."""
    sid = manifest.id
    binds: tuple[str, ...] = ()
    masks: tuple[str, ...] = ()
    python = manifest.warm.python
    if manifest.base == "host":
        here = sys.version.split()[0]
        if here.rsplit(".", 1)[0] != manifest.version.python.rsplit(".", 1)[0]:
            raise InvalidRequest(
                f"snapshot {sid} was built on a host with Python {manifest.version.python}; this "
                f"host runs Python {here}: rebuild it here", snapshot_id=sid)
        host = host_python_view(layer_root)
        binds, masks, python = host.host_binds, host.host_masks, host.warm.python
    if python is None:
        raise InvalidRequest(f"snapshot {sid} is not host-based and has no warm.python", snapshot_id=sid)
    return SnapshotView(
        id=sid,
        layer_root=layer_root,
        layers=tuple(ref.id for ref in reversed(manifest.layers)),
        warm=WarmRecipe(python=python, sys_path=manifest.warm.sys_path, imports=manifest.warm.imports),
        host_binds=binds,
        host_masks=masks,
        warm_layers=manifest.warm_layers,
        env=dict(manifest.env),
        version=manifest.version.model_dump(mode="json"),
        limits=manifest.limits,
    )
