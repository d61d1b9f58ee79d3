"""User slots: as root, every live sandbox in a user namespace owned by a host uid of its own.

The kernel counts several per-user budgets per user namespace and charges each namespace's total to
its owner in the parent namespace: processes against RLIMIT_NPROC, inotify instances and watches,
POSIX message queue bytes, pending signals. With one owner per sandbox (a uid from ``--uid-range``
that no process runs as), one sandbox exhausting a budget leaves the others theirs; without cgroups
RLIMIT_NPROC becomes a per-sandbox limit.

Where the layers' filesystems take idmapped mounts (probed once, with the first batch), each
namespace also maps uid 1000 onto its owner and the sandbox's layers are stacked through that map:
its processes run as that host uid (so what the kernel counts per host uid, pipe buffers and
keyrings, is per sandbox too) while every file keeps uid 1000 on disk and inside. Elsewhere (a
container's overlay root filesystem refuses idmapped mounts) the namespaces map every id onto
itself: processes run as host uid 1000 and pipe buffers (``fs.pipe-user-pages-soft``) and keyrings
(whose syscalls the seccomp filter denies) stay shared. ``shifted`` and ``idmap_error`` say which.

Namespaces are made ahead of demand, in batches, by ``rollbox.runtime.inside.userns`` (a
single-threaded helper process), and reused: a slot goes back to the end of the free queue once
its sandbox's init has exited (the kernel ends a pid namespace's init only after every other
process in it is gone); one whose init did not exit is retired.

Uids are unique across the processes of a host (two servers, a server and a CLI run): each uid a
process takes is claimed by an exclusive open-file-description lock (``F_OFD_SETLK``) on byte
``uid`` of ``<lock_dir>/uids``, through one fd kept open until ``close()``; uids another live
process (or another ``UserSlots``) holds are skipped, and the kernel drops a dead process's claims,
so its uids go to whoever comes next.
"""

from __future__ import annotations

import asyncio
import collections
import errno
import fcntl
import json
import logging
import os
import socket
import struct
import sys
from dataclasses import dataclass

from rollbox.runtime.errors import IsolationError

log = logging.getLogger("rollbox.runtime")

DEFAULT_RANGE = "1073741824:65536"  # 2^30: far above the uids of accounts and of /etc/subuid ranges
BATCH = 32
# host-wide: the file whose byte ``uid`` is locked by the process whose sandboxes use that uid
LOCK_DIR = os.environ.get("ROLLBOX_UID_LOCK_DIR", "/run/rollbox/uids")
_FLOCK = struct.Struct("hhqqi4x")  # struct flock (64-bit Linux): l_type, l_whence, l_start, l_len, l_pid


def parse_range(text: str) -> tuple[int, int] | None:
    """``START:COUNT`` (as in /etc/subuid) -> (start, count); ``""`` or ``none`` -> None."""
    text = text.strip()
    if text in ("", "none", "off"):
        return None
    try:
        start_s, count_s = text.split(":")
        start, count = int(start_s), int(count_s)
    except ValueError:
        raise ValueError(f"uid range {text!r}: expected START:COUNT, e.g. {DEFAULT_RANGE}") from None
    if start < 65536 or count < 1 or start + count > 2**32 - 2:
        raise ValueError(f"uid range {text!r}: START must be >= 65536 (no account's uid) and the range below 2^32 - 1")
    return start, count


@dataclass
class Slot:
    uid: int  # the host uid owning the namespace
    fd: int  # the namespace (an fd of /proc/<pid>/ns/user)
    shifted: bool = False  # its map puts uid 1000 on ``uid``: stack the sandbox's layers through it


