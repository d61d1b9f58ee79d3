"""Command-line options mirrored by environment variables, cast strictly.

A flag wins over its variable, the variable over the default; a value that cannot be used is a
``ConfigError`` naming the flag or variable it came from (``PORT: not a valid integer: 'x'``).
Never writes ``os.environ``.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollbox.runtime.errors import RollboxError

__all__ = ["ConfigError", "Option", "add_options", "resolve_options"]


class ConfigError(RollboxError, ValueError):
    """A flag or environment variable with a value that cannot be used; the message names it. (Under
    rollbox's one root; still a ValueError, as it was.)"""


def integer(minimum: int) -> Callable[[str], int]:
    def cast(raw: str) -> int:
        s = raw.strip()
        if not s.isdigit():
            raise ValueError(f"not a valid integer: {raw!r}")
        v = int(s)
        if v < minimum:
            raise ValueError(f"must be >= {minimum}, got {v}")
        return v

    return cast


def port(raw: str) -> int:
    """A TCP port, 0 (any free one) to 65535."""
    v = integer(0)(raw)
    if v > 65535:
        raise ValueError(f"not a TCP port (0-65535; 0: any free port): {v}")
    return v


def _seconds(raw: str, *, zero_ok: bool) -> float:
    try:
        v = float(raw.strip())
    except ValueError:
        raise ValueError(f"not a valid number of seconds: {raw!r}") from None
    if not math.isfinite(v) or v < 0 or (v == 0 and not zero_ok):
        bound = ">= 0 (0: never)" if zero_ok else "> 0"
        raise ValueError(f"must be a finite number {bound}, got {raw!r}")
    return v


def seconds(raw: str) -> float:
    return _seconds(raw, zero_ok=False)


def seconds_or_never(raw: str) -> float:
    """Seconds, where 0 means never (for windows that may be switched off)."""
    return _seconds(raw, zero_ok=True)


def amount(raw: str) -> float:
    """A finite number >= 0 (a price)."""
    try:
        v = float(raw.strip())
    except ValueError:
        raise ValueError(f"not a valid number: {raw!r}") from None
    if not math.isfinite(v) or v < 0:
        raise ValueError(f"must be a finite number >= 0, got {raw!r}")
    return v


def choice(*allowed: str) -> Callable[[str], str]:
    def cast(raw: str) -> str:
        v = raw.strip().lower()
        if v not in allowed:
            raise ValueError(f"must be one of {', '.join(allowed)}, got {raw!r}")
        return v

    return cast


def text(raw: str) -> str:
    if not raw.strip():
        raise ValueError("must not be empty")
    return raw.strip()


def path(raw: str) -> Path:
    if not raw.strip():
        raise ValueError("must not be empty")
    return Path(raw.strip())


def names(raw: str) -> tuple[str, ...]:
    """A comma-separated list of names (``""``: none); each a plain name, no blanks inside."""
    out = tuple(n.strip() for n in raw.split(",") if n.strip())
    bad = [n for n in out if not all(c.isalnum() or c in "-_.:" for c in n)]
    if bad:
        raise ValueError(f"not a name: {bad[0]!r} (comma-separated names, e.g. python,python-sci)")
    return tuple(dict.fromkeys(out))


def uid_range(raw: str) -> str:
    """``START:COUNT`` of host uids, or ``none``."""
    from rollbox.runtime.slots import parse_range

    parse_range(raw)  # raises ValueError naming the problem
    return raw.strip()


def level(raw: str) -> str:
    v = raw.strip().lower()
    if v not in ("debug", "info", "warning", "error"):
        raise ValueError(f"not a log level (debug, info, warning, error): {raw!r}")
    return v


@dataclass(frozen=True)
class Option:
    dest: str
    flag: str
    env: str
    cast: Callable[[str], Any]
    default: Any
    help: str




def add_options(parser: argparse.ArgumentParser, options: tuple[Option, ...]) -> None:
    for opt in options:
        parser.add_argument(opt.flag, dest=opt.dest, default=None,
                            help=f"{opt.help} (env {opt.env}, default {opt.default})")


def resolve_options(options: tuple[Option, ...], args: argparse.Namespace,
                    environ: Mapping[str, str]) -> dict[str, Any]:
    """Flag, else environment variable, else default; each cast strictly. Raises ``ConfigError``."""
    values: dict[str, Any] = {}
    for opt in options:
        given = getattr(args, opt.dest, None)
        if given is not None:
            raw, origin = given, opt.flag
        elif environ.get(opt.env) is not None:
            raw, origin = environ[opt.env], opt.env
        else:
            values[opt.dest] = opt.default
            continue
        try:
            values[opt.dest] = opt.cast(raw)
        except ValueError as exc:
            raise ConfigError(f"{origin}: {exc}") from None
    return values
