"""Network namespaces made ahead and reused (runtime/netns.py): as root, a sandbox joins an empty one
made on the host, and one whose sandbox has ended goes to the next sandbox, empty."""

from __future__ import annotations

import asyncio
import os

import pytest
from rollbox.runtime.execution import Sandbox
from rollbox.runtime.netns import NetNamespaces
from rollbox.runtime.runtime import Runtime
from rollbox.runtime.spec import ExecRequest

pytestmark = [pytest.mark.asyncio(loop_scope="module"),
              pytest.mark.skipif(os.geteuid() != 0, reason="namespaces are made ahead as root only")]

NAME = "rollbox-netns-test"
# prints its network namespace, then leaves a process behind holding a bound, listening abstract socket
HOLD = f"""
import os, socket, time
print(os.stat('/proc/self/ns/net').st_ino)
r, w = os.pipe()
if os.fork() == 0:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind('\\0{NAME}')
    s.listen()
    os.write(w, b'1')
    time.sleep(60)
    os._exit(0)
os.read(r, 1)
print(open('/proc/net/unix').read().count('{NAME}'))
"""
CHECK = f"""
import os, socket
print(os.stat('/proc/self/ns/net').st_ino)
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.bind('\\0{NAME}')  # EADDRINUSE if the last sandbox's socket were still there
print(open('/proc/net/unix').read().count('{NAME}'))
print(' '.join(sorted(line.split(':')[0].strip() for line in open('/proc/net/dev').readlines()[2:])))
"""


async def _restore(rt: Runtime) -> Sandbox:
    """A sandbox restored now (not from the warm pool, whose sandboxes have their namespaces already)."""
    view = await rt.resolve("python")
    return await rt.restorer.restore(view, view.limits)


async def _made_ahead(nets: NetNamespaces) -> None:
    """Wait until namespaces made ahead are free (the first sandboxes of a runtime make their own)."""
    fd = nets.acquire()  # (starts making a batch when few are free)
    if fd is not None:
        nets.release(fd, True)
    for _ in range(1000):
        if nets.free:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"no network namespace made ahead: {nets.failed}")


async def test_a_reused_network_namespace_is_empty_and_never_shared(rt: Runtime) -> None:
    nets = rt.restorer.netns
    assert nets is not None
    await _made_ahead(nets)
    host = os.stat("/proc/self/ns/net").st_ino
    a = await _restore(rt)
    b = await _restore(rt)
    try:
        ra = await a.exec(ExecRequest(code=HOLD))
        rb = await b.exec(ExecRequest(code=CHECK))
        fd = a.netns_fd
        assert fd >= 0, "the sandbox made its own namespace: none was made ahead"
    finally:
        await a.close("destroyed")
        await b.close("destroyed")
    ino_a, held = ra.stdout.split()
    assert held == "1", ra  # the socket was there while its sandbox lived
    ino_b, count_b, ifaces_b = rb.stdout.split("\n")[:3]
    assert len({int(ino_a), int(ino_b), host}) == 3, (ra, rb)  # live sandboxes: namespaces of their own
    assert (count_b, ifaces_b) == ("1", "lo"), rb

    assert fd in nets.free  # its init exited: kept for the next sandbox
    nets.free.remove(fd)
    nets.free.appendleft(fd)
    c = await _restore(rt)
    try:
        rc = await c.exec(ExecRequest(code=CHECK))
    finally:
        await c.close("destroyed")
    assert rc.exit_code == 0, rc
    ino_c, count_c, ifaces_c = rc.stdout.split("\n")[:3]
    assert int(ino_c) == int(ino_a), (ra, rc)  # the same namespace ...
    assert (count_c, ifaces_c) == ("1", "lo"), rc  # ... with nothing of the last sandbox left in it


async def test_with_none_free_a_sandbox_makes_its_own(rt: Runtime) -> None:
    nets = rt.restorer.netns
    assert nets is not None
    held = list(nets.free)
    nets.free.clear()
    nets.failed = "none made ahead, for this test"
    try:
        sb = await _restore(rt)
        try:
            r = await sb.exec(ExecRequest(code="import os; print(os.stat('/proc/self/ns/net').st_ino)"))
        finally:
            await sb.close("destroyed")
        assert sb.netns_fd == -1
        ino = int(r.stdout)
        assert ino != os.stat("/proc/self/ns/net").st_ino
        assert ino not in {os.fstat(fd).st_ino for fd in held}
    finally:
        nets.failed = None
        nets.free.extend(held)


async def test_closing_twice_leaves_a_reused_fd_number_alone() -> None:
    """A runtime may be closed twice (a service's close, then its owner's): the second close must not close
    the host namespace's fd number again, which by then may be another file's (an asyncio socket's, in
    the service: its transport broke with 'fd is not registered')."""
    pool = NetNamespaces()
    host_fd = pool._host
    pool.close()
    other = os.open("/dev/null", os.O_RDONLY)  # the lowest free number: the one just closed
    try:
        assert other == host_fd
        pool.close()
        os.fstat(other)  # still open
    finally:
        os.close(other)
