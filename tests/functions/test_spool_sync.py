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
