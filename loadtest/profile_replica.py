"""Where a replica's own CPU goes on durable steps on S3: `rollbox serve` replicas (--replicas, one
SeaweedFS) each run under cProfile (its event loop's thread, by its CPU time; the store calls' threads are not profiled:
see profile_s3_step.py), driven by episodes as the fleet run plays them with long think times: create,
then steps that each find their sandbox hibernated (--hibernate-after-s 0.02; 0 would be never) and
resume it from S3, then destroy. Every request goes to the next replica in turn, as a load balancer
without affinity sends them, so with two replicas or more a step mostly resumes a sandbox another
replica hibernated.

With --steps-only, every episode is created first and destroyed after, and only the steps are
measured: a fleet under load spends its CPU on steps, so CPU per step is what sets its steps/s.

Prints, per request (per step with --steps-only), the CPU of each part, user and kernel apart (utime
and stime from /proc/PID/stat, in 10 ms ticks: measure a few hundred steps; the client's own from
getrusage): the servers (threads included), their descendants (zygotes and sandboxes, reaped ones
included), SeaweedFS (its idle rate taken out) and this client; all in; the rate; minor page faults;
the servers' threads; the S3 requests by operation; then the profile's top functions by own time and
by cumulative time.

--perf FILE records `perf record -g` of the servers over the measured phase (Python 3.11's frames show
as the interpreter's; the kernel's are named). --weed-arg and --serve-arg (repeatable) hand one more
flag to `weed mini` and to every `rollbox serve`, to measure a setting: --serve-arg=--flag=value.

    .venv/bin/python loadtest/profile_replica.py --episodes 40 --steps 3
    .venv/bin/python loadtest/profile_replica.py --steps-only --replicas 2 --episodes 100 --steps 3 --no-cprofile
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import pstats
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

sys.path.insert(0, str(ROOT / "loadtest"))
from bench_capacity import _children, _tree, proc_stat, store_ops, tree_cpu_split_s  # noqa: E402
from fleet_local import WEED_PROCS  # noqa: E402

from tests.snapshots.s3server import ACCESS_KEY, SECRET_KEY, SeaweedS3, free_ports  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")
THINK_S = 0.05  # past --hibernate-after-s 0.02: the next step resumes the sandbox
STEP = ("import hashlib\nwith open('trajectory.txt', 'a') as f:\n    f.write('step\\n')\n"
        "print(hashlib.sha256(open('trajectory.txt', 'rb').read()).hexdigest())\n")
PARTS = ("servers", "sandboxes", "seaweedfs", "client")


@dataclass(frozen=True)
class Cpu:
    """CPU seconds, user and kernel."""

    user_s: float = 0.0
    kernel_s: float = 0.0

    def __add__(self, o: Cpu) -> Cpu:
        return Cpu(self.user_s + o.user_s, self.kernel_s + o.kernel_s)

    def __sub__(self, o: Cpu) -> Cpu:
        return Cpu(self.user_s - o.user_s, self.kernel_s - o.kernel_s)

    def scaled(self, k: float) -> Cpu:
        return Cpu(self.user_s * k, self.kernel_s * k)

    @property
    def total_s(self) -> float:
        return self.user_s + self.kernel_s


def own_cpu(pid: int) -> Cpu:
    """The process's own CPU, its threads included (not its children's)."""
    v = proc_stat(pid)
    return Cpu(int(v[11]) / TICK, int(v[12]) / TICK)


def tree_cpu(pid: int, children: dict[int, list[int]]) -> Cpu:
    return Cpu(*tree_cpu_split_s(pid, children))


def tree_faults(pid: int, children: dict[int, list[int]]) -> int:
    """Minor page faults of the tree (copy-on-write after a fork among them), reaped children included."""
    total = 0
    for p in _tree(pid, children):
        try:
            v = proc_stat(p)
            total += int(v[7]) + int(v[8])
        except (OSError, IndexError, ValueError):
            continue
    return total


def client_cpu() -> Cpu:
    r = resource.getrusage(resource.RUSAGE_SELF)  # this process, all its threads
    return Cpu(r.ru_utime, r.ru_stime)


def threads_cpu(pid: int) -> dict[str, float]:
    """CPU seconds of the process's main thread (its event loop) and of its other live threads."""
    out: dict[str, float] = {}
    for entry in os.scandir(f"/proc/{pid}/task"):
        try:
            with open(f"{entry.path}/stat") as f:
                raw = f.read()
        except OSError:
            continue
        # Python 3.11 does not name its threads for the OS: the event loop's thread, and the others
        name = "event loop (main thread)" if entry.name == str(pid) else "other threads (store calls, pools)"
        v = raw.rpartition(")")[2].split()[11:13]
        out[name] = out.get(name, 0.0) + (int(v[0]) + int(v[1])) / TICK
    return out


