"""The seam between the service and the event families: what a handler is and what it may call.

Each family module (``sandbox.py`` now, ``snapshot.py`` next) exports ``ROUTES``, a tuple of
``Route``; the service dispatches an event to the route of its ``type``. A handler gets validated
data and the runtime, and returns the reply data; it never sees HTTP or CloudEvents.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from pydantic import BaseModel
from rollbox.functions.contract import CONTRACT, EventSpec
from rollbox.runtime.runtime import LimitsArg
from rollbox.runtime.spec import ExecRequest, ExecResult, SandboxInfo, Usage

__all__ = ["Route", "SandboxRuntime", "route"]


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
