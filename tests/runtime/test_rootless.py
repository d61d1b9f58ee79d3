"""The same runtime suite, rootless: run by an unprivileged user through user namespaces.

As root, this test creates an unprivileged user, delegates it a cgroup v1 subtree (as systemd
delegates one per user on cgroup v2 hosts) and runs tests/runtime as that user. Inside that run the
fallback test below checks the no-cgroup path (rlimits) too.
"""

from __future__ import annotations

import fcntl
import os
import pwd
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from rollbox.runtime.isolation.cgroups import mounts_of

USER = "rollbox-rootless"
LOCK = "/tmp/rollbox-rootless-test.lock"  # one run as USER at a time (tests/test_fresh_debian.py too)
REPO = Path(__file__).resolve().parents[2]


def _ensure_user() -> pwd.struct_passwd:
    try:
        return pwd.getpwnam(USER)
    except KeyError:
        subprocess.run(["useradd", "--create-home", "--shell", "/bin/sh", USER], check=True)
        return pwd.getpwnam(USER)


def _reachable(paths: list[Path]) -> list[tuple[Path, int]]:
    """Give 'others' search (x) permission on every ancestor that lacks it; returns what to restore."""
    changed: list[tuple[Path, int]] = []
    for path in paths:
        for d in [path, *path.parents]:
            mode = d.stat().st_mode
            if d.is_dir() and not mode & 0o001:
                os.chmod(d, mode | 0o001)
                changed.append((d, mode))
    return changed


@pytest.mark.skipif(os.geteuid() != 0, reason="as root it runs this suite rootless; rootless it is the suite")
def test_runtime_suite_passes_rootless() -> None:
    # One rootless run at a time on a machine: runs share the user and the search bits on ancestors.
    lock = open(LOCK, "w")  # noqa: SIM115
    fcntl.flock(lock, fcntl.LOCK_EX)
    user = _ensure_user()
    parent = f"rollbox-{user.pw_uid}-{os.getpid()}"
    roots = mounts_of("cgroup")
    delegated = []
    for ctrl in ("memory", "pids", "cpu", "cpuacct"):
        if ctrl in roots:
            d = Path(roots[ctrl]) / parent
            d.mkdir(exist_ok=True)
            for f in [d, *(d / n for n in ("cgroup.procs", "tasks"))]:
                os.chown(f, user.pw_uid, user.pw_gid)
            delegated.append(d)
    python = Path(sys.executable)
    restore = _reachable([REPO, python.parent, Path(os.path.realpath(python)).parent])
    try:
        env = {
            "PATH": "/usr/bin:/bin", "HOME": user.pw_dir, "LANG": "C.UTF-8",
            "ROLLBOX_TEST_CGROUP_PARENT": parent,
        }
        proc = subprocess.run(
            [str(python), "-m", "pytest", "-p", "no:cacheprovider", "-q",
             "-x", "tests/runtime", "--deselect", "tests/runtime/test_leaks.py"],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
            user=user.pw_uid, group=user.pw_gid, extra_groups=[],
        )
    finally:
        for d, mode in reversed(restore):
            os.chmod(d, mode)
        for d in delegated:
            for child in d.iterdir():
                if child.is_dir():
                    child.rmdir()
            d.rmdir()
        shutil.rmtree(Path(user.pw_dir) / ".local" / "share" / "rollbox", ignore_errors=True)
        lock.close()
    tail = proc.stdout[-3000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, tail
    assert " passed" in proc.stdout and "failed" not in proc.stdout, tail
