"""The CPU the supervisor keeps (--cpu-reserved-cores): compile-bound throughput and the supervisor's
latency under that load, with the reserve kept as a hard cap on the sandboxes vs lent to them.

    .venv/bin/python loadtest/bench_reserve.py                        # reserves 0.25 and 0, 2 rounds each
    .venv/bin/python loadtest/bench_reserve.py --reserves 0.25,0 --rounds 3 --programs 3

Per round and reserve (alternating, so drift on a shared machine hits both alike): a fresh `rollbox
serve` (home --home, with the cpp snapshot) with `--cpu-reserved-cores R`; C++ cache off (every request
compiles, as bench_languages' "cache off") at -c requests in flight, --programs programs of 10 cases;
meanwhile the supervisor's own latency: GET /healthz every 50 ms (answered by the event loop, no
sandbox: what a step's bookkeeping waits for) and a `run` event of `print(1)` every 0.5 s (a warm
sandbox's whole round trip, competing with the compiles for CPU). R > 0 caps every sandbox together at
the host's cores less R (cfs quota of the sandboxes' parent cgroup); R = 0 writes no cap below the
host's cores: the supervisor then gets its CPU from the scheduler's weights alone (its threads against
the sandboxes' parent group, cpu.shares 1024 each), and only while it wants it.

The servers run under their own cgroup parent (ROLLBOX_CGROUP_PARENT=rollbox-bench-reserve), so other
rollbox runtimes on the host (sharing the default parent `rollbox`) do not rewrite its cap mid-run;
the parent's quota is read back and printed for each round, with the cores its sandboxes used on
average during the compiles and how long its quota throttled them (0: the cap did not bind).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import bench_languages
import bench_service
import httpx

PARENT = "rollbox-bench-reserve"


def q(xs: list[float], p: int) -> float:
    if not xs:
        return float("nan")
    if len(xs) < 2:
        return xs[0]
    return statistics.quantiles(xs, n=100)[p - 1]


def parent_quota() -> str:
    try:
        quota = int(Path(f"/sys/fs/cgroup/cpu/{PARENT}/cpu.cfs_quota_us").read_text())
        period = int(Path(f"/sys/fs/cgroup/cpu/{PARENT}/cpu.cfs_period_us").read_text())
        return "none" if quota < 0 else f"{quota / period:.2f} cores"
    except OSError:
        try:
            quota_s, period_s = Path(f"/sys/fs/cgroup/{PARENT}/cpu.max").read_text().split()
            return "none" if quota_s == "max" else f"{int(quota_s) / int(period_s):.2f} cores"
        except (OSError, ValueError):
            return "?"


def parent_cpu() -> tuple[float, float]:
    """The sandboxes' parent cgroup: CPU seconds its sandboxes used, and seconds its quota throttled them
    (cgroup v1: cpuacct.usage, cpu.stat throttled_time; v2: cpu.stat usage_usec, throttled_usec)."""
    try:
        used = int(Path(f"/sys/fs/cgroup/cpuacct/{PARENT}/cpuacct.usage").read_text()) / 1e9
        stat = dict(ln.split() for ln in Path(f"/sys/fs/cgroup/cpu/{PARENT}/cpu.stat").read_text().splitlines())
        return used, int(stat.get("throttled_time", 0)) / 1e9
    except OSError:
        try:
            stat = dict(ln.split() for ln in Path(f"/sys/fs/cgroup/{PARENT}/cpu.stat").read_text().splitlines())
            return int(stat["usage_usec"]) / 1e6, int(stat.get("throttled_usec", 0)) / 1e6
        except (OSError, KeyError):
            return float("nan"), float("nan")


async def probe(http: httpx.AsyncClient, url: str, stop: asyncio.Event, health: list[float], runs: list[float],
                errors: list[str]) -> None:
    async def healthz() -> None:
        while not stop.is_set():
            t0 = time.perf_counter()
            resp = await http.get(url + "healthz")
            health.append(time.perf_counter() - t0)
            if resp.status_code != 200:
                errors.append(f"healthz {resp.status_code}")
            await asyncio.sleep(0.05)

    async def run() -> None:
        headers = {"ce-specversion": "1.0", "ce-type": "dev.rollbox.sandbox.run", "ce-source": "/bench-reserve",
                   "content-type": "application/json"}
        while not stop.is_set():
            t0 = time.perf_counter()
            resp = await http.post(url, json={"code": "print(1)", "snapshot": "python3", "timeout_s": 30},
                                   headers={**headers, "ce-id": uuid.uuid4().hex})
            runs.append(time.perf_counter() - t0)
            if resp.status_code != 200 or resp.json().get("stdout") != "1\n":
                errors.append(f"run {resp.status_code} {resp.text[:200]}")
            await asyncio.sleep(0.5)

    await asyncio.gather(healthz(), run())


async def one(args: argparse.Namespace, reserve: float, tmp: Path) -> dict[str, float | str]:
    os.environ["ROLLBOX_CGROUP_PARENT"] = PARENT
    proc, url = bench_service.start(tmp / f"serve-{reserve}-{uuid.uuid4().hex[:6]}.log",
                                    ["--home", args.home, "--prewarm", "python3,cpp", "--log-level", "warning",
                                     "--max-queued", "4096", "--cpu-reserved-cores", str(reserve)], timeout_s=120)
    try:
        quota = parent_quota()
        async with httpx.AsyncClient(timeout=httpx.Timeout(10.0, read=300.0),
                                     limits=httpx.Limits(max_connections=args.concurrency + 8)) as http:
            warm = bench_languages.Stats()
            await bench_languages.cpp_round(http, url, 2, 1, True, warm)
            st = bench_languages.Stats()
            health: list[float] = []
            runs: list[float] = []
            errors: list[str] = []
            stop = asyncio.Event()
            prober = asyncio.create_task(probe(http, url, stop, health, runs, errors))
            cpu0, (used0, thr0), t0 = bench_languages.server_cpu_s(proc.pid), parent_cpu(), time.perf_counter()
            await bench_languages.cpp_round(http, url, args.concurrency, args.programs, False, st)
            cpu, (used1, thr1) = bench_languages.server_cpu_s(proc.pid) - cpu0, parent_cpu()
            wall = time.perf_counter() - t0
            stop.set()
            await prober
        row = st.row()
        return {"reserve": reserve, "quota": quota, "programs_s": row["per_s"], "req_p50_s": row["p50_ms"] / 1000,
                "req_p99_s": row["p99_ms"] / 1000, "health_p50_ms": q(health, 50) * 1000,
                "health_p99_ms": q(health, 99) * 1000, "health_max_ms": max(health, default=0) * 1000,
                "run_p50_ms": q(runs, 50) * 1000, "run_p99_ms": q(runs, 99) * 1000, "server_cpu_s": cpu,
                "errors": float(len(st.errors) + len(errors)), "load": os.getloadavg()[0],
                "sandbox_cores": (used1 - used0) / wall, "throttled_s": thr1 - thr0}
    finally:
        bench_service.stop(proc)


async def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--home", default=os.environ.get("ROLLBOX_HOME", "/var/tmp/rbx-langs"))
    p.add_argument("-c", "--concurrency", type=int, default=16)
    p.add_argument("--programs", type=int, default=3, help="C++ programs (10 cases, each compiled) per round")
    p.add_argument("--reserves", default="0.25,0", help="the --cpu-reserved-cores values compared")
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    reserves = [float(x) for x in args.reserves.split(",")]
    rows: list[dict[str, float | str]] = []
    with tempfile.TemporaryDirectory(prefix="bench-reserve-") as tmp:
        for r in range(args.rounds):
            for reserve in reserves if r % 2 == 0 else reversed(reserves):
                row = await one(args, reserve, Path(tmp))
                rows.append(row)
                print(f"round {r + 1} reserve {reserve:g}: {row['programs_s']:.3f} programs/s, healthz p99 "
                      f"{row['health_p99_ms']:.0f} ms, run p99 {row['run_p99_ms']:.0f} ms (load {row['load']:.1f})",
                      file=sys.stderr, flush=True)
    print(f"bench_reserve: c{args.concurrency}, {args.programs} C++ programs x 10 compiles per round, "
          f"{args.rounds} alternating rounds, {os.cpu_count()} CPUs, home {args.home}")
    head = ("reserve", "parent cap", "programs/s", "req p50 s", "req p99 s", "healthz p50 ms", "p99 ms", "max ms",
            "run p50 ms", "run p99 ms", "server CPU s", "sandboxes' cores", "throttled s", "errors", "load")
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for row in rows:
        print(f"| {row['reserve']:g} | {row['quota']} | {row['programs_s']:.3f} | {row['req_p50_s']:.1f} | "
              f"{row['req_p99_s']:.1f} | {row['health_p50_ms']:.1f} | {row['health_p99_ms']:.1f} | "
              f"{row['health_max_ms']:.0f} | {row['run_p50_ms']:.0f} | {row['run_p99_ms']:.0f} | "
              f"{row['server_cpu_s']:.1f} | {row['sandbox_cores']:.2f} | {row['throttled_s']:.1f} | "
              f"{row['errors']:.0f} | {row['load']:.1f} |")
    for reserve in reserves:
        mine = [r for r in rows if r["reserve"] == reserve]
        print(f"reserve {reserve:g}: programs/s mean {statistics.mean(float(r['programs_s']) for r in mine):.3f}, "
              f"healthz p99 mean {statistics.mean(float(r['health_p99_ms']) for r in mine):.1f} ms, "
              f"run p99 mean {statistics.mean(float(r['run_p99_ms']) for r in mine):.0f} ms")
    return 1 if any(r["errors"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
