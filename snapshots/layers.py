"""Layers: a directory tree <-> a deterministic tar, named by the tar's sha256.

A layer is a plain directory the runtime stacks as an overlayfs lower layer, so besides files,
directories, symlinks, hardlinks and fifos it may hold overlay *whiteouts* (a char device 0/0 hides
the same path below) and *opaque* directories (xattr ``trusted.overlay.opaque`` or
``user.overlay.opaque`` = ``y`` hides everything below the directory).

The canonical tar (the layer's identity) is:

- PAX format; entries in pre-order, children sorted bytewise; the layer root itself is not stored;
- mtime 0, no user or group names, permission bits ``mode & 0o7777``, numeric uid/gid kept as found
  or forced to one owner (``owner=(0, 0)`` for built layers);
- a hardlinked file stored once, later names as links to the first name in that order;
- a whiteout as a char device 0/0; an opaque directory as the pax record
  ``SCHILY.xattr.trusted.overlay.opaque=y`` whichever xattr namespace the source used;
- sockets are skipped; any other device node is refused.

So the id of a layer does not depend on when, where or by whom it was written. ``unpack`` verifies
the id while it extracts and never follows a symlink it did not create as a leaf: absolute member
names, ``..`` components, entries through a symlink, hardlinks outside the layer and relative
symlinks that climb out of the layer are refused (absolute symlink targets are allowed: the runtime
resolves them inside the sandbox root). Opaque directories are marked with the xattr the runtime's
overlay mount reads: ``trusted.overlay.opaque`` as root, ``user.overlay.opaque`` for a rootless
mount with ``userxattr``.
"""

from __future__ import annotations

import errno
import hashlib
import os
import posixpath
import re
import shutil
import stat
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import BinaryIO, Protocol

from rollbox.runtime.errors import IntegrityError, StoreError

LAYER_ID_RE = re.compile(r"^[0-9a-f]{64}$")
OPAQUE_XATTRS = ("trusted.overlay.opaque", "user.overlay.opaque")
_PAX_OPAQUE = "SCHILY.xattr.trusted.overlay.opaque"
_CHUNK = 1024 * 1024


def default_opaque_xattr() -> str:
    """The xattr an overlay mount made by this process reads: trusted.* as root, user.* rootless."""
    return OPAQUE_XATTRS[0] if os.geteuid() == 0 else OPAQUE_XATTRS[1]


def check_layer_id(layer_id: str) -> str:
    """A layer id is 64 lowercase hex digits (it is also a directory name, so nothing else passes)."""
    if not LAYER_ID_RE.match(layer_id):
        raise IntegrityError(f"invalid layer id {layer_id!r}: expected 64 lowercase hex digits")
    return layer_id


class Readable(Protocol):
    def read(self, n: int = -1, /) -> bytes: ...


@dataclass(frozen=True)
class PackedLayer:
    id: str
    size_bytes: int


class _HashSink:
    """A write-only file object that hashes what passes through, optionally teeing it to a file."""

    def __init__(self, out: BinaryIO | None):
        self.out = out
        self.sha = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes) -> int:
        self.sha.update(data)
        self.size += len(data)
        if self.out is not None:
            self.out.write(data)
        return len(data)


class _HashSource:
    """A read-only file object that hashes everything read from it."""

    def __init__(self, src: Readable):
        self.src = src
        self.sha = hashlib.sha256()
        self.size = 0

    def read(self, n: int = -1) -> bytes:
        data = self.src.read(n)
        self.sha.update(data)
        self.size += len(data)
        return data

    def drain(self) -> None:
        while self.read(_CHUNK):
            pass


def _xattr(path: str, attr: str) -> bytes | None:
    try:
        return os.getxattr(path, attr, follow_symlinks=False)
    except OSError as exc:
        if exc.errno not in (errno.ENODATA, errno.ENOTSUP, errno.EPERM, errno.EACCES):
            raise
    return None


def _is_opaque(path: str) -> bool:
    return any(_xattr(path, attr) == b"y" for attr in OPAQUE_XATTRS)


