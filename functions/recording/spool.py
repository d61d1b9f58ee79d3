"""The spool: rows appended as JSON lines to local segments and synced to disk before their reply.

The event loop writes the lines (to the page cache: microseconds) and has the kernel sync them through
Linux AIO (``IOCB_CMD_FDSYNC``, run by a kworker, its completion read from an eventfd on the loop): no
thread, so no hand-off of the GIL per reply. Where AIO is unavailable, a writer thread does both
(segments opened O_DSYNC). A write the disk refuses (full: ENOSPC) is cut back off the segment, its
rows dropped unless a durable commit acknowledges them, and ``disk_full`` says so until the disk has
room again. The flush (``flush.py``) writes closed segments to the store; ``recorder.py`` has the whole
story.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import json
import logging
import math
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import CounterMetricFamily
from rollbox.functions.contract.records import DEFAULT_EXPERIMENT
from rollbox.functions.recording.aiosync import AsyncFsync

__all__ = ["KINDS", "Metrics", "Segment", "Spool", "Token", "spool_line"]

log = logging.getLogger("rollbox.recorder")
KINDS = {"step": "trajectories", "usage": "usage"}  # a spool line's kind: its files' folder in the store
MIN_FREE_BYTES = 16 * 1024 * 1024  # below this on the spool's disk, ``disk_full`` (steps are refused)
DISK_FULL = frozenset({errno.ENOSPC, errno.EDQUOT})


def spool_line(kind: str, row: dict[str, Any], pending: list[Any] | None = None) -> bytes:
    """A row as one line of the spool: ``{"k": kind, "r": row[, "p": pending]}`` (``k`` first: the flush
    sorts lines by kind without parsing them). Never fails: what orjson refuses (a lone surrogate, an
    integer past 64 bits) is written by json with the surrogates replaced by U+FFFD."""
    line: dict[str, Any] = {"k": kind, "r": row}
    if pending is not None:
        line["p"] = pending
    try:
        return orjson.dumps(line, default=str, option=orjson.OPT_APPEND_NEWLINE)
    except orjson.JSONEncodeError:
        return json.dumps(_storable(line), default=str, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"


def _storable(value: Any) -> Any:
    """``value`` with every string valid UTF-8 (lone surrogates as U+FFFD) and NaN/inf as null."""
    if isinstance(value, str):
        return value.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {_storable(str(k)): _storable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_storable(v) for v in value]
    return value


class Metrics:
    """The recording's counters. Those the reply path adds to (rows, billed seconds) are plain numbers
    that /metrics reads when scraped: a ``Counter.inc`` takes a lock, ~1 µs each, six per run."""

    _BILLS = (("rollbox_billed_seconds", "Billed sandbox seconds"),
              ("rollbox_billed_vcpu_seconds", "Billed vCPU-seconds (billed s x cores limit)"),
              ("rollbox_billed_gib_seconds", "Billed GiB-seconds (billed s x memory limit)"),
              ("rollbox_cost_usd", "Cost of billed sandbox time at the configured prices"))

    def __init__(self, registry: CollectorRegistry | None):
        r = registry or CollectorRegistry()
        self.flushes = Counter("rollbox_spool_flushes", "Spool segments written to the store as Parquet",
                               ["result"], registry=r)
        self.rejected = 0  # lines the Parquet writer refused, set aside under rejected/ (from the flush thread)
        self.dropped = 0  # rows whose spool write the disk refused (their replies were errors)
        self.rows: dict[str, int] = {}
        self.syncs = 0  # disk syncs of the spool (each serves every reply written before it started)
        self.bills: dict[str, list[float]] = {}  # experiment -> billed s, vCPU-s, GiB-s, dollars
        r.register(self)

    def bill(self, row: dict[str, Any]) -> None:
        sums = self.bills.setdefault(str(row.get("experiment") or DEFAULT_EXPERIMENT), [0.0, 0.0, 0.0, 0.0])
        for i, name in enumerate(("billed_s", "vcpu_s", "gib_s", "cost_usd")):
            value = row.get(name)
            if isinstance(value, int | float):
                sums[i] += value

    def describe(self) -> list[CounterMetricFamily]:
        return [CounterMetricFamily("rollbox_recorded_rows", ""), CounterMetricFamily("rollbox_spool_syncs", ""),
                CounterMetricFamily("rollbox_spool_rejected_rows", ""),
                CounterMetricFamily("rollbox_spool_dropped_rows", ""),
                *(CounterMetricFamily(name, "") for name, _ in self._BILLS)]

    def collect(self) -> list[CounterMetricFamily]:
        rows = CounterMetricFamily("rollbox_recorded_rows", "Rows spooled (steps and usage records)",
                                   labels=["kind"])
        for kind, n in list(self.rows.items()):
            rows.add_metric([kind], n)
        syncs = CounterMetricFamily("rollbox_spool_syncs",
                                    "Disk syncs of the spool (each serves every row written before it)",
                                    value=self.syncs)
        rejected = CounterMetricFamily("rollbox_spool_rejected_rows",
                                       "Spooled rows the Parquet writer refused, kept as JSON under rejected/",
                                       value=self.rejected)
        dropped = CounterMetricFamily("rollbox_spool_dropped_rows",
                                      "Rows whose spool write the disk refused (full); their steps got an error",
                                      value=self.dropped)
        families = [rows, syncs, rejected, dropped]
        for i, (name, text) in enumerate(self._BILLS):
            family = CounterMetricFamily(name, text, labels=["experiment"])
            for experiment, sums in list(self.bills.items()):
                family.add_metric([experiment], sums[i])
            families.append(family)
        return families


@dataclass
class Segment:
    seq: int
    path: Path
    fd: int
    rows: list[bytes] = field(default_factory=list)  # its lines as written (bytes: no work for the GC)
    pending: set[int] = field(default_factory=set)
    void: set[int] = field(default_factory=set)
    unknown: dict[int, tuple[str, int]] = field(default_factory=dict)  # row -> its commit, outcome unknown
    closed: bool = False
    opened: float = field(default_factory=time.monotonic)
    settled: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass(frozen=True)
class Token:
    """A spooled row awaiting its durable commit."""

    seq: int
    index: int
    count: int
    commit: tuple[str, int]  # (sandbox id, generation) of the commit that acknowledges the rows


# Lines on their way to the disk: (segment fd, bytes, the future done once they are on it, the rows to
# drop if the disk refuses them: (segment, first row, count), None when a commit or nobody answers for them)
_Span = tuple[Segment, int, int]
_Item = tuple[int, bytes, asyncio.Future[None], _Span | None]


class Spool:
    """The segments of ``dir`` this process writes: rows appended, synced, marked pending until their
    commit settles, and the disk's free space watched."""

    def __init__(self, spool_dir: Path, replica: str, metrics: Metrics, *, flush_records: int, aio: bool):
        self.dir = spool_dir
        self.replica = replica
        self.metrics = metrics
        self.flush_records = flush_records
        self._want_aio = aio
        self._seq = 0
        self.current: Segment | None = None
        self.segments: dict[int, Segment] = {}
        # batches for the spool's writer thread: ([(segment fd, lines)], future, spans), None to stop
        self._queue: queue.SimpleQueue[tuple[list[tuple[int, bytes]], asyncio.Future[None], list[_Span]] | None] = \
            queue.SimpleQueue()
        self._lazy: list[_Item] = []  # lines no reply waits for yet
        self._thread: threading.Thread | None = None
        self.aio: AsyncFsync | None = None  # the spool's syncs without the thread, where Linux AIO works
        self._unwritten: list[_Item] = []  # (AIO) for the next write and sync
        self._sync_soon = False  # (AIO) the next write and sync is scheduled
        self._syncing = 0  # (AIO) fds of the sync under way
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stem = f"{replica}.{int(time.time() * 1000):013d}"
        self.min_free_bytes = MIN_FREE_BYTES
        self._full: str | None = None  # why the spool's disk is full (None: it has room)

    # ------------------------------------------------------------------------------ the disk
    @property
    def disk_full(self) -> str | None:
        """Why rows cannot be spooled now (the disk refused a write, or has less than ``min_free_bytes``
        free), else None. Cleared once the disk has room again (``check_disk``, every second)."""
        return self._full

    def check_disk(self) -> None:
        """Look at the free space of the spool's disk (what an unprivileged writer may use)."""
        try:
            st = os.statvfs(self.dir)
        except OSError as exc:
            log.warning("cannot read the free space of %s: %s", self.dir, exc)
            return
        free = st.f_bavail * st.f_frsize
        if free < self.min_free_bytes:
            if self._full is None:
                log.warning("the spool's disk is full (%d bytes free in %s): steps are refused until it has "
                            "room", free, self.dir)
            self._full = f"{free} bytes free on the disk of {self.dir} (at least {self.min_free_bytes} needed)"
        elif self._full is not None:
            log.info("the spool's disk has room again (%d bytes free in %s)", free, self.dir)
            self._full = None

    def _refused(self, exc: OSError) -> None:
        """A spool write failed: a full disk is remembered until ``check_disk`` finds room."""
        if exc.errno in DISK_FULL:
            if self._full is None:
                log.warning("the spool's disk is full (%s): steps are refused until it has room", exc.strerror)
            self._full = f"writing the spool in {self.dir}: {exc.strerror}"

    async def watch_disk(self, every_s: float = 1.0) -> None:
        """``disk_full`` kept current (its own task: a flush can take long)."""
        while True:
            await asyncio.sleep(every_s)
            self.check_disk()

    # ------------------------------------------------------------------------------ lifecycle
    def open(self) -> None:
        """(On the loop) sync through AIO where wanted and possible, else start the writer thread; open
        the first segment."""
        self._loop = asyncio.get_running_loop()
        if self._want_aio:
            try:
                self.aio = AsyncFsync(self._loop)
            except OSError as exc:
                log.info("spool syncs in a thread (Linux AIO unavailable: %s)", exc)
        self._open_segment()
        if self.aio is None:
            self._thread = threading.Thread(target=self._write_loop, name="rollbox-spool", daemon=True)
            self._thread.start()

    async def stop_writing(self) -> None:
        """Stop the AIO syncs or the writer thread (call ``drain`` first)."""
        if self.aio is not None:
            self.aio.close()
            self.aio = None
        self._queue.put(None)
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)

    def remove_empty(self) -> None:
        """Delete the empty current segment (one with rows left is kept for a restart)."""
        for seg in list(self.segments.values()):
            if not seg.rows and seg.fd >= 0:
                self.remove(seg)

    def remove(self, seg: Segment) -> None:
        """Close and delete a segment (its rows are in the store, or it has none)."""
        os.close(seg.fd)
        seg.fd = -1
        with contextlib.suppress(FileNotFoundError):
            seg.path.unlink()
        del self.segments[seg.seq]

    # ------------------------------------------------------------------------------- recording
    def append(self, rows: list[tuple[str, dict[str, Any]]], *, pending: tuple[str, int] | None = None,
               now: bool = True) -> tuple[Token | None, asyncio.Future[None]]:
        """See ``Recorder.append``."""
        seg = self.current
        assert seg is not None, "Recorder.start() first"
        mark = None if pending is None else [pending[0], pending[1], self.replica]
        lines = [spool_line(kind, row, mark) for kind, row in rows]  # all made before any is marked
        for kind, row in rows:
            self.metrics.rows[kind] = self.metrics.rows.get(kind, 0) + 1
            if kind == "usage":
                self.metrics.bill(row)
        first = len(seg.rows)  # nothing below raises: a pending mark is always settled by its token
        seg.rows.extend(lines)
        if mark is not None:
            seg.pending.update(range(first, first + len(lines)))
            if lines:
                seg.settled.clear()
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if now:  # a reply waits: if the disk refuses them, the rows go (unless a commit acknowledges them)
            self.push([(seg.fd, b"".join(lines), fut, (seg, first, len(lines)) if mark is None else None)])
        else:
            self._lazy.append((seg.fd, b"".join(lines), fut, None))
        if len(seg.rows) >= self.flush_records:
            self.rotate()
        return (Token(seg.seq, first, len(rows), pending) if pending is not None else None), fut

    def settle(self, token: Token | None, committed: bool | None) -> None:
        """See ``Recorder.settle``."""
        if token is None:
            return
        seg = self.segments.get(token.seq)
        if seg is None:
            return
        for i in range(token.index, token.index + token.count):
            seg.pending.discard(i)
            if committed is None:
                seg.unknown[i] = token.commit
            elif not committed:
                seg.void.add(i)
        if not seg.pending:
            seg.settled.set()

    # --------------------------------------------------------------------------------- spool
    def _open_segment(self) -> None:
        self._seq += 1
        path = self.dir / f"{self._stem}.{self._seq:06d}.jsonl"
        dsync = 0 if self.aio is not None else os.O_DSYNC  # AIO: written, then synced by fdatasync
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | dsync | os.O_CLOEXEC, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # ours while this process lives
        seg = Segment(self._seq, path, fd)
        seg.settled.set()
        self.segments[seg.seq] = seg
        self.current = seg

    def rotate(self) -> None:
        """Close the current segment to new rows (its queued lines still go to its file) and open the next."""
        if self.current is not None:
            self.current.closed = True
        self._open_segment()

    def push(self, items: list[_Item]) -> None:
        """Hand lines to the writer thread, with every lazy line so far (they share its write)."""
        if self._lazy:
            items, self._lazy = self._lazy + items, []
        if not items:
            return
        if self.aio is not None:
            self._write_soon(items)
            return
        fut = items[-1][2]
        for _, _, f, _ in items[:-1]:
            _chain(fut, f)
        self._queue.put(([(fd, data) for fd, data, _, _ in items], fut, [s for *_, s in items if s is not None]))

    def _lost(self, spans: list[_Span], exc: OSError) -> None:
        """The disk refused a write: its rows that no commit acknowledges are dropped (their replies
        are errors), so the flush does not write rows of steps that were not acknowledged."""
        self._refused(exc)
        for seg, first, count in spans:
            seg.void.update(range(first, first + count))
            self.metrics.dropped += count
        if spans:
            log.warning("the spool's disk refused %d rows (%s); their steps were answered with an error",
                        sum(c for _, _, c in spans), exc)

    def _write_soon(self, items: list[_Item]) -> None:
        """(AIO) Queue lines for the next write and sync, which starts at the end of this turn of the
        event loop if none is under way, else when the one under way ends (a sync covers only what was
        written before it started): every reply that arrives meanwhile shares one write and one sync."""
        self._unwritten.extend(items)
        if not self._syncing and not self._sync_soon:
            self._sync_soon = True
            asyncio.get_running_loop().call_soon(self._write_and_sync)

    def _write_and_sync(self) -> None:
        assert self.aio is not None and not self._syncing  # (scheduled only while none is under way)
        self._sync_soon = False
        items, self._unwritten = self._unwritten, []
        batch = [f for _, _, f, _ in items]
        by_fd: dict[int, list[bytes]] = {}
        for fd, data, _, _ in items:
            if data:
                by_fd.setdefault(fd, []).append(data)
        try:
            _write_all(by_fd)  # to the page cache: microseconds
        except OSError as exc:
            self._lost([s for *_, s in items if s is not None], exc)
            _resolve(batch, exc)
            if self._unwritten and not self._sync_soon:  # arrived meanwhile: their own try
                self._sync_soon = True
                asyncio.get_running_loop().call_soon(self._write_and_sync)
            return
        if not by_fd:
            _resolve(batch, None)  # nothing written since the last sync ended
            return
        errors: list[int] = []

        def done(err: int) -> None:
            if err:
                errors.append(err)
            self._syncing -= 1
            if self._syncing:
                return
            failed = OSError(errors[0], f"syncing the spool: {os.strerror(errors[0])}") if errors else None
            if failed is not None:
                self._lost([s for *_, s in items if s is not None], failed)
            _resolve(batch, failed)
            if self._unwritten:
                self._write_and_sync()

        self._syncing = len(by_fd)
        self.metrics.syncs += 1
        for fd in by_fd:
            try:
                self.aio.sync(fd, done)
            except OSError as exc:
                done(exc.errno or 5)

    def _write_loop(self) -> None:
        """The spool's writer thread: takes every batch queued so far, one write per segment (opened
        O_DSYNC: the write returns once its data is on disk), then resolves the futures on the event
        loop. One disk sync serves every reply that arrived while the previous one ran."""
        stop = False
        while not stop:
            first = self._queue.get()
            batch = [first]
            with contextlib.suppress(queue.Empty):
                while True:
                    batch.append(self._queue.get_nowait())
            by_fd: dict[int, list[bytes]] = {}
            futures = []
            spans: list[_Span] = []
            for item in batch:
                if item is None:
                    stop = True
                    continue
                for fd, data in item[0]:
                    if data:
                        by_fd.setdefault(fd, []).append(data)
                futures.append(item[1])
                spans.extend(item[2])
            error: OSError | None = None
            try:
                _write_all(by_fd)
            except OSError as exc:
                error = exc
            if by_fd:
                self.metrics.syncs += 1
            assert self._loop is not None
            if futures:
                with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
                    self._loop.call_soon_threadsafe(self._written, futures, spans, error)

    def _written(self, futures: list[asyncio.Future[None]], spans: list[_Span], error: OSError | None) -> None:
        """(On the loop) the writer thread's batch is on disk, or was refused."""
        if error is not None:
            self._lost(spans, error)
        _resolve(futures, error)

    async def drain(self) -> None:
        """Return once every line appended before the call is on disk."""
        if self.aio is None and (self._thread is None or not self._thread.is_alive()):
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.push([(-1, b"", fut, None)])
        with contextlib.suppress(OSError):
            await fut


def _resolve(futures: list[asyncio.Future[None]], error: OSError | None) -> None:
    for fut in futures:
        if not fut.done():
            if error is None:
                fut.set_result(None)
            else:
                fut.set_exception(error)


def _chain(outer: asyncio.Future[None], inner: asyncio.Future[None]) -> None:
    """``inner`` ends as ``outer`` does (lines written by the same write)."""
    def done(f: asyncio.Future[None]) -> None:
        if not inner.done():
            exc = f.exception()
            inner.set_result(None) if exc is None else inner.set_exception(exc)
    outer.add_done_callback(done)


def _write_all(by_fd: dict[int, list[bytes]]) -> None:
    """Append each segment's lines (O_DSYNC without AIO: on disk when the write returns). A write the
    disk refuses part-way is cut back off its segment: a torn line would swallow the next one."""
    for fd, chunks in by_fd.items():
        data = b"".join(chunks) if len(chunks) > 1 else chunks[0]
        size = os.fstat(fd).st_size
        try:
            while data:
                n = os.write(fd, data)
                data = data[n:]
        except OSError:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, size)
            raise
