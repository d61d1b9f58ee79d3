"""The spool's disk syncs: Linux AIO fdatasync reaped on the event loop, and the writer-thread fallback;
and the spool's robustness: any row can be spooled, one bad row, an unsettled commit or a full disk
never holds up the others.

Real files on this machine's disk (and a real tmpfs that fills up), a real event loop; nothing is faked.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
from rollbox.functions.analysis.trajectories import read
from rollbox.functions.recording.aiosync import AsyncFsync
from rollbox.functions.recording.recorder import Recorder, spool_line
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
        assert (rec.spool.aio is not None) == aio
        # 200 replies in one turn of the loop: written at once, far fewer syncs than replies
        futures = [rec.append([("step", {"event_id": f"e{i}", "status": 200})])[1] for i in range(200)]
        await asyncio.wait_for(asyncio.gather(*futures), 30)
        seg = rec.spool.current
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


# -- one row never holds up the others ---------------------------------------------------------------

def _row(i: int | str, **more: object) -> dict[str, object]:
    return {"event_id": f"e{i}", "event_source": "/t", "event_type": "dev.rollbox.sandbox.run", "status": 200,
            "event_time": 1.0, "recorded_at": 1.0, "experiment": "spool-test", **more}


def test_any_row_can_be_spooled() -> None:
    """What orjson refuses (a lone surrogate, an integer past 64 bits) is still one JSON line."""
    for row in ({"stdout": "a\ud800b", "\udc00key": 1}, {"exit_code": 2**70}, {"wall_s": float("nan")}):
        line = spool_line("step", row)
        assert line.endswith(b"\n") and line.count(b"\n") == 1
        assert orjson.loads(line)["k"] == "step"
    assert orjson.loads(spool_line("step", {"stdout": "a\ud800b"}))["r"]["stdout"] == "a\ufffdb"


async def test_a_row_the_parquet_writer_refuses_is_set_aside_and_the_rest_written(tmp_path: Path) -> None:
    store = LocalObjects(tmp_path / "store")
    rec = Recorder(tmp_path / "spool", store, "r1")
    await rec.start()
    try:
        futures = [rec.append([("step", row)])[1] for row in (
            _row(1), _row(2, stdout="lone \ud800 surrogate"), _row(3, exit_code=2**70), _row(4, status="abc"),
            _row(5))]
        await asyncio.wait_for(asyncio.gather(*futures), 30)  # every one spooled
        assert await rec.flush() == 5
    finally:
        await rec.close()
    table = read("trajectories", store, experiment="spool-test")
    got = dict(zip(table.column("event_id").to_pylist(), table.column("stdout").to_pylist(), strict=True))
    assert got == {"e1": None, "e2": "lone \ufffd surrogate", "e5": None}
    rejected = [k for k in store.keys("rejected/") if k.startswith("rejected/step/")]
    assert len(rejected) == 1
    lines = [orjson.loads(x)["r"] for x in store.get(rejected[0]).splitlines()]  # type: ignore[union-attr]
    assert [r["event_id"] for r in lines] == ["e3", "e4"] and rec.metrics.rejected == 2


async def test_rows_waiting_for_a_commit_do_not_hold_up_other_segments_or_the_drain(tmp_path: Path) -> None:
    """A segment whose rows wait for a durable commit that never settles is kept for later; the
    segments after it are written meanwhile, and the drain does not wait past its bound (it waited
    30 s and flushed none of them)."""
    store = LocalObjects(tmp_path / "store")
    rec = Recorder(tmp_path / "spool", store, "r1")
    await rec.start()
    _, fut = rec.append([("step", _row("pending"))], pending=("sb-x", 1))
    await fut
    assert await rec.flush(settle_wait_s=0.1) == 0  # its segment is closed, and kept
    _, fut = rec.append([("step", _row("later"))])
    await fut
    t0 = time.monotonic()
    assert await rec.close(settle_wait_s=0.2) == 1  # the later segment: written
    assert time.monotonic() - t0 < 5
    assert read("trajectories", store, experiment="spool-test").column("event_id").to_pylist() == ["elater"]
    kept = list((tmp_path / "spool").glob("*.jsonl"))
    assert len(kept) == 1 and b'"epending"' in kept[0].read_bytes()  # for the next start, which asks the store


@pytest.fixture
def tiny_disk(tmp_path: Path) -> Iterator[Path]:
    """A 4 MiB tmpfs (a real filesystem that fills up), unmounted after the test."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.mark.parametrize("aio", [True, False], ids=["aio", "thread"])
