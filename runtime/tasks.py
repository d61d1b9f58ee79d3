"""Stopping background tasks on Python 3.11, whose ``asyncio.wait_for`` can lose a cancellation.

In 3.11, a task cancelled while ``wait_for`` waits, in the same turn of the event loop as the future it
waits on finishes, gets that future's result instead of ``CancelledError`` (gh-86296; 3.12 rewrote
``wait_for`` on ``asyncio.timeout``). A ``while True`` loop task then goes on, and ``task.cancel();
await task`` waits for ever (the likely cause of a replica's drain that hung once in ``Recorder.close``,
awaiting the flusher's loop, every thread idle). ``stop`` cancels again until every task has ended."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

__all__ = ["stop"]

RECANCEL_S = 0.1


async def stop(tasks: Iterable[asyncio.Task[object]], *, every_s: float = RECANCEL_S) -> None:
    """Cancel ``tasks`` and return once each has ended (cancelled again every ``every_s`` until then).
    An exception a task ended with, other than its cancellation, is raised (the first one)."""
    tasks = list(tasks)
    pending = {t for t in tasks if not t.done()}
    while pending:
        for t in pending:
            t.cancel()
        _, pending = await asyncio.wait(pending, timeout=every_s)
    for t in tasks:
        if not t.cancelled() and (exc := t.exception()) is not None:
            raise exc
