"""Seccomp: the syscall filter every sandbox runs under.

``build_filter()`` compiles the policy once, in the supervisor, with libseccomp (through pyseccomp)
into classic BPF; ``apply()`` loads those bytes inside the sandbox with one prctl, so nothing is
compiled on the restore path. Denied calls fail with EPERM, the errno a program expects for
"not allowed here".
"""

from __future__ import annotations

import errno
import socket
import tempfile

from rollbox.runtime.isolation import libc

# Deny list: the kernel's escape and attack surface that untrusted code has no business touching.
DENIED_SYSCALLS = (
    "mount", "umount2", "pivot_root", "chroot", "move_mount", "open_tree", "fsopen", "fsconfig", "fsmount",
    "fspick", "mount_setattr", "ptrace", "process_vm_readv", "process_vm_writev", "reboot", "kexec_load",
    "kexec_file_load", "unshare", "setns", "bpf", "keyctl", "add_key", "request_key", "perf_event_open",
    "init_module", "finit_module", "delete_module", "swapon", "swapoff", "acct", "syslog",
    "settimeofday", "clock_settime", "clock_adjtime", "adjtimex", "open_by_handle_at", "name_to_handle_at",
    "userfaultfd", "iopl", "ioperm", "quotactl", "lookup_dcookie", "vhangup", "personality",
    # io_uring does socket(), open() and more without those syscalls (and is a large attack surface)
    "io_uring_setup", "io_uring_enter", "io_uring_register",
)
# The only socket family allowed: AF_UNIX (no IP, no raw packets, no netlink, no vsock — which a
# network namespace does not confine — nor any other family a kernel module may add).
ALLOWED_SOCKET_FAMILY = socket.AF_UNIX
# clone(2) flags that would create namespaces; clone3 is refused with ENOSYS so libc falls back to clone.
_NS_FLAGS = (
    libc.CLONE_NEWNS | libc.CLONE_NEWUTS | libc.CLONE_NEWIPC | libc.CLONE_NEWUSER | libc.CLONE_NEWPID
    | libc.CLONE_NEWNET | libc.CLONE_NEWCGROUP
)


def build_filter() -> bytes:
    """Compile the sandbox policy to BPF bytes (needs libseccomp; runs in the supervisor)."""
    import pyseccomp as sc

    f = sc.SyscallFilter(sc.ALLOW)
    deny = sc.ERRNO(errno.EPERM)
    for name in DENIED_SYSCALLS:
        try:
            f.add_rule(deny, name)
        except (OSError, ValueError, RuntimeError):  # unknown on this arch: nothing to deny
            continue
    for call in ("socket", "socketpair"):
        f.add_rule(deny, call, sc.Arg(0, sc.NE, int(ALLOWED_SOCKET_FAMILY)))
    for bit in _bits(_NS_FLAGS):
        f.add_rule(deny, "clone", sc.Arg(0, sc.MASKED_EQ, bit, bit))
    f.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
    with tempfile.TemporaryFile() as fh:
        f.export_bpf(fh)
        fh.flush()
        fh.seek(0)
        return fh.read()


def _bits(mask: int) -> list[int]:
    return [1 << i for i in range(64) if mask & (1 << i)]


def apply(program: libc.SeccompProgram | bytes) -> None:
    """Load the compiled filter into this process (and every child it forks). Needs no_new_privs."""
    if isinstance(program, bytes):
        program = libc.SeccompProgram(program)
    libc.prctl(libc.PR_SET_NO_NEW_PRIVS, 1)
    libc.load_seccomp_bpf(program)


__all__ = ["ALLOWED_SOCKET_FAMILY", "DENIED_SYSCALLS", "apply", "build_filter"]
