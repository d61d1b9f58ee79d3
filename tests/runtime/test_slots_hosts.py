"""Host uids are unique across the processes of a host: two OS processes handing out uids from the
same ``--uid-range`` (two servers, a server and a CLI run) never give their sandboxes the same uid,
and a dead process's uids go to the next process (runtime/slots.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from rollbox.runtime.runtime import RuntimeConfig
from rollbox.runtime.slots import parse_range

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="owning a user namespace by another uid needs root")

START = parse_range(RuntimeConfig().uid_range)[0]  # type: ignore[index]

# Acquires N slots from UserSlots(START, COUNT, batch=BATCH) over LOCK_DIR, prints their uids (and
# checks each namespace's owner is that uid), then holds them until its stdin closes.
HOLDER = """
import asyncio, sys
from rollbox.runtime.inside import probe
from rollbox.runtime.slots import UserSlots
start, count, batch, n, lock_dir = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
async def main():
    slots = UserSlots(start, count, batch=batch, lock_dir=lock_dir)
    try:
        got = [await slots.acquire() for _ in range(n)]
    except Exception as exc:
        print("error", exc, flush=True)
    else:
        assert all(probe.userns_owner(f"/proc/self/fd/{s.fd}") == s.uid for s in got)
        print(" ".join(str(s.uid) for s in got), flush=True)
    await asyncio.to_thread(sys.stdin.read)
    slots.close()
asyncio.run(main())
"""


def holder(lock_dir: Path, n: int, count: int = 8, batch: int = 2) -> tuple[subprocess.Popen[str], list[int] | str]:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(START), str(count), str(batch), str(n), str(lock_dir)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    return proc, (line if line.startswith("error") or not line else [int(u) for u in line.split()])


def stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=10)
    for f in (proc.stdin, proc.stdout):
        if f is not None and not f.closed:
            f.close()


def test_two_processes_get_disjoint_uids_and_a_dead_ones_go_to_the_next(tmp_path: Path) -> None:
    procs = []
    try:
        a, a_uids = holder(tmp_path, 3)  # takes two batches of 2: START..START+3
        procs.append(a)
        b, b_uids = holder(tmp_path, 3)
        procs.append(b)
        assert isinstance(a_uids, list) and isinstance(b_uids, list), (a_uids, b_uids)
        assert not set(a_uids) & set(b_uids), (a_uids, b_uids)
        assert all(START <= u < START + 8 for u in a_uids + b_uids), (a_uids, b_uids)
        # the range is used up while both live: a third process finds no uid
        c, c_out = holder(tmp_path, 1)
        procs.append(c)
        assert isinstance(c_out, str) and "no free uid" in c_out, c_out
        stop(c)
        # a dies without closing: the kernel drops its claims and a new process gets its uids
        stop(a)
        d, d_uids = holder(tmp_path, 3)
        procs.append(d)
        assert isinstance(d_uids, list) and set(d_uids) <= {START, START + 1, START + 2, START + 3}, (a_uids, d_uids)
        assert not set(d_uids) & set(b_uids), (b_uids, d_uids)
    finally:
        for p in procs:
            stop(p)
