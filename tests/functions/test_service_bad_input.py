"""The bad-input corpus (``bad_input/cases.py``, hundreds of malformed requests) through one real
`rollbox serve`: each gets its 4xx error event naming the field, or its defined 2xx with its step
recorded; never a 5xx, a dropped connection or a lost row; the server answers normally after it. And
the server-side deadline for requests that stop arriving (408, then the connection is closed).

Then the refusals that depend on the server's state, each with its exact status and code: a snapshot
carrying a process image (422 ``unsupported``), a runtime that is closing (503 ``shutting_down``), a
server draining after SIGTERM (503 ``shutting_down``; a destroy is still served), an event id reused
for other content that only the durable state remembers (409 ``idempotency_conflict``) and a store
that cannot be reached (503 ``store_unavailable``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import re
import signal
import socket
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import orjson
import pytest
import uvicorn
from bad_input.cases import CORPUS, EXPERIMENT, Case
from cloudevents.http import CloudEvent, from_http
from rollbox.functions.analysis.trajectories import read
from rollbox.functions.contract.models import (
    ERROR,
    SANDBOX_CREATE,
    SANDBOX_DESTROY,
    SANDBOX_DESTROYED,
    SANDBOX_EXEC,
    SANDBOX_FORK,
    SANDBOX_RESULT,
    SANDBOX_RUN,
    ErrorCode,
)
from rollbox.functions.handlers import sandbox, snapshot
from rollbox.functions.handlers.routing import InProcess
from rollbox.functions.service.app import Service
from rollbox.runtime.runtime import Runtime, RuntimeConfig
from rollbox.runtime.snapshot import BuiltinResolver
from rollbox.snapshots.cache import LayerCache
from rollbox.snapshots.store_local import LocalStore
from svc_testkit import Reply, ServerProc, metric, metrics_of, parse, send, start_server
from svc_testkit import event as ce

RUN = SANDBOX_RUN

# the codes each status may carry (derived from contract.ErrorCode, which carries each code's status)
CODES = {status: {c.value for c in ErrorCode if c.status == status} for status in {c.status for c in ErrorCode}}


@dataclasses.dataclass
class Answer:
    status: int | None  # None: the connection ended without a reply
    headers: dict[str, str]
    body: bytes
    seconds: float

    @property
    def event(self) -> CloudEvent:
        return from_http(self.headers, self.body)


async def exchange(port: int, request: bytes, *, half_close: bool = False, timeout_s: float = 60.0) -> Answer:
    """Send ``request`` as it is on a connection of its own; read until the server closes it."""
    t0 = time.monotonic()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        await writer.drain()
        if half_close:
            writer.write_eof()
        raw = await asyncio.wait_for(reader.read(), timeout_s)
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
    seconds = time.monotonic() - t0
    if not raw:
        return Answer(None, {}, b"", seconds)
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    assert len(body) == int(headers["content-length"]), (lines[0], headers, body[:200])
    return Answer(int(lines[0].split()[1]), headers, body, seconds)


def event_id_of(request: bytes) -> str:
    """The ce-id of a corpus request (binary: its header; structured: its body's ``id``)."""
    m = re.search(rb"(?im)^ce-id: *(\S+)\r$", request) or re.search(rb'"id": "([^"]+)"', request)
    assert m, request[:300]
    return m.group(1).decode()


def check(case: Case, got: Answer) -> None:
    if case.leaves:  # the client half-closed before its request was whole: no reply, no error
        assert got.status is None, (case.name, got.status, got.body[:300])
        return
    assert got.status == case.status, (case.name, got.status, got.body[:500])
    ev = got.event
    if case.reply is not None:
        assert ev["type"] == case.reply, (case.name, ev.data)
        return
    data = ev.data
    assert ev["type"] == ERROR and data["code"] in CODES[got.status], (case.name, data)
    for word in case.words:
        assert word in data["message"], (case.name, word, data["message"])
    assert "Traceback" not in data["message"] and "/work/" not in data["message"], (case.name, data["message"])
    structured = b"\r\ncontent-type: application/cloudevents+json" in case.request.partition(b"\r\n\r\n")[0]
    if structured and got.headers.get("server"):  # the service's own replies (not the HTTP layer's) keep the mode
        assert got.headers["content-type"].startswith("application/cloudevents+json"), case.name


def recorded_event_ids(home: Path) -> set[str]:
    """Event ids of the rows of ``EXPERIMENT``: the spool first (rows leave it only once flushed), then
    the Parquet files of the store."""
    ids: set[str] = set()
    for seg in sorted((home / "spool").glob("*.jsonl")):
        with contextlib.suppress(FileNotFoundError):
            for raw in seg.read_bytes().splitlines():
                with contextlib.suppress(orjson.JSONDecodeError):
                    line = orjson.loads(raw)
                    if line["k"] == "step" and line["r"].get("experiment") == EXPERIMENT:
                        ids.add(line["r"]["event_id"])
    table = read("trajectories", str(home), experiment=EXPERIMENT)
    if table.num_rows:
        ids.update(table.column("event_id").to_pylist())
    return ids


async def test_the_corpus(server: ServerProc, http: httpx.AsyncClient) -> None:
    """Every request of the corpus, eight at a time, to the session's server."""
    counts = {s: sum(c.status == s for c in CORPUS) for s in sorted({c.status for c in CORPUS}, key=str)}
    print(f"\nbad-input corpus: {len(CORPUS)} requests, expected statuses {counts}")
    assert len(CORPUS) >= 500
    before = await metrics_of(http, server)
    logged = len(server.log_records())
    slots = asyncio.Semaphore(8)

    async def one(case: Case) -> tuple[Case, Answer]:
        async with slots:
            return case, await exchange(server.port, case.request, half_close=case.leaves)

    answers = await asyncio.gather(*(one(c) for c in CORPUS))
    failures = []
    for case, got in answers:
        try:
            check(case, got)
        except Exception as exc:  # an assertion, or a reply that is not a CloudEvent
            failures.append(f"{case.name}: {type(exc).__name__}: {str(exc)[:300]}")
    assert not failures, f"{len(failures)} of {len(CORPUS)} not as expected:\n" + "\n".join(failures[:40])

    assert server.alive()
    ok = await send(http, server.url, ce(RUN, {"code": "print('still up')"}))
    assert (ok.status, ok.type, ok.data["stdout"]) == (200, SANDBOX_RESULT, "still up\n")
    after = await metrics_of(http, server)
    fives = {f"{s}": metric(after, "rollbox_requests_total", status=str(s)) - metric(before, "rollbox_requests_total",
                                                                                       status=str(s))
             for s in (500, 502, 503, 504, 507)}
    assert not any(fives.values()), fives
    gone = metric(after, "rollbox_requests_total", status="499") - metric(before, "rollbox_requests_total", status="499")
    assert gone >= sum(c.leaves for c in CORPUS)
    new = server.log_records()[logged:]
    assert not [r for r in new if "exc" in r or r.get("level") in ("error", "critical") or "Traceback" in
                str(r.get("raw", ""))], [json.dumps(r)[:500] for r in new if "exc" in r][:5]

    # every 2xx that ran is a row (spooled before its reply; flushed to Parquet within seconds)
    listening = next(r for r in server.log_records() if r.get("msg") == "listening")
    home = Path(listening.get("home") or listening["store"])
    want = {event_id_of(c.request) for c in CORPUS if c.status == 200}
    missing = want - recorded_event_ids(home)
    assert not missing, f"{len(missing)} of {len(want)} acknowledged steps have no row"


async def test_huge_body_is_413(server: ServerProc, http: httpx.AsyncClient) -> None:
    cap = 8 * 1024 * 1024  # the default --max-body-bytes
    big = {"code": "print(1)", "files": {"big.txt": "x" * (cap + 1)}}
    for mode in ("binary", "structured"):
        r = await send(http, server.url, ce(SANDBOX_RUN, big), mode)
        assert (r.status, r.type, r.data["code"], r.mode) == (413, ERROR, "payload_too_large", mode)
        assert r.data["details"]["max_body_bytes"] == cap
    # a declared length over the cap is refused without reading the body
    headers = {"ce-specversion": "1.0", "ce-type": RUN, "ce-source": "/tests/bad", "ce-id": uuid.uuid4().hex,
               "content-type": "application/json"}
    r = parse(await http.post(server.url, headers=headers, content=b"x" * (3 * cap)))
    assert (r.status, r.data["code"]) == (413, "payload_too_large")
    ok = await send(http, server.url, ce(SANDBOX_RUN, {"code": "print(2)", "files": {"small.txt": "x" * 1000}}))
    assert (ok.status, ok.data["stdout"]) == (200, "2\n")


# -- refusals that depend on the server's state ----------------------------------------------------


def check_refusal(r: Reply, status: int, code: str, *words: str) -> None:
    """An error event with exactly this status and code, whose message names the problem; a refusal
    that says "retry" says when (Retry-After) and no other does."""
    assert (r.status, r.type, r.data["code"]) == (status, ERROR, code), r.data
    for w in words:
        assert w in r.data["message"], (w, r.data["message"])
    retry = code in ("sandbox_busy", "overloaded", "shutting_down", "store_unavailable")
    assert ("retry-after" in r.headers) is retry, r.headers
    if retry:
        assert int(r.headers["retry-after"]) >= 1


class _Uvicorn(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:  # the test's loop, not uvicorn, owns the signals
        yield


@contextlib.asynccontextmanager
async def serving(service: Service) -> AsyncIterator[str]:
    """``service`` over real HTTP (uvicorn on a free port, as `rollbox serve` runs it), in this process."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    server = _Uvicorn(uvicorn.Config(service.asgi_app(), lifespan="off", http="httptools", ws="none",
                                     log_config=None, access_log=False))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        assert not task.done(), task
        await asyncio.sleep(0.01)
    service.ready = True
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}/"
    finally:
        server.should_exit = True
        await task
        sock.close()


async def test_process_image_snapshot_and_closing_runtime(tmp_path: Path, http: httpx.AsyncClient) -> None:
    """A snapshot carrying a process image is refused as such (422 ``unsupported``, naming the snapshot
    and its kind), by create, run and fork alike; a runtime that is closing refuses new sandboxes with
    503 ``shutting_down`` and Retry-After (both were 500 ``internal``). No manifest a store holds can
    carry a process image yet (the runtime's ``SnapshotView.process_image`` is the seam for CRIU), so
    the real service and runtime run in this process, where the view can be registered."""
    state = tmp_path / "state"
    rt = Runtime(RuntimeConfig(state_dir=state, cgroup_parent=f"rollbox-test-{os.getpid()}-refusals"))
    await rt.start()
    try:
        resolver = rt.resolver
        assert isinstance(resolver, BuiltinResolver)
        base = resolver.resolve("python")
        resolver.register(dataclasses.replace(base, id="criu-image", process_image="criu-image-layer"))
        snapshots = snapshot.Snapshots(rt, LayerCache(LocalStore(tmp_path / "store")))
        service = Service(InProcess(rt), routes=(*sandbox.ROUTES, *snapshot.routes(snapshots)))
        async with serving(service) as url:
            for etype, data in ((SANDBOX_CREATE, {"snapshot": "criu-image"}),
                                (SANDBOX_RUN, {"snapshot": "criu-image", "code": "print(1)"}),
                                (SANDBOX_FORK, {"snapshot": "criu-image", "count": 2})):
                r = await send(http, url, ce(etype, data))
                check_refusal(r, 422, "unsupported", "'criu-image'", "process image")
                assert r.data["details"] == {"snapshot_id": "criu-image"}, r.data
            ok = await send(http, url, ce(SANDBOX_RUN, {"code": "print('still up')"}))
            assert (ok.status, ok.data["stdout"]) == (200, "still up\n")
            kept = (await send(http, url, ce(SANDBOX_CREATE, {}))).data["sandbox_id"]

            await rt.close()  # the runtime goes away under a service that still takes events
            for etype, data in ((SANDBOX_CREATE, {}), (SANDBOX_RUN, {"code": "print(1)"})):
                r = await send(http, url, ce(etype, data))
                check_refusal(r, 503, "shutting_down", "shutting down", "runtime is")
            r = await send(http, url, ce(SANDBOX_EXEC, {"sandbox_id": kept, "code": "print(1)"}))
            check_refusal(r, 404, "sandbox_not_found", kept)  # closing destroyed it
    finally:
        await rt.close()


async def test_a_reply_without_a_body_has_its_head_sent(tmp_path: Path, http: httpx.AsyncClient) -> None:
    """A reply's head is held for its body (HeadHeld: one write per reply); a HEAD, whose reply has no
    body after the head, still gets it, and the connection serves the next request."""
    rt = Runtime(RuntimeConfig(state_dir=tmp_path / "state", cgroup_parent=f"rollbox-test-{os.getpid()}-head"))
    service = Service(InProcess(rt))
    try:
        async with serving(service) as url:
            for _ in range(2):
                head = await http.head(url + "healthz")
                assert (head.status_code, head.content, head.headers["content-length"]) == (200, b"", "15"), head
                assert (await http.get(url + "healthz")).json() == {"status": "ok"}
    finally:
        await rt.close()


@pytest.fixture(scope="module")
def forgetful_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    """Durable sandboxes (the default) and a reply cache of one entry: an event id is soon known only
    to the sandbox's durable state, as on a replica that did not handle it or after a restart."""
    srv = start_server(tmp_path_factory.mktemp("forgetful"), "--idempotency-entries", "1",
                       env={"ROLLBOX_HOME": str(tmp_path_factory.mktemp("forgetful-home"))})
    yield srv
    assert srv.stop() == 0, srv.log_path.read_text()[-3000:]


async def test_event_id_reused_for_other_content_found_in_durable_state(
        forgetful_server: ServerProc, http: httpx.AsyncClient) -> None:
    url = forgetful_server.url
    sid = (await send(http, url, ce(SANDBOX_CREATE, {}))).data["sandbox_id"]
    eid = uuid.uuid4().hex
    first = await send(http, url, ce(SANDBOX_EXEC, {"sandbox_id": sid, "code": "print(1)"}, id=eid))
    assert (first.status, first.data["stdout"]) == (200, "1\n")
    await send(http, url, ce(SANDBOX_EXEC, {"sandbox_id": sid, "code": "print(2)"}))  # the cache forgets eid
    again = await send(http, url, ce(SANDBOX_EXEC, {"sandbox_id": sid, "code": "print(1)"}, id=eid))
    assert (again.status, again.data["stdout"]) == (200, "1\n")  # the recorded reply, from the durable state
    other = await send(http, url, ce(SANDBOX_EXEC, {"sandbox_id": sid, "code": "print(3)"}, id=eid))
    check_refusal(other, 409, "idempotency_conflict", repr(eid), "different content")  # was 500 internal
    r = await send(http, url, ce(SANDBOX_EXEC, {"sandbox_id": sid, "code": "print(4)"}))
    assert (r.status, r.data["stdout"]) == (200, "4\n")  # nothing of the refused event ran
    await send(http, url, ce(SANDBOX_DESTROY, {"sandbox_id": sid}))


async def test_refusals_while_draining(tmp_path: Path, http: httpx.AsyncClient) -> None:
    srv = start_server(tmp_path, "--grace-s", "30", "--retry-after-s", "3")
    try:
        kept = (await send(http, srv.url, ce(SANDBOX_CREATE, {}))).data["sandbox_id"]
        busy = asyncio.create_task(send(http, srv.url, ce(SANDBOX_RUN, {"code": "import time; time.sleep(3)"})))
        deadline = time.monotonic() + 30
        while "rollbox_inflight_requests 1.0" not in (await http.get(srv.url + "metrics")).text:
            assert time.monotonic() < deadline and not busy.done()
            await asyncio.sleep(0.02)
        os.kill(srv.pid, signal.SIGTERM)
        while (await http.get(srv.url + "readyz")).status_code != 503:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
        for etype, data in ((SANDBOX_RUN, {"code": "print(1)"}), (SANDBOX_CREATE, {}),
                            (SANDBOX_EXEC, {"sandbox_id": kept, "code": "print(1)"})):
            r = await send(http, srv.url, ce(etype, data))
            check_refusal(r, 503, "shutting_down", "shutting down", "only destroy")
            assert r.headers["retry-after"] == "3"  # --retry-after-s
        bye = await send(http, srv.url, ce(SANDBOX_DESTROY, {"sandbox_id": kept}))
        assert (bye.status, bye.type) == (200, SANDBOX_DESTROYED)  # a destroy frees what the drain waits for
        assert (await busy).status == 200
        assert await asyncio.to_thread(srv.proc.wait, 40) == 0
    finally:
        srv.stop()


async def test_unreachable_store_is_503_store_unavailable(tmp_path: Path, http: httpx.AsyncClient) -> None:
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))  # bound, never listening: connections to it are refused
        endpoint = f"http://127.0.0.1:{closed.getsockname()[1]}"
        srv = start_server(tmp_path, "--store", "s3://rollbox-nowhere/rb", "--s3-endpoint-url", endpoint,
                           env={"ROLLBOX_HOME": str(tmp_path / "home"), "AWS_ACCESS_KEY_ID": "k",
                                "AWS_SECRET_ACCESS_KEY": "s", "AWS_REGION": "us-east-1"})
        try:
            ready = await http.get(srv.url + "readyz")
            assert (ready.status_code, ready.json()["store_ok"]) == (503, False)
            r = await send(http, srv.url, ce(SANDBOX_CREATE, {"snapshot": "not-held-here"}))
            check_refusal(r, 503, "store_unavailable", "store")
        finally:
            assert srv.stop() == 0, srv.log_path.read_text()[-3000:]
