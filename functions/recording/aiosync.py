"""fdatasync and fsync without a thread: Linux AIO's ``IOCB_CMD_FDSYNC`` / ``IOCB_CMD_FSYNC`` (Linux
4.18+), the completion signalled on an eventfd that the event loop watches.

The kernel runs the sync in a kworker; the event loop only submits it (one syscall) and reaps it when
the eventfd turns readable. A writer thread doing the same costs the server a thread wake-up and two
hand-offs of the GIL with the event loop per sync, which measured more than the sync itself.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
import os
from collections.abc import Callable

__all__ = ["AsyncFsync"]

log = logging.getLogger("rollbox.aiosync")

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.syscall.restype = ctypes.c_long

# asm-generic numbers (aarch64, riscv64) and x86_64's own
_SYSCALLS = {"x86_64": (206, 207, 208, 209), "aarch64": (0, 1, 4, 2), "riscv64": (0, 1, 4, 2)}
_IOCB_CMD_FSYNC = 2
_IOCB_CMD_FDSYNC = 3
_IOCB_FLAG_RESFD = 1
_MAX_EVENTS = 64


class _Iocb(ctypes.Structure):  # struct iocb (linux/aio_abi.h), little-endian layout
    _fields_ = [("aio_data", ctypes.c_uint64), ("aio_key", ctypes.c_uint32), ("aio_rw_flags", ctypes.c_int32),
                ("aio_lio_opcode", ctypes.c_uint16), ("aio_reqprio", ctypes.c_int16),
                ("aio_fildes", ctypes.c_uint32), ("aio_buf", ctypes.c_uint64), ("aio_nbytes", ctypes.c_uint64),
                ("aio_offset", ctypes.c_int64), ("aio_reserved2", ctypes.c_uint64), ("aio_flags", ctypes.c_uint32),
                ("aio_resfd", ctypes.c_uint32)]


class _IoEvent(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64), ("obj", ctypes.c_uint64), ("res", ctypes.c_int64),
                ("res2", ctypes.c_int64)]


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class AsyncFsync:
    """``sync(fd, callback)``: fdatasync ``fd`` (``full``: fsync) in the kernel's own time;
    ``callback(errno)`` (0: done) runs on the event loop. ``synced(fd)``: the same, awaitable. Raises
    OSError at construction where Linux AIO is unavailable."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        numbers = _SYSCALLS.get(os.uname().machine)
        if numbers is None:
            raise OSError(0, f"no Linux AIO syscall numbers for {os.uname().machine}")
        self._setup, self._destroy, self._getevents, self._submit = numbers
        ctx = ctypes.c_ulong(0)
        if _libc.syscall(self._setup, _MAX_EVENTS, ctypes.byref(ctx)) < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"io_setup: {os.strerror(err)}")
        self._ctx = ctx
        self._efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._loop = loop
        self._pending: dict[int, tuple[_Iocb, Callable[[int], None]]] = {}  # iocbs stay alive until reaped
        self._next = 0
        self._events = (_IoEvent * _MAX_EVENTS)()
        self._zero = _Timespec(0, 0)
        loop.add_reader(self._efd, self._reap)

    def sync(self, fd: int, callback: Callable[[int], None], *, full: bool = False) -> None:
        self._next += 1
        iocb = _Iocb(aio_data=self._next, aio_lio_opcode=_IOCB_CMD_FSYNC if full else _IOCB_CMD_FDSYNC,
                     aio_fildes=fd, aio_flags=_IOCB_FLAG_RESFD, aio_resfd=self._efd)
        ptr = ctypes.pointer(iocb)
        if _libc.syscall(self._submit, self._ctx, 1, ctypes.byref(ptr)) != 1:
            err = ctypes.get_errno()
            raise OSError(err, f"io_submit({'FSYNC' if full else 'FDSYNC'}): {os.strerror(err)}")
        self._pending[self._next] = (iocb, callback)

    def synced(self, fd: int, *, full: bool = True) -> asyncio.Future[None]:
        """``sync`` as a future (a full fsync unless told otherwise). The kernel holds its own reference
        to the file from the submit on: the caller may close ``fd``, or stop waiting, meanwhile."""
        fut: asyncio.Future[None] = self._loop.create_future()

        def done(err: int) -> None:
            if fut.done():  # the waiter gave up (cancelled)
                return
            if err:
                fut.set_exception(OSError(err, f"fsync: {os.strerror(err)}"))
            else:
                fut.set_result(None)

        self.sync(fd, done, full=full)
        return fut

    def _reap(self) -> None:
        try:
            os.eventfd_read(self._efd)
        except BlockingIOError:
            return
        while True:
            n = _libc.syscall(self._getevents, self._ctx, 0, _MAX_EVENTS, self._events, ctypes.byref(self._zero))
            if n <= 0:
                return
            for i in range(n):
                ev = self._events[i]
                _, callback = self._pending.pop(ev.data)
                try:
                    callback(-ev.res if ev.res < 0 else 0)
                except Exception:  # the other completions reaped with it still get theirs
                    log.exception("a sync's completion callback failed")
            if n < _MAX_EVENTS:
                return

    @property
    def busy(self) -> bool:
        return bool(self._pending)

    def close(self) -> None:
        """After every sync was reaped (the caller drains first)."""
        self._loop.remove_reader(self._efd)
        os.close(self._efd)
        _libc.syscall(self._destroy, self._ctx)
