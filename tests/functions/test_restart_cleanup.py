"""`kill -9` of a server under load, a restart on the same home within half a second: the new server
clears what the dead one left (sandbox cgroups, zygote staging dirs, mounts, scratch layers) within
10 s, though the dead server may still be a zombie and its sandboxes still dying. Real server, real
cgroups."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from rollbox.runtime.isolation.cgroups import default_parent, mounts_of, select
from rollbox.runtime.isolation.cgroups_v1 import V1
from rollbox.runtime.isolation.cgroups_v2 import V2
from svc_testkit import event, send, start_server

CREATE, EXEC, RUN, FORK = (f"dev.rollbox.sandbox.{t}" for t in ("create", "exec", "run", "fork"))


def _owner(pid: int) -> str:
    raw = Path(f"/proc/{pid}/stat").read_text()
    return f"{pid}.{raw[raw.rindex(')') + 2:].split()[19]}"


def _left(owner: str, home: Path) -> list[str]:
    """Everything on this host still named after ``owner``."""
    found = []
    roots = set(mounts_of("cgroup").values()) | set(mounts_of("cgroup2").values())
    for root in roots:
        parent = Path(root) / default_parent()
        if parent.is_dir():
            found += [str(d) for d in parent.iterdir() if d.name.startswith(owner + "-")]
    staging = home / "zygotes"
    if staging.is_dir():
        found += [str(d) for d in staging.iterdir() if d.name.startswith(owner + "-")]
    layers = home / "layers"
    if layers.is_dir():
        found += [str(d) for d in layers.iterdir() if d.name.startswith(f"scratch-{owner}-")]
    with open("/proc/self/mountinfo") as f:
        found += [line.split()[4] for line in f if owner in line]
    return found


async def test_a_restart_right_after_kill_9_clears_what_the_dead_server_left(tmp_path: Path) -> None:
    home = tmp_path / "home"
    # fork children take a scratch layer (no diff injection), so the dead server leaves one too
    args = ("--home", str(home), "--durability", "off")
    srv = start_server(tmp_path / "a", *args)
    owner = _owner(srv.pid)
    async with httpx.AsyncClient(timeout=60) as http:
        live = []
        for _ in range(6):
            r = await send(http, srv.url, event(CREATE, {"snapshot": "python"}))
            assert r.status == 200, r.data
            live.append(r.data["sandbox_id"])
        big = "head -c 9000000 /dev/urandom > /home/sandbox/big"  # over the inject limit: a scratch layer
        r = await send(http, srv.url, event(EXEC, {"sandbox_id": live[0], "command": big}))
        assert r.status == 200 and r.data["exit_code"] == 0, r.data
        r = await send(http, srv.url, event(FORK, {"sandbox_id": live[0], "count": 2}))
        assert r.status == 200, r.data

        async def load() -> None:
            while True:
                try:
                    await send(http, srv.url, event(RUN, {"code": "import time; time.sleep(0.2)"}))
                except httpx.HTTPError:
                    return

        workers = [asyncio.create_task(load()) for _ in range(8)]
        await asyncio.sleep(1.0)
        assert _left(owner, home), "the server under load holds cgroups and staging dirs named after it"
        os.kill(srv.pid, signal.SIGKILL)  # not reaped yet: a zombie while the new server starts
        t0 = time.monotonic()
        new = start_server(tmp_path / "b", *args)
        started = time.monotonic() - t0
        for w in workers:
            w.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
    try:
        assert Path(f"/proc/{srv.pid}").exists(), "the dead server was reaped too early for this test"
        deadline = time.monotonic() + 10
        while (left := _left(owner, home)) and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        assert not left, f"left after 10 s (restart took {started:.2f} s): {left}"
        async with httpx.AsyncClient(timeout=60) as http:
            r = await send(http, new.url, event(RUN, {"code": "print(1)"}))
            assert (r.status, r.data["stdout"]) == (200, "1\n")
    finally:
        srv.proc.wait()
        assert new.stop() == 0


@pytest.mark.parametrize("durability", ["step", "off"])
async def test_kill_9_with_creates_and_long_runs_in_flight_leaves_nothing_after_10_s(tmp_path: Path, durability: str) -> None:
    """The issue's sequence: 16 sandboxes just created and 8 one-shot runs of ``sleep 2`` in flight at
    the kill; a new server on the same home at once, while the dead one is still a zombie."""
    home = tmp_path / "home"
    args = ("--home", str(home), "--durability", durability)
    srv = start_server(tmp_path / "a", *args)
    owner = _owner(srv.pid)
    async with httpx.AsyncClient(timeout=60) as http:
        creates = [asyncio.create_task(send(http, srv.url, event(CREATE, {"snapshot": "python"}))) for _ in range(16)]
        runs = [asyncio.create_task(send(http, srv.url, event(RUN, {"code": "import time; time.sleep(2)"})))
                for _ in range(8)]
        await asyncio.sleep(0.8)
        os.kill(srv.pid, signal.SIGKILL)
        t0 = time.monotonic()
        new = start_server(tmp_path / "b", *args)
        started = time.monotonic() - t0
        await asyncio.gather(*creates, *runs, return_exceptions=True)
    try:
        deadline = time.monotonic() + 10
        while (left := _left(owner, home)) and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        assert not left, f"left after 10 s (restart took {started:.2f} s): {left}"
    finally:
        srv.proc.wait()
        assert new.stop() == 0


async def test_a_server_that_dies_after_another_started_on_its_home_is_cleared_too(tmp_path: Path) -> None:
    """Two servers on one home (replicas on a node): the second one's start-up sweep finds the first
    alive and leaves its things alone. When the first is then killed -9 (a zombie: nobody reaps it
    during this test) with sandboxes being created and runs in flight, the second clears what it left
    within seconds, not at its next periodic sweep."""
    home = tmp_path / "home"
    args = ("--home", str(home), "--durability", "off")
    first = start_server(tmp_path / "a", *args)
    owner = _owner(first.pid)
    second = start_server(tmp_path / "b", *args)
    try:
        async with httpx.AsyncClient(timeout=60) as http:
            creates = [asyncio.create_task(send(http, first.url, event(CREATE, {"snapshot": "python"})))
                       for _ in range(8)]
            runs = [asyncio.create_task(send(http, first.url, event(RUN, {"code": "import time; time.sleep(2)"})))
                    for _ in range(4)]
            await asyncio.sleep(1.0)
            assert _left(owner, home), "the first server holds cgroups and staging dirs named after it"
            os.kill(first.pid, signal.SIGKILL)
            await asyncio.gather(*creates, *runs, return_exceptions=True)
        assert Path(f"/proc/{first.pid}").exists(), "the dead server was reaped too early for this test"
        deadline = time.monotonic() + 10
        while (left := _left(owner, home)) and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        assert not left, f"left 10 s after the kill: {left}"
    finally:
        first.proc.wait()
        assert second.stop() == 0


OUTLIVER = """
import os, subprocess, sys
start = open(f"/proc/{os.getpid()}/stat").read().rsplit(")", 1)[1].split()[19]
name = f"{os.getpid()}.{start}-sb-outlived"
made = [os.path.join(parent, name) for parent in sys.argv[1:]]
for d in made:
    os.mkdir(d)
