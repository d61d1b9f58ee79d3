"""Snapshot and fork events end to end: real `rollbox serve` processes over HTTP, a real SeaweedFS.

Server A and server B share one S3 bucket and nothing else (separate processes, homes and caches):
what A checkpoints, B restores.
"""

from __future__ import annotations

import argparse
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
from rollbox.functions.client import Client, InternalError, Sandbox
from rollbox.functions.config.stores import StoreConfig
from rollbox.functions.contract.models import (
    MAX_FORK,
    SANDBOX_FORK,
    SANDBOX_FORKED,
    SANDBOX_SNAPSHOT,
    SANDBOX_SNAPSHOTTED,
    ForkRecord,
    SnapshotRecord,
)
from rollbox.functions.service.server import OPTIONS, ConfigError, resolve
from svc_testkit import ServerProc, event, send, start_server

from tests.snapshots.s3server import ACCESS_KEY, SECRET_KEY, SeaweedS3

PREFIX = "rollbox"
WRITE = "mkdir -p work/deep && echo alpha > a.txt && echo beta > work/deep/b.txt && chmod 640 a.txt"
READ = "cat a.txt work/deep/b.txt && stat -c '%a %U' a.txt"


def test_store_flags_mirror_env_and_are_cast_strictly() -> None:
    none = argparse.Namespace(**{o.dest: None for o in OPTIONS})
    assert resolve(none, {}).store == StoreConfig()  # the local store in the home
    env = {"ROLLBOX_STORE": "s3://bkt/p", "AWS_ENDPOINT_URL": "http://127.0.0.1:1", "ROLLBOX_CACHE_MAX_BYTES": "1024",
           "ROLLBOX_HOME": "/h", "ROLLBOX_S3_MAX_ATTEMPTS": "2"}
    cfg = resolve(none, env).store
    assert (cfg.store, cfg.s3_endpoint_url, cfg.cache_max_bytes, str(cfg.home), cfg.s3_max_attempts) == (
        "s3://bkt/p", "http://127.0.0.1:1", 1024, "/h", 2)
    flags = argparse.Namespace(**{**vars(none), "store": "/srv/snaps"})
    assert resolve(flags, env).store.store == "/srv/snaps"  # the flag wins
    for bad, needle in (({"ROLLBOX_STORE": "s3://"}, "ROLLBOX_STORE: invalid S3 store URL"),
                        ({"ROLLBOX_CACHE_MAX_BYTES": "1G"}, "ROLLBOX_CACHE_MAX_BYTES: not a valid integer"),
                        ({"ROLLBOX_S3_MAX_ATTEMPTS": "0"}, "ROLLBOX_S3_MAX_ATTEMPTS: must be >= 1")):
        with pytest.raises(ConfigError, match=needle):
            resolve(none, bad)


class Pair:
    def __init__(self, a: ServerProc, b: ServerProc, bucket: str, b_cache: Path):
        self.a, self.b, self.bucket, self.b_cache = a, b, bucket, b_cache