def _refuse_overlay_features(path: str, kind: str) -> None:
    """An upper dir written with redirect_dir or metacopy holds entries whose content lives in the
    lower layers; packed alone they would be wrong, so refuse them."""
    for ns in ("trusted", "user"):
        if _xattr(path, f"{ns}.overlay.{kind}") is not None:
            raise StoreError(f"cannot pack {path!r}: it carries {ns}.overlay.{kind} (an overlay mounted "
                             f"with {'redirect_dir' if kind == 'redirect' else 'metacopy'}=on); mount "
                             "sandboxes with redirect_dir=off,metacopy=off to checkpoint them")


def _walk(root: str, rel: str = "") -> Iterator[tuple[str, str]]:
    """(relative name, absolute path) in pre-order, children sorted bytewise."""
    for raw in sorted(os.listdir(os.fsencode(os.path.join(root, rel) if rel else root))):
        name = os.fsdecode(raw)
        crel = f"{rel}/{name}" if rel else name
        cabs = os.path.join(root, crel)
        yield crel, cabs
        if stat.S_ISDIR(os.lstat(cabs).st_mode):
            yield from _walk(root, crel)


def pack(src: str | os.PathLike[str], out: BinaryIO | None = None, *,
         owner: tuple[int, int] | None = None, remap: tuple[int, int] | None = None) -> PackedLayer:
    """Write the canonical tar of directory ``src`` to ``out`` (or only hash it); return id and size.
    ``remap`` (from, to): an owner uid or gid ``from`` is written as ``to`` (a sandbox's upper directory,
    whose files its host uid owns, packed as the sandbox user's)."""
    root = os.fspath(src)
    if not os.path.isdir(root):
        raise StoreError(f"cannot pack {root!r}: not a directory")
    sink = _HashSink(out)
    links: dict[tuple[int, int], str] = {}
    with tarfile.open(fileobj=sink, mode="w|", format=tarfile.PAX_FORMAT) as tar:  # type: ignore[call-overload]
        for rel, path in _walk(root):
            st = os.lstat(path)
            info = tarfile.TarInfo(rel)
            info.mtime = 0
            info.mode = stat.S_IMODE(st.st_mode)
            info.uid, info.gid = owner if owner is not None else (st.st_uid, st.st_gid)
            if remap is not None:
                info.uid = remap[1] if info.uid == remap[0] else info.uid
                info.gid = remap[1] if info.gid == remap[0] else info.gid
            info.uname = info.gname = ""
            fmt = stat.S_IFMT(st.st_mode)
            if fmt == stat.S_IFDIR:
                info.type = tarfile.DIRTYPE
                _refuse_overlay_features(path, "redirect")
                if _is_opaque(path):
                    info.pax_headers = {_PAX_OPAQUE: "y"}
                tar.addfile(info)
            elif fmt == stat.S_IFREG:
                key = (st.st_dev, st.st_ino)
                if st.st_nlink > 1 and key in links:
                    info.type = tarfile.LNKTYPE
                    info.linkname = links[key]
                    tar.addfile(info)
                    continue
                links[key] = rel
                _refuse_overlay_features(path, "metacopy")
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
                with os.fdopen(fd, "rb") as f:
                    info.size = os.fstat(fd).st_size
                    tar.addfile(info, _Exact(f, info.size, path))
            elif fmt == stat.S_IFLNK:
                info.type = tarfile.SYMTYPE
                info.linkname = os.readlink(path)
                tar.addfile(info)
            elif fmt == stat.S_IFCHR and st.st_rdev == 0:
                info.type = tarfile.CHRTYPE
                info.devmajor = info.devminor = 0
                tar.addfile(info)
            elif fmt == stat.S_IFIFO:
                info.type = tarfile.FIFOTYPE
                tar.addfile(info)
            elif fmt == stat.S_IFSOCK:
                continue
            else:
                raise StoreError(f"cannot pack {path!r}: device nodes other than whiteouts (0/0) "
                                 "do not belong in a layer")
    return PackedLayer(id=sink.sha.hexdigest(), size_bytes=sink.size)


class _Exact:
    """Reads exactly ``size`` bytes of a file, failing if it shrank while being packed."""

    def __init__(self, f: BinaryIO, size: int, path: str):
        self.f, self.left, self.path = f, size, path

    def read(self, n: int = -1) -> bytes:
        n = self.left if n < 0 else min(n, self.left)
        data = self.f.read(n)
        if len(data) < n:
            raise StoreError(f"cannot pack {self.path!r}: file changed size while being read")
        self.left -= len(data)
        return data


