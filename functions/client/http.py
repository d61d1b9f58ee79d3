"""An async client for trainers, shaped like E2B's SDK, speaking CloudEvents (binary mode) over httpx.

    async with await Sandbox.create("http://127.0.0.1:8080", metadata={"episode": "7"}) as sb:
        r = await sb.exec(code="print(6 * 7)")
        assert r.stdout == "42\\n"

    r = await Client("http://127.0.0.1:8080").run(code="print(1)")   # one-shot

Exceptions (one root; each carries ``sandbox_id`` when there is one, and ``attempts``). Every error
code of the contract (``contract.ErrorCode``) has its own class (``ERROR_CLASSES``), grouped by what
a caller does about it:

    ClientError
    ├── TransportError                  no usable reply: connection failed, or the reply was not an event
    ├── ServiceError                    an error event (``status``, ``code``, ``message``, ``details``)
    │   ├── InvalidRequestError             fix the request
    │   │   ├── InvalidEventError               400 invalid_event: not a CloudEvents 1.0 event
    │   │   ├── InvalidDataError                400 invalid_data: the message names the field
    │   │   ├── UnknownTypeError                400 unknown_type
    │   │   ├── MethodNotAllowedError           405 method_not_allowed
    │   │   ├── IdempotencyConflictError        409 idempotency_conflict: an event id reused for other content
    │   │   ├── PayloadTooLargeError            413 payload_too_large
    │   │   ├── HeadersTooLargeError            431 headers_too_large
    │   │   ├── UnsupportedMediaTypeError       415 unsupported_media_type
    │   │   └── UnsupportedError                422 unsupported: valid, not servable here (a process image)
    │   ├── NotFoundError                   404
    │   │   ├── EndpointNotFoundError           404 not_found: no such HTTP path (the URL is wrong)
    │   │   ├── SnapshotNotFoundError           404 snapshot_not_found
    │   │   └── SandboxNotFoundError            404 sandbox_not_found
    │   │       └── SandboxGoneError            410 sandbox_gone: destroyed or expired (``details['reason']``)
    │   ├── SandboxDiedError                410 sandbox_died: it ended while in use
    │   ├── SandboxBusyError                409 sandbox_busy (retried): another replica committed a step first
    │   ├── RequestTimeoutError             408 request_timeout (retried): the request stopped arriving
    │   ├── OverloadedError                 429 overloaded (retried): ``retry_after_s``
    │   │   ├── StoreUnavailableError           503 store_unavailable (retried): the store cannot be reached
    │   │   ├── ShuttingDownError               503 shutting_down (retried): the replica is draining
    │   │   └── InsufficientStorageError        507 insufficient_storage (retried): the server's disk is full
    │   └── InternalError                   500 internal, and any code this client does not know
    │       └── StoreError                      502 store_error: the snapshot store refused
    │           └── StoreCorruptError           502 store_corrupt: it returned data that failed its sha256
    └── CommandExitError                ``check=True`` and the command failed; it is also the result
                                        (``exit_code``, ``stdout``, ``stderr``, ``result``)

Retried, with the same event id (the service's idempotency runs an event at most once): what the
contract says to retry — the classes marked above (``retryable``), and lost connections — never
anything else. Each retry waits the reply's Retry-After (else a backoff from 0.2 s to 2 s), and no
retry starts later than ``retry_budget_s`` (30 s by default) after the first attempt: then the last
error is raised, typed by its code.
"""

from __future__ import annotations

import asyncio
import datetime
import email.utils
import json
import ssl
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from types import TracebackType
from typing import Any, ClassVar, Final, TypeVar

import httpx
from cloudevents.conversion import to_binary
from cloudevents.http import CloudEvent, from_http
from pydantic import BaseModel, ValidationError
from rollbox.functions.contract.models import (
    ERROR,
    PARTITION_KEY,
    SANDBOX_CREATE,
    SANDBOX_CREATED,
    SANDBOX_DESTROY,
    SANDBOX_DESTROYED,
    SANDBOX_EXEC,
    SANDBOX_FORK,
    SANDBOX_FORKED,
    SANDBOX_RESULT,
    SANDBOX_RUN,
    SANDBOX_SNAPSHOT,
    SANDBOX_SNAPSHOTTED,
    ErrorCode,
    ErrorData,
    ForkRecord,
    SnapshotRecord,
)
from rollbox.runtime.spec import ExecResult, Limits, SandboxInfo, Usage

