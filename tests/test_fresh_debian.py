"""A newcomer on a fresh Debian 12 with Debian's own Python: clone, `scripts/bootstrap`, doctor, run.

The clone is of the working tree under test (the files `git add -A` would commit, as they are now,
committed into a scratch repo). It is bootstrapped with PYTHON=/usr/bin/python3 in a clean
environment (no pyenv on PATH, no pip config from this machine's home), as root and as an
unprivileged user (rootless, with no delegated cgroup: doctor warns that cgroups fall back to
rlimits). Both share one pip cache (which saves nothing where a proxy makes downloads uncacheable).
Each newcomer's clone (its venv: ~1.1 GB, 26k files) is deleted in the background once its test is
done (remove_later, tests/conftest.py): on this machine's disk that is ~30 s of waiting per venv.
"""

from __future__ import annotations

import fcntl
import os
import pwd
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.runtime.test_rootless import LOCK, _ensure_user

REPO = Path(__file__).resolve().parents[1]
PYTHON = "/usr/bin/python3"
# what describes this machine's network to pip, passed through; nothing else of this environment is
NETWORK_ENV = ("http_proxy", "https_proxy", "no_proxy", "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "SSL_CERT_FILE",
               "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE", "PIP_CERT", "PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL",
               "PIP_TRUSTED_HOST", "PIP_DEFAULT_TIMEOUT")


def _why_not() -> str | None:
    if shutil.which("git") is None:
        return "git is not installed (a newcomer clones the repo with it)"
    if not os.access(PYTHON, os.X_OK):
        return f"{PYTHON} is absent (install Debian's python3)"
    p = subprocess.run([PYTHON, "-c", "import sys; print(sys.version.split()[0]); sys.exit(sys.version_info < (3, 11))"],
                       capture_output=True, text=True)
    if p.returncode:
        return f"{PYTHON} is Python {p.stdout.strip() or '?'}; rollbox needs 3.11+"
    if os.geteuid() != 0 and subprocess.run([PYTHON, "-c", "import ensurepip, venv"], capture_output=True).returncode:
        return f"{PYTHON} cannot make a venv (Debian package python3-venv) and only root may install it"
    return None


WHY_NOT = _why_not()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or "")]


def _run(args: list[str], cwd: Path, env: dict[str, str] | None = None, timeout: float = 60,
         user: pwd.struct_passwd | None = None) -> subprocess.CompletedProcess[str]:
    as_user = {"user": user.pw_uid, "group": user.pw_gid, "extra_groups": []} if user else {}
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, **as_user)


def _git(*args: str, cwd: Path) -> str:
    p = _run(["git", *args], cwd)
    assert p.returncode == 0, f"git {' '.join(args)}: {p.stderr}"
    return p.stdout


def _chown_tree(top: Path, uid: int, gid: int) -> None:
    for d, dirs, files in os.walk(top):
        for name in [".", *dirs, *files]:
            os.lchown(os.path.join(d, name), uid, gid)


@dataclass(frozen=True)
class Scratch:
    base: Path  # under /tmp, searchable by the unprivileged user
    source: Path  # a repo whose HEAD is the working tree under test
    pip_cache: Path
    remove_later: Callable[[Path], None]


@pytest.fixture(scope="module")
def scratch(remove_later: Callable[[Path], None]) -> Iterator[Scratch]:
    base = Path(tempfile.mkdtemp(prefix="rollbox-fresh-debian-", dir="/tmp"))
    try:
        base.chmod(0o755)
        source = base / "source"
        _git("clone", "-q", "--no-hardlinks", str(REPO), str(source), cwd=base)
        # every file `git add -A` would commit: edits and new files not committed yet are under test too
        for rel in filter(None, _git("ls-files", "-z", "--cached", "--others", "--exclude-standard", cwd=REPO).split("\0")):
            src, dst = REPO / rel, source / rel
            if dst.is_symlink() or dst.is_file():
                dst.unlink()
            if src.is_symlink():
                dst.symlink_to(os.readlink(src))
            elif src.is_file():
                dst.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, dst)
        _git("add", "-A", cwd=source)
        if _git("status", "--porcelain", cwd=source):
            _git("-c", "user.name=rollbox tests", "-c", "user.email=tests@rollbox.invalid",
                 "commit", "-q", "-m", "the working tree under test", cwd=source)
        yield Scratch(base, source, base / "pip-cache", remove_later)
    finally:
        remove_later(base)


def _newcomer(scratch: Scratch, name: str, env: dict[str, str], user: pwd.struct_passwd | None) -> str:
    """Clone, bootstrap (twice: the second must be a fast no-op), doctor, run; returns doctor's output."""
    uid, gid = (user.pw_uid, user.pw_gid) if user else (os.geteuid(), os.getegid())
    _chown_tree(scratch.source, uid, gid)  # git refuses to clone from a repo someone else owns
    work = scratch.base / name
    work.mkdir()
    try:
        return _bootstrap_doctor_run(scratch, name, env, user, work)
    finally:
        scratch.remove_later(work)


