"""The layer cache: a local store in front of a remote one (S3), filled lazily.

- ``ensure(layer_ids)`` makes layers present locally, pulling the missing ones. Concurrent pulls of
  one layer, from threads or from asyncio tasks (``ensure_async``), share a single download.
- Every pulled layer is verified against its sha256 while it is unpacked in a temporary directory
  and only then renamed into ``layers/``: a corrupt or truncated object is never used and leaves
  nothing behind.
- ``max_bytes`` caps the size of *pulled* layers (layers built or committed locally are the only
  copy until pushed and are never evicted). Above the cap the least recently used layers go first,
  never a pinned one (``pin``/``unpin``/``pinned``) nor one the runtime reports in use
  (``in_use(layer_id)``, e.g. the lowerdir of a live sandbox or zygote).
- Pins and in-flight downloads are per process; several processes may share one cache directory
  (renames are atomic) but only the pins of this process protect layers from its evictions.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future

from rollbox.runtime.errors import SnapshotNotFound, StoreUnavailable
from rollbox.snapshots.layers import remove_tree
from rollbox.snapshots.manifest import Manifest
from rollbox.snapshots.store import ByteCallback, Store
from rollbox.snapshots.store_local import LocalStore

log = logging.getLogger(__name__)


class LayerCache:
    def __init__(self, local: LocalStore, remote: Store | None = None, *, max_bytes: int | None = None,
                 in_use: Callable[[str], bool] | None = None,
                 on_layer: Callable[[str, int], ByteCallback | None] | None = None):
        if max_bytes is not None and max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive or None (no cap), not {max_bytes}")
        self.local = local
        self.remote = remote
        self.max_bytes = max_bytes
        self.in_use = in_use
        self.on_layer = on_layer
        self._lock = threading.Lock()
        self._inflight: dict[str, Future[None]] = {}
        self._pins: collections.Counter[str] = collections.Counter()
        self.stats: collections.Counter[str] = collections.Counter()

    # ----------------------------------------------------------------------------------- pins
    def pin(self, layer_ids: Iterable[str]) -> None:
        with self._lock:
            self._pins.update(layer_ids)

    def unpin(self, layer_ids: Iterable[str]) -> None:
        with self._lock:
            self._pins.subtract(layer_ids)
            self._pins = +self._pins

    @contextlib.contextmanager
    def pinned(self, layer_ids: Iterable[str]) -> Iterator[None]:
        ids = list(layer_ids)
        self.pin(ids)
        try:
            yield
        finally:
            self.unpin(ids)

    def _protected(self, layer_id: str) -> bool:
        return self._pins[layer_id] > 0 or layer_id in self._inflight or (
            self.in_use is not None and self.in_use(layer_id))

    # ------------------------------------------------------------------------------ manifests
    def manifest(self, name_or_id: str) -> Manifest:
        """The manifest for a name or id: an id already here is used as is (content-addressed); a
        name is asked of the remote first (names move), and of the local store when the remote is
        unreachable or does not know it."""
        if self.remote is None:
            return self.local.get_manifest(self.local.resolve_id(name_or_id))
        with contextlib.suppress(SnapshotNotFound):
            sid = self.local.resolve_id(name_or_id)
            if sid == name_or_id:
                return self.local.get_manifest(sid)
        try:
            sid = self.remote.resolve_id(name_or_id)
        except (SnapshotNotFound, StoreUnavailable) as exc:
            try:
                sid = self.local.resolve_id(name_or_id)
            except SnapshotNotFound:
                raise exc from None
            log.warning("using the cached name %r -> %s: %s", name_or_id, sid, exc.message)
            return self.local.get_manifest(sid)
        if self.local.has_manifest(sid):
            manifest = self.local.get_manifest(sid)
        else:
            manifest = self.remote.get_manifest(sid)
            self.local.put_manifest(manifest)
        if sid != name_or_id:
            self.local.set_name(name_or_id, sid)
        return manifest

    # --------------------------------------------------------------------------------- layers
    def ensure(self, layer_ids: Iterable[str], *, sizes: dict[str, int] | None = None) -> None:
        """Make every layer present locally (pulling missing ones), then evict down to the cap."""
        ids = list(dict.fromkeys(layer_ids))
        with self.pinned(ids):
            for layer_id in ids:
                self._ensure_one(layer_id, (sizes or {}).get(layer_id, 0))
                self.local.touch_layer(layer_id)
            self.evict()

    async def ensure_async(self, layer_ids: Iterable[str], *, sizes: dict[str, int] | None = None) -> None:
        await asyncio.to_thread(self.ensure, list(layer_ids), sizes=sizes)

    def _ensure_one(self, layer_id: str, size: int) -> None:
        with self._lock:
            if self.local.has_layer(layer_id):
                self.stats["hits"] += 1
                return
            fut = self._inflight.get(layer_id)
            owner = fut is None
            if fut is None:
                fut = self._inflight[layer_id] = Future()
        if not owner:
            self.stats["waits"] += 1
            fut.result()
            return
        try:
            self._pull(layer_id, size)
            fut.set_result(None)
        except BaseException as exc:
            fut.set_exception(exc)
            raise
        finally:
            with self._lock:
                del self._inflight[layer_id]

    def _pull(self, layer_id: str, size: int) -> None:
        if self.remote is None:
            raise SnapshotNotFound(f"layer {layer_id} is not in {self.local.root} and no remote store "
                                   "is configured", snapshot_id=None)
        work = self.local.tmp_dir()
        try:
            tar = os.path.join(work, "layer.tar")
            cb = self.on_layer(layer_id, size) if self.on_layer else None
            self.remote.get_layer(layer_id, tar, on_bytes=cb)
            self.local.put_layer(layer_id, tar, pulled=True)
            self.stats["pulls"] += 1
        finally:
            remove_tree(work)

    def evict(self) -> list[str]:
        """Remove least recently used pulled layers until under the cap; returns the removed ids."""
        if self.max_bytes is None:
            return []
        usage = [u for u in self.local.layer_usage() if u.pulled]
        total = sum(u.size_bytes for u in usage)
        removed: list[str] = []
        for u in usage:
            if total <= self.max_bytes:
                break
            with self._lock:
                if self._protected(u.id):
                    continue
                self.local.remove_layer(u.id)
            total -= u.size_bytes
            removed.append(u.id)
            self.stats["evictions"] += 1
        if total > self.max_bytes:
            log.warning("layer cache %s holds %d bytes of pulled layers, above its cap of %d: the rest "
                        "is in use", self.local.root, total, self.max_bytes)
        return removed
