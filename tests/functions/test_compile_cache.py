"""The compile cache alone: what its key covers, one compile per key at a time, what is kept, the bound,
and sharing through the store's objects (a local directory here; S3 is the same interface)."""

from __future__ import annotations

import asyncio
import base64
import io
import tarfile
from pathlib import Path

import pytest
from rollbox.functions.handlers.compile_cache import CompileCache, Compiled, TimedOut, cache_key
from rollbox.functions.handlers.run_code import _members
from rollbox.snapshots.state import LocalObjects

from tests.snapshots.s3server import SeaweedS3, store_factory

OK = Compiled(0, "", "", 1.0, "QUJD")


def test_the_key_covers_language_toolchain_flags_and_every_file() -> None:
    base = cache_key("cpp", "snap1", "g++ main.cpp", {"main.cpp": b"int main(){}"})
    assert base == cache_key("cpp", "snap1", "g++ main.cpp", {"main.cpp": b"int main(){}"})
    others = {
        cache_key("c", "snap1", "g++ main.cpp", {"main.cpp": b"int main(){}"}),
        cache_key("cpp", "snap2", "g++ main.cpp", {"main.cpp": b"int main(){}"}),
        cache_key("cpp", "snap1", "g++ -O2 main.cpp", {"main.cpp": b"int main(){}"}),
        cache_key("cpp", "snap1", "g++ main.cpp", {"main.cpp": b"int main(){ }"}),
        cache_key("cpp", "snap1", "g++ main.cpp", {"main.cpp": b"int main(){}", "lib.jar": b"x"}),
        cache_key("cpp", "snap1", "g++ main.cpp", {"other.cpp": b"int main(){}"}),
    }
    assert base not in others and len(others) == 6


async def test_concurrent_requests_compile_once_and_go_on_when_the_compile_is_done() -> None:
    cache = CompileCache()
    compiles = 0
    release_run = asyncio.Event()

    async def compile_(done):  # type: ignore[no-untyped-def]
        nonlocal compiles
        compiles += 1
        await asyncio.sleep(0.05)
        await done(OK)
        await release_run.wait()  # the first request's own run: the others need not wait for it

    first = asyncio.create_task(cache.once("k", compile_))
    await asyncio.sleep(0.01)
    others = await asyncio.wait_for(asyncio.gather(*(cache.once("k", compile_) for _ in range(9))), 5)
    assert compiles == 1 and all(o == (OK, True) for o in others)
    release_run.set()
    assert await first == (OK, False)


async def test_a_compile_that_keeps_nothing_lets_each_waiter_compile() -> None:
    cache = CompileCache()
    calls = 0

    async def timed_out(done):  # type: ignore[no-untyped-def]
        nonlocal calls
        calls += 1
        await asyncio.sleep(0.02)
        await done(None)

    results = await asyncio.gather(*(cache.once("k", timed_out) for _ in range(3)))
    assert calls == 3 and results == [(None, False)] * 3

    async def raises(done):  # type: ignore[no-untyped-def]
        raise RuntimeError("sandbox fault")

    try:
        await cache.once("k2", raises)
    except RuntimeError:
        pass
    assert "k2" not in cache._inflight and await cache.get("k2") is None


async def test_the_waiters_of_a_compile_that_timed_out_get_its_timeout_instead_of_compiling_again() -> None:
    """verl's ten cases of one program on an overloaded machine: their one compile times out; the nine
    waiting for it answer that timeout (their compile timeout is the same) rather than compiling nine
    times more. A waiter allowed longer compiles on its own, and the timeout is not kept for later."""
    cache = CompileCache()
    calls = 0

    async def times_out(done):  # type: ignore[no-untyped-def]
        nonlocal calls
        calls += 1
        await asyncio.sleep(0.05)
        await done(TimedOut("the compile step, timed out", 10.0))

    first = asyncio.create_task(cache.once("k", times_out, 10.0))
    await asyncio.sleep(0.01)
    waiters = [cache.once("k", times_out, t) for t in (10.0,) * 8 + (5.0, 30.0)]
    results = await asyncio.wait_for(asyncio.gather(first, *waiters), 5)
    assert results[0] == (TimedOut("the compile step, timed out", 10.0), False)
    assert results[1:10] == [(TimedOut("the compile step, timed out", 10.0), True)] * 9
    assert results[10] == (TimedOut("the compile step, timed out", 10.0), False)  # 30 s: compiled itself
    assert calls == 2 and cache.shared_timeouts == 9
    assert await cache.once("k", times_out, 10.0) == (TimedOut("the compile step, timed out", 10.0), False)
    assert calls == 3 and await cache.get("k") is None  # not kept: the next wave compiles again


