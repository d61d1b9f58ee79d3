"""The seam between the service and the event families: what a handler is and what it may call.

Each family module (``sandbox.py`` now, ``snapshot.py`` next) exports ``ROUTES``, a tuple of
``Route``; the service dispatches an event to the route of its ``type``. A handler gets validated
data and the runtime, and returns the reply data; it never sees HTTP or CloudEvents.
"""

from __future__ import annotations

import hashlib
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Protocol

from pydantic import BaseModel
from rollbox.functions.contract.models import CONTRACT, EventSpec
from rollbox.runtime.runtime import LimitsArg
from rollbox.runtime.spec import ExecRequest, ExecResult, SandboxInfo, Usage

__all__ = ["EventRef", "Route", "SandboxRuntime", "current_event", "route"]


@dataclass
class EventRef:
    """The event a handler is serving: its CloudEvents identity (source, id) and a fingerprint of its
    content. The durable layer records replies under ``key`` and derives the ids of the sandboxes an
    event creates from it, so a redelivered event finds its reply on any replica."""

    source: str
    id: str
    fingerprint: str
    creates: int = field(default=0)  # sandboxes this event made so far (their ids are derived in order)

    @property
    def key(self) -> str:
        return hashlib.sha256(f"{self.source}\0{self.id}".encode()).hexdigest()[:32]

    def next_sandbox_id(self) -> str:
        n = self.creates
        self.creates += 1
        return "sb-" + hashlib.sha256(f"{self.key}/{n}".encode()).hexdigest()[:20]


current_event: ContextVar[EventRef | None] = ContextVar("rollbox_current_event", default=None)


class SandboxRuntime(Protocol):
    """What the service needs of ``rollbox.runtime.runtime.Runtime``."""

    async def create(
        self, snapshot: str = ..., limits: LimitsArg = ..., metadata: dict[str, str] | None = ...
    ) -> SandboxInfo: ...

    async def exec(self, sandbox_id: str, request: ExecRequest) -> ExecResult: ...

    async def run(
        self,
        request: ExecRequest,
        snapshot: str = ...,
        limits: LimitsArg = ...,
        metadata: dict[str, str] | None = ...,
    ) -> ExecResult: ...

    async def destroy(self, sandbox_id: str) -> Usage: ...

    def live_count(self) -> int: ...

    def pool_sizes(self) -> dict[str, int]: ...


Handler = Callable[[SandboxRuntime, Any], Awaitable[BaseModel]]


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
