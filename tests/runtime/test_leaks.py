"""1,000 sandboxes created and destroyed leave fds, mounts, cgroups and processes at baseline."""

from __future__ import annotations

import asyncio

import pytest
from rollbox.runtime.runtime import Runtime
from rollbox.runtime.spec import ExecRequest

from .conftest import host_mounts, host_state, open_fds, sandbox_processes

pytestmark = pytest.mark.asyncio(loop_scope="module")


async def test_thousand_sandboxes_leave_nothing_behind(rt: Runtime) -> None:
    await rt.run(ExecRequest(code="print(1)"))  # zygote and pool up: part of the baseline
    fds, mounts = open_fds(), host_mounts()
    for i in range(1000):
        info = await rt.create()
        if i % 100 == 0:
            r = await rt.exec(info.sandbox_id, ExecRequest(command="echo $$"))
            assert r.stdout == "2\n"  # a fresh pid namespace every time: the worker is pid 2
        await rt.destroy(info.sandbox_id)
    for pool in rt.pools.values():  # let the pool drain what it holds for the fd count
        await pool.close()
    rt.pools.clear()
    assert host_state(rt) == {"cgroups": [], "sandbox_children": 0}
    for _ in range(100):  # and the zygotes reaped every one of them: no zombie piles up
        if sandbox_processes(rt, zombies=True) == 0:
            break
        await asyncio.sleep(0.01)
    assert sandbox_processes(rt, zombies=True) == 0
    assert host_mounts() == mounts
    assert open_fds() <= fds