def store_requests(url: str) -> dict[str, int]:
    """The replica's S3 requests so far by operation (rollbox_store_requests_total), but its bucket checks."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "metrics", timeout=10).text
    out = store_ops(text)
    out["(resumes)"] = int(sum(smp.value for fam in text_string_to_metric_families(text) for smp in fam.samples
                               if smp.name == "rollbox_resumes_total"))
    out["(hibernated creates)"] = int(sum(smp.value for fam in text_string_to_metric_families(text) for smp in fam.samples
                                          if smp.name == "rollbox_hibernations_total" and smp.labels["reason"] == "create"))
    return out


def all_requests(urls: list[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for u in urls:
        for k, n in store_requests(u).items():
            out[k] = out.get(k, 0) + n
    return out


@dataclass(frozen=True)
class Sample:
    """Every part's CPU so far, at one moment (the client's is read apart, closest to the phase)."""

    cpu: dict[str, Cpu]
    faults: dict[str, int]  # minor page faults: servers, sandboxes
    threads: dict[str, float]


def sample(servers: list[int], weed: int) -> Sample:
    ch = _children()
    own = [own_cpu(p) for p in servers]
    tree = [tree_cpu(p, ch) for p in servers]
    own_faults = [int(proc_stat(p)[7]) for p in servers]
    threads: dict[str, float] = {}
    for p in servers:
        for k, v in threads_cpu(p).items():
            threads[k] = threads.get(k, 0.0) + v
    return Sample(
        cpu={"servers": sum(own, Cpu()), "sandboxes": sum(tree, Cpu()) - sum(own, Cpu()),
             "seaweedfs": tree_cpu(weed, ch)},
        faults={"servers": sum(own_faults),
                "sandboxes": sum(tree_faults(p, ch) for p in servers) - sum(own_faults)},
        threads=threads)


@dataclass(frozen=True)
class Phase:
    """The measured phase: what each part did between its two samples."""

    took_s: float
    n: int  # requests (steps with --steps-only)
    cpu: dict[str, Cpu]
    faults: dict[str, int]
    threads: dict[str, float]
    requests: dict[str, int]
    weed_idle: Cpu  # per second, taken out of SeaweedFS's share


class RoundRobin:
    """Each request to the next replica, whatever the sandbox: a load balancer without affinity."""

    def __init__(self, http: httpx.AsyncClient, urls: list[str]):
        self.http = http
        self.urls: Iterator[str] = itertools.cycle(urls)

    async def send(self, etype: str, data: dict[str, Any]) -> dict[str, Any]:
        headers = {"ce-specversion": "1.0", "ce-type": f"dev.rollbox.sandbox.{etype}", "ce-source": "/profile",
                   "ce-id": uuid.uuid4().hex, "content-type": "application/json"}
        r = await self.http.post(next(self.urls), headers=headers, json=data)
        assert r.status_code == 200, r.text
        out: dict[str, Any] = r.json()
        return out

    async def create(self) -> str:
        sid: str = (await self.send("create", {"snapshot": "python"}))["sandbox_id"]
        return sid

    async def steps(self, sid: str, steps: int) -> None:
        for _ in range(steps):
            await asyncio.sleep(THINK_S)
            await self.send("exec", {"sandbox_id": sid, "code": STEP})

    async def destroy(self, sid: str) -> None:
        await self.send("destroy", {"sandbox_id": sid})


async def limited(concurrency: int, jobs: list[Any]) -> list[Any]:
    sem = asyncio.Semaphore(concurrency)

    async def one(job: Any) -> Any:
        async with sem:
            return await job

    return await asyncio.gather(*(one(j) for j in jobs))


async def episodes(rr: RoundRobin, n: int, steps: int, concurrency: int) -> int:
    """``n`` whole episodes (create, steps, destroy); returns the requests sent."""
    async def one() -> None:
        sid = await rr.create()
        await rr.steps(sid, steps)
        await rr.destroy(sid)
    await limited(concurrency, [one() for _ in range(n)])
    return n * (steps + 2)


class Perf:
    """`perf record -g` of the servers' processes over the measured phase, if perf is installed."""

    def __init__(self, out: Path | None, pids: list[int]):
        self.out, self.pids = out, pids
        self.proc: subprocess.Popen[bytes] | None = None
        self.note = ""  # printed after the figures

    def start(self) -> None:
        if self.out is None:
            return
        perf = shutil.which("perf")
        if perf is None:
            print(f"--perf {self.out}: no `perf` on PATH (Debian: apt-get install linux-perf); measuring without it",
                  file=sys.stderr)
            return
        self.proc = subprocess.Popen([perf, "record", "-g", "-o", str(self.out), "-p", ",".join(map(str, self.pids))],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        time.sleep(1.0)  # attached to every thread
        if self.proc.poll() is not None:
            err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
            print(f"--perf {self.out}: perf record exited with {self.proc.returncode}: {err.strip()[-500:]}",
                  file=sys.stderr)
            self.proc = None

    def stop(self) -> None:
        if self.proc is None:
            return
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self.note = (f"  perf: the servers over the measured phase in {self.out} (perf report -i {self.out} "
                     "--no-children; its CPU is in no part above, but it slows the servers)")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def wait_ready(urls: list[str], procs: list[subprocess.Popen[bytes]], logs: list[Path], timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    for url, proc, log in zip(urls, procs, logs, strict=True):
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"rollbox serve ({url}) exited with {proc.returncode}:\n"
                                   + log.read_text(errors="replace")[-3000:])
            try:
                if httpx.get(url + "readyz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{url} not ready after {timeout_s:.0f} s")
            time.sleep(0.2)


def report(args: argparse.Namespace, ph: Phase) -> None:
    n, unit = ph.n, "step" if args.steps_only else "request"
    what = (f"{args.episodes} episodes created first, {args.steps} resumed steps each, destroyed after, unmeasured"
            if args.steps_only else f"{args.episodes} episodes of create, {args.steps} resumed steps, destroy")
    print(f"{n} {unit}s in {ph.took_s:.1f} s, {n / ph.took_s:.1f} {unit}s/s ({what}; round-robin over {args.replicas} "
          f"replica{'s' if args.replicas > 1 else ''}; c{args.concurrency})"
          + ("" if args.no_cprofile else "; under cProfile, so slower than without it") + ":")
    ms = 1000 / n
    print(f"CPU per {unit} (ms)     user  kernel   total")
    notes = {"servers": "  (threads included)", "sandboxes": "  (the servers' descendants: zygotes, sandboxes)",
             "seaweedfs": f"  (its idle {ph.weed_idle.total_s * 1000:.0f} ms/s taken out)", "client": "  (this script: HTTP, JSON)"}
    for k in PARTS:
        c = ph.cpu[k]
        print(f"  {k:<18}{c.user_s * ms:7.2f} {c.kernel_s * ms:7.2f} {c.total_s * ms:7.2f}{notes[k]}")
    three = ph.cpu["servers"] + ph.cpu["sandboxes"] + ph.cpu["seaweedfs"]
    total = three + ph.cpu["client"]
    print(f"  {'all in':<18}{total.user_s * ms:7.2f} {total.kernel_s * ms:7.2f} {total.total_s * ms:7.2f}")
    print(f"  all three (servers, sandboxes, SeaweedFS; the client not counted) {three.total_s * ms:.2f} ms/{unit}")
    print(f"  minor page faults per {unit}: servers {ph.faults['servers'] / n:.0f}, sandboxes "
          f"{ph.faults['sandboxes'] / n:.0f} (copy-on-write after the zygotes' forks among them)")
    for name in sorted(ph.threads, key=lambda k: -ph.threads[k]):
        if ph.threads[name] > 0:
            print(f"    servers' thread {name:<34} {ph.threads[name] * ms:6.2f} ms/{unit}")
    sent = dict(ph.requests)
    resumed = sent.pop("(resumes)", 0)
    created = sent.pop("(hibernated creates)", 0)
    print(f"  sandboxes resumed from S3: {resumed} for {args.episodes * args.steps} steps"
          + ("" if args.steps_only else f"; creates that restored none (committed hibernated): {created} of {args.episodes}"))
    print(f"  S3 requests per {unit} {sum(sent.values()) / n:.2f}: "
          + ", ".join(f"{op} {k / n:.2f}" for op, k in sorted(sent.items())))


async def measure(args: argparse.Namespace, urls: list[str], servers: list[int], weed: int, perf: Perf) -> Phase:
    async with httpx.AsyncClient(timeout=120) as http:
        rr = RoundRobin(http, urls)
        if args.warm_episodes:  # warm: pools, connections, the first resumes
            await episodes(rr, args.warm_episodes, args.steps, 4)
        sids: list[str] = []
        if args.steps_only:
            sids = await limited(args.concurrency, [rr.create() for _ in range(args.episodes)])
        i0, idle0 = time.monotonic(), tree_cpu(weed, _children())
        await asyncio.sleep(3.0)  # SeaweedFS's own background work, to take out of its share
        weed_idle = (tree_cpu(weed, _children()) - idle0).scaled(1 / (time.monotonic() - i0))
        perf.start()
        # each part read as close to the phase as it can be: the servers' /metrics and the client's own
        # reading of /proc outside the phase
        r0 = all_requests(urls)
        s0 = sample(servers, weed)
        c0, t0 = client_cpu(), time.monotonic()
        if args.steps_only:
            await limited(args.concurrency, [rr.steps(sid, args.steps) for sid in sids])
            n = args.episodes * args.steps
        else:
            n = await episodes(rr, args.episodes, args.steps, args.concurrency)
        t1, c1 = time.monotonic(), client_cpu()
        s1 = sample(servers, weed)
        r1 = all_requests(urls)
        perf.stop()
        await limited(args.concurrency, [rr.destroy(sid) for sid in sids])
    took = t1 - t0
    cpu = {k: s1.cpu[k] - s0.cpu[k] for k in s1.cpu}
    cpu["seaweedfs"] = cpu["seaweedfs"] - weed_idle.scaled(took)
    cpu["client"] = c1 - c0
    return Phase(took_s=took, n=n, cpu=cpu, faults={k: s1.faults[k] - s0.faults[k] for k in s1.faults},
                 threads={k: s1.threads[k] - s0.threads.get(k, 0.0) for k in s1.threads},
                 requests={op: k - r0.get(op, 0) for op, k in r1.items() if k > r0.get(op, 0)}, weed_idle=weed_idle)


PROFILED_MAIN = """
import cProfile, sys, time
from rollbox.functions.cli.main import main
out = sys.argv.pop(1)
profile = cProfile.Profile(time.thread_time)  # the event loop's thread's CPU, not the wall clock
rc = profile.runcall(main)
profile.dump_stats(out)
sys.exit(rc)
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--episodes", type=int, default=40)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=8, help="episodes played at once")
    ap.add_argument("--replicas", type=int, default=1,
                    help="`rollbox serve` replicas on the one SeaweedFS; requests go to each in turn (no affinity)")
    ap.add_argument("--steps-only", action="store_true",
                    help="create every episode first and destroy them after, unmeasured: CPU per step")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--no-cprofile", action="store_true", help="run the servers as they are: their CPU by thread only")
    ap.add_argument("--perf", type=Path, default=None, metavar="FILE",
                    help="record `perf record -g` of the servers over the measured phase into FILE (needs perf)")
    ap.add_argument("--weed-arg", action="append", default=[], metavar="ARG",
                    help="one more flag for `weed mini` (repeatable), e.g. --weed-arg=-volume.max=0")
    ap.add_argument("--weed-procs", type=int, default=WEED_PROCS,
                    help="SeaweedFS's GOMAXPROCS, as the local fleet sets it (0: Go's default)")
    ap.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                    help="one more flag for every `rollbox serve` (repeatable; write --serve-arg=--flag=value)")
    ap.add_argument("--base", type=Path, default=None,
                    help="directory for the logs, homes and S3 data (default: a new temp dir; removed after a run that worked)")
    ap.add_argument("--warm-episodes", type=int, default=4,
                    help="episodes played before measuring (pools, connections); 0: measure from fresh replicas")
    args = ap.parse_args()
    if args.replicas < 1 or args.episodes < 1 or args.steps < 1:
        ap.error("--replicas, --episodes and --steps must be at least 1")
    base = args.base or Path(tempfile.mkdtemp(prefix="rollbox-profile-replica-"))
    base.mkdir(parents=True, exist_ok=True)
    s3 = SeaweedS3(base / "s3", extra_args=args.weed_arg, procs=args.weed_procs or None)
    procs: list[subprocess.Popen[bytes]] = []
    perf = Perf(args.perf, [])
    ok = False
    try:
        s3.start()
        bucket = s3.new_bucket()
        env = {**{k: v for k, v in os.environ.items() if not k.startswith("ROLLBOX_")},
               "AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_REGION": "us-east-1",
               "AWS_ENDPOINT_URL": s3.endpoint, "ROLLBOX_STORE": f"s3://{bucket}/p"}
        ports = free_ports(args.replicas)
        profs = [base / f"serve-{i}.prof" for i in range(args.replicas)]
        logs = [base / f"serve-{i}.log" for i in range(args.replicas)]
        for i, port in enumerate(ports):
            log = open(logs[i], "wb")  # noqa: SIM115 - handed to the child
            # (serve ends with os._exit, past where `python -m cProfile -o` writes its file: the profile is
            # of main() and written when it returns)
            run = ["-m", "rollbox.functions.cli"] if args.no_cprofile else ["-c", PROFILED_MAIN, str(profs[i])]
            procs.append(subprocess.Popen(
                [sys.executable, *run, "serve", "--port", str(port),
                 "--home", str(base / f"home-{i}"), "--log-level", "warning", "--hibernate-after-s", "0.02",
                 *args.serve_arg], stdout=log, stderr=subprocess.STDOUT, env=env))
            log.close()
        urls = [f"http://127.0.0.1:{port}/" for port in ports]
        wait_ready(urls, procs, logs)
        assert s3.proc is not None
        perf.pids = [p.pid for p in procs]
        phase = asyncio.run(measure(args, urls, perf.pids, s3.proc.pid, perf))
        for p in procs:
            os.kill(p.pid, signal.SIGTERM)
        for p in procs:
            p.wait(120)
        report(args, phase)
        if perf.note:
            print(perf.note)
        if not args.no_cprofile:
            st = pstats.Stats(*map(str, profs))  # the replicas' profiles, added up
            st.sort_stats("tottime").print_stats(args.top)
            st.sort_stats("cumulative").print_stats(args.top)
        ok = True
    finally:
        perf.kill()
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
        s3.stop()
        if ok and args.base is None:
            shutil.rmtree(base, ignore_errors=True)
        else:
            print(f"logs and data kept in {base}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
