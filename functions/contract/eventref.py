"""The identity of a request event, as the layers below the service need it: ``EventRef``.

The durable layer records each reply under the event's ``key`` and derives the ids of the sandboxes
an event creates from it, so a redelivered event finds its reply, and a redelivered create its
sandbox, on any replica. It is passed as a parameter wherever it decides something (never read from
a context variable): a create made through the Python API with the same ``EventRef`` is idempotent
as one that came over HTTP.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

__all__ = ["EventRef"]


@dataclass
class EventRef:
    """The event a handler is serving: its CloudEvents identity (source, id) and a fingerprint of its
    content (an event with the same identity and other content is a conflict)."""

    source: str
    id: str
    fingerprint: str
    creates: int = field(default=0)  # sandboxes this event made so far (their ids are derived in order)

    @property
    def key(self) -> str:
        return hashlib.sha256(f"{self.source}\0{self.id}".encode()).hexdigest()[:32]

    def sandbox_id(self, n: int) -> str:
        """The id of the ``n``-th sandbox (from 0) this event creates."""
        return "sb-" + hashlib.sha256(f"{self.key}/{n}".encode()).hexdigest()[:20]

    def next_sandbox_id(self) -> str:
        n = self.creates
        self.creates += 1
        return self.sandbox_id(n)
