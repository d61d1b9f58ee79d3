"""CloudEvents over HTTP for the service: pure conversions between HTTP messages and events.

The cloudevents SDK does the parsing and rendering; this module only decides the content mode,
turns the SDK's (and JSON's) exceptions into ``ReplyError`` with a status and a message that says
what to fix, and builds reply and error events.
"""

from __future__ import annotations

import datetime as dt
import enum
import json
import re
import uuid
from collections.abc import Iterable, Mapping
from typing import Any

from cloudevents import exceptions as ce_exceptions
from cloudevents.conversion import to_binary, to_structured
from cloudevents.http import CloudEvent, from_http
from pydantic import BaseModel
from rollbox.functions.contract.models import ERROR, EVENT_SOURCE, ErrorCode, ErrorData
from rollbox.runtime.errors import RollboxError

__all__ = ["Mode", "ReplyError", "check_attributes", "check_headers", "content_mode", "decode", "encode", "error_event",
           "reply_event"]

JSON = "application/json"
STRUCTURED = "application/cloudevents+json"
BATCH = "application/cloudevents-batch+json"
MAX_ATTR_CHARS = 1024  # id, source, type
_TOO_DEEP = "nested too deep (JSON arrays and objects may nest at most about 900 levels)"
_HEADER_SAFE = re.compile(r"[\x20-\x7e]{1,1024}")  # printable ASCII: a valid HTTP header value
_HEADER_VALUE = re.compile(rb"[\x20-\x7e]*")
_ATTR_NAME = re.compile(r"[a-z0-9]{1,64}")
_REQUIRED_TEXT = ("id", "source", "type")
_TEXT_ATTRS = frozenset({"id", "source", "type", "subject", "dataschema", "datacontenttype", "time"})
# what a CloudEvents string must not hold: C0/C1 controls, DEL, surrogates, noncharacters
_NOT_TEXT = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff\ufdd0-\ufdef"
                       + "".join(f"{chr(p << 16 | 0xFFFE)}{chr(p << 16 | 0xFFFF)}" for p in range(17)) + "]")
_RFC3339 = re.compile(r"\d{4}-\d{2}-\d{2}[Tt ]\d{2}:\d{2}:\d{2}(\.\d+)?([Zz]|[+-]\d{2}:\d{2})")


class Mode(enum.Enum):
    BINARY = "binary"
    STRUCTURED = "structured"


class ReplyError(RollboxError):
    """A request that gets an error event: a stable code (which carries the HTTP status), a message
    naming the problem."""

    def __init__(
        self,
        code: ErrorCode,
        message: str,
        *,
        details: Mapping[str, Any] | None = None,
        sandbox_id: str | None = None,
        retry_after_s: float | None = None,
    ):
        super().__init__(message, sandbox_id=sandbox_id)
        self.code = code
        self.details = dict(details or {})
        self.retry_after_s = retry_after_s

    @property
    def status(self) -> int:
        return self.code.status


def _media_type(headers: Mapping[str, str]) -> str:
    return headers.get("content-type", "").split(";", 1)[0].strip().lower()


def content_mode(headers: Mapping[str, str]) -> Mode:
    """Structured when the body is a whole event (``application/cloudevents+json``), else binary."""
    return Mode.STRUCTURED if _media_type(headers).startswith("application/cloudevents") else Mode.BINARY


def _is_json(media_type: str) -> bool:
    return media_type == JSON or media_type.endswith("+json")


def _strict_json(content: str | bytes | None) -> Any:
    if content is None or content in ("", b""):
        return None
    return json.loads(content)


