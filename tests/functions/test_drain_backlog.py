"""SIGTERM with a backlog: the steps waiting their turn (behind --max-running; --turn-s 0: the running
ones keep their turn to their end, so the others are still waiting at the SIGTERM) are handed back at once
(503 + Retry-After, nothing of them applied), the running ones finish, the process exits within the
grace, and each handed-back step, retried on another replica sharing the S3 store, applies once.

Real parts: two `rollbox serve` processes on one SeaweedFS bucket, SIGTERM by pid.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
from rollbox.functions.contract.models import ERROR
from svc_testkit import Reply, ServerProc, event, send, start_server

from tests.snapshots.s3server import ACCESS_KEY, SECRET_KEY, SeaweedS3

pytestmark = pytest.mark.slow

CREATE, EXEC = "dev.rollbox.sandbox.create", "dev.rollbox.sandbox.exec"
RUNNING, WAITING, GRACE_S, SLOW_S = 2, 4, 20, 3


async def _step(http: httpx.AsyncClient, srv: ServerProc, sid: str, command: str, eid: str | None = None) -> Reply:
    return await send(http, srv.url, event(EXEC, {"sandbox_id": sid, "command": command}, id=eid))


async def _timed(coro: Any) -> tuple[float, Reply]:
    r = await coro
    return time.monotonic(), r


async def _until(http: httpx.AsyncClient, srv: ServerProc, key: str, n: int) -> None:
    deadline = time.monotonic() + 30
    while (await http.get(srv.url + "readyz")).json()[key] < n:
        assert time.monotonic() < deadline, f"never {n} {key}"
        await asyncio.sleep(0.02)


async def test_sigterm_hands_back_waiting_steps_at_once_and_their_retries_apply_once(
        seaweed: SeaweedS3, tmp_path: Path) -> None:
    env = {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_REGION": "us-east-1",
           "ROLLBOX_STORE": f"s3://{seaweed.new_bucket()}/rb", "AWS_ENDPOINT_URL": seaweed.endpoint}
    a = start_server(tmp_path / "a", "--home", str(tmp_path / "home-a"), "--max-running", str(RUNNING), "--turn-s", "0",
                     "--grace-s", str(GRACE_S), env=env)
    b: ServerProc | None = None
    try:
        async with httpx.AsyncClient(timeout=60) as http:
            sids = []
            for _ in range(RUNNING + WAITING):
                r = await send(http, a.url, event(CREATE, {}))
                assert r.status == 200, r.data
                sids.append(str(r.data["sandbox_id"]))
            slow, queued = sids[:RUNNING], sids[RUNNING:]
            running = [asyncio.create_task(_timed(_step(http, a, sid, f"sleep {SLOW_S}; echo slow >> log.txt; "
                                                        "cat log.txt"))) for sid in slow]
            await _until(http, a, "inflight", RUNNING)
            ids = {sid: uuid.uuid4().hex for sid in queued}
            waiting = [asyncio.create_task(_timed(_step(http, a, sid, "echo once >> log.txt; wc -l < log.txt",
                                                        ids[sid]))) for sid in queued]
            # SandboxFusion's /run_code waits in the same queue, and is handed back in its own shape
            fusion = asyncio.create_task(_timed(http.post(a.url + "run_code", json={"code": "print(1)",
                                                                                      "language": "python"})))
            await _until(http, a, "waiting", WAITING + 1)
            t0 = time.monotonic()
            os.kill(a.pid, signal.SIGTERM)
            handed_back = await asyncio.gather(*waiting)
            for at, r in handed_back:  # at once, while the running steps still sleep
                assert (r.status, r.type, r.data["code"]) == (503, ERROR, "shutting_down"), r.data
                assert int(r.headers["retry-after"]) >= 1 and "had not started" in r.data["message"]
                assert at - t0 < SLOW_S / 2, at - t0
            at, rc = await fusion
            assert rc.status_code == 503 and "had not started" in rc.json()["detail"], rc.text
            assert int(rc.headers["retry-after"]) >= 1 and at - t0 < SLOW_S / 2
            for _at, r in await asyncio.gather(*running):  # the running ones finished, acknowledged
                assert (r.status, r.data["stdout"]) == (200, "slow\n"), r.data
            await asyncio.to_thread(a.proc.wait, GRACE_S)
            assert a.proc.returncode == 0 and time.monotonic() - t0 < GRACE_S / 2
            assert any(rec.get("msg") == "draining" and rec.get("handed_back") == WAITING + 1 for rec in a.log_records())

            b = start_server(tmp_path / "b", "--home", str(tmp_path / "home-b"), env=env)  # an empty cache
            for sid in slow:  # what A acknowledged is in S3
                r = await _step(http, b, sid, "cat log.txt")
                assert (r.status, r.data["stdout"]) == (200, "slow\n"), r.data
            for sid in queued:  # never applied on A; the client's retry (same event) applies it once
                first = await _step(http, b, sid, "echo once >> log.txt; wc -l < log.txt", ids[sid])
                again = await _step(http, b, sid, "echo once >> log.txt; wc -l < log.txt", ids[sid])
                assert (first.status, first.data["stdout"].strip()) == (200, "1"), first.data
                assert again.data == first.data
                r = await _step(http, b, sid, "wc -l < log.txt")
                assert r.data["stdout"].strip() == "1", r.data
    finally:
        a.stop()
        if b is not None:
            assert b.stop() == 0


async def test_a_program_that_sleeps_does_not_hold_the_queue(tmp_path: Path) -> None:
    """--max-running 1: a step whose program sleeps 6 s holds its turn for --turn-s (1 s by default)
    only; the step sent after it, on another sandbox, starts then and is answered long before."""
    a = start_server(tmp_path / "a", "--home", str(tmp_path / "home"), "--max-running", "1")
    try:
        async with httpx.AsyncClient(timeout=60) as http:
            sids = []
            for _ in range(2):
                r = await send(http, a.url, event(CREATE, {}))
                assert r.status == 200, r.data
                sids.append(str(r.data["sandbox_id"]))
            t0 = time.monotonic()
            sleeper = asyncio.create_task(_timed(_step(http, a, sids[0], "sleep 6; echo slept")))
            await _until(http, a, "inflight", 1)
            at, r = await _timed(_step(http, a, sids[1], "echo quick"))
            assert (r.status, r.data["stdout"]) == (200, "quick\n"), r.data
            assert at - t0 < 4, at - t0  # its turn came after ~1 s, not after the sleeper's 6 s
            done, slept = await sleeper
            assert (slept.status, slept.data["stdout"]) == (200, "slept\n") and done > at
    finally:
        assert a.stop() == 0
