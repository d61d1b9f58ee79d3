"""A sandbox's overlay upper directory, read from the host: its entries in walk order, and the
filesystem diff they make (what a fork's children and a resumed sandbox are given, INJECT), with
the file contents copied into a memfd (``pack_upper``) or named by hash (snapshots/state.py).
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Callable, Iterator

from rollbox.runtime.errors import RollboxError
from rollbox.runtime.inside.proto import Diff, DiffEntry, Kind

__all__ = ["UpperTooLarge", "give_back", "pack_upper", "upper_diff", "walk_upper"]


class UpperTooLarge(RollboxError):
    """An upper directory with more entries than a walk's ``limit`` (``walk_upper``)."""


def walk_upper(upper: str, limit: int | None = None) -> Iterator[tuple[str, str, os.stat_result, str]]:
    """The entries of an overlay upper directory in walk order (children sorted by name, a directory
    before its contents): (path inside the sandbox, kind, stat, host path). Kinds: "w" whiteout
    (a deleted path), "d" directory, "o" opaque directory (hides what is below it), "l" symlink,
    "f" regular file; anything else (fifos, sockets) is skipped. ``limit``: UpperTooLarge once more
    entries than that were listed (a caller walking on the event loop gives the rest to a thread)."""
    stack = [""]
    left = limit
    while stack:
        rel = stack.pop()
        with os.scandir(os.path.join(upper, rel) if rel else upper) as it:
            if left is None:
                found = sorted(it, key=lambda e: e.name)
            else:
                found = []
                for e in it:
                    found.append(e)
                    left -= 1
                    if left < 0:
                        raise UpperTooLarge(f"{upper} holds more than {limit} entries")
                found.sort(key=lambda e: e.name)
        for e in found:
            path = f"/{rel}/{e.name}" if rel else f"/{e.name}"
            st = e.stat(follow_symlinks=False)
            if stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:
                yield path, "w", st, e.path
            elif stat.S_ISDIR(st.st_mode):
                opaque = False
                for attr in ("trusted.overlay.opaque", "user.overlay.opaque"):
                    with contextlib.suppress(OSError):
                        opaque = opaque or os.getxattr(e.path, attr, follow_symlinks=False) == b"y"
                yield path, "o" if opaque else "d", st, e.path
                stack.append(path.lstrip("/"))
            elif stat.S_ISLNK(st.st_mode):
                yield path, "l", st, e.path
            elif stat.S_ISREG(st.st_mode):
                yield path, "f", st, e.path


def give_back(tree: str, shift: tuple[int, int]) -> None:
    """Owners ``shift[0]`` (uid or gid) in ``tree`` become ``shift[1]``: a copy of a sandbox's upper
    directory stacked as a layer under other sandboxes (see ``Sandbox.owner_shift``)."""
    src, dst = shift
    for _, _, st, host_path in [("", "d", os.lstat(tree), tree), *walk_upper(tree)]:
        if src in (st.st_uid, st.st_gid):
            os.chown(host_path, dst if st.st_uid == src else st.st_uid, dst if st.st_gid == src else st.st_gid,
                     follow_symlinks=False)


def upper_diff(upper: str, file_content: Callable[[DiffEntry, os.stat_result, str], bool],
               limit: int | None = None) -> Diff | None:
    """An overlay upper directory as a diff a sandbox's agent can apply: its entries (directories,
    files, symlinks, hard links to an earlier path, in walk order, with modes and mtimes), the
    whiteouts (deleted paths) and the opaque directories. Where a regular file's content goes is the
    caller's: ``file_content(entry, stat, host path)`` fills in the entry's content fields, or says
    False to give up (then this returns None)."""
    entries: list[DiffEntry] = []
    whiteouts: list[str] = []
    opaque: list[str] = []
    seen: dict[tuple[int, int], str] = {}
    for path, kind, st, host_path in walk_upper(upper, limit):
        if kind == "w":
            whiteouts.append(path)
        elif kind in ("d", "o"):
            if kind == "o":
                opaque.append(path)
            entries.append(DiffEntry(path, Kind.DIR, stat.S_IMODE(st.st_mode), st.st_mtime))
        elif kind == "l":
            entries.append(DiffEntry(path, Kind.SYMLINK, link=os.readlink(host_path)))
        elif st.st_nlink > 1 and (st.st_dev, st.st_ino) in seen:
            entries.append(DiffEntry(path, Kind.HARDLINK, link=seen[(st.st_dev, st.st_ino)]))
        else:
            seen[(st.st_dev, st.st_ino)] = path
            entry = DiffEntry(path, Kind.FILE, stat.S_IMODE(st.st_mode), st.st_mtime)
            if not file_content(entry, st, host_path):
                return None
            entries.append(entry)
    return Diff(entries, whiteouts, opaque)


def pack_upper(upper: str, max_bytes: int) -> Diff | None:
    """``upper_diff`` with the file contents one after another in a memfd (``fd``; each child copies
    its files from it in the kernel). None if the files exceed ``max_bytes``."""
    fd = os.memfd_create("rollbox-fork-diff", os.MFD_CLOEXEC)
    offset = 0

    def copy_in(entry: DiffEntry, st: os.stat_result, host_path: str) -> bool:
        nonlocal offset
        if offset + st.st_size > max_bytes:
            return False
        with open(host_path, "rb") as src:
            n = os.sendfile(fd, src.fileno(), 0, st.st_size) if st.st_size else 0
        entry.offset, entry.size = offset, n
        offset += n
        return True

    try:
        diff = upper_diff(upper, copy_in)
    except BaseException:
        os.close(fd)
        raise
    if diff is None:
        os.close(fd)
        return None
    diff.fd = fd
    return diff