async def test_bounded_in_memory_and_shared_through_the_store(tmp_path: Path) -> None:
    small = CompileCache(max_bytes=3 * OK.size())
    for i in range(5):
        await small.put(f"k{i}", OK)
    assert [k for k in ("k0", "k1", "k2", "k3", "k4") if await small.get(k)] == ["k2", "k3", "k4"]
    objects = LocalObjects(tmp_path / "store")
    a, b = CompileCache(objects), CompileCache(objects)  # two replicas
    fail = Compiled(1, "", "main.cpp:1: error", 0.3)
    await a.put("key", fail)
    assert await b.get("key") == fail and (tmp_path / "store" / "compiled" / "key.json").is_file()


async def test_artifacts_over_the_bound_are_not_kept(tmp_path: Path) -> None:
    from rollbox.functions.handlers.compile_cache import MAX_ARTIFACT_BYTES

    for n in (0, 1, 2, 3, 1000):
        assert Compiled(0, "", "", 0.1, base64.b64encode(b"x" * n).decode()).artifact_bytes() == n
    cache = CompileCache(LocalObjects(tmp_path / "store"))
    under = Compiled(0, "", "", 1.0, base64.b64encode(bytes(MAX_ARTIFACT_BYTES - 1)).decode())
    over = Compiled(0, "", "", 1.0, base64.b64encode(bytes(MAX_ARTIFACT_BYTES)).decode())
    await cache.put("under", under)
    await cache.put("over", over)
    assert await cache.get("under") == under and await cache.get("over") is None
    assert not (tmp_path / "store" / "compiled" / "over.json").exists()


async def test_replicas_sharing_s3_compile_a_program_once(seaweed: SeaweedS3) -> None:
    """Two replicas (two caches on one SeaweedFS bucket) get cases of one program at once: one claims the
    compile in the store and makes it, the other waits for its outcome there instead of compiling too. A
    claim that goes without an outcome (a timeout) or that is stale (its replica died) lets the other
    claim it and compile."""
    import json
    import time

    from rollbox.snapshots.store_s3 import S3Objects

    url = f"s3://{seaweed.new_bucket()}/p"
    a, b = (CompileCache(S3Objects(store_factory(seaweed)(url))) for _ in range(2))
    compiles: list[str] = []

    def compiler(name: str, value: Compiled | TimedOut, took_s: float = 0.3):  # type: ignore[no-untyped-def]
        async def compile_(done):  # type: ignore[no-untyped-def]
            compiles.append(name)
            await asyncio.sleep(took_s)
            await done(value)
        return compile_

    got = await asyncio.wait_for(asyncio.gather(a.once("k", compiler("a", OK), 10.0),
                                                b.once("k", compiler("b", OK), 10.0)), 20)
    assert len(compiles) == 1 and sorted(cached for _, cached in got) == [False, True], (compiles, got)
    assert all(value == OK for value, _ in got) and a.from_replicas + b.from_replicas == 1
    assert a.objects is not None and a.objects.keys("compiled/") == ["compiled/k.json"]  # the claim is gone

    compiles.clear()  # the claimer's compile times out: the other, waiting, answers its timeout
    late = TimedOut({"stderr": "timed out"}, 10.0)
    got = await asyncio.wait_for(asyncio.gather(a.once("t", compiler("a", late), 10.0),
                                                b.once("t", compiler("b", late), 10.0)), 20)
    assert len(compiles) == 1 and sorted(cached for _, cached in got) == [False, True], (compiles, got)
    assert all(value == late for value, _ in got) and a.shared_timeouts + b.shared_timeouts == 1
    assert "compiled/t.timedout" in a.objects.keys("compiled/") and "compiled/t.json" not in a.objects.keys("compiled/")
    compiles.clear()  # a later request compiles again (a timeout depends on the load), and so does a
    first = asyncio.create_task(a.once("t", compiler("a", late), 10.0))  # waiter with more time than that
    for _ in range(200):                                                  # compile had
        if a.objects.get("compiled/t.claim") is not None:
            break
        await asyncio.sleep(0.02)
    got = [await asyncio.wait_for(b.once("t", compiler("b", OK), 30.0), 20), await first]
    assert compiles == ["a", "b"] and got == [(OK, False), (late, False)], (compiles, got)

    compiles.clear()  # a claim left by a replica that died an hour ago
    a.objects.put_new("compiled/s.claim", json.dumps({"replica": "dead:1", "since": time.time() - 3600,
                                                       "timeout_s": 10.0}).encode())
    assert await asyncio.wait_for(b.once("s", compiler("b", OK, 0.0), 10.0), 20) == (OK, False)
    assert compiles == ["b"]


