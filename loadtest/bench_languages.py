"""Languages through SandboxFusion's POST /run_code, the way verl sends them: one request per test case,
all cases of a program at once.

    .venv/bin/python loadtest/bench_languages.py                       # ROLLBOX_HOME or /var/tmp/rbx-langs
    .venv/bin/python loadtest/bench_languages.py --home DIR -c 16 --programs 8 --rounds 2

Two comparisons, side by side in one run, in alternating rounds (the machine may be shared):

1. C++, 10 test cases of one program (a typical competitive-programming solution with bits/stdc++.h):
   compile cache "off" (each case's source differs by a comment, so every request compiles, as
   SandboxFusion does) vs "on" (the 10 cases send the same source: one compile, nine cached).
   Each program is new (a fresh comment), so "on" pays its first compile too. Programs/s and the
   p50/p99 of a request.
2. Python: the same program and stdin through POST /run_code (language python) and as a `run`
   CloudEvent (code, snapshot python3, 1 GiB as verl's memory_limit_MB): runs/s and p50/p99.

At most ``-c`` requests in flight (default 16). Every reply is checked (status Success, the right
stdout). Starts its own `rollbox serve` on the store given (with its language snapshots: python3 and cpp
at least), stops it by pid.
"""

from __future__ import annotations

import argparse
import asyncio
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


def server_cpu_s(pid: int) -> float:
    """The server process's user + system CPU seconds (its sandboxes are other processes)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Stats:
    def __init__(self) -> None:
        self.lat: list[float] = []
        self.wall = 0.0
        self.units = 0
        self.errors: list[str] = []
        self.server_cpu_s = 0.0

    def row(self) -> dict[str, float]:
        q = statistics.quantiles(self.lat, n=100) if len(self.lat) >= 2 else [self.lat[0]] * 99
        return {"per_s": self.units / self.wall if self.wall else 0.0, "p50_ms": q[49] * 1000, "p99_ms": q[98] * 1000,
                "n": float(len(self.lat)), "cpu_ms": self.server_cpu_s * 1000 / max(1, len(self.lat))}


async def post(http: httpx.AsyncClient, sem: asyncio.Semaphore, url: str, st: Stats, want: str,
               body: dict[str, Any], event: bool = False) -> None:
    async with sem:
        t0 = time.perf_counter()
        if event:
            headers = {"ce-specversion": "1.0", "ce-type": "dev.rollbox.sandbox.run", "ce-source": "/bench",
                       "ce-id": uuid.uuid4().hex, "content-type": "application/json"}
            resp = await http.post(url, json=body, headers=headers)
            ok = resp.status_code == 200 and resp.json().get("stdout") == want
        else:
            resp = await http.post(url + "run_code", json=body)
            ok = resp.status_code == 200 and resp.json().get("status") == "Success" and \
                (resp.json().get("run_result") or {}).get("stdout") == want
        st.lat.append(time.perf_counter() - t0)
        if not ok:
            st.errors.append(resp.text[:300])


async def cpp_round(http: httpx.AsyncClient, url: str, c: int, programs: int, cache: bool, st: Stats) -> None:
    sem = asyncio.Semaphore(c)
    cases = [cpp_case(i) for i in range(10)]
    t0 = time.perf_counter()
    jobs = []
    for _ in range(programs):
        program = CPP + f"// program {uuid.uuid4()}\n"
        for i, (stdin, want) in enumerate(cases):
            code = program if cache else program + f"// case {i}\n"
            jobs.append(post(http, sem, url, st, want, {"code": code, "language": "cpp", "stdin": stdin,
                                                        "memory_limit_MB": 1024, "compile_timeout": 60,
                                                        "run_timeout": 30}))
    await asyncio.gather(*jobs)
    st.wall += time.perf_counter() - t0
    st.units += programs


async def py_round(http: httpx.AsyncClient, url: str, c: int, n: int, event: bool, st: Stats, pid: int = 0) -> None:
    sem = asyncio.Semaphore(c)
    stdin, want = "3 1 4 1 5 9 2 6\n", "31 9\n"
    if event:
        body = {"code": PY, "snapshot": "python3", "stdin": stdin, "timeout_s": 10,
                "limits": {"memory_max_bytes": 1 << 30}}
    else:
        body = {"code": PY, "language": "python", "stdin": stdin, "memory_limit_MB": 1024, "run_timeout": 10}
    t0, cpu0 = time.perf_counter(), server_cpu_s(pid) if pid else 0.0
    await asyncio.gather(*(post(http, sem, url, st, want, body, event) for _ in range(n)))
    st.wall += time.perf_counter() - t0
    st.server_cpu_s += server_cpu_s(pid) - cpu0 if pid else 0.0
    st.units += n


def show(title: str, unit: str, a: tuple[str, Stats], b: tuple[str, Stats]) -> float:
    print(f"\n{title}")
    print(f"  {'':<22}{unit + '/s':>12}{'p50 ms':>10}{'p99 ms':>10}{'requests':>10}{'errors':>8}"
          f"{'server CPU ms/request':>23}")
    for name, st in (a, b):
        r = st.row()
        cpu = f"{r['cpu_ms']:.2f}" if st.server_cpu_s else "-"
        print(f"  {name:<22}{r['per_s']:>12.2f}{r['p50_ms']:>10.0f}{r['p99_ms']:>10.0f}{int(r['n']):>10}"
              f"{len(st.errors):>8}{cpu:>23}")
        for e in st.errors[:2]:
            print(f"    error: {e}")
    ra, rb = a[1].row()["per_s"], b[1].row()["per_s"]
    return rb / ra if ra else 0.0


async def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--home", default=os.environ.get("ROLLBOX_HOME", "/var/tmp/rbx-langs"))
    p.add_argument("-c", "--concurrency", type=int, default=16)
    p.add_argument("--programs", type=int, default=4, help="C++ programs (10 cases each) per mode per round")
    p.add_argument("--python-runs", type=int, default=200, help="python runs per interface per round")
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-languages-") as tmp:
        proc, url = start(args.home, Path(tmp) / "serve.log")
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
                        await cpp_round(http, url, args.concurrency, args.programs, cache, st)
                    py_order = [(False, rc), (True, ev)] if r % 2 == 0 else [(True, ev), (False, rc)]
                    for event, st in py_order:
                        await py_round(http, url, args.concurrency, args.python_runs, event, st, proc.pid)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(120)
    print(f"bench_languages: c{args.concurrency}, {args.rounds} alternating rounds, home {args.home}, "
          f"{os.cpu_count()} CPUs (load average at the end: {os.getloadavg()[0]:.1f})")
    speedup = show(f"C++, 10 test cases per program ({args.programs} programs per mode per round)", "programs",
                   ("compile cache off", off), ("compile cache on", on))
    ratio = show(f"Python, {args.python_runs} runs per interface per round", "runs",
                 ("run event", ev), ("POST /run_code", rc))
    print(f"\ncache on / off: {speedup:.2f}x (target >= 5x); /run_code / run event: {ratio:.2f} (target >= 0.90)")
    bad = off.errors or on.errors or rc.errors or ev.errors
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
