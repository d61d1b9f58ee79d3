"""`rollbox serve` checks its store at start: a store that cannot work (no such bucket, refused
credentials) stops it at once with a message saying what to fix; an unreachable one (an outage) lets it
start, but /readyz says it is not ready, so a load balancer sends it no steps. Real SeaweedFS."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx
from svc_testkit import start_server

from tests.snapshots.s3server import ACCESS_KEY, SECRET_KEY, SeaweedS3

SERVE = [sys.executable, "-m", "rollbox.functions.cli", "serve", "--port", "0"]


def _env(seaweed_endpoint: str, bucket: str, key: str = ACCESS_KEY) -> dict[str, str]:
    return {"PATH": "/usr/bin:/bin", "AWS_ACCESS_KEY_ID": key, "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_REGION": "us-east-1", "ROLLBOX_STORE": f"s3://{bucket}/p", "AWS_ENDPOINT_URL": seaweed_endpoint,
            "ROLLBOX_S3_MAX_ATTEMPTS": "1"}


def _serve_fails(tmp_path: Path, env: dict[str, str]) -> str:
    t0 = time.monotonic()
    p = subprocess.run([*SERVE, "--home", str(tmp_path / "home")], env=env, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 1 and time.monotonic() - t0 < 30, (p.returncode, p.stderr[-2000:])
    return p.stdout + p.stderr


def test_a_missing_bucket_stops_the_server_at_once(seaweed: SeaweedS3, tmp_path: Path) -> None:
    out = _serve_fails(tmp_path, _env(seaweed.endpoint, "no-such-bucket-here"))
    assert "no-such-bucket-here" in out and "does not exist" in out and "create the bucket" in out


def test_refused_credentials_stop_the_server_at_once(seaweed: SeaweedS3, tmp_path: Path) -> None:
    out = _serve_fails(tmp_path, _env(seaweed.endpoint, seaweed.new_bucket(), key="not-a-key"))
    assert "refused access" in out and "credentials" in out


def test_an_unreachable_store_starts_unready(tmp_path: Path) -> None:
    env = _env("http://127.0.0.1:1", "some-bucket")
    srv = start_server(tmp_path, "--home", str(tmp_path / "home"), env=env)
    try:
        r = httpx.get(srv.url + "readyz", timeout=10)
        assert (r.status_code, r.json()["status"], r.json()["store_ok"]) == (503, "store unavailable", False)
        assert httpx.get(srv.url + "healthz", timeout=10).status_code == 200  # up, just not ready
        assert any("cannot be reached" in str(rec.get("msg")) for rec in srv.log_records())
    finally:
        assert srv.stop() == 0