def _tar(*members: tuple[str, bytes, int, bytes]) -> str:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data, mode, kind in members:
            info = tarfile.TarInfo(name)
            info.mode, info.type, info.size = mode, kind, len(data) if kind == tarfile.REGTYPE else 0
            info.linkname = data.decode() if kind == tarfile.SYMTYPE else ""
            tar.addfile(info, io.BytesIO(data) if kind == tarfile.REGTYPE else None)
    return base64.b64encode(buf.getvalue()).decode()


def test_cached_artifacts_are_written_as_files_unless_they_are_not_plain_files() -> None:
    """A cached run gets its artifacts as files its sandbox's agent writes (no base64 | tar processes in
    the sandbox); a tar holding anything else (a link, a path out of the home) is left to tar."""
    binary = bytes(range(256))
    files = _members(_tar(("main", binary, 0o755, tarfile.REGTYPE), ("Main$1.class", b"\xca\xfe", 0o644,
                                                                        tarfile.REGTYPE)))
    assert files == {"main": (base64.b64encode(binary).decode(), 0o755),
                     "Main$1.class": (base64.b64encode(b"\xca\xfe").decode(), 0o644)}
    assert _members(_tar(("main", b"/etc/passwd", 0o777, tarfile.SYMTYPE))) is None
    assert _members(_tar(("../main", b"x", 0o755, tarfile.REGTYPE))) is None
    assert _members(_tar(("/tmp/main", b"x", 0o755, tarfile.REGTYPE))) is None
    assert _members("not base64!") is None


async def test_a_claim_whose_replica_was_killed_is_taken_over_in_seconds_while_a_live_ones_is_waited_for(
        seaweed: SeaweedS3, monkeypatch: pytest.MonkeyPatch) -> None:
    """A replica killed (SIGKILL) while holding a compile claim leaves it in the store, fresh: the others
    used to wait its compile timeout + 30 s (40 s by default) before compiling; its beat stopped with it,
    so they take over after CLAIM_DEAD_S (shortened here). A replica alive and compiling for longer than
    that beats meanwhile and is waited for (one compile)."""
    import json
    import time

    from rollbox.functions.handlers import compile_cache
    from rollbox.snapshots.store_s3 import S3Objects

    monkeypatch.setattr(compile_cache, "CLAIM_BEAT_S", 0.2, raising=False)  # (absent: no beat)
    monkeypatch.setattr(compile_cache, "CLAIM_DEAD_S", 1.0, raising=False)
    url = f"s3://{seaweed.new_bucket()}/p"
    a, b = (CompileCache(S3Objects(store_factory(seaweed)(url))) for _ in range(2))
    compiles: list[str] = []

    def compiler(name: str, took_s: float):  # type: ignore[no-untyped-def]
        async def compile_(done):  # type: ignore[no-untyped-def]
            compiles.append(name)
            await asyncio.sleep(took_s)
            await done(OK)
        return compile_

    assert a.objects is not None  # a claim made a moment ago by a replica killed right after
    a.objects.put_new("compiled/d.claim", json.dumps({"replica": "killed:1", "since": time.time(),
                                                       "timeout_s": 10.0}).encode())
    t0 = time.monotonic()
    assert await asyncio.wait_for(b.once("d", compiler("b", 0.0), 10.0), 8) == (OK, False)
    assert compiles == ["b"] and time.monotonic() - t0 < 8

    compiles.clear()  # a live replica's compile that takes 2.5 s (> CLAIM_DEAD_S): waited for, not redone
    first = asyncio.create_task(a.once("l", compiler("a", 2.5), 10.0))
    await asyncio.sleep(0.3)
    assert await asyncio.wait_for(b.once("l", compiler("b", 0.0), 10.0), 20) == (OK, True)
    assert await first == (OK, False) and compiles == ["a"]
    assert a.objects.keys("compiled/") == ["compiled/d.json", "compiled/l.json"]  # no claim, no beat left