def pack_to_file(src: str | os.PathLike[str], dest: str | os.PathLike[str], *,
                 owner: tuple[int, int] | None = None, remap: tuple[int, int] | None = None) -> PackedLayer:
    with open(dest, "wb") as out:
        return pack(src, out, owner=owner, remap=remap)


def layer_id(src: str | os.PathLike[str], *, owner: tuple[int, int] | None = None) -> str:
    """The id ``src`` would have as a layer (hashes the canonical tar without writing it)."""
    return pack(src, None, owner=owner).id


# --------------------------------------------------------------------------------------- unpack


def _member_parts(name: str) -> list[str]:
    if not name or "\x00" in name:
        raise IntegrityError(f"unsafe layer entry {name!r}: empty or contains NUL")
    if name.startswith("/"):
        raise IntegrityError(f"unsafe layer entry {name!r}: absolute path")
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise IntegrityError(f"unsafe layer entry {name!r}: '..' component")
    return parts


class _Extractor:
    """Creates entries under ``root`` through directory fds opened with O_NOFOLLOW, so no entry can
    be written through a symlink, whatever order the tar lists things in."""

    def __init__(self, root: str, *, opaque_xattr: str, chown: bool):
        self.root = root
        self.opaque_xattr = opaque_xattr
        self.chown = chown
        self.root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        self.dirs: list[tuple[list[str], tarfile.TarInfo]] = []
        self.opaque: list[list[str]] = []

    def close(self) -> None:
        os.close(self.root_fd)

    def _open_dir(self, parts: list[str], *, create: bool) -> int:
        fd = os.dup(self.root_fd)
        try:
            for i, part in enumerate(parts):
                try:
                    nfd = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
                except FileNotFoundError:
                    if not create:
                        raise
                    os.mkdir(part, 0o755, dir_fd=fd)
                    nfd = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
                except OSError as exc:
                    if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                        where = "/".join(parts[: i + 1])
                        raise IntegrityError(
                            f"unsafe layer entry under {where!r}: it is not a directory (a symlink?)"
                        ) from None
                    raise
                os.close(fd)
                fd = nfd
        except BaseException:
            os.close(fd)
            raise
        return fd

    def add(self, member: tarfile.TarInfo, data: BinaryIO | None) -> None:
        parts = _member_parts(member.name)
        if not parts:  # the layer root itself
            if member.isdir():
                self.dirs.append((parts, member))
                return
            raise IntegrityError(f"unsafe layer entry {member.name!r}: names the layer root")
        leaf = parts[-1]
        pfd = self._open_dir(parts[:-1], create=True)
        try:
            self._add_leaf(pfd, leaf, parts, member, data)
        finally:
            os.close(pfd)

    def _add_leaf(self, pfd: int, leaf: str, parts: list[str], m: tarfile.TarInfo,
                  data: BinaryIO | None) -> None:
        mode = m.mode & 0o7777
        if m.isdir():
            try:
                os.mkdir(leaf, 0o700, dir_fd=pfd)
            except FileExistsError:
                if not stat.S_ISDIR(os.stat(leaf, dir_fd=pfd, follow_symlinks=False).st_mode):
                    raise IntegrityError(f"layer entry {m.name!r} listed twice") from None
            self.dirs.append((parts, m))
            return
        if m.isreg():
            assert data is not None
            fd = os.open(leaf, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=pfd)
            with os.fdopen(fd, "wb") as out:
                shutil.copyfileobj(data, out, _CHUNK)
                if self.chown:
                    os.fchown(fd, m.uid, m.gid)
                os.fchmod(fd, mode)
                out.flush()
                os.utime(fd, (m.mtime, m.mtime))  # as the tar says (0): no file looks newer than another
            return
        if m.issym():
            target = m.linkname
            if not target or "\x00" in target:
                raise IntegrityError(f"unsafe layer entry {m.name!r}: empty symlink target")
            if not target.startswith("/"):
                resolved = posixpath.normpath(posixpath.join(posixpath.dirname("/".join(parts)), target))
                if resolved == ".." or resolved.startswith("../"):
                    raise IntegrityError(
                        f"unsafe layer entry {m.name!r}: symlink to {target!r} leaves the layer")
            os.symlink(target, leaf, dir_fd=pfd)
            if self.chown:
                os.chown(leaf, m.uid, m.gid, dir_fd=pfd, follow_symlinks=False)
            os.utime(leaf, (m.mtime, m.mtime), dir_fd=pfd, follow_symlinks=False)
            return
        if m.islnk():
            tparts = _member_parts(m.linkname)
            if not tparts:
                raise IntegrityError(f"unsafe layer entry {m.name!r}: hardlink to the layer root")
            try:
                tfd = self._open_dir(tparts[:-1], create=False)
            except FileNotFoundError:
                raise IntegrityError(
                    f"unsafe layer entry {m.name!r}: hardlink to {m.linkname!r}, not in the layer"
                ) from None
            try:
                st = os.stat(tparts[-1], dir_fd=tfd, follow_symlinks=False)
                if not stat.S_ISREG(st.st_mode):
                    raise IntegrityError(
                        f"unsafe layer entry {m.name!r}: hardlink to {m.linkname!r}, not a file")
                os.link(tparts[-1], leaf, src_dir_fd=tfd, dst_dir_fd=pfd, follow_symlinks=False)
            except FileNotFoundError:
                raise IntegrityError(
                    f"unsafe layer entry {m.name!r}: hardlink to {m.linkname!r}, not in the layer"
                ) from None
            finally:
                os.close(tfd)
            return
        if m.ischr() and m.devmajor == 0 and m.devminor == 0:
            os.mknod(leaf, stat.S_IFCHR | mode, os.makedev(0, 0), dir_fd=pfd)
            if self.chown:
                os.chown(leaf, m.uid, m.gid, dir_fd=pfd, follow_symlinks=False)
            return
        if m.isfifo():
            os.mkfifo(leaf, mode, dir_fd=pfd)
            if self.chown:
                os.chown(leaf, m.uid, m.gid, dir_fd=pfd, follow_symlinks=False)
            return
        raise IntegrityError(f"unsafe layer entry {m.name!r}: device nodes other than whiteouts "
                             "(char 0/0) are not allowed in a layer")

    def mark_opaque(self, parts: list[str]) -> None:
        os.close(self._open_dir(parts, create=True))
        self.opaque.append(parts)

    def finish(self) -> None:
        """Directory modes, owners, mtimes and opaque marks last (deepest first), so a read-only
        directory does not stop its own contents from being written. Every entry gets the tar's mtime
        (0): tools that use a compiled file only when it is not older than its source (Racket's .zo)
        would otherwise see sources unpacked after their compiled files as newer, and recompile."""
        for parts in self.opaque:
            fd = self._open_dir(parts, create=False)
            try:
                os.setxattr(fd, self.opaque_xattr, b"y")
            finally:
                os.close(fd)
        for parts, m in reversed(self.dirs):
            fd = self._open_dir(parts, create=False)
            try:
                if m.pax_headers.get(_PAX_OPAQUE) == "y":
                    os.setxattr(fd, self.opaque_xattr, b"y")
                if self.chown:
                    os.fchown(fd, m.uid, m.gid)
                os.fchmod(fd, m.mode & 0o7777)
                os.utime(fd, (m.mtime, m.mtime))
            finally:
                os.close(fd)
        os.utime(self.root_fd, (0, 0))  # the layer root is in no tar: its mtime is every entry's


