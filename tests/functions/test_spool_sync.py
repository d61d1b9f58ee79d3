"""The spool's disk syncs: Linux AIO fdatasync reaped on the event loop, and the writer-thread fallback.

Real files on this machine's disk, a real event loop; nothing is faked.
"""

from __future__ import annotations

import asyncio
import errno
import os
import threading
from pathlib import Path

import orjson
import pytest
from rollbox.functions.aiosync import AsyncFsync
from rollbox.functions.recorder import Recorder
from rollbox.runtime.errors import StoreError
from rollbox.snapshots.state import LocalObjects


async def test_a_sync_completes_on_the_event_loop_thread(tmp_path: Path) -> None:
    loop = asyncio.get_running_loop()
    aio = AsyncFsync(loop)
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        os.write(fd, b"x" * 4096)
        done: asyncio.Future[tuple[int, int]] = loop.create_future()
        aio.sync(fd, lambda err: done.set_result((err, threading.get_ident())))
        assert aio.busy
        err, thread = await asyncio.wait_for(done, 10)
        assert (err, thread) == (0, threading.get_ident())
        assert not aio.busy
    finally:
        os.close(fd)
        aio.close()


async def test_a_sync_the_kernel_refuses_raises_naming_it(tmp_path: Path) -> None:
    aio = AsyncFsync(asyncio.get_running_loop())
    r, w = os.pipe()  # a pipe has no fsync
    try:
        with pytest.raises(OSError, match="io_submit") as info:
            aio.sync(w, lambda err: None)
        assert info.value.errno == errno.EINVAL
        assert not aio.busy
    finally:
        os.close(r)
        os.close(w)
        aio.close()


@pytest.mark.parametrize("aio", [True, False], ids=["aio", "thread"])
async def test_spooled_rows_are_on_disk_when_their_future_is_done_and_syncs_are_shared(
        tmp_path: Path, aio: bool) -> None:
    rec = Recorder(tmp_path / "spool", LocalObjects(tmp_path / "store"), "r1", aio=aio)
    await rec.start()
    try:
        assert (rec._aio is not None) == aio
        # 200 replies in one turn of the loop: written at once, far fewer syncs than replies
        futures = [rec.append([("step", {"event_id": f"e{i}", "status": 200})])[1] for i in range(200)]
        await asyncio.wait_for(asyncio.gather(*futures), 30)
        seg = rec._current
        assert seg is not None
        lines = seg.path.read_bytes().splitlines()
        assert [orjson.loads(line)["r"]["event_id"] for line in lines] == [f"e{i}" for i in range(200)]
        assert 1 <= rec.syncs <= 10, rec.syncs
        # a lone reply still gets its own sync
        before = rec.syncs
        _, fut = rec.append([("step", {"event_id": "late", "status": 200})])
        await asyncio.wait_for(fut, 10)
        assert rec.syncs == before + 1
        assert seg.path.read_bytes().endswith(b'"late","status":200}}\n')
    finally:
        assert await rec.close() == 201


async def test_a_local_commit_synced_on_the_loop_is_create_only_and_leaves_nothing_behind(tmp_path: Path) -> None:
    """The durable layer's local commits (``LocalObjects.put_new_synced`` through AIO fsync): the same
    create-only write as ``put_new``; a writer that stops waiting leaves no temporary file."""
    aio = AsyncFsync(asyncio.get_running_loop())
    store = LocalObjects(tmp_path / "store")
    key = "sandboxes/sb-1/0000000001.json"
    try:
        assert await store.put_new_synced(key, b"first", aio.synced) is True
        assert await store.put_new_synced(key, b"second", aio.synced) is False  # the name is taken
        assert store.put_new(key, b"third") is False  # and the thread's write agrees
        assert store.get(key) == b"first"
        assert store.put_new("sandboxes/sb-1/0000000002.json", b"next") is True
        assert await store.put_new_synced("sandboxes/sb-1/0000000003.json", b"", aio.synced) is True

        async def never(fd: int) -> None:  # a disk that does not answer: the caller's deadline ends it
            await asyncio.sleep(3600)

        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.05):
                await store.put_new_synced("sandboxes/sb-1/0000000004.json", b"late", never)
        assert store.get("sandboxes/sb-1/0000000004.json") is None
        assert sorted(p.name for p in (tmp_path / "store/sandboxes/sb-1").iterdir()) == \
            ["0000000001.json", "0000000002.json", "0000000003.json"]  # no temporary file left
        r, w = os.pipe()
        try:  # a sync the kernel refuses (of a pipe) fails the write, named
            with pytest.raises(StoreError, match="io_submit"):
                await store.put_new_synced("sandboxes/sb-1/0000000005.json", b"x", lambda fd: aio.synced(w))
        finally:
            os.close(r)
            os.close(w)
        assert sorted(p.name for p in (tmp_path / "store/sandboxes/sb-1").iterdir())[-1] == "0000000003.json"
        assert not aio.busy
    finally:
        aio.close()