__all__ = [
    "ERROR_CLASSES",
    "Client",
    "ClientError",
    "CommandExitError",
    "EndpointNotFoundError",
    "HeadersTooLargeError",
    "IdempotencyConflictError",
    "InsufficientStorageError",
    "InternalError",
    "InvalidDataError",
    "InvalidEventError",
    "InvalidRequestError",
    "MethodNotAllowedError",
    "NotFoundError",
    "OverloadedError",
    "PayloadTooLargeError",
    "RequestTimeoutError",
    "Sandbox",
    "SandboxBusyError",
    "SandboxDiedError",
    "SandboxGoneError",
    "SandboxNotFoundError",
    "ServiceError",
    "ShuttingDownError",
    "SnapshotNotFoundError",
    "StoreCorruptError",
    "StoreError",
    "StoreUnavailableError",
    "TransportError",
    "UnknownTypeError",
    "UnsupportedError",
    "UnsupportedMediaTypeError",
]

M = TypeVar("M", bound=BaseModel)


class ClientError(Exception):
    attempts: int = 1  # how many times the event was sent before this error was raised

    def __init__(self, message: str, *, sandbox_id: str | None = None):
        super().__init__(message)
        self.message = message
        self.sandbox_id = sandbox_id


class TransportError(ClientError):
    """No usable reply: connection failed, or the response was not the expected CloudEvent."""


class ServiceError(ClientError):
    """An error event. ``retryable``: the contract says a retry of the same event may succeed."""

    retryable: ClassVar[bool] = False

    def __init__(
        self,
        status: int,
        error: ErrorData,
        *,
        sandbox_id: str | None = None,
        retry_after_s: float | None = None,
    ):
        super().__init__(f"{status} {error.code}: {error.message}", sandbox_id=sandbox_id)
        self.status = status
        self.code = error.code
        self.details = error.details
        self.retry_after_s = retry_after_s


class InvalidRequestError(ServiceError):
    """The request cannot be served as it is: fix it (the message names what is wrong)."""


class InvalidEventError(InvalidRequestError):
    pass


class InvalidDataError(InvalidRequestError):
    pass


class UnknownTypeError(InvalidRequestError):
    pass


class MethodNotAllowedError(InvalidRequestError):
    pass


class IdempotencyConflictError(InvalidRequestError):
    pass


class PayloadTooLargeError(InvalidRequestError):
    pass


class UnsupportedMediaTypeError(InvalidRequestError):
    pass


class HeadersTooLargeError(InvalidRequestError):
    pass


class UnsupportedError(InvalidRequestError):
    """Valid, but not servable by this service (a snapshot carrying a process image)."""


class NotFoundError(ServiceError):
    pass


class EndpointNotFoundError(NotFoundError):
    pass


class SnapshotNotFoundError(NotFoundError):
    pass


class SandboxNotFoundError(NotFoundError):
    pass


class SandboxGoneError(SandboxNotFoundError):
    pass


class SandboxDiedError(ServiceError):
    pass


class SandboxBusyError(ServiceError):
    pass


class RequestTimeoutError(ServiceError):
    """The server stopped waiting for the rest of the request (headers or body); nothing ran."""


class OverloadedError(ServiceError):
    pass


class StoreUnavailableError(OverloadedError):
    pass


class ShuttingDownError(OverloadedError):
    pass


class InsufficientStorageError(OverloadedError):
    """The server's disk is full: the step was refused or its record could not be written; a retry of
    the same event (later, or on another replica) runs it, or answers it from its durable state."""


class InternalError(ServiceError):
    pass


class StoreError(InternalError):
    pass


class StoreCorruptError(StoreError):
    pass


