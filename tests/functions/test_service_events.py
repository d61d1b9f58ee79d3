"""Every event type, both content modes, against a real `rollbox serve` over HTTP."""

from __future__ import annotations

import asyncio
import re
import uuid

import httpx
import pytest
from rollbox.functions.contract.models import (
    ERROR,
    SANDBOX_CREATE,
    SANDBOX_CREATED,
    SANDBOX_DESTROY,
    SANDBOX_DESTROYED,
    SANDBOX_EXEC,
    SANDBOX_RESULT,
    SANDBOX_RUN,
)
from rollbox.runtime.spec import ExecResult, SandboxInfo, Usage
from svc_testkit import ServerProc, send
from svc_testkit import event as ce

MODES = ["binary", "structured"]


def metric(text: str, name: str, **labels: str) -> float:
    """The value of one sample in Prometheus text format (0 if absent)."""
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        m = re.match(r"^([a-zA-Z_:]+)(\{[^}]*\})? (\S+)$", line)
        if not m or m.group(1) != name:
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        if all(got.get(k) == v for k, v in labels.items()):
            return float(m.group(3))
    return 0.0


async def test_health_endpoints(server: ServerProc, http: httpx.AsyncClient) -> None:
    r = await http.get(server.url + "healthz")
    assert r.status_code == 200 and r.json()["status"] == "ok"
    r = await http.get(server.url + "readyz")
    assert r.status_code == 200 and r.json()["status"] == "ready"
    r = await http.get(server.url + "metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    for name in (
        "rollbox_live_sandboxes",
        "rollbox_inflight_requests",
        "rollbox_requests_total",
        "rollbox_admission_rejects_total",
        "rollbox_sandbox_create_seconds",
        "rollbox_pool_size",
        "rollbox_cleanup_failures",
        "rollbox_gc_pause_seconds",
        "rollbox_gc_collections",
    ):
        assert f"# TYPE {name.removesuffix('_total')}" in r.text, name


@pytest.mark.parametrize("mode", MODES)
async def test_episode_create_exec_destroy(server: ServerProc, http: httpx.AsyncClient, mode: str) -> None:
    episode = uuid.uuid4().hex[:8]
    meta = {"experiment": "e2e", "episode": episode}
    r = await send(http, server.url, ce(SANDBOX_CREATE, {"metadata": meta}), mode)
    assert (r.status, r.type, r.mode) == (200, SANDBOX_CREATED, mode), r.data
    info = SandboxInfo.model_validate(r.data)
    sid = info.sandbox_id
    assert r.subject == sid and info.snapshot_id and info.metadata == meta and info.create_ms >= 0

    exec_id = uuid.uuid4().hex
    r = await send(
        http,
        server.url,
        ce(
            SANDBOX_EXEC,
            {
                "sandbox_id": sid,
                "code": "import sys; print(open('in.txt').read() + sys.stdin.read())",
                "stdin": "-tail",
                "files": {"in.txt": "head"},
                "read_files": ["out.txt", "missing.txt"],
                "timeout_s": 30,
            },
            id=exec_id,
        ),
        mode,
    )
    assert (r.status, r.type, r.mode, r.subject) == (200, SANDBOX_RESULT, mode, sid), r.data
    res = ExecResult.model_validate(r.data)
    assert res.exit_code == 0 and res.stdout == "head-tail\n" and res.files == {"out.txt": None, "missing.txt": None}

    r = await send(
        http,
        server.url,
        ce(SANDBOX_EXEC, {"sandbox_id": sid, "command": "echo shell > out.txt; cat out.txt; exit 3"}),
        mode,
    )
    res = ExecResult.model_validate(r.data)
    assert (r.status, res.exit_code, res.stdout) == (200, 3, "shell\n")

    r = await send(http, server.url, ce(SANDBOX_DESTROY, {"sandbox_id": sid}), mode)
    assert (r.status, r.type, r.mode, r.subject) == (200, SANDBOX_DESTROYED, mode, sid), r.data
    usage = Usage.model_validate(r.data)
    assert usage.sandbox_id == sid and usage.execs == 2 and usage.wall_s > 0 and usage.metadata == meta

    # destroy is idempotent, even as a new event: the same usage record
    r = await send(http, server.url, ce(SANDBOX_DESTROY, {"sandbox_id": sid}), mode)
    assert (r.status, r.type) == (200, SANDBOX_DESTROYED) and Usage.model_validate(r.data) == usage

    # the sandbox is gone: exec is a 410 error event about it (its durable state says destroyed)
    r = await send(http, server.url, ce(SANDBOX_EXEC, {"sandbox_id": sid, "code": "print(1)"}), mode)
    assert (r.status, r.type, r.mode, r.subject) == (410, ERROR, mode, sid)
    assert r.data["code"] == "sandbox_gone" and sid in r.data["message"]
    # one that never existed is a 404
    r = await send(http, server.url, ce(SANDBOX_EXEC, {"sandbox_id": "sb-never", "code": "print(1)"}), mode)
    assert (r.status, r.data["code"]) == (404, "sandbox_not_found")

    # the exec was logged as one JSON line carrying the correlation fields
    lines = [x for x in server.log_records() if x.get("event_id") == exec_id]
    assert len(lines) == 1, lines
    assert lines[0]["sandbox_id"] == sid and lines[0]["experiment"] == "e2e" and lines[0]["episode"] == episode
    assert lines[0]["status"] == 200 and lines[0]["type"] == SANDBOX_EXEC


