"""Users: the uid a sandbox runs as, and user-namespace maps for rootless operation (stdlib only)."""

from __future__ import annotations

import os
import re
import resource

from rollbox.runtime.isolation import libc

SANDBOX_UID = 1000
SANDBOX_GID = 1000

# Per-user kernel budgets a user namespace can cap for itself (/proc/sys/user/<name>, one table per
# namespace), each with the host-wide sysctl that bounds the initial namespace's level.
# The kernel charges a nested namespace's counts at every level up to the initial namespace
# (inc_ucount, kernel/ucount.c), so rootless, where every sandbox's namespace hangs off the caller, one
# sandbox could take the caller's whole budget; a lower cap in its own namespace stops it at its share.
# (The namespace counts of the same table need no cap: seccomp refuses sandboxes new namespaces.)
NS_BUDGETS = {
    "max_inotify_instances": "/proc/sys/fs/inotify/max_user_instances",
    "max_inotify_watches": "/proc/sys/fs/inotify/max_user_watches",
    "max_fanotify_groups": "/proc/sys/fs/fanotify/max_user_groups",
    "max_fanotify_marks": "/proc/sys/fs/fanotify/max_user_marks",
}
# Budgets the kernel counts the same way but bounds by the caller's rlimits (a nested namespace keeps
# its creator's as the bound of the level above it): a lower rlimit caps the sandbox's own level.
RLIMIT_BUDGETS = {"RLIMIT_MSGQUEUE": resource.RLIMIT_MSGQUEUE, "RLIMIT_SIGPENDING": resource.RLIMIT_SIGPENDING}


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def shared_budgets(share: int) -> dict[str, int]:
    """Supervisor side, rootless: the cap for one sandbox's namespace of each budget in ``NS_BUDGETS``,
    ``1/share`` of the smallest bound readable from here (this namespace's own and the host-wide
    sysctl). ``share`` 1: no caps."""
    if share <= 1:
        return {}
    out = {}
    for name, host in NS_BUDGETS.items():
        own = _read_int(f"/proc/sys/user/{name}")  # (absent on kernels without it: nothing to write either)
        if own:
            out[name] = max(1, min(v for v in (own, _read_int(host)) if v) // share)
    if _kernel_at_least(5, 14):  # before 5.14 these counts were per host uid: a lower rlimit would
        for name, which in RLIMIT_BUDGETS.items():  # cap every sandbox together, not each one
            soft = resource.getrlimit(which)[0]
            if soft != resource.RLIM_INFINITY:
                out[name] = max(1, soft // share)
    return out


def _kernel_at_least(major: int, minor: int) -> bool:
    found = re.match(r"(\d+)\.(\d+)", os.uname().release)
    return found is not None and (int(found[1]), int(found[2])) >= (major, minor)


def cap_budgets(budgets: dict[str, int]) -> None:
    """In a user namespace just made, while this process still has every capability in it: write its own
    table of per-user budgets (the sandbox, without capabilities, can read but not raise them)."""
    for name, value in budgets.items():
        if name in RLIMIT_BUDGETS:
            resource.setrlimit(RLIMIT_BUDGETS[name], (value, value))
            continue
        with open(f"/proc/sys/user/{name}", "w") as f:
            f.write(str(value))


def map_self(inside_uid: int, inside_gid: int, outside_uid: int, outside_gid: int) -> None:
    """After unshare(CLONE_NEWUSER): map one id, our own, the only map an unprivileged process may write."""
    with open("/proc/self/setgroups", "w") as f:
        f.write("deny")
    with open("/proc/self/uid_map", "w") as f:
        f.write(f"{inside_uid} {outside_uid} 1")
    with open("/proc/self/gid_map", "w") as f:
        f.write(f"{inside_gid} {outside_gid} 1")


def enter_rootless_userns() -> None:
    """Supervisor side of rootless: become root of a new user namespace (for the zygote's mounts)."""
    uid, gid = os.geteuid(), os.getegid()
    libc.unshare(libc.CLONE_NEWUSER | libc.CLONE_NEWNS)
    map_self(0, 0, uid, gid)


def drop_privileges(rootless: bool, userns_fd: int = -1, budgets: dict[str, int] | None = None) -> None:
    """Become the unprivileged sandbox user with no capabilities.

    As root: first into the sandbox's own user namespace if it has one (``userns_fd``: owned by a host
    uid of its own, its map identity or putting 1000 on that uid, see runtime/slots.py), then
    setgroups/setresgid/setresuid to 1000 (the kernel clears capabilities, the namespace's root being
    host root). Rootless: the process is root only of the zygote's user namespace, which maps to the
    caller; a nested user namespace maps 1000 onto it and caps its share of the caller's per-user
    budgets (``budgets``, see ``shared_budgets``), then capset clears every capability.
    """
    if rootless:
        libc.unshare(libc.CLONE_NEWUSER)
        map_self(SANDBOX_UID, SANDBOX_GID, 0, 0)
        # after the unshare, not before: a new namespace keeps its creator's rlimits as the bound of
        # the level above it (the caller's, shared by all sandboxes), the lowered ones bound its own
        cap_budgets(budgets or {})
        libc.drop_all_capabilities()
    else:
        if userns_fd >= 0:
            libc.setns(userns_fd, libc.CLONE_NEWUSER)
            os.close(userns_fd)
        os.setgroups([])
        os.setresgid(SANDBOX_GID, SANDBOX_GID, SANDBOX_GID)
        os.setresuid(SANDBOX_UID, SANDBOX_UID, SANDBOX_UID)