def _service_errors(root: type[ServiceError] = ServiceError) -> dict[str, type[ServiceError]]:
    """``root`` and every class under it, by name."""
    out = {root.__name__: root}
    for sub in root.__subclasses__():
        out.update(_service_errors(sub))
    return out


def _classes_of_codes() -> dict[str, type[ServiceError]]:
    """One class per error code, as the contract names it (``ErrorCode.client_class``), retried when
    the contract says the code is ``retryable``."""
    by_name = _service_errors()
    classes: dict[str, type[ServiceError]] = {}
    for code in ErrorCode:
        cls = by_name[code.client_class]  # a KeyError here: the contract names a class this module lacks
        cls.retryable = code.retryable
        classes[code.value] = cls
    return classes


# One class per error code of the contract, derived from it (a test checks that none is missing).
ERROR_CLASSES: Final[Mapping[str, type[ServiceError]]] = _classes_of_codes()

# Connection failures worth a retry of the same event: it never arrived, or its reply was lost on a
# connection the server closed. A read timeout is not one (the event is still running there).
_RETRYABLE_TRANSPORT: Final = (httpx.NetworkError, httpx.ConnectTimeout, httpx.RemoteProtocolError)


class CommandExitError(ClientError):
    """The command exited non-zero (``check=True``); carries the whole result."""

    def __init__(self, result: ExecResult):
        tail = (result.stderr or result.stdout)[-500:]
        super().__init__(f"command exited with {result.exit_code}: {tail}", sandbox_id=result.sandbox_id)
        self.result = result

    @property
    def exit_code(self) -> int:
        return self.result.exit_code

    @property
    def stdout(self) -> str:
        return self.result.stdout

    @property
    def stderr(self) -> str:
        return self.result.stderr


def _error_class(status: int, code: str = "") -> type[ServiceError]:
    """The class of an error event: by its code; a code this client does not know, by its status."""
    if code in ERROR_CLASSES:
        return ERROR_CLASSES[code]
    if status == 404:
        return NotFoundError
    if status == 410:
        return SandboxGoneError
    if status in (429, 503):
        return OverloadedError
    if status == 507:
        return InsufficientStorageError
    if status == 408:
        return RequestTimeoutError
    if 400 <= status < 500:
        return InvalidRequestError
    return InternalError


def _retry_after(resp: httpx.Response) -> float | None:
    """Retry-After in seconds: delay-seconds or an HTTP date (RFC 9110); None if absent or unreadable."""
    raw = resp.headers.get("retry-after")
    if raw is None:
        return None
    try:
        return max(0.0, float(raw))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(raw)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=datetime.UTC)
    return max(0.0, (when - datetime.datetime.now(datetime.UTC)).total_seconds())


def _backoff(attempt: int) -> float:
    return float(min(2.0, 0.1 * 2**attempt))


def _exec_data(
    code: str | None,
    command: str | None,
    stdin: str | None,
    files: Mapping[str, str] | None,
    read_files: list[str] | None,
    env: Mapping[str, str] | None,
    timeout_s: float | None,
) -> dict[str, Any]:
    data: dict[str, Any] = {"code": code, "command": command, "stdin": stdin}
    if files:
        data["files"] = dict(files)
    if read_files:
        data["read_files"] = list(read_files)
    if env:
        data["env"] = dict(env)
    if timeout_s is not None:
        data["timeout_s"] = timeout_s
    return {k: v for k, v in data.items() if v is not None}


