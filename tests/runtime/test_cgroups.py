"""cgroup backends against the real hierarchies of this host.

v1 carries memory/pids/cpu here, so it is tested in full. This host's cgroup v2 hierarchy carries no
memory/pids/cpu controller (they are bound to v1), so for v2 only what works without them is tested
for real: creating a group, moving a process in, cgroup.kill, removal, and the refusal (naming the
missing controllers) when limits are asked of a hierarchy that cannot enforce them.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
from pathlib import Path

import pytest
from rollbox.runtime.isolation import cgroups
from rollbox.runtime.isolation.cgroup_pool import CgroupPool
from rollbox.runtime.isolation.cgroups_v1 import V1
from rollbox.runtime.isolation.cgroups_v2 import V2

MiB = 1024 * 1024
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="creates cgroups at the hierarchy root")


@needs_root
@pytest.mark.skipif("memory" not in cgroups.mounts_of("cgroup"), reason="no cgroup v1 memory hierarchy")
def test_v1_limits_stats_and_cleanup() -> None:
    backend = V1(f"rollbox-t1-{os.getpid()}")
    group = backend.prepare("sb-x", 64 * MiB, 7, 0.5)
    try:
        assert (group.dirs["memory"] / "memory.limit_in_bytes").read_text().strip() == str(64 * MiB)
        assert (group.dirs["pids"] / "pids.max").read_text().strip() == "7"
        assert (group.dirs["cpu"] / "cpu.cfs_quota_us").read_text().strip() == "50000"
        proc = subprocess.Popen(["sh", "-c", "for i in 1 2 3 4 5 6 7 8 9 10; do sleep 5 & done; wait"],
                                preexec_fn=lambda: group.attach(os.getpid()))
        time.sleep(0.5)
        stats = group.stats()
        assert stats.pids_max_hits >= 1  # 1 sh + 10 sleeps > 7
        proc.kill()
        for pid in map(int, (group.dirs["pids"] / "cgroup.procs").read_text().split()):
            os.kill(pid, 9)
        proc.wait()
    finally:
        group.close()
        backend.close()
    assert not any(d.exists() for d in group.dirs.values())


@needs_root
@pytest.mark.skipif("cpu" not in cgroups.mounts_of("cgroup"), reason="no cgroup v1 cpu hierarchy")
def test_v1_cpu_cap_stays_under_an_ancestors_quota_and_bounds_every_sandbox() -> None:
    """The parent of all sandboxes is capped at what its ancestors allow (a container's CPU limit) less
    the reserve; a sandbox asking for more gets the cap (v1 refuses a child quota above its parent's),
    and every sandbox's group has the same cpu.shares."""
    roots = cgroups.mounts_of("cgroup")
    outer = [Path(roots[c]) / f"rollbox-t5-{os.getpid()}" for c in dict.fromkeys(("memory", "pids", "cpu", "cpuacct"))]
    for d in dict.fromkeys(outer):
        d.mkdir()
    try:
        (Path(roots["cpu"]) / outer[0].name / "cpu.cfs_quota_us").write_text("50000")  # a container's 0.5 CPU
        backend = V1(f"{outer[0].name}/rt", reserved_cores=0.25)
        try:
            assert (backend.cpu.available_cores, backend.cpu.cap_cores) == (0.5, 0.25)
            assert (backend.parents["cpu"] / "cpu.cfs_quota_us").read_text().strip() == "25000"
            groups = [backend.prepare(f"sb-{i}", 64 * MiB, 8, cores) for i, cores in enumerate((2.0, 0.1))]
            try:
                quotas = [(g.dirs["cpu"] / "cpu.cfs_quota_us").read_text().strip() for g in groups]
                assert quotas == ["25000", "10000"]
                assert [(g.dirs["cpu"] / "cpu.shares").read_text().strip() for g in groups] == ["1024", "1024"]
            finally:
                for g in groups:
                    g.close()
        finally:
            backend.close()
    finally:
        for d in dict.fromkeys(outer):
            d.rmdir()
    assert not any(d.exists() for d in outer)


@needs_root
@pytest.mark.skipif("memory" not in cgroups.mounts_of("cgroup"), reason="no cgroup v1 memory hierarchy")
@pytest.mark.asyncio
async def test_pool_keeps_at_most_its_size_reuses_and_removes_the_rest() -> None:
    backend = V1(f"rollbox-t3-{os.getpid()}")
    tasks: list[asyncio.Future[None]] = []
    pool = CgroupPool(keep=1, background=lambda work: tasks.append(asyncio.ensure_future(work)))
    pool.open(backend)
    a, b = (pool.acquire(name, 64 * MiB, 16, 0.5) for name in ("sb-a", "sb-b"))
    assert a is not None and b is not None
    assert pool.held() == {*a.paths(), *b.paths()}
    pool.release(a)
    pool.release(b)  # past the pool's size: removed
    await asyncio.gather(*tasks)
    assert pool.free == [a] and not any(Path(p).exists() for p in b.paths())
    assert pool.acquire("sb-c", 32 * MiB, 8, 0.25) is a  # reused, with the new limits
    assert (a.dirs["pids"] / "pids.max").read_text().strip() == "8"  # type: ignore[attr-defined]
    pool.release(a)
    await pool.close()
    assert pool.held() == set() and not any(Path(p).exists() for p in a.paths())


def test_v2_without_controllers_refuses_and_names_them() -> None:
    roots = cgroups.mounts_of("cgroup2")
    if "" not in roots:
        pytest.skip("no cgroup2 hierarchy mounted")
    available = set((Path(roots[""]) / "cgroup.controllers").read_text().split())
    if {"memory", "pids", "cpu"} <= available:
        pytest.skip("this host delegates v2 controllers; the full path is used instead")
    with pytest.raises(OSError, match="lacks controllers"):
        V2(f"rollbox-t2-{os.getpid()}")
    assert not (Path(roots[""]) / f"rollbox-t2-{os.getpid()}").exists()  # nothing left behind


@needs_root
def test_v2_group_attach_kill_and_remove() -> None:
    roots = cgroups.mounts_of("cgroup2")
    if "" not in roots:
        pytest.skip("no cgroup2 hierarchy mounted")
    backend = V2(f"rollbox-t3-{os.getpid()}", require=())
    group = backend.prepare("sb-y", 64 * MiB, 8, 1.0)
    try:
        proc = subprocess.Popen(["sleep", "30"])
        group.attach(proc.pid)
        assert str(proc.pid) in (group.path / "cgroup.procs").read_text().split()
        group.kill()  # cgroup.kill: every process in the group, from outside
        assert proc.wait(timeout=5) == -9
    finally:
        group.close()
        backend.close()
    assert not group.path.exists() and not backend.parent.exists()


@needs_root
@pytest.mark.parametrize("version", ["v1", "v2"])
def test_a_group_closed_with_processes_in_it_kills_them_and_goes(version: str) -> None:
    """Removing a group that still holds processes (a sandbox's, not gone yet) kills them first, then
    removes it: v2 through cgroup.kill, v1 by killing each process listed (again while new ones come)."""
    if version == "v1":
        if "pids" not in cgroups.mounts_of("cgroup"):
            pytest.skip("no cgroup v1 pids hierarchy")
        backend: V1 | V2 = V1(f"rollbox-t6-{os.getpid()}")
    else:
        if "" not in cgroups.mounts_of("cgroup2"):
            pytest.skip("no cgroup2 hierarchy mounted")
        backend = V2(f"rollbox-t6-{os.getpid()}", require=())
    group = backend.prepare("sb-z", 64 * MiB, 16, 1.0)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        procs = [subprocess.Popen(["sh", "-c", "sleep 30 & sleep 30 & wait"],
                                  preexec_fn=lambda: group.attach(os.getpid())) for _ in range(2)]
        time.sleep(0.3)
        assert len(group.pids()) == 6, group.pids()
        group.close()  # (before: EBUSY for as long as they lived)
        assert [p.wait(timeout=5) for p in procs] == [-9, -9]
    finally:
        for p in procs:
            p.kill()
        for d in group.paths():
            if Path(d).exists():
                subprocess.run(["sh", "-c", f"kill -9 $(cat {d}/cgroup.procs) 2>/dev/null; sleep 0.5; rmdir {d}"])
        assert backend.close() == []
    assert not any(Path(d).exists() for d in group.paths())


def test_select_reports_why() -> None:
    backend, why = cgroups.select("rollbox-none", prefer="none")
    assert backend is None and why == "disabled"


@needs_root
@pytest.mark.asyncio
async def test_start_sweeps_what_a_dead_supervisor_left(tmp_path: Path) -> None:
    from rollbox.runtime.runtime import Runtime, RuntimeConfig

    parent = f"rollbox-t4-{os.getpid()}"
    backend, _ = cgroups.select(parent, "auto")
    assert backend is not None
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = backend.prepare(f"{dead.pid}-sb-stale", 64 * MiB, 8, 1.0)  # a dead runtime's cgroup
    (tmp_path / "zygotes" / f"{dead.pid}-abc").mkdir(parents=True)
    alive = (tmp_path / "zygotes" / "1-def")  # pid 1 is alive: never swept
    alive.mkdir()
    rt = Runtime(RuntimeConfig(state_dir=tmp_path, cgroup_parent=parent))
    await rt.start()
    try:
        assert not any(Path(p).exists() for p in stale.paths())
        assert not (tmp_path / "zygotes" / f"{dead.pid}-abc").exists() and alive.exists()
    finally:
        await rt.close()
