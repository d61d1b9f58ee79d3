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
import random
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from rollbox.functions.durable.residency import SWEEP_UNKNOWN_READS
from rollbox.functions.durable.runtime import DurableRuntime
from rollbox.functions.durable.sweeping import SHARDS, SweepPlan, key_range, stale_claims
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


# ------------------------------------------------------------------ a large store: a range per round


def _record_keys(n: int, seed: int) -> list[str]:
    """Record keys of ``n`` sandboxes with ids as the API makes them (``sb-`` and 20 hex digits), and a few
    the tests above use (``sb-other…``), one to three generations each."""
    rng = random.Random(seed)
    sids = [f"sb-{rng.getrandbits(80):020x}" for _ in range(n)] + ["sb-other00001", "sb-page00002", "sb-0", "sb-f"]
    return sorted(record_key(sid, g) for sid in sids for g in range(rng.randint(1, 3)))


def test_the_ranges_hold_every_key_once_and_about_as_many_each() -> None:
    keys = _record_keys(4000, seed=1)
    counts = [0] * SHARDS
    for k in keys:
        inside = [i for i in range(SHARDS) if (lo := key_range(i)[0]) is None or k > lo
                  if (hi := key_range(i)[1]) is None or k < hi]
        assert len(inside) == 1, (k, inside)
        counts[inside[0]] += 1
    assert min(counts) > 0.6 * len(keys) / SHARDS and max(counts) < 1.4 * len(keys) / SHARDS, counts


@pytest.mark.parametrize("kind", ["s3", "local"])
async def test_a_ranged_listing_lists_exactly_its_range_on_both_stores(kind: str, tmp_path: Path,
                                                                       seaweed: SeaweedS3) -> None:
    """S3 (obstore, from StartAfter, stopped at the range's end: past a page of 1,000 keys) and the local
    store (only the directories that may hold keys of the range) list what the whole listing holds in it."""
    from rollbox.functions.durable.store import StateStore
    from rollbox.snapshots.state import LocalObjects

    objects: Any = (S3Objects(store_factory(seaweed)(f"s3://{seaweed.new_bucket()}/ranges")) if kind == "s3"
                    else LocalObjects(tmp_path / "state"))
    keys = _record_keys(700, seed=2)  # ~1,400 keys: the S3 ranges' listings cross a page
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        assert all(pool.map(lambda k: objects.put_new(k, b"{}"), keys))
    assert objects.put_new("sweeps/64/00/1", b"{}")  # (outside sandboxes/: in no range)
    store = StateStore(objects)
    whole = [k async for page in store.listing("sandboxes/") for k, _ in page]
    assert whole == keys
    ranged = []
    for i in range(SHARDS):
        lo, hi = key_range(i)
        got = [k async for page in store.listing("sandboxes/", lo, hi) for k, _ in page]
        assert got == [k for k in keys if (lo is None or k > lo) and (hi is None or k < hi)], i
        ranged += got
    assert ranged == keys


def test_the_plan_lists_the_whole_store_until_that_is_long_then_a_range_per_round() -> None:
    plan = SweepPlan(60.0, 19.0, random.Random(0))
    assert plan.bounds() is None and plan.wait_s == 60.0
    plan.done(0.2, listed=True)  # a short whole listing: the next in 60 s
    assert plan.bounds() is None and plan.wait_s == 60.0
    plan.done(8.0, listed=True)  # 8 s: too long for one burst; the pass takes 19 x 8 s, a range each 1/16
    assert plan.bounds() == key_range(plan.shard) and plan.wait_s == pytest.approx(19 * 8.0 / SHARDS)
    first = plan.shard
    plan.done(0.5, listed=True)  # a range in 0.5 s (a pass ~8 s): the next range 19 x 0.5 s later
    assert plan.shard == (first + 1) % SHARDS and plan.wait_s == pytest.approx(9.5)
    plan.done(0.0, listed=False)  # another replica had claimed it: the next range, the same pace
    assert plan.shard == (first + 2) % SHARDS and plan.wait_s == pytest.approx(9.5)
    # the period: a pass as paced, 19 x the whole listing's estimate (8 s, then 16 x 0.5 s: 8 s), 152 s,
    # rounded up to 256 s
    key, stale = plan.claim(1000.0)  # (and the claim of two periods back, to delete)
    assert (key, stale) == (f"sweeps/256/{plan.shard:02d}/3", f"sweeps/256/{plan.shard:02d}/1")
    for _ in range(40):  # the store shrank: ranges listed in 10 ms, a pass ~0.16 s: the whole again
        plan.done(0.01, listed=True)
    assert plan.bounds() is None and plan.wait_s == 60.0


