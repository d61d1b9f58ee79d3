"""Languages through SandboxFusion's POST /run_code, the way verl sends them: one request per test case,
all cases of a program at once.

    .venv/bin/python loadtest/bench_languages.py                       # ROLLBOX_HOME or /var/tmp/rbx-langs
    .venv/bin/python loadtest/bench_languages.py --home DIR -c 16 --programs 2 --rounds 9
    .venv/bin/python loadtest/bench_languages.py --rounds 3 --programs 2 --python-runs 100   # a short run
    .venv/bin/python loadtest/bench_languages.py --replicas 2 --rounds 1 --programs 2 --python-runs 50

Two comparisons, side by side in one run, in alternating rounds (the machine may be shared): each
round measures one block of each mode, in the order A B, the next round B A, and so on; before each
block the server and its sandboxes are let settle (the warm pools refilled). Each round's ratio is
printed, and the verdict is the median ratio over the rounds, so one noisy round cannot flip it.

1. C++, 10 test cases of one program (a typical competitive-programming solution with bits/stdc++.h):
   compile cache "off" (each case's source differs by a comment, so every request compiles, as
   SandboxFusion does) vs "on" (the 10 cases send the same source: one compile, nine cached).
   Each program is new (a fresh comment), so "on" pays its first compile too. Programs/s and the
   p50/p99 of a request. The compile timeout is 600 s: on a loaded machine a slow compile is measured,
   not timed out (a compile that timed out is not cached, and the cases waiting for it compile each
   on their own, which would turn "on" into "off" for that program).
2. Python: the same program and stdin through POST /run_code (language python) and as a `run`
   CloudEvent (code, snapshot python3, 1 GiB as verl's memory_limit_MB): runs/s and p50/p99.

At most ``-c`` requests in flight (default 16). Every reply is checked (status Success, the right
stdout). Also the CPU per request (per program) of the server process alone and of the server with
its zygotes and sandboxes (every process under it, live or reaped: /proc's utime, stime, cutime,
cstime), which other jobs on the machine do not inflate: the ratio of the latter is what a machine
given to this load alone would show. Starts its own `rollbox serve` on the store given (with its
language snapshots: python3 and cpp at least), stops it by pid. The default run takes about 2 minutes
on an idle 2-core machine.

``--replicas N`` (N > 1): the same load through HAProxy to N `rollbox serve` replicas sharing one S3
store (SeaweedFS), as loadtest/fleet_local.py runs them (round-robin, each replica a new empty home):
python3's and cpp's snapshots are pushed from ``--home`` to the store first, each replica pulls them
when it starts (prewarm), and the compile cache is shared through the store (``compiled/`` objects):
a program's ten cases land on every replica, and a replica that finds the compile in the store does
not compile it. The CPU figures are the sum over the replicas' process trees. Language builds are off
in the replicas (a snapshot missing from the store is an error, not a build).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import bench_service
import httpx

CPP = """#include <bits/stdc++.h>
using namespace std;
int main() {
    ios::sync_with_stdio(false); cin.tie(nullptr);
    int n; cin >> n; vector<long long> a(n);
    for (auto& x : a) cin >> x;
    sort(a.begin(), a.end());
    map<long long, int> seen; long long best = 0;
    for (int i = 0; i < n; i++) { seen[a[i]]++; best = max(best, a[i] * (i + 1)); }
    cout << best << " " << seen.size() << "\\n";
}
"""
PY = "import sys\nnums = list(map(int, sys.stdin.read().split()))\nprint(sum(nums), max(nums))\n"


def cpp_case(i: int) -> tuple[str, str]:
    a = [(i * 7919 + k * 104729) % 1000 for k in range(50 + i)]
    s = sorted(a)
    best = max(s[k] * (k + 1) for k in range(len(s)))
    return f"{len(a)}\n{' '.join(map(str, a))}\n", f"{best} {len(set(a))}\n"


def start(home: str, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    return bench_service.start(log, ["--home", home, "--prewarm", "python3,cpp", "--log-level", "warning",
                                     "--max-queued", "4096"], timeout_s=120)


TICK = os.sysconf("SC_CLK_TCK")


def server_cpu_s(pid: int) -> float:
    """The server process's user + system CPU seconds (its sandboxes are other processes)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def tree_cpu_s(root: int) -> float:
    """CPU seconds of ``root`` and every process under it (zygotes, sandboxes, compilers): each live
    one's own and its reaped children's (utime, stime, cutime, cstime)."""
    parent: dict[int, int] = {}
    cpu: dict[int, float] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            fields = Path(f"/proc/{name}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile (its CPU is in its parent's cutime once reaped)
            continue
        parent[int(name)] = int(fields[1])
        cpu[int(name)] = sum(int(x) for x in fields[11:15]) / TICK
    total = 0.0
    for pid, c in cpu.items():
        p = pid
        while p > 1 and p != root:
            p = parent.get(p, 0)
        if p == root:
            total += c
    return total


def trees_cpu_s(pids: tuple[int, ...]) -> float:
    return sum(tree_cpu_s(pid) for pid in pids)


async def settle(pids: tuple[int, ...], timeout_s: float = 5.0) -> None:
    """Until the servers and their sandboxes are idle (under 5 % of a core for 0.2 s: the warm pools
    refilled, the last block's sandboxes torn down), at most ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    before = trees_cpu_s(pids)
    while time.monotonic() < deadline:
        await asyncio.sleep(0.2)
        now = trees_cpu_s(pids)
        if now - before < 0.01:
            return
        before = now


class Stats:
    def __init__(self) -> None:
        self.lat: list[float] = []
        self.wall = 0.0
        self.units = 0
        self.errors: list[str] = []
        self.server_cpu_s = 0.0
        self.tree_cpu_s = 0.0
        self.rounds: list[float] = []  # units/s of each block

    def row(self) -> dict[str, float]:
        q = statistics.quantiles(self.lat, n=100) if len(self.lat) >= 2 else [self.lat[0]] * 99
        return {"per_s": self.units / self.wall if self.wall else 0.0, "p50_ms": q[49] * 1000, "p99_ms": q[98] * 1000,
                "n": float(len(self.lat)), "cpu_ms": self.server_cpu_s * 1000 / max(1, len(self.lat)),
                "tree_ms": self.tree_cpu_s * 1000 / max(1, self.units)}


async def post(http: httpx.AsyncClient, sem: asyncio.Semaphore, url: str, st: Stats, want: str | None,
               body: dict[str, Any], event: bool = False) -> None:
    """One request; ok when it answers 200 with status Success and ``want`` as stdout (None: any stdout)."""
    async with sem:
        t0 = time.perf_counter()
        if event:
            headers = {"ce-specversion": "1.0", "ce-type": "dev.rollbox.sandbox.run", "ce-source": "/bench",
                       "ce-id": uuid.uuid4().hex, "content-type": "application/json"}
            resp = await http.post(url, json=body, headers=headers)
            ok = resp.status_code == 200 and (want is None or resp.json().get("stdout") == want)
        else:
            resp = await http.post(url + "run_code", json=body)
            reply = resp.json() if resp.status_code == 200 else {}
            ok = reply.get("status") == "Success" and (want is None or (reply.get("run_result") or {}).get("stdout") == want)
        st.lat.append(time.perf_counter() - t0)
        if not ok:
            st.errors.append(resp.text[:300])


async def block(st: Stats, pids: tuple[int, ...], units: int, jobs: list[Coroutine[Any, Any, None]]) -> float:
    """Run one block's requests (the caller's semaphore bounds them): its units/s, kept in ``st``."""
    t0, cpu0, tree0 = time.perf_counter(), sum(server_cpu_s(p) for p in pids), trees_cpu_s(pids)
    await asyncio.gather(*jobs)
    wall = time.perf_counter() - t0
    if pids:
        st.server_cpu_s += sum(server_cpu_s(p) for p in pids) - cpu0
        st.tree_cpu_s += trees_cpu_s(pids) - tree0
    st.wall += wall
    st.units += units
    st.rounds.append(units / wall)
    return units / wall


async def cpp_round(http: httpx.AsyncClient, url: str, c: int, programs: int, cache: bool, st: Stats,
                    pids: tuple[int, ...] = ()) -> float:
    sem = asyncio.Semaphore(c)
    cases = [cpp_case(i) for i in range(10)]
    jobs = []
    for _ in range(programs):
        program = CPP + f"// program {uuid.uuid4()}\n"
        for i, (stdin, want) in enumerate(cases):
            code = program if cache else program + f"// case {i}\n"
            jobs.append(post(http, sem, url, st, want, {"code": code, "language": "cpp", "stdin": stdin,
                                                        "memory_limit_MB": 1024, "compile_timeout": 600,
                                                        "run_timeout": 30}))
    return await block(st, pids, programs, jobs)


async def py_round(http: httpx.AsyncClient, url: str, c: int, n: int, event: bool, st: Stats,
                   pids: tuple[int, ...] = ()) -> float:
    sem = asyncio.Semaphore(c)
    stdin, want = "3 1 4 1 5 9 2 6\n", "31 9\n"
    if event:
        body = {"code": PY, "snapshot": "python3", "stdin": stdin, "timeout_s": 10,
                "limits": {"memory_max_bytes": 1 << 30}}
    else:
        body = {"code": PY, "language": "python", "stdin": stdin, "memory_limit_MB": 1024, "run_timeout": 10}
    return await block(st, pids, n, [post(http, sem, url, st, want, body, event) for _ in range(n)])


def show(title: str, unit: str, a: tuple[str, Stats], b: tuple[str, Stats]) -> list[float]:
    """The table of two modes; returns each round's ratio b/a."""
    print(f"\n{title}")
    print(f"  {'':<20}{unit + '/s':>12}{'p50 ms':>9}{'p99 ms':>9}{'requests':>10}{'errors':>7}"
          f"{'server CPU ms/req':>19}{'server+sandboxes CPU ms/' + unit[:-1]:>34}")
    for name, st in (a, b):
        r = st.row()
        cpu = f"{r['cpu_ms']:.2f}" if st.server_cpu_s else "-"
        tree = f"{r['tree_ms']:.1f}" if st.tree_cpu_s else "-"
        print(f"  {name:<20}{r['per_s']:>12.2f}{r['p50_ms']:>9.0f}{r['p99_ms']:>9.0f}{int(r['n']):>10}"
              f"{len(st.errors):>7}{cpu:>19}{tree:>34}")
        for e in st.errors[:2]:
            print(f"    error: {e}")
    ratios = [rb / ra if ra else 0.0 for ra, rb in zip(a[1].rounds, b[1].rounds, strict=True)]
    print("  each round, " + f"{unit}/s {a[0]} | {b[0]} | ratio:")
    for i, (ra, rb, q) in enumerate(zip(a[1].rounds, b[1].rounds, ratios, strict=True)):
        print(f"    round {i + 1} ({'A B' if i % 2 == 0 else 'B A'}): {ra:9.2f} | {rb:9.2f} | {q:6.2f}")
    return ratios


