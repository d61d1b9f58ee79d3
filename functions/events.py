"""CloudEvents over HTTP for the service: pure conversions between HTTP messages and events.

The cloudevents SDK does the parsing and rendering; this module only decides the content mode,
turns the SDK's (and JSON's) exceptions into ``ReplyError`` with a status and a message that says
what to fix, and builds reply and error events.
"""

from __future__ import annotations

import enum
import json
import re
import uuid
from collections.abc import Mapping
from typing import Any

from cloudevents import exceptions as ce_exceptions
from cloudevents.conversion import to_binary, to_structured
from cloudevents.http import CloudEvent, from_http
from pydantic import BaseModel
from rollbox.functions.contract import ERROR, EVENT_SOURCE, ErrorCode, ErrorData

__all__ = ["Mode", "ReplyError", "content_mode", "decode", "encode", "error_event", "reply_event"]

JSON = "application/json"
STRUCTURED = "application/cloudevents+json"
BATCH = "application/cloudevents-batch+json"
MAX_ATTR_CHARS = 1024  # id, source, type
_TOO_DEEP = "nested too deep (JSON arrays and objects may nest at most about 900 levels)"
_HEADER_SAFE = re.compile(r"[\x20-\x7e]{1,1024}")  # printable ASCII: a valid HTTP header value


class Mode(enum.Enum):
    BINARY = "binary"
    STRUCTURED = "structured"


class ReplyError(Exception):
    """A request that gets an error event: HTTP status, stable code, a message naming the problem."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        *,
        details: Mapping[str, Any] | None = None,
        sandbox_id: str | None = None,
        retry_after_s: float | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.details = dict(details or {})
        self.sandbox_id = sandbox_id
        self.retry_after_s = retry_after_s


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


def decode(headers: Mapping[str, str], body: bytes) -> CloudEvent:
    """Parse a CloudEvents 1.0 request with JSON data (either mode). Raises ``ReplyError``."""
    media = _media_type(headers)
    if media == BATCH:
        raise ReplyError(
            415,
            ErrorCode.UNSUPPORTED_MEDIA_TYPE,
            "batched CloudEvents are not supported: send one event per request",
        )
    if media.startswith("application/cloudevents") and media != STRUCTURED:
        raise ReplyError(
            415,
            ErrorCode.UNSUPPORTED_MEDIA_TYPE,
            f"unsupported event format {media!r}: use {STRUCTURED!r} or binary mode",
        )
    if content_mode(headers) is Mode.BINARY and media and not _is_json(media):
        raise ReplyError(
            415,
            ErrorCode.UNSUPPORTED_MEDIA_TYPE,
            f"unsupported content type {media!r}: event data must be {JSON!r} (binary mode, "
            f"ce-* headers) or the body an event as {STRUCTURED!r} (structured mode)",
        )
    try:
        body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ReplyError(
            400,
            ErrorCode.INVALID_EVENT,
            f"the body is not valid UTF-8 (byte {exc.start}): JSON must be UTF-8",
        ) from None
    if content_mode(headers) is Mode.BINARY:  # name the attribute that is missing or empty
        lower = {k.lower(): v for k, v in headers.items()}
        for attr in ("specversion", "id", "source", "type"):
            if not lower.get(f"ce-{attr}", "").strip():
                what = "empty" if f"ce-{attr}" in lower else "missing"
                raise ReplyError(400, ErrorCode.INVALID_EVENT,
                                 f"the ce-{attr} header is {what}: a binary-mode CloudEvent needs ce-specversion "
                                 "(1.0), ce-id, ce-source and ce-type (or send application/cloudevents+json)")
    too_deep: list[bool] = []

    def unmarshal(content: str | bytes | None) -> Any:
        try:
            return _strict_json(content)
        except RecursionError:
            too_deep.append(True)
            raise ValueError(_TOO_DEEP) from None

    try:
        event = from_http(dict(headers), body, data_unmarshaller=unmarshal)
    except RecursionError:  # structured mode: the whole body is parsed as JSON
        raise ReplyError(400, ErrorCode.INVALID_EVENT, f"the body is not valid JSON: {_TOO_DEEP}") from None
    except ce_exceptions.DataUnmarshallerError as exc:
        if too_deep:
            raise ReplyError(400, ErrorCode.INVALID_EVENT, f"event data is not valid JSON: {_TOO_DEEP}") from None
        raise ReplyError(
            400, ErrorCode.INVALID_EVENT, f"event data is not valid JSON: {_clip(str(exc))}"
        ) from None
    except json.JSONDecodeError as exc:
        raise ReplyError(400, ErrorCode.INVALID_EVENT, f"event data is not valid JSON: {exc}") from None
    except ce_exceptions.GenericException as exc:
        raise ReplyError(
            400,
            ErrorCode.INVALID_EVENT,
            f"not a valid CloudEvent: {_clip(str(exc))}; required attributes are "
            "specversion (1.0), id, source, type",
        ) from None
    except (ValueError, TypeError, AttributeError) as exc:
        raise ReplyError(400, ErrorCode.INVALID_EVENT, f"not a valid CloudEvent: {_clip(str(exc))}") from None
    if event["specversion"] != "1.0":
        raise ReplyError(
            400, ErrorCode.INVALID_EVENT, f"specversion {event['specversion']!r} is not supported: use '1.0'"
        )
    for attr in ("id", "source", "type"):
        if not isinstance(event[attr], str) or not event[attr]:
            raise ReplyError(400, ErrorCode.INVALID_EVENT, f"attribute {attr!r} must be a non-empty string")
        if len(event[attr]) > MAX_ATTR_CHARS:
            raise ReplyError(400, ErrorCode.INVALID_EVENT,
                             f"attribute {attr!r} is {len(event[attr])} chars long: at most {MAX_ATTR_CHARS}")
        try:
            event[attr].encode("utf-8")
        except UnicodeEncodeError as exc:  # a JSON escape such as \ud800: valid JSON, not storable text
            raise ReplyError(400, ErrorCode.INVALID_EVENT,
                             f"attribute {attr!r} is not valid UTF-8: lone surrogate at position {exc.start}") from None
    for name, value in event.get_attributes().items():  # CloudEvents attributes are scalars
        if isinstance(value, dict | list) or value is None:
            kind = "an object" if isinstance(value, dict) else "an array" if isinstance(value, list) else "null"
            raise ReplyError(400, ErrorCode.INVALID_EVENT,
                             f"attribute {_clip(name, 64)!r} is {kind}: CloudEvents attributes are strings, "
                             "integers or booleans")
    dct = event.get("datacontenttype")
    if dct is not None and not _is_json(str(dct).split(";", 1)[0].strip().lower()):
        raise ReplyError(
            415,
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
