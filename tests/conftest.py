"""Fixtures shared by the test folders: a session-wide real S3 server (SeaweedFS on 127.0.0.1)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator

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
