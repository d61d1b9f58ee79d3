"""What a replica's store layer keeps of what it saw (``rollbox.functions.durable.store``): the newest
record of each recent sandbox, and when a step may run on it without reading first."""

from __future__ import annotations

import hashlib
import random
from pathlib import Path

from rollbox.functions.durable.store import StateStore
from rollbox.runtime.spec import Limits
from rollbox.snapshots.state import LocalObjects, SandboxRecord


def test_behind_a_balancer_without_affinity_a_replica_does_not_come_to_trust_what_it_saw(tmp_path: Path) -> None:
    """Behind a round-robin balancer half a replica's steps find their sandbox moved on by another: a
    step that trusted what it saw would run twice that often, so runs of luck (a few steps in a row
    that found nothing newer) must not make it trust. With affinity (nothing ever moved on) it trusts
    soon, and stops at the first step that finds it was behind."""
    store = StateStore(LocalObjects(tmp_path))
    try:
        rng = random.Random(7)
        trusted = 0
        for _ in range(20_000):
            trusted += store.trusts_seen()
            store.note_behind(rng.random() < 0.5)
        assert trusted < 20, trusted  # (the estimate over ~5 steps it replaced trusted 6 % of the time)
        for _ in range(100):
            store.note_behind(False)
        assert store.trusts_seen()
        store.note_behind(True)
        assert not store.trusts_seen()
    finally:
        store.close()


def _record(i: int, generation: int = 0) -> SandboxRecord:
    content = f"state of {i}\n".encode()
    return SandboxRecord(sandbox_id=f"sb-{i:020x}", generation=generation, snapshot="python", limits=Limits(),
                         metadata={"episode": str(i)}, created_at=1e9 + i, last_used=1e9 + i,
                         inline={hashlib.sha256(content).hexdigest(): content})


def test_the_newest_record_seen_of_a_hundred_thousand_sandboxes_is_kept_as_stored(tmp_path: Path) -> None:
    """A step on a sandbox this replica saw last reads only the generation after it, if the record
    itself is still kept: trainers thinking for minutes come back after ~100,000 other sandboxes'
    steps. The records are kept as stored (a few KB each, bounded in bytes, the oldest going first) and
    each use gets its own copy, equal to what was remembered."""
    store = StateStore(LocalObjects(tmp_path))
    try:
        n = 100_000
        for i in range(n):
            store.remember(_record(i))
        assert len(store.seen) == n and store.seen_bytes == sum(map(len, store.seen.values()))
        assert store.seen_bytes <= store.seen_max_bytes
        first, again = store.seen_record(_record(0).sandbox_id), store.seen_record(_record(0).sandbox_id)
        assert first == again == _record(0) and first is not again and first.inline == _record(0).inline
        store.remember(_record(5, generation=3))  # a newer generation replaces the one kept
        assert store.seen_record(_record(5).sandbox_id) == _record(5, generation=3) and len(store.seen) == n
        store.seen_max_bytes = store.seen_bytes // 2  # past the bound: the oldest go first
        store.remember(_record(n))
        assert store.seen_bytes <= store.seen_max_bytes
        assert store.seen_record(_record(0).sandbox_id) is None
        assert store.seen_record(_record(n).sandbox_id) == _record(n)
        assert store.seen_record(_record(5).sandbox_id) is not None  # (remembered again: among the newest)
        store.forget(_record(n).sandbox_id)
        assert store.seen_record(_record(n).sandbox_id) is None
        assert store.seen_bytes == sum(map(len, store.seen.values()))
    finally:
        store.close()
