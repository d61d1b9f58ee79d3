"""The local directory store: the embedded default, and the cache in front of S3.

Layout under ``root`` (default ``$ROLLBOX_HOME``, else ``/var/lib/rollbox`` as root, else
``~/.local/share/rollbox``)::

    layers/<layer id>/          unpacked layers: the runtime's layer_root
    layers-meta/<layer id>.json size, origin; its mtime is the layer's last use (LRU)
    blobs/<layer id>.tar        the canonical tar, kept only where unpacking could not restore
                                owners (not root), so the layer can be pushed byte-identical
    manifests/<snapshot id>.json
    names/<name>                a snapshot id
    tmp/                        downloads and unpacks in progress (renamed into place when verified)

Every entry appears by an atomic rename, so a crash or a failed verification leaves nothing
half-written where the runtime looks.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rollbox.runtime.errors import IntegrityError, RollboxError, SnapshotNotFound, StoreError
from rollbox.runtime.runtime import default_home
from rollbox.snapshots.layers import check_layer_id, default_opaque_xattr, pack_to_file, remove_tree, unpack
from rollbox.snapshots.manifest import LayerRef, Manifest, check_name, check_snapshot_id
from rollbox.snapshots.store import ByteCallback


@dataclass(frozen=True)
class LayerUsage:
    id: str
    size_bytes: int
    last_used: float
    pulled: bool


class LocalStore:
    """A snapshot store in a local directory (see the module docstring for the layout)."""

    def __init__(self, root: str | os.PathLike[str] | None = None, *, opaque_xattr: str | None = None):
        self.root = Path(root) if root is not None else default_home()
        self.opaque_xattr = opaque_xattr or default_opaque_xattr()
        self.keep_blobs = os.geteuid() != 0
        for sub in ("layers", "layers-meta", "blobs", "manifests", "names", "tmp"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        self._clean_tmp()

    @property
    def url(self) -> str:
        return str(self.root)

    @property
    def layer_root(self) -> str:
        return str(self.root / "layers")

    def __repr__(self) -> str:
        return f"LocalStore({str(self.root)!r})"

    # ----------------------------------------------------------------------------------- tmp
    def _clean_tmp(self) -> None:
        """Remove leftovers of processes that died mid-download (entries are named ``<pid>.*``)."""
        for entry in (self.root / "tmp").iterdir():
            pid = entry.name.split(".", 1)[0]
            if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
                try:
                    remove_tree(entry)
                except PermissionError:  # rootless: a Debian build killed half way left files of its
                    if os.geteuid() == 0:  # subordinate owners, removable in its namespace only
                        raise
                    from rollbox.snapshots import userns

                    with contextlib.suppress(RollboxError):
                        userns.remove(str(entry))

    def tmp_dir(self) -> str:
        return tempfile.mkdtemp(prefix=f"{os.getpid()}.", dir=self.root / "tmp")

    # -------------------------------------------------------------------------------- layers
    def layer_path(self, layer_id: str) -> Path:
        return self.root / "layers" / check_layer_id(layer_id)

    def has_layer(self, layer_id: str) -> bool:
        return self.layer_path(layer_id).is_dir()

    def put_layer(self, layer_id: str, tar_path: str, *, on_bytes: ByteCallback | None = None,
                  pulled: bool = False) -> None:
        """Unpack and verify a layer tar, then rename it into ``layers/`` (no-op if present)."""
        final = self.layer_path(layer_id)
        if final.is_dir():
            return
        work = self.tmp_dir()
        try:
            staged = os.path.join(work, "layer")
            with open(tar_path, "rb") as src:
                packed = unpack(src, staged, expected_id=layer_id, opaque_xattr=self.opaque_xattr)
            if self.keep_blobs:
                blob = self.root / "blobs" / f"{layer_id}.tar"
                shutil.copyfile(tar_path, os.path.join(work, "blob"))
                os.replace(os.path.join(work, "blob"), blob)
            self._write_meta(layer_id, {"size_bytes": packed.size_bytes, "pulled": pulled})
            try:
                os.rename(staged, final)
            except OSError:
                if not final.is_dir():  # lost a race to another process: theirs is as good as ours
                    raise
        except OSError as exc:
            raise StoreError(f"cannot store layer {layer_id} in {self.root}: {exc}",
                             layer_id=layer_id) from exc
        finally:
            remove_tree(work)

    def add_layer_dir(self, src: str | os.PathLike[str], *, owner: tuple[int, int] | None = (0, 0),
                      remap: tuple[int, int] | None = None) -> LayerRef:
        """Commit a directory as a layer (packed, then unpacked here verified); returns its ref.
        ``owner`` forces every entry's owner (built layers) or keeps them (``None``, checkpoints);
        ``remap``: see ``layers.pack``."""
        work = self.tmp_dir()
        try:
            tar = os.path.join(work, "layer.tar")
            packed = pack_to_file(src, tar, owner=owner, remap=remap)
            self.put_layer(packed.id, tar)
        finally:
            remove_tree(work)
        return LayerRef(id=packed.id, size_bytes=packed.size_bytes)

    def get_layer(self, layer_id: str, dest_path: str, *, on_bytes: ByteCallback | None = None) -> None:
        """Write the layer's canonical tar (re-packed, and checked to still hash to its id)."""
        src = self.layer_path(layer_id)
        blob = self.root / "blobs" / f"{layer_id}.tar"
        if not src.is_dir():
            raise StoreError(f"layer {layer_id} is not in {self.root}", layer_id=layer_id)
        try:
            if blob.is_file():
                shutil.copyfile(blob, dest_path)
                return
            packed = pack_to_file(src, dest_path)
        except OSError as exc:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(dest_path)
            raise StoreError(f"cannot read layer {layer_id} from {self.root}: {exc}",
                             layer_id=layer_id) from exc
        if packed.id != layer_id:
            os.unlink(dest_path)
            raise IntegrityError(
                f"layer {layer_id} in {src} was modified on disk (it now hashes to {packed.id}); "
                "remove it and pull or build it again", layer_id=layer_id)

    def remove_layer(self, layer_id: str) -> None:
        """Remove a layer atomically (renamed out of ``layers/`` first, then deleted)."""
        path = self.layer_path(layer_id)
        if path.is_dir():
            gone = os.path.join(self.tmp_dir(), "gone")
            os.rename(path, gone)
            remove_tree(os.path.dirname(gone))
        meta, blob = self.root / "layers-meta" / f"{layer_id}.json", self.root / "blobs" / f"{layer_id}.tar"
        for extra in (meta, blob):
            with contextlib.suppress(FileNotFoundError):
                extra.unlink()

    def _write_meta(self, layer_id: str, meta: dict[str, object]) -> None:
        _atomic_write(self.root / "layers-meta" / f"{layer_id}.json", json.dumps(meta).encode())

    def touch_layer(self, layer_id: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.utime(self.root / "layers-meta" / f"{layer_id}.json")

    def layer_usage(self) -> list[LayerUsage]:
        """Every stored layer with its size and last use, least recently used first."""
        out = []
        for entry in (self.root / "layers").iterdir():
            meta_path = self.root / "layers-meta" / f"{entry.name}.json"
            try:
                meta = json.loads(meta_path.read_bytes())
                st = meta_path.stat()
            except (FileNotFoundError, ValueError):
                meta, st = {"size_bytes": 0, "pulled": False}, entry.stat()
            out.append(LayerUsage(entry.name, int(meta.get("size_bytes", 0)), st.st_mtime,
                                  bool(meta.get("pulled", False))))
        out.sort(key=lambda u: u.last_used)
        return out

    # ----------------------------------------------------------------------------- manifests
    def has_manifest(self, snapshot_id: str) -> bool:
        return (self.root / "manifests" / f"{check_snapshot_id(snapshot_id)}.json").is_file()

    def put_manifest(self, manifest: Manifest) -> str:
        sid = manifest.id
        path = self.root / "manifests" / f"{sid}.json"
        if not path.is_file():
            _atomic_write(path, manifest.canonical_json())
        return sid

    def get_manifest(self, snapshot_id: str) -> Manifest:
        path = self.root / "manifests" / f"{check_snapshot_id(snapshot_id)}.json"
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise SnapshotNotFound(f"no snapshot {snapshot_id} in {self.root}",
                                   snapshot_id=snapshot_id) from None
        return Manifest.from_bytes(data, expected_id=snapshot_id)

    def list_ids(self) -> list[str]:
        return sorted(p.stem for p in (self.root / "manifests").glob("*.json"))

    # --------------------------------------------------------------------------------- names
    def set_name(self, name: str, snapshot_id: str) -> None:
        try:
            check_name(name)
        except ValueError as exc:
            raise StoreError(str(exc), snapshot_id=snapshot_id) from None
        _atomic_write(self.root / "names" / name, check_snapshot_id(snapshot_id).encode())

    def create_name(self, name: str, snapshot_id: str) -> str:
        try:
            check_name(name)
        except ValueError as exc:
            raise StoreError(str(exc), snapshot_id=snapshot_id) from None
        path = self.root / "names" / name
        tmp = path.with_name(f".{name}.{os.getpid()}.{time.monotonic_ns()}")
        _atomic_write(tmp, check_snapshot_id(snapshot_id).encode())
        try:
            os.link(tmp, path)  # (fails if the name exists)
        except FileExistsError:
            return path.read_text().strip()
        finally:
            tmp.unlink()
        return snapshot_id

    def names(self) -> dict[str, str]:
        """Every name and its id. A name never starts with ``.``; those are another writer's temp
        files, and a name removed while listing is skipped."""
        out = {}
        for p in sorted((self.root / "names").iterdir()):
            if p.name.startswith("."):
                continue
            with contextlib.suppress(FileNotFoundError):
                out[p.name] = p.read_text().strip()
        return out

    def resolve_id(self, name_or_id: str) -> str:
        if self._is_id(name_or_id) and self.has_manifest(name_or_id):
            return name_or_id
        path = self.root / "names" / name_or_id
        if "/" not in name_or_id and name_or_id not in ("", ".", "..") and path.is_file():
            return path.read_text().strip()
        known = ", ".join(sorted(self.names())) or "none"
        raise SnapshotNotFound(f"no snapshot named {name_or_id!r} in {self.root}; names here: {known}",
                               snapshot_id=name_or_id)

    @staticmethod
    def _is_id(s: str) -> bool:
        try:
            check_snapshot_id(s)
        except IntegrityError:
            return False
        return True

    # -------------------------------------------------------------------------------- delete
    def delete(self, snapshot_id: str, *, in_use: Callable[[str], bool] | None = None) -> list[str]:
        manifest = self.get_manifest(snapshot_id)
        for name, sid in self.names().items():
            if sid == snapshot_id:
                (self.root / "names" / name).unlink()
        (self.root / "manifests" / f"{snapshot_id}.json").unlink()
        still_used = {ref.id for sid in self.list_ids() for ref in self.get_manifest(sid).layers}
        removed = []
        for ref in manifest.layers:
            if ref.id in still_used or (in_use is not None and in_use(ref.id)):
                continue
            self.remove_layer(ref.id)
            removed.append(ref.id)
        return removed


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{time.monotonic_ns()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
