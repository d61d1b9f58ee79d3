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
    wave = re.search(r"wave: drained in [\d.]+ s \(exit codes \[0, 0\]\).*first reply ([\d.]+) s after", p.stdout)
    assert wave and float(wave.group(1)) < 30, p.stdout
    assert re.search(r"peak memory \(PSS\): replicas \d+ MiB, seaweedfs \d+ MiB, haproxy \d+ MiB", p.stdout)
