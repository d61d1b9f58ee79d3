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
import time
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry
from rollbox.functions.contract.records import DEFAULT_EXPERIMENT, SCHEMA_VERSION
from rollbox.functions.recording.flush import SETTLE_WAIT_S, Flusher, partition_key
from rollbox.functions.recording.prices import Prices, billed_seconds
from rollbox.functions.recording.spool import KINDS, Metrics, Spool, Token, spool_line
from rollbox.runtime import tasks
from rollbox.runtime.spec import Limits, Usage
from rollbox.snapshots.calls import StoreCalls
from rollbox.snapshots.state import Objects

__all__ = ["KINDS", "Prices", "Recorder", "Token", "partition_key", "spool_line", "usage_row"]

GiB = 1024**3


def usage_row(usage: Usage, limits: Limits, *, kind: str, replica: str, prices: Prices, usage_id: str,
              ended_at: float | None = None) -> dict[str, Any]:
    """A sandbox life as a usage record: billed seconds rounded up, vCPU- and GiB-seconds of its limits."""
    billed = billed_seconds(usage.wall_s)
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


class Recorder:
    """The spool (``spool.py``: rows appended and synced, the disk watched) and its flush to the store
    (``flush.py``), started and drained together."""

    def __init__(self, spool_dir: Path, objects: Objects, replica: str, *, flush_records: int = 5000,
                 flush_interval_s: float = 10.0, prices: Prices | None = None,
                 registry: CollectorRegistry | None = None, aio: bool = True):
        """``aio``: sync the spool through Linux AIO where it works (else, or if False: a writer thread)."""
        self.dir = Path(spool_dir)
        self.objects = objects
        self.replica = replica
        self.prices = prices or Prices()
        self.spool = Spool(self.dir, replica, Metrics(registry), flush_records=flush_records, aio=aio)
        self.flusher = Flusher(self.spool, objects, replica, flush_interval_s=flush_interval_s)
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def flush_records(self) -> int:
        """A segment is closed (and flushed soon) at this many rows."""
        return self.spool.flush_records

    @property
    def flush_interval_s(self) -> float:
        return self.flusher.flush_interval_s

    @property
    def metrics(self) -> Metrics:
        return self.spool.metrics

    def bind_metrics(self, registry: CollectorRegistry) -> None:
        self.spool.metrics = Metrics(registry)

    @property
    def calls(self) -> StoreCalls:
        """The store's writes, with deadlines."""
        return self.flusher.calls

    @property
    def syncs(self) -> int:
        return self.metrics.syncs

    @property
    def min_free_bytes(self) -> int:
        """Below this free on the spool's disk, ``disk_full``."""
        return self.spool.min_free_bytes

    @min_free_bytes.setter
    def min_free_bytes(self, value: int) -> None:
        self.spool.min_free_bytes = value

    @property
    def disk_full(self) -> str | None:
        """Why rows cannot be spooled now (the disk refused a write, or has less than ``min_free_bytes``
        free), else None. Cleared once the disk has room again (``check_disk``, every second)."""
        return self.spool.disk_full

    def check_disk(self) -> None:
        """Look at the free space of the spool's disk (what an unprivileged writer may use)."""
        self.spool.check_disk()

    # ------------------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        self.spool.check_disk()
        await self.flusher.recover_left()
        self.spool.open()
        self._tasks = [asyncio.create_task(self.flusher.loop()), asyncio.create_task(self.spool.watch_disk())]

    async def close(self, *, settle_wait_s: float = 5.0) -> int:
        """Drain: write what is queued, flush every segment, stop. Returns the rows flushed. Nothing
        commits now: rows still marked pending after ``settle_wait_s`` (a lost settle) stay in their
        segment for the next start, which asks the store."""
        await self.spool.drain()
        await tasks.stop(self._tasks)
        rows = await self.flusher.flush(settle_wait_s=settle_wait_s)
        await self.spool.drain()
        await self.spool.stop_writing()
        self.flusher.calls.shutdown()
        self.spool.remove_empty()
        return rows

    # ------------------------------------------------------------------------------- recording
    def append(self, rows: list[tuple[str, dict[str, Any]]], *, pending: tuple[str, int] | None = None,
               now: bool = True) -> tuple[Token | None, asyncio.Future[None]]:
        """Spool ``rows`` ((kind, row) pairs); the future is done once they are fsync'd. ``pending``:
        (sandbox id, generation) of the durable commit that acknowledges them; ``settle`` the token
        it returns when that commit is done. ``now=False``: no reply waits for them, they go to disk
        with the next rows that are waited for (or within a second), sharing their fsync."""
        return self.spool.append(rows, pending=pending, now=now)

    def settle(self, token: Token | None, committed: bool | None) -> None:
        """The commit a pending token waited for is done: keep its rows (``committed``) or drop them;
        None: its outcome is unknown (a write past its deadline may still land), the flush asks the store."""
        self.spool.settle(token, committed)

    async def flush(self, *, settle_wait_s: float = SETTLE_WAIT_S) -> int:
        """Write every segment with rows to the store (the current one is closed first). Returns rows
        written. A segment whose durable commits have not settled within ``settle_wait_s`` is kept for
        the next flush; the others are written meanwhile."""
        return await self.flusher.flush(settle_wait_s=settle_wait_s)

    def _upload(self, rows: list[tuple[str, dict[str, Any]]], name: str) -> None:
        """(Tests) rows written to the store as a segment named ``name`` would be."""
        self.flusher.upload(rows, name)
