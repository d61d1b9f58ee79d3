"""Makes user namespaces owned by given host uids, one per sandbox slot (stdlib only; root only).

Run by the supervisor as ``python -I -S`` (a single-threaded process: unshare(CLONE_NEWUSER) refuses
threaded ones) with a socket and the owner uids. For each owner it forks a child that becomes that
uid and unshares a user namespace; this process (root) writes the namespace's maps, and the child
sends back an fd of it. The fds go to the supervisor in one message; the children exit,
the namespaces live on through the fds.

Why the owner matters: the kernel charges a namespace's per-user counts (processes under
RLIMIT_NPROC, inotify instances and watches, POSIX message queues, pending signals) to the
namespace's owner in the parent namespace, so sandboxes in namespaces of distinct owners get a
budget each.

Where the layers' filesystems take idmapped mounts (``probe``: checked once, in a throwaway mount
namespace, with the overlay the sandboxes stack), the namespace's map also puts uid 1000 on the
owner: a sandbox's processes then run as a host uid of their own, so what the kernel counts per
host uid (pipe buffers, keyrings) is per sandbox too, and its layers are stacked through the same
map (runtime/isolation/mounts.py), so files keep uid 1000 on disk. Elsewhere (a container whose
root filesystem is an overlay refuses idmapped mounts) the maps are identity: processes run as host
uid 1000, the namespace owner still gives each sandbox the per-namespace budgets above.
"""

from __future__ import annotations

import json
import os
import socket
import sys

from rollbox.runtime.isolation import libc
from rollbox.runtime.isolation.users import SANDBOX_UID

IDENTITY = "0 0 4294967295"  # every id as on the host, like the initial namespace's own map
LAST = 4294967295  # (uid -1 is never mapped)


def shifted_map(owner: int) -> str:
    """Every uid as on the host except the sandbox user's: 1000 inside is ``owner`` outside (and the
    owner's own uid, whose place 1000 takes, is left unmapped)."""
    after = SANDBOX_UID + 1
    return (f"0 0 {SANDBOX_UID}\n{SANDBOX_UID} {owner} 1\n{after} {after} {owner - after}\n"
            f"{owner + 1} {owner + 1} {LAST - owner - 1}\n")


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


def make(owners: list[int], shift: bool = False) -> list[int]:
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
                        f.write(shifted_map(owner) if shift and name == "uid_map" else IDENTITY)
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


def probe_idmap(paths: list[str], owner: int) -> str:
    """"" if an overlay of idmapped mounts works here: lower layers on the filesystems of ``paths``
    (the layer store, the skeletons), idmapped, and a plain upper layer on a tmpfs, as sandboxes stack
    them (runtime/isolation/mounts.py); else why not."""
    ns_fd = make([owner], shift=True)[0]
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            libc.unshare(libc.CLONE_NEWNS)
            libc.mount("none", "/", None, libc.MS_REC | libc.MS_PRIVATE)
            lowers = [libc.idmapped_clone(p, ns_fd) for p in paths[1:]]
            scratch = paths[0]  # a tmpfs over a directory of ours, in this namespace only
            libc.mount("tmpfs", scratch, "tmpfs", 0, "size=64k")
            for d in ("upper", "work", "root"):
                os.mkdir(f"{scratch}/{d}")
            lower = ":".join(f"/proc/self/fd/{fd}" for fd in lowers)
            libc.mount("overlay", f"{scratch}/root", "overlay", 0,
                       f"lowerdir={lower},upperdir={scratch}/upper,workdir={scratch}/work")
            os._exit(0)
        except BaseException as exc:
            os.write(w, f"{exc}".encode()[:1000])
            os._exit(1)
    os.close(w)
    why = b""
    while chunk := os.read(r, 1024):
        why += chunk
    os.close(r)
    os.close(ns_fd)
    _, status = os.waitpid(pid, 0)
    return "" if status == 0 else (why.decode(errors="replace") or f"probe exited with status {status}")


def main(sock_fd: int, request_json: str) -> None:
    """``request_json``: {"owners": [uid, ...], "shift": bool} or, the first time, {"owners": [...],
    "probe": [scratch dir, layer dir, skeleton dir, ...]} (shift if the probe succeeds)."""
    sock = socket.socket(fileno=sock_fd)
    req = json.loads(request_json)
    reply: dict[str, object] = {}
    try:
        shift = bool(req.get("shift"))
        if req.get("probe"):
            why = probe_idmap(req["probe"], req["owners"][0])
            shift = not why
            reply["idmap_error"] = why
        fds = make(req["owners"], shift)
    except OSError as exc:
        sock.sendall(json.dumps({"error": str(exc)}).encode())
        sys.exit(1)
    socket.send_fds(sock, [json.dumps({**reply, "n": len(fds), "shift": shift}).encode()], fds)
