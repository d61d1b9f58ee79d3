"""The store interface every snapshot store implements, and copying snapshots between stores.

A store holds three kinds of things, all immutable except names:

- layers, by sha256 (a local store keeps them unpacked, the runtime's ``layer_root``; S3 keeps tars);
- manifests, by snapshot id (the sha256 of the manifest's canonical JSON);
- names, ``name -> snapshot id`` (the only mutable entries; the last ``set_name`` wins, ``create_name``
  names only what nobody named).

Everything read from a store is verified against its sha256 before it is used. Stores raise only
rollbox errors (``SnapshotNotFound``, ``StoreError``, ``StoreUnavailable``, ``IntegrityError``).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from typing import Protocol
from urllib.parse import urlparse

from rollbox.runtime.errors import StoreError
from rollbox.snapshots.manifest import Manifest

ByteCallback = Callable[[int], None]
"""Called with the number of bytes just transferred (drives progress bars)."""


class Store(Protocol):
    @property
    def url(self) -> str: ...

    def has_layer(self, layer_id: str) -> bool: ...

    def put_layer(self, layer_id: str, tar_path: str, *, on_bytes: ByteCallback | None = None) -> None:
        """Store the layer tar at ``tar_path`` (verified against ``layer_id``); no-op if present."""

    def get_layer(self, layer_id: str, dest_path: str, *, on_bytes: ByteCallback | None = None) -> None:
        """Write the layer's tar to ``dest_path``, verified; on failure ``dest_path`` does not exist."""

    def has_manifest(self, snapshot_id: str) -> bool: ...

    def put_manifest(self, manifest: Manifest) -> str: ...

    def get_manifest(self, snapshot_id: str) -> Manifest:
        """The manifest, verified against its id; ``SnapshotNotFound`` if absent."""

    def set_name(self, name: str, snapshot_id: str) -> None: ...

    def create_name(self, name: str, snapshot_id: str) -> str:
        """Name ``snapshot_id`` only if the name is absent (create-only); returns the id the name points
        to afterwards: ``snapshot_id``, or the one another writer named first (left as it is)."""

    def names(self) -> dict[str, str]: ...

    def resolve_id(self, name_or_id: str) -> str:
        """The snapshot id a name points to (or the id itself if stored); ``SnapshotNotFound``."""

    def list_ids(self) -> list[str]: ...

    def delete(self, snapshot_id: str) -> list[str]:
        """Remove a snapshot, the names pointing to it and layers no other snapshot uses; returns
        the removed layer ids."""


def copy_snapshot(src: Store, dst: Store, name_or_id: str, *, tmp_dir: str | None = None,
                  on_layer: Callable[[str, int], ByteCallback | None] | None = None) -> Manifest:
    """Copy a snapshot (missing layers, manifest, and the name if one was given) from ``src`` to
    ``dst``. ``push`` is local -> S3, ``pull`` is S3 -> local. Layers go through a temporary tar
    and are verified on both sides. ``on_layer(layer_id, size)`` may return a byte callback."""
    snapshot_id = src.resolve_id(name_or_id)
    manifest = src.get_manifest(snapshot_id)
    for ref in manifest.layers:
        if dst.has_layer(ref.id):
            continue
        cb = on_layer(ref.id, ref.size_bytes) if on_layer else None
        fd, tmp = tempfile.mkstemp(prefix=f"{os.getpid()}.layer-{ref.id[:12]}-", suffix=".tar", dir=tmp_dir)
        os.close(fd)
        os.unlink(tmp)
        try:
            src.get_layer(ref.id, tmp, on_bytes=cb)
            dst.put_layer(ref.id, tmp, on_bytes=cb)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    dst.put_manifest(manifest)
    if name_or_id != snapshot_id:
        dst.set_name(name_or_id, snapshot_id)
    return manifest


def parse_s3_url(url: str) -> tuple[str, str]:
    """``s3://bucket/some/prefix`` -> (bucket, "some/prefix")."""
    parsed = urlparse(url)
    if parsed.scheme != "s3" or not parsed.netloc:
        raise StoreError(f"invalid S3 store URL {url!r}: expected s3://bucket[/prefix]")
    return parsed.netloc, parsed.path.strip("/")
