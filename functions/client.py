"""An async client for trainers, shaped like E2B's SDK, speaking CloudEvents (binary mode) over httpx.

    async with await Sandbox.create("http://127.0.0.1:8080", metadata={"episode": "7"}) as sb:
        r = await sb.exec(code="print(6 * 7)")
        assert r.stdout == "42\\n"

    r = await Client("http://127.0.0.1:8080").run(code="print(1)")   # one-shot

Exceptions (one root; each carries ``sandbox_id`` when there is one):

    ClientError
    ├── TransportError          the service could not be reached, or its reply was not an event
    ├── ServiceError            an error event (``status``, ``code``, ``message``, ``details``)
    │   ├── InvalidRequestError     400, 409, 413, 415: fix the request
    │   ├── NotFoundError           404: no such sandbox or snapshot
    │   │   └── SandboxGoneError    410 sandbox_gone: destroyed or expired (``details['reason']``)
    │   ├── SandboxDiedError        410 sandbox_died: it ended while in use
    │   ├── SandboxBusyError        409 sandbox_busy (after the retries): another replica was first
    │   ├── OverloadedError         429, 503 (after the retries): ``retry_after_s``
    │   │   ├── StoreUnavailableError   503 store_unavailable: the store cannot be reached
    │   │   └── ShuttingDownError       503 shutting_down: the replica is draining
    │   └── InternalError           500 and anything else (502: the snapshot store failed)
    └── CommandExitError        ``check=True`` and the command failed; it is also the result
                                (``exit_code``, ``stdout``, ``stderr``, ``result``)

Every request is retried on 429, 503, 409 sandbox_busy and transport failures with the same event id
(waiting Retry-After), so the service's idempotency guarantees it runs at most once.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
import uuid
from collections.abc import Mapping
from types import TracebackType
from typing import Any, TypeVar

import httpx
from cloudevents.conversion import to_binary
from cloudevents.http import CloudEvent, from_http
from pydantic import BaseModel, ValidationError
from rollbox.functions.contract import (
    ERROR,
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
    ErrorData,
    ForkRecord,
    SnapshotRecord,
)
from rollbox.runtime.spec import ExecResult, Limits, SandboxInfo, Usage

__all__ = [
    "Client",
    "ClientError",
    "CommandExitError",
    "InternalError",
    "InvalidRequestError",
    "NotFoundError",
    "OverloadedError",
    "Sandbox",
    "SandboxBusyError",
    "SandboxDiedError",
    "SandboxGoneError",
    "ServiceError",
    "ShuttingDownError",
    "StoreUnavailableError",
    "TransportError",
]

M = TypeVar("M", bound=BaseModel)


class ClientError(Exception):
    def __init__(self, message: str, *, sandbox_id: str | None = None):
        super().__init__(message)
        self.message = message
        self.sandbox_id = sandbox_id


class TransportError(ClientError):
    """No usable reply: connection failed, or the response was not the expected CloudEvent."""


class ServiceError(ClientError):
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
    pass


class NotFoundError(ServiceError):
    pass


class SandboxGoneError(NotFoundError):
    pass


class SandboxDiedError(ServiceError):
    pass


class SandboxBusyError(ServiceError):
    pass


class OverloadedError(ServiceError):
    pass


class StoreUnavailableError(OverloadedError):
    pass


class ShuttingDownError(OverloadedError):
    pass


class InternalError(ServiceError):
    pass


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
    by_code = {"sandbox_busy": SandboxBusyError, "sandbox_gone": SandboxGoneError,
               "store_unavailable": StoreUnavailableError, "shutting_down": ShuttingDownError}
    if code in by_code:
        return by_code[code]
    if status in (400, 409, 413, 415):
        return InvalidRequestError
    if status == 404:
        return NotFoundError
    if status == 410:
        return SandboxDiedError
    if status in (429, 503):
        return OverloadedError
    return InternalError


def _retry_after(resp: httpx.Response) -> float | None:
    raw = resp.headers.get("retry-after")
    try:
        return float(raw) if raw is not None else None
    except ValueError:
        return None


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


class Client:
    """A connection to one rollbox service. Cheap to share between many concurrent episodes."""

    def __init__(
        self,
        url: str,
        *,
        source: str = "/rollbox/client",
        retries: int = 3,
        retry_budget_s: float = 10.0,
        connect_timeout_s: float = 10.0,
        reply_margin_s: float = 60.0,
        pools: int = 16,
        http: httpx.AsyncClient | None = None,
    ):
        """``pools``: requests are spread round-robin over this many httpx clients. One connection pool
        shared by dozens of concurrent requests costs ~10 ms of CPU per request in its bookkeeping
        (measured at 64); small pools keep it near 1 ms. Ignored when ``http`` is given.
        ``retries`` and ``retry_budget_s`` bound the retries of one request: at most that many, and no
        wait that would end past the budget (then the last error is raised, typed by its code)."""
        self.url = url.rstrip("/") + "/"
        self.source = source
        self.retries = retries
        self.retry_budget_s = retry_budget_s
        self.reply_margin_s = reply_margin_s
        self._own_http = http is None
        timeout = httpx.Timeout(connect_timeout_s, read=None, write=60.0, pool=None)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=32)
        self._pools = [http] if http else [httpx.AsyncClient(timeout=timeout, limits=limits) for _ in range(pools)]
        self._turn = itertools.count()

    @property
    def closed(self) -> bool:
        return all(http.is_closed for http in self._pools)

    @property
    def _http(self) -> httpx.AsyncClient:
        return self._pools[next(self._turn) % len(self._pools)]

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._own_http:
            for http in self._pools:
                await http.aclose()

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
        """Send one event and return the reply's data as ``model``; retries keep the event id."""
        event = CloudEvent(
            {
                "type": event_type,
                "source": self.source,
                "id": event_id or uuid.uuid4().hex,
                "datacontenttype": "application/json",
            },
            dict(data),
        )
        headers, body = to_binary(event)
        http = self._http
        timeout = httpx.Timeout(http.timeout.connect, read=read_timeout_s, write=60.0, pool=None)
        attempt = 0
        give_up_at = time.monotonic() + self.retry_budget_s
        while True:
            try:
                resp = await http.post(self.url, headers=headers, content=body, timeout=timeout)
            except httpx.TransportError as exc:
                if attempt >= self.retries:
                    raise TransportError(f"{event_type} to {self.url}: {exc!r}", sandbox_id=sandbox_id) from exc
                attempt += 1
                await asyncio.sleep(0.1 * 2**attempt)
                continue
            retryable = resp.status_code in (429, 503) or (resp.status_code == 409 and "retry-after" in resp.headers)
            wait = _retry_after(resp) or 0.1 * 2 ** (attempt + 1)
            if retryable and attempt < self.retries and time.monotonic() + wait <= give_up_at:
                attempt += 1
                await asyncio.sleep(wait)
                continue
            return self._reply(resp, expect, model, sandbox_id)

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
    ) -> ExecResult:
        """One-shot: a fresh sandbox runs ``code`` (or ``command``) once and is destroyed."""
        data = _exec_data(code, command, stdin, files, read_files, env, timeout_s)
        data["snapshot"] = snapshot
        if limits is not None:
            data["limits"] = limits.model_dump(exclude_unset=True)
        if metadata:
            data["metadata"] = dict(metadata)
        result = await self.send(
            SANDBOX_RUN,
            data,
            expect=SANDBOX_RESULT,
            model=ExecResult,
            read_timeout_s=timeout_s + self.reply_margin_s,
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
    ) -> Sandbox:
        """A live sandbox; ``timeout_s`` is its lifetime (the service destroys it after that)."""
        data: dict[str, Any] = {"snapshot": snapshot}
        if timeout_s is not None:
            data["timeout_s"] = timeout_s
        if limits is not None:
            data["limits"] = limits.model_dump(exclude_unset=True)
        if metadata:
            data["metadata"] = dict(metadata)
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
    """A live sandbox. ``async with`` kills it on exit; ``kill()`` may be called any number of times."""

    def __init__(self, client: Client, info: SandboxInfo, *, owns_client: bool):
        self.client = client
        self.info = info
        self._owns_client = owns_client
        self._usage: Usage | None = None
        self._killed = False

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
    ) -> Sandbox:
        """Create a sandbox at the service ``url`` (or through a shared ``Client``)."""
        client = url if isinstance(url, Client) else Client(url)
        try:
            sb = await client.create(snapshot, timeout_s=timeout_s, limits=limits, metadata=metadata)
        except BaseException:
            if client is not url:
                await client.aclose()
            raise
        sb._owns_client = client is not url
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

    async def fork(self, n: int = 1, *, metadata: Mapping[str, str] | None = None) -> list[Sandbox]:
        """``n`` new sandboxes seeing this one's files as they are now; each is killed on its own."""
        if self._killed:
            raise ClientError(f"sandbox {self.id} was killed; create a new one", sandbox_id=self.id)
        return await self.client.fork(self.id, count=n, metadata=metadata)

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
            except NotFoundError:
                self._usage = None
            self._killed = True
            if self._owns_client:
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