class _Connections(httpx.AsyncBaseTransport):
    """A Client's one connection pool: keep-alive connections to the service, each taken by one request
    at a time and given back when its response is closed (a free list, most recently used first).

    A connection is an httpx transport capped at one connection, so a request's bookkeeping does not
    grow with the number of connections: httpcore's own pool rescans its connections as every request
    starts and ends, which costs 2-4x the client CPU per request at concurrency 16-64
    (``loadtest/bench_client_pool.py``). Connections are opened as concurrency needs them; at most
    ``max_idle`` are kept between requests, each for ``keepalive_expiry_s``."""

    def __init__(self, *, max_idle: int = 256, keepalive_expiry_s: float = 5.0):
        self._limits = httpx.Limits(max_connections=1, max_keepalive_connections=1,
                                    keepalive_expiry=keepalive_expiry_s)
        self._free: list[httpx.AsyncHTTPTransport] = []
        self._max_idle = max_idle
        self._closed = False
        self._tls: ssl.SSLContext | None = None  # made for the first https connection, shared by the next

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if self._closed:
            raise httpx.TransportError("the client is closed")  # httpx.AsyncClient refuses first
        conn = self._free.pop() if self._free else self._connection(request.url.scheme)
        try:
            resp = await conn.handle_async_request(request)
        except BaseException:
            await self._give_back(conn)  # its connection was closed by httpcore: the slot is reusable
            raise
        assert isinstance(resp.stream, httpx.AsyncByteStream)
        return httpx.Response(resp.status_code, headers=resp.headers, extensions=resp.extensions,
                              stream=_GivenBack(resp.stream, lambda: self._give_back(conn)))

    def _connection(self, scheme: str) -> httpx.AsyncHTTPTransport:
        """A new one-connection transport. Left to itself, httpx builds a TLS context for each, loading
        the CA bundle (tens of ms of CPU): https connections share one, and plain-HTTP ones get an empty
        context they never use (were one used for TLS, it would refuse every certificate)."""
        if scheme == "https":
            if self._tls is None:
                self._tls = httpx.create_ssl_context()
            return httpx.AsyncHTTPTransport(limits=self._limits, verify=self._tls)
        return httpx.AsyncHTTPTransport(limits=self._limits, verify=ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT))

    async def _give_back(self, conn: httpx.AsyncHTTPTransport) -> None:
        if self._closed or len(self._free) >= self._max_idle:
            await conn.aclose()
        else:
            self._free.append(conn)

    async def aclose(self) -> None:
        self._closed = True
        free, self._free = self._free, []
        for conn in free:
            await conn.aclose()


class _GivenBack(httpx.AsyncByteStream):
    """A response body whose connection goes back to the pool once the body is closed (read or not)."""

    def __init__(self, stream: httpx.AsyncByteStream, give_back: Callable[[], Awaitable[None]]):
        self._stream = stream
        self._give_back: Callable[[], Awaitable[None]] | None = give_back

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self._stream:
            yield chunk

    async def aclose(self) -> None:
        give_back, self._give_back = self._give_back, None
        try:
            await self._stream.aclose()
        finally:
            if give_back is not None:
                await give_back()


