"""The seam between the service and the event families: what a handler is and what it may call.

Each family module (``sandbox.py`` now, ``snapshot.py`` next) exports ``ROUTES``, a tuple of
``Route``; the service dispatches an event to the route of its ``type``. A handler gets validated
data, the runtime and the event's identity (``EventRef``, passed on where it decides sandbox ids and
replays), and returns the reply data; it never sees HTTP or CloudEvents.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from pydantic import BaseModel
from rollbox.functions.contract.eventref import EventRef
from rollbox.functions.contract.models import CONTRACT, EventSpec
from rollbox.runtime.runtime import LimitsArg, Runtime
from rollbox.runtime.spec import ExecRequest, ExecResult, SandboxInfo, Usage

__all__ = ["EventRef", "Handler", "InProcess", "Route", "SandboxRuntime", "route"]


class SandboxRuntime(Protocol):
    """What the service and the handlers need of a runtime: ``DurableRuntime``, or ``InProcess`` around
    a ``rollbox.runtime.runtime.Runtime`` (durability off). ``event``: the request being served, where
    it decides something (the durable layer derives created sandboxes' ids from it and records replies
    under it); None for a call made outside any event."""

    async def create(
        self, snapshot: str = ..., limits: LimitsArg = ..., metadata: dict[str, str] | None = ..., *,
        event: EventRef | None = ...,
    ) -> SandboxInfo: ...

    async def exec(self, sandbox_id: str, request: ExecRequest, *, event: EventRef | None = ...) -> ExecResult: ...

    async def run(
        self,
        request: ExecRequest,
        snapshot: str = ...,
        limits: LimitsArg = ...,
        metadata: dict[str, str] | None = ...,
    ) -> ExecResult: ...

    async def destroy(self, sandbox_id: str, *, event: EventRef | None = ...) -> Usage: ...

    def live_count(self) -> int: ...

    def running_count(self) -> int:
        """Sandboxes that count against admission's live cap (the durable layer hibernates idle ones
        to make room, so only those running a step count there)."""
        ...

    def pool_sizes(self) -> dict[str, int]: ...


class InProcess:
    """A ``Runtime`` as a ``SandboxRuntime`` (``--durability off``): sandboxes live in this process
    only, their ids are random, and a redelivered event is answered by the service's idempotency
    cache alone (``event`` decides nothing here)."""

    def __init__(self, rt: Runtime):
        self.rt = rt

    async def create(self, snapshot: str = "python", limits: LimitsArg = None,
                     metadata: dict[str, str] | None = None, *, event: EventRef | None = None) -> SandboxInfo:
        return await self.rt.create(snapshot, limits, metadata)

    async def exec(self, sandbox_id: str, request: ExecRequest, *, event: EventRef | None = None) -> ExecResult:
        return await self.rt.exec(sandbox_id, request)

    async def run(self, request: ExecRequest, snapshot: str = "python", limits: LimitsArg = None,
                  metadata: dict[str, str] | None = None) -> ExecResult:
        return await self.rt.run(request, snapshot=snapshot, limits=limits, metadata=metadata)

    async def destroy(self, sandbox_id: str, *, event: EventRef | None = None) -> Usage:
        return await self.rt.destroy(sandbox_id)

    def live_count(self) -> int:
        return self.rt.live_count()

    def running_count(self) -> int:
        return self.rt.live_count()

    def pool_sizes(self) -> dict[str, int]:
        return self.rt.pool_sizes()


Handler = Callable[[SandboxRuntime, Any, EventRef | None], Awaitable[BaseModel]]
"""``handler(runtime, data, event)``: the validated data of one event, the event it came in."""


@dataclass(frozen=True)
class Route:
    """An event type of the contract bound to its handler.

    ``creates_sandbox``: the request holds a new sandbox while it runs, so it counts against the
    live-sandbox cap of admission control.
    """

    spec: EventSpec
    handler: Handler
    creates_sandbox: bool = False


def route(request_type: str, handler: Handler, *, creates_sandbox: bool = False) -> Route:
    """Bind ``handler`` to the contract's entry for ``request_type`` (which must exist)."""
    for spec in CONTRACT:
        if spec.request_type == request_type:
            return Route(spec=spec, handler=handler, creates_sandbox=creates_sandbox)
    raise LookupError(f"{request_type!r} is not in the contract; add it to contract.CONTRACT first")
