"""Fixtures shared by the test folders: a session-wide real S3 server (SeaweedFS on 127.0.0.1); trees
deleted in the background; the suite's workers (pytest-xdist, one more than the cores: most tests wait on
servers, sandboxes and subprocesses) and the tests that need the box to themselves (``quiet``)."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.snapshots.s3server import SeaweedS3


@pytest.fixture(scope="session")
def seaweed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedS3]:
    base = tmp_path_factory.mktemp("seaweedfs")
    server = SeaweedS3(base)
    server.start()
    try:
        yield server
    finally:
        server.stop()
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="session")
def remove_later() -> Iterator[Callable[[Path], None]]:
    """Deletes a tree in the background (renamed at once, then `rm -rf`), waited for at the session's end.
    For trees of a GB such as a venv: on a disk mounted with discard (this machine's ext4), deleting one
    took 4 s on an idle machine and 30-90 s while other runs kept the disk busy, under a second of it CPU:
    time the tests after it need not wait."""
    procs: list[tuple[subprocess.Popen[bytes], Path]] = []

    def remove(path: Path) -> None:
        if not path.exists():
            return
        trash = path.with_name(f".{path.name}.deleting-{uuid.uuid4().hex[:8]}")
        path.rename(trash)
        procs.append((subprocess.Popen(["rm", "-rf", "--one-file-system", "--", str(trash)]), trash))

    yield remove
    for proc, trash in procs:
        assert proc.wait() == 0 and not trash.exists(), f"rm -rf {trash} exited {proc.returncode}"


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto`` (the suite's default, pyproject.toml): one worker more than the cores, at most 6. A serial
    run kept 2 cores ~35 % busy (tests wait on servers, sandboxes and subprocesses more than they compute)."""
    return min(6, (os.cpu_count() or 1) + 1)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "quiet: needs the box to itself; waits until no other worker runs a test")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Every test of a parallel run holds the run's box lock shared, its fixtures' set-up and tear-down
    of every scope included; a ``quiet`` test holds it alone, so what it measures (a CPU cap's level, say)
    is not the other workers' load. A turnstile keeps a waiting quiet test from being starved: while it
    waits, no other test starts. The lock files are in the run's base directory (the workers' own are
    under it; pytest prunes old ones), so a suite run inside a test (tests/runtime/test_rootless.py) has
    its own."""
    if not os.environ.get("PYTEST_XDIST_WORKER") or not item.config.option.basetemp:  # a serial run
        return (yield)
    quiet = item.get_closest_marker("quiet") is not None
    run = Path(item.config.option.basetemp).parent  # <the run's base>/popen-gwN: the workers' common parent
    main = os.open(run / "box.lock", os.O_RDWR | os.O_CREAT, 0o600)
    gate = os.open(run / "box.gate", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(gate, fcntl.LOCK_EX)
        fcntl.flock(main, fcntl.LOCK_EX if quiet else fcntl.LOCK_SH)
        if not quiet:
            fcntl.flock(gate, fcntl.LOCK_UN)
        return (yield)
    finally:
        os.close(main)  # (releases the locks)
        os.close(gate)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A quiet test may wait for the longest test another worker runs: its timeout counts from after that."""
    for item in items:
        if item.get_closest_marker("quiet") is not None:
            marker = item.get_closest_marker("timeout")
            limit = marker.args[0] if marker and marker.args else config.getini("timeout")
            item.add_marker(pytest.mark.timeout(float(limit or 120) + 300))
