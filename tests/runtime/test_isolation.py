"""Misbehaving code, black-box: each case is (code or command, what must be true of the result).

After every case the supervisor still works and nothing is left behind on the host.
"""

from __future__ import annotations

import os
import socket
import subprocess
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
from rollbox.runtime.runtime import Runtime
from rollbox.runtime.spec import ExecRequest, ExecResult, Limits

from .conftest import host_mounts, host_state

pytestmark = pytest.mark.asyncio(loop_scope="module")
MiB = 1024 * 1024
SECRET = f"host-secret-{uuid.uuid4().hex}"
HOST_FILE = f"/tmp/rollbox-host-{uuid.uuid4().hex}"


# Calls a libc function (or a raw syscall) and prints "<label>:<errno name>" (or "<label>:ok"):
# each case names the exact error the kernel must give, so a missing tool or a crash cannot pass.
ERRNO_OF = (
    "import ctypes, errno\nlibc = ctypes.CDLL(None, use_errno=True)\n"
    "def call(fn, *args, label=None):\n"
    "    ctypes.set_errno(0)\n"
    "    rc = getattr(libc, fn)(*args)\n"
    "    err = ctypes.get_errno()\n"
    "    print(f'{label or fn}:' + ('ok' if rc != -1 else errno.errorcode.get(err, str(err))))\n"
    "import os\nNR = {'x86_64': {'pivot_root': 155, 'clone': 56}, 'aarch64': {'pivot_root': 41, 'clone': 220}}"
    "[os.uname().machine]\n"
)


@dataclass
class Case:
    name: str
    check: Callable[[ExecResult], bool]
    code: str | None = None
    command: str | None = None
    timeout_s: float = 10.0
    limits: dict[str, int] = field(default_factory=dict)
    one_shot_check: Callable[[ExecResult], bool] | None = None  # when a one-shot run ends differently


