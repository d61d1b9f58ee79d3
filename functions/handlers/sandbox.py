"""The sandbox event family: create, exec, run (one-shot), destroy.

Thin handlers: the data arrives validated, each handler makes one runtime call (passing the event on,
where it decides ids and replays) and returns its record. Errors are the runtime's own
(``rollbox.runtime.errors``); the service maps them to replies.
"""

from __future__ import annotations

from rollbox.functions.contract.models import (
    SANDBOX_CREATE,
    SANDBOX_DESTROY,
    SANDBOX_EXEC,
    SANDBOX_RUN,
    CreateData,
    DestroyData,
    ExecData,
    RunData,
)
from rollbox.functions.handlers.routing import EventRef, Route, SandboxRuntime, route
from rollbox.runtime.spec import ExecResult, SandboxInfo, Usage

__all__ = ["ROUTES", "create", "destroy", "exec_", "run"]


async def create(rt: SandboxRuntime, data: CreateData, event: EventRef | None = None) -> SandboxInfo:
    info = await rt.create(snapshot=data.snapshot, limits=data.effective_limits(), metadata=data.metadata,
                           event=event)
    return info if data.include_isolation else info.brief()


async def exec_(rt: SandboxRuntime, data: ExecData, event: EventRef | None = None) -> ExecResult:
    return await rt.exec(data.sandbox_id, data.exec_request(), event=event)


async def run(rt: SandboxRuntime, data: RunData, event: EventRef | None = None) -> ExecResult:
    if data.language is not None or data.cases is not None:  # compiled (once) and run, per case (handlers/run_code.py)
        from rollbox.functions.handlers import run_code

        return await run_code.run_event(rt, data)
    return await rt.run(
        data.exec_request(), snapshot=data.snapshot,
        limits=data.limits.model_dump(exclude_unset=True) if data.limits is not None else None, metadata=data.metadata
    )


async def destroy(rt: SandboxRuntime, data: DestroyData, event: EventRef | None = None) -> Usage:
    return await rt.destroy(data.sandbox_id, event=event)


ROUTES: tuple[Route, ...] = (
    route(SANDBOX_CREATE, create, creates_sandbox=True),
    route(SANDBOX_EXEC, exec_),
    route(SANDBOX_RUN, run, creates_sandbox=True),
    route(SANDBOX_DESTROY, destroy),
)
