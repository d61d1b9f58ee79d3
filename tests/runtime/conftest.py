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
    runtime = Runtime(RuntimeConfig(state_dir=state, cgroup_parent=f"rollbox-test-{os.getpid()}"))
    await runtime.start()
    try:
        yield runtime
    finally:
        await runtime.close()
    assert host_state(runtime) == {"cgroups": [], "sandbox_children": 0}


def zygote_children() -> int:
    """Processes whose parent is one of our zygotes (sandbox inits), counted from /proc."""
    mine = os.getpid()
    zygotes = set()
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if int((p / "stat").read_text().rsplit(")", 1)[1].split()[1]) == mine:
                    zygotes.add(int(p.name))
            except (OSError, IndexError, ValueError):
                continue
    n = 0
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if int((p / "stat").read_text().rsplit(")", 1)[1].split()[1]) in zygotes:
                    n += 1
            except (OSError, IndexError, ValueError):
                continue
    return n


def host_state(rt: Runtime) -> dict[str, object]:
    """What exists on the host beyond the sandboxes the runtime knows (live ones and the warm pool)."""
    known = set(rt.sandboxes) | {sb.id for pool in rt.pools.values() for sb in pool.ready} | rt.restoring
    cgs = rt.cgroup_backend.leftovers() if rt.cgroup_backend else []
    return {
        "cgroups": [c for c in cgs if os.path.basename(c) not in known],
        "sandbox_children": zygote_children() - len(known),
    }


def host_mounts() -> int:
    return len(Path("/proc/self/mountinfo").read_text().splitlines())


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))
