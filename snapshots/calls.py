"""Store calls off the event loop, on their own bounded thread pool, each with a deadline.

A hung store (an S3 endpoint that accepts connections and never answers) must fail only the
requests that need it, and fast; work that does not touch the store must not wait behind it:

    await calls.run(fn, *args, doing="reading the manifest of python-sci")

runs ``fn`` on this pool's threads (never the loop's default executor, which the runtime uses for
cgroups, packing and clean-up) and raises ``StoreUnavailable`` (503 ``store_unavailable`` with
Retry-After) once ``deadline_s`` has passed. A call that times out keeps its thread until the
store client's own socket timeouts end it (the pool is bounded: calls queued behind stuck ones hit
their deadline too, so nothing waits longer than its deadline). Its outcome is unknown to the
caller: a write may still land, which the callers that write treat as such (see
``DurableRuntime._commit``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from rollbox.runtime.errors import StoreUnavailable

__all__ = ["StoreCalls", "StoreDeadline"]

T = TypeVar("T")


class StoreDeadline(StoreUnavailable):
    """A store call did not finish within its deadline; whether a write it made landed is unknown."""


class StoreCalls:
    def __init__(self, threads: int = 8, deadline_s: float = 8.0, *, name: str = "rollbox-store"):
        self.deadline_s = deadline_s
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix=name)

    async def run(self, fn: Callable[..., T], /, *args: Any, doing: str, deadline_s: float | None = None) -> T:
        limit = self.deadline_s if deadline_s is None else deadline_s
        fut = asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
        try:
            return await asyncio.wait_for(asyncio.shield(fut), limit)
        except TimeoutError:
            fut.add_done_callback(_consume)  # it ends in its own time; nobody waits for it now
            raise StoreDeadline(f"the store did not answer within {limit:g} s while {doing}") from None

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _consume(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()  # retrieved: no "exception was never retrieved" at exit