def _bootstrap_doctor_run(scratch: Scratch, name: str, env: dict[str, str], user: pwd.struct_passwd | None,
                          work: Path) -> str:
    uid, gid = (user.pw_uid, user.pw_gid) if user else (os.geteuid(), os.getegid())
    os.chown(work, uid, gid)
    scratch.pip_cache.mkdir(exist_ok=True)
    _chown_tree(scratch.pip_cache, uid, gid)  # pip uses a cache only if it is the user's own
    env = {**{k: os.environ[k] for k in NETWORK_ENV if k in os.environ}, "LANG": "C.UTF-8",
           "PIP_CACHE_DIR": str(scratch.pip_cache), **env}
    times = {}

    def step(label: str, args: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
        t0 = time.monotonic()
        p = _run(args, cwd, env, timeout, user)
        times[label] = time.monotonic() - t0
        assert p.returncode == 0, f"{label} exited {p.returncode}:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
        return p

    step("git clone", ["git", "clone", "-q", str(scratch.source), "rollbox"], work, 60)
    clone = work / "rollbox"
    boot = step("bootstrap", ["scripts/bootstrap"], clone, 240)
    assert "home = /usr/bin\n" in (clone / ".venv" / "pyvenv.cfg").read_text()  # made from Debian's Python
    # it prints what matters, not pip's and setuptools' chatter (issue 26: ~250 lines, most of them
    # setuptools' `project.license` deprecation warning)
    said = (boot.stdout + boot.stderr).splitlines()
    assert said[-1].startswith("bootstrap: .venv ready: rollbox "), said[-20:]
    assert not [line for line in said if re.search(r"warning|deprecat", line, re.I)], said[:40]
    step("bootstrap again", ["scripts/bootstrap"], clone, 60)
    doctor = step("rollbox doctor", [".venv/bin/rollbox", "doctor"], clone, 60).stdout
    run = step("rollbox run", [".venv/bin/rollbox", "run", "--code", "print(6 * 7)"], clone, 60)
    print(f"{name}: " + ", ".join(f"{k} {v:.1f} s" for k, v in times.items()))
    assert run.stdout == "42\n", run
    assert times["bootstrap again"] < 5, times
    debian = _run([PYTHON, "-c", "import sys; print(sys.version.split()[0])"], REPO).stdout.strip()
    assert f"python {debian}" in doctor.splitlines()[0], doctor
    assert not [line for line in doctor.splitlines() if line.strip().startswith("FAIL")], doctor
    return doctor


@pytest.mark.timeout(300)
@pytest.mark.skipif(os.geteuid() != 0, reason="the newcomer as root needs root")
def test_clone_bootstrap_run_as_root(scratch: Scratch) -> None:
    home = scratch.base / "root-home"  # a fresh root: none of this machine's ~/.config/pip, ~/.gitconfig
    home.mkdir()
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "HOME": str(home), "PYTHON": PYTHON,
           "ROLLBOX_HOME": str(scratch.base / "root-state")}  # not the machine's /var/lib/rollbox
    doctor = _newcomer(scratch, "root", env, None)
    assert "uid 0 (root)" in doctor


@pytest.mark.timeout(300)
def test_clone_bootstrap_run_as_unprivileged_user(scratch: Scratch) -> None:
    if os.geteuid() != 0:  # we are the unprivileged user
        env = {"PATH": "/usr/bin:/bin", "HOME": os.environ.get("HOME", "/nonexistent"), "PYTHON": PYTHON,
               "ROLLBOX_HOME": str(scratch.base / "user-state")}
        doctor = _newcomer(scratch, "user", env, None)
        assert "(rootless)" in doctor
        return
    # One user of rollbox-rootless at a time on a machine (tests/runtime/test_rootless.py takes it too).
    with open(LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        user = _ensure_user()
        try:
            env = {"PATH": "/usr/bin:/bin", "HOME": user.pw_dir, "PYTHON": PYTHON}
            doctor = _newcomer(scratch, "user", env, user)
        finally:
            shutil.rmtree(Path(user.pw_dir) / ".local" / "share" / "rollbox", ignore_errors=True)
    assert f"uid {user.pw_uid} (rootless)" in doctor
    # no cgroup delegated to this user: limits fall back to rlimits, a warning and not a failure
    cgroups = [line.strip() for line in doctor.splitlines() if line.strip().startswith(("ok   cgroups", "warn cgroups"))]
    assert len(cgroups) == 1 and cgroups[0].startswith("warn cgroups: not available"), doctor
    assert "memory and pids fall back to rlimits" in cgroups[0], doctor
    # every sandbox runs as the caller: its own user namespace caps its share of the caller's budgets
    share = int(Path("/proc/sys/fs/inotify/max_user_instances").read_text()) // 8
    assert f"its own namespace caps its share: {share} inotify instances" in doctor, doctor
    subuid = [line.strip() for line in doctor.splitlines() if line.strip().startswith("info subordinate uids:")]
    assert len(subuid) == 1 and re.search(r"grants \d+; not used|none granted", subuid[0]), doctor
