"""A hung store fails only the work that needs it, fast, and nothing else waits for it.

A SeaweedFS of this test's own is stopped with SIGSTOP: it keeps accepting connections (the kernel
does) and never answers, the worst an S3 endpoint can do. Real servers, real SeaweedFS."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
from svc_testkit import ServerProc, event, send, start_server

from tests.snapshots.s3server import ACCESS_KEY, SECRET_KEY, SeaweedS3

CREATE, EXEC, RUN, FORK, SNAPSHOT = (f"dev.rollbox.sandbox.{t}" for t in ("create", "exec", "run", "fork", "snapshot"))
QUICK_S = 3.0  # a request that needs no store: well under the store's 8 s deadline it would wait if it did


@pytest.fixture
def own_seaweed(tmp_path: Path) -> Iterator[SeaweedS3]:
    """Not the session's SeaweedFS: this one gets stopped."""
    server = SeaweedS3(tmp_path / "weed")
    server.start()
    try:
        yield server
    finally:
        if server.proc is not None:
            os.killpg(server.proc.pid, signal.SIGCONT)
        server.stop()


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=120) as client:
        yield client


def _serve(tmp_path: Path, weed: SeaweedS3, bucket: str, name: str, *args: str) -> ServerProc:
    env = {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_REGION": "us-east-1",
           "ROLLBOX_STORE": f"s3://{bucket}/rb", "AWS_ENDPOINT_URL": weed.endpoint}
    return start_server(tmp_path / name, "--home", str(tmp_path / name / "home"), *args, env=env)


@contextlib.contextmanager
def _hung(weed: SeaweedS3) -> Iterator[None]:
    """The store accepts connections and answers nothing until the block ends (its processes stopped)."""
    assert weed.proc is not None
    os.killpg(weed.proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.killpg(weed.proc.pid, signal.SIGCONT)


async def _timed(http: httpx.AsyncClient, url: str, etype: str, data: dict[str, object]) -> tuple[float, int, dict]:
    t0 = time.monotonic()
    r = await send(http, url, event(etype, data))
    return time.monotonic() - t0, r.status, r.data


async def _once_the_store_is_back(http: httpx.AsyncClient, url: str, etype: str,
                                  data: dict[str, object]) -> dict:
    """Send the event every second until it is answered 200 (stuck store calls end first), within 60 s."""
    deadline = time.monotonic() + 60
    while True:
        _, status, reply = await _timed(http, url, etype, data)
        if status == 200 or time.monotonic() > deadline:
            break
        await asyncio.sleep(1)
    assert status == 200, reply
    return reply


async def test_a_hung_store_is_a_fast_503_for_what_needs_it_and_nothing_else_waits(
        own_seaweed: SeaweedS3, tmp_path: Path, http: httpx.AsyncClient) -> None:
    bucket = own_seaweed.new_bucket()
    # a snapshot in the store that the second server's empty cache does not hold
    a = _serve(tmp_path, own_seaweed, bucket, "a")
    try:
        r = await send(http, a.url, event(CREATE, {"snapshot": "python"}))
        assert r.status == 200, r.data
        sid = r.data["sandbox_id"]
        r = await send(http, a.url, event(EXEC, {"sandbox_id": sid, "command": "echo hi > /home/sandbox/f"}))
        assert r.status == 200 and r.data["exit_code"] == 0, r.data
        r = await send(http, a.url, event(SNAPSHOT, {"sandbox_id": sid, "name": "hung-t"}))
        assert r.status == 200, r.data
    finally:
        assert a.stop() == 0

    # durability off: fork and run need no store at all
    b = _serve(tmp_path, own_seaweed, bucket, "b", "--durability", "off")
    try:
        r = await send(http, b.url, event(CREATE, {"snapshot": "python"}))
        assert r.status == 200, r.data
        live = r.data["sandbox_id"]
        with _hung(own_seaweed):
            creates = [asyncio.create_task(_timed(http, b.url, CREATE, {"snapshot": "hung-t"})) for _ in range(8)]
            await asyncio.sleep(0.5)  # the creates are waiting on the store now
            took, status, data = await _timed(http, b.url, RUN, {"code": "print(6 * 7)"})
            assert (status, data.get("stdout")) == (200, "42\n") and took < QUICK_S, (took, status, data)
            took, status, data = await _timed(http, b.url, FORK, {"sandbox_id": live, "count": 1})
            assert status == 200 and took < QUICK_S, (took, status, data)
            for took, status, data in await asyncio.gather(*creates):
                assert (status, data["code"]) == (503, "store_unavailable") and took < 10.0, (took, status, data)
                assert "did not answer within" in data["message"], data
            # the server itself stays up and answers its probes
            assert httpx.get(b.url + "healthz", timeout=2).status_code == 200
        # the store is back: the same create works
        data = await _once_the_store_is_back(http, b.url, CREATE, {"snapshot": "hung-t"})
        r = await send(http, b.url, event(EXEC, {"sandbox_id": data["sandbox_id"], "command": "cat /home/sandbox/f"}))
        assert (r.status, r.data["stdout"]) == (200, "hi\n"), r.data
    finally:
        assert b.stop() == 0


async def test_a_durable_step_on_a_hung_store_is_a_fast_503_and_a_run_still_answers(
        own_seaweed: SeaweedS3, tmp_path: Path, http: httpx.AsyncClient) -> None:
    bucket = own_seaweed.new_bucket()
    srv = _serve(tmp_path, own_seaweed, bucket, "d")  # durability step: the default with a store
    try:
        r = await send(http, srv.url, event(CREATE, {"snapshot": "python"}))
        assert r.status == 200, r.data
        sid = r.data["sandbox_id"]
        with _hung(own_seaweed):
            step = asyncio.create_task(_timed(http, srv.url, EXEC, {"sandbox_id": sid, "code": "print(1)"}))
            await asyncio.sleep(0.3)
            took, status, data = await _timed(http, srv.url, RUN, {"code": "print(2)"})
            assert (status, data.get("stdout")) == (200, "2\n") and took < QUICK_S, (took, status, data)
            took, status, data = await step
            assert (status, data["code"]) == (503, "store_unavailable") and took < 10.0, (took, status, data)
        # the step was not acknowledged: retried, it runs (once) from the last durable state
        data = await _once_the_store_is_back(http, srv.url, EXEC, {"sandbox_id": sid, "code": "print(3)"})
        assert data["stdout"] == "3\n", data
    finally:
        assert srv.stop() == 0
