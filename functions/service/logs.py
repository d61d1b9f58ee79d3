"""JSON-lines logs: one object per line, with the request's correlation fields at the top level."""

from __future__ import annotations

import json
import logging
import sys
from typing import IO, Any

__all__ = ["JsonFormatter", "configure", "lifecycle", "logger"]

logger = logging.getLogger("rollbox.functions")
# Start, drain and stop: always logged (at info), whatever the level, so supervisors can follow them.
lifecycle = logging.getLogger("rollbox.lifecycle")


class JsonFormatter(logging.Formatter):
    """``{"ts", "level", "msg", ...fields}``; fields come from ``extra={"fields": {...}}``."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": round(record.created, 6),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            out.update({k: v for k, v in fields.items() if v is not None})
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def configure(level: str = "info", stream: IO[str] | None = None) -> None:
    """Send rollbox's logs (and uvicorn's) to ``stream`` as JSON lines."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter())
    for name in ("rollbox", "uvicorn", "uvicorn.error"):
        lg = logging.getLogger(name)
        lg.handlers[:] = [handler]
        lg.setLevel(level.upper())
        lg.propagate = False
    lifecycle.handlers[:] = [handler]
    lifecycle.setLevel(logging.INFO)
    lifecycle.propagate = False
