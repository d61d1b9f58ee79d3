"""rollbox.runtime: isolated sandboxes restored from warm snapshots.

This package is also loaded inside zygotes with the standard library only, so it exports lazily.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "DEFAULT_LIMITS",
    "ExecRequest",
    "ExecResult",
    "Limits",
    "Runtime",
    "RuntimeConfig",
    "SandboxInfo",
    "Usage",
]

_WHERE = {
    "Runtime": "rollbox.runtime.runtime",
    "RuntimeConfig": "rollbox.runtime.runtime",
    "DEFAULT_LIMITS": "rollbox.runtime.spec",
    "ExecRequest": "rollbox.runtime.spec",
    "ExecResult": "rollbox.runtime.spec",
    "Limits": "rollbox.runtime.spec",
    "SandboxInfo": "rollbox.runtime.spec",
    "Usage": "rollbox.runtime.spec",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        import importlib

        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'rollbox.runtime' has no attribute {name!r}")
