"""Admission control (429 + Retry-After) and a real internal error (500), each on a server of its own."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from cloudevents.http import from_http
from rollbox.functions.analysis.trajectories import steps
from rollbox.functions.client import Client, OverloadedError
from rollbox.functions.contract.models import ERROR, SANDBOX_CREATE, SANDBOX_CREATED, SANDBOX_DESTROY, SANDBOX_RUN
from svc_testkit import ServerProc, send, start_server
from svc_testkit import event as ce


def sample(text: str, name: str, **labels: str) -> float:
    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z_:]+)(\{[^}]*\})? (\S+)$", line)
        if m and m.group(1) == name:
            got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
            if all(got.get(k) == v for k, v in labels.items()):
                return float(m.group(3))
    return 0.0


@pytest.fixture(scope="module")
def small_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    srv = start_server(
        tmp_path_factory.mktemp("small"),
        "--max-live",
        "1",
        "--max-queued",
        "2",
        "--durability",  # without durable state a live sandbox cannot be hibernated to make room
        "off",
        env={"ROLLBOX_RETRY_AFTER_S": "2"},
    )
    yield srv
    assert srv.stop() == 0, srv.log_path.read_text()[-3000:]


async def test_live_cap_is_429_with_retry_after(small_server: ServerProc, http: httpx.AsyncClient) -> None:
    url = small_server.url
    first = await send(http, url, ce(SANDBOX_CREATE, {}))
    assert (first.status, first.type) == (200, SANDBOX_CREATED)
    for etype, data in ((SANDBOX_CREATE, {}), (SANDBOX_RUN, {"code": "print(1)"})):
        r = await send(http, url, ce(etype, data))
        assert (r.status, r.type, r.data["code"]) == (429, ERROR, "overloaded")
        assert r.headers["retry-after"] == "2" and "live sandboxes" in r.data["message"]
    metrics = (await http.get(url + "metrics")).text
    assert sample(metrics, "rollbox_admission_rejects_total", reason="live") >= 2
    # a refusal is not remembered: the same event, retried once there is room, runs
    retry = ce(SANDBOX_RUN, {"code": "print('ran')"})
    assert (await send(http, url, retry)).status == 429
    await send(http, url, ce(SANDBOX_DESTROY, {"sandbox_id": first.data["sandbox_id"]}))
    r = await send(http, url, retry)
    assert (r.status, r.data["stdout"]) == (200, "ran\n")


async def test_queue_cap_is_429(small_server: ServerProc, http: httpx.AsyncClient) -> None:
    url = small_server.url
    sid = (await send(http, url, ce(SANDBOX_CREATE, {}))).data["sandbox_id"]
    slow = [
        asyncio.create_task(
            send(
                http,
                url,
                ce(
                    "dev.rollbox.sandbox.exec",
                    {"sandbox_id": sid, "code": "import time; time.sleep(2); print('slow')"},
                ),
            )
        )
        for _ in range(2)
    ]
    for _ in range(200):
        if sample((await http.get(url + "metrics")).text, "rollbox_inflight_requests") >= 2:
            break
        await asyncio.sleep(0.02)
    r = await send(http, url, ce("dev.rollbox.sandbox.exec", {"sandbox_id": sid, "code": "print(1)"}))
    assert (r.status, r.data["code"], r.headers["retry-after"]) == (429, "overloaded", "2")
    assert "in flight" in r.data["message"]
    assert [x.status for x in await asyncio.gather(*slow)] == [200, 200]
    # the client retries a 429 after Retry-After, and gives up with a typed error
    async with Client(url, retries=1) as client:
        with pytest.raises(OverloadedError) as info:
            await client.run(code="print(1)")
        assert info.value.status == 429 and info.value.retry_after_s == 2
    await send(http, url, ce(SANDBOX_DESTROY, {"sandbox_id": sid}))


async def test_internal_error_is_500_without_host_details(tmp_path: Path, http: httpx.AsyncClient) -> None:
    state = tmp_path / "state"
    # no prewarmed pool: the create below must build a root under the broken directory
    srv = start_server(tmp_path / "logs", "--durability", "off", "--prewarm", "", env={"ROLLBOX_HOME": str(state)})
    try:
        # break the runtime's state directory under it: the next restore cannot build its root
        aside = tmp_path / "state-aside"
        state.rename(aside)
        state.write_text("not a directory")
        eid = uuid.uuid4().hex
        r = await send(http, srv.url, ce(SANDBOX_CREATE, {}, id=eid))
        assert (r.status, r.type, r.data["code"]) == (500, ERROR, "internal")
        assert str(tmp_path) not in r.data["message"] and "Error" not in r.data["message"] and not r.data["details"]
        logged = [x for x in srv.log_records() if x.get("event_id") == eid and "exc" in x]
        assert logged and "Traceback" in logged[0]["exc"]
        assert srv.alive()
        state.unlink()
        aside.rename(state)
        r = await send(http, srv.url, ce(SANDBOX_RUN, {"code": "print('recovered')"}))
        assert (r.status, r.data["stdout"]) == (200, "recovered\n")
        # a 500 is not the event's answer for good: its redelivery runs (it was replayed as the 500)
        again = await send(http, srv.url, ce(SANDBOX_CREATE, {}, id=eid))
        assert (again.status, again.type) == (200, SANDBOX_CREATED), again.data
        await send(http, srv.url, ce(SANDBOX_DESTROY, {"sandbox_id": again.data["sandbox_id"]}))
    finally:
        rc = srv.stop()
        if state.is_file():
            state.unlink()
        shutil.rmtree(state, ignore_errors=True)
    assert rc == 0


def test_bad_config_is_a_clear_error(tmp_path: Path) -> None:
    import subprocess
    import sys

    for env, flag in (
        ({"ROLLBOX_MAX_LIVE": "many"}, "ROLLBOX_MAX_LIVE"),
        ({"PORT": "80x"}, "PORT"),
        ({"ROLLBOX_GRACE_S": "-1"}, "ROLLBOX_GRACE_S"),
        ({"ROLLBOX_MAX_LIVE": "0"}, "ROLLBOX_MAX_LIVE"),
    ):
        p = subprocess.run(
            [sys.executable, "-m", "rollbox.functions.cli", "serve"],
            capture_output=True,
            text=True,
            env={**os.environ, **env},
            timeout=60,
        )
        assert p.returncode == 2 and flag in p.stderr, (env, p.stderr)
    p = subprocess.run(
        [sys.executable, "-m", "rollbox.functions.cli", "serve", "--max-queued", "1.5"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 2 and "--max-queued" in p.stderr and "integer" in p.stderr


async def test_a_pool_that_cannot_build_is_logged_once_and_counted(tmp_path: Path, http: httpx.AsyncClient) -> None:
    """A snapshot whose zygote cannot start (its warm recipe imports a module it lacks): the create that
    asked for it fails, and its warm pool's builds, retried in the background while it is wanted, fail
    too — counted in /metrics, logged once with the snapshot, its limits and the cause, not per retry."""
    import subprocess
    import sys

    home = tmp_path / "home"
    (tmp_path / "broken.yaml").write_text("name: broken\nwarm: {imports: [rollbox_no_such_module]}\n")
    built = subprocess.run([sys.executable, "-m", "rollbox.functions.cli", "snapshot", "build",
                            str(tmp_path / "broken.yaml"), "--home", str(home)], capture_output=True, text=True,
                           timeout=120)
    assert built.returncode == 0, built.stderr
    sid = re.search(r"built broken ([0-9a-f]{64})", built.stdout + built.stderr)
    assert sid, built.stdout
    srv = start_server(tmp_path / "logs", "--durability", "off", env={"ROLLBOX_HOME": str(home)})
    try:
        r = await send(http, srv.url, ce(SANDBOX_CREATE, {"snapshot": "broken"}))
        assert (r.status, r.type) == (500, ERROR), r.data
        deadline = asyncio.get_running_loop().time() + 30
        while True:
            text = (await http.get(srv.url + "metrics")).text
            failures = sample(text, "rollbox_pool_build_failures_total")
            if failures >= 4:  # two builders, retrying every 0.5 s
                break
            assert asyncio.get_running_loop().time() < deadline, text
            await asyncio.sleep(0.1)
        warned = [x for x in srv.log_records() if x.get("logger") == "rollbox.runtime.pool"]
        assert len(warned) == 1, warned  # once for the run of failures, not once per retry
        w = warned[0]
        assert w["level"] == "warning" and "cannot build a sandbox" in w["msg"]
        assert "rollbox_no_such_module" in w["msg"] and "Traceback" in w["exc"]
        assert w["limits"]["memory_max_bytes"] > 0 and w["build_failures"] == 1
        assert w["snapshot_id"] == sid.group(1)
        assert sample(text, "rollbox_pool_build_failures_total", snapshot=sid.group(1)) == failures
        ok = await send(http, srv.url, ce(SANDBOX_RUN, {"code": "print('others unaffected')"}))
        assert (ok.status, ok.data["stdout"]) == (200, "others unaffected\n")
    finally:
        assert srv.stop() == 0, srv.log_path.read_text()[-3000:]


# -- requests that stop arriving; clients that leave ---------------------------------------------------

async def _talk(port: int, data: bytes, *, half_close: bool = False, timeout_s: float = 30.0) -> tuple[float, bytes]:
    """Send ``data`` on a new connection and read until the server closes it: (seconds, what came back)."""
    t0 = time.monotonic()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        if half_close:
            writer.write_eof()
        raw = await asyncio.wait_for(reader.read(), timeout_s)
        return time.monotonic() - t0, raw
    finally:
        writer.close()


def _error_of(raw: bytes) -> tuple[int, dict[str, str], dict[str, Any]]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:])}
    ev = from_http(headers, body)
    assert ev["type"] == ERROR
    return int(lines[0].split()[1]), headers, ev.data


async def test_requests_that_stop_arriving_get_408_and_the_connection_is_closed(tmp_path: Path,
                                                                                 http: httpx.AsyncClient) -> None:
    """Headers that stop mid-way and a body that stops mid-way are answered 408 ``request_timeout``
    after ``--request-timeout-s`` and their connections closed (they were held open with no deadline);
    a connection that never sends a request is closed after the keep-alive time; a client that leaves
    mid-body is counted as 499, not as a 500. Nothing ran, nothing is logged as an error."""
    srv = start_server(tmp_path, "--request-timeout-s", "1", "--keep-alive-s", "2", "--durability", "off")
    head = (b"POST / HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\nce-specversion: 1.0\r\n"
            b"ce-type: dev.rollbox.sandbox.run\r\nce-source: /tests/slow\r\n")
    body = b'{"code": "open(\'/tmp/ran\', \'w\')"}'
    try:
        slow_headers, slow_body, silent, leaving = await asyncio.gather(
            _talk(srv.port, head + b"ce-id: slow-headers\r\n"),
            _talk(srv.port, head + b"ce-id: slow-body\r\ncontent-length: 100\r\n\r\n" + body[:20]),
            _talk(srv.port, b""),
            _talk(srv.port, head + b"ce-id: leaving\r\ncontent-length: 100\r\n\r\n" + body[:20], half_close=True))
        for (took, raw), where in ((slow_headers, "headers"), (slow_body, "body")):
            status, headers, data = _error_of(raw)  # the whole reply, then the server closed: read() ended
            assert (status, data["code"]) == (408, "request_timeout"), data
            assert where in data["message"] and "--request-timeout-s" in data["message"], data
            assert headers["connection"] == "close"
            assert 0.9 <= took < 10, took
        assert "20 bytes of the 100 declared" in _error_of(slow_body[1])[2]["message"]
        took, raw = silent
        assert raw == b"" and 1.9 <= took < 10, (took, raw)  # closed after --keep-alive-s, not held forever
        took, raw = leaving
        assert raw == b"" and took < 5, (took, raw)
        text = (await http.get(srv.url + "metrics")).text
        assert sample(text, "rollbox_requests_total", status="408", type="invalid") == 2
        assert sample(text, "rollbox_requests_total", status="499", type="invalid") == 1
        assert not [line for line in text.splitlines() if line.startswith("rollbox_requests_total")
                    and re.search(r'status="5\d\d"', line)], text
        errors = [r for r in srv.log_records() if r.get("level") in ("error", "critical") or "exc" in r]
        assert not errors, errors
        r = await send(http, srv.url, ce(SANDBOX_RUN, {"code": "import os; print(os.path.exists('/tmp/ran'))"}))
        assert (r.status, r.data["stdout"]) == (200, "False\n")
    finally:
        assert srv.stop() == 0, srv.log_path.read_text()[-3000:]


# -- a full disk -------------------------------------------------------------------------------------

@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 64 MiB tmpfs of its own (a real filesystem that fills up), unmounted after the test."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / "small-disk"
    mnt.mkdir()
    import subprocess

    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m,mode=0755", "tmpfs", str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def fill(disk: Path, leave: int = 0, name: str = "filler") -> Path:
    """Write a file until ``leave`` bytes are free, or the disk refuses (ENOSPC); returns it."""
    filler = disk / name
    with open(filler, "wb", buffering=0) as f:
        try:
            while (st := os.statvfs(disk)).f_bavail * st.f_frsize - (1 << 20) >= leave:
                f.write(b"\0" * (1 << 20))
            while not leave:
                f.write(b"\0" * 4096)
        except OSError as exc:
            assert exc.errno == 28 and not leave, exc
    return filler


async def test_a_full_disk_is_507_never_a_200_whose_row_is_lost(small_disk: Path, tmp_path: Path,
                                                                 http: httpx.AsyncClient) -> None:
    """The home (spool and local store) on a disk that fills up. A step whose row the disk refuses
    is answered 507 ``insufficient_storage`` + Retry-After, not 200 (its row was lost); then, with the
    disk full, steps are refused before they run (a durable step's commit was 502 ``store_error``) and
    /readyz says so; the client retries a 507 and succeeds once there is room. Every 200 has its row,
    no 507 has one."""
    home = small_disk / "home"
    srv = start_server(tmp_path / "logs", "--retry-after-s", "1", env={"ROLLBOX_HOME": str(home)})
    refused = []
    try:
        first = await send(http, srv.url, first_run := ce(SANDBOX_RUN, {"code": "print(1)"}))
        sid = (await send(http, srv.url, ce(SANDBOX_CREATE, {}))).data["sandbox_id"]
        assert first.status == 200
        # room for the server to go on (over its 16 MiB floor), not for a 20 MiB row: the run's output
        some = fill(small_disk, leave=18 << 20, name="some")
        big = ce(SANDBOX_RUN, {"code": "print('x' * (20 << 20))", "limits": {"output_max_bytes": 32 << 20}})
        r = await send(http, srv.url, big)
        assert (r.status, r.type, r.data["code"]) == (507, ERROR, "insufficient_storage"), r.data
        assert "record could not be written" in r.data["message"] and r.headers["retry-after"] == "1", r.data
        refused.append(big["id"])
        assert not any(b"x" * 4096 in p.read_bytes() for p in (home / "spool").glob("*.jsonl"))  # cut back off

        filler = fill(small_disk)
        deadline = time.monotonic() + 10
        while (ready := await http.get(srv.url + "readyz")).json()["disk_ok"]:
            assert time.monotonic() < deadline, ready.json()
            await asyncio.sleep(0.1)
        assert ready.status_code == 503 and ready.json()["status"] == "disk full"
        for etype, data in ((SANDBOX_RUN, {"code": "print(2)"}), (SANDBOX_CREATE, {}),
                            ("dev.rollbox.sandbox.exec", {"sandbox_id": sid, "code": "print(3)"})):
            r = await send(http, srv.url, ev := ce(etype, data))
            assert (r.status, r.type, r.data["code"]) == (507, ERROR, "insufficient_storage"), r.data
            assert "disk is full" in r.data["message"] and r.headers["retry-after"] == "1", r.data
            refused.append(ev["id"])

        async with Client(srv.url, retry_budget_s=30) as client:  # retried after Retry-After, until there is room
            later = asyncio.create_task(client.run(code="print(5)", metadata={"episode": "after-full"}))
            await asyncio.sleep(1.5)
            assert not later.done()
            filler.unlink()
            some.unlink()
            result = await asyncio.wait_for(later, 20)
        assert result.stdout == "5\n"
        r = await send(http, srv.url, ce("dev.rollbox.sandbox.exec", {"sandbox_id": sid, "code": "print(6)"}))
        assert (r.status, r.data["stdout"]) == (200, "6\n")
        assert (await http.get(srv.url + "readyz")).status_code == 200
        text = (await http.get(srv.url + "metrics")).text
        assert sample(text, "rollbox_spool_dropped_rows_total") >= 2  # the run's step and usage rows
        assert not [x for x in text.splitlines() if x.startswith("rollbox_requests_total")
                    and re.search(r'status="50[0-3]"', x)], text
    finally:
        assert srv.stop() == 0, srv.log_path.read_text()[-3000:]
    rows = steps(str(home))  # every row flushed at the drain
    ids = set(rows["event_id"])
    assert first_run["id"] in ids, srv.log_path.read_text()[-5000:]
    assert not ids & set(refused), (ids & set(refused))
    assert (rows["episode"] == "after-full").sum() == 1  # the client's retries: one row, for the one that ran


def test_a_store_write_refused_for_a_full_disk_is_507_not_502() -> None:
    """The local store's ENOSPC (a durable commit) is the full disk it is, retryable; a store that
    refuses for other reasons is still 502 ``store_error``."""
    import errno

    from rollbox.functions.service.app import _runtime_error
    from rollbox.runtime.errors import StoreError

    def raised(err: int) -> StoreError:
        try:
            try:
                raise OSError(err, os.strerror(err))
            except OSError as exc:
                raise StoreError(f"cannot write x: {exc}") from exc
        except StoreError as exc:
            return exc

    full = _runtime_error(raised(errno.ENOSPC))
    assert (full.status, full.code, full.retry_after_s) == (507, "insufficient_storage", 5.0)
    assert "disk is full" in full.message and "No space left" in full.message
    quota = _runtime_error(raised(errno.EDQUOT))
    assert quota.status == 507
    other = _runtime_error(raised(errno.EACCES))
    assert (other.status, other.code) == (502, "store_error")
