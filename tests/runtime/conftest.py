"""Fixtures for the runtime tests: a real Runtime (real namespaces, mounts, cgroups) per module."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest_asyncio
from rollbox.runtime.runtime import Runtime, RuntimeConfig


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def rt(tmp_path_factory) -> AsyncIterator[Runtime]:  # type: ignore[no-untyped-def]
    state = tmp_path_factory.mktemp("state")
    parent = os.environ.get("ROLLBOX_TEST_CGROUP_PARENT", f"rollbox-test-{os.getpid()}")
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


def host_mounts() -> int:
    return len(Path("/proc/self/mountinfo").read_text().splitlines())


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

