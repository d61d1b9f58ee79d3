"""Fixtures shared by the test folders: a session-wide real S3 server (SeaweedFS on 127.0.0.1); trees
deleted in the background."""

from __future__ import annotations

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