@pytest.mark.parametrize("mode", MODES)
async def test_run_one_shot(server: ServerProc, http: httpx.AsyncClient, mode: str) -> None:
    before = (await http.get(server.url + "metrics")).text
    r = await send(http, server.url, ce(SANDBOX_RUN, {"code": "print(1)"}), mode)
    assert (r.status, r.type, r.mode) == (200, SANDBOX_RESULT, mode)
    res = ExecResult.model_validate(r.data)
    assert (res.exit_code, res.stdout, res.stderr) == (0, "1\n", "")
    assert r.subject == res.sandbox_id

    r = await send(
        http,
        server.url,
        ce(
            SANDBOX_RUN,
            {"code": "import sys; sys.stderr.write('no'); sys.exit(7)", "metadata": {"experiment": "e2e"}},
        ),
        mode,
    )
    res = ExecResult.model_validate(r.data)
    assert (r.status, res.exit_code, res.stderr) == (200, 7, "no")
    after = (await http.get(server.url + "metrics")).text
    assert (
        metric(after, "rollbox_exec_exit_codes_total", code="7")
        >= metric(before, "rollbox_exec_exit_codes_total", code="7") + 1
    )
    assert metric(after, "rollbox_execs_total", type=SANDBOX_RUN) >= 2


async def test_run_timeout_is_killed(server: ServerProc, http: httpx.AsyncClient) -> None:
    before = metric((await http.get(server.url + "metrics")).text, "rollbox_exec_timeouts_total")
    r = await send(http, server.url, ce(SANDBOX_RUN, {"code": "import time; time.sleep(30)", "timeout_s": 0.5}))
    res = ExecResult.model_validate(r.data)
    assert r.status == 200 and res.timed_out and res.exit_code == 137
    after = metric((await http.get(server.url + "metrics")).text, "rollbox_exec_timeouts_total")
    assert after == before + 1


async def test_create_latency_and_live_metrics(server: ServerProc, http: httpx.AsyncClient) -> None:
    text = (await http.get(server.url + "metrics")).text
    counts = sum(metric(text, "rollbox_sandbox_create_seconds_count", source=s) for s in ("pooled", "restored"))
    hibernated = metric(text, "rollbox_hibernations_total", reason="create")
    r = await send(http, server.url, ce(SANDBOX_CREATE, {}))
    sid = r.data["sandbox_id"]
    assert r.data["hibernated"] is True, r.data  # (durable: a create makes no sandbox, its first step resumes it)
    text = (await http.get(server.url + "metrics")).text
    assert (
        sum(metric(text, "rollbox_sandbox_create_seconds_count", source=s) for s in ("pooled", "restored"))
        == counts
    )
    assert metric(text, "rollbox_hibernations_total", reason="create") == hibernated + 1
    r = await send(http, server.url, ce(SANDBOX_EXEC, {"sandbox_id": sid, "command": "true"}))
    assert r.data["resumed"] is True, r.data
    assert metric((await http.get(server.url + "metrics")).text, "rollbox_live_sandboxes") >= 1
    await send(http, server.url, ce(SANDBOX_DESTROY, {"sandbox_id": sid}))
    r = await send(http, server.url, ce(SANDBOX_RUN, {"code": "print(1)"}))  # a one-shot run acquires one too
    res = ExecResult.model_validate(r.data)
    assert res.create_ms is not None and res.create_ms >= 0 and res.pooled is not None
    text = (await http.get(server.url + "metrics")).text
    assert (
        sum(metric(text, "rollbox_sandbox_create_seconds_count", source=s) for s in ("pooled", "restored"))
        == counts + 1
    )


@pytest.mark.parametrize("first,second", [("binary", "binary"), ("binary", "structured")])
async def test_idempotent_replay_runs_once(
    server: ServerProc, http: httpx.AsyncClient, first: str, second: str
) -> None:
    sid = (await send(http, server.url, ce(SANDBOX_CREATE, {}))).data["sandbox_id"]
    step = {"sandbox_id": sid, "code": "open('log.txt', 'a').write('step\\n'); print('appended')"}
    eid = uuid.uuid4().hex
    r1 = await send(http, server.url, ce(SANDBOX_EXEC, step, id=eid), first)
    r2 = await send(http, server.url, ce(SANDBOX_EXEC, step, id=eid), second)
    assert r1.status == r2.status == 200
    assert r2.mode == second  # the replay comes in the retry's content mode...
    assert r2.event["id"] == r1.event["id"] and r2.data == r1.data  # ...but it is the first reply
    r = await send(
        http,
        server.url,
        ce(SANDBOX_EXEC, {"sandbox_id": sid, "code": "print(open('log.txt').read(), end='')"}),
    )
    assert r.data["stdout"] == "step\n"
    await send(http, server.url, ce(SANDBOX_DESTROY, {"sandbox_id": sid}))


