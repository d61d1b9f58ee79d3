"""Two `rollbox serve` processes and a `rollbox run` on one host at once (each on its own home, as
two replicas on a Knative node and a developer's CLI would be): every sandbox's host uid is its own.
The uids are read from inside each sandbox (/proc/self/uid_map: sandbox uid -> host uid), so the
check is what the kernel enforces per-uid budgets on, not what the runtime believes it handed out.
Real servers, real user namespaces."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from svc_testkit import event, send, start_server

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mapping sandboxes to host uids of their own needs root")

CREATE, EXEC = "dev.rollbox.sandbox.create", "dev.rollbox.sandbox.exec"
UID_MAP = "id -u; cat /proc/self/uid_map"


def host_uid(out: str) -> int:
    """The host uid of the sandbox's user: its uid inside (first line) through the uid_map after it
    (lines of inside-start host-start count)."""
    me, *lines = out.strip().splitlines()
    for line in lines:
        inside, host, count = (int(x) for x in line.split())
        if inside <= int(me) < inside + count:
            return host + int(me) - inside
    raise AssertionError(f"uid {me} is not mapped: {out!r}")


async def test_two_servers_and_a_cli_run_give_their_sandboxes_disjoint_host_uids(tmp_path: Path) -> None:
    servers = [start_server(tmp_path / f"log{i}", "--home", str(tmp_path / f"home{i}"), "--durability", "off")
               for i in range(2)]
    try:
        async with httpx.AsyncClient(timeout=120) as http:
            async def sandbox_uid(url: str) -> int:
                r = await send(http, url, event(CREATE, {"snapshot": "python"}))
                assert r.status == 200, r.data
                r = await send(http, url, event(EXEC, {"sandbox_id": r.data["sandbox_id"], "command": UID_MAP}))
                assert r.status == 200 and r.data["exit_code"] == 0, r.data
                return host_uid(r.data["stdout"])

            # both servers create at the same time, and a CLI run starts while their sandboxes live
            per_server = await asyncio.gather(*(asyncio.gather(*(sandbox_uid(s.url) for _ in range(4)))
                                                for s in servers))
            cli = await asyncio.to_thread(
                subprocess.run, [sys.executable, "-m", "rollbox.functions.cli", "run", "--home",
                                 str(tmp_path / "home-cli"), "--command", UID_MAP],
                capture_output=True, text=True, timeout=60)
            assert cli.returncode == 0, cli.stderr
        owners: dict[int, str] = {}
        sets = [(f"server{i} sandbox{j}", u) for i, sbs in enumerate(per_server) for j, u in enumerate(sbs)]
        sets.append(("cli run", host_uid(cli.stdout)))
        for who, u in sets:
            assert u != 0 and u != os.getuid(), (who, u)  # never the host's root or the server's user
            assert u not in owners, f"host uid {u} given to both {owners[u]} and {who}"
            owners[u] = who
    finally:
        for s in servers:
            assert s.stop() == 0
