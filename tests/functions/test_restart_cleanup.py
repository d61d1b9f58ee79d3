"""`kill -9` of a server under load, a restart on the same home within half a second: the new server
clears what the dead one left (sandbox cgroups, zygote staging dirs, mounts, scratch layers) within
10 s, though the dead server may still be a zombie and its sandboxes still dying. Real server, real
cgroups."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import httpx
import pytest
from rollbox.runtime.isolation.cgroups import default_parent, mounts_of
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
