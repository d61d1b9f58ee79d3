"""Fixtures for the runtime tests: a real Runtime (real namespaces, mounts, cgroups) per module."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
from rollbox.runtime.runtime import Runtime, RuntimeConfig


def cgroup_parent(name: str = "test") -> str:
    """A cgroup parent of this test process's own: rootless, under the subtree delegated to the test
    user (ROLLBOX_TEST_CGROUP_PARENT, whose own limit files are root's, so the runtime can write caps on
    the parent it makes); one per process, as the suite's workers share that subtree."""
    base = os.environ.get("ROLLBOX_TEST_CGROUP_PARENT")
    return f"{base}/{name}-{os.getpid()}" if base else f"rollbox-{name}-{os.getpid()}"


_OWN_TEMP: list[Path] = []  # this process's pytest temp base (each parallel worker has its own)


@pytest.fixture(scope="session", autouse=True)
def _own_temp(tmp_path_factory: pytest.TempPathFactory) -> None:
    _OWN_TEMP[:] = [tmp_path_factory.getbasetemp()]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def rt(tmp_path_factory) -> AsyncIterator[Runtime]:  # type: ignore[no-untyped-def]
    state = tmp_path_factory.mktemp("state")
    parent = cgroup_parent()
    runtime = Runtime(RuntimeConfig(state_dir=state, cgroup_parent=parent))
    await runtime.start()
    try:
        yield runtime
    finally:
        await runtime.close()
    assert host_state(runtime) == {"cgroups": [], "sandbox_children": 0}


def _children(zombies: bool = False) -> dict[int, list[int]]:
    """Parent pid -> child pids, from /proc. Zombies are left out unless asked for: a destroyed
    sandbox's init is a zombie until its zygote reaps it, a moment later."""
    children: dict[int, list[int]] = {}
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                fields = (p / "stat").read_text().rsplit(")", 1)[1].split()
                state, ppid = fields[0], int(fields[1])
            except (OSError, IndexError, ValueError):
                continue
            if state != "Z" or zombies:
                children.setdefault(ppid, []).append(int(p.name))
    return children


def sandbox_processes(rt: Runtime, zombies: bool = False) -> int:
    """Sandbox inits alive on the host: the children of our zygotes (rootless, a zygote runs under a
    holder process that stays outside its pid namespace)."""
    children = _children(zombies)
    zygotes = [z.proc.pid for z in rt.zygotes.values() if z.proc]
    if rt.config.rootless:
        zygotes = [c for h in zygotes for c in children.get(h, [])]
    return sum(len(children.get(z, [])) for z in zygotes)


def host_state(rt: Runtime) -> dict[str, object]:
    """What exists on the host beyond what the runtime holds (live sandboxes, the warm pool, cgroups
    kept for reuse — which must be empty)."""
    known = set(rt.sandboxes) | {sb.id for pool in rt.pools.values() for sb in pool.ready} | set(rt.cgroups.restoring)
    assert all(g.is_empty() for g in rt.cgroups.free)
    cgs = rt.cgroup_backend.leftovers() if rt.cgroup_backend else []
    return {
        "cgroups": sorted(set(cgs) - rt.cgroups.held()),
        # a sandbox being restored may not have its process yet: count only what nothing explains
        "sandbox_children": max(0, sandbox_processes(rt) - len(known)),
    }


# what a sandbox's mount leaking into the host's namespace would cover: the host's own top directories
# (a sandbox mounts its /proc, /tmp, /dev... inside its own) and this process's temporary files (where
# its runtimes keep sandboxes' roots). Other mounts come and go with what else runs on the host (the
# suite's other workers: podman's containers, mmdebstrap's chroots).
_HOST_TOPS = {"/", "/proc", "/sys", "/dev", "/dev/shm", "/dev/pts", "/dev/mqueue", "/tmp", "/run", "/etc", "/usr",
              "/var", "/var/tmp", "/home", "/root", "/opt", "/mnt", "/srv"}


def host_mounts() -> int:
    """Mounts in the host's namespace where a sandbox's leaked mount would show (``_HOST_TOPS``)."""
    own = [f"{p}/" for p in _OWN_TEMP]
    count = 0
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4]
        if point in _HOST_TOPS or any(f"{point}/".startswith(p) for p in own):
            count += 1
    return count


def fd_targets() -> dict[str, str]:
    """What each open fd of this process refers to, without the cgroup.procs files that reusable
    cgroups keep open (a cache bounded by the free-group list, handed to each sandbox of that group)."""
    found = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            target = "?"
        if not target.endswith("/cgroup.procs"):
            found[fd] = target
    return found

