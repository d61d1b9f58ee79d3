"""One-shot `run` of print(1) through HTTP at several concurrencies: throughput and p50/p99.

    .venv/bin/python loadtest/bench_service.py                  # concurrency 1, 16, 64
    .venv/bin/python loadtest/bench_service.py -c 16 -n 2000
    .venv/bin/python loadtest/bench_service.py --record off   # one server, recording off

Recording (trajectories and usage) on and off are two servers, measured side by side at each level,
once both have finished starting (their start-up work is not what a run costs).

Starts its own `rollbox serve` on 127.0.0.1 (a free port), sends binary-mode CloudEvents with httpx
from this process, checks every reply (200, exit code 0, stdout "1\\n"), stops the server by pid.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import uvloop

RUN = "dev.rollbox.sandbox.run"
BODY = json.dumps({"code": "print(1)"}).encode()


def start(log: Path, extra: list[str], timeout_s: float = 90.0) -> tuple[subprocess.Popen[bytes], str]:
    """`rollbox serve --port 0 EXTRA...`, its output in ``log``: the process and its URL once it listens."""
    with open(log, "wb") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "rollbox.functions.cli", "serve", "--port", "0", *extra],
            stdout=f,
            stderr=subprocess.STDOUT,
        )
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for line in log.read_text(errors="replace").splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if rec.get("msg") == "listening":
                return proc, f"http://127.0.0.1:{rec['port']}/"
        if proc.poll() is not None:
            raise SystemExit(f"rollbox serve exited with {proc.returncode}:\n{log.read_text()}")
        time.sleep(0.05)
    stop(proc)
    raise SystemExit("rollbox serve did not start")


def stop(proc: subprocess.Popen[bytes]) -> int:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode


TICK = os.sysconf("SC_CLK_TCK")


def machine_busy_s() -> float:
    """CPU seconds spent busy by the whole machine (every core, every process, the kernel)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    idle = v[3] + v[4]  # idle + iowait
    return (sum(v[:8]) - idle) / TICK


