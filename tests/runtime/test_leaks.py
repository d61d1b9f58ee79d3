"""1,000 sandboxes created and destroyed leave fds, mounts, cgroups and processes at baseline."""

from __future__ import annotations

import asyncio

import pytest
from rollbox.runtime.runtime import Runtime
from rollbox.runtime.spec import ExecRequest

from .conftest import fd_targets, host_mounts, host_state, sandbox_processes

pytestmark = pytest.mark.asyncio(loop_scope="module")


async def test_thousand_sandboxes_leave_nothing_behind(rt: Runtime) -> None:
    await rt.run(ExecRequest(code="print(1)"))  # zygote and pool up: part of the baseline
    fds, mounts = fd_targets(), host_mounts()
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
    for _ in range(200):  # the runtime's background work (ends, cgroup releases) settles first
        if not rt._tasks:
            break
        await asyncio.sleep(0.05)
    # reusable cgroups keep their stat files open (a cache bounded by the free-group list)
    cached = tuple(f"{d}/" for g in rt.cgroups.free
                   for d in (g.dirs.values() if hasattr(g, "dirs") else [g.path]))  # type: ignore[union-attr]
    now = {fd: t for fd, t in fd_targets().items() if not t.startswith(cached)}
    assert len(now) <= len(fds), {fd: t for fd, t in now.items() if fds.get(fd) != t}