class UserSlots:
    def __init__(self, start: int, count: int, *, batch: int = BATCH, probe: list[str] | None = None,
                 lock_dir: str | None = None):
        """``probe``: [a scratch directory, then the directories the sandboxes' layers come from];
        if an overlay of idmapped mounts of them works, sandboxes run as their slot's uid.
        ``lock_dir``: the host-wide directory of uid claims (default ``LOCK_DIR``)."""
        self.start, self.count = start, count
        self.batch = batch
        self._probe = probe
        self.shifted: bool | None = None  # known once the first batch is made
        self.idmap_error = ""
        self._next = start  # the next uid never handed out
        self._free: collections.deque[Slot] = collections.deque()
        self._all: dict[int, Slot] = {}
        self._making: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()
        self._lock_dir = lock_dir or LOCK_DIR
        self._claims: set[int] = set()  # uids whose byte of the lock file this holds
        self._claim_fd = -1  # the lock file, opened at the first claim

    @property
    def made(self) -> int:
        return len(self._all)

    @property
    def in_use(self) -> int:
        return len(self._all) - len(self._free)

    async def acquire(self) -> Slot:
        """A slot for a new sandbox: the free one released longest ago, or one of a new batch."""
        while not self._free:
            if self._next >= self.start + self.count:
                raise IsolationError(f"no free uid in the uid range {self.start}:{self.count} "
                                     f"({self.in_use} sandboxes here hold one each, other processes "
                                     f"of this host the rest)")
            await self._make(only_if_none_free=True)
        slot = self._free.popleft()
        if len(self._free) < self.batch // 4 and self._next < self.start + self.count \
                and (self._making is None or self._making.done()):
            self._making = asyncio.get_running_loop().create_task(self._make())
            self._making.add_done_callback(_log_failure)
        return slot

    def release(self, slot: Slot, *, gone: bool) -> None:
        """``gone``: its sandbox's init has exited (which the kernel lets happen only after every
        other process of its pid namespace is gone), so the namespace's counts are back to zero and
        it may serve the next sandbox. Otherwise it is retired, never handed out again."""
        if self._all.get(slot.uid) is not slot:  # closed or retired already: its fd number may be another's now
            return
        if gone:
            self._free.append(slot)
        else:
            self._all.pop(slot.uid, None)
            os.close(slot.fd)

    async def _make(self, only_if_none_free: bool = False) -> None:
        async with self._lock:  # one batch at a time; a waiter finds the batch made meanwhile
            if (only_if_none_free and self._free) or self._next >= self.start + self.count:
                return
            owners = await asyncio.to_thread(self._claim, self.batch)
            if not owners:
                return
            request: dict[str, object] = {"owners": owners}
            if self.shifted is None and self._probe:
                request["probe"] = self._probe
            else:
                request["shift"] = bool(self.shifted)
            try:
                fds, reply = await make_namespaces(request)
            except BaseException:
                self._unclaim(owners)
                self._next = min(self._next, owners[0])  # as before: a failed batch's uids are tried again
                raise
            if self.shifted is None:
                self.shifted = bool(reply.get("shift"))
                self.idmap_error = str(reply.get("idmap_error") or "")
                if not self.shifted and self.idmap_error:
                    log.info("sandboxes run as host uid 1000 (namespaces owned per sandbox): no idmapped "
                             "layers here: %s", self.idmap_error)
            for uid, fd in zip(owners, fds, strict=True):
                slot = self._all[uid] = Slot(uid, fd, bool(self.shifted))
                self._free.append(slot)

    def _claim(self, n: int) -> list[int]:
        """Up to ``n`` uids from ``_next`` on that no other live process of the host holds, each
        locked on its byte of the lock file; ``_next`` moves past every uid looked at."""
        if self._claim_fd < 0:
            os.makedirs(self._lock_dir, mode=0o700, exist_ok=True)
            self._claim_fd = os.open(os.path.join(self._lock_dir, "uids"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        end = self.start + self.count
        got: list[int] = []
        while len(got) < n and self._next < end:
            uid = self._next
            self._next += 1
            if self._lock_byte(uid, fcntl.F_WRLCK):
                self._claims.add(uid)
                got.append(uid)
        return got

    def _lock_byte(self, uid: int, kind: int) -> bool:
        try:
            fcntl.fcntl(self._claim_fd, fcntl.F_OFD_SETLK, _FLOCK.pack(kind, os.SEEK_SET, uid, 1, 0))
        except OSError as exc:
            if exc.errno in (errno.EAGAIN, errno.EACCES):  # another live process's sandboxes have it
                return False
            raise
        return True

    def _unclaim(self, uids: list[int]) -> None:
        for uid in uids:
            self._claims.discard(uid)
            self._lock_byte(uid, fcntl.F_UNLCK)

    async def prepare(self) -> None:
        """Make the first batch (at start, beside the first zygotes)."""
        if not self._all:
            await self._make()

    async def stop_making(self) -> None:
        """A batch being made ahead of demand is cancelled, and its helper reaped before this returns
        (not left to the event loop's end, where closing its transport would reap it behind asyncio's
        child watcher)."""
        if self._making is not None and not self._making.done():
            self._making.cancel()
            await asyncio.gather(self._making, return_exceptions=True)

    def close(self) -> None:
        if self._making is not None:
            self._making.cancel()
        for slot in self._all.values():
            try:
                os.close(slot.fd)
            except OSError:
                pass
        self._all.clear()
        self._free.clear()
        self._claims.clear()
        if self._claim_fd >= 0:  # its locks go with it
            os.close(self._claim_fd)
            self._claim_fd = -1


def _log_failure(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.warning("making user namespaces ahead of demand failed: %s", task.exception())


async def make_namespaces(request: dict[str, object]) -> tuple[list[int], dict[str, object]]:
    """One user namespace per owner uid (``request["owners"]``), made by the stdlib helper
    (runtime/inside/userns.py); returns their fds and the helper's reply."""
    owners = request["owners"]
    assert isinstance(owners, list)
    from rollbox.runtime.restore import boot_args

    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        proc = await asyncio.create_subprocess_exec(
            *boot_args(sys.executable, theirs.fileno(), "userns", json.dumps(request)),
            pass_fds=[theirs.fileno()], env={"LANG": "C.UTF-8"}, stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE, cwd="/",
        )
    finally:
        theirs.close()
    try:
        msg, fds = await asyncio.to_thread(_receive, ours, len(owners))
    finally:
        ours.close()
        _, err = await proc.communicate()
    if "error" in msg or len(fds) != len(owners):
        for fd in fds:
            os.close(fd)
        why = msg.get("error") or err.decode(errors="replace").strip()[-500:] or "no namespaces came back"
        raise IsolationError(f"cannot make user namespaces: {why}")
    return fds, msg


def _receive(sock: socket.socket, n: int) -> tuple[dict[str, object], list[int]]:
    data, fds, _, _ = socket.recv_fds(sock, 1 << 16, n)
    try:
        msg = json.loads(data or b"{}")
    except ValueError:
        msg = {"error": f"bad reply {data[:200]!r}"}
    return msg, list(fds)