async def test_a_write_the_disk_refuses_is_cut_back_and_its_rows_dropped(tmp_path: Path, tiny_disk: Path,
                                                                         aio: bool) -> None:
    """The spool's disk is full: the rows of the refused write fail their future (the service answers
    507), are cut back off the segment (no torn line to swallow the next one after a crash) and are
    not flushed; ``disk_full`` says so until there is room; the rows before and after are kept."""
    store = LocalObjects(tmp_path / "store")
    rec = Recorder(tiny_disk / "spool", store, "r1", aio=aio)
    rec.min_free_bytes = 0
    await rec.start()
    try:
        _, fut = rec.append([("step", _row("before"))])
        await fut
        seg = rec.spool.current
        assert seg is not None and rec.disk_full is None
        size = seg.path.stat().st_size
        filler = tiny_disk / "filler"
        with open(filler, "wb", buffering=0) as f, contextlib.suppress(OSError):
            while True:
                f.write(b"\0" * 65536)
        _, fut = rec.append([("step", _row("refused", stdout="x" * 200_000)), ("usage", {"billed_s": 1})])
        with pytest.raises(OSError) as info:
            await asyncio.wait_for(fut, 30)
        assert info.value.errno == errno.ENOSPC
        assert rec.disk_full is not None and "No space left" in rec.disk_full
        assert seg.path.stat().st_size == size  # cut back: only the row before
        assert rec.metrics.dropped == 2
        filler.unlink()
        rec.check_disk()
        assert rec.disk_full is None
        _, fut = rec.append([("step", _row("after"))])
        await fut
        assert seg.path.read_bytes().count(b"\n") == 2
        assert await rec.flush() == 2
    finally:
        await rec.close()
    ids = read("trajectories", store, experiment="spool-test").column("event_id").to_pylist()
    assert sorted(ids) == ["eafter", "ebefore"]


FLUSH_WITHOUT_PANDAS = """
import asyncio, json, sys
from pathlib import Path
from rollbox.functions.recording.recorder import Recorder
from rollbox.snapshots.state import LocalObjects

async def main(tmp: Path) -> None:
    store = LocalObjects(tmp / "store")
    rec = Recorder(tmp / "spool", store, "r1")
    await rec.start()
    try:
        day = 86400.0
        rows = [{"event_id": f"e{i}", "event_source": "/t", "event_type": "dev.rollbox.sandbox.run", "status": 200,
                 "event_time": t, "recorded_at": t, **({"experiment": exp} if exp else {})}
                for i, (exp, t) in enumerate([("a/b", 1.0), ("a/b", 2.0), ("a/b", 1.0 + day), ("c", 1.0), (None, 1.0)])]
        await asyncio.gather(*(rec.append([("step", r)])[1] for r in rows))
        assert await rec.flush() == len(rows)
    finally:
        await rec.close()
    print(json.dumps({"keys": sorted(store.keys("trajectories/")), "pandas": "pandas" in sys.modules}))

asyncio.run(main(Path(sys.argv[1])))
"""


def test_a_flush_writes_one_file_per_experiment_and_date_without_loading_pandas(tmp_path: Path) -> None:
    """pyarrow imports pandas (when installed: ~0.18 s of CPU and ~40 MiB of every replica) as soon as a
    Python value meets it as a scalar or Table.group_by runs; the spool's writer gives it Arrow scalars
    and groups by one key column. In a fresh process, as a replica flushes: rows of an experiment with a
    "/" in its name on two dates, of another, and of none (the default)."""
    import json
    import sys

    out = subprocess.run([sys.executable, "-c", FLUSH_WITHOUT_PANDAS, str(tmp_path)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    folders = [k.rsplit("/", 1)[0] for k in got["keys"]]
    assert folders == ["trajectories/experiment=a%2Fb/date=1970-01-01", "trajectories/experiment=a%2Fb/date=1970-01-02",
                       "trajectories/experiment=c/date=1970-01-01", "trajectories/experiment=default/date=1970-01-01"]
    assert got["pandas"] is False
    rows = read("trajectories", LocalObjects(tmp_path / "store"), experiment="a/b")
    assert sorted(rows.column("event_id").to_pylist()) == ["e0", "e1", "e2"]