def _clip(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


def _kind(value: Any) -> str:
    """A JSON value's kind, as a message names it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    return "an object" if isinstance(value, dict) else "an array" if isinstance(value, list) else type(value).__name__


def _json_problem(exc: BaseException) -> str:
    """What is wrong with a JSON text, as ``json`` found it, without Python's own words."""
    if isinstance(exc, RecursionError):
        return _TOO_DEEP
    if isinstance(exc, json.JSONDecodeError):
        return f"{exc.msg} at line {exc.lineno} column {exc.colno}"
    if "digits" in str(exc):  # int("1" * 5000): Python's limit on the digits of an integer
        return "a number has more than 4300 digits"
    return _clip(str(exc))


def _specversion_error(value: Any) -> ReplyError:
    if not isinstance(value, str):
        return ReplyError(ErrorCode.INVALID_EVENT,
                          f"attribute 'specversion' must be the string '1.0', got {_kind(value)}")
    return ReplyError(ErrorCode.INVALID_EVENT,
                      f"specversion {_clip(value, 64)!r} is not supported: this service takes CloudEvents 1.0 "
                      "(specversion '1.0')")


def check_headers(raw: Iterable[tuple[bytes, bytes]]) -> None:
    """The request's own header lines (a mapping has lost them): a ``ce-*`` or ``content-type`` header
    given twice (which one counts?) or a ``ce-*`` value outside printable ASCII (the CloudEvents HTTP
    binding asks for percent-encoding) is refused, named."""
    seen: set[bytes] = set()
    for name, value in raw:
        if not name.startswith(b"ce-") and name != b"content-type":
            continue
        if name in seen:
            raise ReplyError(ErrorCode.INVALID_EVENT,
                             f"the {name.decode('latin-1')!r} header is given more than once: send it once")
        seen.add(name)
        if name != b"content-type" and not _HEADER_VALUE.fullmatch(value):
            bad = next(i for i, c in enumerate(value) if not 0x20 <= c <= 0x7E)
            raise ReplyError(ErrorCode.INVALID_EVENT,
                             f"the {_clip(name.decode('latin-1'), 64)!r} header has byte 0x{value[bad]:02x} at "
                             f"position {bad}: header values are printable ASCII (percent-encode other text, as "
                             "the CloudEvents HTTP binding says)")


def check_attributes(attrs: Mapping[str, Any]) -> None:
    """A CloudEvents 1.0 event's attributes, each by the spec's rules, the first wrong one named: names
    of lower-case letters and digits; values strings, booleans or 32-bit integers; strings without
    control characters, lone surrogates or noncharacters; id, source and type non-empty, at most
    ``MAX_ATTR_CHARS``; time an RFC 3339 timestamp. A null optional attribute is one not given (the
    JSON format: "it MUST be treated as the equivalent of unset")."""
    for name, value in attrs.items():
        if value is None and name not in _REQUIRED_TEXT and name != "specversion":
            continue
        if not isinstance(name, str) or not _ATTR_NAME.fullmatch(name):
            raise ReplyError(ErrorCode.INVALID_EVENT,
                             f"attribute name {_clip(str(name), 64)!r} is not valid: CloudEvents attribute names "
                             "are lower-case ASCII letters and digits (at most 64)")
        if name == "specversion":
            if value != "1.0":
                raise _specversion_error(value)
            continue
        if name in _REQUIRED_TEXT:
            if not isinstance(value, str) or not value:
                raise ReplyError(ErrorCode.INVALID_EVENT, f"attribute {name!r} must be a non-empty string")
            if len(value) > MAX_ATTR_CHARS:
                raise ReplyError(ErrorCode.INVALID_EVENT,
                                 f"attribute {name!r} is {len(value)} chars long: at most {MAX_ATTR_CHARS}")
        if isinstance(value, str):
            _check_text(name, value)
            if name == "time":
                _check_time(value)
            continue
        if name in _TEXT_ATTRS:
            raise ReplyError(ErrorCode.INVALID_EVENT, f"attribute {name!r} must be a string, got {_kind(value)}")
        if isinstance(value, bool):
            continue
        if isinstance(value, int):
            if not -(2**31) <= value < 2**31:
                raise ReplyError(ErrorCode.INVALID_EVENT,
                                 f"attribute {_clip(name, 64)!r} is out of range: CloudEvents integers are 32-bit "
                                 "(-2147483648 to 2147483647)")
            continue
        kind = "a number with a fraction" if isinstance(value, float) else _kind(value)  # (null: above)
        raise ReplyError(ErrorCode.INVALID_EVENT,
                         f"attribute {_clip(name, 64)!r} is {kind}: CloudEvents attributes are strings, integers "
                         "or booleans")


def _check_text(name: str, value: str) -> None:
    if value.isascii() and value.isprintable():  # the usual case, without the regex (~15x faster)
        return
    bad = _NOT_TEXT.search(value)
    if bad is None:
        return
    ch = bad.group()
    what = ("not valid UTF-8: lone surrogate" if "\ud800" <= ch <= "\udfff"
            else "a control character" if ch <= "\x1f" or "\x7f" <= ch <= "\x9f" else "a noncharacter")
    raise ReplyError(ErrorCode.INVALID_EVENT,
                     f"attribute {_clip(name, 64)!r} is {what} at position {bad.start()} (U+{ord(ch):04X}): "
                     "CloudEvents strings exclude control characters, surrogates and noncharacters")


def _check_time(value: str) -> None:
    ok = _RFC3339.fullmatch(value) is not None
    if ok:
        try:
            dt.datetime.fromisoformat(value.upper().replace("Z", "+00:00"))
        except ValueError:
            ok = False
    if not ok:
        raise ReplyError(ErrorCode.INVALID_EVENT,
                         f"attribute 'time' is {_clip(value, 64)!r}: not an RFC 3339 timestamp "
                         "(e.g. 2026-01-31T12:00:00Z)")


def _structured_problem(body: bytes) -> ReplyError | None:
    """Why the SDK could not read a structured-mode body, in the terms of the request: parsed again
    (this runs only for a body that failed) and checked attribute by attribute."""
    try:
        raw = json.loads(body)
    except (RecursionError, ValueError) as exc:
        return ReplyError(ErrorCode.INVALID_EVENT,
                          f"the body is not valid JSON: {_json_problem(exc)} (a structured-mode CloudEvent is "
                          "one JSON object)")
    if not isinstance(raw, dict):
        return ReplyError(ErrorCode.INVALID_EVENT,
                          f"the body is {_kind(raw)}: a structured-mode CloudEvent is one JSON object (its "
                          "attributes, and its data under 'data')")
    for attr in ("specversion", "id", "source", "type"):
        if attr not in raw:
            return ReplyError(ErrorCode.INVALID_EVENT,
                              f"attribute {attr!r} is missing: a CloudEvent needs specversion ('1.0'), id, source "
                              "and type")
    if "data_base64" in raw:
        return ReplyError(ErrorCode.INVALID_EVENT,
                          "'data_base64' (binary data) is not supported: event data is JSON, under 'data'")
    try:
        check_attributes({k: v for k, v in raw.items() if k != "data"})
    except ReplyError as err:
        return err
    return None


def decode(headers: Mapping[str, str], body: bytes, raw_headers: Iterable[tuple[bytes, bytes]] = ()) -> CloudEvent:
    """Parse a CloudEvents 1.0 request with JSON data (either mode). Raises ``ReplyError``.
    ``raw_headers``: the request's header lines as received (duplicates are refused)."""
    media = _media_type(headers)
    if media == BATCH:
        raise ReplyError(
            ErrorCode.UNSUPPORTED_MEDIA_TYPE,
            f"batched CloudEvents ({BATCH!r}) are not supported: send one event per request",
        )
    if media.startswith("application/cloudevents") and media != STRUCTURED:
        raise ReplyError(
            ErrorCode.UNSUPPORTED_MEDIA_TYPE,
            f"unsupported event format {media!r}: use {STRUCTURED!r} or binary mode",
        )
    mode = content_mode(headers)
    if mode is Mode.BINARY and media and not _is_json(media):
        raise ReplyError(
            ErrorCode.UNSUPPORTED_MEDIA_TYPE,
            f"unsupported content type {media!r}: event data must be {JSON!r} (binary mode, "
            f"ce-* headers) or the body an event as {STRUCTURED!r} (structured mode)",
        )
    check_headers(raw_headers)
    try:
        body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ReplyError(
            ErrorCode.INVALID_EVENT,
            f"the body is not valid UTF-8 (byte {exc.start}): JSON must be UTF-8",
        ) from None
    if mode is Mode.BINARY:  # name the attribute that is missing or empty
        lower = {k.lower(): v for k, v in headers.items()}
        for attr in ("specversion", "id", "source", "type"):
            if not lower.get(f"ce-{attr}", "").strip():
                what = "empty" if f"ce-{attr}" in lower else "missing"
                raise ReplyError(ErrorCode.INVALID_EVENT,
                                 f"the ce-{attr} header is {what}: a binary-mode CloudEvent needs ce-specversion "
                                 "(1.0), ce-id, ce-source and ce-type (or send application/cloudevents+json)")
        if lower["ce-specversion"] != "1.0":  # 0.3 parses, 2.0 does not: the same answer for both
            raise _specversion_error(lower["ce-specversion"])
    failed: list[BaseException] = []

    def unmarshal(content: str | bytes | None) -> Any:
        try:
            return _strict_json(content)
        except (RecursionError, ValueError) as exc:
            failed.append(exc)
            raise ValueError("not JSON") from None

    if mode is Mode.STRUCTURED and b'"data_base64"' in body:  # (a cheap look first: it is rare)
        err = _structured_problem(body)
        if err is not None:
            raise err
    try:
        event = from_http(dict(headers), body, data_unmarshaller=unmarshal)
    except ce_exceptions.DataUnmarshallerError as exc:
        problem = _json_problem(failed[0]) if failed else _clip(str(exc))
        raise ReplyError(ErrorCode.INVALID_EVENT, f"data is not valid JSON: {problem}") from None
    except (ce_exceptions.GenericException, RecursionError, ValueError, TypeError, AttributeError) as exc:
        err = _structured_problem(body) if mode is Mode.STRUCTURED else None
        if err is not None:
            raise err from None
        raise ReplyError(
            ErrorCode.INVALID_EVENT,
            f"not a valid CloudEvent: {_clip(str(exc))}; required attributes are specversion (1.0), id, source, type",
        ) from None
    check_attributes(event.get_attributes())
    dct = event.get("datacontenttype")
    if dct is not None and not _is_json(str(dct).split(";", 1)[0].strip().lower()):
        raise ReplyError(
            ErrorCode.UNSUPPORTED_MEDIA_TYPE,
            f"unsupported datacontenttype {dct!r}: event data must be {JSON!r}",
        )
    return event


def reply_event(event_type: str, data: BaseModel | Mapping[str, Any], subject: str | None) -> CloudEvent:
    """A reply event (Knative's reply contract: it travels in the HTTP response)."""
    attrs = {
        "specversion": "1.0",
        "id": uuid.uuid4().hex,
        "source": EVENT_SOURCE,
        "type": event_type,
        "datacontenttype": JSON,
    }
    if subject and _HEADER_SAFE.fullmatch(subject):  # it becomes the ce-subject header in binary mode
        attrs["subject"] = subject
    payload = data.model_dump(mode="json") if isinstance(data, BaseModel) else dict(data)
    return CloudEvent(attrs, payload)


def error_event(err: ReplyError) -> CloudEvent:
    return reply_event(
        ERROR, ErrorData(code=err.code, message=err.message, details=err.details), err.sandbox_id
    )


def encode(event: CloudEvent, mode: Mode) -> tuple[dict[str, str], bytes]:
    """Render ``event`` as HTTP headers and body in ``mode``."""
    if mode is Mode.STRUCTURED:
        headers, body = to_structured(event)
    else:
        headers, body = to_binary(event)
    return dict(headers), body if isinstance(body, bytes) else str(body).encode()
