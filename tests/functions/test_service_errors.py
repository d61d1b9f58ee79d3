"""Admission control (429 + Retry-After) and a real internal error (500), each on a server of its own."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from rollbox.functions.client import Client, OverloadedError
from rollbox.functions.contract import ERROR, SANDBOX_CREATE, SANDBOX_CREATED, SANDBOX_DESTROY, SANDBOX_RUN
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