class Client:
    """A connection to one rollbox service, with one connection pool. Cheap to share between many
    concurrent episodes: every ``Sandbox`` it creates or forks sends through its pool."""

    def __init__(
        self,
        url: str,
        *,
        source: str = "/rollbox/client",
        retries: int | None = None,
        retry_budget_s: float = 30.0,
        connect_timeout_s: float = 10.0,
        reply_margin_s: float = 60.0,
        http: httpx.AsyncClient | None = None,
    ):
        """``http``: send through this httpx client (and its pool) instead of one of the Client's own;
        the caller closes it. ``retry_budget_s`` bounds the retries of one request in time: no retry
        starts later than that after its first attempt (nor one whose Retry-After would end past it);
        ``retries``, if given, also bounds their number. Then the last error is raised, typed by its
        code."""
        self.url = url.rstrip("/") + "/"
        self.source = source
        self.retries = retries
        self.retry_budget_s = retry_budget_s
        self.reply_margin_s = reply_margin_s
        self._own_http = http is None
        timeout = httpx.Timeout(connect_timeout_s, read=None, write=60.0, pool=None)
        self._http = http or httpx.AsyncClient(timeout=timeout, transport=_Connections())
        self._handles = 0  # Sandbox handles not yet killed that send through this client
        self._close_with_handles = False  # made for Sandbox.create(url): closed when its last handle is killed

    @property
    def closed(self) -> bool:
        return self._http.is_closed

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._own_http:
            await self._http.aclose()

    async def send(
        self,
        event_type: str,
        data: Mapping[str, Any],
        *,
        expect: str,
        model: type[M],
        read_timeout_s: float,
        event_id: str | None = None,
        sandbox_id: str | None = None,
    ) -> M:
        """Send one event and return the reply's data as ``model``; retries keep the event id. An event
        that names a sandbox carries it as its ``partitionkey`` (CloudEvents Partitioning): through a
        Kafka Broker, one partition per sandbox, so an episode's steps arrive in order."""
        attributes = {
            "type": event_type,
            "source": self.source,
            "id": event_id or uuid.uuid4().hex,
            "datacontenttype": "application/json",
        }
        key = sandbox_id or data.get("sandbox_id")
        if isinstance(key, str) and key:
            attributes[PARTITION_KEY] = key
        event = CloudEvent(attributes, dict(data))
        headers, body = to_binary(event)
        http = self._http
        timeout = httpx.Timeout(http.timeout.connect, read=read_timeout_s, write=60.0, pool=None)
        attempt = 0
        give_up_at = time.monotonic() + self.retry_budget_s
        while True:
            attempt += 1
            err: ClientError
            try:
                resp = await http.post(self.url, headers=headers, content=body, timeout=timeout)
            except httpx.TransportError as exc:
                err = TransportError(f"{event_type} to {self.url}: {exc!r}", sandbox_id=sandbox_id)
                err.__cause__ = exc
                retryable, wait = isinstance(exc, _RETRYABLE_TRANSPORT), _backoff(attempt)
            else:
                try:
                    return self._reply(resp, expect, model, sandbox_id)
                except ServiceError as exc:
                    err, retryable = exc, exc.retryable
                except TransportError as exc:  # not an event: a proxy's 429/503/507 page is still "retry later"
                    err, retryable = exc, resp.status_code in (408, 429, 503, 507)
                told = _retry_after(resp)
                wait = _backoff(attempt) if told is None else told
            err.attempts = attempt
            if (not retryable or (self.retries is not None and attempt > self.retries)
                    or time.monotonic() + wait > give_up_at):
                raise err
            await asyncio.sleep(wait)

    def _reply(self, resp: httpx.Response, expect: str, model: type[M], sandbox_id: str | None) -> M:
        try:
            reply = from_http(dict(resp.headers), resp.content)
        except Exception as exc:
            raise TransportError(
                f"HTTP {resp.status_code} from {self.url} is not a CloudEvent: {resp.text[:200]!r}",
                sandbox_id=sandbox_id,
            ) from exc
        sid = reply.get("subject") or sandbox_id
        try:
            if reply["type"] == ERROR:
                err = ErrorData.model_validate(reply.data)
                raise _error_class(resp.status_code, err.code)(
                    resp.status_code, err, sandbox_id=sid, retry_after_s=_retry_after(resp)
                )
            if reply["type"] != expect or resp.status_code != 200:
                raise TransportError(
                    f"expected a {expect} reply, got {reply['type']} ({resp.status_code})", sandbox_id=sid
                )
            data = reply.data if not isinstance(reply.data, (bytes, str)) else json.loads(reply.data)
            return model.model_validate(data)
        except ValidationError as exc:
            raise TransportError(f"malformed {reply['type']} reply: {exc}", sandbox_id=sid) from exc

    async def run(
        self,
        code: str | None = None,
        *,
        command: str | None = None,
        stdin: str | None = None,
        files: Mapping[str, str] | None = None,
        read_files: list[str] | None = None,
        env: Mapping[str, str] | None = None,
        timeout_s: float = 30.0,
        snapshot: str = "python",
        limits: Limits | None = None,
        metadata: Mapping[str, str] | None = None,
        check: bool = False,
        event_id: str | None = None,
        language: str | None = None,
        compile_timeout_s: float | None = None,
        cases: list[Mapping[str, str | None]] | None = None,
    ) -> ExecResult:
        """One-shot: a fresh sandbox runs ``code`` (or ``command``) once and is destroyed. With ``language``
        (docs/languages.md), ``code`` is a program in it, compiled (once) and run in its snapshot;
        ``cases`` (``{stdin, expected_stdout}``) run it once per case (after one compile, with a language)."""
        data = _exec_data(code, command, stdin, files, read_files, env, timeout_s)
        wait_s = timeout_s * max(1, len(cases or ()))
        if language is None:
            data["snapshot"] = snapshot
        else:
            data["language"] = language
            wait_s += compile_timeout_s or 10.0
        if compile_timeout_s is not None:
            data["compile_timeout_s"] = compile_timeout_s  # (without a language: refused, saying so)
        if cases is not None:
            data["cases"] = [dict(c) for c in cases]
        if limits is not None:
            data["limits"] = limits.model_dump(exclude_unset=True)
        if metadata:
            data["metadata"] = dict(metadata)
        result = await self.send(
            SANDBOX_RUN,
            data,
            expect=SANDBOX_RESULT,
            model=ExecResult,
            read_timeout_s=wait_s + self.reply_margin_s,
            event_id=event_id,
        )
        if check and result.exit_code != 0:
            raise CommandExitError(result)
        return result

    async def create(
        self,
        snapshot: str = "python",
        *,
        timeout_s: float | None = None,
        limits: Limits | None = None,
        metadata: Mapping[str, str] | None = None,
        include_isolation: bool = False,
    ) -> Sandbox:
        """A live sandbox; ``timeout_s`` is its lifetime (the service destroys it after that).
        ``include_isolation``: its ``info.isolation`` is the full isolation report (else None, and
        ``info.isolation_summary`` one line)."""
        data: dict[str, Any] = {"snapshot": snapshot}
        if timeout_s is not None:
            data["timeout_s"] = timeout_s
        if limits is not None:
            data["limits"] = limits.model_dump(exclude_unset=True)
        if metadata:
            data["metadata"] = dict(metadata)
        if include_isolation:
            data["include_isolation"] = True
        info = await self.send(
            SANDBOX_CREATE,
            data,
            expect=SANDBOX_CREATED,
            model=SandboxInfo,
            read_timeout_s=self.reply_margin_s,
        )
        return Sandbox(self, info, owns_client=False)

    async def fork(
        self,
        sandbox_id: str | None = None,
        *,
        snapshot: str | None = None,
        count: int = 1,
        limits: Limits | None = None,
        metadata: Mapping[str, str] | None = None,
        include_isolation: bool = False,
    ) -> list[Sandbox]:
        """``count`` new sandboxes from exactly one of a live sandbox (they see its files as they
        are now and keep its limits) or a snapshot (name or id). All of them, or an error."""
        data: dict[str, Any] = {"count": count}
        if sandbox_id is not None:
            data["sandbox_id"] = sandbox_id
        if snapshot is not None:
            data["snapshot"] = snapshot
        if limits is not None:
            data["limits"] = limits.model_dump(exclude_unset=True)
        if metadata:
            data["metadata"] = dict(metadata)
        if include_isolation:
            data["include_isolation"] = True
        record = await self.send(
            SANDBOX_FORK,
            data,
            expect=SANDBOX_FORKED,
            model=ForkRecord,
            read_timeout_s=self.reply_margin_s,
            sandbox_id=sandbox_id,
        )
        return [Sandbox(self, info, owns_client=False) for info in record.sandboxes]

    async def snapshot(self, sandbox_id: str, name: str | None = None) -> SnapshotRecord:
        """Checkpoint a live sandbox's files into the service's store; create or fork from the id."""
        data: dict[str, Any] = {"sandbox_id": sandbox_id}
        if name is not None:
            data["name"] = name
        return await self.send(
            SANDBOX_SNAPSHOT,
            data,
            expect=SANDBOX_SNAPSHOTTED,
            model=SnapshotRecord,
            read_timeout_s=self.reply_margin_s,
            sandbox_id=sandbox_id,
        )


