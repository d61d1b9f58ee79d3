"""The HTTP/1.1 protocol ``rollbox serve`` gives uvicorn: httptools' parser, hardened for untrusted clients
(header deadline, header size cap, malformed requests answered as error events)."""

from __future__ import annotations

import asyncio
import http
from collections.abc import Callable

import httptools
from rollbox.functions.contract.events import Mode, ReplyError, encode, error_event
from rollbox.functions.contract.models import ErrorCode
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

__all__ = ["HeadHeld", "HttpProtocol", "http_protocol"]

MAX_HEADER_BYTES = 256 * 1024  # a request's line and headers; more is a 431 (uvicorn buffers any amount)
LINGER_S = 2.0  # after refusing a request: how long the rest of what the client sends is read and dropped
LINGER_MAX_BYTES = 64 * 1024 * 1024


def http_protocol(request_timeout_s: float, refused: Callable[[int], None]) -> type[HttpProtocol]:
    """``HttpProtocol`` with its settings: the headers' deadline, and what counts each refused request."""
    return type("Protocol", (HttpProtocol,), {"request_timeout_s": request_timeout_s,
                                              "refused": staticmethod(refused)})


class HttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with what it lacks for untrusted clients: headers that do not all
    arrive within ``request_timeout_s`` get a 408 error event and the connection is closed (the
    body's own deadline is the service's); headers over ``MAX_HEADER_BYTES`` a 431; a connection that
    never sends a request is closed after the keep-alive time (it was held forever); malformed HTTP
    gets a 400 error event naming what the parser found (not a plain-text page). ``refused(status)``
    counts each such reply. uvicorn makes the instances: ``http_protocol`` sets the two settings."""

    request_timeout_s = 30.0
    _header_timer: asyncio.TimerHandle | None = None  # armed while a request's headers arrive
    _head_bytes = 0
    _discarded: int | None = None  # refused: what the client still sends is read and dropped

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive,
                                                            self.timeout_keep_alive_handler)

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_header_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._discarded is not None:
            self._discarded += len(data)
            if self._discarded > LINGER_MAX_BYTES:
                self.transport.close()
            return
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
        except httptools.HttpParserError as exc:
            why = str(exc)[:200] or "the parser stopped"
            self._refuse(ReplyError(ErrorCode.INVALID_EVENT,
                                    f"not a valid HTTP/1.1 request: {why}{_bad_header_line(data)}"))
            return
        if self._header_timer is not None:  # still in the headers (held by the parser until they end)
            self._head_bytes += len(data)
            if self._head_bytes > MAX_HEADER_BYTES:
                self._headers_too_large()

    def _headers_too_large(self) -> None:
        self._refuse(ReplyError(ErrorCode.HEADERS_TOO_LARGE,
                                f"the request's headers are over {MAX_HEADER_BYTES // 1024} KiB: send large "
                                "values in the body", details={"max_header_bytes": MAX_HEADER_BYTES}))

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._stop_header_timer()
        self._header_timer = self.loop.call_later(self.request_timeout_s, self._headers_late)
        self._head_bytes = 0

    def on_headers_complete(self) -> None:
        self._stop_header_timer()
        if len(self.url) + sum(len(k) + len(v) + 4 for k, v in self.headers) > MAX_HEADER_BYTES:
            self._headers_too_large()  # they came in one piece: the request is not started
            return
        super().on_headers_complete()
        if self.cycle is not None:
            self.cycle.transport = HeadHeld(self.transport, self.loop)  # type: ignore[assignment]

    def on_body(self, body: bytes) -> None:
        if self._discarded is None:  # (refused while the parser went on with the same bytes)
            super().on_body(body)

    def on_message_complete(self) -> None:
        if self._discarded is None:
            super().on_message_complete()

    def _stop_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_late(self) -> None:
        self._header_timer = None
        self._refuse(ReplyError(ErrorCode.REQUEST_TIMEOUT,
                                f"the request headers did not all arrive within {self.request_timeout_s:g} s "
                                "(--request-timeout-s)", details={"request_timeout_s": self.request_timeout_s}))

    @staticmethod
    def refused(status: int) -> None:
        """A request was refused with ``status`` (``http_protocol`` sets what counts it)."""

    def _refuse(self, err: ReplyError) -> None:
        """Answer ``err`` and close, unless a reply to an earlier request is still being sent (then
        the connection closes after it). Closing waits until the client has read the reply: what it
        still sends is discarded (up to ``LINGER_MAX_BYTES``, ``LINGER_S``); closing at once would
        reset the connection under a reply it has not read."""
        if self.transport.is_closing() or self._discarded is not None:
            return
        if self.cycle is not None and not self.cycle.response_complete:
            if self.cycle.response_started:
                self.cycle.keep_alive = False
                return
            self.cycle.disconnected = True  # the request's handler stops reading and sends nothing
            self.cycle.message_event.set()
        self._stop_header_timer()
        headers, body = encode(error_event(err), Mode.BINARY)
        head = [f"HTTP/1.1 {err.status} {http.HTTPStatus(err.status).phrase}"]
        head += [f"{k}: {v}" for k, v in headers.items()]
        head += [f"content-length: {len(body)}", "connection: close", "", ""]
        self.transport.write("\r\n".join(head).encode("latin-1") + body)
        self._discarded = 0
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.loop.call_later(LINGER_S, self.transport.close)
        self.refused(err.status)


class HeadHeld:
    """A response's transport (uvicorn's cycle writes through it) that holds the response's first write
    (its status line and headers) until the next (its body), and sends both as one: uvicorn writes
    them apart, which on a TCP_NODELAY socket is two segments, two write calls and two wake-ups of the
    client (/healthz with keep-alive, one client: ~5-15 us less of the server's CPU per request and
    ~10-30 us less of the client's).
    What is held is sent at the end of this turn of the event loop at the latest (a response with no
    body), and before the connection is closed."""

    __slots__ = ("_first", "_held", "_loop", "_transport")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop):
        self._transport = transport
        self._loop = loop
        self._held: bytes | None = None
        self._first = True

    def write(self, data: bytes) -> None:
        if self._first:
            self._first = False
            self._held = data
            self._loop.call_soon(self.flush)
            return
        if self._held is not None:
            data, self._held = self._held + data, None
        self._transport.write(data)

    def flush(self) -> None:
        if self._held is not None:
            data, self._held = self._held, None
            if not self._transport.is_closing():
                self._transport.write(data)

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def __getattr__(self, name: str) -> object:
        return getattr(self._transport, name)


_TOKEN = frozenset(b"!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")


def _bad_header_line(data: bytes) -> str:
    """Which header line of ``data`` holds what the HTTP parser refused, as a message names it: a name
    byte outside the token characters, or a control byte in a value ('' if none is found)."""
    for line in data.split(b"\r\n")[1:]:
        if not line:
            break
        name, colon, value = line.partition(b":")
        bad = next((c for c in name if c not in _TOKEN), None) if colon else None
        where = "name"
        if bad is None and colon:
            bad = next((c for c in value if (c < 0x20 and c != 0x09) or c == 0x7F), None)
            where = "value"
        if bad is not None:
            shown = name.decode("latin-1")[:64]
            return f" (byte 0x{bad:02x} in the {where} of the {shown!r} header)"
    return ""


