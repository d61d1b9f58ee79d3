"""The locustfile and the service benchmark still work: short real runs against a real server."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

from svc_testkit import ServerProc

ROOT = Path(__file__).resolve().parents[2]


def run_locust(host: str, env: dict[str, str], *extra: str) -> subprocess.CompletedProcess[str]:
    """locust monkey-patches the standard library with gevent: run it in its own process."""
    return subprocess.run(
        [sys.executable, "-m", "locust", "-f", str(ROOT / "loadtest" / "locustfile.py"), "--headless",
         "--host", host, "--only-summary", *extra],
        capture_output=True, text=True, timeout=90, env={**os.environ, **env},
    )


def test_locustfile_plays_episodes(server: ServerProc, tmp_path: Path) -> None:
    env = {"ROLLBOX_LOCUST_STAGE_S": "2", "ROLLBOX_LOCUST_USERS": "4", "ROLLBOX_LOCUST_STEPS": "2"}
    p = run_locust(server.url.rstrip("/"), env, "--csv", str(tmp_path / "run"))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    with open(tmp_path / "run_stats.csv") as f:
        rows = {r["Name"]: r for r in csv.DictReader(f)}
    for name in ("create", "exec", "destroy"):
        assert int(rows[name]["Request Count"]) > 0 and int(rows[name]["Failure Count"]) == 0, rows[name]
    assert int(rows["exec"]["Request Count"]) >= int(rows["create"]["Request Count"])


def test_locust_thresholds_fail_the_run(tmp_path: Path) -> None:
    # nothing listens on this port: every request fails, and the quitting listener must say so
    p = run_locust("http://127.0.0.1:9", {"ROLLBOX_LOCUST_STAGE_S": "1", "ROLLBOX_LOCUST_USERS": "1"})
    assert p.returncode == 1 and "thresholds failed" in p.stdout + p.stderr


def test_bench_service_runs(tmp_path: Path) -> None:
    p = subprocess.run(
        [sys.executable, str(ROOT / "loadtest" / "bench_service.py"), "-c", "2", "-n", "10"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    header, row = p.stdout.splitlines()[:2]
    assert header.split()[:3] == ["path", "concurrency", "requests"] and row.split()[:3] == ["http", "2", "10"]
    assert float(row.split()[3]) > 0
