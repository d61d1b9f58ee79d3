"""The flush: closed spool segments written to the store as Parquet, then deleted.

One Parquet file per (kind, experiment, date), named after the segment, each with a create-only write
(a segment flushed twice writes nothing the second time). A line the Parquet writer refuses is set
aside as it is under ``rejected/`` while the rest of its segment is written. Segments a dead process
left are flushed at start (and retried at each flush while the store is down); ``recorder.py`` has
the whole story.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import fcntl
import logging
import os
import time
from pathlib import Path
from typing import Any
from urllib.parse import quote

import orjson
from rollbox.functions.contract.records import DEFAULT_EXPERIMENT
from rollbox.functions.recording.spool import KINDS, Segment, Spool, spool_line
from rollbox.runtime.errors import RollboxError
from rollbox.snapshots.calls import StoreCalls
from rollbox.snapshots.state import Objects, SandboxRecord, record_key

__all__ = ["Flusher", "partition_key"]

log = logging.getLogger("rollbox.recorder")
FLUSH_DEADLINE_S = 120.0  # a flush the store does not finish in this time fails; its segment is kept
SETTLE_WAIT_S = 30.0  # a flush waits this long for a segment's durable commits to settle (then: next flush)
# after start: pyarrow (~0.2 s of CPU) loads once a replica scaled from zero has had a few seconds for
# the requests that waited for it (its first flush comes later still: flush_interval_s, 10 s by default)
WARM_UP_AFTER_S = 5.0


def partition_key(kind: str, experiment: str | None, when: float | str, name: str) -> str:
    """``trajectories|usage/experiment=<e>/date=<yyyy-mm-dd>/<name>.parquet`` (the experiment URI-quoted,
    which hive partitioning decodes); ``when``: unix seconds, or the date itself."""
    prefix = KINDS[kind]
    date = when if isinstance(when, str) else dt.datetime.fromtimestamp(when, dt.UTC).strftime("%Y-%m-%d")
    exp = quote(experiment or DEFAULT_EXPERIMENT, safe="-_.")
    return f"{prefix}/experiment={exp}/date={date}/{name}.parquet"


class Flusher:
    """Writes the spool's closed segments to ``objects`` (every ``flush_interval_s``, or when asked),
    and what a previous process left in the spool's folder."""

    def __init__(self, spool: Spool, objects: Objects, replica: str, *, flush_interval_s: float):
        self.spool = spool
        self.objects = objects
        self.replica = replica
        self.flush_interval_s = flush_interval_s
        self._lock = asyncio.Lock()
        self._leftovers = False
        self.calls = StoreCalls(2, name="rollbox-flush")  # the store's writes, with deadlines

    async def recover_left(self) -> None:
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

    async def loop(self) -> None:
        # pyarrow, its kernels and Parquet writer load lazily: once, in the background after the server
        # answers (WARM_UP_AFTER_S), so that neither its start nor its first flush waits
        await asyncio.sleep(WARM_UP_AFTER_S)
        try:
            await asyncio.to_thread(_warm_up)
        except Exception:  # only a head start: the first flush loads what it needs
            log.exception("warming up the Parquet writer failed")
        while True:
            await asyncio.sleep(min(1.0, self.flush_interval_s))
            self.spool.push([])  # lines no reply waited for: on disk within a second
            seg = self.spool.current
            due = seg is not None and seg.rows and (
                seg.closed or time.monotonic() - seg.opened >= self.flush_interval_s)
            if any(s.closed for s in self.spool.segments.values()) or due:
                try:
                    await self.flush()
                except Exception:  # logged; the segments stay in the spool and are tried again
                    log.exception("flushing the spool failed")

    async def flush(self, *, settle_wait_s: float = SETTLE_WAIT_S) -> int:
        """See ``Recorder.flush``."""
        spool = self.spool
        async with self._lock:
            if self._leftovers:
                await self.recover_left()
            cur = spool.current
            if cur is not None and cur.rows:
                spool.rotate()
            await spool.drain()
            written = 0
            for seq in sorted(spool.segments):
                seg = spool.segments[seq]
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
                    spool.metrics.flushes.labels("failed").inc()
                    log.warning("could not flush %s to the store (kept, retried): %s", seg.path.name, exc)
                    return written
                spool.metrics.flushes.labels("ok").inc()
                spool.remove(seg)
                written += count
            return written

    def _flush_segment(self, seg: Segment) -> int:
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
        self.upload_lines(lines, seg.path.stem)
        return len(lines)

    def upload(self, rows: list[tuple[str, dict[str, Any]]], name: str) -> None:
        self.upload_lines([spool_line(kind, row) for kind, row in rows], name)

    def upload_lines(self, lines: list[bytes], name: str) -> None:
        """Spool lines as Parquet files, one per (kind, experiment, date), each with a create-only write.
        Lines Arrow cannot read as their kind's schema go, as they are, to ``rejected/<kind>/<name>.jsonl``."""
        from rollbox.functions.recording import parquet  # (pyarrow: loaded by the warm-up or the first flush)

        files = parquet.files_of(lines)
        for kind, bad in files.rejected.items():
            self.objects.put_new(f"rejected/{kind}/{name}.jsonl", b"".join(bad))
            self.spool.metrics.rejected += len(bad)
            log.warning("%s: %d %s rows could not be written as Parquet; kept as JSON under rejected/%s/",
                        name, len(bad), kind, kind)
        for kind, experiment, date, data in files.parts:
            # False: flushed before a crash, already there
            self.objects.put_new(partition_key(kind, experiment, date, name), data)

    # ------------------------------------------------------------------------------ recovery
    def _recover(self) -> int:
        """Flush segments a previous process left (those no live process holds locked)."""
        total = 0
        for path in sorted(self.spool.dir.glob("*.jsonl")):
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
                self.upload_lines(rows, path.stem)
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
    from rollbox.functions.recording import parquet

    parquet.warm_up()
