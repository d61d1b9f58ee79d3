"""Environment variables that mirror CLI flags, cast strictly (a bad value is an error, not a default)."""

from __future__ import annotations

import os


class EnvError(SystemExit):
    def __init__(self, name: str, value: str, kind: str):
        super().__init__(f"rollbox: environment variable {name}={value!r} is not a valid {kind}")


def env_default(name: str, default: str) -> str:
    return os.environ.get(name, default)


def env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        return int(raw)
    except ValueError:
        raise EnvError(name, raw, "integer") from None


def env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        return float(raw)
    except ValueError:
        raise EnvError(name, raw, "number") from None


def env_bool(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None:
        return default
    low = raw.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise EnvError(name, raw, "bool (true/false/1/0/yes/no/on/off)")
