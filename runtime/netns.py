"""Network namespaces for sandboxes, made ahead and reused (as root).

Every sandbox has a network namespace of its own, with its loopback down and no other interface: it
has no network. Making one costs ~0.5 ms of CPU in the sandbox's setup, and tearing it down when its
last process is gone ~0.7 ms more of kernel work in the background (cleanup_net, measured here), per
sandbox. Such a namespace keeps nothing once its processes are gone: its sandbox, without
capabilities over it, could not configure it (no interface up, no address, no route, no filter, no
sysctl), and the sockets it opened closed with its processes. So namespaces are made here, in a
thread of their own (unshare(CLONE_NEWNET) acts on the calling thread alone; the thread goes back to
the host's namespace after each batch), handed to sandboxes (``setns`` in their containment, before
they drop privileges) and taken back once the sandbox's init has exited (the kernel ends a pid
namespace's init only after every other process in it): up to ``keep`` wait for the next sandbox,
the others are closed. A sandbox that finds none free makes its own, as before.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import logging
import os

from rollbox.runtime.isolation import libc

log = logging.getLogger("rollbox.runtime")

BATCH = 16


class NetNamespaces:
    def __init__(self, keep: int = 128, batch: int = BATCH) -> None:
        self.keep = keep
        self.batch = batch
        self.free: collections.deque[int] = collections.deque()  # fds of /proc/thread-self/ns/net
        self.made = 0  # namespaces made here, ever
        self.handed = 0  # handed to sandboxes, ever (made or reused)
        self.failed: str | None = None  # why none can be made here (then sandboxes make their own)
        self._host = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        self._thread: concurrent.futures.ThreadPoolExecutor | None = None
        self._filling: asyncio.Future[list[int]] | None = None
        self.closed = False

    def acquire(self) -> int | None:
        """An fd of an empty network namespace (the caller owns it until ``release``), or None."""
        if not self.closed and self.failed is None and len(self.free) < self.batch // 2:
            self._fill()
        if not self.free:
            return None
        self.handed += 1
        return self.free.popleft()

    def release(self, fd: int, gone: bool) -> None:
        """The sandbox that had ``fd`` has ended: ``gone`` if its init has exited (nothing of it is
        left in the namespace); reused then, unless ``keep`` wait already."""
        if gone and not self.closed and len(self.free) < self.keep:
            self.free.append(fd)
        else:
            os.close(fd)

    def _fill(self) -> None:
        if self._filling is not None:
            return
        if self._thread is None:
            self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rollbox-netns")
        fut = asyncio.get_running_loop().run_in_executor(self._thread, self._make, self.batch)
        self._filling = fut

        def done(f: asyncio.Future[list[int]]) -> None:
            self._filling = None
            try:
                fds = f.result()
            except OSError as exc:
                self.failed = str(exc)
                log.warning("network namespaces cannot be made ahead (%s): every sandbox makes its own", exc)
                return
            self.made += len(fds)
            if self.closed:
                for fd in fds:
                    os.close(fd)
            else:
                self.free.extend(fds)

        fut.add_done_callback(done)

    def _make(self, n: int) -> list[int]:
        """In this pool's thread: ``n`` new network namespaces; the thread is back in the host's after."""
        fds: list[int] = []
        try:
            for _ in range(n):
                libc.unshare(libc.CLONE_NEWNET)
                fds.append(os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC))
        except OSError:
            for fd in fds:
                os.close(fd)
            raise
        finally:
            libc.setns(self._host, libc.CLONE_NEWNET)
        return fds

    def close(self) -> None:
        """Idempotent: a second close must not close the host namespace's fd number again (by then
        it may be another file's, a socket's)."""
        self.closed = True
        if self._thread is not None:
            self._thread.shutdown(wait=True)
            self._thread = None
        while self.free:
            os.close(self.free.popleft())
        if self._host >= 0:
            with contextlib.suppress(OSError):
                os.close(self._host)
            self._host = -1
