"""A sandbox's generations: a step's state committed as the next one, the newest one made live again.

    commit    the usage of this life so far, the files changed (scanned while the sandbox is held
              still; large new contents uploaded as blobs first), the events acknowledged and the
              step's reply, written create-only as generation n+1; a replica that finds n+1 taken
              keeps nothing of its step (``SandboxBusy``, or ``SandboxGone`` if the winner ended it)
    resume    a sandbox of the generation's snapshot and limits, its files injected as a fork
              child's are, its lifetime counted from the sandbox's create

Any failure of a commit drops the live copy: its files may hold a step that was not acknowledged.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel
from rollbox.functions.contract.eventref import EventRef
from rollbox.functions.durable.metrics import DurableMetrics
from rollbox.functions.durable.residency import Live, Residency
from rollbox.functions.durable.store import StateStore
from rollbox.functions.recording.prices import billed_seconds
from rollbox.runtime.errors import RollboxError, SandboxBusy, SandboxDied, SandboxGone, StoreError
from rollbox.runtime.runtime import Runtime
from rollbox.runtime.spec import ExecResult, Usage
from rollbox.snapshots.calls import StoreDeadline
from rollbox.snapshots.state import (
    SMALL_SCAN,
    Files,
    SandboxRecord,
    StepUsage,
    UpperTooLarge,
    diff_of,
    place_contents,
    prefill_hashes,
    record_key,
    scan_upper,
)

if TYPE_CHECKING:
    from rollbox.functions.recording.steps import StepLog

__all__ = ["Generations"]


class Generations:
    """Commit and resume (see the module docstring); the live copies are ``residency``'s."""

    def __init__(self, rt: Runtime, store: StateStore, residency: Residency, metrics: DurableMetrics, *,
                 replica: str, journal: StepLog | None = None):
        self.rt = rt
        self.store = store
        self.residency = residency
        self.metrics = metrics
        self.replica = replica
        self.journal = journal
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="rollbox-scan")  # reading upper dirs

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    async def commit(self, live: Live, reply: BaseModel | None, ev: EventRef | None, *, scan: bool = True,
                      state: str = "live", reason: str | None = None, journal: bool = True) -> None:
        """Write the sandbox's next generation (create-only). Any failure drops the live copy: its
        files may hold a step that was not acknowledged, so the next step resumes from the store.
        ``journal``: spool the step's row and usage (off for a record that only notes an event)."""
        prev = live.record
        sid = prev.sandbox_id
        gen = prev.generation + 1
        t0 = time.perf_counter()
        token = None
        writing = False
        steps = self.journal if journal else None
        try:
            sb = self.rt.sandboxes.get(sid)
            if sb is not None and state == "live":
                self.account(live, sb.cpu_s, sb.peak_memory_bytes)
            files = prev.files
            inline: dict[str, bytes] = {}
            if scan and sb is not None:
                files, inline = await self.scan(sid, live, gen)
            events = dict(prev.events)
            if ev is not None:
                events[ev.key] = [gen, ev.fingerprint]
            usage_now = live.record.usage
            if isinstance(reply, ExecResult):
                usage_now = usage_now.model_copy(update={"execs": usage_now.execs + 1})
            record = live.record.model_copy(update={
                "generation": gen, "state": state, "reason": reason, "files": files if state == "live" else Files(),
                "inline": inline, "events": events, "last_used": time.time(), "usage": usage_now,
                "reply": None if reply is None else reply.model_dump(mode="json"), "writer": self.replica})
            if steps is not None:  # spooled beside the write; the reply waits for both
                token = await steps.before_commit(record, reply, ev is not None)
            writing = True
            data = record.to_bytes()
            ok = await self.store.put_record(record_key(sid, gen), data)
        except BaseException as exc:
            if steps is not None:  # a write past its deadline may still land: the flush asks the store
                steps.settle(token, None if writing and isinstance(exc, StoreDeadline) else False)
            if state == "live":
                self.residency.drop(sid, "commit failed")
            raise
        finally:
            self.metrics.store_write_seconds.observe(time.perf_counter() - t0)
        if steps is not None:
            steps.settle(token, ok)
        if not ok:
            self.metrics.conflicts.inc()
            self.residency.drop(sid, "conflict")
            if state == "live":  # a step lost to the sandbox's end (a destroy, an expiry elsewhere): that is final
                with contextlib.suppress(StoreError):
                    winner = await self.store.read(sid, gen)
                    if winner is not None:  # (a step run again here reads on from it)
                        self.store.remember(winner)
                    if winner is not None and winner.state == "destroyed":
                        raise SandboxGone(f"sandbox {sid} ended ({winner.reason}) while this step ran; nothing of "
                                          "it was kept", sandbox_id=sid, reason=winner.reason or "destroyed")
            raise SandboxBusy(f"sandbox {sid}: another replica committed step {gen} first; nothing of this "
                              "request was kept, retry it", sandbox_id=sid)
        live.record = record
        self.store.remember(record, data)

    async def scan(self, sandbox_id: str, live: Live, gen: int) -> tuple[Files, dict[str, bytes]]:
        """The sandbox's files, read while it is held still (or, once it died, through its upper
        directory's descriptor); (files, inline contents). New large contents are uploaded as blobs
        before it may run again or its descriptor is closed: their paths lead into it."""
        def scan(upper: str, small: bool = False) -> tuple[Files, dict[str, bytes], dict[str, str]]:
            files, paths = scan_upper(upper, live.hashes, small)
            inline, blobs = place_contents(files, live.record if live.record.generation >= 0 else None, gen, paths)
            return files, inline, blobs

        async def scanned(upper: str) -> tuple[Files, dict[str, bytes]]:
            try:  # most steps change a few small files: scanned here, no thread's round trip
                files, inline, blobs = scan(upper, small=True)
            except UpperTooLarge:
                files, inline, blobs = await self._disk(scan, upper)
            await self.store.put_blobs(blobs)
            return files, inline

        try:
            async with self.rt.frozen(sandbox_id) as sb:
                return await scanned(sb.upper_path)
        except SandboxDied:  # nothing runs in it any more: its files can be read as they are
            dead = self.rt.sandboxes.get(sandbox_id)
            if dead is None or dead.upper_fd < 0:
                raise
            fd = os.dup(dead.upper_fd)  # the runtime's reaper may end the dead sandbox (and close its fd) meanwhile
            try:
                return await scanned(f"/proc/self/fd/{fd}/upper")
            finally:
                os.close(fd)

    async def resume(self, head: SandboxRecord, spare: bool = True) -> Live:
        """A live copy of ``head``: a sandbox of its snapshot and limits with its files injected."""
        t0 = time.perf_counter()
        sid = head.sandbox_id
        contents = await self.store.contents(head)
        await self.residency.make_room()
        await self.rt.take(head.snapshot, head.limits, head.metadata, sandbox_id=sid, forked_from=head.forked_from,
                           step_next=spare)
        self.not_metered(sid)
        sb = self.rt.sandboxes.get(sid)
        if sb is not None:  # its lifetime counts from the sandbox's create, not from this resume (the reaper's)
            sb.backdate(max(0.0, time.time() - head.created_at))
        try:
            if head.files.entries or head.files.whiteouts or head.files.opaque:
                diff = diff_of(head.files, contents)
                try:
                    await self.rt.inject(sid, diff)
                finally:
                    os.close(diff.fd)
        except BaseException:
            with contextlib.suppress(RollboxError):
                await self.rt.destroy(sid, reason="resume failed")
            raise
        live = Live(record=head)
        sb = self.rt.sandboxes.get(sid)
        if sb is not None and sb.upper_fd >= 0:  # the injected files are known: the first commit reads none
            try:  # a stat per entry: a small upper here, no thread's round trip
                prefill_hashes(sb.upper_path, head.files, live.hashes, SMALL_SCAN[0])
            except UpperTooLarge:
                await self._disk(prefill_hashes, sb.upper_path, head.files, live.hashes)
        live.resume_ms = round((time.perf_counter() - t0) * 1000, 3)
        self.residency.live[sid] = live
        self.metrics.resumes.inc()
        self.metrics.resume_seconds.observe(time.perf_counter() - t0)
        return live

    def account(self, live: Live, life_cpu_s: float, peak: int) -> None:
        """Fold this life's usage since the last commit into ``live.record.usage``."""
        now = time.monotonic()
        u = live.record.usage
        live.record = live.record.model_copy(update={"usage": StepUsage(
            live_s=u.live_s + (now - live.since),
            cpu_s=u.cpu_s + max(0.0, life_cpu_s - live.cpu_s),
            peak_memory_bytes=max(u.peak_memory_bytes, peak),
            execs=u.execs)})
        live.since = now
        live.cpu_s = life_cpu_s

    def usage(self, record: SandboxRecord, reason: str) -> Usage:
        u = record.usage
        return Usage(sandbox_id=record.sandbox_id, snapshot_id=record.snapshot, metadata=record.metadata,
                     wall_s=round(u.live_s, 6), cpu_s=round(u.cpu_s, 6), peak_memory_bytes=u.peak_memory_bytes,
                     billed_s=billed_seconds(u.live_s), execs=u.execs, reason=reason)

    def not_metered(self, sandbox_id: str) -> None:
        """A durable sandbox's lives on replicas are one life, billed once when it ends (``_commit`` of
        its tombstone), not by the runtime at each hibernation."""
        sb = self.rt.sandboxes.get(sandbox_id)
        if sb is not None:
            sb.bill_elsewhere()

    async def _disk(self, fn: Callable[..., Any], *args: Any) -> Any:  # local files, off the event loop
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
