"""loadtest/bench_capacity.py, short: 2 replicas + SeaweedFS + HAProxy + distributed Locust (60 users),
a scale-to-zero-and-back wave in the middle; it prints CPU per request by component and the wave's figures."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def test_bench_capacity_short_run_with_a_wave(tmp_path: Path) -> None:
    p = subprocess.run(
        [sys.executable, str(ROOT / "loadtest" / "bench_capacity.py"), "--users", "60", "--spawn-rate", "60",
         "--think-min-s", "0.5", "--think-max-s", "1", "--run-s", "24", "--wave-at-s", "10", "--down-s", "2",
         "--wave-s", "10", "--base", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=110)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    cpu = {m.group(1): float(m.group(2)) for m in re.finditer(r"^  (\w+)\s+([\d.]+) ms  \(", p.stdout, re.M)}
    assert set(cpu) == {"servers", "sandboxes", "seaweedfs", "haproxy", "locust", "all"}, p.stdout
    assert all(v > 0 for v in cpu.values()), cpu
    assert abs(cpu["all"] - sum(v for k, v in cpu.items() if k != "all")) < 0.05, cpu
    m = re.search(r"failures (\d+), retries (\d+)", p.stdout)
    assert m and int(m.group(1)) == 0, p.stdout  # the wave's 503s were retried, none given up
    wave = re.search(r"wave: drained in [\d.]+ s \(exit codes \[0, 0\]\).*first reply ([\d.]+) s after.*"
                     r"first step answered to a user ([\d.]+) s after the start", p.stdout)
    assert wave and float(wave.group(1)) < 30 and 0 < float(wave.group(2)) < 30, p.stdout
    # Locust's own window of the wave: the steps its users sent from the replicas' start on
    window = re.search(r"steps sent in the wave .*: (\d+) steps \((\d+) 200\), p50 (\d+) ms, p99 (\d+) ms", p.stdout)
    assert window and int(window.group(1)) > 0 and int(window.group(4)) >= int(window.group(3)) > 0, p.stdout
    assert re.search(r"peak memory \(PSS\): replicas \d+ MiB, seaweedfs \d+ MiB, haproxy \d+ MiB", p.stdout)
    # every event answered wrote its record (a create-only PUT), and steps read (GETs)
    s3 = re.search(r"S3 requests per CloudEvent answered .*\((\d+) events\): [\d.]+ \((.*)\)", p.stdout)
    assert s3 and int(s3.group(1)) > 0, p.stdout
    ops = {op: float(n) for op, n in (kv.rsplit(" ", 1) for kv in s3.group(2).split(", "))}
    assert ops.get("PutObject", 0) >= 0.9 and ops.get("GetObject", 0) > 0, ops
    import csv
    series = list(csv.DictReader((tmp_path / "run" / "locust_cpu.csv").read_text().splitlines()))
    assert len(series) >= 2, series  # a row every 5 s of the 24 s run, but none across the wave's restart
    assert all(float(r["machine_busy_cores"]) > 0 and float(r["servers_cores"]) >= 0 for r in series), series
    # (a 5 s window may hold no request to a replica, and Locust's own CPU under a 10 ms tick: on a box shared
    # with other tests, Locust's users waited)
    assert sum(float(r["servers_cores"]) for r in series) > 0.01, series
    assert all(float(r["machine_steal_cores"]) >= 0 and float(r["locust_cores"]) >= 0 for r in series), series
    assert sum(float(r["locust_cores"]) for r in series) > 0, series
    # what the replicas did every 5 s: their counters' increments, summed over the replicas (the wave's new
    # processes counting from their start), so a run's windows add up to what they answered
    import json
    rows = [json.loads(line) for line in (tmp_path / "run" / "locust_replicas.jsonl").read_text().splitlines()]
    assert len(rows) >= 3 and all(r["replicas"] in (1, 2) for r in rows), rows
    assert all(v >= 0 for r in rows for v in r["counts"].values()), rows
    total = {k: sum(r["counts"].get(k, 0) for r in rows) for r in rows for k in r["counts"]}
    events = sum(v for k, v in total.items() if k.startswith("requests:"))
    assert total.get("requests:exec", 0) > 0 and total.get("resumes", 0) > 0, total
    assert total.get("store_requests:PutObject", 0) >= 0.9 * events > 0, total
    assert all({"inflight_requests", "live_sandboxes", "pool_size"} <= set(r["gauges"]) for r in rows), rows


def test_bench_capacity_sweep_quick_writes_the_curve(tmp_path: Path) -> None:
    """--sweep --quick: one replica on SeaweedFS, 3 points (live sandboxes, then hibernated episodes)."""
    import csv

    p = subprocess.run([sys.executable, str(ROOT / "loadtest" / "bench_capacity.py"), "--sweep", "--quick",
                        "--out", str(tmp_path)], capture_output=True, text=True, timeout=110)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    lines = (tmp_path / "capacity.csv").read_text().splitlines()
    assert lines[0].startswith("# bench_capacity.py --sweep --quick") and lines[1].startswith("# shared machine")
    rows = list(csv.DictReader(ln for ln in lines if not ln.startswith("#")))
    assert len(rows) == 3, p.stdout  # --quick runs every point, saturated or not
    for col in ("steps_per_s", "step_p50_ms", "step_p99_ms", "cpu_ms_per_step_server", "cpu_ms_per_step_sandboxes",
                "cpu_ms_per_step_store", "cpu_ms_per_step_loadgen", "mem_per_live_sandbox_kib",
                "mem_per_open_episode_kib", "s3_requests_per_step", "s3_bytes_per_step",
                "s3_stored_bytes_per_open_episode", "cold_start_s"):
        assert col in rows[0], col
    for r in rows:
        assert float(r["steps_per_s"]) > 0 and int(r["failures"]) == 0, r
        assert float(r["step_p99_ms"]) >= float(r["step_p50_ms"]) > 0, r
        assert all(float(r[f"cpu_ms_per_step_{c}"]) > 0 for c in ("server", "sandboxes", "store", "loadgen")), r
        assert float(r["s3_requests_per_step"]) > 0 and float(r["s3_bytes_per_step"]) > 0, r  # a durable step writes
        assert float(r["s3_stored_bytes_per_open_episode"]) > 0, r
    # the first points keep their sandboxes live, the last one's think outlasts --hibernate-after-s
    assert int(rows[1]["live_sandboxes"]) >= 12 and float(rows[1]["mem_per_live_sandbox_kib"]) > 0
    assert int(rows[2]["hibernated_episodes"]) > int(rows[2]["live_sandboxes"])
    assert 0 < float(rows[0]["cold_start_s"]) < 60
    png = tmp_path / "capacity.png"
    assert png.stat().st_size > 10_000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_stop_group_stops_the_workers_a_master_left(tmp_path: Path) -> None:
    """Locust's master can exit while the workers it forked still wait on requests (an overloaded run):
    the bench stops its whole process group, SIGKILL for what ignores SIGTERM."""
    import importlib.util
    import time

    spec = importlib.util.spec_from_file_location("bench_capacity", ROOT / "loadtest" / "bench_capacity.py")
    assert spec is not None and spec.loader is not None
    bc = importlib.util.module_from_spec(spec)
    sys.modules["bench_capacity"] = bc  # (its dataclasses look their module up there)
    spec.loader.exec_module(bc)
    pidfile = tmp_path / "worker.pid"
    # a "master" that leaves a "worker" behind it, one that ignores SIGTERM
    # (the worker writes its pid once it ignores SIGTERM; an ignored signal stays ignored across exec)
    worker_sh = f"trap '' TERM; echo $$ > {pidfile}.tmp; mv {pidfile}.tmp {pidfile}; exec sleep 300"
    master = subprocess.Popen(["sh", "-c", f'sh -c "{worker_sh}" & exec sleep 300'], start_new_session=True)
    while not pidfile.exists():
        time.sleep(0.05)
    worker = int(pidfile.read_text())
    assert bc._state(worker) not in ("", "Z")
    t0 = time.monotonic()
    bc.stop_group(master, grace_s=1.0)
    assert master.returncode is not None
    assert bc._state(worker) in ("", "Z"), bc._state(worker)  # gone (or a zombie nobody reaps here)
    assert 1.0 <= time.monotonic() - t0 < 10  # it outlived SIGTERM, so SIGKILL after the grace
    assert not [pid for pid in bc._group(master.pid) if bc._state(pid) not in ("", "Z")]
