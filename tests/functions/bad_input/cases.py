"""The bad-input corpus: every request a broken or hostile client might send, as the bytes it sends.

Each ``Case`` is one whole HTTP/1.1 request (request line, headers, body: sent as they are, on a
connection of its own) and the reply it must get: a 4xx error event whose message names the field
(``words``), or a defined 2xx (``reply``: the reply event's type; its step must be recorded), or, for
a client that half-closes before its request is whole (``leaves``), no reply and no error counted.
Never a 5xx, a dropped connection or a lost record (``test_service_bad_input.test_the_corpus``).

What it covers: binary and structured mode; each CloudEvents attribute missing, empty, of each wrong
JSON type, too long, with control characters, lone surrogates, noncharacters, non-ASCII or
non-printable header bytes, given twice; extension attributes of every kind; bodies that are not
JSON, not UTF-8, truncated, nested too deep, with numbers past any range; wrong content types; every
data field of every event type with wrong types, out-of-range values, bad paths and names; and HTTP
itself (methods, paths, malformed request lines, chunking, header and body sizes).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["CORPUS", "EXPERIMENT", "SOURCE", "Case"]

SOURCE = "/tests/bad-input-corpus"
EXPERIMENT = f"bad-input-corpus-{uuid.uuid4().hex[:12]}"  # the 2xx runs' rows: one partition of their own

CREATE, EXEC, RUN, DESTROY = ("dev.rollbox.sandbox.create", "dev.rollbox.sandbox.exec", "dev.rollbox.sandbox.run",
                              "dev.rollbox.sandbox.destroy")
SNAPSHOT, FORK, ANNOTATE = "dev.rollbox.sandbox.snapshot", "dev.rollbox.sandbox.fork", "dev.rollbox.episode.annotate"
RESULT, ANNOTATED = "dev.rollbox.sandbox.result", "dev.rollbox.episode.annotated"
STRUCTURED = "application/cloudevents+json"
NOBODY = "sb-corpus-nobody"  # a well-formed sandbox id no sandbox has


@dataclass(frozen=True)
class Case:
    name: str
    request: bytes
    status: int | None  # the exact status; None: the client leaves, nothing is answered
    words: tuple[str, ...] = ()  # a 4xx's message names these
    reply: str | None = None  # a 2xx: the reply event's type
    leaves: bool = False  # the client half-closes after sending (a request cut short)


def _b(v: str | bytes) -> bytes:
    return v.encode() if isinstance(v, str) else v


def http(headers: Sequence[tuple[str | bytes, str | bytes]], body: bytes = b"", *, method: str = "POST",
         path: str = "/", version: str = "HTTP/1.1", length: bool = True) -> bytes:
    """A whole request as sent; ``connection: close`` so the reply ends with the connection."""
    lines = [f"{method} {path} {version}".encode(), b"host: rollbox"]
    lines += [_b(k) + b": " + _b(v) for k, v in headers]
    if length:
        lines.append(b"content-length: %d" % len(body))
    lines.append(b"connection: close")
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


def _id() -> str:
    return uuid.uuid4().hex


class Raw(str):
    """JSON text put into a body as it is (``1e999``, ``NaN``, ``"\\ud800"``...)."""


def dumps(value: Any) -> bytes:
    raws: list[str] = []

    def swap(v: Any) -> Any:
        if isinstance(v, Raw):
            raws.append(v)
            return f"@@RAW{len(raws) - 1}@@"
        if isinstance(v, dict):
            return {swap(k): swap(x) for k, x in v.items()}
        if isinstance(v, list):
            return [swap(x) for x in v]
        return v

    text = json.dumps(swap(value))
    for i, raw in enumerate(raws):
        text = text.replace(f'"@@RAW{i}@@"', raw)
    return text.encode()


def binary(data: Any = None, *, etype: str = RUN, body: bytes | None = None, ctype: str | None = "application/json",
           omit: Sequence[str] = (), extra: Sequence[tuple[str | bytes, str | bytes]] = (),
           **attrs: str | bytes) -> bytes:
    """A binary-mode event: ce-* headers, the data as the body."""
    ce: dict[str, str | bytes] = {"specversion": "1.0", "id": _id(), "source": SOURCE, "type": etype, **attrs}
    headers: list[tuple[str | bytes, str | bytes]] = [(f"ce-{k}", v) for k, v in ce.items() if k not in omit]
    if ctype is not None:
        headers.append(("content-type", ctype))
    headers += list(extra)
    return http(headers, dumps(data) if body is None else body)


def structured(data: Any = None, *, etype: str = RUN, omit: Sequence[str] = (), **attrs: Any) -> bytes:
    """A structured-mode event: the whole event as the JSON body."""
    ev: dict[str, Any] = {"specversion": "1.0", "id": _id(), "source": SOURCE, "type": etype, **attrs}
    if data is not None:
        ev["data"] = data
    for k in omit:
        ev.pop(k, None)
    return http([("content-type", STRUCTURED)], dumps(ev))


def structured_body(body: bytes) -> bytes:
    return http([("content-type", STRUCTURED)], body)


def run(code: str = "print(1)", **more: Any) -> dict[str, Any]:
    return {"code": code, "metadata": {"experiment": EXPERIMENT}, **more}


def _kind_values() -> list[tuple[str, Any, str]]:
    """(what, JSON value, how the message names its kind) for an attribute of the wrong type."""
    return [("a number", 7, "number"), ("a float", 1.5, "number"), ("true", True, "boolean"),
            ("null", None, "null"), ("an array", ["x"], "array"), ("an object", {"a": 1}, "object")]


# -- binary mode: the ce-* headers --------------------------------------------------------------------

def _binary_attributes() -> Iterator[Case]:
    for attr in ("specversion", "id", "source", "type"):
        yield Case(f"binary ce-{attr} missing", binary(run(), omit=(attr,)), 400, (f"ce-{attr}", "missing"))
        yield Case(f"binary ce-{attr} empty", binary(run(), **{attr: ""}), 400, (f"ce-{attr}", "empty"))
        yield Case(f"binary ce-{attr} only spaces", binary(run(), **{attr: "   "}), 400, (f"ce-{attr}", "empty"))
        yield Case(f"binary ce-{attr} with NUL", binary(run(), **{attr: b"a\x00b"}), 400, ("HTTP",))
        yield Case(f"binary ce-{attr} with a tab", binary(run(), **{attr: b"a\tb"}), 400, (f"ce-{attr}", "0x09"))
        yield Case(f"binary ce-{attr} with DEL", binary(run(), **{attr: b"a\x7fb"}), 400, (f"ce-{attr}",))
        yield Case(f"binary ce-{attr} Latin-1 byte", binary(run(), **{attr: b"caf\xe9"}), 400, (f"ce-{attr}", "0xe9"))
        yield Case(f"binary ce-{attr} UTF-8 text", binary(run(), **{attr: "sb-\u2603"}), 400, (f"ce-{attr}", "0xe2"))
        yield Case(f"binary ce-{attr} given twice", binary(run(), extra=((f"ce-{attr}", "x"),)), 400,
                   (f"ce-{attr}", "more than once"))
    for attr in ("id", "source", "type"):
        yield Case(f"binary ce-{attr} 1025 chars", binary(run(), **{attr: "x" * 1025}), 400, (f"'{attr}'", "1024"))
        yield Case(f"binary ce-{attr} 200 KiB", binary(run(), **{attr: "x" * 200 * 1024}), 400, (f"'{attr}'", "1024"))
    yield Case("binary ce-id 300 KiB (headers over the cap)", binary(run(), id="i" * 300 * 1024), 431, ("headers",))
    for version in ("0.3", "2.0", "1", "1.0.0", "v1.0", "1.0 beta"):
        yield Case(f"binary specversion {version}", binary(run(), specversion=version), 400,
                   ("specversion", repr(version), "'1.0'"))
    for what, value in (("a date only", "2026-01-31"), ("no offset", "2026-01-31T12:00:00"), ("words", "yesterday"),
                        ("month 13", "2026-13-01T00:00:00Z"), ("a number", "1767225600"), ("empty", "")):
        yield Case(f"binary ce-time {what}", binary(run(), time=value), 400, ("'time'", "RFC 3339"))
    for name in ("my_ext", "My-Ext", "x" * 65, "caf\xe9"):
        yield Case(f"binary extension named {name[:12]!r}", binary(run(), extra=((f"ce-{name}", "v"),)), 400,
                   ("attribute name" if name != "caf\xe9" else "0xc3",))
    yield Case("binary extension with a tab", binary(run(), extra=(("ce-myext", b"a\tb"),)), 400, ("ce-myext",))
    yield Case("binary ce-subject with a byte 0x85", binary(run(), subject=b"a\x85"), 400, ("ce-subject", "0x85"))
    yield Case("binary unknown type", binary({}, etype="dev.rollbox.sandbox.explode"), 400,
               ("dev.rollbox.sandbox.explode", RUN))
    yield Case("binary type of another vendor", binary({}, etype="com.example.thing"), 400, ("com.example.thing",))
    yield Case("no headers, empty body", http([], b""), 400, ("ce-specversion", "missing"))


def _binary_bodies() -> Iterator[Case]:
    for what, body in (("plain text", b"hello"), ("truncated JSON", b'{"code": "print(1)"'),
                       ("trailing garbage", b'{"code": "1"} x'), ("single quotes", b"{'code': '1'}"),
                       ("a trailing comma", b'{"code": "1",}'), ("a bare word", b"code"),
                       ("an unterminated string", b'{"code": "1'), ("a control char in a string", b'{"code": "a\x01"}')):
        yield Case(f"binary body {what}", binary(body=body), 400, ("data is not valid JSON", "line 1 column"))
    for what, body in (("Latin-1 bytes", b'{"code": "caf\xe9"}'), ("a lone 0xff", b'{"code": "\xff"}'),
                       ("a cut UTF-8 sequence", b'{"code": "\xe2\x98"}'), ("UTF-16", '{"code": "1"}'.encode("utf-16"))):
        yield Case(f"binary body {what}", binary(body=body), 400, ("UTF-8",))
    for depth in (1000, 100_000):
        yield Case(f"binary data nested {depth} deep", binary(body=b"[" * depth + b"]" * depth), 400, ("JSON", "deep"))
    yield Case("binary data object nested 2000 deep", binary(body=b'{"a":' * 2000 + b"1" + b"}" * 2000), 400,
               ("JSON", "deep"))
    yield Case("binary number of 5000 digits", binary(body=b'{"code": "1", "timeout_s": ' + b"9" * 5000 + b"}"), 400,
               ("not valid JSON", "4300 digits"))
    for what, data in (("an array", ["print(1)"]), ("a string", "print(1)"), ("a number", 42), ("true", True)):
        yield Case(f"binary data is {what}", binary(data), 400, ("JSON object",))
    yield Case("binary data is null", binary(body=b"null"), 400, ("code", "command"))
    yield Case("binary empty body", binary(body=b""), 400, ("code", "command"))
    for ctype in ("text/plain", "application/xml", "application/octet-stream", "multipart/form-data; boundary=x",
                  "text/json"):
        yield Case(f"binary content-type {ctype}", binary(run(), ctype=ctype), 415, (ctype.split(";")[0],))
    for ctype in ("application/cloudevents-batch+json", "application/cloudevents+xml", "application/cloudevents"):
        yield Case(f"content-type {ctype}", binary(run(), ctype=ctype), 415, ("application/",))
    yield Case("binary content-type given twice", binary(run(), extra=(("content-type", "text/plain"),)), 400,
               ("content-type", "more than once"))
    yield Case("binary ce-datacontenttype not JSON", binary(run(), ctype=None, datacontenttype="text/plain"), 415,
               ("text/plain",))


# -- structured mode: the event as JSON ----------------------------------------------------------------

def _structured_attributes() -> Iterator[Case]:
    for attr in ("specversion", "id", "source", "type"):
        yield Case(f"structured {attr} missing", structured(run(), omit=(attr,)), 400, (f"'{attr}'", "missing"))
        for what, value, kind in _kind_values():
            words = ("'specversion'", "'1.0'", kind) if attr == "specversion" else (f"'{attr}'", "string")
            yield Case(f"structured {attr} is {what}", structured(run(), **{attr: value}), 400, words)
    for attr in ("id", "source", "type"):
        yield Case(f"structured {attr} empty", structured(run(), **{attr: ""}), 400, (f"'{attr}'", "non-empty"))
        yield Case(f"structured {attr} 1025 chars", structured(run(), **{attr: "s" * 1025}), 400, (f"'{attr}'", "1024"))
        yield Case(f"structured {attr} 1 MiB", structured(run(), **{attr: "s" * (1 << 20)}), 400, (f"'{attr}'", "1024"))
    for version in ("0.3", "2.0", "1", "", " 1.0"):
        yield Case(f"structured specversion {version!r}", structured(run(), specversion=version), 400,
                   ("specversion", "'1.0'"))
    for attr in ("id", "source", "type", "subject", "dataschema", "myext", "partitionkey", "correlationid"):
        for what, ch, words in (("NUL", "\x00", "control character"), ("LF", "\n", "control character"),
                                ("CR LF", "\r\n", "control character"), ("a tab", "\t", "control character"),
                                ("DEL", "\x7f", "control character"), ("NEL", "\x85", "control character"),
                                ("a lone high surrogate", Raw('"a\\ud800"'), "lone surrogate"),
                                ("a lone low surrogate", Raw('"\\udfff"'), "lone surrogate"),
                                ("a noncharacter", "\uffff", "noncharacter")):
            value = ch if isinstance(ch, Raw) else f"a{ch}b"
            yield Case(f"structured {attr} with {what}", structured(run(), **{attr: value}), 400, (f"'{attr}'", words))
    for attr in ("subject", "dataschema", "time", "datacontenttype"):
        for what, value, kind in _kind_values()[:-3] + _kind_values()[-2:]:  # (null: absent, as the spec says)
            yield Case(f"structured {attr} is {what}", structured(run(), **{attr: value}), 400,
                       (f"'{attr}'", "string", kind))
    for what, value in (("a date only", "2026-01-31"), ("no offset", "2026-01-31T12:00:00"), ("words", "tomorrow"),
                        ("day 32", "2026-01-32T00:00:00Z"), ("hour 25", "2026-01-31T25:00:00Z")):
        yield Case(f"structured time {what}", structured(run(), time=value), 400, ("'time'", "RFC 3339"))
    for what, value, words in (("a float", 1.5, "fraction"), ("2**31", 2**31, "32-bit"), ("-2**31-1", -(2**31) - 1,
                               "32-bit"), ("10**30", 10**30, "32-bit"),
                               ("an object", {"a": {"b": 1}}, "object"), ("an array", [1, 2], "array"),
                               ("an empty object", {}, "object"), ("Infinity", Raw("Infinity"), "fraction"),
                               ("NaN", Raw("NaN"), "fraction")):
        yield Case(f"structured extension is {what}", structured(run(), myext=value), 400, ("'myext'", words))
    for name in ("my_ext", "my-ext", "my.ext", "x" * 65, "\u00e9t\u00e9", ""):
        yield Case(f"structured extension named {name[:12]!r}", structured(run(), **{name: "v"}), 400,
                   ("attribute name",))
    yield Case("structured datacontenttype text/plain", structured("print(1)", datacontenttype="text/plain"), 415,
               ("text/plain",))
    yield Case("structured datacontenttype application/xml", structured("<x/>", datacontenttype="application/xml"),
               415, ("application/xml",))
    yield Case("structured data_base64", structured(None, data_base64="aGVsbG8="), 400, ("data_base64",))
    yield Case("structured data_base64 not base64", structured(None, data_base64="!!!"), 400, ("data_base64",))
    yield Case("structured data_base64 and data", structured(run(), data_base64="aGVsbG8="), 400, ("data_base64",))
    yield Case("structured unknown type", structured({}, type="dev.rollbox.nope"), 400, ("dev.rollbox.nope",))


def _structured_bodies() -> Iterator[Case]:
    for what, body in (("plain text", b"hello"), ("truncated", b'{"specversion": "1.0", "type": '),
                       ("empty", b""), ("only spaces", b"   "), ("trailing garbage", b'{"specversion": "1.0"} x'),
                       ("two objects", b"{}{}"), ("single quotes", b"{'specversion': '1.0'}"),
                       ("NUL", b"\x00")):
        yield Case(f"structured body {what}", structured_body(body), 400, ("the body is not valid JSON", "line 1"))
    for what, body, kind in (("an array", b"[1, 2]", "an array"), ("null", b"null", "null"), ("a string", b'"x"',
                             "a string"), ("a number", b"7", "a number"), ("true", b"true", "a boolean"),
                             ("a batch", b"[" + structured(run()).split(b"\r\n\r\n", 1)[1] + b"]", "an array")):
        yield Case(f"structured body is {what}", structured_body(body), 400, (f"the body is {kind}", "JSON object"))
    yield Case("structured empty object", structured_body(b"{}"), 400, ("'specversion'", "missing"))
    for what, body in (("Latin-1 bytes", b'{"specversion": "1.0", "id": "caf\xe9"}'),
                       ("a lone 0xc3", b'{"specversion": "1.0", "data": "\xc3\x28"}'),
                       ("UTF-16", '{"specversion": "1.0"}'.encode("utf-16"))):
        yield Case(f"structured body {what}", structured_body(body), 400, ("UTF-8",))
    head = b'{"specversion": "1.0", "type": "dev.rollbox.sandbox.run", "source": "/t", "id": "deep", '
    for depth in (1000, 100_000):
        yield Case(f"structured data nested {depth} deep", structured_body(head + b'"data": ' + b"[" * depth +
                   b"]" * depth + b"}"), 400, ("JSON", "deep"))
        yield Case(f"structured extension nested {depth} deep", structured_body(head + b'"myext": ' + b"[" * depth +
                   b"]" * depth + b', "data": {}}'), 400, ("deep",))
    yield Case("structured number of 5000 digits", structured_body(head + b'"data": {"code": "1", "count": ' +
               b"1" * 5000 + b"}}"), 400, ("not valid JSON", "4300 digits"))
    yield Case("structured data is a string", structured("print(1)"), 400, ("JSON object",))
    yield Case("structured data is an array", structured(["print(1)"]), 400, ("JSON object",))
    yield Case("structured data missing", structured(None), 400, ("code", "command"))
    yield Case("structured data with a lone surrogate", structured({"code": Raw('"print(\\"\\ud800\\")"')}), 400,
               ("code", "surrogate"))


# -- the data of every event type ---------------------------------------------------------------------

_BASE: dict[str, dict[str, Any]] = {
    CREATE: {},
    EXEC: {"sandbox_id": NOBODY, "code": "print(1)"},
    RUN: {"code": "print(1)"},
    DESTROY: {"sandbox_id": NOBODY},
    SNAPSHOT: {"sandbox_id": NOBODY},
    FORK: {"snapshot": "python", "count": 1},
    ANNOTATE: {"episode": "e1", "reward": 1.0},
}

_LIMITS = ("memory_max_bytes", "pids_max", "cpu_max_cores", "disk_max_bytes", "nofile_max", "file_size_max_bytes",
           "output_max_bytes", "lifetime_s", "idle_s")


def _exec_fields(etype: str) -> Iterator[tuple[str, dict[str, Any], tuple[str, ...]]]:
    """(what, changes to the base data, words) for the fields of an exec request (exec and run)."""
    for field in ("code", "command", "stdin"):
        other = {"code": None} if field == "command" else {}
        for what, value in (("a number", 1), ("true", True), ("an array", ["x"]), ("an object", {"a": 1})):
            yield f"{field} is {what}", {**other, field: value}, (field,)
        yield f"{field} with a lone surrogate", {**other, field: Raw('"x\\ud800"')}, (field, "surrogate")
    yield "code and command", {"command": "true"}, ("code", "command")
    yield "neither code nor command", {"code": None}, ("code", "command")
    yield "code is null, command too", {"code": None, "command": None}, ("code", "command")
    for what, value, words in (
            ("not an object", ["a.txt"], ("files",)), ("a number as content", {"a.txt": 1}, ("files",)),
            ("null content", {"a.txt": None}, ("files",)), ("'..' in a path", {"../../etc/passwd": "x"}, ("files", "..")),
            ("an absolute '..' path", {"/home/../../etc/x": "x"}, ("files", "..")), ("an empty path", {"": "x"}, ("files",)),
            ("the root as a path", {"/": "x"}, ("files", "directory")), ("'.' as a path", {".": "x"}, ("files",)),
            ("NUL in a path", {"a\x00b": "x"}, ("files", "NUL")), ("a 256-byte name", {"d/" + "n" * 256: "x"},
                                                                  ("files", "255 bytes")),
            ("a 4097-char path", {"d/" * 2049: "x"}, ("files", "4096")),
            ("a lone surrogate in a path", {Raw('"a\\udc00.txt"'): "x"}, ("files", "surrogate")),
            ("a lone surrogate in content", {"a.txt": Raw('"\\ud800"')}, ("files", "surrogate"))):
        yield f"files: {what}", {"files": value}, words
    for what, value, words in (
            ("a string", "a.txt", ("read_files",)), ("an object", {"a": 1}, ("read_files",)),
            ("a number item", [1], ("read_files",)), ("'..'", ["../x"], ("read_files", "..")),
            ("an empty path", [""], ("read_files",)), ("NUL", ["a\x00"], ("read_files", "NUL")),
            ("a 256-byte name", ["\u00e9" * 128], ("read_files", "256 bytes")),
            ("a lone surrogate", [Raw('"\\udfff"')], ("read_files", "surrogate"))):
        yield f"read_files: {what}", {"read_files": value}, words
    for what, value, words in (
            ("a list", ["A=1"], ("env",)), ("a number value", {"A": 1}, ("env",)), ("'=' in a name", {"A=B": "1"},
                                                                                   ("env",)),
            ("an empty name", {"": "1"}, ("env",)), ("NUL in a value", {"A": "1\x002"}, ("env",)),
            ("a lone surrogate in a value", {"A": Raw('"\\ud800"')}, ("env", "surrogate")),
            ("a lone surrogate in a name", {Raw('"\\ud800"'): "1"}, ("env", "surrogate"))):
        yield f"env: {what}", {"env": value}, words
    for what, value, words in (("0", 0, ("timeout_s",)), ("-1", -1, ("timeout_s",)), ("a day and a second", 86401,
                               ("timeout_s",)), ("true", True, ("timeout_s", "boolean")), ("a string", "soon",
                               ("timeout_s",)), ("null", None, ("timeout_s",)), ("1e999", Raw("1e999"), ("timeout_s",)),
                               ("NaN", Raw("NaN"), ("timeout_s",)), ("an array", [1], ("timeout_s",))):
        yield f"timeout_s {what}", {"timeout_s": value}, words


def _limits_fields() -> Iterator[tuple[str, dict[str, Any], tuple[str, ...]]]:
    yield "limits is a string", {"limits": "big"}, ("limits",)
    yield "limits is an array", {"limits": [1]}, ("limits",)
    yield "limits has an unknown field", {"limits": {"gpus": 1}}, ("limits.gpus",)
    for field in _LIMITS:
        for what, value in (("-1", -1), ("0", 0), ("10**20", 10**20), ("true", True), ("a string", "lots")):
            yield f"limits.{field} {what}", {"limits": {field: value}}, (f"limits.{field}",)


def _metadata_fields(field: str = "metadata") -> Iterator[tuple[str, dict[str, Any], tuple[str, ...]]]:
    for what, value, words in (
            ("a string", "x", (field,)), ("an array", ["x"], (field,)), ("a number value", {"episode": 3},
                                                                         (f"{field}.episode",)),
            ("a null value", {"episode": None}, (f"{field}.episode",)),
            ("an object value", {"episode": {"a": 1}}, (f"{field}.episode",)),
            ("33 items", {f"k{i}": "v" for i in range(33)}, (field, "at most 32")),
            ("an empty key", {"": "v"}, (field, "1-64")), ("a 65-char key", {"k" * 65: "v"}, (field, "1-64")),
            ("a 1025-char value", {"k": "v" * 1025}, (field, "1024")),
            ("a lone surrogate in a value", {"experiment": Raw('"e\\ud800"')}, (field, "lone surrogate")),
            ("a lone surrogate in a key", {Raw('"\\udc00k"'): "v"}, (field, "lone surrogate"))):
        yield f"{field}: {what}", {field: value}, words


def _data_fields() -> Iterator[tuple[str, str, dict[str, Any], tuple[str, ...]]]:
    """(event type, what, changes to its base data, words)."""
    for etype in _BASE:
        yield etype, "an unknown field", {"cdoe": "x"}, ("cdoe",)
    for etype in (EXEC, DESTROY, SNAPSHOT):
        for what, value in (("null", None), ("empty", ""), ("a number", 7), ("'..'", "../../etc"),
                            ("a slash", "sb/x"), ("129 chars", "s" * 129), ("NUL", "sb-\x00x"), ("CR", "sb-\rx"),
                            ("LF", "sb-\nx"), ("DEL", "sb-\x7fx"), ("a snowman", "sb-\u2603"),
                            ("a space", "sb x"), ("a lone surrogate", Raw('"sb-\\ud800"'))):
            change = {"sandbox_id": value} if value is not None else {"sandbox_id": Raw("null")}
            yield etype, f"sandbox_id {what}", change, ("sandbox_id",)
    for etype in (EXEC, RUN):
        for what, change, words in _exec_fields(etype):
            yield etype, what, change, words
    for etype in (CREATE, RUN, FORK):
        for what, value in (("'..'", "../../../etc"), ("a space", "py thon"), ("empty", ""), ("a number", 3),
                            ("257 chars", "s" * 257), ("NUL", "py\x00")):
            yield etype, f"snapshot {what}", {"snapshot": value}, ("snapshot",)
        for what, change, words in _metadata_fields():
            yield etype, what, change, words
    for etype in (CREATE, RUN):
        for what, change, words in _limits_fields():
            yield etype, what, change, words
    for what, value, words in (("0", 0, ("timeout_s",)), ("-5", -5, ("timeout_s",)), ("8 days", 8 * 86400,
                               ("timeout_s",)), ("true", True, ("timeout_s", "boolean")),
                               ("a string", "1h", ("timeout_s",))):
        yield CREATE, f"timeout_s {what}", {"timeout_s": value}, words
    yield CREATE, "timeout_s and limits.lifetime_s", {"timeout_s": 5, "limits": {"lifetime_s": 5}}, ("lifetime",)
    for what, value in (("an array", [1]), ("a number", 1), ("a string", "good")):
        yield DESTROY, f"outcome is {what}", {"outcome": value}, ("outcome",)
    for what, change, words in (
            ("reward a string", {"reward": "high"}, ("outcome.reward",)),
            ("reward true", {"reward": True}, ("reward", "boolean")),
            ("reward NaN", {"reward": Raw("NaN")}, ("outcome.reward", "finite")),
            ("reward 1e999", {"reward": Raw("1e999")}, ("outcome.reward", "finite")),
            ("an unknown field", {"score": 1}, ("outcome.score",)),
            *((what, {"labels": v[next(iter(v))]}, words) for what, v, words in
              (("labels: " + w, c, ws) for w, c, ws in _metadata_fields("labels")))):
        yield DESTROY, f"outcome {what}", {"outcome": change}, words
    for what, value in (("uppercase", "Python"), ("a slash", "a/b"), ("64 hex digits", "a" * 64), ("129 chars", "n" * 129),
                        ("empty", ""), ("a number", 5), ("a lone surrogate", Raw('"n\\ud800"'))):
        yield SNAPSHOT, f"name {what}", {"name": value}, ("name",)
    for what, change, words in (
            ("count 0", {"count": 0}, ("count",)), ("count 65", {"count": 65}, ("count",)),
            ("count -1", {"count": -1}, ("count",)), ("count true", {"count": True}, ("count", "boolean")),
            ("count a string", {"count": "two"}, ("count",)), ("count 1.5", {"count": 1.5}, ("count",)),
            ("count 10**30", {"count": 10**30}, ("count",)),
            ("both sandbox_id and snapshot", {"sandbox_id": NOBODY}, ("sandbox_id", "snapshot")),
            ("neither sandbox_id nor snapshot", {"snapshot": Raw("null")}, ("sandbox_id", "snapshot")),
            ("limits with sandbox_id", {"snapshot": Raw("null"), "sandbox_id": NOBODY, "limits": {"pids_max": 64}},
             ("limits",))):
        yield FORK, what, change, words
    for what, change, words in (
            ("episode missing", {"episode": Raw("null")}, ("episode",)), ("episode empty", {"episode": ""}, ("episode",)),
            ("episode a number", {"episode": 4}, ("episode",)), ("episode 1025 chars", {"episode": "e" * 1025},
                                                                 ("episode",)),
            ("episode a lone surrogate", {"episode": Raw('"e\\ud800"')}, ("episode",)),
            ("experiment empty", {"experiment": ""}, ("experiment",)),
            ("experiment a lone surrogate", {"experiment": Raw('"x\\udfff"')}, ("experiment",)),
            ("experiment an object", {"experiment": {"a": 1}}, ("experiment",)),
            ("reward NaN", {"reward": Raw("NaN")}, ("reward", "finite")),
            ("reward -Infinity", {"reward": Raw("-Infinity")}, ("reward", "finite")),
            ("reward true", {"reward": True}, ("reward", "boolean")),
            ("reward a string", {"reward": "1"}, ("reward",)),
            ("no reward and no labels", {"reward": Raw("null")}, ("reward", "labels")),
            *((f"labels: {w}", {"labels": c[next(iter(c))]}, ws) for w, c, ws in _metadata_fields("labels"))):
        yield ANNOTATE, what, change, words


def _data_cases() -> Iterator[Case]:
    for i, (etype, what, change, words) in enumerate(_data_fields()):
        data = {**_BASE[etype], **change}
        data = {k: v for k, v in data.items() if v is not None or k in change}
        short = etype.rsplit(".", 1)[1]
        if i % 3 == 0:  # a third of them in structured mode, the rest binary
            yield Case(f"{short} (structured): {what}", structured(data, etype=etype), 400, words)
        else:
            yield Case(f"{short}: {what}", binary(data, etype=etype), 400, words)
    yield Case("exec: a sandbox that does not exist", binary(_BASE[EXEC], etype=EXEC), 404, (NOBODY,))
    yield Case("destroy: a sandbox that does not exist", binary(_BASE[DESTROY], etype=DESTROY), 404, (NOBODY,))
    yield Case("snapshot: a sandbox that does not exist", binary(_BASE[SNAPSHOT], etype=SNAPSHOT), 404, (NOBODY,))
    yield Case("fork: a sandbox that does not exist", binary({"sandbox_id": NOBODY}, etype=FORK), 404, (NOBODY,))
    yield Case("run: a snapshot that does not exist", binary(run(snapshot="no-such-snapshot")), 404,
               ("no-such-snapshot",))
    yield Case("create: a snapshot that does not exist", binary({"snapshot": "no-such-snapshot"}, etype=CREATE), 404,
               ("no-such-snapshot",))
    yield Case("fork: a snapshot that does not exist", binary({"snapshot": "no-such-snapshot"}, etype=FORK), 404,
               ("no-such-snapshot",))


# -- HTTP itself --------------------------------------------------------------------------------------

def _http_cases() -> Iterator[Case]:
    ok_headers = [("ce-specversion", "1.0"), ("ce-id", _id()), ("ce-source", SOURCE), ("ce-type", RUN),
                  ("content-type", "application/json")]
    body = dumps(run())
    for method in ("GET", "PUT", "DELETE", "PATCH", "OPTIONS"):
        yield Case(f"method {method}", http(ok_headers, body, method=method), 405, (method, "POST"))
    for path in ("/run", "/metrics/x", "//", "/%00", "/run?x=1"):
        yield Case(f"path {path[:20]!r}", http(ok_headers, body, path=path), 404, ("POST CloudEvents to '/'",))
    yield Case("request line garbage", b"GARBAGE\r\n\r\n", 400, ("HTTP",))
    yield Case("HTTP/3.7 request line", http(ok_headers, body, version="HTTP/3.7"), 400, ("HTTP",))
    yield Case("request line without a version", http(ok_headers, body, version=""), 400, ("HTTP",))
    yield Case("header without a colon", http([*ok_headers, ("x-broken", "")], body).replace(b"x-broken: ", b"x-broken"),
               400, ("HTTP",))
    yield Case("header name with a space", http([*ok_headers, ("x bad", "1")], body), 400, ("HTTP",))
    yield Case("content-length not a number", http([*ok_headers, ("content-length", "ten")], body, length=False), 400,
               ("HTTP",))
    yield Case("content-length negative", http([*ok_headers, ("content-length", "-1")], body, length=False), 400,
               ("HTTP",))
    yield Case("content-length twice, different", http([*ok_headers, ("content-length", "1")], body), 400, ("HTTP",))
    yield Case("content-length and chunked", http([*ok_headers, ("transfer-encoding", "chunked")], b"0\r\n\r\n"), 400,
               ("HTTP",))
    yield Case("a bad chunk size", http([*ok_headers, ("transfer-encoding", "chunked")], b"ZZ\r\nxx\r\n0\r\n\r\n",
                                        length=False), 400, ("HTTP", "chunk"))
    yield Case("headers over 256 KiB", http([*ok_headers, *((f"x-filler-{i}", "f" * 1000) for i in range(300))],
                                            body), 431, ("headers", "256 KiB"))
    yield Case("one header of 1 MiB", http([*ok_headers, ("x-big", "b" * (1 << 20))], body), 431, ("headers",))
    cap = 8 * 1024 * 1024  # --max-body-bytes' default
    yield Case("a body over the cap", http(ok_headers, dumps(run(files={"big.txt": "x" * cap}))), 413,
               ("max body bytes",))
    # cut short and the client half-closes: nobody is left to answer (counted as 499, not an error)
    for what, sent in (("nothing of the body", b""), ("half the body", body[: len(body) // 2])):
        yield Case(f"cut short: {what}", http([*ok_headers, ("content-length", str(len(body)))], sent, length=False),
                   None, leaves=True)
    yield Case("cut short: half a chunk", http([*ok_headers, ("transfer-encoding", "chunked")],
                                               b"%x\r\n" % len(body) + body[:10], length=False), None, leaves=True)


# -- what is defined as a 2xx -------------------------------------------------------------------------

def _accepted() -> Iterator[Case]:
    """Odd but valid: each runs, answers 200, and its step is recorded."""
    def ok(name: str, request: bytes, reply: str = RESULT) -> Case:
        return Case(name, request, 200, reply=reply)

    yield ok("binary, a plain run", binary(run()))
    yield ok("binary, a UTF-8 byte order mark before the JSON (RFC 8259 lets a parser skip it)",
             binary(body=b"\xef\xbb\xbf" + dumps(run())))
    yield ok("a query string on /", http([("ce-specversion", "1.0"), ("ce-id", _id()), ("ce-source", SOURCE),
                                          ("ce-type", RUN), ("content-type", "application/json")], dumps(run()),
                                         path="/?x=1" + "y" * 1000))
    yield ok("structured, null optional attributes (the same as absent)",
             structured(run(), subject=None, dataschema=None, time=None, datacontenttype=None, myext=None))
    yield ok("structured, a plain run", structured(run()))
    yield ok("binary, charset in content-type", binary(run(), ctype="application/json; charset=utf-8"))
    yield ok("binary, no content-type", binary(run(), ctype=None))
    yield ok("binary, vendor +json content-type", binary(run(), ctype="application/vnd.example+json"))
    yield ok("binary, upper-case header names", binary(run()).replace(b"ce-id:", b"CE-ID:").replace(b"ce-type:",
                                                                                                      b"Ce-Type:"))
    yield ok("binary, time with a zone offset", binary(run(), time="2026-01-31T12:00:00+05:30"))
    yield ok("binary, time with nanoseconds", binary(run(), time="2026-01-31T12:00:00.123456789Z"))
    yield ok("structured, lower-case t and z in time", structured(run(), time="2026-01-31t12:00:00z"))
    yield ok("structured, extension boolean, integer and string",
             structured(run(), flag=True, count=2**31 - 1, neg=-(2**31), note="x"))
    yield ok("structured, non-ASCII text in attributes", structured(run(), subject="\u00e9t\u00e9 \u2603 \U0001f600"))
    yield ok("structured, an escaped surrogate pair in data", structured({**run(), "stdin": Raw('"\\ud83d\\ude00"')}))
    yield ok("binary, code printing invalid UTF-8", binary(run("import sys; sys.stdout.buffer.write(b'\\xff\\xfe')")))
    yield ok("binary, chunked body", http([("ce-specversion", "1.0"), ("ce-id", _id()), ("ce-source", SOURCE),
                                           ("ce-type", RUN), ("content-type", "application/json"),
                                           ("transfer-encoding", "chunked")],
                                          b"5\r\n" + dumps(run())[:5] + b"\r\n%x\r\n" % (len(dumps(run())) - 5)
                                          + dumps(run())[5:] + b"\r\n0\r\n\r\n", length=False))
    yield ok("binary, HTTP/1.0", http([("ce-specversion", "1.0"), ("ce-id", _id()), ("ce-source", SOURCE),
                                       ("ce-type", RUN), ("content-type", "application/json")], dumps(run()),
                                      version="HTTP/1.0"))
    yield ok("binary, files and env of odd but valid text",
             binary(run("import os; print(open('d/caf\u00e9 \u2603.txt').read(), os.environ['V'])",
                        files={"d/caf\u00e9 \u2603.txt": "\u00e9\x01\t"}, env={"V": "\u00e9 \x01"})))
    yield ok("binary, a file name of 255 bytes", binary(run(files={"n" * 255: "x"})))
    yield ok("binary, a command", binary({"command": "echo hi", "metadata": {"experiment": EXPERIMENT}}))
    yield ok("binary, a program that fails", binary(run("raise SystemExit(3)")))
    yield ok("annotate, reward only", binary({"experiment": EXPERIMENT, "episode": "e1", "reward": 0.5},
                                             etype=ANNOTATE), ANNOTATED)
    yield ok("annotate (structured), labels only", structured({"experiment": EXPERIMENT, "episode": "e2",
                                                               "labels": {"verdict": "pass"}}, etype=ANNOTATE),
             ANNOTATED)


CORPUS: tuple[Case, ...] = (*_binary_attributes(), *_binary_bodies(), *_structured_attributes(),
                            *_structured_bodies(), *_data_cases(), *_http_cases(), *_accepted())
