"""Fixtures for the snapshot tests: a session-wide real S3 server (SeaweedFS) and a bucket per test."""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import pytest

from .s3server import S3Factory, SeaweedS3, store_factory


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


@pytest.fixture
def s3_url(seaweed: SeaweedS3) -> str:
    """A fresh bucket (and a prefix in it) for one test."""
    return f"s3://{seaweed.new_bucket()}/snapshots"


@pytest.fixture
def make_s3(seaweed: SeaweedS3) -> S3Factory:
    return store_factory(seaweed)
