"""Building Debian roots without root: a user namespace with the caller's subordinate ids.

A Debian root holds files of many owners (root, _apt, man, the shadow group...), and dpkg chowns
every file it unpacks. A single-id namespace (what rollbox's sandboxes use) maps one owner only, so
the builder, run as an ordinary user, works in a namespace of its own with the whole id space a
Debian system needs: uid 0 is the caller, uids 1..65535 are its subordinate range from /etc/subuid
(the same for gids), set by the setuid helpers ``newuidmap``/``newgidmap`` (Debian package
``uidmap``). Debian 12's useradd and adduser give every new user a range of 65536 whenever
/etc/subuid exists (it does on a Debian 12 install, empty until the first such user).

Inside, the builder is root of that namespace (and of a mount namespace of its own) and runs what a
root build runs: mmdebstrap --mode=root, the tidy-up, the diff against the layer below and the
packing into the layer's canonical tar, so the tar records each file's real owner exactly as a root
build does. Outside, the caller (owner of the root-owned files, which is all it needs) stores that
tar; the tree it was packed from, with files of subordinate owners the caller cannot remove, is
removed inside the namespace too.

    check()                  # the maps, or InvalidRequest naming what is missing and the fix
    run(job, on_step)        # one job in a fresh namespace (a child process); returns its result
    remove(path)             # remove a tree left by a killed build (subordinate owners) the same way

The child (``userns.child()`` in a new interpreter) unshares, says so on stdout, and once the caller
has written its maps reads the job (JSON, one line) from stdin, reports ``step <text>`` lines and
ends with ``done <json>``.
"""

from __future__ import annotations

import collections
import json
import os
import pwd
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rollbox.runtime.errors import InvalidRequest, StoreError

IDS_NEEDED = 65535  # uids 1..65535 inside: Debian's system users and nobody/nogroup (65534)
SUBUID, SUBGID = "/etc/subuid", "/etc/subgid"


@dataclass(frozen=True)
class IdMaps:
    """The caller's id and its first subordinate range of at least IDS_NEEDED ids, for uids and gids."""

    uid: int
    gid: int
    sub_uid: int
    sub_gid: int
    count: int

    def uid_args(self) -> list[str]:
        return ["0", str(self.uid), "1", "1", str(self.sub_uid), str(self.count)]

    def gid_args(self) -> list[str]:
        return ["0", str(self.gid), "1", "1", str(self.sub_gid), str(self.count)]


