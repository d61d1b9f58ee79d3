"""A newcomer on a fresh Debian 12 with Debian's own Python: clone, `scripts/bootstrap`, doctor, run.

The clone is of the working tree under test (the files `git add -A` would commit, as they are now,
committed into a scratch repo). It is bootstrapped with PYTHON=/usr/bin/python3 in a clean
environment (no pyenv on PATH, no pip config from this machine's home), as root and as an
unprivileged user (rootless, with no delegated cgroup: doctor warns that cgroups fall back to
rlimits). The two newcomers are set up at once, each in a thread of the module's fixture, each with
a pip cache of its own: a bootstrap is one pip process, which keeps one core of two busy, so the two
take about as long as one. Each newcomer's clone (its venv: ~1.1 GB, 26k files) is deleted in the
background once it is done (remove_later, tests/conftest.py): on this machine's disk (ext4 mounted
with discard) the module's teardown took 4 s idle, 47-94 s while other runs kept the disk busy.
"""

from __future__ import annotations

import fcntl
import os
import pwd
import re
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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
    remove_later: Callable[[Path], None]
    source_lock: threading.Lock = field(default_factory=threading.Lock)  # its owner is the one cloning it


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
        yield Scratch(base, source, remove_later)
    finally:
        remove_later(base)


def _newcomer(scratch: Scratch, name: str, env: dict[str, str], user: pwd.struct_passwd | None) -> str:
    """Clone, bootstrap (twice: the second must be a fast no-op), doctor, run; returns doctor's output.
    The clone is deleted in the background afterwards."""
    work = scratch.base / name
    work.mkdir()
    try:
        return _clone_bootstrap_doctor_run(scratch, work, env, user)
    finally:
        scratch.remove_later(work)


def _clone_bootstrap_doctor_run(scratch: Scratch, work: Path, env: dict[str, str],
                                user: pwd.struct_passwd | None) -> str:
    uid, gid = (user.pw_uid, user.pw_gid) if user else (os.geteuid(), os.getegid())
    os.chown(work, uid, gid)
    pip_cache = scratch.base / f"pip-cache-{work.name}"  # pip uses a cache only if it is the user's own
    pip_cache.mkdir()
    os.chown(pip_cache, uid, gid)
    env = {**{k: os.environ[k] for k in NETWORK_ENV if k in os.environ}, "LANG": "C.UTF-8",
           "PIP_CACHE_DIR": str(pip_cache), **env}
    times = {}

    def step(label: str, args: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
        t0 = time.monotonic()
        p = _run(args, cwd, env, timeout, user)
        times[label] = time.monotonic() - t0
        assert p.returncode == 0, f"{label} exited {p.returncode}:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
        return p

    with scratch.source_lock:
        _chown_tree(scratch.source, uid, gid)  # git refuses to clone from a repo someone else owns
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
    print(f"{work.name}: " + ", ".join(f"{k} {v:.1f} s" for k, v in times.items()))
    assert run.stdout == "42\n", run
    assert times["bootstrap again"] < 5, times
    debian = _run([PYTHON, "-c", "import sys; print(sys.version.split()[0])"], REPO).stdout.strip()
    assert f"python {debian}" in doctor.splitlines()[0], doctor
    assert not [line for line in doctor.splitlines() if line.strip().startswith("FAIL")], doctor
    return doctor


def _root_newcomer(scratch: Scratch) -> str:
    home = scratch.base / "root-home"  # a fresh root: none of this machine's ~/.config/pip, ~/.gitconfig
    home.mkdir()
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "HOME": str(home), "PYTHON": PYTHON,
           "ROLLBOX_HOME": str(scratch.base / "root-state")}  # not the machine's /var/lib/rollbox
    return _newcomer(scratch, "root", env, None)


def _user_newcomer(scratch: Scratch) -> tuple[str, int | None]:
    """Doctor's output, and the uid of the user made for it (None: this process is the unprivileged user)."""
    if os.geteuid() != 0:  # we are the unprivileged user
        env = {"PATH": "/usr/bin:/bin", "HOME": os.environ.get("HOME", "/nonexistent"), "PYTHON": PYTHON,
               "ROLLBOX_HOME": str(scratch.base / "user-state")}
        return _newcomer(scratch, "user", env, None), None
    # One user of rollbox-rootless at a time on a machine (tests/runtime/test_rootless.py takes it too).
    with open(LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        user = _ensure_user()
        try:
            env = {"PATH": "/usr/bin:/bin", "HOME": user.pw_dir, "PYTHON": PYTHON}
            return _newcomer(scratch, "user", env, user), user.pw_uid
        finally:
            shutil.rmtree(Path(user.pw_dir) / ".local" / "share" / "rollbox", ignore_errors=True)


@pytest.fixture(scope="module")
def newcomers(scratch: Scratch, request: pytest.FixtureRequest) -> Iterator[dict[str, Future[Any]]]:
    """The newcomers of this module's selected tests, started at once (each test waits for its own)."""
    selected = {item.name for item in request.session.items if item.path == request.path}
    pool = ThreadPoolExecutor(max_workers=2)
    runs: dict[str, Future[Any]] = {}
    if "test_clone_bootstrap_run_as_root" in selected and os.geteuid() == 0:
        runs["root"] = pool.submit(_root_newcomer, scratch)
    if "test_clone_bootstrap_run_as_unprivileged_user" in selected:
        runs["user"] = pool.submit(_user_newcomer, scratch)
    try:
        yield runs
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


@pytest.mark.timeout(300)
@pytest.mark.skipif(os.geteuid() != 0, reason="the newcomer as root needs root")
def test_clone_bootstrap_run_as_root(newcomers: dict[str, Future[Any]]) -> None:
    doctor = newcomers["root"].result()
    assert "uid 0 (root)" in doctor


@pytest.mark.timeout(300)
def test_clone_bootstrap_run_as_unprivileged_user(newcomers: dict[str, Future[Any]]) -> None:
    doctor, uid = newcomers["user"].result()
    if uid is None:  # we are the unprivileged user
        assert "(rootless)" in doctor
        return
    assert f"uid {uid} (rootless)" in doctor
    # no cgroup delegated to this user: limits fall back to rlimits, a warning and not a failure
    cgroups = [line.strip() for line in doctor.splitlines() if line.strip().startswith(("ok   cgroups", "warn cgroups"))]
    assert len(cgroups) == 1 and cgroups[0].startswith("warn cgroups: not available"), doctor
    assert "memory and pids fall back to rlimits" in cgroups[0], doctor
    # every sandbox runs as the caller: its own user namespace caps its share of the caller's budgets
    share = int(Path("/proc/sys/fs/inotify/max_user_instances").read_text()) // 8
    assert f"its own namespace caps its share: {share} inotify instances" in doctor, doctor
    subuid = [line.strip() for line in doctor.splitlines() if line.strip().startswith("info subordinate uids:")]
    assert len(subuid) == 1 and re.search(r"grants \d+; used to build language snapshots|none granted", subuid[0]), doctor
