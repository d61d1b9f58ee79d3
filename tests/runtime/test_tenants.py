"""Tenants cannot use up each other's per-user kernel budgets: as root every live sandbox is in a
user namespace owned by a host uid of its own (runtime/slots.py), so the kernel counts its
processes (RLIMIT_NPROC), inotify instances, message queues and pending signals apart from every
other sandbox's; where its layers take idmapped mounts (ext4 and tmpfs here) its processes also run
as that host uid, so pipe buffers and keyrings are its own too, while files keep uid 1000."""

from __future__ import annotations

import asyncio
import io
import os
import tarfile
from pathlib import Path

import pytest
from rollbox.runtime.inside import probe
from rollbox.runtime.runtime import Runtime, RuntimeConfig
from rollbox.runtime.slots import parse_range
from rollbox.runtime.spec import ExecRequest, ExecResult, Limits
from rollbox.snapshots.layers import pack

pytestmark = pytest.mark.asyncio(loop_scope="module")

ROOTLESS = os.geteuid() != 0
as_root = pytest.mark.skipif(ROOTLESS, reason="rootless sandboxes' namespaces all have the caller as owner")

# Holds every inotify instance it can get, says how many and why it stopped, then waits.
INOTIFY_HOG = """
import ctypes, time
libc = ctypes.CDLL(None, use_errno=True)
n = 0
while libc.inotify_init1(0) >= 0:
    n += 1
open("/tmp/held", "w").write(f"{n} {ctypes.get_errno()}")
time.sleep(60)
"""
# Sizes pipes to 1 MiB until the kernel refuses (its per-user pipe buffer budget, fs.pipe-user-pages-soft),
# says how many and why it stopped, then holds them.
PIPE_HOG = """
import fcntl, os, time
held, errno = [], 0
while True:
    r, w = os.pipe()
    held.append((r, w))
    try:
        fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, 1 << 20)
    except OSError as exc:
        errno = exc.errno
        break
open("/tmp/held", "w").write(f"{len(held)} {errno}")
time.sleep(60)
"""
PIPE_ONE = """
import fcntl, os
r, w = os.pipe()
print(fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, 1 << 20))
"""
INOTIFY_ONE = """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
fd = libc.inotify_init1(0)
print(fd >= 0, ctypes.get_errno())
"""
FORK_4 = "sleep 0.5 & sleep 0.5 & sleep 0.5 & sleep 0.5 & wait && echo ok"
FORK_BOMB = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"


def ns_owner(pid: int) -> int:
    """The host uid owning the user namespace of a process, read from the host."""
    return probe.userns_owner(f"/proc/{pid}/ns/user")


