"""The sweep at scale: it lists the store a page at a time with each record's write time, and reads a
sandbox's newest record only when it may be due. A real ``Runtime`` under a real ``DurableRuntime`` on
SeaweedFS (S3, through obstore); the other replicas' sandboxes are records written straight into the
bucket, as another replica's commits are.

Before, each sweep (every 60 s, on every replica) listed every key through botocore in a store thread
and read every sandbox whose newest record it had not written itself: at 20,000 open episodes its
listing ran past the store's 8 s deadline every time (the sweep failed, its thread listed on), and at
a drain the process waited for that thread before it could exit.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from rollbox.functions.durable.residency import SWEEP_UNKNOWN_READS
from rollbox.functions.durable.runtime import DurableRuntime
from rollbox.snapshots.state import SandboxRecord, record_key
from rollbox.snapshots.store_s3 import S3Objects
from svc_testkit import durable_runtime

from tests.snapshots.s3server import SeaweedS3, store_factory

OTHERS = 1200  # sandboxes of other replicas: more than a listing page (1,000 keys)


@pytest.fixture
async def durable(tmp_path: Path, seaweed: SeaweedS3) -> AsyncIterator[DurableRuntime]:
    objects = S3Objects(store_factory(seaweed)(f"s3://{seaweed.new_bucket()}/fleet"))
    assert objects.awaitable  # obstore: listed on the event loop
    async with durable_runtime(tmp_path / "home", objects, "sweep", sweep_interval_s=3600) as d:  # (swept by the test)
        yield d


def gets(d: DurableRuntime) -> int:
    return d.store.objects.requests_sent().get("GetObject", 0)


def write(d: DurableRuntime, records: list[SandboxRecord]) -> None:
    """Commit ``records`` as other replicas do (create-only puts), 16 at a time."""
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        assert all(pool.map(lambda r: d.store.objects.put_new(record_key(r.sandbox_id, r.generation), r.to_bytes()),
                            records))


async def test_a_sweep_reads_only_what_may_be_due_and_the_unknown_oldest_first(durable: DurableRuntime) -> None:
    d = durable
    now = time.time()
    short = await d.create("python", {"lifetime_s": 1.0})  # past its lifetime by the sweep
    moved = await d.create("python", {"lifetime_s": 3600.0, "idle_s": 600.0})
    kept = await d.create("python", {"lifetime_s": 3600.0, "idle_s": 600.0})
    base = await d.store.read(kept.sandbox_id, 0)
    assert base is not None
    # `moved` stepped on another replica: its generation 1 is unread here, but its limits are known
    write(d, [base.model_copy(update={"sandbox_id": moved.sandbox_id, "generation": 1, "last_used": now})])
    # sandboxes this replica never saw, all past their idle limit: the oldest (by write) are read first
    others = [base.model_copy(update={"sandbox_id": f"sb-other{i:05d}", "created_at": now - 7200,
                                      "last_used": now - 7200, "limits": base.limits.model_copy(
                                          update={"idle_s": 60.0})}) for i in range(OTHERS)]
    write(d, others[:OTHERS // 2])
    await asyncio.sleep(1.5)  # (the later half written after: younger by the listing's times)
    write(d, others[OTHERS // 2:])

    before = gets(d)
    done = await d.sweep()
    read = gets(d) - before
    assert done["sandboxes"] == OTHERS + 3, done  # every page listed
    # read: `short` (due) and the first SWEEP_UNKNOWN_READS of the unknown; not `moved`, not `kept`
    assert read == 1 + SWEEP_UNKNOWN_READS, (read, done)
    assert done["unread"] == OTHERS - SWEEP_UNKNOWN_READS, done
    assert done["expired"] == 1 + SWEEP_UNKNOWN_READS, done
    tomb = await d.store.read(short.sandbox_id, 1)
    assert tomb is not None and (tomb.state, tomb.reason) == ("destroyed", "lifetime"), tomb
    assert await d.store.read(moved.sandbox_id, 2) is None and await d.store.read(kept.sandbox_id, 1) is None
    expired = {o.sandbox_id for o in others if await d.store.read(o.sandbox_id, 1) is not None}
    assert expired <= {o.sandbox_id for o in others[:OTHERS // 2]}, "the oldest are read first"
    assert len(expired) == SWEEP_UNKNOWN_READS

    # the next sweep reads the next ones it knows nothing of; the tombstones it wrote are not due yet
    before = gets(d)
    done = await d.sweep()
    assert gets(d) - before == SWEEP_UNKNOWN_READS and done["expired"] == SWEEP_UNKNOWN_READS, done
    assert done["unread"] == OTHERS - 2 * SWEEP_UNKNOWN_READS, done


async def test_a_sweep_stops_at_once_when_cancelled_mid_listing(durable: DurableRuntime) -> None:
    """A drain cancels the sweep: it stops between pages, with no thread left listing that the
    process's exit would wait for."""
    d = durable
    base = await d.store.read((await d.create("python")).sandbox_id, 0)
    assert base is not None
    write(d, [base.model_copy(update={"sandbox_id": f"sb-page{i:05d}"}) for i in range(2000)])
    listing = [t for t in threading.enumerate() if "state" in t.name]
    sweep = asyncio.create_task(d.sweep())
    await asyncio.sleep(0.05)
    t0 = time.monotonic()
    sweep.cancel()
    with pytest.raises(asyncio.CancelledError):
        await sweep
    assert time.monotonic() - t0 < 1.0
    # no store thread was started for it (obstore lists in its own runtime)
    assert [t for t in threading.enumerate() if "state" in t.name] == listing
