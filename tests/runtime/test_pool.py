"""The warm pool: Little's-law sizing, pooled acquisition, drain to zero when idle."""

from __future__ import annotations

import asyncio
import time

import pytest
from rollbox.runtime.execution import Sandbox
from rollbox.runtime.pool import Pool
from rollbox.runtime.runtime import Runtime
from rollbox.runtime.spec import ExecRequest


async def _never() -> Sandbox:
    raise AssertionError("not built in this test")


@pytest.mark.asyncio
async def test_target_follows_demand_and_falls_to_min_when_idle() -> None:
    pool = Pool("k", _never, min_size=0, max_size=8, window_s=10.0, idle_s=5.0)
    pool.t_task_s = 0.5
    now = 1000.0
    assert pool.target(now) == 0  # no demand, nothing kept
    pool.acquired.extend([now - 1] * 100)  # 100 acquisitions in the 10 s window, 0.5 s per restore
    pool.last_acquire = now - 1
    assert pool.target(now) == 6  # ceil(100 * 0.5 / 10) + 1
    pool.acquired.extend([now - 1] * 1000)
    assert pool.target(now) == 8  # clamped to max
    assert pool.target(now + 6) == 0  # idle past idle_s: back to min (scale to zero)
    burst = Pool("k", _never, min_size=0, max_size=32, window_s=10.0, idle_s=5.0)
    burst.note_burst(16)  # a fork of 16: keep 16 ready while forks recur
    burst.last_acquire = time.monotonic()
    assert burst.target() == 16
    pool.min_size = 2
    assert pool.target(now + 60) == 2


@pytest.mark.asyncio(loop_scope="module")
async def test_pool_serves_acquisitions_and_drains(rt: Runtime) -> None:
    await rt.prewarm("python", count=2)
    info = await rt.create()
    assert info.pooled and info.create_ms < 1000
    r = await rt.exec(info.sandbox_id, ExecRequest(code="print('from the pool')"))
    assert r.stdout == "from the pool\n"
    await rt.destroy(info.sandbox_id)
    pool = next(p for k, p in rt.pools.items() if k[0] == "python")
    assert pool.hits >= 1
    pool.min_size = 0
    pool.idle_s = 0.1
    for _ in range(100):
        if not pool.ready and not pool.building:
            break
        await asyncio.sleep(0.05)
    assert not pool.ready  # drained to zero after the idle window
