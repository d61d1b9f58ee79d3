"""Async frames over a unix socket (the supervisor's side of the zygote and agent protocols)."""

from __future__ import annotations

import array
import asyncio
import socket
from collections.abc import Mapping
from typing import Any

from rollbox.runtime import jsonio
from rollbox.runtime.inside import proto


def encode(obj: Mapping[str, Any]) -> bytes:
    """``proto.encode`` on the supervisor's side: the same frame, its JSON by ``jsonio.dumps``."""
    return proto.encode(obj, jsonio.dumps)


class Channel:
    def __init__(self, sock: socket.socket, max_frame_bytes: int = proto.MAX_FRAME_BYTES):
        sock.setblocking(False)
        self.sock = sock
        self.reader = proto.Reader(max_frame_bytes, jsonio.loads)
        self.loop = asyncio.get_running_loop()
        self.closed = False
        self._send_lock = asyncio.Lock()  # a frame is sent whole before the next one starts

    async def _wait(self, writable: bool) -> None:
        fut: asyncio.Future[None] = self.loop.create_future()
        fd = self.sock.fileno()

        def ready() -> None:
            if not fut.done():
                fut.set_result(None)

        if writable:
            self.loop.add_writer(fd, ready)
        else:
            self.loop.add_reader(fd, ready)
        try:
            await fut
        finally:
            if writable:
                self.loop.remove_writer(fd)
            else:
                self.loop.remove_reader(fd)

    async def recv(self) -> dict[str, Any] | None:
        """The next frame, or None once the peer has hung up. Safe to cancel between frames."""
        while True:
            try:
                msg = self.reader.next()
            except (proto.ProtocolError, ValueError, RecursionError):  # oversized, malformed, too deep: peer is lost
                self.closed = True
                return None
            if msg is not None:
                return msg
            if self.closed:
                return None
            try:
                data, anc, _f, _a = self.sock.recvmsg(1 << 16, proto.ANC_SPACE, proto.RECV_FLAGS)
            except BlockingIOError:
                await self._wait(writable=False)
                continue
            except (ConnectionResetError, OSError):
                data, anc = b"", []
            if not data:
                self.closed = True
                return None
            self.reader.feed(data, anc)

    def take_fds(self) -> list[int]:
        return self.reader.take_fds()

    async def send(self, obj: Mapping[str, Any] | bytes, fds: list[int] | tuple[int, ...] = ()) -> None:
        """Send one frame: a message, or one already encoded (``encode``) to send to many."""
        async with self._send_lock:
            await self._send(obj, fds)

    async def _send(self, obj: Mapping[str, Any] | bytes, fds: list[int] | tuple[int, ...]) -> None:
        data = obj if isinstance(obj, bytes) else encode(obj)
        if fds:
            while True:
                try:
                    n = self.sock.sendmsg(
                        [data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
                    )
                    break
                except BlockingIOError:
                    await self._wait(writable=True)
            data = data[n:]
        if data:
            await self.loop.sock_sendall(self.sock, data)

    def close(self) -> None:
        self.closed = True
        self.reader.close()
        self.sock.close()
