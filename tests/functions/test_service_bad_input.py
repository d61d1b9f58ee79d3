"""The bad-input corpus: each gets its 4xx error event, the server stays up, the next request works."""

from __future__ import annotations

import json
import uuid
from typing import Any

import httpx
import pytest
from rollbox.functions.contract import ERROR, SANDBOX_RESULT, SANDBOX_RUN
from svc_testkit import ServerProc, parse, send
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
        "binary missing specversion",
        binary_headers(**{"ce-specversion": None}),
        b({"code": "1"}),
        400,
        "invalid_event",
        ("specversion",),
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
    ("binary empty ce-id", binary_headers(**{"ce-id": ""}), b({"code": "1"}), 400, "invalid_event",
     ("the ce-id header is empty",)),
    ("binary missing ce-source", binary_headers(**{"ce-source": None}), b({"code": "1"}), 400, "invalid_event",
     ("the ce-source header is missing",)),
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
