"""loadtest/profile_replica.py, short: two replicas on one SeaweedFS, steps only, each step to the next
replica; it prints CPU per step by part, user and kernel apart, and the parts add up."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PARTS = ("servers", "sandboxes", "seaweedfs", "client")

pytestmark = pytest.mark.slow


def test_profile_replica_steps_only_splits_cpu_per_step_by_part(tmp_path: Path) -> None:
    # 32 steps: /proc counts CPU in 10 ms ticks, so 4 steps would leave a part at 0 by chance
    p = subprocess.run(
        [sys.executable, str(ROOT / "loadtest" / "profile_replica.py"), "--steps-only", "--replicas", "2",
         "--episodes", "16", "--steps", "2", "--no-cprofile", "--warm-episodes", "2",
         "--weed-arg=-volume.index=memory", "--serve-arg=--log-level=warning",
         "--base", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=110)
    out = p.stdout
    assert p.returncode == 0, (out + p.stderr)[-4000:]
    rate = re.search(r"^32 steps in [\d.]+ s, ([\d.]+) steps/s \(16 episodes created first, 2 resumed steps each, "
                     r"destroyed after, unmeasured; round-robin over 2 replicas; c8\):$", out, re.M)
    assert rate and float(rate.group(1)) > 0, out
    assert "CPU per step (ms)     user  kernel   total" in out, out
    rows = {m.group(1): tuple(float(m.group(i)) for i in (2, 3, 4))
            for m in re.finditer(r"^  (servers|sandboxes|seaweedfs|client|all in)\s+(-?[\d.]+)\s+(-?[\d.]+)\s+(-?[\d.]+)",
                                 out, re.M)}
    assert set(rows) == {*PARTS, "all in"}, out
    for part in PARTS:
        user, kernel, total = rows[part]
        assert total > 0 and user > 0, (part, out)
        assert abs(user + kernel - total) < 0.015, (part, out)
    # a resumed sandbox runs in a forked copy of its zygote: kernel time, copy-on-write page faults
    assert rows["sandboxes"][1] > 0, out
    faults = re.search(r"minor page faults per step: servers (\d+), sandboxes (\d+)", out)
    assert faults and int(faults.group(2)) > 100, out
    for i in range(3):
        assert abs(rows["all in"][i] - sum(rows[part][i] for part in PARTS)) < 0.05, out
    # every step resumed its sandbox from S3, mostly one the other replica had hibernated
    resumed = re.search(r"sandboxes resumed from S3: (\d+) for 32 steps", out)
    assert resumed and int(resumed.group(1)) >= 32, out
    s3 = re.search(r"S3 requests per step ([\d.]+): (.*)$", out, re.M)
    assert s3 and "PutObject" in s3.group(2) and "GetObject" in s3.group(2), out


@pytest.mark.parametrize(("flag", "says"), [("--weed-arg=-no.such.flag", "weed exited"),
                                            ("--serve-arg=--no-such-flag", "rollbox serve (http://127.0.0.1:")])
def test_profile_replica_hands_its_extra_flags_to_weed_and_to_serve(flag: str, says: str, tmp_path: Path) -> None:
    """An unknown flag stops the program it was handed to, and the script says which."""
    p = subprocess.run([sys.executable, str(ROOT / "loadtest" / "profile_replica.py"), "--episodes", "1", "--steps", "1",
                        "--no-cprofile", "--base", str(tmp_path / "run"), flag], capture_output=True, text=True, timeout=60)
    assert p.returncode != 0 and says in p.stderr, (p.stdout + p.stderr)[-3000:]


def test_profile_replica_under_cprofile_prints_the_replicas_profile(tmp_path: Path) -> None:
    """Without --no-cprofile each replica runs under cProfile and the script prints their profiles added
    up (serve ends with os._exit, which `python -m cProfile -o` never got to write its file past)."""
    p = subprocess.run(
        [sys.executable, str(ROOT / "loadtest" / "profile_replica.py"), "--replicas", "2", "--episodes", "4",
         "--steps", "2", "--warm-episodes", "0", "--top", "40", "--base", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=110)
    out = p.stdout
    assert p.returncode == 0, (out + p.stderr)[-4000:]
    assert "under cProfile, so slower than without it" in out, out
    assert len(re.findall(r"function calls \(\d+ primitive calls\) in [\d.]+ seconds", out)) == 2, out  # both sorts
    assert re.search(r"^\s+ncalls\s+tottime\s+percall\s+cumtime\s+percall filename:lineno\(function\)", out, re.M), out
    assert re.search(r"/functions/(service|durable|handlers)/\w+\.py:\d+\(", out), out  # the service's own frames
