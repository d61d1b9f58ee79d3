"""Stopping background tasks when Python 3.11's ``asyncio.wait_for`` loses a cancellation."""

from __future__ import annotations

import asyncio
import sys

import pytest
from rollbox.runtime import tasks


def _looper(waits: list[asyncio.Future[None]]) -> asyncio.Task[None]:
    """A background loop like the recorder's flusher: each round waits (with a deadline) on a future."""
    loop = asyncio.get_running_loop()

    async def run() -> None:
        while True:
            fut = loop.create_future()
            waits.append(fut)
            await asyncio.wait_for(fut, 10)

    return asyncio.create_task(run())


async def test_a_loop_whose_cancel_wait_for_swallowed_is_stopped() -> None:
    waits: list[asyncio.Future[None]] = []
    task = _looper(waits)
    await asyncio.sleep(0)
    waits[-1].set_result(None)  # it finishes in the turn stop's first cancel comes in (stop runs inline)
    async with asyncio.timeout(2):
        await tasks.stop([task], every_s=0.02)
    assert task.cancelled()
    if sys.version_info < (3, 12):  # the race this guards against is real here: the first cancel was lost
        assert len(waits) == 2


async def test_stop_raises_what_a_task_failed_with_and_ends_the_others() -> None:
    async def fail() -> None:
        raise ValueError("broken loop")

    waits: list[asyncio.Future[None]] = []
    looping, failed = _looper(waits), asyncio.create_task(fail())
    await asyncio.sleep(0)
    with pytest.raises(ValueError, match="broken loop"):
        async with asyncio.timeout(2):
            await tasks.stop([looping, failed])
    assert looping.cancelled()
    await tasks.stop([])  # nothing to stop
