"""Users: the uid a sandbox runs as, and user-namespace maps for rootless operation (stdlib only)."""

from __future__ import annotations

import os

from rollbox.runtime.isolation import libc

SANDBOX_UID = 1000
SANDBOX_GID = 1000


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


def drop_privileges(rootless: bool, userns_fd: int = -1) -> None:
    """Become the unprivileged sandbox user with no capabilities.

    As root: first into the sandbox's own user namespace if it has one (``userns_fd``: owned by a host
    uid of its own, its map identity or putting 1000 on that uid, see runtime/slots.py), then
    setgroups/setresgid/setresuid to 1000 (the kernel clears capabilities, the namespace's root being
    host root). Rootless: the process is root only of the zygote's user namespace, which maps to the
    caller; a nested user namespace maps 1000 onto it, then capset clears every capability.
    """
    if rootless:
        libc.unshare(libc.CLONE_NEWUSER)
        map_self(SANDBOX_UID, SANDBOX_GID, 0, 0)
        libc.drop_all_capabilities()
    else:
        if userns_fd >= 0:
            libc.setns(userns_fd, libc.CLONE_NEWUSER)
            os.close(userns_fd)
        os.setgroups([])
        os.setresgid(SANDBOX_GID, SANDBOX_GID, SANDBOX_GID)
        os.setresuid(SANDBOX_UID, SANDBOX_UID, SANDBOX_UID)