def unpack(src: Readable, dest: str | os.PathLike[str], *, expected_id: str | None,
           opaque_xattr: str | None = None, chown: bool | None = None) -> PackedLayer:
    """Extract a layer tar read from ``src`` into the new directory ``dest``, verifying its sha256.

    On any failure (bad hash, truncated or malformed tar, unsafe entry) ``dest`` is removed and
    :class:`IntegrityError` raised. Owners are applied when running as root (``chown``)."""
    out = os.fspath(dest)
    if expected_id is not None:
        check_layer_id(expected_id)
    xattr = opaque_xattr or default_opaque_xattr()
    if xattr not in OPAQUE_XATTRS:
        raise StoreError(f"opaque_xattr must be one of {OPAQUE_XATTRS}, not {xattr!r}")
    os.mkdir(out, 0o755)
    source = _HashSource(src)
    ok = False
    try:
        ex = _Extractor(out, opaque_xattr=xattr, chown=os.geteuid() == 0 if chown is None else chown)
        try:
            with tarfile.open(fileobj=source, mode="r|", format=tarfile.PAX_FORMAT) as tar:  # type: ignore[call-overload]
                for member in tar:
                    ex.add(member, tar.extractfile(member) if member.isreg() else None)
            source.drain()
            ex.finish()
        finally:
            ex.close()
        got = source.sha.hexdigest()
        if expected_id is not None and got != expected_id:
            raise IntegrityError(
                f"layer {expected_id} is corrupt: its content hashes to {got} "
                f"({source.size} bytes); it was not used", layer_id=expected_id)
        ok = True
        return PackedLayer(id=got, size_bytes=source.size)
    except (tarfile.TarError, EOFError) as exc:
        raise IntegrityError(
            f"layer {expected_id or '(unverified)'} is not a valid tar ({exc}); truncated or corrupt "
            f"after {source.size} bytes; it was not used", layer_id=expected_id) from exc
    except IntegrityError as exc:
        if exc.layer_id is None and expected_id is not None:
            exc.layer_id = expected_id
        raise
    finally:
        if not ok:
            remove_tree(out)