def _range(path: str, names: set[str]) -> tuple[int, int] | None:
    """The first range of ``path`` (/etc/subuid format) granted to one of ``names`` with enough ids."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return None
    for line in text.splitlines():
        parts = line.strip().split(":")
        if (len(parts) == 3 and parts[0] in names and parts[1].isdigit() and parts[2].isdigit()
                and int(parts[2]) >= IDS_NEEDED):
            return int(parts[1]), int(parts[2])
    return None


def check() -> IdMaps:
    """What a rootless build needs (newuidmap, newgidmap, subordinate ranges in SUBUID and SUBGID), or
    InvalidRequest saying which is missing and the command root runs to give it."""
    subuid, subgid = SUBUID, SUBGID
    uid, gid = os.geteuid(), os.getegid()
    try:
        user = pwd.getpwuid(uid).pw_name
    except KeyError:
        user = str(uid)
    missing = [t for t in ("newuidmap", "newgidmap") if _which(t) is None]
    if missing:
        raise InvalidRequest(
            f"base.debian: building a Debian root as uid {uid} (not root) runs it in a user namespace whose ids "
            f"come from /etc/subuid and /etc/subgid, set by {' and '.join(missing)} (Debian package uidmap), "
            "which is not installed: as root, `apt-get install uidmap` (scripts/bootstrap names it)")
    names = {user, str(uid)}
    uids, gids = _range(subuid, names), _range(subgid, names)
    if uids is None or gids is None:
        which = " and ".join(p for p, r in ((subuid, uids), (subgid, gids)) if r is None)
        raise InvalidRequest(
            f"base.debian: building a Debian root as {user} (uid {uid}, not root) needs a range of {IDS_NEEDED + 1} "
            f"subordinate ids for it (Debian's system users and nobody own files), and {which} grants it none "
            f"that large; as root: `usermod --add-subuids 100000-165535 --add-subgids 100000-165535 {user}` "
            "(useradd gives one to every new user once /etc/subuid exists)")
    return IdMaps(uid, gid, uids[0], gids[0], min(uids[1], gids[1], IDS_NEEDED))


def _which(tool: str) -> str | None:
    return shutil.which(tool) or next((p for d in ("/usr/bin", "/usr/sbin") if os.access(p := f"{d}/{tool}", os.X_OK)),
                                      None)


def run(job: dict[str, Any], on_step: Callable[[str], None], maps: IdMaps | None = None) -> dict[str, Any]:
    """Run ``job`` in a child that is root of a new user namespace with ``maps`` (default: ``check()``)
    and of a new mount namespace; relay its steps; return its result. StoreError if it fails."""
    maps = maps or check()
    tail: collections.deque[str] = collections.deque(maxlen=40)
    result: dict[str, Any] | None = None
    argv = [sys.executable, "-c", "from rollbox.snapshots import userns; userns.child()"]
    with subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          errors="replace", env={**os.environ, "PYTHONUNBUFFERED": "1"}) as proc:
        assert proc.stdin is not None and proc.stdout is not None
        try:
            while (first := proc.stdout.readline()) and first.strip() != "unshared":
                tail.append(first.rstrip("\n"))
            if not first:
                why = "\n".join(tail)[-1500:] or f"exit {proc.wait()}"
                raise StoreError(f"cannot make a user namespace to build in: {why}")
            for tool, args in (("newuidmap", maps.uid_args()), ("newgidmap", maps.gid_args())):
                done = subprocess.run([_which(tool) or tool, str(proc.pid), *args], capture_output=True, text=True,
                                      check=False)
                if done.returncode != 0:
                    raise StoreError(f"{tool} {proc.pid} {' '.join(args)} failed: "
                                     f"{(done.stderr or done.stdout).strip()[-500:]}")
            proc.stdin.write(json.dumps(job) + "\n")
            proc.stdin.close()
            for line in proc.stdout:
                line = line.rstrip("\n")
                if line.startswith("step "):
                    on_step(line[5:])
                elif line.startswith("done "):
                    result = json.loads(line[5:])
                else:
                    tail.append(line)
        except BaseException:
            proc.kill()
            raise
    if proc.returncode != 0 or result is None:
        why = "\n".join(list(tail)[-25:])
        raise StoreError(why or f"the build in a user namespace failed (exit {proc.returncode})")
    return result


def remove(path: str) -> None:
    """Remove a tree whose files have subordinate owners (a build killed before it cleaned up)."""
    run({"op": "remove", "path": path}, lambda _msg: None)


def child() -> None:
    """The child's side (see the module docstring); a failure is its last line and exit status 1."""
    try:
        _child()
    except Exception as exc:
        print(f"{type(exc).__name__}: {exc}", flush=True)
        sys.exit(1)


def _child() -> None:
    from rollbox.runtime.isolation import libc

    libc.unshare(libc.CLONE_NEWUSER | libc.CLONE_NEWNS)
    print("unshared", flush=True)
    line = sys.stdin.readline()
    if not line:
        sys.exit(1)  # the caller gave up (its map failed)
    os.setgroups([])
    os.setresgid(0, 0, 0)
    os.setresuid(0, 0, 0)
    libc.mount("none", "/", None, libc.MS_REC | libc.MS_PRIVATE)
    job = json.loads(line)
    if job["op"] == "remove":
        from rollbox.snapshots.layers import remove_tree

        remove_tree(job["path"])
        out: dict[str, Any] = {}
    elif job["op"] == "build":
        from rollbox.snapshots import debian

        out = debian.run_build_job(job, lambda msg: print("step " + msg.replace("\n", " "), flush=True))
    else:
        raise SystemExit(f"unknown job {job['op']!r}")
    print("done " + json.dumps(out), flush=True)


__all__ = ["IdMaps", "check", "child", "remove", "run"]
