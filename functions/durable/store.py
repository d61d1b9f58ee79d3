"""Store I/O of durable sandbox state: records (one per generation), the blobs of large files, and
what this replica remembers of them.

``StateStore`` reads and writes ``sandboxes/<id>/<generation>.json`` (``rollbox.snapshots.state``)
create-only, each call with the store's deadline (a hung store is a 503, ``StoreDeadline``); on the
local store a record is read on the event loop and a commit's two syncs go through Linux AIO. It keeps
the newest record seen of recent sandboxes, as stored (a resume reads on from it), each sandbox's generation
and when the sweep may next have to do with it, and a bounded cache of blobs (content-addressed, so
never stale). It knows nothing of live sandboxes (``residency``) or of steps (``runtime``).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import logging
import os
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from rollbox.functions.recording.aiosync import AsyncFsync
from rollbox.runtime.errors import IntegrityError, SandboxGone, SandboxNotFound, StoreError
from rollbox.snapshots.calls import StoreCalls, StoreDeadline
from rollbox.snapshots.state import (
    REFRESH_AFTER_S,
    LocalObjects,
    Objects,
    SandboxRecord,
    blob_key,
    check_content,
    generation_of,
    record_key,
)

__all__ = ["AIO_COMMITS", "StateStore", "recorded"]

log = logging.getLogger("rollbox.durable")
# what a store call of this layer is doing, for the 503 a hung store gets
_DOING = {"get": "reading a sandbox's state", "get_blob": "reading a sandbox's files",
          "put_blob": "writing a sandbox's files", "put_new": "committing a sandbox's step",
          "keys": "listing sandbox state", "listing": "listing sandbox state", "delete": "deleting sandbox state"}
M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")
CLAIMANT = f"{socket.gethostname()}:{os.getpid()}"  # who made a claim (its body: another's differs)
AIO_COMMITS = 32  # local commits syncing at once (the AIO context has room for 64 syncs in flight)
# the newest record seen of each recent sandbox, kept as stored (~1.5-3 KB; parsed again in ~20 us when
# used): a step on one resumes from it and reads only the generation after it (a GET that finds nothing,
# or the one another replica committed), not also its own again. 256 MiB holds ~100,000 sandboxes'.
SEEN_BYTES = 256 * 1024 * 1024
# an exec trusts what this replica saw last of its sandbox (no read of the next generation first) while
# fewer than this share of recent steps found that another replica had moved it on (``behind``, a moving
# average over ~20 steps). Trusting saves a GET (~1.3 ms of CPU, client and store); a wrong trust runs the
# step twice (~15 ms): worth it below ~8 %. (Over ~5 steps, behind a round-robin balancer's 50 % the
# average fell under 0.1 after four steps in a row that found nothing newer: 6 % of steps ran twice.)
TRUST_BELOW = 0.05
BEHIND_WEIGHT = 0.05
# a sandbox nothing is known of here (another replica's create, a replica that just started) is looked up
# by reading its generations 0 and 1 at once, not by listing its records, while more than this share of
# recent such lookups found it at generation 0 (``fresh``: its create's, no step yet, as a first step
# behind a balancer without affinity finds it). Two GETs save a listing then (~1.3 ms of CPU, client and
# store); when the sandbox has moved on they cost two GETs more (~2.5 ms) (profile_s3_step.py --lookups)
FRESH_ABOVE = 0.75
FRESH_WEIGHT = 0.2  # (a moving average over ~5 lookups: a scale from zero turns the reads off within one or two)


def recorded(model: type[M], record: SandboxRecord) -> M:
    """The reply ``record`` holds, as this version's ``model``. Fields it does not know (a newer
    replica wrote the record: a rolling upgrade) are left out, at any depth, rather than refused; a
    reply that does not fit otherwise is corrupt state (502), not a crash."""
    data: Any = copy.deepcopy(record.reply)
    for _ in range(16):
        try:
            return model.model_validate(data)
        except ValidationError as exc:
            errors = exc.errors(include_url=False, include_input=False)
            if not errors or any(e["type"] != "extra_forbidden" for e in errors):
                raise IntegrityError(f"sandbox {record.sandbox_id}: the reply recorded in generation "
                                     f"{record.generation} is not a {model.__name__}: {str(exc)[:300]}",
                                     sandbox_id=record.sandbox_id) from None
            for e in errors:  # each names the path of a field this version does not have
                *path, name = e["loc"]
                parent = data
                for part in path:
                    parent = parent[part]
                parent.pop(name, None)
    raise IntegrityError(f"sandbox {record.sandbox_id}: the reply recorded in generation {record.generation} "
                         f"does not fit {model.__name__}", sandbox_id=record.sandbox_id)


class StateStore:
    """Durable state in ``objects`` (S3, or the local store's directory): see the module docstring."""

    def __init__(self, objects: Objects, *, tombstone_ttl_s: float = 600.0, io_threads: int = 8):
        self.objects = objects
        self.local = isinstance(objects, LocalObjects)  # records are local files (see read)
        self.tombstone_ttl_s = tombstone_ttl_s
        self.calls = StoreCalls(io_threads, name="rollbox-state")  # store calls, each with a deadline
        self.blobs_known: dict[str, float] = {}  # blob -> when it was last written or refreshed here
        self.seen: OrderedDict[str, bytes] = OrderedDict()  # sandbox id -> its newest record seen, as stored
        self.seen_bytes = 0
        self.seen_max_bytes = SEEN_BYTES
        # sandbox id -> (newest generation seen here, Unix time before which the sweep has nothing to do
        # with it: it cannot expire, or its tombstone is kept, until then, when its lifetime ends, its idle
        # limit). The sweep reads only the records of sandboxes that passed that time, or that moved on and
        # whose limits (set at their create) count their idle window from their newest record's write
        # time to now (``due_at``): not every sandbox in the store.
        self.due: dict[str, tuple[int, float, float, float]] = {}
        # of recent steps on sandboxes seen here, the share that found them moved on by another replica
        # (a moving average, from 0.5: a new replica trusts nothing until its steps have shown it)
        self.behind = 0.5
        # of recent lookups of sandboxes unknown here, the share that found them at generation 0 (a moving
        # average, from 0: a new replica lists until its lookups have shown that they are fresh)
        self.fresh = 0.0
        self._blob_cache: OrderedDict[str, bytes] = OrderedDict()  # content-addressed, so never stale
        self._blob_cache_bytes = 0
        self._blob_lock = threading.Lock()
        self.blob_cache_max_bytes = 64 * 1024 * 1024
        self._aio: AsyncFsync | None = None  # the local store's commits sync through it (put_record)
        # each commit has one sync in flight at a time; the AIO context holds MAX_EVENTS: the rest wait here
        self._aio_slots = asyncio.Semaphore(AIO_COMMITS)
        # S3 through obstore: records are read and committed on the event loop, awaited (no thread)
        # (S3Objects.awaitable; asked by name: importing store_s3 here would load boto3 for a local store)
        self._awaitable: Any = objects if getattr(objects, "awaitable", False) is True else None

    def start(self) -> None:
        if self.local:
            try:
                self._aio = AsyncFsync(asyncio.get_running_loop())
            except OSError as exc:
                log.info("local store: commits sync in a thread (Linux AIO unavailable: %s)", exc)

    def close(self) -> None:
        self.calls.shutdown()  # a call stuck on a hung store ends with its socket timeout
        if self._aio is not None and not self._aio.busy:
            self._aio.close()
            self._aio = None

    def forget(self, sandbox_id: str) -> None:
        """Nothing of the sandbox is to be remembered here (its records were removed)."""
        self._unsee(sandbox_id)
        self.due.pop(sandbox_id, None)

    async def put_blobs(self, blobs: dict[str, str]) -> None:
        """Upload the new large contents a scan found (sha -> path), unless written or refreshed here
        within ``REFRESH_AFTER_S`` (the store keeps a blob that long after its last write)."""
        for sha, path in blobs.items():
            if time.monotonic() - self.blobs_known.get(sha, float("-inf")) >= REFRESH_AFTER_S:
                await self.io(self.put_blob, sha, path)

    async def io(self, fn: Callable[..., Any], *args: Any) -> Any:
        """A store call, off the event loop, with a deadline (``StoreDeadline``: a hung store is a 503)."""
        return await self.calls.run(fn, *args, doing=_DOING.get(getattr(fn, "__name__", ""), "reading sandbox state"))

    async def read(self, sandbox_id: str, generation: int) -> SandboxRecord | None:
        """A sandbox's record of one generation. The local store's is a small local file, read and
        parsed on the event loop: less work than a thread's round trip, whose hand-offs of the GIL
        cost the loop more than the read (measured); S3's off the loop, with a deadline."""
        got = await self._fetch(sandbox_id, generation)
        return None if got is None else got[0]

    async def _fetch(self, sandbox_id: str, generation: int) -> tuple[SandboxRecord, bytes] | None:
        """``read``, with the record's bytes as stored: what ``remember`` keeps (not serialized again)."""
        key = record_key(sandbox_id, generation)
        if self.local:
            data = self.objects.get(key)
        elif self._awaitable is not None:  # S3 through obstore: awaited on the loop, no thread (put_record)
            data = await self._within(self._awaitable.get_async(key), _DOING["get"])
        else:
            data = await self.io(self.objects.get, key)
        return None if data is None else (SandboxRecord.from_bytes(data, key), data)

    async def _within(self, call: Awaitable[T], doing: str) -> T:
        """``call`` with the store's deadline, as ``io`` gives a call in a thread (``StoreDeadline``)."""
        try:
            async with asyncio.timeout(self.calls.deadline_s):
                return await call
        except TimeoutError:
            raise StoreDeadline(f"the store did not answer within {self.calls.deadline_s:g} s while {doing}") from None

    def note_behind(self, behind: bool) -> None:
        """A step on a sandbox seen here found it moved on by another replica (True), or not."""
        self.behind += BEHIND_WEIGHT * (behind - self.behind)

    def trusts_seen(self) -> bool:
        """Whether a step may run on what this replica saw last of its sandbox without reading the next
        generation first: when that read has rarely found one lately (one replica, or a load balancer
        with affinity). The step's create-only commit is the check then: a 412 says it ran behind, and it
        runs again on the newest (``DurableRuntime.step``)."""
        return self.behind < TRUST_BELOW

    async def head(self, sandbox_id: str) -> SandboxRecord:
        """The newest generation of a sandbox not live here; SandboxNotFound if it never existed.
        From a generation seen here before (a record read or written; the record itself is kept for
        the most recent, ``SEEN_BYTES`` of them, its generation for many more), reading forward costs a
        GET per generation and one that finds nothing (and, when only its generation was kept, a GET of
        that record too); else the sandbox's records are listed and the newest read (while such lookups
        keep finding their sandbox at generation 0, ``FRESH_ABOVE``, its generations 0 and 1 are read at
        once first: 0 alone found is the newest, no listing)."""
        return (await self.newest(sandbox_id, confirm=True))[0]

    async def newest(self, sandbox_id: str, *, confirm: bool) -> tuple[SandboxRecord, bool]:
        """``head``, and whether the record is known to be the newest. Without ``confirm``, the first
        generation found after the one seen here is taken unconfirmed: the GET that would find nothing
        after it is not sent (behind a round-robin load balancer, a step finds the one its sandbox's
        previous step committed on another replica: one GET, not two or three); a step that runs on it
        learns from its create-only commit whether another came first (``DurableRuntime.step``)."""
        kept = self.seen.get(sandbox_id)  # (its bytes: kept again as they are when nothing newer is found)
        head = None if kept is None else self._parse_seen(sandbox_id, kept)
        if head is None and (due := self.due.get(sandbox_id)) is not None:
            if not confirm:  # the one after the generation seen here last, first
                got = await self._fetch(sandbox_id, due[0] + 1)
                if got is not None:
                    self.note_behind(True)
                    self.remember(*got)
                    return got[0], False
            got = await self._fetch(sandbox_id, due[0])  # the generation seen here last
            if got is not None and not confirm:  # and none after it, just read
                self.note_behind(False)
                self.remember(*got)
                return got[0], True
            if got is not None:
                head, kept = got
        if head is None:
            read: dict[int, tuple[SandboxRecord, bytes]] = {}
            if self.fresh > FRESH_ABOVE:  # its create's generation, and none after it?
                read = await self._first_two(sandbox_id)
                if 0 in read and 1 not in read:
                    self.note_fresh(True)
                    self.remember(*read[0])
                    return read[0][0], True
            keys = await self.keys(f"sandboxes/{sandbox_id}/")
            gens = sorted(g for k in keys if (g := generation_of(k)) is not None)
            if not gens:
                raise SandboxNotFound(f"no sandbox {sandbox_id!r}", sandbox_id=sandbox_id)
            self.note_fresh(gens[-1] == 0)
            got = read.get(gens[-1]) or await self._fetch(sandbox_id, gens[-1])
            if got is None:  # removed between the listing and the read (the sweeper)
                raise SandboxGone(f"sandbox {sandbox_id} was destroyed", sandbox_id=sandbox_id)
            # the listing said it is the newest, as a read of the next one would: a commit since is caught
            # by the step's create-only write, as one after such a read is
            self.remember(*got)
            return got[0], True
        seen_generation = head.generation
        confirmed = True
        while (got := await self._fetch(sandbox_id, head.generation + 1)) is not None:
            head, kept = got  # committed elsewhere since
            if not confirm:
                confirmed = False
                break
        self.note_behind(head.generation > seen_generation)
        self.remember(head, kept)
        return head, confirmed

    async def _first_two(self, sandbox_id: str) -> dict[int, tuple[SandboxRecord, bytes]]:
        """A sandbox's records of generations 0 and 1 (with their bytes), those found, read at once."""
        got = await asyncio.gather(self._fetch(sandbox_id, 0), self._fetch(sandbox_id, 1), return_exceptions=True)
        for r in got:
            if isinstance(r, BaseException):
                raise r
        return {g: r for g, r in enumerate(got) if isinstance(r, tuple)}

    def note_fresh(self, fresh: bool) -> None:
        """A lookup of a sandbox unknown here found it at generation 0 (True), or further on."""
        self.fresh += FRESH_WEIGHT * (fresh - self.fresh)

    def remember(self, record: SandboxRecord, data: bytes | None = None) -> None:
        """Keep the newest record seen of a sandbox (``data``: its bytes as stored, if at hand), the oldest
        kept going past ``seen_max_bytes``: its next resume here reads on from it."""
        self.note_due(record)
        sid = record.sandbox_id
        self._unsee(sid)
        data = record.to_bytes() if data is None else data
        self.seen[sid] = data
        self.seen_bytes += len(data)
        while self.seen_bytes > self.seen_max_bytes and self.seen:
            self.seen_bytes -= len(self.seen.popitem(last=False)[1])

    def seen_record(self, sandbox_id: str) -> SandboxRecord | None:
        """The newest record of the sandbox seen here (a copy of its own), if still kept."""
        data = self.seen.get(sandbox_id)
        return None if data is None else self._parse_seen(sandbox_id, data)

    @staticmethod
    def _parse_seen(sandbox_id: str, data: bytes) -> SandboxRecord:
        return SandboxRecord.from_bytes(data, f"sandboxes/{sandbox_id} (seen here)")

    def _unsee(self, sandbox_id: str) -> None:
        data = self.seen.pop(sandbox_id, None)
        if data is not None:
            self.seen_bytes -= len(data)

    def note_due(self, record: SandboxRecord) -> None:
        """Note a sandbox's generation and when the sweep may next have to do with it (``due``)."""
        ends, idle_s = record.created_at + record.limits.lifetime_s, record.limits.idle_s
        if record.state == "destroyed":
            due = record.last_used + self.tombstone_ttl_s
        else:
            due = min(ends, record.last_used + idle_s)
        self.due[record.sandbox_id] = (record.generation, due, ends, idle_s)
        while len(self.due) > 1_000_000:
            self.due.pop(next(iter(self.due)))

    def due_at(self, sandbox_id: str, newest: int, written_at: float) -> float | None:
        """When the sweep may next have to do with a sandbox whose newest record (generation ``newest``)
        was written at ``written_at`` (its listing's time), without reading that record: from the record
        seen here if it is that one, else from the sandbox's limits seen here (its idle window counted
        from ``written_at``, a little after the step's own time: an expiry found a sweep later, never
        early). None: nothing of it is known here (its record must be read)."""
        known = self.due.get(sandbox_id)
        if known is None:
            return None
        generation, due, ends, idle_s = known
        return due if generation == newest else min(ends, written_at + idle_s)

    async def keys(self, prefix: str) -> list[str]:
        """Keys under ``prefix``: S3's through obstore on the event loop (``listing``), else in a store call."""
        if self._awaitable is not None:
            return [k async for page in self.listing(prefix) for k, _ in page]
        keys: list[str] = await self.io(self.objects.keys, prefix)
        return keys

    async def listing(self, prefix: str, after: str | None = None,
                      before: str | None = None) -> AsyncIterator[list[tuple[str, float]]]:
        """Keys under ``prefix`` with their write times, a page at a time: S3's through obstore on the
        event loop (each page with the store's deadline, and nothing left listing in a thread when the
        caller stops), a local store's in one call. Only those in the range (after, before) when given."""
        if self._awaitable is not None:
            async for page in self._awaitable.listing_pages(prefix, self.calls.deadline_s, after, before):
                yield page
            return
        yield await self.io(self.objects.listing, prefix, after, before)

    async def claim(self, key: str, stale: str) -> bool:
        """Create ``key`` (create-only) for this process: True if this call made it, False if another
        writer had (``sweeping``'s claims). The one that makes it deletes ``stale`` (best effort)."""
        mine = json.dumps({"by": CLAIMANT, "at": time.time()}).encode()
        if not await self.put_record(key, mine):
            return False
        with contextlib.suppress(StoreError, OSError):
            await self.drop([stale])
        return True

    async def drop(self, keys: list[str]) -> None:
        """Delete ``keys`` (absent ones are no error)."""
        if keys:
            await self.io(self.objects.delete, keys)

    async def put_record(self, key: str, data: bytes) -> bool:
        """The create-only write of a record. On the local store it runs on the event loop and its two
        disk syncs go through Linux AIO: a thread's round trip per commit cost the loop more (GIL
        hand-offs) than the writes. Elsewhere (S3, or no AIO) a store call off the loop. Both with the
        store's deadline (``StoreDeadline``: a write past it may still land)."""
        if self._aio is None:
            if self._awaitable is not None:
                return await self._within(self._awaitable.put_new_async(key, data), _DOING["put_new"])
            ok: bool = await self.io(self.objects.put_new, key, data)
            return ok
        assert isinstance(self.objects, LocalObjects)
        try:
            async with asyncio.timeout(self.calls.deadline_s), self._aio_slots:
                return await self.objects.put_new_synced(key, data, self._aio.synced)
        except TimeoutError:
            raise StoreDeadline(f"the store did not answer within {self.calls.deadline_s:g} s while "
                                "committing a sandbox's step") from None

    def put_blob(self, sha: str, path: str) -> None:
        with open(path, "rb") as f:
            data = f.read()
        check_content(sha, data, path)
        self.objects.put_content(blob_key(sha), data)  # an old copy is rewritten: its expiry restarts
        self.blobs_known[sha] = time.monotonic()
        while len(self.blobs_known) > 1_000_000:
            self.blobs_known.pop(next(iter(self.blobs_known)))
        self._cache_blob(sha, data)

    def _cache_blob(self, sha: str, data: bytes) -> None:
        """Keep recent blobs (bounded, least recently used out first): a sandbox resumed again on this
        replica reads its large files from memory, not the store. Called from store threads."""
        with self._blob_lock:
            if sha in self._blob_cache or len(data) > self.blob_cache_max_bytes // 4:
                return
            self._blob_cache[sha] = data
            self._blob_cache_bytes += len(data)
            while self._blob_cache_bytes > self.blob_cache_max_bytes:
                _, old = self._blob_cache.popitem(last=False)
                self._blob_cache_bytes -= len(old)

    def get_blob(self, sha: str) -> bytes | None:
        with self._blob_lock:
            data = self._blob_cache.get(sha)
            if data is not None:
                self._blob_cache.move_to_end(sha)
                return data
        data = self.objects.get(blob_key(sha))
        if data is not None:
            data = check_content(sha, data, f"blob {sha}")
            self._cache_blob(sha, data)
        return data

    async def contents(self, head: SandboxRecord) -> dict[str, bytes]:
        """Every file content ``head`` names: inline in its records, or blobs."""
        sid = head.sandbox_id
        gens = {e.generation for e in head.files.entries if e.kind == "f" and e.generation is not None}
        need_blobs = {e.sha for e in head.files.entries if e.kind == "f" and e.generation is None}
        records = {head.generation: head}
        # one order for the reads and for pairing their results: a set of ints iterates unsorted
        # once they pass its table size (list({3, 9}) == [9, 3]), which paired records with wrong generations
        older = sorted(gens - {head.generation})
        fetched = await asyncio.gather(*(self.read(sid, g) for g in older))
        for g, rec in zip(older, fetched, strict=True):
            if rec is None:
                raise IntegrityError(f"sandbox {sid}: record {g} holding file contents is missing", sandbox_id=sid)
            records[g] = rec
        contents: dict[str, bytes] = {}
        for e in head.files.entries:
            if e.kind == "f" and e.generation is not None and e.sha not in contents:
                contents[e.sha] = records[e.generation].inline[e.sha]  # checked when the record was read
        blobs = sorted(need_blobs)
        datas = await asyncio.gather(*(self.io(self.get_blob, s) for s in blobs))
        for sha, data in zip(blobs, datas, strict=True):
            if data is None:
                raise IntegrityError(f"sandbox {sid}: blob {sha} is missing from the store", sandbox_id=sid)
            contents[sha] = data
        return contents