def process_cpu_s(pid: int) -> float:
    """CPU seconds of one process itself (not its children)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def settle(pids: list[int], timeout_s: float = 20.0) -> None:
    """Wait until the servers are done starting: a server's first seconds hold one-time work (the
    recorder loads its Parquet writer in a thread a second after start, the pool restores its first
    sandboxes), which is not what a run costs. Idle = each used under 2 % of a core over 0.5 s."""
    time.sleep(1.5)  # (the recorder's warm-up starts a second after start)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        before = [process_cpu_s(pid) for pid in pids]
        time.sleep(0.5)
        if all(process_cpu_s(pid) - b < 0.01 for pid, b in zip(pids, before, strict=True)):
            return


class CpuMeter:
    """Where the CPU went during a level: the whole machine, this client, the server process; the
    rest is the sandboxes, zygotes and kernel threads."""

    def __init__(self, server_pid: int | None):
        self.server_pid = server_pid
        self.t0 = self._sample()

    def _sample(self) -> tuple[float, float, float]:
        server = process_cpu_s(self.server_pid) if self.server_pid else 0.0
        return machine_busy_s(), process_cpu_s(os.getpid()), server

    def per_run_ms(self, runs: int) -> dict[str, float]:
        machine, client, server = (now - then for now, then in zip(self._sample(), self.t0, strict=True))
        return {
            "cpu_ms_per_run": 1000 * machine / runs,
            "client_ms_per_run": 1000 * client / runs,
            "server_ms_per_run": 1000 * server / runs,
            "sandbox_ms_per_run": 1000 * (machine - client - server) / runs,
        }


async def one(http: httpx.AsyncClient, url: str) -> float:
    headers = {
        "ce-specversion": "1.0",
        "ce-type": RUN,
        "ce-source": "/bench",
        "ce-id": uuid.uuid4().hex,
        "content-type": "application/json",
    }
    t0 = time.perf_counter()
    resp = await http.post(url, headers=headers, content=BODY)
    dt = time.perf_counter() - t0
    if resp.status_code != 200 or resp.headers.get("ce-type") != "dev.rollbox.sandbox.result":
        raise RuntimeError(f"bad reply {resp.status_code}: {resp.text[:300]}")
    data = resp.json()
    if data["exit_code"] != 0 or data["stdout"] != "1\n":
        raise RuntimeError(f"wrong result: {data}")
    return dt


async def level(url: str, server_pid: int, concurrency: int, requests: int) -> dict[str, Any]:
    # One connection per worker, each in its own httpx client: a single pool shared by 64 workers costs
    # the client several ms of CPU per request (measured), which this 2-core box cannot spare.
    clients = [httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=1)) for _ in range(concurrency)]
    try:
        await asyncio.gather(*(one(http, url) for http in clients))  # warm connections and the zygote
        latencies: list[float] = []
        todo = iter(range(requests))

        async def worker(http: httpx.AsyncClient) -> None:
            for _ in todo:
                latencies.append(await one(http, url))

        meter = CpuMeter(server_pid)
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(http) for http in clients))
        wall = time.perf_counter() - t0
        cpu = meter.per_run_ms(len(latencies))
    finally:
        for http in clients:
            await http.aclose()
    return {**summary(concurrency, latencies, wall), **cpu}


async def level_inprocess(concurrency: int, requests: int) -> dict[str, Any]:
    """The same work on an embedded Runtime in this process, no HTTP: what the service adds."""
    from rollbox.runtime.runtime import Runtime
    from rollbox.runtime.spec import ExecRequest

    req = ExecRequest(code="print(1)")
    async with Runtime() as rt:
        for _ in range(min(concurrency, 8)):
            await rt.run(req)
        latencies: list[float] = []
        todo = iter(range(requests))

        async def worker() -> None:
            for _ in todo:
                t0 = time.perf_counter()
                r = await rt.run(req)
                latencies.append(time.perf_counter() - t0)
                if r.exit_code != 0 or r.stdout != "1\n":
                    raise RuntimeError(f"wrong result: {r}")

        meter = CpuMeter(None)
        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
        cpu = meter.per_run_ms(len(latencies))
    return {**summary(concurrency, latencies, wall), **cpu}


def summary(concurrency: int, latencies: list[float], wall: float) -> dict[str, Any]:
    qs = statistics.quantiles(latencies, n=100, method="inclusive")
    return {
        "concurrency": concurrency,
        "requests": len(latencies),
        "wall_s": wall,
        "runs_per_s": len(latencies) / wall,
        "p50_ms": qs[49] * 1000,
        "p99_ms": qs[98] * 1000,
    }


# two-sided 95 % quantiles of Student's t by degrees of freedom (past 30: 1.96 + 2.4/df, within 0.003)
_T975 = {4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228, 11: 2.201, 12: 2.179,
         13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093, 20: 2.086, 21: 2.080,
         22: 2.074, 23: 2.069, 24: 2.064, 25: 2.060, 26: 2.056, 27: 2.052, 28: 2.048, 29: 2.045, 30: 2.042}


def mean_interval(xs: list[float]) -> tuple[float, float]:
    """95 % t-interval of the mean of ``xs`` (at least five values)."""
    df = len(xs) - 1
    t = _T975.get(df, 1.96 + 2.4 / df)
    half = t * statistics.stdev(xs) / len(xs) ** 0.5
    return statistics.fmean(xs) - half, statistics.fmean(xs) + half


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-c", "--concurrency", type=int, action="append", help="repeatable; default 1, 16, 64")
    p.add_argument("-n", "--requests", type=int, help="requests per level (default 50 x concurrency, 200..2000)")
    p.add_argument("--log-level", default="warning", help="server log level (default warning)")
    p.add_argument(
        "--baseline",
        action="store_true",
        help="also run the same work on an embedded Runtime without HTTP, for comparison",
    )
    p.add_argument("--record", choices=("both", "on", "off"), default="both",
                   help="trajectory recording of the server(s): both (side by side, default), on or off")
    p.add_argument("--repeat", type=int, default=1, help="measure every level this many times (medians compared)")
    p.add_argument("--json", action="store_true", help="print the rows as JSON lines too")
    args = p.parse_args()
    levels = args.concurrency or [1, 16, 64]

    def count(c: int) -> int:
        return int(args.requests or min(2000, max(200, 50 * c)))

    rows: list[dict[str, Any]] = []
    modes = ["on", "off"] if args.record == "both" else [args.record]
    rc = 0
    with tempfile.TemporaryDirectory(prefix="rollbox-bench-") as tmp:
        servers = {}
        try:
            for mode in modes:  # each its own home: recording writes its spool and Parquet there
                servers[mode] = start(Path(tmp) / f"serve-{mode}.log",
                                      ["--log-level", args.log_level, "--max-queued", "4096", "--record", mode,
                                       "--home", str(Path(tmp) / f"home-{mode}")])
            settle([proc.pid for proc, _ in servers.values()])
            for rep in range(args.repeat):
                for c in levels:  # the modes side by side at each level (alternating which goes first),
                    for mode in modes if rep % 2 == 0 else modes[::-1]:  # so drift hits both alike
                        proc, url = servers[mode]
                        rows.append({"path": f"rec {mode}", **uvloop.run(level(url, proc.pid, c, count(c)))})
        except Exception:
            for mode in servers:
                tail = (Path(tmp) / f"serve-{mode}.log").read_text(errors="replace").splitlines()[-20:]
                print("server log (last lines):", *tail, sep="\n", file=sys.stderr)
            raise
        finally:
            for proc, _ in servers.values():
                rc = stop(proc) or rc
        flushed = sum(1 for _ in Path(tmp, "home-on").glob("trajectories/**/*.parquet")) if "on" in servers else 0
    if args.baseline:
        for c in levels:
            rows.append({"path": "in-process", **asyncio.run(level_inprocess(c, count(c)))})
    print(
        f"{'path':>10} {'concurrency':>11} {'requests':>8} {'runs/s':>8} {'p50 ms':>8} {'p99 ms':>8}"
        f" | CPU ms/run: {'all':>5} {'client':>6} {'server':>6} {'rest':>5}"
    )
    for r in rows:
        print(
            f"{r['path']:>10} {r['concurrency']:>11} {r['requests']:>8} {r['runs_per_s']:>8.1f} "
            f"{r['p50_ms']:>8.1f} {r['p99_ms']:>8.1f} |             {r['cpu_ms_per_run']:>5.1f} "
            f"{r['client_ms_per_run']:>6.1f} {r['server_ms_per_run'] if r['path'] != 'in-process' else 0.0:>6.1f} "
            f"{r['sandbox_ms_per_run']:>5.1f}"
        )
        if args.json:
            print(json.dumps(r))
    for c in levels:
        on = [r for r in rows if r["concurrency"] == c and r["path"] == "rec on"]
        off = [r for r in rows if r["concurrency"] == c and r["path"] == "rec off"]
        if on and off:
            def med(rs: list[dict[str, Any]], k: str) -> float:
                return statistics.median(r[k] for r in rs)
            cost = 100 * (1 - med(on, "runs_per_s") / med(off, "runs_per_s"))
            # each repetition measured on and off back to back: the ratio of a pair is what drift
            # between repetitions (this VM's phases) leaves alone
            paired = 100 * (1 - statistics.median(a["runs_per_s"] / b["runs_per_s"] for a, b in zip(on, off, strict=True)))
            print(f"recording on vs off at c{c}: {cost:+.1f} % runs/s lost (median of {len(on)}: "
                  f"{med(on, 'runs_per_s'):.1f} vs {med(off, 'runs_per_s'):.1f} runs/s; median of the "
                  f"{len(on)} back-to-back pairs' ratios: {paired:+.1f} %; server CPU "
                  f"{med(on, 'server_ms_per_run'):.2f} vs {med(off, 'server_ms_per_run'):.2f} ms/run)")
            if len(on) >= 5:  # enough pairs to say how sure the estimate is
                costs = [100 * (1 - a["runs_per_s"] / b["runs_per_s"]) for a, b in zip(on, off, strict=True)]
                lo, hi = mean_interval(costs)
                print(f"  mean of the {len(costs)} pairs' costs {statistics.fmean(costs):+.1f} % "
                      f"(95 % t-interval of the mean {lo:+.1f} .. {hi:+.1f} %)")
    if "on" in modes:
        print(f"(recording on: its server flushed {flushed} Parquet files of trajectories to its store)")
    print(
        f"(server: rollbox serve --log-level {args.log_level}, exit status {rc}; client: httpx on uvloop in this "
        f"process; {os.cpu_count()} cores shared; load average {os.getloadavg()[0]:.1f} at the end)\n"
        "(CPU ms/run: busy CPU of the whole machine per run, from /proc/stat; client = this process; "
        "server = the rollbox serve process itself; rest = sandboxes, zygotes, kernel threads. In-process, "
        "the runtime is in the client.)"
    )
    return 0 if rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