class Sandbox:
    """A live sandbox. ``async with`` kills it on exit; ``kill()`` may be called any number of times.

    A handle borrows its client's connection pool. ``owns_client``: the client was made for this
    sandbox (``Sandbox.create(url)``) and is closed once it and every sandbox forked from it through
    that client are killed."""

    def __init__(self, client: Client, info: SandboxInfo, *, owns_client: bool):
        self.client = client
        self.info = info
        self._usage: Usage | None = None
        self._killed = False
        client._handles += 1
        if owns_client:
            client._close_with_handles = True

    @property
    def id(self) -> str:
        return self.info.sandbox_id

    @property
    def sandbox_id(self) -> str:
        return self.info.sandbox_id

    @classmethod
    async def create(
        cls,
        url: str | Client,
        snapshot: str = "python",
        *,
        timeout_s: float | None = None,
        limits: Limits | None = None,
        metadata: Mapping[str, str] | None = None,
        include_isolation: bool = False,
    ) -> Sandbox:
        """Create a sandbox at the service ``url`` (or through a shared ``Client``)."""
        client = url if isinstance(url, Client) else Client(url)
        try:
            sb = await client.create(snapshot, timeout_s=timeout_s, limits=limits, metadata=metadata,
                                     include_isolation=include_isolation)
        except BaseException:
            if client is not url:
                await client.aclose()
            raise
        if client is not url:
            client._close_with_handles = True
        return sb

    async def exec(
        self,
        code: str | None = None,
        *,
        command: str | None = None,
        stdin: str | None = None,
        files: Mapping[str, str] | None = None,
        read_files: list[str] | None = None,
        env: Mapping[str, str] | None = None,
        timeout_s: float = 30.0,
        check: bool = False,
        event_id: str | None = None,
    ) -> ExecResult:
        """Run ``code`` (Python) or ``command`` (shell) in this sandbox."""
        if self._killed:
            raise ClientError(f"sandbox {self.id} was killed; create a new one", sandbox_id=self.id)
        data = _exec_data(code, command, stdin, files, read_files, env, timeout_s)
        data["sandbox_id"] = self.id
        result = await self.client.send(
            SANDBOX_EXEC,
            data,
            expect=SANDBOX_RESULT,
            model=ExecResult,
            read_timeout_s=timeout_s + self.client.reply_margin_s,
            event_id=event_id,
            sandbox_id=self.id,
        )
        if check and result.exit_code != 0:
            raise CommandExitError(result)
        return result

    async def snapshot(self, name: str | None = None) -> SnapshotRecord:
        """Checkpoint this sandbox's files (it keeps running); ``.snapshot_id`` restores them anywhere
        the store reaches."""
        if self._killed:
            raise ClientError(f"sandbox {self.id} was killed; create a new one", sandbox_id=self.id)
        return await self.client.snapshot(self.id, name)

    async def fork(self, n: int = 1, *, metadata: Mapping[str, str] | None = None,
                   include_isolation: bool = False) -> list[Sandbox]:
        """``n`` new sandboxes seeing this one's files as they are now; each is killed on its own."""
        if self._killed:
            raise ClientError(f"sandbox {self.id} was killed; create a new one", sandbox_id=self.id)
        return await self.client.fork(self.id, count=n, metadata=metadata, include_isolation=include_isolation)

    async def kill(self) -> Usage | None:
        """Destroy the sandbox; its usage record, or None if the service no longer knew it."""
        if not self._killed:
            try:
                self._usage = await self.client.send(
                    SANDBOX_DESTROY,
                    {"sandbox_id": self.id},
                    expect=SANDBOX_DESTROYED,
                    model=Usage,
                    read_timeout_s=self.client.reply_margin_s,
                    sandbox_id=self.id,
                )
            except SandboxNotFoundError:  # not a wrong URL (EndpointNotFoundError): that is raised
                self._usage = None
            self._killed = True
            self.client._handles -= 1
            if self.client._close_with_handles and self.client._handles == 0:
                await self.client.aclose()
        return self._usage

    async def __aenter__(self) -> Sandbox:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            await self.kill()
        except ClientError:
            if exc is None:
                raise