def start_fleet(home: str, base: Path, replicas: int) -> Any:
    """``replicas`` servers behind HAProxy sharing a SeaweedFS store into which python3's and cpp's
    snapshots are pushed from ``home`` before they start."""
    from fleet_local import ACCESS_KEY, SECRET_KEY, Fleet
    from rollbox.snapshots.store import copy_snapshot
    from rollbox.snapshots.store_local import LocalStore
    from rollbox.snapshots.store_s3 import S3Store

    def push(fleet: Fleet) -> None:
        t0 = time.monotonic()
        remote = S3Store(fleet.store_env["ROLLBOX_STORE"], endpoint_url=fleet.s3.endpoint, access_key_id=ACCESS_KEY,
                         secret_access_key=SECRET_KEY)
        local = LocalStore(home)
        for name in ("python3", "cpp"):
            copy_snapshot(local, remote, name, tmp_dir=str(local.root / "tmp"))
        print(f"pushed python3 and cpp from {home} to {remote.url} in {time.monotonic() - t0:.0f} s", flush=True)

    t0 = time.monotonic()
    fleet = Fleet(base, replicas, on_store=push, start_timeout_s=300.0,
                  serve_args=["--prewarm", "python3,cpp", "--max-queued", "4096", "--language-builds", "off"])
    fleet.start()
    print(f"{replicas} replicas up in {time.monotonic() - t0:.0f} s", flush=True)
    return fleet


