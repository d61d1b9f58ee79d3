"""The locustfile and the service benchmark still work: short real runs against a real server."""

from __future__ import annotations

import csv
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from svc_testkit import ServerProc, start_server

ROOT = Path(__file__).resolve().parents[2]
FAST = ("--think-min-s", "0.05", "--think-max-s", "0.1")  # the model thinks for 50-100 ms, not 2-10 s


def run_locust(host: str, env: dict[str, str], *extra: str) -> subprocess.CompletedProcess[str]:
    """locust monkey-patches the standard library with gevent: run it in its own process."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("ROLLBOX_")}
    return subprocess.run(
        [sys.executable, "-m", "locust", "-f", str(ROOT / "loadtest" / "locustfile.py"), "--headless",
         "--host", host, "--only-summary", *FAST, *extra],
        capture_output=True, text=True, timeout=90, env={**clean, **env},
    )


def read_rows(prefix: Path) -> dict[str, dict[str, str]]:
    with open(f"{prefix}_stats.csv") as f:
        return {r["Name"]: r for r in csv.DictReader(f)}


def printed_counts(out: str) -> dict[str, int]:
    """Request counts per name from the stats tables Locust printed. The last table is the final one,
    while the CSV holds its last periodic write, up to a second older; counts only grow, so the
    largest seen is the final one, whichever stream a table went to."""
    counts: dict[str, int] = {}
    for m in re.finditer(r"^POST\s+(.+?)\s+(\d+)\s+\d+\(", out, re.M):
        counts[m.group(1)] = max(counts.get(m.group(1), 0), int(m.group(2)))
    return counts


@pytest.fixture
def small_server(tmp_path: Path) -> Iterator[ServerProc]:
    """Its own `rollbox serve` with room for 2 live sandboxes: 6 users get 429s and must retry."""
    srv = start_server(tmp_path / "serve", "--max-live", "2")
    yield srv
    rc = srv.stop()
    assert rc == 0, f"rollbox serve exited with {rc}:\n{srv.log_path.read_text()[-4000:]}"


def test_locustfile_plays_episodes(small_server: ServerProc, tmp_path: Path) -> None:
    url = small_server.url.rstrip("/")
    # Two `rollbox serve` processes cannot share sandboxes yet (durable sandboxes are being added), and
    # each step goes to the next host, so --hosts names the same server twice: this checks the turns.
    p = run_locust(
        url, {"ROLLBOX_LOCUST_STAGE_S": "1.5", "ROLLBOX_LOCUST_USERS": "6"},  # burst, pause, burst: 4.5 s
        "--hosts", f"{url},{url}", "--steps", "3", "--retry-attempts", "100", "--retry-budget-s", "20",
        "--stop-timeout", "10", "--server-pid", str(small_server.pid), "--csv", str(tmp_path / "run"),
    )
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    rows = read_rows(tmp_path / "run")
    for name in ("create", "exec", "destroy"):
        assert int(rows[name]["Request Count"]) > 0 and int(rows[name]["Failure Count"]) == 0, rows[name]
    final = printed_counts(out)
    assert {"create", "exec", "destroy"} <= set(final), out[-4000:]  # (Locust's table as this test reads it)
    assert final["exec"] >= final["create"] > 0, final
    assert final["destroy"] == final["create"], out[-4000:]  # every episode ended with its destroy

    # 6 users, 2 sandboxes: refused creates are retried, in their own row and not as failures ...
    retried = {name: r for name, r in rows.items() if name.startswith("retry ")}
    assert "retry create" in retried, sorted(rows)
    assert all(int(r["Failure Count"]) == 0 for r in retried.values()), retried
    # ... with the same event id, which the server then ran
    events = [r for r in small_server.log_records() if r.get("msg") == "event" and r.get("source") == "/loadtest/locust"]
    refused = {r["event_id"] for r in events if r["status"] in (429, 503)}
    answered = {r["event_id"] for r in events if r["status"] == 200}
    assert refused and refused <= answered, refused - answered
    assert sum(r["status"] in (429, 503) for r in events) == sum(int(r["Request Count"]) for r in retried.values())

    summary = p.stdout[p.stdout.index("rollbox locust summary"):]
    turns = [int(n) for n in re.findall(r"#[12] \S+ (\d+) requests", summary)]
    assert len(turns) == 2 and min(turns) > 0 and abs(turns[0] - turns[1]) <= 10, summary  # each user alternates
    rss = re.search(r"server peak memory \(PSS\): ([\d.]+) MiB", summary)
    assert rss and float(rss.group(1)) > 10, summary
    for counter in ("rollbox_resumes_total", "rollbox_hibernations_total"):
        assert re.search(rf"{counter} (\d+|n/a)", summary), summary
    # every sandbox the episodes created was destroyed
    metrics = httpx.get(url + "/metrics").text
    assert re.search(r"^rollbox_live_sandboxes 0(\.0)?$", metrics, re.M), metrics


def test_locust_plain_run_and_p99_threshold(server: ServerProc) -> None:
    # ROLLBOX_LOCUST_SHAPE=none: Locust's -u -r -t apply; a p99 over --max-p99-ms turns the run red
    p = run_locust(server.url.rstrip("/"), {"ROLLBOX_LOCUST_SHAPE": "none"},
                   "-u", "2", "-r", "2", "-t", "2s", "--max-p99-ms", "0.5")
    out = p.stdout + p.stderr
    assert p.returncode == 1 and "thresholds failed: p99" in out, out[-3000:]
    assert re.search(r"requests: [1-9]\d*, 0 failed", out), out[-3000:]


def test_locust_thresholds_fail_the_run() -> None:
    # nothing listens on this port: every request fails, and the quitting listener must say so
    p = run_locust("http://127.0.0.1:9", {"ROLLBOX_LOCUST_SHAPE": "none"}, "-u", "1", "-r", "1", "-t", "2s")
    out = p.stdout + p.stderr
    assert p.returncode == 1 and "thresholds failed: fail ratio" in out, out[-3000:]
    assert "rollbox_resumes_total n/a" in out, out[-3000:]


def test_bench_service_runs(tmp_path: Path) -> None:
    p = subprocess.run(
        [sys.executable, str(ROOT / "loadtest" / "bench_service.py"), "-c", "2", "-n", "10"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    header, on, off = p.stdout.splitlines()[:3]
    assert header.split()[:3] == ["path", "concurrency", "requests"]
    assert on.split()[:4] == ["rec", "on", "2", "10"] and off.split()[:4] == ["rec", "off", "2", "10"]
    assert float(on.split()[4]) > 0 and float(off.split()[4]) > 0
    assert "recording on vs off at c2:" in p.stdout
    assert "flushed 1 Parquet files" in p.stdout  # 10 runs of one experiment, flushed at the server's exit
