"""The bad-input corpus: each gets its 4xx error event, the server stays up, the next request works.

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
import signal
import socket
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from rollbox.functions import sandbox, snapshot
from rollbox.functions.contract import (
    ERROR,
    SANDBOX_CREATE,
    SANDBOX_DESTROY,
    SANDBOX_DESTROYED,
    SANDBOX_EXEC,
    SANDBOX_FORK,
    SANDBOX_RESULT,
    SANDBOX_RUN,
)
from rollbox.functions.service import Service
from rollbox.runtime.runtime import Runtime, RuntimeConfig
from rollbox.runtime.snapshot import BuiltinResolver
from rollbox.snapshots.cache import LayerCache
from rollbox.snapshots.store_local import LocalStore
from svc_testkit import Reply, ServerProc, parse, send, start_server
from svc_testkit import event as ce

RUN = SANDBOX_RUN
STRUCT = {"content-type": "application/cloudevents+json"}


def binary_headers(**over: str | None) -> dict[str, str]:
    h: dict[str, str | None] = {
        "ce-specversion": "1.0",
        "ce-type": RUN,
        "ce-source": "/tests/bad",
        "ce-id": uuid.uuid4().hex,
        "content-type": "application/json",
    }
    h.update(over)
    return {k: v for k, v in h.items() if v is not None}


def structured(data: Any = None, *, raw_data: bool = False, **over: Any) -> bytes:
    ev: dict[str, Any] = {"specversion": "1.0", "type": RUN, "source": "/tests/bad", "id": uuid.uuid4().hex}
    if data is not None:
        ev["data"] = data
    ev.update(over)
    ev = {k: v for k, v in ev.items() if v is not None}
    return json.dumps(ev).encode()


def b(data: Any) -> bytes:
    return json.dumps(data).encode()


# (name, headers, body, status, code, words the message must contain)
CORPUS: list[tuple[str, dict[str, str], bytes, int, str, tuple[str, ...]]] = [
    ("binary malformed json", binary_headers(), b'{"code": "print(1)"', 400, "invalid_event", ("JSON",)),
    (
        "structured malformed json",
        STRUCT,
        b'{"specversion": "1.0", "type": ',
        400,
        "invalid_event",
        ("CloudEvent",),
    ),
    (
        "structured missing specversion",
        STRUCT,
        structured({"code": "1"}, specversion=None),
        400,
        "invalid_event",
        ("specversion",),
    ),
    (
        "binary wrong specversion",
        binary_headers(**{"ce-specversion": "2.0"}),
        b({"code": "1"}),
        400,
        "invalid_event",
        ("specversion",),
    ),
    (
        "structured specversion 0.3",
        STRUCT,
        structured({"code": "1"}, specversion="0.3"),
        400,
        "invalid_event",
        ("specversion", "1.0"),
    ),
    ("structured missing id", STRUCT, structured({"code": "1"}, id=None), 400, "invalid_event", ("id",)),
    ("structured empty id", STRUCT, structured({"code": "1"}, id=""), 400, "invalid_event", ("'id'", "non-empty")),
    ("structured missing type", STRUCT, structured({"code": "1"}, type=None), 400, "invalid_event", ("type",)),
    ("structured empty type", STRUCT, structured({"code": "1"}, type=""), 400, "invalid_event",
     ("'type'", "non-empty")),
    ("structured missing source", STRUCT, structured({"code": "1"}, source=None), 400, "invalid_event",
     ("source",)),
    # every required attribute, missing or empty, is named (not "Failed to find specversion")
    *[
        (f"binary {what} ce-{attr}", binary_headers(**{f"ce-{attr}": value}), b({"code": "1"}), 400,
         "invalid_event", (f"the ce-{attr} header is {what}",))
        for attr in ("specversion", "id", "source", "type")
        for what, value in (("missing", None), ("empty", ""))
    ],
    (
        "structured empty source",
        STRUCT,
        structured({"code": "1"}, source=""),
        400,
        "invalid_event",
        ("source",),
    ),
    (
        "unknown type",
        binary_headers(**{"ce-type": "dev.rollbox.sandbox.explode"}),
        b({}),
        400,
        "unknown_type",
        ("dev.rollbox.sandbox.explode", SANDBOX_RUN),
    ),
    ("code not a string", binary_headers(), b({"code": 123}), 400, "invalid_data", ("code",)),
    (
        "timeout_s not a number",
        binary_headers(),
        b({"code": "1", "timeout_s": "soon"}),
        400,
        "invalid_data",
        ("timeout_s",),
    ),
    (
        "negative timeout",
        STRUCT,
        structured({"code": "1", "timeout_s": -1}),
        400,
        "invalid_data",
        ("timeout_s",),
    ),
    (
        "nested limit wrong type",
        binary_headers(),
        b({"code": "1", "limits": {"memory_max_bytes": "lots"}}),
        400,
        "invalid_data",
        ("limits.memory_max_bytes",),
    ),
    ("unknown field", binary_headers(), b({"code": "1", "cdoe": "1"}), 400, "invalid_data", ("cdoe",)),
    (
        "code and command",
        binary_headers(),
        b({"code": "1", "command": "true"}),
        400,
        "invalid_data",
        ("code", "command"),
    ),
    ("neither code nor command", binary_headers(), b({}), 400, "invalid_data", ("code", "command")),
    ("data is a list", binary_headers(), b(["print(1)"]), 400, "invalid_data", ("JSON object",)),
    (
        "data is base64 bytes",
        STRUCT,
        structured(None, data_base64="aGVsbG8="),
        400,
        "invalid_event",
        ("JSON",),
    ),
    (
        "metadata value not a string",
        binary_headers(),
        b({"code": "1", "metadata": {"episode": 3}}),
        400,
        "invalid_data",
        ("metadata.episode",),
    ),
    ("binary non-utf8", binary_headers(), b'{"code": "\xff\xfe"}', 400, "invalid_event", ("UTF-8",)),
    (
        "structured non-utf8",
        STRUCT,
        b'{"specversion": "1.0", "data": "\xc3\x28"}',
        400,
        "invalid_event",
        ("UTF-8",),
    ),
    (
        "path traversal in files",
        binary_headers(),
        b({"code": "1", "files": {"../../etc/passwd": "x"}}),
        400,
        "invalid_data",
        ("files", ".."),
    ),
    (
        "path traversal in read_files",
        STRUCT,
        structured({"code": "1", "read_files": ["/home/../../etc/shadow"]}),
        400,
        "invalid_data",
        ("read_files", ".."),
    ),
    (
        "lone surrogate in a file's text (valid JSON, not UTF-8)",
        binary_headers(),
        b'{"code": "1", "files": {"a.txt": "\\ud800"}}',
        400,
        "invalid_data",
        ("files", "surrogate"),
    ),
    (
        "lone surrogate in stdin",
        STRUCT,
        b'{"specversion": "1.0", "type": "dev.rollbox.sandbox.run", "source": "/t", "id": "s1", '
        b'"datacontenttype": "application/json", "data": {"code": "1", "stdin": "x\\udfff"}}',
        400,
        "invalid_data",
        ("stdin", "surrogate"),
    ),
    (
        "NUL in file name",
        binary_headers(),
        b({"code": "1", "files": {"a\u0000b": "x"}}),
        400,
        "invalid_data",
        ("files",),
    ),
    (
        "path traversal in sandbox_id",
        binary_headers(**{"ce-type": "dev.rollbox.sandbox.exec"}),
        b({"sandbox_id": "../../etc", "code": "1"}),
        400,
        "invalid_data",
        ("sandbox_id",),
    ),
    # sandbox_id with control or non-Latin-1 characters: was a dropped connection / plain-text 500 (the
    # error reply copied the id into the ce-subject header)
    *[
        (f"sandbox_id with {what}", binary_headers(**{"ce-type": "dev.rollbox.sandbox.exec"}),
         b({"sandbox_id": f"sb-{ch}x", "code": "1"}), 400, "invalid_data", ("sandbox_id",))
        for what, ch in (("NUL", "\u0000"), ("CR", "\r"), ("LF", "\n"), ("DEL", "\u007f"), ("snowman", "\u2603"))
    ],
    (
        "structured sandbox_id with LF",
        STRUCT,
        structured({"sandbox_id": "sb-\n", "code": "1"}, type="dev.rollbox.sandbox.exec"),
        400,
        "invalid_data",
        ("sandbox_id",),
    ),
    # structured JSON nested past the parser's depth: was a 500 RecursionError (binary mode: 400)
    *[
        (f"{mode} json nested {depth} deep", hdrs, body_of(depth), 400, "invalid_event", ("JSON", "deep"))
        for depth in (1000, 100_000)
        for mode, hdrs, body_of in (
            ("structured", STRUCT, lambda n: b'{"specversion": "1.0", "type": "dev.rollbox.sandbox.run", '
             b'"source": "/t", "id": "deep", "data": ' + b"[" * n + b"]" * n + b"}"),
            ("binary", binary_headers(), lambda n: b"[" * n + b"]" * n),
        )
    ],
    # lone surrogates (valid JSON escapes, not UTF-8): refused before anything runs, naming the field
    (
        "lone surrogate in create metadata",
        binary_headers(**{"ce-type": "dev.rollbox.sandbox.create"}),
        b'{"metadata": {"episode": "e\\ud800"}}',
        400,
        "invalid_data",
        ("metadata", "lone surrogate"),
    ),
    (
        "lone surrogate in a metadata key",
        binary_headers(),
        b'{"code": "1", "metadata": {"\\udc00k": "v"}}',
        400,
        "invalid_data",
        ("metadata", "lone surrogate"),
    ),
    (
        "lone surrogate in structured source",
        STRUCT,
        b'{"specversion": "1.0", "type": "dev.rollbox.sandbox.run", "source": "/t\\ud800", "id": "x", '
        b'"data": {"code": "1"}}',
        400,
        "invalid_event",
        ("'source'", "not valid UTF-8: lone surrogate"),
    ),
    (
        "lone surrogate in structured id",
        STRUCT,
        b'{"specversion": "1.0", "type": "dev.rollbox.sandbox.run", "source": "/t", "id": "x\\udfff", '
        b'"data": {"code": "1"}}',
        400,
        "invalid_event",
        ("'id'", "not valid UTF-8: lone surrogate"),
    ),
    # JSON true/false is not a number (timeout_s: true was taken as 1 s)
    *[
        (f"boolean {field} in {etype.rsplit('.', 1)[1]}", binary_headers(**{"ce-type": etype}), b(data), 400,
         "invalid_data", (field, "not a boolean"))
        for etype, field, data in (
            ("dev.rollbox.sandbox.create", "timeout_s", {"timeout_s": True}),
            ("dev.rollbox.sandbox.run", "timeout_s", {"code": "1", "timeout_s": True}),
            ("dev.rollbox.sandbox.run", "limits.pids_max", {"code": "1", "limits": {"pids_max": True}}),
            ("dev.rollbox.sandbox.fork", "count", {"snapshot": "python", "count": True}),
            ("dev.rollbox.episode.annotate", "reward", {"episode": "e", "reward": False}),
        )
    ],
    ("object extension attribute", STRUCT, structured({"code": "1"}, myext={"a": 1}), 400, "invalid_event",
     ("'myext'", "object")),
    ("array extension attribute", STRUCT, structured({"code": "1"}, partitionkey=["sb"]), 400, "invalid_event",
     ("'partitionkey'", "array")),
    ("200 KiB ce-id", binary_headers(**{"ce-id": "i" * 200 * 1024}), b({"code": "1"}), 400, "invalid_event",
     ("'id'", "1024")),
    ("long structured source", STRUCT, structured({"code": "1"}, source="/" + "s" * 2000), 400, "invalid_event",
     ("'source'", "1024")),
    ("long structured type", STRUCT, structured({"code": "1"}, type="t" * 1025), 400, "invalid_event",
     ("'type'", "1024")),
    ("file name over 255 bytes", binary_headers(), b({"code": "1", "files": {"d/" + "n" * 256: "x"}}), 400,
     "invalid_data", ("files", "'nnnn", "255 bytes")),
    ("read_files name over 255 bytes", binary_headers(), b({"code": "1", "read_files": ["\u00e9" * 128]}), 400,
     "invalid_data", ("read_files", "256 bytes")),
    (
        "path traversal in snapshot",
        binary_headers(),
        b({"code": "1", "snapshot": "../../../etc"}),
        400,
        "invalid_data",
        ("snapshot",),
    ),
    (
        "plain text",
        {"content-type": "text/plain"},
        b"print(1)",
        415,
        "unsupported_media_type",
        ("text/plain",),
    ),
    (
        "binary with text data",
        binary_headers(**{"content-type": "text/plain"}),
        b"print(1)",
        415,
        "unsupported_media_type",
        ("application/json",),
    ),
    (
        "batch mode",
        {"content-type": "application/cloudevents-batch+json"},
        b"[" + structured({"code": "1"}) + b"]",
        415,
        "unsupported_media_type",
        ("batch",),
    ),
    (
        "structured with xml data",
        STRUCT,
        structured("<x/>", datacontenttype="application/xml"),
        415,
        "unsupported_media_type",
        ("application/xml",),
    ),
    ("empty body, no headers", {}, b"", 400, "invalid_event", ("specversion",)),
]


@pytest.mark.parametrize("name,headers,body,status,code,words", CORPUS, ids=[c[0] for c in CORPUS])
async def test_bad_input(
    server: ServerProc,
    http: httpx.AsyncClient,
    name: str,
    headers: dict[str, str],
    body: bytes,
    status: int,
    code: str,
    words: tuple[str, ...],
) -> None:
    r = parse(await http.post(server.url, headers=headers, content=body))
    assert (r.status, r.type, r.data["code"]) == (status, ERROR, code), r.data
    for w in words:
        assert w in r.data["message"], (w, r.data["message"])
    want_mode = "structured" if headers.get("content-type", "").startswith("application/cloudevents") else "binary"
    assert r.mode == want_mode
    assert "Traceback" not in r.data["message"] and "/work/" not in r.data["message"]
    assert server.alive()
    ok = await send(http, server.url, ce(SANDBOX_RUN, {"code": "print('still up')"}))
    assert (ok.status, ok.type, ok.data["stdout"]) == (200, SANDBOX_RESULT, "still up\n")


async def test_huge_body_is_413(server: ServerProc, http: httpx.AsyncClient) -> None:
    cap = 8 * 1024 * 1024  # the default --max-body-bytes
    big = {"code": "print(1)", "files": {"big.txt": "x" * (cap + 1)}}
    for mode in ("binary", "structured"):
        r = await send(http, server.url, ce(SANDBOX_RUN, big), mode)
        assert (r.status, r.type, r.data["code"], r.mode) == (413, ERROR, "payload_too_large", mode)
        assert r.data["details"]["max_body_bytes"] == cap
    # a declared length over the cap is refused without reading the body
    r = parse(await http.post(server.url, headers=binary_headers(), content=b"x" * (3 * cap)))
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
        service = Service(rt, routes=(*sandbox.ROUTES, *snapshot.routes(snapshots)))
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
