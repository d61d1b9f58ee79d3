"""Makes user namespaces owned by given host uids, one per sandbox slot (stdlib only; root only).

Run by the supervisor as ``python -I -S`` (a single-threaded process: unshare(CLONE_NEWUSER) refuses
threaded ones) with a socket and the owner uids. For each owner it forks a child that becomes that
uid and unshares a user namespace; this process (root) writes the namespace's identity maps, and
the child sends back an fd of it. The fds go to the supervisor in one message; the children exit,
the namespaces live on through the fds.

Why the owner matters: the kernel charges a namespace's per-user counts (processes under
RLIMIT_NPROC, inotify instances and watches, POSIX message queues, pending signals) to the
namespace's owner in the parent namespace, so sandboxes in namespaces of distinct owners get a
budget each, while their processes keep uid 1000 and every file its owner (identity maps).
"""

from __future__ import annotations

import json
import os
import socket
import sys

from rollbox.runtime.isolation import libc

IDENTITY = "0 0 4294967295"  # every id as on the host, like the initial namespace's own map


def _child(sock: socket.socket, owner: int) -> None:
    try:
        os.setgroups([])
        os.setresgid(owner, owner, owner)
        os.setresuid(owner, owner, owner)
        libc.unshare(libc.CLONE_NEWUSER)
        sock.send(b"u")
        if sock.recv(1) != b"m":
            os._exit(1)
        fd = os.open("/proc/self/ns/user", os.O_RDONLY)  # its own: no ptrace access check on another uid's
        socket.send_fds(sock, [b"n"], [fd])
        os._exit(0)
    except BaseException as exc:
        sock.send(f"!{type(exc).__name__}: {exc}".encode())
        os._exit(1)


def make(owners: list[int]) -> list[int]:
    fds = []
    for owner in owners:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        pid = os.fork()
        if pid == 0:
            ours.close()
            _child(theirs, owner)
        theirs.close()
        try:
            first = ours.recv(256)
            if first != b"u":
                raise OSError(f"user namespace for uid {owner}: {first[1:].decode(errors='replace') or 'child died'}")
            for name in ("uid_map", "gid_map"):
                try:
                    with open(f"/proc/{pid}/{name}", "w") as f:
                        f.write(IDENTITY)
                except PermissionError as exc:  # a map with uid 0 in it needs CAP_SETFCAP (Linux >= 5.12)
                    raise OSError(f"writing the {name} of a user namespace: {exc.strerror} (mapping id 0 needs "
                                  "CAP_SETUID, CAP_SETGID and CAP_SETFCAP)") from None
            ours.send(b"m")
            _, got, _, _ = socket.recv_fds(ours, 1, 1)
            if not got:
                raise OSError(f"user namespace for uid {owner}: no fd came back")
            fds.append(got[0])
        finally:
            ours.close()
            os.waitpid(pid, 0)
    return fds


def main(sock_fd: int, owners_json: str) -> None:
    sock = socket.socket(fileno=sock_fd)
    try:
        fds = make(json.loads(owners_json))
    except OSError as exc:
        sock.sendall(json.dumps({"error": str(exc)}).encode())
        sys.exit(1)
    socket.send_fds(sock, [json.dumps({"n": len(fds)}).encode()], fds)
