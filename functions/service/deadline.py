"""The per-request deadline: every event gets its reply within ``--request-deadline-s`` (plus the exec
time it asks for, its ``timeout_s``), however long its work waits.

Work can wait longer than a client does: behind another step of the same sandbox, for room under the
live cap, for a zygote's fork, for store calls queued behind slow ones, or for the first delivery of
the same event (a retry joins it). Each wait has its own bound, but they add up, and a client that
hears nothing cannot tell a slow server from a lost request. So the reply is sent at the deadline:
429 ``overloaded`` with Retry-After, and the work goes on. It is not cancelled (a step half done is
no better than one done: its commit may land either way); what it ends with is kept as the event's
reply, so the client's retry of the same event (same source and id) gets it from the idempotency
cache, or runs it again if it was refused.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

from pydantic import BaseModel
from rollbox.runtime.spec import ExecRequest

__all__ = ["budget_s", "within"]

T = TypeVar("T")

_LATE: set[asyncio.Task[Any]] = set()  # work whose reply was the deadline's: held until it ends


def budget_s(deadline_s: float, data: BaseModel) -> float:
    """The time an event may take before its reply: the deadline, plus the run time it asks for (an
    exec's or a run's ``timeout_s``); 0 turns the deadline off (``math.inf``)."""
    if deadline_s <= 0:
        return float("inf")
    own = data.timeout_s if isinstance(data, ExecRequest) else 0.0
    return deadline_s + own


async def within(work: Coroutine[Any, Any, T], seconds: float) -> tuple[bool, T | None]:
    """Run ``work`` as a task; (True, its result) if it ends within ``seconds``, else (False, None)
    while it goes on in the background (its outcome kept by whoever it reports to)."""
    if seconds == float("inf"):
        return True, await work
    task = asyncio.ensure_future(work)
    done, _ = await asyncio.wait({task}, timeout=max(seconds, 0.0))
    if done:
        return True, task.result()
    _LATE.add(task)
    task.add_done_callback(_ended)
    return False, None


def late_count() -> int:
    """How many events answered at their deadline are still being worked on."""
    return len(_LATE)


def _ended(task: asyncio.Task[Any]) -> None:
    _LATE.discard(task)
    if not task.cancelled():
        task.exception()  # retrieved: the work logs its own failures
