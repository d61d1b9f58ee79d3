"""Recording: every handled step and every sandbox life, spooled locally, flushed to the store as Parquet.

    reply ready -> rows appended to the spool (a JSON-lines segment in ``<home>/spool``) and synced to
                   disk: one sync serves every row written while the previous one ran -> reply sent
    every ``flush_records`` rows or ``flush_interval_s`` seconds, and on drain: the segment is closed
                   and written to the store as Parquet, one file per (kind, experiment, date), named
                   after the segment, with a create-only write; then the segment is deleted

The event loop writes the lines (to the page cache: microseconds) and has the kernel sync them through
Linux AIO (``IOCB_CMD_FDSYNC``, run by a kworker, its completion read from an eventfd on the loop): no
thread, so no hand-off of the GIL per reply. Where AIO is unavailable, a writer thread does both
(segments opened O_DSYNC).

So nothing acknowledged is lost on a crash: a restart flushes what the last process left (a segment
not locked by a live process). Flushing a segment twice (a crash between its upload and its
deletion) finds its files there and writes nothing: every row is in the store once.

One row never holds up the others: any row can be spooled (text JSON cannot carry, a lone surrogate,
is replaced by U+FFFD), and a line the Parquet writer refuses is set aside as it is, under
``rejected/`` in the store, while the rest of its segment is written. A write the disk refuses (full:
ENOSPC) is cut back off the segment, so the lines after it stay readable; the rows of that write are
dropped unless a durable commit acknowledges them (their reply is an error: see the service), and
``disk_full`` says so until the spool's disk has room again (checked every second), so the service
refuses work before it runs rather than answering steps it cannot record.

A durable step's row is spooled *before* its state is committed (the commit is what acknowledges
it), marked pending with the generation it commits; a failed commit drops it from the flush. Rows of
a segment left by a dead process that are still marked pending are kept only if that generation's
record in the store was written by that process.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import errno
import fcntl
import io
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
from urllib.parse import quote

import orjson
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import CounterMetricFamily
from rollbox.functions.contract.records import (
    DEFAULT_EXPERIMENT,
    SCHEMA_VERSION,
    STEP_SCHEMA,
    USAGE_SCHEMA,
    arrow_table_of_lines,
)
from rollbox.functions.recording.aiosync import AsyncFsync
from rollbox.functions.recording.prices import Prices
from rollbox.runtime.errors import RollboxError
from rollbox.runtime.spec import Limits, Usage
from rollbox.snapshots.calls import StoreCalls
from rollbox.snapshots.state import Objects, SandboxRecord, record_key

__all__ = ["Prices", "Recorder", "partition_key", "usage_row"]

log = logging.getLogger("rollbox.recorder")
GiB = 1024**3
KINDS = {"step": ("trajectories", STEP_SCHEMA), "usage": ("usage", USAGE_SCHEMA)}
FLUSH_DEADLINE_S = 120.0  # a flush the store does not finish in this time fails; its segment is kept
SETTLE_WAIT_S = 30.0  # a flush waits this long for a segment's durable commits to settle (then: next flush)
MIN_FREE_BYTES = 16 * 1024 * 1024  # below this on the spool's disk, ``disk_full`` (steps are refused)
DISK_FULL = frozenset({errno.ENOSPC, errno.EDQUOT})
WARM_UP_AFTER_S = 1.0  # after start: a replica scaled from zero answers its first event before


def partition_key(kind: str, experiment: str | None, when: float | str, name: str) -> str:
    """``trajectories|usage/experiment=<e>/date=<yyyy-mm-dd>/<name>.parquet`` (the experiment URI-quoted,
    which hive partitioning decodes); ``when``: unix seconds, or the date itself."""
    prefix, _ = KINDS[kind]
    date = when if isinstance(when, str) else dt.datetime.fromtimestamp(when, dt.UTC).strftime("%Y-%m-%d")
    exp = quote(experiment or DEFAULT_EXPERIMENT, safe="-_.")
    return f"{prefix}/experiment={exp}/date={date}/{name}.parquet"


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


_KIND_PREFIX = {kind: b'{"k":"%s"' % kind.encode() for kind in KINDS}


def usage_row(usage: Usage, limits: Limits, *, kind: str, replica: str, prices: Prices, usage_id: str,
              ended_at: float | None = None) -> dict[str, Any]:
    """A sandbox life as a usage record: billed seconds rounded up, vCPU- and GiB-seconds of its limits."""
    billed = max(1, math.ceil(usage.wall_s - 1e-9))
    vcpu_s = billed * limits.cpu_max_cores
    gib_s = billed * limits.memory_max_bytes / GiB
    meta = usage.metadata
    return {  # UsageRecord's fields (tests validate rows against the model)
        "schema_version": SCHEMA_VERSION, "usage_id": usage_id,
        "experiment": meta.get("experiment") or DEFAULT_EXPERIMENT, "episode": meta.get("episode"),
        "task": meta.get("task"), "sandbox_id": usage.sandbox_id, "snapshot_id": usage.snapshot_id, "kind": kind,
        "reason": usage.reason, "ended_at": ended_at or time.time(), "wall_s": round(usage.wall_s, 6),
        "billed_s": billed, "cpu_max_cores": limits.cpu_max_cores, "memory_max_bytes": limits.memory_max_bytes,
        "vcpu_s": round(vcpu_s, 6), "gib_s": round(gib_s, 6),
        "cost_usd": round(vcpu_s * prices.vcpu_s + gib_s * prices.gib_s, 9), "cpu_s": round(usage.cpu_s, 6),
        "peak_memory_bytes": usage.peak_memory_bytes, "execs": usage.execs, "replica": replica,
    }


class _Metrics:
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
class _Segment:
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
_Span = tuple[_Segment, int, int]
_Item = tuple[int, bytes, asyncio.Future[None], _Span | None]


class Recorder:
    def __init__(self, spool_dir: Path, objects: Objects, replica: str, *, flush_records: int = 5000,
                 flush_interval_s: float = 10.0, prices: Prices | None = None,
                 registry: CollectorRegistry | None = None, aio: bool = True):
        """``aio``: sync the spool through Linux AIO where it works (else, or if False: a writer thread)."""
        self.dir = Path(spool_dir)
        self.objects = objects
        self.replica = replica
        self.flush_records = flush_records
        self.flush_interval_s = flush_interval_s
        self.prices = prices or Prices()
        self.metrics = _Metrics(registry)
        self._want_aio = aio
        self._seq = 0
        self._current: _Segment | None = None
        self._segments: dict[int, _Segment] = {}
        # batches for the spool's writer thread: ([(segment fd, lines)], future, spans), None to stop
        self._queue: queue.SimpleQueue[tuple[list[tuple[int, bytes]], asyncio.Future[None], list[_Span]] | None] = \
            queue.SimpleQueue()
        self._lazy: list[_Item] = []  # lines no reply waits for yet
        self._thread: threading.Thread | None = None
        self._aio: AsyncFsync | None = None  # the spool's syncs without the thread, where Linux AIO works
        self._unwritten: list[_Item] = []  # (AIO) for the next write and sync
        self._sync_soon = False  # (AIO) the next write and sync is scheduled
        self._syncing = 0  # (AIO) fds of the sync under way
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._flush_lock = asyncio.Lock()
        self._leftovers = False
        self._stem = f"{replica}.{int(time.time() * 1000):013d}"
        self.calls = StoreCalls(2, name="rollbox-flush")  # the store's writes, with deadlines
        self.min_free_bytes = MIN_FREE_BYTES
        self._full: str | None = None  # why the spool's disk is full (None: it has room)

    def bind_metrics(self, registry: CollectorRegistry) -> None:
        self.metrics = _Metrics(registry)

    @property
    def syncs(self) -> int:
        return self.metrics.syncs

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

    # ------------------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        self.check_disk()
        await self._recover_left()
        self._loop = asyncio.get_running_loop()
        if self._want_aio:
            try:
                self._aio = AsyncFsync(self._loop)
            except OSError as exc:
                log.info("spool syncs in a thread (Linux AIO unavailable: %s)", exc)
        self._open_segment()
        if self._aio is None:
            self._thread = threading.Thread(target=self._write_loop, name="rollbox-spool", daemon=True)
            self._thread.start()
        self._tasks = [asyncio.create_task(self._flush_loop()), asyncio.create_task(self._watch_disk())]

    async def _recover_left(self) -> None:
        try:
            left = await self.calls.run(self._recover, doing="flushing what a previous process left",
                                        deadline_s=FLUSH_DEADLINE_S)
        except (RollboxError, OSError) as exc:  # the store is down: they stay, tried again at each flush
            self._leftovers = True
            log.warning("could not flush what a previous process left in the spool (kept): %s", exc)
            return
        self._leftovers = False
        if left:
            log.info("flushed %d rows a previous process left in the spool", left)

    async def close(self, *, settle_wait_s: float = 5.0) -> int:
        """Drain: write what is queued, flush every segment, stop. Returns the rows flushed. Nothing
        commits now: rows still marked pending after ``settle_wait_s`` (a lost settle) stay in their
        segment for the next start, which asks the store."""
        await self._drain_queue()
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        rows = await self.flush(settle_wait_s=settle_wait_s)
        await self._drain_queue()
        if self._aio is not None:
            self._aio.close()
            self._aio = None
        self._queue.put(None)
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
        self.calls.shutdown()
        for seg in list(self._segments.values()):  # the empty current one (rows left: kept for a restart)
            if not seg.rows and seg.fd >= 0:
                os.close(seg.fd)
                seg.fd = -1
                with contextlib.suppress(FileNotFoundError):
                    seg.path.unlink()
                del self._segments[seg.seq]
        return rows

    # ------------------------------------------------------------------------------- recording
    def append(self, rows: list[tuple[str, dict[str, Any]]], *, pending: tuple[str, int] | None = None,
               now: bool = True) -> tuple[Token | None, asyncio.Future[None]]:
        """Spool ``rows`` ((kind, row) pairs); the future is done once they are fsync'd. ``pending``:
        (sandbox id, generation) of the durable commit that acknowledges them; ``settle`` the token
        it returns when that commit is done. ``now=False``: no reply waits for them, they go to disk
        with the next rows that are waited for (or within a second), sharing their fsync."""
        seg = self._current
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
            self._push([(seg.fd, b"".join(lines), fut, (seg, first, len(lines)) if mark is None else None)])
        else:
            self._lazy.append((seg.fd, b"".join(lines), fut, None))
        if len(seg.rows) >= self.flush_records:
            self._rotate()
        return (Token(seg.seq, first, len(rows), pending) if pending is not None else None), fut

    def settle(self, token: Token | None, committed: bool | None) -> None:
        """The commit a pending token waited for is done: keep its rows (``committed``) or drop them;
        None: its outcome is unknown (a write past its deadline may still land), the flush asks the store."""
        if token is None:
            return
        seg = self._segments.get(token.seq)
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
        dsync = 0 if self._aio is not None else os.O_DSYNC  # AIO: written, then synced by fdatasync
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | dsync | os.O_CLOEXEC, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # ours while this process lives
        seg = _Segment(self._seq, path, fd)
        seg.settled.set()
        self._segments[seg.seq] = seg
        self._current = seg

    def _rotate(self) -> None:
        """Close the current segment to new rows (its queued lines still go to its file) and open the next."""
        if self._current is not None:
            self._current.closed = True
        self._open_segment()

    def _push(self, items: list[_Item]) -> None:
        """Hand lines to the writer thread, with every lazy line so far (they share its write)."""
        if self._lazy:
            items, self._lazy = self._lazy + items, []
        if not items:
            return
        if self._aio is not None:
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
        assert self._aio is not None and not self._syncing  # (scheduled only while none is under way)
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
                self._aio.sync(fd, done)
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

    async def _drain_queue(self) -> None:
        """Return once every line appended before the call is on disk."""
        if self._aio is None and (self._thread is None or not self._thread.is_alive()):
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._push([(-1, b"", fut, None)])
        with contextlib.suppress(OSError):
            await fut

    # --------------------------------------------------------------------------------- flush
    async def _watch_disk(self, every_s: float = 1.0) -> None:
        """``disk_full`` kept current (its own task: a flush can take long)."""
        while True:
            await asyncio.sleep(every_s)
            self.check_disk()

    async def _flush_loop(self) -> None:
        # pyarrow's kernels and Parquet writer load lazily (~0.6 s, pandas included): once, in the
        # background after the server answers, so that neither its start nor its first flush waits
        await asyncio.sleep(WARM_UP_AFTER_S)
        try:
            await asyncio.to_thread(_warm_up)
        except Exception:  # only a head start: the first flush loads what it needs
            log.exception("warming up the Parquet writer failed")
        while True:
            await asyncio.sleep(min(1.0, self.flush_interval_s))
            self._push([])  # lines no reply waited for: on disk within a second
            seg = self._current
            due = seg is not None and seg.rows and (
                seg.closed or time.monotonic() - seg.opened >= self.flush_interval_s)
            if any(s.closed for s in self._segments.values()) or due:
                try:
                    await self.flush()
                except Exception:  # logged; the segments stay in the spool and are tried again
                    log.exception("flushing the spool failed")

    async def flush(self, *, settle_wait_s: float = SETTLE_WAIT_S) -> int:
        """Write every segment with rows to the store (the current one is closed first). Returns rows
        written. A segment whose durable commits have not settled within ``settle_wait_s`` is kept for
        the next flush; the others are written meanwhile."""
        async with self._flush_lock:
            if self._leftovers:
                await self._recover_left()
            cur = self._current
            if cur is not None and cur.rows:
                self._rotate()
            await self._drain_queue()
            written = 0
            for seq in sorted(self._segments):
                seg = self._segments[seq]
                if not seg.closed:
                    continue
                if seg.pending:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(seg.settled.wait(), settle_wait_s)
                if seg.pending:  # a commit still running (a hung store): keep the segment, try again later
                    log.warning("%s: %d rows still wait for their durable commit; kept for the next flush",
                                seg.path.name, len(seg.pending))
                    continue
                try:
                    count = await self.calls.run(self._flush_segment, seg, doing=f"flushing {seg.path.name}",
                                                 deadline_s=FLUSH_DEADLINE_S)
                except (RollboxError, OSError) as exc:
                    self.metrics.flushes.labels("failed").inc()
                    log.warning("could not flush %s to the store (kept, retried): %s", seg.path.name, exc)
                    return written
                self.metrics.flushes.labels("ok").inc()
                os.close(seg.fd)
                seg.fd = -1
                with contextlib.suppress(FileNotFoundError):
                    seg.path.unlink()
                del self._segments[seq]
                written += count
            return written

    def _flush_segment(self, seg: _Segment) -> int:
        """Upload the segment's acknowledged rows (a row whose commit's outcome was unknown is kept if
        the store holds that commit, written by this replica); returns how many."""
        void = set(seg.void)
        known: dict[tuple[str, int], bool] = {}
        for i, (sid, gen) in list(seg.unknown.items()):
            if (sid, gen) not in known:
                known[(sid, gen)] = self._was_committed(sid, gen, self.replica)
            if not known[(sid, gen)]:
                void.add(i)
        lines = [r for i, r in enumerate(seg.rows) if i not in void]
        self._upload_lines(lines, seg.path.stem)
        return len(lines)

    def _upload(self, rows: list[tuple[str, dict[str, Any]]], name: str) -> None:
        self._upload_lines([spool_line(kind, row) for kind, row in rows], name)

    def _upload_lines(self, lines: list[bytes], name: str) -> None:
        """Spool lines as Parquet files, one per (kind, experiment, date), each with a create-only write.
        Lines Arrow cannot read as their kind's schema go, as they are, to ``rejected/<kind>/<name>.jsonl``."""
        for kind, (_, schema) in KINDS.items():
            mine = [line for line in lines if line.startswith(_KIND_PREFIX[kind])]
            if not mine:
                continue
            try:
                table = arrow_table_of_lines(b"".join(mine), schema)
            except (pa.ArrowException, ValueError, TypeError, OverflowError):
                mine, bad = self._sort_lines(mine, schema)
                self.objects.put_new(f"rejected/{kind}/{name}.jsonl", b"".join(bad))
                self.metrics.rejected += len(bad)
                log.warning("%s: %d %s rows could not be written as Parquet; kept as JSON under rejected/%s/",
                            name, len(bad), kind, kind)
                if not mine:
                    continue
                table = arrow_table_of_lines(b"".join(mine), schema)
            when = "recorded_at" if "recorded_at" in schema.names else "ended_at"
            dates = pc.strftime(table[when], format="%Y-%m-%d").fill_null(
                dt.datetime.now(dt.UTC).strftime("%Y-%m-%d"))
            experiments = table["experiment"].fill_null(DEFAULT_EXPERIMENT)
            table = table.select(schema.names)
            keys = pa.table({"e": experiments, "d": dates})
            for part in keys.group_by(["e", "d"]).aggregate([]).to_pylist():
                group = table.filter(pc.and_(pc.equal(experiments, part["e"]), pc.equal(dates, part["d"])))
                buf = io.BytesIO()
                pq.write_table(group, buf, compression="zstd")
                # False: flushed before a crash, already there
                self.objects.put_new(partition_key(kind, part["e"], part["d"], name), buf.getvalue())

    @staticmethod
    def _sort_lines(lines: list[bytes], schema: pa.Schema) -> tuple[list[bytes], list[bytes]]:
        """(Lines Arrow reads as ``schema``, lines it does not), each tried alone."""
        good: list[bytes] = []
        bad: list[bytes] = []
        for line in lines:
            try:
                arrow_table_of_lines(line if line.endswith(b"\n") else line + b"\n", schema)
            except (pa.ArrowException, ValueError, TypeError, OverflowError):
                bad.append(line if line.endswith(b"\n") else line + b"\n")
            else:
                good.append(line)
        return good, bad

    # ------------------------------------------------------------------------------ recovery
    def _recover(self) -> int:
        """Flush segments a previous process left (those no live process holds locked)."""
        total = 0
        for path in sorted(self.dir.glob("*.jsonl")):
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                continue
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # a live process is writing it
                rows = self._read_left(path)
                self._upload_lines(rows, path.stem)
                path.unlink()
                total += len(rows)
            finally:
                os.close(fd)
        return total

    def _read_left(self, path: Path) -> list[bytes]:
        """The lines of a dead process's segment that were acknowledged."""
        kept: list[bytes] = []
        committed: dict[tuple[str, int, str], bool] = {}
        for raw in path.read_bytes().splitlines(keepends=True):
            try:
                line = orjson.loads(raw)
            except orjson.JSONDecodeError:
                continue  # a line torn by the crash was never acknowledged
            if not isinstance(line, dict) or line.get("k") not in KINDS or not isinstance(line.get("r"), dict):
                continue
            p = line.get("p")
            if p is not None:
                key = (p[0], int(p[1]), p[2])
                if key not in committed:
                    committed[key] = self._was_committed(*key)
                if not committed[key]:
                    continue
            kept.append(spool_line(line["k"], line["r"]))  # as this version writes it
        return kept

    def _was_committed(self, sandbox_id: str, generation: int, writer: str) -> bool:
        rkey = record_key(sandbox_id, generation)
        data = self.objects.get(rkey)
        if data is not None:
            return SandboxRecord.from_bytes(data, rkey).writer == writer
        # missing: never committed; or the sandbox was destroyed and its records swept since, which
        # needs a generation after this one, so this one was committed
        return generation > 0 and not self.objects.keys(f"sandboxes/{sandbox_id}/")


def _warm_up() -> None:
    """Write a table once, in memory: pyarrow loads its compute kernels and Parquet writer lazily,
    which would otherwise land on the first flush under load."""
    for kind, (_, schema) in KINDS.items():
        pq.write_table(arrow_table_of_lines(spool_line(kind, {}), schema), io.BytesIO(), compression="zstd")


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