CASES = [
    Case("fork bomb is stopped by the pids limit",
         lambda r: r.pids_limit_hit and r.timed_out and r.exit_code == 137,
         code="import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
         timeout_s=3, limits={"pids_max": 32}),
    Case("shell fork bomb is stopped by the pids limit",
         lambda r: r.pids_limit_hit,
         command="bomb() { bomb | bomb & }; bomb; sleep 2", timeout_s=3, limits={"pids_max": 32}),
    Case("memory hog is OOM-killed and reported",
         lambda r: r.oom_killed and r.exit_code == 137 and r.signal == "SIGKILL",
         code="a = []\nwhile True:\n    a.append(' ' * 10**7)", limits={"memory_max_bytes": 64 * MiB}),
    Case("endless output is truncated at the cap",
         lambda r: r.stdout_truncated and len(r.stdout) == 4096 and r.timed_out,
         code="while True:\n    print('x' * 1000)", timeout_s=2, limits={"output_max_bytes": 4096}),
    Case("large finite output is truncated and the run still ends by itself",
         lambda r: r.stdout_truncated and not r.timed_out and r.exit_code == 0 and len(r.stdout) == 4096,
         code="import sys\nsys.stdout.write('y' * 20000)", limits={"output_max_bytes": 4096}),
    Case("endless loop times out with 137",
         lambda r: r.timed_out and r.exit_code == 137,
         code="while True:\n    pass", timeout_s=1),
    Case("sleep forever times out with 137",
         lambda r: r.timed_out and r.exit_code == 137,
         command="sleep 1000", timeout_s=1),
    Case("reading host files outside the snapshot fails",
         lambda r: r.exit_code == 0 and r.stdout.split() == ["absent"] * 4,
         code="import os\n"
              f"for p in ['{HOST_FILE}', '/etc/shadow', '/work', os.path.expanduser('~root') + '/.bashrc']:\n"
              "    print('present' if os.path.exists(p) else 'absent')"),
    Case("writing outside the sandbox never reaches the host; /usr is a read-only bind (EROFS)",
         lambda r: r.exit_code == 0 and r.stdout == "usr:EROFS\n" and not os.path.exists(HOST_FILE + ".w"),
         code=f"import errno\nopen('{HOST_FILE}.w', 'w').write('x')\n"
              "try:\n    open('/usr/evil', 'w')\n    print('usr:written')\nexcept OSError as e:\n"
              "    print('usr:' + errno.errorcode[e.errno])"),
    Case("connecting to a TCP port the host listens on fails",
         lambda r: r.exit_code == 0 and r.stdout.strip() == "refused:PermissionError",
         code="import socket\ntry:\n    socket.create_connection(('127.0.0.1', PORT), timeout=2)\n    print('connected')\n"
              "except OSError as e:\n    print('refused:' + type(e).__name__)"),
    Case("kill -9 -1 inside kills the sandbox's other processes, not its init",
         lambda r: r.exit_code == 0 and r.stdout.split() == ["alive", "0"] and r.sandbox_alive,
         command="sleep 100 & sleep 100 & kill -9 -1; echo alive; sleep 0.2; ps -e -o comm= | grep -c sleep || true",
         one_shot_check=lambda r: r.exit_code == 0 and r.stdout.split() == ["alive", "0"] and not r.sandbox_alive),
    Case("a program that sends itself SIGTERM ends at once (also as a one-shot, where it is pid 1)",
         lambda r: r.exit_code == 143 and not r.timed_out and r.stdout == "",
         code="import os, signal, time\nos.kill(os.getpid(), signal.SIGTERM)\ntime.sleep(30)\nprint('still here')",
         timeout_s=5),
    Case("background processes do not outlive the step's end as a one-shot",
         lambda r: r.exit_code == 0 and r.stdout == "started\n" and r.wall_s < 5,
         command="(sleep 1000; echo late) & echo started", timeout_s=20),
    Case("only AF_UNIX sockets: netlink, vsock, packet, inet6 refused by the filter (EPERM)",
         lambda r: r.exit_code == 0 and r.stdout.split() == ["1:ok", "16:EPERM", "40:EPERM", "17:EPERM", "10:EPERM"],
         code="import errno, socket\nfor fam in (1, 16, 40, 17, 10):\n    try:\n        socket.socket(fam, socket.SOCK_DGRAM).close()\n"
              "        print(f'{fam}:ok')\n    except OSError as e:\n        print(f'{fam}:{errno.errorcode[e.errno]}')"),
    Case("io_uring is refused (it would bypass the socket filter)",
         lambda r: r.exit_code == 0 and r.stdout.split() == ["-1", "1"],
         code="import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\np = ctypes.create_string_buffer(120)\n"
              "print(libc.syscall(425, 4, p), ctypes.get_errno())"),
    Case("mount, umount2, pivot_root and chroot are refused by the filter (EPERM)",
         lambda r: r.exit_code == 0 and r.stdout.split() == ["mount:EPERM", "umount2:EPERM", "pivot_root:EPERM",
                                                             "chroot:EPERM", "/tmp:not-tmpfs"],
         code=ERRNO_OF + "call('mount', b'none', b'/tmp', b'tmpfs', 0, None)\ncall('umount2', b'/proc', 2)\n"
              "call('syscall', NR['pivot_root'], b'/tmp', b'/tmp', label='pivot_root')\ncall('chroot', b'/tmp')\n"
              "print('/tmp:' + ('tmpfs' if any(l.split()[4] == '/tmp' and ' - tmpfs ' in l\n"
              "      for l in open('/proc/self/mountinfo')) else 'not-tmpfs'))"),
    Case("ptrace fails",
         lambda r: r.exit_code == 0 and r.stdout.strip() == "-1 1",
         code="import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
              "print(libc.ptrace(0, 0, 0, 0), ctypes.get_errno())"),
    Case("device nodes cannot be made: mknod is EPERM (no CAP_MKNOD; the root allows the skeleton's /dev only)",
         lambda r: r.exit_code == 0 and r.stdout.split() == ["c:EPERM", "b:EPERM", "absent"],
         code="import errno, os, stat\nfor kind, mode in (('c', stat.S_IFCHR), ('b', stat.S_IFBLK)):\n    try:\n"
              "        os.mknod('/tmp/mem', mode | 0o666, os.makedev(1, 1))\n        print(kind + ':made')\n"
              "    except OSError as e:\n        print(kind + ':' + errno.errorcode[e.errno])\n"
              "print('present' if os.path.lexists('/tmp/mem') else 'absent')"),
    Case("no new namespaces from inside: unshare and setns are EPERM, clone with namespace flags EPERM, clone3 ENOSYS",
         lambda r: r.exit_code == 0 and r.stdout.split() == [
             "unshare-user:EPERM", "unshare-mnt:EPERM", "unshare-net:EPERM", "unshare-pid:EPERM",
             "setns:EPERM", "clone-newuser:EPERM", "clone3:ENOSYS"],
         code=ERRNO_OF + "import os\nfor name, flag in (('user', 0x10000000), ('mnt', 0x20000), ('net', 0x40000000),\n"
              "                   ('pid', 0x20000000)):\n    call('unshare', flag, label='unshare-' + name)\n"
              "fd = os.open('/proc/self/ns/uts', os.O_RDONLY)\ncall('setns', fd, 0)\n"
              "call('syscall', NR['clone'], 0x10000000 | 17, 0, 0, 0, 0, label='clone-newuser')\n"
              "args = ctypes.create_string_buffer(88)\ncall('syscall', 435, args, 88, label='clone3')"),
    Case("the host environment is not visible",
         lambda r: r.exit_code == 0 and SECRET not in r.stdout and "HOME=/home/sandbox" in r.stdout,
         command="env; cat /proc/1/environ 2>/dev/null | tr '\\0' '\\n'"),
    Case("runs as an unprivileged user with no capabilities",
         lambda r: r.exit_code == 0 and r.stdout.split() == ["1000", "0000000000000000", "1"],
         command="id -u; grep CapEff /proc/self/status | cut -f2; grep NoNewPrivs /proc/self/status | cut -f2"),
]


