"""Probe: what containment put in force, read back by a sandbox from its own /proc (stdlib only).

Run inside a freshly contained sandbox (after the last step of ``zygote.contain``, before any
untrusted code) when the supervisor asks for it in the spawn request: the first sandbox of each
zygote. The supervisor compares the facts with its own (``namespaces()`` of the host) and renders
them per layer (runtime/report.py).
"""

from __future__ import annotations

import os
import resource
from collections.abc import Callable
from typing import Any

from rollbox.runtime.isolation import users

NAMESPACES = ("mnt", "pid", "ipc", "uts", "net", "user", "cgroup", "time")
STATUS_FIELDS = ("Uid", "Gid", "CapEff", "CapPrm", "CapBnd", "NoNewPrivs", "Seccomp", "Seccomp_filters", "NSpid")
RLIMITS = {"core": resource.RLIMIT_CORE, "nofile": resource.RLIMIT_NOFILE, "fsize": resource.RLIMIT_FSIZE,
           "nproc": resource.RLIMIT_NPROC, "data": resource.RLIMIT_DATA, "as": resource.RLIMIT_AS,
           "msgqueue": resource.RLIMIT_MSGQUEUE, "sigpending": resource.RLIMIT_SIGPENDING}

__all__ = ["NAMESPACES", "namespaces", "read_back", "userns_owner"]


def namespaces() -> dict[str, int]:
    """The inode of each namespace this process is in (the ones this kernel has)."""
    out: dict[str, int] = {}
    for name in NAMESPACES:
        try:
            out[name] = os.stat(f"/proc/self/ns/{name}").st_ino
        except OSError:
            continue
    return out


def _text(path: str) -> str:
    with open(path) as f:
        return f.read()


def _status() -> dict[str, str]:
    out = {}
    for line in _text("/proc/self/status").splitlines():
        key, _, value = line.partition(":")
        if key in STATUS_FIELDS:
            out[key] = value.strip()
    return out


def _mounts() -> list[list[str]]:
    """[mount point, fs type, mount options, super options] of every mount this process sees."""
    out = []
    for line in _text("/proc/self/mountinfo").splitlines():
        left, _, right = line.partition(" - ")
        fields, rfields = left.split(), right.split()
        if len(fields) >= 6 and len(rfields) >= 3:
            out.append([fields[4], rfields[0], fields[5], rfields[2]])
    return out


def _interfaces() -> list[str]:
    """Network interfaces of this network namespace (no socket needed: the filter allows AF_UNIX only)."""
    lines = _text("/proc/self/net/dev").splitlines()[2:]
    return [line.split(":", 1)[0].strip() for line in lines if ":" in line]


def userns_owner(ns: str = "/proc/self/ns/user") -> int:
    """The uid owning a user namespace (0 for the host's), from the NS_GET_OWNER_UID ioctl."""
    import fcntl
    import struct

    fd = os.open(ns, os.O_RDONLY | os.O_CLOEXEC)
    try:
        buf = bytearray(4)
        fcntl.ioctl(fd, 0xB704, buf)
        return int(struct.unpack("I", buf)[0])
    finally:
        os.close(fd)


def read_back() -> dict[str, Any]:
    """The facts, as plain JSON values. A fact that cannot be read is reported as its error."""
    facts: dict[str, Any] = {"ns": namespaces()}
    readers: dict[str, Callable[[], Any]] = {
        "status": _status,
        "uid_map": lambda: " ".join(_text("/proc/self/uid_map").split()),
        "gid_map": lambda: " ".join(_text("/proc/self/gid_map").split()),
        "userns_owner": userns_owner,
        "mounts": _mounts,
        "rlimits": lambda: {k: list(resource.getrlimit(r)) for k, r in RLIMITS.items()},
        # this user namespace's own caps of the budgets rootless sandboxes are capped on (those this kernel has)
        "budgets": lambda: {k: int(_text(f"/proc/sys/user/{k}")) for k in users.NS_BUDGETS
                            if os.path.exists(f"/proc/sys/user/{k}")},
        "net": _interfaces,
        "hostname": lambda: os.uname().nodename,
    }
    errors = {}
    for key, read in readers.items():
        try:
            facts[key] = read()
        except Exception as exc:
            errors[key] = f"{type(exc).__name__}: {exc}"
    if errors:
        facts["errors"] = errors
    return facts