async def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--home", default=os.environ.get("ROLLBOX_HOME", "/var/tmp/rbx-langs"))
    p.add_argument("-c", "--concurrency", type=int, default=16)
    p.add_argument("--programs", type=int, default=2, help="C++ programs (10 cases each) per mode per round")
    p.add_argument("--python-runs", type=int, default=200, help="python runs per interface per round")
    p.add_argument("--rounds", type=int, default=9, help="alternating rounds (the verdict is their median ratio)")
    p.add_argument("--replicas", type=int, default=1,
                   help="N > 1: N replicas behind HAProxy sharing a SeaweedFS store (loadtest/fleet_local.py)")
    args = p.parse_args()
    t_start, load_start = time.monotonic(), os.getloadavg()[0]
    busy0, own0, tree_total = bench_service.machine_busy_s(), time.process_time(), 0.0
    with tempfile.TemporaryDirectory(prefix="bench-languages-") as tmp, contextlib.ExitStack() as stack:
        if args.replicas > 1:
            fleet = start_fleet(args.home, Path(tmp) / "fleet", args.replicas)
            stack.callback(fleet.stop)
            url, pids = fleet.url, tuple(srv.pid for srv in fleet.replicas if srv is not None)
        else:
            proc, url = start(args.home, Path(tmp) / "serve.log")
            pids = (proc.pid,)

            def stop_server() -> None:
                proc.send_signal(signal.SIGTERM)
                proc.wait(120)

            stack.callback(stop_server)
        try:
            async with httpx.AsyncClient(timeout=httpx.Timeout(10.0, read=300.0),
                                         limits=httpx.Limits(max_connections=args.concurrency + 4)) as http:
                warm = Stats()  # first compile and zygotes of both snapshots, not measured
                await cpp_round(http, url, 2, 1, True, warm)
                await py_round(http, url, 4, 8, False, warm)
                await py_round(http, url, 4, 8, True, warm)
                off, on, rc, ev = Stats(), Stats(), Stats(), Stats()
                for r in range(args.rounds):
                    order = [(False, off), (True, on)] if r % 2 == 0 else [(True, on), (False, off)]
                    for cache, st in order:
                        await settle(pids)
                        await cpp_round(http, url, args.concurrency, args.programs, cache, st, pids)
                    py_order = [(True, ev), (False, rc)] if r % 2 == 0 else [(False, rc), (True, ev)]
                    for event, st in py_order:
                        await settle(pids)
                        await py_round(http, url, args.concurrency, args.python_runs, event, st, pids)
        finally:
            tree_total = trees_cpu_s(pids)
    elapsed = time.monotonic() - t_start
    # the machine's busy CPU less this bench's (the server's tree and this process): the other jobs' share
    others = max(0.0, bench_service.machine_busy_s() - busy0 - tree_total - (time.process_time() - own0)) / elapsed
    where = (f"{args.replicas} replicas behind HAProxy sharing SeaweedFS (snapshots and compile cache)"
             if args.replicas > 1 else "one server")
    print(f"bench_languages: {where}, c{args.concurrency}, {args.rounds} alternating rounds, home {args.home}, "
          f"{os.cpu_count()} CPUs, {time.monotonic() - t_start:.0f} s "
          f"(load average {load_start:.1f} at the start; other work used {others:.2f} of the CPUs during the run)")
    speedups = show(f"C++, 10 test cases per program ({args.programs} programs per mode per round; A: off, B: on)",
                    "programs", ("compile cache off", off), ("compile cache on", on))
    ratios = show(f"Python, {args.python_runs} runs per interface per round (A: run event, B: /run_code)", "runs",
                  ("run event", ev), ("POST /run_code", rc))
    speedup, ratio = statistics.median(speedups), statistics.median(ratios)
    cpu_speedup = off.row()["tree_ms"] / on.row()["tree_ms"] if on.tree_cpu_s else 0.0
    cpu_ratio = ev.row()["tree_ms"] / rc.row()["tree_ms"] if rc.tree_cpu_s else 0.0
    print(f"\ncache on / off, median of {len(speedups)} rounds: {speedup:.2f}x (target >= 5x; "
          f"{sum(x >= 5 for x in speedups)} of {len(speedups)} rounds >= 5x); CPU per program off / on: "
          f"{cpu_speedup:.2f}x")
    print(f"/run_code / run event, median of {len(ratios)} rounds: {ratio:.2f} (target >= 0.90; "
          f"{sum(x >= 0.9 for x in ratios)} of {len(ratios)} rounds >= 0.90); CPU per run event / /run_code: "
          f"{cpu_ratio:.2f}")
    if others > 0.2:
        print(f"\nthe machine was busy with other work ({others:.2f} CPUs on average, load average {load_start:.1f} "
              f"at the start, {os.cpu_count()} CPUs): the ratios of throughput move with it (and 'off', 16 compiles at once, gets more of a contended machine "
              "than 'on'); the CPU ratios are not moved by it")
    bad = off.errors or on.errors or rc.errors or ev.errors
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
