"""JSON on the supervisor's side (frames to zygotes and agents, sandbox records): orjson, ~10x faster
than json on what every step sends and stores, with json for what orjson refuses — a lone surrogate
in a string (a client's text, an error naming an undecodable file), NaN — so both read and write
everything json did. Inside a sandbox only the stdlib is there: runtime/inside/proto.py uses json."""

from __future__ import annotations

import json
from typing import Any

import orjson


def dumps(obj: Any) -> bytes:
    """Compact JSON (as ``json.dumps(obj, separators=(",", ":"))``, UTF-8 rather than escaped)."""
    try:
        return orjson.dumps(obj, option=orjson.OPT_NON_STR_KEYS)
    except TypeError:
        return json.dumps(obj, separators=(",", ":")).encode()


def loads(data: bytes) -> Any:
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:  # json judges what orjson refuses (and raises ValueError if it is not JSON)
        return json.loads(data)