async def test_concurrent_duplicates_wait_for_the_first(server: ServerProc, http: httpx.AsyncClient) -> None:
    sid = (await send(http, server.url, ce(SANDBOX_CREATE, {}))).data["sandbox_id"]
    step = {"sandbox_id": sid, "code": "import time; open('log.txt', 'a').write('x\\n'); time.sleep(0.5)"}
    eid = uuid.uuid4().hex
    replies = await asyncio.gather(*(send(http, server.url, ce(SANDBOX_EXEC, step, id=eid)) for _ in range(6)))
    assert {r.status for r in replies} == {200}
    assert len({r.event["id"] for r in replies}) == 1
    r = await send(
        http,
        server.url,
        ce(SANDBOX_EXEC, {"sandbox_id": sid, "code": "print(open('log.txt').read(), end='')"}),
    )
    assert r.data["stdout"] == "x\n"
    await send(http, server.url, ce(SANDBOX_DESTROY, {"sandbox_id": sid}))


async def test_same_id_other_content_is_a_conflict(server: ServerProc, http: httpx.AsyncClient) -> None:
    eid = uuid.uuid4().hex
    r1 = await send(http, server.url, ce(SANDBOX_RUN, {"code": "print(1)"}, id=eid))
    r2 = await send(http, server.url, ce(SANDBOX_RUN, {"code": "print(2)"}, id=eid))
    assert r1.status == 200 and (r2.status, r2.type, r2.data["code"]) == (409, ERROR, "idempotency_conflict")
    # the same id from another source is another event
    r3 = await send(http, server.url, ce(SANDBOX_RUN, {"code": "print(2)"}, id=eid, source="/other"))
    assert r3.status == 200 and r3.data["stdout"] == "2\n"


@pytest.mark.parametrize("mode", MODES)
async def test_not_found_statuses(server: ServerProc, http: httpx.AsyncClient, mode: str) -> None:
    r = await send(http, server.url, ce(SANDBOX_EXEC, {"sandbox_id": "sb-does-not-exist", "code": "1"}), mode)
    assert (r.status, r.type, r.mode, r.data["code"], r.subject) == (
        404,
        ERROR,
        mode,
        "sandbox_not_found",
        "sb-does-not-exist",
    )
    r = await send(http, server.url, ce(SANDBOX_DESTROY, {"sandbox_id": "sb-does-not-exist"}), mode)
    assert (r.status, r.data["code"]) == (404, "sandbox_not_found")
    r = await send(http, server.url, ce(SANDBOX_CREATE, {"snapshot": "no-such-snapshot"}), mode)
    assert (r.status, r.data["code"]) == (404, "snapshot_not_found") and "no-such-snapshot" in r.data["message"]
    r = await send(http, server.url, ce(SANDBOX_RUN, {"snapshot": "no-such-snapshot", "code": "1"}), mode)
    assert (r.status, r.data["code"]) == (404, "snapshot_not_found")


async def test_http_paths_and_methods(server: ServerProc, http: httpx.AsyncClient) -> None:
    from svc_testkit import parse

    r = parse(await http.post(server.url + "elsewhere", content=b"{}"))
    assert (r.status, r.type, r.data["code"]) == (404, ERROR, "not_found")
    r = parse(await http.get(server.url))
    assert (r.status, r.type, r.data["code"]) == (405, ERROR, "method_not_allowed")
    assert r.headers["allow"] == "POST"


async def test_sandbox_past_its_lifetime_is_destroyed(server: ServerProc, http: httpx.AsyncClient) -> None:
    r = await send(http, server.url, ce(SANDBOX_CREATE, {"timeout_s": 1}))
    sid = r.data["sandbox_id"]
    assert r.data["limits"]["lifetime_s"] == 1
    await asyncio.sleep(2.5)  # the runtime reaps it; nobody asked
    r = await send(http, server.url, ce(SANDBOX_EXEC, {"sandbox_id": sid, "code": "print(1)", "timeout_s": 1}))
    assert (r.status, r.data["code"], r.data["details"]["reason"]) == (410, "sandbox_gone", "lifetime")
    r = await send(http, server.url, ce(SANDBOX_DESTROY, {"sandbox_id": sid}))
    assert (r.status, r.type) == (200, SANDBOX_DESTROYED) and r.data["reason"] == "lifetime"