def host_uid(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Uid:"):
            return int(line.split()[1])
    raise AssertionError("no Uid line")


@as_root
async def test_live_sandboxes_never_share_a_namespace_owner(rt: Runtime) -> None:
    start, count = parse_range(rt.config.uid_range) or (0, 0)
    infos = [await rt.create() for _ in range(6)]
    try:
        pids = [rt.sandboxes[i.sandbox_id].pid for i in infos]
        owners = [ns_owner(pid) for pid in pids]
        assert len(set(owners)) == len(owners) and all(start <= o < start + count for o in owners), owners
        # the processes run as that host uid (uid 1000 inside), checked from the host
        assert [host_uid(pid) for pid in pids] == owners, (owners, [host_uid(pid) for pid in pids])
        # (the probe that chose this wrote nothing into the layer store, where every entry is a layer)
        assert all(not p.name.startswith(".") for p in rt.layer_root.iterdir()), list(rt.layer_root.iterdir())
        # files keep their owners inside: the sandbox's home is its own, the system's files root's
        r = await rt.exec(infos[0].sandbox_id, ExecRequest(command="id -u; stat -c %u ~ /usr/bin; touch ~/f && echo w"))
        assert r.stdout.split() == ["1000", "1000", "0", "w"], r
    finally:
        for i in infos:
            await rt.destroy(i.sandbox_id)


async def hold_in_one_then_try_another(rt: Runtime, hog_code: str, try_code: str) -> tuple[tuple[int, int], ExecResult]:
    """Runs ``hog_code`` in the background of one sandbox until it wrote "<count> <errno>" to /tmp/held
    (it took all it could get), then ``try_code`` in another sandbox: (count, errno), that step's result."""
    hog, other = await rt.create(), await rt.create()
    try:
        await rt.exec(hog.sandbox_id, ExecRequest(command=f"python3 -c '{hog_code}' >/dev/null 2>&1 &"))
        held = ""
        for _ in range(200):
            held = (await rt.exec(hog.sandbox_id, ExecRequest(command="cat /tmp/held 2>/dev/null"))).stdout
            if held:
                break
            await asyncio.sleep(0.05)
        n, errno = map(int, held.split())
        return (n, errno), await rt.exec(other.sandbox_id, ExecRequest(code=try_code))
    finally:
        await rt.destroy(hog.sandbox_id)
        await rt.destroy(other.sandbox_id)


async def test_a_sandbox_holding_every_inotify_instance_leaves_the_others_theirs(rt: Runtime) -> None:
    """As root the hog's budget is its own uid's; rootless, where every sandbox's namespace hangs off
    the caller's, its own namespace caps it at a share of the caller's (runtime/isolation/users.py)."""
    (n, errno), r = await hold_in_one_then_try_another(rt, INOTIFY_HOG, INOTIFY_ONE)
    assert n > 0 and errno == 24, (n, errno)  # EMFILE: it took every instance its budget allows
    if ROOTLESS:  # its cap, far below the caller's budget (in this suite the caller runs nothing else)
        assert n == rt.user_budgets.get("max_inotify_instances"), (n, rt.user_budgets)
    assert r.stdout.split() == ["True", "0"], r  # and the other sandbox still gets one of its own


@pytest.mark.skipif(not ROOTLESS, reason="as root every sandbox has budgets of its own uid")
async def test_rootless_a_sandbox_reads_its_share_and_cannot_raise_it(rt: Runtime) -> None:
    share = rt.user_budgets["max_inotify_instances"]
    info = await rt.create()
    try:
        r = await rt.exec(info.sandbox_id, ExecRequest(command=(
            "cat /proc/sys/user/max_inotify_instances; echo 100000 > /proc/sys/user/max_inotify_instances"
            " 2>/dev/null && echo raised;"
            " python3 -c 'import resource; print(resource.getrlimit(resource.RLIMIT_MSGQUEUE)[0])'")))
        assert r.stdout.split() == [str(share), str(rt.user_budgets["RLIMIT_MSGQUEUE"])], r
    finally:
        await rt.destroy(info.sandbox_id)


@as_root
async def test_a_sandbox_holding_every_pipe_buffer_it_can_get_leaves_the_others_theirs(rt: Runtime) -> None:
    (n, errno), r = await hold_in_one_then_try_another(rt, PIPE_HOG, PIPE_ONE)
    assert n > 1 and errno == 1, (n, errno)  # EPERM: its budget of pipe buffers is used up
    assert r.exit_code == 0 and r.stdout == f"{1 << 20}\n", r  # the other sandbox still sizes a pipe to 1 MiB


async def test_without_cgroups_64_sandboxes_fork_their_children_beside_a_fork_bomb(tmp_path: Path) -> None:
    """RLIMIT_NPROC, the only process limit without cgroups, counts per sandbox: 63 sandboxes each
    forking 4 children all succeed while a 64th runs a fork bomb into its own limit."""
    lim = Limits(pids_max=8)
    cfg = RuntimeConfig(state_dir=tmp_path, cgroup="none", pool_max=0)
    async with Runtime(cfg) as rt:
        bomb = asyncio.ensure_future(rt.run(ExecRequest(code=FORK_BOMB, timeout_s=3), limits=lim))
        runs = await asyncio.gather(*(rt.run(ExecRequest(command=FORK_4, timeout_s=30), limits=lim)
                                      for _ in range(63)))
        failed = [r.stderr[-200:] for r in runs if r.exit_code != 0 or r.stdout != "ok\n"]
        assert not failed, f"{len(failed)} of 63 failed: {failed[:3]}"
        r = await bomb
        assert r.timed_out, r  # contained by its own limit, and ended at its deadline


@as_root
async def test_what_a_sandbox_wrote_goes_into_layers_as_the_sandbox_users(rt: Runtime) -> None:
    """Its upper directory holds what it wrote as its host uid (the upper is not idmapped); packed
    into a snapshot's layer, and copied into a fork's scratch layer, those files are uid 1000's, so
    every sandbox stacking the layer owns them."""
    saved = rt.config
    rt.config = rt.config.model_copy(update={"fork_inject_max_bytes": 0})  # forks copy a scratch layer
    parent = await rt.create()
    children = []
    try:
        r = await rt.exec(parent.sandbox_id, ExecRequest(command="mkdir d && echo a > d/f && stat -c %u d/f"))
        assert r.stdout == "1000\n", r
        sb = rt.sandboxes[parent.sandbox_id]
        shift = sb.owner_shift
        assert shift is not None and shift[1] == 1000 and shift[0] == ns_owner(sb.pid)
        upper = Path(sb.upper_path)
        assert (upper / "home/sandbox/d/f").stat().st_uid == shift[0]
        buf = io.BytesIO()
        pack(upper, buf, remap=shift)
        with tarfile.open(fileobj=io.BytesIO(buf.getvalue())) as tar:
            owners = {m.name: (m.uid, m.gid) for m in tar.getmembers()}
        assert owners["home/sandbox/d/f"] == owners["home/sandbox/d"] == (1000, 1000), owners
        children = await rt.fork(parent.sandbox_id, 2)
        scratch = rt.layer_root / rt.sandboxes[children[0].sandbox_id].view.layers[0]
        assert scratch.name.startswith("scratch-") and (scratch / "home/sandbox/d/f").stat().st_uid == 1000
        for c in children:
            r = await rt.exec(c.sandbox_id, ExecRequest(command="echo b >> d/f && cat d/f && stat -c %u d/f"))
            assert r.stdout == "a\nb\n1000\n", r
    finally:
        rt.config = saved
        for info in [parent, *children]:
            await rt.destroy(info.sandbox_id)


@as_root
async def test_slots_are_reused_when_released_and_never_after_close(tmp_path: Path) -> None:
    from rollbox.runtime.errors import IsolationError
    from rollbox.runtime.slots import UserSlots

    start = parse_range(RuntimeConfig().uid_range)[0]  # type: ignore[index]
    # its own uid-claim directory: the module's runtime, in this process too, holds the range's first uids
    slots = UserSlots(start, 4, batch=2, lock_dir=str(tmp_path))
    a, b = await slots.acquire(), await slots.acquire()
    assert (a.uid, b.uid) == (start, start + 1) and probe.userns_owner(f"/proc/self/fd/{a.fd}") == a.uid
    slots.release(a, gone=True)
    assert await slots.acquire() is a  # its sandbox is gone: the next one gets it
    slots.release(b, gone=False)  # its sandbox's init did not exit: retired, never handed out again
    d, e = await slots.acquire(), await slots.acquire()
    assert (d.uid, e.uid) == (start + 2, start + 3)
    with pytest.raises(IsolationError, match="no free uid"):
        await slots.acquire()
    slots.close()
    r, w = os.pipe()  # likely to get a closed slot's fd number
    try:
        slots.release(d, gone=False)  # a sandbox ending after its runtime closed: nothing of ours is closed
        os.fstat(r)
        os.fstat(w)
    finally:
        os.close(r)
        os.close(w)
