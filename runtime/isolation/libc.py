"""Thin ctypes bindings for the syscalls Python 3.11's os module lacks (stdlib only: loaded in the zygote).

Each wrapper raises OSError naming the syscall, so a failed layer says exactly what failed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os


def _load_libc(kind: type[ctypes.CDLL] = ctypes.CDLL) -> ctypes.CDLL:
    """glibc by its soname first: find_library("c") runs ldconfig with /dev/null as its stdin, and
    failing that gcc with a temporary file, and a rootless zygote's read-only view has neither /dev/null
    nor a writable /tmp (a snapshot with gcc in it, cpp's, failed to start there)."""
    try:
        return kind("libc.so.6", use_errno=True)
    except OSError:
        return kind(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


_libc = _load_libc()
# The same library called with the GIL held (for fork_bare: nothing else may run across the fork)
_libc_gil = _load_libc(ctypes.PyDLL)
# Looked up now, in the zygote: a CDLL makes each function's object on its first use and stores it in its
# own dict, which in a fresh fork costs copy-on-write faults on every page that touches (~35 per sandbox
# for sethostname alone).
for _name in ("fork", "unshare", "setns", "mount", "umount2", "syscall", "prctl", "sethostname"):
    getattr(_libc_gil if _name == "fork" else _libc, _name)
ctypes.pythonapi.PyOS_AfterFork_Child.restype = None

# namespaces (linux/sched.h)
CLONE_NEWNS = 0x00020000
CLONE_NEWCGROUP = 0x02000000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000

# mount flags (linux/mount.h)
MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_BIND = 4096
MS_MOVE = 8192
MS_REC = 16384
MS_PRIVATE = 1 << 18
MNT_DETACH = 2

# prctl
PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
PR_SET_SECCOMP = 22
PR_SET_NO_NEW_PRIVS = 38
PR_SET_CHILD_SUBREAPER = 36
SECCOMP_MODE_FILTER = 2

_SYS_pivot_root = 155  # x86_64
_SYS_capset = 126
if os.uname().machine == "aarch64":  # pragma: no cover - not this machine
    _SYS_pivot_root = 41
    _SYS_capset = 91


def _check(ret: int, what: str) -> int:
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return ret


def fork_bare() -> int:
    """fork(2) without Python's own fork handling: no ``os.register_at_fork`` hooks run (threading's
    reset, random's reseed, ...) and the interpreter's locks are not re-made in the child. For a
    single-threaded interpreter whose child runs no user code, only forks Python code of its own
    (with ``os.fork``, which runs every hook there): a zygote's sandbox init. The hooks' first run
    in a fresh copy-on-write child touches pages all over the warm heap: ~0.5 ms of CPU per fork
    here, a third of the child's cost. The caller checks that no other Python thread runs.
    Returns 0 in the child, its pid in the parent."""
    return _check(_libc_gil.fork(), "fork")


def after_fork_child() -> None:
    """Python's fork handling in a child of ``fork_bare``, deferred to the moment it is needed (the
    process is about to run user code itself): what ``os.fork`` would have done in the child, its
    ``os.register_at_fork`` hooks included (random reseeds). Single-threaded, as the fork was."""
    ctypes.pythonapi.PyOS_AfterFork_Child()


def unshare(flags: int) -> None:
    _check(_libc.unshare(ctypes.c_int(flags)), f"unshare({flags:#x})")


def setns(fd: int, nstype: int) -> None:
    _check(_libc.setns(ctypes.c_int(fd), ctypes.c_int(nstype)), f"setns({nstype:#x})")


def mount(source: str, target: str, fstype: str | None, flags: int = 0, data: str | None = None) -> None:
    ret = _libc.mount(
        source.encode(),
        target.encode(),
        fstype.encode() if fstype else None,
        ctypes.c_ulong(flags),
        data.encode() if data else None,
    )
    _check(ret, f"mount({source!r} -> {target!r}, {fstype}, {data})")


# the new mount API (same numbers on every architecture: Linux >= 5.2 / 5.12)
_SYS_open_tree = 428
_SYS_mount_setattr = 442
_OPEN_TREE_CLONE = 1
_OPEN_TREE_CLOEXEC = os.O_CLOEXEC
_AT_EMPTY_PATH = 0x1000
_MOUNT_ATTR_IDMAP = 0x00100000


class _MountAttr(ctypes.Structure):  # struct mount_attr (MOUNT_ATTR_SIZE_VER0)
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]


def idmapped_clone(path: str, userns_fd: int) -> int:
    """A detached copy of the mount at ``path`` whose file ownership is seen through the id map of the
    user namespace ``userns_fd`` (an idmapped mount); returns its fd (use ``/proc/self/fd/N/...``)."""
    fd = _check(_libc.syscall(_SYS_open_tree, -100, path.encode(), _OPEN_TREE_CLONE | _OPEN_TREE_CLOEXEC),
                f"open_tree({path!r})")
    attr = _MountAttr(_MOUNT_ATTR_IDMAP, 0, 0, userns_fd)
    try:
        _check(_libc.syscall(_SYS_mount_setattr, fd, b"", _AT_EMPTY_PATH, ctypes.byref(attr),
                             ctypes.sizeof(attr)), f"mount_setattr({path!r}, MOUNT_ATTR_IDMAP)")
    except OSError:
        os.close(fd)
        raise
    return fd


def umount2(target: str, flags: int = 0) -> None:
    _check(_libc.umount2(target.encode(), ctypes.c_int(flags)), f"umount2({target!r})")


def pivot_root(new_root: str, put_old: str) -> None:
    _check(_libc.syscall(_SYS_pivot_root, new_root.encode(), put_old.encode()), "pivot_root")


def prctl(option: int, arg2: int = 0, arg3: int = 0, arg4: int = 0, arg5: int = 0) -> int:
    return _check(
        _libc.prctl(
            ctypes.c_int(option), ctypes.c_ulong(arg2), ctypes.c_ulong(arg3), ctypes.c_ulong(arg4),
            ctypes.c_ulong(arg5),
        ),
        f"prctl({option})",
    )


def sethostname(name: str) -> None:
    b = name.encode()
    _check(_libc.sethostname(b, ctypes.c_size_t(len(b))), "sethostname")


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


_CapData2 = _CapData * 2  # made once, at import: creating a ctypes type after a fork costs every sandbox


def drop_all_capabilities() -> None:
    """capset(2) with empty effective, permitted and inheritable sets."""
    hdr = _CapHeader(0x20080522, 0)
    data = _CapData2()
    _check(_libc.syscall(_SYS_capset, ctypes.byref(hdr), ctypes.byref(data)), "capset")


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


class SeccompProgram:
    """A compiled classic-BPF seccomp program (8 bytes per instruction), its ctypes buffer made once
    (in the zygote) so that loading it after a fork is one prctl."""

    def __init__(self, bpf: bytes):
        if not bpf or len(bpf) % 8:
            raise OSError(22, "seccomp: program must be a non-empty multiple of 8 bytes")
        self.buf = ctypes.create_string_buffer(bpf, len(bpf))
        self.prog = _SockFprog(len(bpf) // 8, ctypes.cast(self.buf, ctypes.c_void_p))


def load_seccomp_bpf(program: SeccompProgram) -> None:
    """Install a precompiled seccomp program in this process (and every child it forks)."""
    prog = program.prog
    _check(
        _libc.prctl(ctypes.c_int(PR_SET_SECCOMP), ctypes.c_ulong(SECCOMP_MODE_FILTER), ctypes.byref(prog),
                    ctypes.c_ulong(0), ctypes.c_ulong(0)),
        "prctl(PR_SET_SECCOMP)",
    )
