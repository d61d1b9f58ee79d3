"""Fair CPU with real cgroups: equal weight per sandbox whatever it runs, all sandboxes together capped
below the host's cores (a reserve for the supervisor); without cgroups, what falls back (nice).

CPU time is read from the host (cpuacct.usage / cpu.stat of each sandbox's group), never from inside.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
from rollbox.runtime.isolation import cgroups
from rollbox.runtime.isolation.cgroups_v1 import V1, V1Group
from rollbox.runtime.isolation.cgroups_v2 import V2, V2Group
from rollbox.runtime.isolation.rlimits import FALLBACK_NICE
from rollbox.runtime.runtime import Runtime, RuntimeConfig
from rollbox.runtime.spec import ExecRequest, Limits

from .conftest import cgroup_parent

pytestmark = pytest.mark.asyncio

SECS = 3.0


def busy(processes: int, secs: float) -> str:
    """Code that keeps ``processes`` processes spinning for ``secs`` seconds, then reaps them."""
    return (
        "import os, time\n"
        f"end = time.monotonic() + {secs}\n"
        f"for _ in range({processes} - 1):\n"
        "    if os.fork() == 0:\n"
        "        while time.monotonic() < end: pass\n"
        "        os._exit(0)\n"
        "while time.monotonic() < end: pass\n"
        f"for _ in range({processes} - 1): os.wait()\n"
    )


def _throttled_periods(rt: Runtime) -> int:
    """Periods in which the cap on all sandboxes held them back (their parent group's nr_throttled)."""
    b = rt.cgroup_backend
    parent = b.parents["cpu"] if isinstance(b, V1) else b.parent if isinstance(b, V2) else None
    assert parent is not None
    return cgroups.read_kv(parent / "cpu.stat").get("nr_throttled", 0)


@pytest_asyncio.fixture
async def capped(tmp_path: Path) -> AsyncIterator[Runtime]:
    """A runtime whose sandboxes may use 1 CPU together (the rest is reserved)."""
    rt = Runtime(RuntimeConfig(state_dir=tmp_path, cgroup_parent=cgroup_parent("fair"),
                               cpu_reserved_cores=cgroups.host_cores() - 1.0, pool_max=0))
    await rt.start()
    made = rt.cgroup_backend.leftovers() if rt.cgroup_backend else []
    try:
        if rt.cgroup_backend is None or rt.cgroup_backend.cpu.cap_cores is None:
            pytest.skip(f"no writable cpu cgroup here: {rt.cgroup_reason}")
        yield rt
    finally:
        await rt.close()
    b = rt.cgroup_backend
    assert made == [] and b is not None and b.leftovers() == []
    parents = list(b.parents.values()) if isinstance(b, V1) else [b.parent] if isinstance(b, V2) else []
    assert parents and not any(p.exists() for p in parents)  # the runtime removed its parent group


@pytest.mark.quiet  # the cap's level shows only when nothing else on the box takes the CPU
async def test_sandboxes_get_equal_cpu_whatever_they_run_under_one_cap(capped: Runtime) -> None:
    """One sandbox running 20 busy processes and one running 1, both under a 1-CPU cap on all sandboxes:
    each gets about half (per-process weights would give 20:1), and together no more than the cap."""
    rt = capped
    assert rt.cgroup_backend is not None and rt.cgroup_backend.cpu.cap_cores == 1.0
    lim = Limits(cpu_max_cores=1.0, pids_max=64)
    many, one = (await rt.create(limits=lim)), (await rt.create(limits=lim))
    try:
        groups = [rt.sandboxes[s.sandbox_id].group for s in (many, one)]
        assert all(g is not None for g in groups)
        before = [g.stats().cpu_s for g in groups if g is not None]
        throttled_before = _throttled_periods(rt)
        t0 = asyncio.get_running_loop().time()
        results = await asyncio.gather(rt.exec(many.sandbox_id, ExecRequest(code=busy(20, SECS), timeout_s=30)),
                                       rt.exec(one.sandbox_id, ExecRequest(code=busy(1, SECS), timeout_s=30)))
        wall = asyncio.get_running_loop().time() - t0
        after = [g.stats().cpu_s for g in groups if g is not None]
        throttled = _throttled_periods(rt) - throttled_before
        assert [r.exit_code for r in results] == [0, 0], [r.stderr for r in results]
        used = [a - b for a, b in zip(after, before, strict=True)]
        # Each sandbox's fair share is half of what both used. CFS spreads a group's weight over the CPUs
        # it runs on, so the one-process sandbox (on one CPU of two) gets somewhat less than half
        # (measured 38-47 % here); with a weight per process it would get 1/21 (5 %), with 4:1, 20 %.
        got = f"20 processes got {used[0]:.2f} CPU-s, 1 process got {used[1]:.2f} CPU-s"
        assert used[1] >= 0.3 * sum(used) and used[0] >= 0.3 * sum(used), got
        assert sum(used) <= 1.0 * wall * 1.1, f"{sum(used):.2f} CPU-s in {wall:.2f} s under a 1-CPU cap"
        # The cap is not far below 1 CPU: in each period in which it held the sandboxes back (their parent
        # was throttled) they had used all of it, 1 CPU for a period. On a quiet box that is every period
        # of the run (so >= 0.8 CPU-s per second); on a busy one the host's other work may leave them
        # less than the cap in some periods, which are not the cap's doing and are not counted.
        cap_s = throttled * cgroups.CPU_PERIOD_US / 1e6
        if cap_s < 0.25 * SECS:  # the host's other work kept them under the cap: it was not tested (say so)
            pytest.skip(f"the cap held the sandboxes back in only {throttled} periods ({cap_s:.2f} s of {SECS} s): "
                        "the box is too busy to check the cap's level (fairness and the upper bound were checked)")
        assert sum(used) >= 0.8 * cap_s, \
            f"only {sum(used):.2f} CPU-s used in {throttled} throttled periods ({cap_s:.1f} s): the cap is below 1 CPU"
    finally:
        for s in (many, one):
            await rt.destroy(s.sandbox_id)
    rep = rt.isolation_report()["cpu"]
    assert "equal weight per sandbox" in rep and "capped at 1 of" in rep, rep


async def test_weights_and_caps_are_written(capped: Runtime) -> None:
    """Each sandbox's group has the equal weight; a sandbox asking for more CPU than the cap gets the
    cap (cgroup v1 refuses a child quota above its parent's); the report says so."""
    rt = capped
    backend = rt.cgroup_backend
    assert backend is not None
    info = await rt.create(limits=Limits(cpu_max_cores=float(cgroups.host_cores() + 2)))
    try:
        group = rt.sandboxes[info.sandbox_id].group
        assert group is not None
        d = group.dirs["cpu"] if isinstance(group, V1Group) else group.path if isinstance(group, V2Group) else None
        assert d is not None
        if isinstance(group, V1Group):
            assert (d / "cpu.shares").read_text().strip() == "1024"
            assert (d / "cpu.cfs_quota_us").read_text().strip() == "100000"
            assert (d.parent / "cpu.cfs_quota_us").read_text().strip() == "100000"
        else:
            assert (d / "cpu.weight").read_text().strip() == "100"
            assert (d / "cpu.max").read_text().split() == ["100000", "100000"]
            assert (d.parent / "cpu.max").read_text().split() == ["100000", "100000"]
        assert "this sandbox: at most 1 CPU" in info.isolation["cpu"], info.isolation["cpu"]
    finally:
        await rt.destroy(info.sandbox_id)


async def test_without_cgroups_sandboxes_run_niced(tmp_path: Path) -> None:
    """cgroups off: every sandbox process runs at FALLBACK_NICE (the supervisor keeps its share where
    it competes with them one by one), and the report says what fell back."""
    async with Runtime(RuntimeConfig(state_dir=tmp_path, cgroup="none", pool_max=0)) as rt:
        assert "no cgroup" in rt.isolation_report()["cpu"]
        info = await rt.create()
        try:
            r = await rt.exec(info.sandbox_id, ExecRequest(command="nice; sh -c nice"))
            assert r.stdout.split() == [str(FALLBACK_NICE)] * 2, r
            assert f"fell back to nice {FALLBACK_NICE}" in info.isolation["cpu"]
            assert f"nice {FALLBACK_NICE}" in info.isolation["rlimits"]
        finally:
            await rt.destroy(info.sandbox_id)