# a process that outlives its owner and keeps forking (its children join its groups)
child = subprocess.Popen(["sh", "-c", "while :; do sleep 0.05 & wait; done"], start_new_session=True)
for d in made:
    with open(os.path.join(d, "cgroup.procs"), "w") as f:
        f.write(str(child.pid))
print(name, child.pid, flush=True)
os._exit(0)
"""


async def test_a_dead_owners_processes_that_outlived_it_are_killed_and_its_groups_removed(tmp_path: Path) -> None:
    """A sandbox group whose owner died (a zombie nobody reaps during this test) while a process in it
    lives on and keeps forking: a server starting on the host kills them all and removes the group
    within 10 s."""
    backend, why = select(default_parent())
    if backend is None:
        pytest.skip(f"no writable cgroups: {why}")
    parents = [str(p) for p in dict.fromkeys(backend.parents.values())] if isinstance(backend, V1) else \
        [str(backend.parent)] if isinstance(backend, V2) else []
    owner = subprocess.Popen([sys.executable, "-c", OUTLIVER, *parents], stdout=subprocess.PIPE, text=True)
    assert owner.stdout is not None
    name, pid = owner.stdout.readline().split()
    groups = [Path(p, name) for p in parents]
    srv = None
    try:
        assert all(g.is_dir() for g in groups) and Path(f"/proc/{pid}").exists()
        srv = start_server(tmp_path / "srv", "--home", str(tmp_path / "home"), "--durability", "off")
        deadline = time.monotonic() + 10
        while (left := [str(g) for g in groups if g.exists()]) and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        assert not left, f"left 10 s after the server started: {left}"
        assert not Path(f"/proc/{pid}").exists() or Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    finally:
        owner.stdout.close()
        owner.wait()
        for g in groups:  # (the server failed: end what the test made)
            if g.exists():
                with contextlib.suppress(OSError):
                    for p in (g / "cgroup.procs").read_text().split():
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(int(p), signal.SIGKILL)
                    time.sleep(0.2)
                    g.rmdir()
        if srv is not None:
            assert srv.stop() == 0