def test_stale_claims_are_those_two_or_more_of_their_own_periods_old() -> None:
    now = 1000.5  # period 1: n = 1000; period 8: n = 125; period 64: n = 15
    keys = ["sweeps/1/00/1000", "sweeps/1/00/999", "sweeps/1/00/998", "sweeps/1/07/12",
            "sweeps/8/03/125", "sweeps/8/03/124", "sweeps/8/03/123", "sweeps/64/15/14", "sweeps/64/15/13",
            "sweeps/1/00/x", "sweeps/0/00/1", "sweeps/other", "sandboxes/sb-1/0"]
    assert stale_claims(keys, now) == ["sweeps/1/00/998", "sweeps/1/07/12", "sweeps/8/03/123", "sweeps/64/15/13"]


async def test_two_replicas_share_the_ranges_each_swept_once_per_period(
        tmp_path: Path, seaweed: SeaweedS3, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two replicas on one store, their sweeps split into ranges from the start and paced fast (a period
    of 1 s): in each period every range is swept by one of them, not by both; both do some; the claims
    of past periods are deleted as the next ones are made, and so are those no claimant names (left by a
    period nobody swept, or by another period length)."""
    from rollbox.functions.durable import residency, sweeping

    monkeypatch.setattr(sweeping, "SPLIT_S", 0.0)  # a range per round whatever the store's size
    monkeypatch.setattr(residency, "SWEEP_REST", 0.0)  # paced by the interval alone: a period of 1 s on both
    swept: list[tuple[int, tuple[str | None, str | None] | None, float]] = []
    real_sweep = residency.Residency.sweep

    async def counted(self: Any, bounds: Any = None) -> dict[str, int]:
        swept.append((id(self), bounds, time.time()))
        return await real_sweep(self, bounds)

    monkeypatch.setattr(residency.Residency, "sweep", counted)
    bucket = seaweed.new_bucket()
    objects = [S3Objects(store_factory(seaweed)(f"s3://{bucket}/fleet")) for _ in range(2)]
    t0 = time.time()
    left = [f"sweeps/1/03/{int(t0) - 60}", f"sweeps/1/09/{int(t0) - 7}", f"sweeps/64/03/{int(t0) // 64 - 3}"]
    for key in left:  # a period skipped (replicas stopped a while), a period length no longer in use
        assert objects[0].put_new(key, b"{}")
    async with durable_runtime(tmp_path / "a", objects[0], "share-a", sweep_interval_s=0.16) as a, \
            durable_runtime(tmp_path / "b", objects[1], "share-b", sweep_interval_s=0.16) as b:
        await asyncio.sleep(3.5)
        replicas = {id(a.residency), id(b.residency)}
    t1 = time.time()
    assert {who for who, _, _ in swept} == replicas, "both replicas swept some ranges"
    assert all(bounds is not None for _, bounds, _ in swept)
    periods = int(t1) - int(t0) + 1  # whole seconds the run touched: a range's claims at most one each
    for i in range(SHARDS):
        n = sum(1 for _, bounds, _ in swept if bounds == key_range(i))
        assert 1 <= n <= periods, (i, n, periods)
    claims = objects[0].keys("sweeps/")
    # per range, the current period's and the one before; a replica stopped between making a claim and
    # deleting the one of two periods back leaves that one too (at most one per replica)
    assert 0 < len(claims) <= 2 * SHARDS + 2, claims
    assert all(int(key.rsplit("/", 1)[1]) >= int(t1) - 2 for key in claims), claims
    assert not set(left) & set(claims), claims


async def test_a_range_reads_its_share_of_the_unknown(durable: DurableRuntime) -> None:
    """A sweep round of one range reads at most 1/SHARDS of SWEEP_UNKNOWN_READS of the sandboxes nothing
    is known of here (a whole pass of ranges then reads as many as one whole sweep did, not SHARDS times)."""
    d = durable
    base = await d.store.read((await d.create("python")).sandbox_id, 0)
    assert base is not None
    now = time.time()
    # ids past "sb-f": all in the last range
    write(d, [base.model_copy(update={"sandbox_id": f"sb-other{i:05d}", "created_at": now - 7200,
                                      "last_used": now - 7200, "limits": base.limits.model_copy(
                                          update={"idle_s": 60.0})}) for i in range(100)])
    before = gets(d)
    done = await d.sweep(key_range(SHARDS - 1))
    share = SWEEP_UNKNOWN_READS // SHARDS
    assert (done["sandboxes"], done["expired"], done["unread"]) == (100, share, 100 - share), done
    assert gets(d) - before == share
