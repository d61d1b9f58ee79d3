"""Recording: every handled step and every sandbox life, spooled locally, flushed to the store as Parquet.

    reply ready -> rows appended to the spool (a JSON-lines segment in ``<home>/spool``, fsync'd: one
                   fsync serves every row that arrived while the previous one ran) -> reply sent
    every ``flush_records`` rows or ``flush_interval_s`` seconds, and on drain: the segment is closed
                   and written to the store as Parquet, one file per (kind, experiment, date), named
                   after the segment, with a create-only write; then the segment is deleted

So nothing acknowledged is lost on a crash: a restart flushes what the last process left (a segment
not locked by a live process). Flushing a segment twice (a crash between its upload and its
deletion) finds its files there and writes nothing: every row is in the store once.

A durable step's row is spooled *before* its state is committed (the commit is what acknowledges
it), marked pending with the generation it commits; a failed commit drops it from the flush. Rows of
a segment left by a dead process that are still marked pending are kept only if that generation's
record in the store was written by that process.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import fcntl
import io
import json
import logging
import math
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pyarrow.parquet as pq
from prometheus_client import CollectorRegistry, Counter
from rollbox.functions.records import (
    DEFAULT_EXPERIMENT,
    SCHEMA_VERSION,
    STEP_SCHEMA,
    USAGE_SCHEMA,
    arrow_table,
)
from rollbox.runtime.errors import RollboxError
from rollbox.runtime.spec import Limits, Usage
from rollbox.snapshots.state import Objects, SandboxRecord, record_key

__all__ = ["Prices", "Recorder", "partition_key", "usage_row"]

log = logging.getLogger("rollbox.recorder")
GiB = 1024**3
KINDS = {"step": ("trajectories", STEP_SCHEMA), "usage": ("usage", USAGE_SCHEMA)}


@dataclass(frozen=True)
class Prices:
    """Dollars per vCPU-second and per GiB-second of a sandbox's limits (defaults: E2B's published rates)."""

    vcpu_s: float = 0.000014
    gib_s: float = 0.0000045


def partition_key(kind: str, experiment: str | None, when: float, name: str) -> str:
    """``trajectories|usage/experiment=<e>/date=<yyyy-mm-dd>/<name>.parquet`` (the experiment URI-quoted,
    which hive partitioning decodes)."""
    prefix, _ = KINDS[kind]
    date = dt.datetime.fromtimestamp(when, dt.UTC).strftime("%Y-%m-%d")
    exp = quote(experiment or DEFAULT_EXPERIMENT, safe="-_.")
    return f"{prefix}/experiment={exp}/date={date}/{name}.parquet"


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
    def __init__(self, registry: CollectorRegistry | None):
        r = registry or CollectorRegistry()
        self.rows = Counter("rollbox_recorded_rows", "Rows spooled (steps and usage records)", ["kind"], registry=r)
        self.flushes = Counter("rollbox_spool_flushes", "Spool segments written to the store as Parquet",
                               ["result"], registry=r)
        self.billed_s = Counter("rollbox_billed_seconds", "Billed sandbox seconds", ["experiment"], registry=r)
        self.vcpu_s = Counter("rollbox_billed_vcpu_seconds", "Billed vCPU-seconds (billed s x cores limit)",
                              ["experiment"], registry=r)
        self.gib_s = Counter("rollbox_billed_gib_seconds", "Billed GiB-seconds (billed s x memory limit)",
                             ["experiment"], registry=r)
        self.cost = Counter("rollbox_cost_usd", "Cost of billed sandbox time at the configured prices",
                            ["experiment"], registry=r)
        self._rows: dict[str, Any] = {}
        self._bills: dict[str, tuple[Any, Any, Any, Any]] = {}

    def row(self, kind: str) -> Any:  # labelled children, looked up once (labels() costs ~3 µs a call)
        child = self._rows.get(kind)
        if child is None:
            child = self._rows[kind] = self.rows.labels(kind)
        return child

    def bill(self, experiment: str) -> tuple[Any, Any, Any, Any]:
        children = self._bills.get(experiment)
        if children is None:
            children = self._bills[experiment] = (self.billed_s.labels(experiment), self.vcpu_s.labels(experiment),
                                                  self.gib_s.labels(experiment), self.cost.labels(experiment))
        return children


@dataclass
class _Segment:
    seq: int
    path: Path
    fd: int
    rows: list[bytes] = field(default_factory=list)  # its lines as written (bytes: no work for the GC)
    pending: set[int] = field(default_factory=set)
    void: set[int] = field(default_factory=set)
    closed: bool = False
    opened: float = field(default_factory=time.monotonic)
    settled: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass(frozen=True)
class Token:
    """A spooled row awaiting its durable commit."""

    seq: int
    index: int
    count: int


class Recorder:
    def __init__(self, spool_dir: Path, objects: Objects, replica: str, *, flush_records: int = 1000,
                 flush_interval_s: float = 10.0, prices: Prices | None = None,
                 registry: CollectorRegistry | None = None):
        self.dir = Path(spool_dir)
        self.objects = objects
        self.replica = replica
        self.flush_records = flush_records
        self.flush_interval_s = flush_interval_s
        self.prices = prices or Prices()
        self.metrics = _Metrics(registry)
        self._seq = 0
        self._current: _Segment | None = None
        self._segments: dict[int, _Segment] = {}
        # lines waiting for the spool's writer thread (guarded by _cv); _urgent: a reply waits for some
        self._queue: list[tuple[bytes, int, asyncio.Future[None]]] = []
        self._cv = threading.Condition()
        self._urgent = False
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._flush_lock = asyncio.Lock()
        self._leftovers = False
        self._stem = f"{replica}.{int(time.time() * 1000):013d}"

    def bind_metrics(self, registry: CollectorRegistry) -> None:
        self.metrics = _Metrics(registry)

    # ------------------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        await asyncio.to_thread(_warm_up)
        await self._recover_left()
        self._open_segment()
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._write_loop, name="rollbox-spool", daemon=True)
        self._thread.start()
        self._tasks = [asyncio.create_task(self._flush_loop())]

    async def _recover_left(self) -> None:
        try:
            left = await asyncio.to_thread(self._recover)
        except (RollboxError, OSError) as exc:  # the store is down: they stay, tried again at each flush
            self._leftovers = True
            log.warning("could not flush what a previous process left in the spool (kept): %s", exc)
            return
        self._leftovers = False
        if left:
            log.info("flushed %d rows a previous process left in the spool", left)

    async def close(self) -> int:
        """Drain: write what is queued, flush every segment, stop. Returns the rows flushed."""
        await self._drain_queue()
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        rows = await self.flush()
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
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
        first = len(seg.rows)
        lines = []
        for kind, row in rows:
            idx = len(seg.rows)
            line: dict[str, Any] = {"k": kind, "r": {k: v for k, v in row.items() if v is not None}}
            if pending is not None:
                line["p"] = [pending[0], pending[1], self.replica]
                seg.pending.add(idx)
                seg.settled.clear()
            lines.append(json.dumps(line, separators=(",", ":"), default=str).encode() + b"\n")
            seg.rows.append(lines[-1])
            self.metrics.row(kind).inc()
            if kind == "usage":
                self._bill(row)
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        with self._cv:
            self._queue.append((b"".join(lines), seg.fd, fut))
            if now:
                self._urgent = True
                self._cv.notify()
        if len(seg.rows) >= self.flush_records:
            self._rotate()
        return (Token(seg.seq, first, len(rows)) if pending is not None else None), fut

    def settle(self, token: Token | None, committed: bool) -> None:
        """The commit a pending token waited for is done: keep its rows (``committed``) or drop them."""
        if token is None:
            return
        seg = self._segments.get(token.seq)
        if seg is None:
            return
        for i in range(token.index, token.index + token.count):
            seg.pending.discard(i)
            if not committed:
                seg.void.add(i)
        if not seg.pending:
            seg.settled.set()

    def _bill(self, row: dict[str, Any]) -> None:
        billed_s, vcpu_s, gib_s, cost = self.metrics.bill(row.get("experiment") or DEFAULT_EXPERIMENT)
        billed_s.inc(row["billed_s"])
        vcpu_s.inc(row["vcpu_s"])
        gib_s.inc(row["gib_s"])
        cost.inc(row["cost_usd"])

    # --------------------------------------------------------------------------------- spool
    def _open_segment(self) -> None:
        self._seq += 1
        path = self.dir / f"{self._stem}.{self._seq:06d}.jsonl"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
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

    def _write_loop(self) -> None:
        """The spool's writer thread: takes every line queued so far, writes each to its segment (a
        batch may straddle a rotation), one fdatasync per segment, then resolves their futures on the
        event loop. Lines no reply waits for are taken within a second."""
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._urgent or self._stopping, timeout=1.0)
                batch, self._queue, self._urgent = self._queue, [], False
                if not batch and self._stopping:
                    return
            if not batch:
                continue
            by_fd: dict[int, list[bytes]] = {}
            for data, fd, _ in batch:
                if data:
                    by_fd.setdefault(fd, []).append(data)
            error: OSError | None = None
            try:
                _write_all(by_fd)
            except OSError as exc:
                error = exc
            assert self._loop is not None
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
                self._loop.call_soon_threadsafe(_resolve, [fut for _, _, fut in batch], error)

    async def _drain_queue(self) -> None:
        """Return once every line queued before the call is on disk."""
        if self._thread is None or not self._thread.is_alive():
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        with self._cv:
            self._queue.append((b"", -1, fut))
            self._urgent = True
            self._cv.notify()
        with contextlib.suppress(OSError):
            await fut

    # --------------------------------------------------------------------------------- flush
    async def _flush_loop(self) -> None:
        while True:
            await asyncio.sleep(min(1.0, self.flush_interval_s))
            seg = self._current
            due = seg is not None and seg.rows and (
                seg.closed or time.monotonic() - seg.opened >= self.flush_interval_s)
            if any(s.closed for s in self._segments.values()) or due:
                try:
                    await self.flush()
                except Exception:  # logged; the segments stay in the spool and are tried again
                    log.exception("flushing the spool failed")

    async def flush(self) -> int:
        """Write every segment with rows to the store (the current one is closed first). Returns rows written."""
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
                        await asyncio.wait_for(seg.settled.wait(), 30.0)
                if seg.pending:  # a commit still running (a hung store): keep the segment, try again later
                    return written
                lines = [r for i, r in enumerate(seg.rows) if i not in seg.void]
                try:
                    await asyncio.to_thread(self._upload_lines, lines, seg.path.stem)
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
                written += len(lines)
            return written

    def _upload_lines(self, lines: list[bytes], name: str) -> None:
        self._upload([(line["k"], line["r"]) for line in map(json.loads, lines)], name)

    def _upload(self, rows: list[tuple[str, dict[str, Any]]], name: str) -> None:
        groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
        for kind, row in rows:
            when = row.get("recorded_at") or row.get("ended_at") or time.time()
            groups.setdefault((kind, partition_key(kind, row.get("experiment"), when, name)), []).append(row)
        for (kind, key), group in sorted(groups.items()):
            buf = io.BytesIO()
            pq.write_table(arrow_table(group, KINDS[kind][1]), buf, compression="zstd")
            self.objects.put_new(key, buf.getvalue())  # False: flushed before a crash, already there

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
                self._upload(rows, path.stem)
                path.unlink()
                total += len(rows)
            finally:
                os.close(fd)
        return total

    def _read_left(self, path: Path) -> list[tuple[str, dict[str, Any]]]:
        rows: list[tuple[str, dict[str, Any]]] = []
        committed: dict[tuple[str, int, str], bool] = {}
        for raw in path.read_bytes().splitlines():
            try:
                line = json.loads(raw)
            except ValueError:
                continue  # a line torn by the crash was never acknowledged
            p = line.get("p")
            if p is not None:
                key = (p[0], int(p[1]), p[2])
                if key not in committed:
                    committed[key] = self._was_committed(*key)
                if not committed[key]:
                    continue
            rows.append((line["k"], line["r"]))
        return rows

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
    for schema in (STEP_SCHEMA, USAGE_SCHEMA):
        pq.write_table(arrow_table([], schema), io.BytesIO(), compression="zstd")


def _resolve(futures: list[asyncio.Future[None]], error: OSError | None) -> None:
    for fut in futures:
        if not fut.done():
            if error is None:
                fut.set_result(None)
            else:
                fut.set_exception(error)


def _write_all(by_fd: dict[int, list[bytes]]) -> None:
    for fd, chunks in by_fd.items():
        data = b"".join(chunks)
        while data:
            n = os.write(fd, data)
            data = data[n:]
        os.fdatasync(fd)