async def test_a_request_cancelled_while_waiting_for_another_replicas_compile_leaves_no_key_stuck(
        tmp_path: Path) -> None:
    """A request waiting for another replica's claimed compile is cancelled (the server's grace period
    over): the key was left in flight for ever, so every later request for that program on this replica
    waited on it; now they compile (the claim gone) and the cancelled one's local waiters go on."""
    import json
    import time

    objects = LocalObjects(tmp_path / "store")
    cache = CompileCache(objects)
    objects.put_new("compiled/k.claim", json.dumps({"replica": "other:1", "since": time.time(),
                                                    "timeout_s": 10.0}).encode())

    async def compile_(done):  # type: ignore[no-untyped-def]
        await done(OK)

    waiting = asyncio.create_task(cache.once("k", compile_, 10.0))
    local = asyncio.create_task(cache.once("k", compile_, 10.0))  # the same program's next case, here
    await asyncio.sleep(0.3)
    waiting.cancel()
    objects.delete(["compiled/k.claim"])  # (the other replica's compile went without an outcome)
    assert await asyncio.wait_for(local, 5) == (OK, False)
    assert await asyncio.wait_for(cache.once("k", compile_, 10.0), 5) == (OK, True)


async def test_a_beat_absent_for_a_moment_while_rewritten_is_not_taken_for_a_dead_replica(
        seaweed: SeaweedS3, monkeypatch: pytest.MonkeyPatch) -> None:
    """A beat is rewritten as delete + create: a waiter polling in between sees no beat. Its replica is
    alive (the waiter saw its beat a moment before), so the waiter keeps waiting for its compile rather
    than judging the claim by its creation alone (older than CLAIM_DEAD_S in a long compile) and
    compiling too."""
    import json
    import time

    from rollbox.functions.handlers import compile_cache
    from rollbox.snapshots.store_s3 import S3Objects

    monkeypatch.setattr(compile_cache, "CLAIM_DEAD_S", 1.0)
    url = f"s3://{seaweed.new_bucket()}/p"
    a, b = (CompileCache(S3Objects(store_factory(seaweed)(url))) for _ in range(2))
    assert a.objects is not None
    a.objects.put_new("compiled/k.claim", json.dumps({"replica": "a:1", "since": time.time() - 60,
                                                       "timeout_s": 120.0}).encode())
    a.objects.put_new("compiled/k.beat", json.dumps({"beat": time.time()}).encode())
    compiles: list[str] = []

    async def compile_(done):  # type: ignore[no-untyped-def]
        compiles.append("b")
        await done(OK)

    waiting = asyncio.create_task(b.once("k", compile_, 120.0))
    await asyncio.sleep(0.3)
    a.objects.delete(["compiled/k.beat"])  # the rewrite's gap, held long enough for b to poll in it
    await asyncio.sleep(0.6)
    a.objects.put_new("compiled/k.beat", json.dumps({"beat": time.time()}).encode())
    await a.put("k", OK)  # a's compile lands, its claim goes
    a.objects.delete(["compiled/k.claim", "compiled/k.beat"])
    assert await asyncio.wait_for(waiting, 10) == (OK, True) and compiles == []


