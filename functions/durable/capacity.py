"""The live-sandbox cap of one replica (``--max-live``): one number with one default, one check.

Both layers that refuse or make room for a new sandbox ask it: the service's admission (a request
that will hold a new sandbox is refused with 429 when the sandboxes running steps here, and those
being created, leave no room) and the durable layer (before a create, a resume or a fork's children
it hibernates the least recently used idle live copies until the new ones fit). ``rollbox serve``
gives the runtime the same number, which it keeps as its own safety limit (a ``Runtime`` used alone,
``rollbox run`` or the Python API, has its own default: ``RuntimeConfig.max_live``).
"""

from __future__ import annotations

__all__ = ["DEFAULT_MAX_LIVE", "LiveCap"]

DEFAULT_MAX_LIVE = 256


class LiveCap:
    """At most ``max_live`` sandboxes live at once on this replica."""

    def __init__(self, max_live: int = DEFAULT_MAX_LIVE):
        if max_live < 1:
            raise ValueError(f"max_live must be >= 1, got {max_live}")
        self.max_live = max_live

    def fits(self, count: int, n: int = 1) -> bool:
        """Whether ``n`` more sandboxes fit beside ``count`` (live, or being made)."""
        return count + n <= self.max_live

    def __repr__(self) -> str:
        return f"LiveCap({self.max_live})"