def unpack_oci(src: Readable, dest: str | os.PathLike[str], *, opaque_xattr: str | None = None,
               chown: bool | None = None) -> None:
    """Extract one OCI image layer (tar, optionally gzip/bzip2/xz) into the new directory ``dest``,
    turning OCI whiteouts into overlay ones: ``.wh.NAME`` -> char device 0/0 ``NAME``,
    ``.wh..wh..opq`` -> its directory marked opaque. Same safety rules as :func:`unpack`; the
    caller verifies the blob's digest. On failure ``dest`` is removed."""
    out = os.fspath(dest)
    xattr = opaque_xattr or default_opaque_xattr()
    os.mkdir(out, 0o755)
    ok = False
    try:
        ex = _Extractor(out, opaque_xattr=xattr, chown=os.geteuid() == 0 if chown is None else chown)
        try:
            with tarfile.open(fileobj=src, mode="r|*") as tar:  # type: ignore[call-overload]
                for member in tar:
                    parts = _member_parts(member.name)
                    leaf = parts[-1] if parts else ""
                    if leaf == ".wh..wh..opq":
                        ex.mark_opaque(parts[:-1])
                    elif leaf.startswith(".wh."):
                        wh = tarfile.TarInfo("/".join([*parts[:-1], leaf[4:]]))
                        wh.type, wh.mode, wh.uid, wh.gid = tarfile.CHRTYPE, 0, 0, 0
                        ex.add(wh, None)
                    else:
                        ex.add(member, tar.extractfile(member) if member.isreg() else None)
            ex.finish()
        finally:
            ex.close()
        ok = True
    except (tarfile.TarError, EOFError, OSError) as exc:
        raise IntegrityError(f"cannot extract OCI layer into {out}: {exc}") from exc
    finally:
        if not ok:
            remove_tree(out)


def remove_tree(path: str | os.PathLike[str]) -> None:
    """Remove a file or directory tree, including read-only directories inside it."""
    p = os.fspath(path)
    if not os.path.lexists(p):
        return
    if not os.path.isdir(p) or os.path.islink(p):
        os.unlink(p)
        return
    os.chmod(p, 0o700)
    for dirpath, dirs, _files in os.walk(p):
        for d in dirs:
            full = os.path.join(dirpath, d)
            if not os.path.islink(full):
                os.chmod(full, 0o700)
    shutil.rmtree(p)


def tree_size(path: str | os.PathLike[str]) -> int:
    """Bytes of regular files under ``path`` (each inode once)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for f in files:
            st = os.lstat(os.path.join(dirpath, f))
            if stat.S_ISREG(st.st_mode) and (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_size
    return total


__all__ = [
    "LAYER_ID_RE",
    "OPAQUE_XATTRS",
    "PackedLayer",
    "check_layer_id",
    "default_opaque_xattr",
    "layer_id",
    "pack",
    "pack_to_file",
    "remove_tree",
    "tree_size",
    "unpack",
    "unpack_oci",
]
