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


class _SlowToClose:
    """Stands in for a ready sandbox in the drain's race: the pool only asks whether it is alive and
    closes it, and a close that takes 50 ms (a real one takes ~1-5 ms) makes the race certain."""

    def __init__(self) -> None:
        self.closed = False

    def alive(self) -> bool:
        return not self.closed

    async def close(self, reason: str) -> None:
        await asyncio.sleep(0.05)
        self.closed = True


class _Source:
    alive = True


class _Ready:
    """A ready sandbox as the pool sees it: alive or not, and the zygote it came from."""

    def __init__(self, source: _Source) -> None:
        self.source, self.closed = source, False

    def alive(self) -> bool:
        return not self.closed

    async def close(self, reason: str) -> None:
        self.closed = True


@pytest.mark.asyncio
async def test_a_ready_sandbox_whose_zygote_died_is_not_handed_out() -> None:
    """A zygote killed under a busy host: its ready sandboxes still look alive for a moment (their inits
    die with it a little later). The pool hands out none of them (a run that took three in a row failed
    with "ended before its program started"), and releases them; another zygote's are served."""
    dead, well = _Source(), _Source()
    dead.alive = False
    pool = Pool("k", _never, min_size=0, max_size=8, window_s=10.0, idle_s=60.0)
    stale = [_Ready(dead) for _ in range(3)]
    fresh = _Ready(well)
    pool.ready.extend([*stale, fresh])  # type: ignore[list-item]
    assert pool.take() is fresh
    assert pool.take() is None and not pool.ready
    await asyncio.sleep(0)  # (the discarded ones close in the background)
    assert all(sb.closed for sb in stale)
    await pool.close()


@pytest.mark.asyncio
async def test_a_prewarm_during_a_drain_stops_it_at_the_new_minimum() -> None:
    """The pool drains idle sandboxes one close at a time; a prewarm that comes while it does keeps
    what it asked for (the drain used to go on to the target it had read before its first close)."""
    pool = Pool("k", _never, min_size=0, max_size=8, window_s=10.0, idle_s=0.0)
    pool.ready.extend(_SlowToClose() for _ in range(6))  # type: ignore[misc]
    pool.start()
    try:
        for _ in range(100):
            if len(pool.ready) < 6:
                break
            await asyncio.sleep(0.01)
        assert 3 <= len(pool.ready) < 6  # the drain is under way
        pool.keep_at_least(2)
        await asyncio.sleep(0.5)
        assert len(pool.ready) == 2 and all(sb.alive() for sb in pool.ready)
    finally:
        pool.min_size = 0
        await pool.close()


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


@pytest.mark.asyncio(loop_scope="module")
async def test_a_prewarm_short_of_its_target_is_logged_and_counted(
        rt: Runtime, caplog: pytest.LogCaptureFixture) -> None:
    from prometheus_client import generate_latest
    from rollbox.functions.service.metrics import Metrics

    caplog.set_level("WARNING", logger="rollbox.runtime.pool")
    await rt.prewarm("python", count=12, timeout_s=0.01)  # far more than two builders make in 10 ms
    pool = next(p for k, p in rt.pools.items() if k[0] == "python")
    try:
        assert pool.prewarm_shortfalls == 1
        warned = [r for r in caplog.records if r.name == "rollbox.runtime.pool"]
        assert len(warned) == 1 and "of the 12 ready sandboxes asked for after 0.01 s" in warned[0].getMessage()
        fields = warned[0].fields  # type: ignore[attr-defined]
        assert fields["snapshot_id"] == "python" and fields["wanted"] == 12 and fields["limits"]["pids_max"] > 0
        metrics = Metrics(live_count=lambda: 0, pool_sizes=dict, inflight=lambda: 0, pools=lambda: rt.pools.values())
        text = generate_latest(metrics.registry).decode()
        assert 'rollbox_pool_prewarm_shortfalls_total{snapshot="python"} 1.0' in text
        assert 'rollbox_pool_build_failures_total{snapshot="python"} 0.0' in text
        assert await pool.wait_ready(1, timeout_s=30)  # it does get there: a shortfall, not a failure
    finally:
        pool.min_size = 0


@pytest.mark.asyncio(loop_scope="module")
async def test_longer_timers_come_from_the_pool_and_hold(rt: Runtime) -> None:
    """A trainer thinking for minutes asks for longer idle and lifetime limits: the timers are the
    supervisor's, so such a sandbox still comes from the warm pool of the snapshot's defaults, with its
    own timers (the reaper's); other limits (what the sandbox's processes see) still do not."""
    await rt.prewarm("python", count=2)
    info = await rt.create(limits={"idle_s": 1200.0, "lifetime_s": 3600.0})
    assert info.pooled, info
    assert (info.limits.idle_s, info.limits.lifetime_s) == (1200.0, 3600.0)
    assert rt.sandboxes[info.sandbox_id].limits == info.limits
    r = await rt.exec(info.sandbox_id, ExecRequest(code="print('long think')", timeout_s=1000.0))
    assert r.stdout == "long think\n"  # (a timeout past the default lifetime of 900 s: the sandbox's own)
    await rt.destroy(info.sandbox_id)
    short = await rt.create(limits={"idle_s": 0.5})
    assert short.pooled
    for _ in range(100):  # the reaper ends it at its own idle limit
        if short.sandbox_id not in rt.sandboxes:
            break
        await asyncio.sleep(0.05)
    assert short.sandbox_id not in rt.sandboxes
    other = await rt.create(limits={"pids_max": 64})
    assert not other.pooled
    await rt.destroy(other.sandbox_id)
