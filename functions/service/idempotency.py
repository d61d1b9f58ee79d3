"""Idempotency the CloudEvents way: an event is identified by (source, id).

A bounded, expiring cache of replies. The first event with a key runs; concurrent duplicates wait
for it; later duplicates get the stored reply. A reply marked not ``cacheable`` (work refused
before it started: overload, shutdown) is handed to the waiters and then forgotten, so a retry runs.
A duplicate whose content differs from the first (same key, other type or data) is refused.
Bounded twice: by entries and by the bytes of the replies kept (outputs can be megabytes each).
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from rollbox.functions.contract.models import Conflict

__all__ = ["Conflict", "IdempotencyCache"]

R = TypeVar("R")


@dataclass
class _Entry(Generic[R]):
    fingerprint: str
    future: asyncio.Future[R]
    expires_at: float = field(default=float("inf"))
    size: int = 0


class IdempotencyCache(Generic[R]):
    def __init__(
        self,
        max_entries: int,
        ttl_s: float,
        *,
        cacheable: Callable[[R], bool],
        max_bytes: int | None = None,
        size_of: Callable[[R], int] = lambda _: 0,
        clock: Callable[[], float] = time.monotonic,
    ):
        if max_entries < 1 or ttl_s <= 0 or (max_bytes is not None and max_bytes < 1):
            raise ValueError("max_entries and max_bytes must be >= 1 and ttl_s > 0")
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self.bytes = 0
        self._size_of = size_of
        self._cacheable = cacheable
        self._clock = clock
        self._entries: OrderedDict[tuple[str, str], _Entry[R]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def _drop(self, key: tuple[str, str]) -> None:
        self.bytes -= self._entries.pop(key).size

    async def run(self, key: tuple[str, str], fingerprint: str, fn: Callable[[], Awaitable[R]]) -> tuple[R, bool]:
        """The reply for ``key``: ``fn()``'s on first sight, else the first one. Returns (reply, replayed)."""
        while True:
            entry = self._entries.get(key)
            if entry is not None and entry.future.done() and entry.expires_at <= self._clock():
                self._drop(key)
                entry = None
            if entry is None:
                break
            if entry.fingerprint != fingerprint:
                raise Conflict(
                    f"an event with source {key[0]!r} and id {key[1]!r} was already handled "
                    "with different content; give a new event a new id"
                )
            try:
                return await asyncio.shield(entry.future), True
            except asyncio.CancelledError:
                if entry.future.cancelled():  # the first run was abandoned: this one takes over
                    continue
                raise
        loop = asyncio.get_running_loop()
        entry = _Entry(fingerprint, loop.create_future())
        self._entries[key] = entry
        self._evict()
        try:
            reply = await fn()
        except BaseException:
            if self._entries.get(key) is entry:
                self._drop(key)
            entry.future.cancel()
            raise
        entry.future.set_result(reply)
        if self._entries.get(key) is not entry:
            return reply, False
        if self._cacheable(reply):
            entry.expires_at = self._clock() + self.ttl_s
            entry.size = self._size_of(reply)
            self.bytes += entry.size
            self._entries.move_to_end(key)
            self._evict()
        else:
            del self._entries[key]
        return reply, False

    def _evict(self) -> None:
        """Drop expired entries, then the oldest finished ones while over either bound (entries, bytes).
        Entries still running are never dropped (that would let a duplicate run twice)."""
        now = self._clock()
        while self._entries:
            key, e = next(iter(self._entries.items()))
            if not (e.future.done() and e.expires_at <= now):
                break
            self._drop(key)
        skipped = 0
        while (
            len(self._entries) > self.max_entries or (self.max_bytes is not None and self.bytes > self.max_bytes)
        ) and skipped < len(self._entries):
            key, e = next(iter(self._entries.items()))
            if e.future.done():
                self._drop(key)
            else:
                self._entries.move_to_end(key)
                skipped += 1
