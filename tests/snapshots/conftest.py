"""Fixtures for the snapshot tests: a bucket per test on the session's S3 server (tests/conftest.py)."""

from __future__ import annotations

import pytest

from .s3server import S3Factory, SeaweedS3, store_factory


@pytest.fixture
def s3_url(seaweed: SeaweedS3) -> str:
    """A fresh bucket (and a prefix in it) for one test."""
    return f"s3://{seaweed.new_bucket()}/snapshots"


@pytest.fixture
def make_s3(seaweed: SeaweedS3) -> S3Factory:
    return store_factory(seaweed)