@pytest.fixture(scope="module")
def pair(seaweed: SeaweedS3, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    """Server A (endpoint from AWS_ENDPOINT_URL) and server B (from --s3-endpoint-url), one bucket."""
    bucket = seaweed.new_bucket()
    base = tmp_path_factory.mktemp("snap-serve")
    creds = {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_REGION": "us-east-1"}
    store = f"s3://{bucket}/{PREFIX}"
    a = start_server(
        base / "a",
        "--home",
        str(base / "a-home"),
        env={**creds, "ROLLBOX_STORE": store, "AWS_ENDPOINT_URL": seaweed.endpoint, "ROLLBOX_S3_MAX_ATTEMPTS": "2"},
    )
    try:
        b = start_server(
            base / "b",
            "--store",
            store,
            "--s3-endpoint-url",
            seaweed.endpoint,
            "--s3-max-attempts",
            "2",
            "--cache-dir",
            str(base / "b-cache"),
            "--cache-max-bytes",
            str(1 << 30),
            env={**creds, "ROLLBOX_HOME": str(base / "b-home")},
        )
    except BaseException:
        a.stop()
        raise
    try:
        yield Pair(a, b, bucket, base / "b-cache")
    finally:
        rcs = (a.stop(), b.stop())
    assert rcs == (0, 0), a.log_path.read_text()[-3000:] + b.log_path.read_text()[-3000:]


@pytest.fixture
async def clients(pair: Pair) -> AsyncIterator[tuple[Client, Client]]:
    async with Client(pair.a.url, retries=0) as a, Client(pair.b.url, retries=0) as b:
        yield a, b


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=httpx.Timeout(10.0, read=120.0)) as client:
        yield client


async def kill_all(*sandboxes: Sandbox) -> None:
    for sb in sandboxes:
        await sb.kill()


async def test_a_snapshot_taken_on_one_server_restores_on_another_with_an_empty_cache(
    pair: Pair, clients: tuple[Client, Client]
) -> None:
    ca, cb = clients
    sb = await ca.create(metadata={"episode": "portable"})
    try:
        assert (await sb.exec(command=WRITE)).exit_code == 0
        here = await sb.exec(command=READ)
        rec = await sb.snapshot(name="portable")
    finally:
        await sb.kill()
    assert isinstance(rec, SnapshotRecord) and rec.sandbox_id == sb.id and rec.name == "portable"
    assert rec.store == f"s3://{pair.bucket}/{PREFIX}" and rec.parent_id is not None
    assert rec.env_version == sb.info.env_version
    assert not (pair.b_cache / "layers" / rec.layer_id).exists()  # B has never seen it

    # B: by id, then by name; the same files (contents, modes, owner) and the same VERSION
    b1 = await cb.create(rec.snapshot_id)
    b2 = await cb.create("portable")
    try:
        assert b1.info.snapshot_id == b2.info.snapshot_id == rec.snapshot_id
        assert b1.info.env_version == b2.info.env_version == rec.env_version
        there = await b1.exec(command=READ)
        assert (there.exit_code, there.stdout) == (0, here.stdout) == (0, "alpha\nbeta\n640 sandbox\n")
        assert there.snapshot_id == rec.snapshot_id  # the step records what it started from
        assert (await b2.exec(command=READ)).stdout == here.stdout
        assert (pair.b_cache / "layers" / rec.layer_id).is_dir()  # pulled lazily into B's cache
        # a fork of it on B sees them too
        await b1.exec(command="echo gamma > c.txt")
        kids = await b1.fork(2)
        try:
            for kid in kids:
                r = await kid.exec(command=READ + " && cat c.txt")
                assert r.stdout == here.stdout + "gamma\n"
                assert kid.info.env_version == rec.env_version
        finally:
            await kill_all(*kids)
    finally:
        await kill_all(b1, b2)


async def test_snapshots_form_a_tree_and_restore_on_the_same_server(clients: tuple[Client, Client]) -> None:
    ca, _ = clients
    root = await ca.create()
    try:
        await root.exec(command="echo one > one.txt && echo keep > keep.txt")
        s1 = await root.snapshot()
    finally:
        await root.kill()
    child = await ca.create(s1.snapshot_id)
    try:
        r = await child.exec(command="cat one.txt keep.txt && rm one.txt && echo two > two.txt")
        assert r.stdout == "one\nkeep\n" and r.snapshot_id == s1.snapshot_id
        s2 = await child.snapshot(name="tree-leaf")
    finally:
        await child.kill()
    assert s2.parent_id == s1.snapshot_id and s2.snapshot_id != s1.snapshot_id
    assert s2.size_bytes == s1.size_bytes + s2.layer_bytes  # one more layer on its parent's
    leaf = await ca.create("tree-leaf")
    try:
        r = await leaf.exec(command="ls; cat keep.txt two.txt")
        assert r.stdout == "keep.txt\ntwo.txt\nkeep\ntwo\n", r.stderr  # one.txt stays deleted
    finally:
        await leaf.kill()
    # an unchanged sandbox still gives a child (with an empty diff), and twice the same one
    again = await ca.create(s1.snapshot_id)
    try:
        first, second = await again.snapshot(), await again.snapshot()
        assert first.parent_id == s1.snapshot_id and first.snapshot_id == second.snapshot_id
    finally:
        await again.kill()


async def test_forks_of_a_live_sandbox_see_its_files_and_are_isolated_afterwards(
    clients: tuple[Client, Client],
) -> None:
    ca, _ = clients
    parent = await ca.create(metadata={"experiment": "grpo"})
    await parent.exec(command="echo shared > s.txt")
    kids = await parent.fork(3)
    try:
        assert len({k.id for k in kids} | {parent.id}) == 4
        assert all(k.info.metadata == {"experiment": "grpo"} for k in kids)  # inherited
        for i, kid in enumerate(kids):
            r = await kid.exec(command=f"cat s.txt && echo {i} > mine.txt && echo {i} >> s.txt")
            assert (r.exit_code, r.stdout) == (0, "shared\n")
        await parent.exec(command="echo after > late.txt")
        for i, kid in enumerate(kids):
            r = await kid.exec(command="cat mine.txt s.txt; ls")
            assert r.stdout == f"{i}\nshared\n{i}\nmine.txt\ns.txt\n"  # no sibling's, no later parent's
        r = await parent.exec(command="cat s.txt; ls")
        assert r.stdout == "shared\nlate.txt\ns.txt\n"
        # a fork's own snapshot restores its files on top of what it was forked from
        rec = await kids[1].snapshot()
        again = await ca.create(rec.snapshot_id)
        try:
            assert (await again.exec(command="cat mine.txt s.txt")).stdout == "1\nshared\n1\n"
        finally:
            await again.kill()
    finally:
        await kill_all(*kids, parent)


async def test_fork_from_a_snapshot_id(clients: tuple[Client, Client]) -> None:
    ca, cb = clients
    sb = await ca.create()
    try:
        await sb.exec(command="echo from-snapshot > f.txt")
        rec = await sb.snapshot()
    finally:
        await sb.kill()
    kids = await cb.fork(snapshot=rec.snapshot_id, count=4, metadata={"episode": "g"})
    try:
        assert len({k.id for k in kids}) == 4
        for kid in kids:
            assert kid.info.snapshot_id == rec.snapshot_id and kid.info.metadata == {"episode": "g"}
            assert (await kid.exec(command="cat f.txt")).stdout == "from-snapshot\n"
        await kids[0].exec(command="echo x > f.txt")
        assert (await kids[1].exec(command="cat f.txt")).stdout == "from-snapshot\n"
    finally:
        await kill_all(*kids)


async def test_errors_name_the_problem(pair: Pair, http: httpx.AsyncClient) -> None:
    url = pair.a.url
    r = await send(http, url, event(SANDBOX_SNAPSHOT, {"sandbox_id": "sb-nope"}))
    assert (r.status, r.data["code"]) == (404, "sandbox_not_found") and "sb-nope" in r.data["message"]
    r = await send(http, url, event(SANDBOX_FORK, {"sandbox_id": "sb-nope", "count": 2}))
    assert (r.status, r.data["code"]) == (404, "sandbox_not_found")
    r = await send(http, url, event(SANDBOX_FORK, {"snapshot": "f" * 64, "count": 2}))
    assert (r.status, r.data["code"]) == (404, "snapshot_not_found")
    for count in (0, MAX_FORK + 1):
        r = await send(http, url, event(SANDBOX_FORK, {"snapshot": "python", "count": count}))
        assert (r.status, r.data["code"]) == (400, "invalid_data") and "count" in r.data["message"]
    for bad in ({"count": 1}, {"snapshot": "python", "sandbox_id": "sb-x"}):
        r = await send(http, url, event(SANDBOX_FORK, bad))
        assert r.status == 400 and "exactly one of" in r.data["message"]
    r = await send(http, url, event(SANDBOX_FORK, {"sandbox_id": "sb-x", "limits": {"pids_max": 64}}))
    assert r.status == 400 and "keep its limits" in r.data["message"]
    r = await send(http, url, event(SANDBOX_SNAPSHOT, {"sandbox_id": "sb-x", "name": "Bad Name"}))
    assert r.status == 400 and "name" in r.data["message"]


def _layer_key(layer_id: str) -> str:
    return f"{PREFIX}/layers/{layer_id}.tar"


async def test_a_corrupted_object_in_s3_is_refused_through_the_service(
    pair: Pair, seaweed: SeaweedS3, clients: tuple[Client, Client], http: httpx.AsyncClient
) -> None:
    ca, cb = clients
    sb = await ca.create()
    try:
        await sb.exec(command=f"echo {uuid.uuid4().hex} > unique.txt")
        rec = await sb.snapshot()
    finally:
        await sb.kill()
    s3 = seaweed.client()
    good = s3.get_object(Bucket=pair.bucket, Key=_layer_key(rec.layer_id))["Body"].read()
    bad = bytearray(good)
    bad[len(bad) // 3] ^= 0xFF
    s3.put_object(Bucket=pair.bucket, Key=_layer_key(rec.layer_id), Body=bytes(bad))
    try:
        r = await send(http, pair.b.url, event("dev.rollbox.sandbox.create", {"snapshot": rec.snapshot_id}))
        assert (r.status, r.data["code"]) == (502, "store_corrupt"), r.data
        assert rec.layer_id in r.data["message"] and "not used" in r.data["message"]
        with pytest.raises(InternalError, match="corrupt"):
            await cb.fork(snapshot=rec.snapshot_id, count=2)
        assert not (pair.b_cache / "layers" / rec.layer_id).exists()
        assert [p for p in (pair.b_cache / "tmp").iterdir()] == []  # the cache is left clean
    finally:
        s3.put_object(Bucket=pair.bucket, Key=_layer_key(rec.layer_id), Body=good)
    sb = await cb.create(rec.snapshot_id)  # repaired: the next request succeeds
    await sb.kill()


async def test_an_s3_outage_gives_a_clear_error_and_the_next_request_after_restart_succeeds(
    pair: Pair, seaweed: SeaweedS3, clients: tuple[Client, Client], http: httpx.AsyncClient
) -> None:
    ca, cb = clients
    sb = await ca.create()
    try:
        await sb.exec(command=f"echo {uuid.uuid4().hex} > during-outage.txt")
        seaweed.stop()  # a crash, by pid
        try:
            # the sandbox's state lives in S3 too (durable steps): nothing can be acknowledged now
            r = await send(http, pair.a.url, event(SANDBOX_SNAPSHOT, {"sandbox_id": sb.id}))
            assert (r.status, r.data["code"]) == (503, "store_unavailable"), r.data
            assert "unreachable" in r.data["message"] and r.headers["retry-after"]
            r = await send(http, pair.b.url, event("dev.rollbox.sandbox.create", {}))
            assert (r.status, r.data["code"]) == (503, "store_unavailable"), r.data
            # a one-shot run keeps no state: it does not need the store
            r = await send(http, pair.b.url, event("dev.rollbox.sandbox.run", {"code": "print(1)"}))
            assert (r.status, r.data["stdout"]) == (200, "1\n"), r.data
        finally:
            seaweed.start()
        r = await send(http, pair.a.url, event(SANDBOX_SNAPSHOT, {"sandbox_id": sb.id}))
        assert (r.status, r.type) == (200, SANDBOX_SNAPSHOTTED), r.data
        committed = r.data["snapshot_id"]
        r = await send(http, pair.b.url, event("dev.rollbox.sandbox.exec", {"sandbox_id": sb.id,
                                                                              "command": "cat during-outage.txt"}))
        assert r.status == 200 and len(r.data["stdout"].strip()) == 32, r.data  # the files from before the outage
    finally:
        await sb.kill()
    r = await send(http, pair.b.url, event(SANDBOX_FORK, {"snapshot": committed, "count": 2}))
    assert (r.status, r.type) == (200, SANDBOX_FORKED), r.data
    for info in ForkRecord.model_validate(r.data).sandboxes:
        await Sandbox(cb, info, owns_client=False).kill()