@pytest.fixture(scope="module")
def host_listener():
    os.environ.setdefault("ROLLBOX_TEST_SECRET", SECRET)  # visible to the supervisor, never inside
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    with open(HOST_FILE, "w") as f:
        f.write(SECRET)
    yield srv.getsockname()[1]
    srv.close()
    os.unlink(HOST_FILE)


def _request(case: Case, port: int) -> tuple[ExecRequest, Limits | None]:
    code = case.code.replace("PORT", str(port)) if case.code else None
    limits = Limits(**case.limits) if case.limits else None
    return ExecRequest(code=code, command=case.command, timeout_s=case.timeout_s), limits


async def _all_still_well(rt: Runtime, mounts_before: int) -> None:
    """After a case: the supervisor still runs sandboxes, and nothing of the case is left on the host."""
    fresh = await rt.run(ExecRequest(code="print('fine')"))
    assert fresh.stdout == "fine\n" and fresh.exit_code == 0
    assert host_mounts() == mounts_before
    assert host_state(rt) == {"cgroups": [], "sandbox_children": 0}


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
async def test_misbehaviour_is_contained(rt: Runtime, host_listener: int, case: Case) -> None:
    mounts_before = host_mounts()
    req, limits = _request(case, host_listener)
    info = await rt.create(limits=limits)
    try:
        res = await rt.exec(info.sandbox_id, req)
        assert case.check(res), res.model_dump()
        # the supervisor and this very sandbox still work after the case (unless it had to die)
        if res.sandbox_alive:
            again = await rt.exec(info.sandbox_id, ExecRequest(code="print(6*7)"))
            assert again.stdout == "42\n", again
    finally:
        await rt.destroy(info.sandbox_id)
    await _all_still_well(rt, mounts_before)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
async def test_misbehaviour_is_contained_in_one_shot_runs(rt: Runtime, host_listener: int, case: Case) -> None:
    """The same table through ``run``, where the program is the sandbox's init (pid 1)."""
    mounts_before = host_mounts()
    req, limits = _request(case, host_listener)
    res = await rt.run(req, limits=limits)
    assert (case.one_shot_check or case.check)(res), res.model_dump()
    await _all_still_well(rt, mounts_before)


async def test_kill_minus_one_spares_the_host(rt: Runtime) -> None:
    host_proc = subprocess.Popen(["sleep", "30"])
    try:
        res = await rt.run(ExecRequest(command="kill -9 -1; echo survived"))
        assert res.exit_code == 0 and res.stdout == "survived\n"
        assert host_proc.poll() is None
    finally:
        host_proc.kill()
        host_proc.wait()


async def test_sandboxes_are_isolated_from_each_other(rt: Runtime) -> None:
    a = await rt.create()
    b = await rt.create()
    try:
        await rt.exec(a.sandbox_id, ExecRequest(command="echo mine > /tmp/f; echo home > note.txt; sleep 30 &"))
        r = await rt.exec(b.sandbox_id, ExecRequest(command="cat /tmp/f note.txt; ps -e -o comm="))
        assert "mine" not in r.stdout and "home" not in r.stdout
        assert "sleep" not in r.stdout and "ps" in r.stdout  # b sees its own processes, none of a's
    finally:
        await rt.destroy(a.sandbox_id)
        await rt.destroy(b.sandbox_id)
