"""Frames between the supervisor, a zygote and a sandbox agent (stdlib only).

A frame is a 4-byte big-endian length and a JSON object; file descriptors ride with the frame's
bytes as SCM_RIGHTS (one sendmsg; the reader ties them to the frame those bytes belong to).
Everything a sandbox sends is untrusted: frames are size-capped and parsed as plain JSON only.
"""

from __future__ import annotations

import array
import json
import os
import select
import socket
import struct
from collections.abc import Callable
from typing import Any

MAX_FRAME_BYTES = 256 * 1024 * 1024
SANDBOX_FRAME_BYTES = 48 * 1024 * 1024  # what a sandbox may send in one frame (its read-back files)
HEADER = struct.Struct(">I")
_MAX_FDS = 8


class ProtocolError(Exception):
    pass


def _dumps(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def encode(obj: dict[str, Any], dumps: Callable[[dict[str, Any]], bytes] = _dumps) -> bytes:
    """A frame: its length, then ``obj`` as JSON (``dumps``: the supervisor's side passes a faster one)."""
    body = dumps(obj)
    if len(body) > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {len(body)} bytes exceeds {MAX_FRAME_BYTES}")
    return HEADER.pack(len(body)) + body


def send(sock: socket.socket, obj: dict[str, Any], fds: list[int] | tuple[int, ...] = ()) -> None:
    """Blocking send of one frame (used inside zygotes and agents)."""
    data = encode(obj)
    if fds:
        n = sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
        data = data[n:]
    if data:  # sendall(b"") still calls send(): EPIPE if the peer already read the frame and left
        sock.sendall(data)


class Reader:
    """Incremental frame parser. Passed fds are tied to the frame whose bytes they arrived with
    (the kernel ends a read right after a message that carries fds), so frames that arrive
    together never mix up their fds."""

    def __init__(self, max_frame_bytes: int = MAX_FRAME_BYTES, loads: Callable[[bytes], Any] = json.loads) -> None:
        self.max_frame_bytes = max_frame_bytes
        self.loads = loads  # the supervisor's side parses with a faster one (runtime/channel.py)
        self.buf = bytearray()
        self.base = 0  # stream offset of buf[0]
        self.pending: list[tuple[int, list[int]]] = []  # (stream offset of the carrying byte, fds)
        self.last_fds: list[int] = []
        self.creds: tuple[int, int, int] | None = None  # (pid, uid, gid) of the latest sender, SO_PASSCRED

    def feed(self, data: bytes, ancdata: list[tuple[int, int, bytes]]) -> None:
        self.buf += data
        for level, kind, payload in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                a = array.array("i")
                a.frombytes(payload[: len(payload) - (len(payload) % a.itemsize)])
                self.pending.append((self.base + len(self.buf) - 1, list(a)))
            elif level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS and len(payload) >= 12:
                pid, uid, gid = struct.unpack_from("iII", payload)
                self.creds = (pid, uid, gid)

    def next(self) -> dict[str, Any] | None:
        if len(self.buf) < 4:
            return None
        (n,) = HEADER.unpack_from(self.buf)
        if n > self.max_frame_bytes:
            raise ProtocolError(f"peer announced a frame of {n} bytes")
        if len(self.buf) < 4 + n:
            return None
        body = bytes(self.buf[4 : 4 + n])
        start, end = self.base, self.base + 4 + n
        del self.buf[: 4 + n]
        self.base = end
        _close_all(self.last_fds)  # fds the caller did not take are not kept (a peer could pile them up)
        self.last_fds = [fd for off, fds in self.pending if start <= off < end for fd in fds]
        self.pending = [(off, fds) for off, fds in self.pending if off >= end]
        obj = self.loads(body)
        if not isinstance(obj, dict):
            raise ProtocolError("frame is not a JSON object")
        return obj

    def take_fds(self) -> list[int]:
        """The fds that came with the frame ``next()`` returned last."""
        fds, self.last_fds = self.last_fds, []
        return fds

    def close(self) -> None:
        """Close every received fd nobody took."""
        _close_all(self.last_fds)
        _close_all([fd for _, fds in self.pending for fd in fds])
        self.last_fds, self.pending = [], []


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def recv(sock: socket.socket, reader: Reader) -> dict[str, Any] | None:
    """Blocking receive of one frame; None at EOF."""
    while True:
        msg = reader.next()
        if msg is not None:
            return msg
        data, anc, _flags, _addr = sock.recvmsg(1 << 16, ANC_SPACE, RECV_FLAGS)
        if not data:
            return None
        reader.feed(data, anc)


ANC_SPACE = socket.CMSG_SPACE(_MAX_FDS * 4) + socket.CMSG_SPACE(12)
RECV_FLAGS = socket.MSG_CMSG_CLOEXEC  # received fds never cross an exec by accident


def wait(sock: socket.socket, wake_r: int) -> tuple[bool, bool]:
    """Block until ``sock`` is readable or a child exited (SIGCHLD wrote to ``wake_r``, the
    signal wakeup pipe). Returns (sock readable, children to reap); the wakeup pipe is drained."""
    while True:
        try:
            ready, _, _ = select.select([sock.fileno(), wake_r], [], [])
            break
        except InterruptedError:
            continue
    if wake_r in ready:
        try:
            while os.read(wake_r, 512):
                pass
        except BlockingIOError:
            pass
    return sock.fileno() in ready, wake_r in ready