def _waiting_on_a_claim(seaweed: SeaweedS3, replicas: int, holder: str):  # type: ignore[no-untyped-def]
    """``replicas`` caches on one SeaweedFS bucket, a claim of key ``k`` by ``holder`` made just now, and a
    compiler per cache (0.5 s, then OK) that notes its index in ``compiles``."""
    import json
    import time

    from rollbox.snapshots.store_s3 import S3Objects

    url = f"s3://{seaweed.new_bucket()}/p"
    caches = [CompileCache(S3Objects(store_factory(seaweed)(url))) for _ in range(replicas)]
    objects = caches[0].objects
    assert objects is not None
    objects.put_new("compiled/k.claim", json.dumps({"replica": holder, "since": time.time(),
                                                    "timeout_s": 10.0}).encode())
    compiles: list[int] = []

    def compiler(i: int):  # type: ignore[no-untyped-def]
        async def compile_(done):  # type: ignore[no-untyped-def]
            compiles.append(i)
            await asyncio.sleep(0.5)
            await done(OK)
        return compile_

    return caches, objects, compiles, compiler


async def test_replicas_waiting_for_a_dead_replicas_claim_compile_once_between_them(
        seaweed: SeaweedS3, monkeypatch: pytest.MonkeyPatch) -> None:
    """Three replicas wait for the compile a killed replica claimed: the one that finds it dead claims it
    again and compiles, the others wait for that one (they each compiled, at once, unclaimed)."""
    from rollbox.functions.handlers import compile_cache

    monkeypatch.setattr(compile_cache, "CLAIM_DEAD_S", 1.0)
    caches, objects, compiles, compiler = _waiting_on_a_claim(seaweed, 3, "killed:1")
    got = await asyncio.wait_for(asyncio.gather(*(c.once("k", compiler(i), 10.0) for i, c in enumerate(caches))), 20)
    assert len(compiles) == 1 and sorted(cached for _, cached in got) == [False, True, True], (compiles, got)
    assert objects.keys("compiled/") == ["compiled/k.json"]


async def test_replicas_waiting_for_a_claim_gone_without_an_outcome_compile_once_between_them(
        seaweed: SeaweedS3) -> None:
    """Two replicas wait for another's claimed compile, which goes without an outcome (it timed out, or a
    waiter took a dead replica's claim over: deleted, then claimed again): one of them claims it and
    compiles, the other waits for that one (they each compiled, unclaimed, at once)."""
    caches, objects, compiles, compiler = _waiting_on_a_claim(seaweed, 2, "other:1")
    waiting = asyncio.gather(*(c.once("k", compiler(i), 10.0) for i, c in enumerate(caches)))
    await asyncio.sleep(0.5)
    assert compiles == []  # both wait for the claim
    objects.delete(["compiled/k.claim"])
    got = await asyncio.wait_for(waiting, 20)
    assert len(compiles) == 1 and sorted(cached for _, cached in got) == [False, True], (compiles, got)
    assert objects.keys("compiled/") == ["compiled/k.json"]


async def test_a_replica_whose_compile_claim_was_taken_over_leaves_the_new_owners_claim(tmp_path: Path) -> None:
    """Replica A claims a compile; while it compiles, another replica takes the claim over (A's beat looked
    dead to it). A's compile lands, and its release leaves the new owner's claim in the store."""
    import json

    objects = LocalObjects(tmp_path / "store")
    a = CompileCache(objects)
    theirs = json.dumps({"replica": "b:2", "since": 0.0, "timeout_s": 10.0}).encode()
    seen: list[bytes | None] = []

    async def compile_(done):  # type: ignore[no-untyped-def]
        seen.append(objects.get("compiled/k.claim"))
        objects.delete(["compiled/k.claim"])
        assert objects.put_new("compiled/k.claim", theirs)
        await done(OK)

    assert await a.once("k", compile_, 10.0) == (OK, False)
    assert seen and json.loads(seen[0] or b"{}")["replica"] == a.replica
    assert objects.get("compiled/k.claim") == theirs and objects.get("compiled/k.json") is not None
