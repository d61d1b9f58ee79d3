"""bench_sweep.py still works: a small store (real SeaweedFS), listed both ways, every key counted."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_sweep_lists_every_key_both_ways() -> None:
    p = subprocess.run([sys.executable, str(ROOT / "loadtest" / "bench_sweep.py"), "--keys", "1500", "--rounds", "1"],
                       capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert p.returncode == 0, p.stdout + p.stderr
    rows = {m.group(1): (int(m.group(2)), float(m.group(3))) for m in
            re.finditer(r"^(botocore|obstore)\s+(\d+)\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+([\d.]+)$", p.stdout, re.M)}
    assert set(rows) == {"botocore", "obstore"}, p.stdout
    assert all(n == 1500 and per_1000 > 0 for n, per_1000 in rows.values()), rows  # two pages, every key
