"""Durable steps, side by side in one run, on SeaweedFS (started on 127.0.0.1 for the run):

  - step latency with durability off vs step, writing 1 KiB, 64 KiB, 1 MiB and 10 MiB per step;
  - a cross-replica step: resume + `print(1)` on the other replica, with a 1 MiB diff;
  - hibernate + resume: the step after an idle hibernation, on the same replica;
  - one-shot `run` throughput (8 at a time) with durability off vs step: runs keep no durable state;
  - churn: many open episodes over a small live cap (the embedded default, local store and recording),
    each idle longer than a live copy lasts (``--hibernate-after-s 0.5``) when its next step comes: every
    step resumes its sandbox and passes through (runs as its init, which hibernates it as it ends), as
    in the many-users Locust run; the machine's CPU per such step is what bounds how many episodes one
    box serves.

Every server is a real `rollbox serve` (the durable ones share one bucket); every reply is checked.

    .venv/bin/python loadtest/bench_durable.py [-n 40]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.*
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "functions"))

from svc_testkit import ServerProc, event, send, start_server

from tests.snapshots.s3server import ACCESS_KEY, SECRET_KEY, SeaweedS3

KiB = 1024


def busy_s() -> float:
    """Busy CPU seconds of the whole machine so far (all cores), from /proc/stat."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + fields[4]
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def step(http: httpx.AsyncClient, srv: ServerProc, sid: str, **data: Any) -> tuple[float, dict[str, Any]]:
    t0 = time.perf_counter()
    r = await send(http, srv.url, event("dev.rollbox.sandbox.exec", {"sandbox_id": sid, **data}))
    ms = (time.perf_counter() - t0) * 1000
    if r.status != 200 or r.data.get("exit_code") != 0:
        raise SystemExit(f"step failed: {r.status} {r.data}")
    return ms, r.data


async def create(http: httpx.AsyncClient, srv: ServerProc) -> str:
    r = await send(http, srv.url, event("dev.rollbox.sandbox.create", {}))
    if r.status != 200:
        raise SystemExit(f"create failed: {r.status} {r.data}")
    return str(r.data["sandbox_id"])


def write_code(size: int) -> str:
    return f"import os; open('payload.bin', 'wb').write(os.urandom({size})); print('ok')"


# the Locust file's action: append a line to the state file, print the file's sha256
CHURN_CODE = ("import hashlib\nwith open('trajectory.txt', 'a') as f:\n    f.write('step\\n')\n"
              "print(hashlib.sha256(open('trajectory.txt', 'rb').read()).hexdigest())\n")


async def churn_row(http: httpx.AsyncClient, srv: ServerProc, args: argparse.Namespace,
                    rows: list[tuple[str, int, float, float, float]]) -> float:
    """Steps round-robin over more open sandboxes than the live cap, 8 at a time: each one resumes (its
    sandbox idle for longer than the server's --hibernate-after-s) and passes through."""
    sids = [await create(http, srv) for _ in range(args.churn_sandboxes)]
    await asyncio.sleep(1.5)
    todo = iter(range(args.churn_steps))
    lat: list[float] = []

    async def worker() -> None:
        for i in todo:
            ms, data = await step(http, srv, sids[i % len(sids)], code=CHURN_CODE)
            assert (data["resumed"], data["hibernated"]) == (True, True), data
            lat.append(ms)

    c0, t0 = busy_s(), time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(8)))
    wall, cpu = time.perf_counter() - t0, (busy_s() - c0) * 1000 / len(lat)
    rows.append((f"churn: {args.churn_sandboxes} episodes, --max-live {args.churn_live}, c8 (each step resumes, passes through)",
                 len(lat), statistics.median(lat), pct(lat, 0.99), cpu))
    return len(lat) / wall


async def run_rows(http: httpx.AsyncClient, servers: list[tuple[str, ServerProc]], n: int,
                   rows: list[tuple[str, int, float, float, float]]) -> dict[str, float]:
    """One-shot `run` events, 8 at a time, against each server, twice in alternating order: a run keeps
    no durable state, so its throughput should not depend on durability. Returns runs/s by server."""
    lat: dict[str, list[float]] = {name: [] for name, _ in servers}
    cpu: dict[str, float] = dict.fromkeys(lat, 0.0)
    wall: dict[str, float] = dict.fromkeys(lat, 0.0)
    for order in (servers, servers[::-1]):
        for name, srv in order:
            todo = iter(range(n))

            async def worker(srv: ServerProc = srv, name: str = name, todo: Any = todo) -> None:
                for _ in todo:
                    t0 = time.perf_counter()
                    r = await send(http, srv.url, event("dev.rollbox.sandbox.run", {"code": "print(1)"}))
                    if r.status != 200 or r.data.get("stdout") != "1\n":
                        raise SystemExit(f"run failed: {r.status} {r.data}")
                    lat[name].append((time.perf_counter() - t0) * 1000)

            c0, t0 = busy_s(), time.perf_counter()
            await asyncio.gather(*(worker() for _ in range(8)))
            wall[name] += time.perf_counter() - t0
            cpu[name] += busy_s() - c0
    for name, _ in servers:
        xs = lat[name]
        rows.append((f"one-shot run, c8, durability {name}", len(xs), statistics.median(xs), pct(xs, 0.99),
                     cpu[name] * 1000 / len(xs)))
    return {name: len(lat[name]) / wall[name] for name, _ in servers}


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", type=int, default=40, help="steps per row")
    ap.add_argument("--hibernate-rounds", type=int, default=8)
    ap.add_argument("--churn-sandboxes", type=int, default=300, help="open episodes of the churn row")
    ap.add_argument("--churn-live", type=int, default=16, help="--max-live of the churn row's server")
    ap.add_argument("--churn-steps", type=int, default=600)
    ap.add_argument("--runs", type=int, default=300, help="one-shot runs per server and round (two rounds)")
    args = ap.parse_args()
    base = Path(tempfile.mkdtemp(prefix="rollbox-bench-durable-"))
    s3 = SeaweedS3(base / "s3")
    s3.start()
    servers: list[ServerProc] = []
    try:
        bucket = s3.new_bucket()
        env = {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_REGION": "us-east-1",
               "ROLLBOX_STORE": f"s3://{bucket}/bench", "AWS_ENDPOINT_URL": s3.endpoint}

        def start(name: str, *extra: str, store: bool = True) -> ServerProc:
            srv = start_server(base / name, "--home", str(base / f"home-{name}"), "--log-level", "warning",
                               *extra, env=env if store else {})
            servers.append(srv)
            return srv

        # durability measured without trajectory recording; recording's own cost is the last pair
        off = start("off", "--durability", "off", "--record", "off")
        local = start("local", "--hibernate-after-s", "0", "--record", "off", store=False)  # local store
        rec = start("rec", "--hibernate-after-s", "0", store=False)  # the embedded default: recording on
        a = start("a", "--hibernate-after-s", "0", "--record", "off")
        b = start("b", "--hibernate-after-s", "0", "--record", "off")
        hib = start("hib", "--hibernate-after-s", "1")
        churn = start("churn", "--max-live", str(args.churn_live), "--hibernate-after-s", "0.5", store=False)
        rows: list[tuple[str, int, float, float, float]] = []
        async with httpx.AsyncClient(timeout=120) as http:
            for size in (1 * KiB, 64 * KiB, 1024 * KiB, 10 * 1024 * KiB):
                for name, srv in (("off", off), ("step", a), ("local", local), ("rec", rec)):
                    sid = await create(http, srv)
                    await step(http, srv, sid, code=write_code(size))  # warm: the first step pays the zygote
                    c0 = busy_s()
                    lat = [(await step(http, srv, sid, code=write_code(size)))[0] for _ in range(args.n)]
                    cpu = (busy_s() - c0) * 1000 / args.n
                    label = {"off": "off       ", "step": "step (S3) ", "local": "step local",
                             "rec": "step local"}[name] + (" + recording" if name == "rec" else "")
                    rows.append((f"durability {label} write {size // KiB:>5} KiB/step", len(lat),
                                 statistics.median(lat), pct(lat, 0.99), cpu))
            # cross-replica: each step on the replica that did not run the previous one
            sid = await create(http, a)
            await step(http, a, sid, code=write_code(1024 * KiB))
            await step(http, b, sid, code="print(1)")
            cross, resume = [], []
            c0 = busy_s()
            for i in range(args.n):
                ms, data = await step(http, (a, b)[i % 2], sid, code="print(1)")
                assert data["resumed"] is True, data
                cross.append(ms)
                resume.append(float(data["resume_ms"]))
            cpu = (busy_s() - c0) * 1000 / args.n
            rows.append(("cross-replica step (resume + print(1)), 1 MiB diff", len(cross),
                         statistics.median(cross), pct(cross, 0.99), cpu))
            rows.append(("  of which resume (in the server)", len(resume),
                         statistics.median(resume), pct(resume, 0.99), float("nan")))
            sid = await create(http, hib)
            await step(http, hib, sid, code=write_code(64 * KiB))
            after: list[float] = []
            for _ in range(args.hibernate_rounds):
                await asyncio.sleep(1.6)  # idle past --hibernate-after-s 1: committed and ended
                ms, data = await step(http, hib, sid, code="print(1)")
                assert data["resumed"] is True, data
                after.append(ms)
            rows.append(("step after hibernation (resume + print(1)), 64 KiB diff", len(after),
                         statistics.median(after), pct(after, 0.99), float("nan")))
            churn_rate = await churn_row(http, churn, args, rows)
            run_rates = await run_rows(http, [("off", off), ("step (S3)", a), ("step local", local)],
                                       args.runs, rows)
        print(f"{'path':58} {'n':>4} {'p50 ms':>8} {'p99 ms':>8} {'CPU ms/step':>12}")
        for name, n, p50, p99, cpu in rows:
            print(f"{name:58} {n:4d} {p50:8.2f} {p99:8.2f} {cpu:12.1f}")
        by = {r[0]: r[2] for r in rows}
        for size in (1, 64, 1024, 10240):
            off_ms = by[f"durability off        write {size:>5} KiB/step"]
            d3 = by[f"durability step (S3)  write {size:>5} KiB/step"] - off_ms
            dl = by[f"durability step local write {size:>5} KiB/step"] - off_ms
            print(f"durability adds {d3:6.2f} ms p50 (S3), {dl:6.2f} ms p50 (local store) to a step writing {size} KiB")
        for size in (1, 64, 1024, 10240):
            plain = by[f"durability step local write {size:>5} KiB/step"]
            recorded = by[f"durability step local + recording write {size:>5} KiB/step"]
            print(f"recording adds {recorded - plain:6.2f} ms p50 to a durable step (local store) writing {size} KiB")
        print("one-shot runs/s, c8: " + ", ".join(f"durability {k} {v:.1f}" for k, v in run_rates.items())
              + f" (step vs off: {100 * (run_rates['step (S3)'] / run_rates['off'] - 1):+.1f} % S3, "
              f"{100 * (run_rates['step local'] / run_rates['off'] - 1):+.1f} % local store)")
        print(f"churn: {churn_rate:.1f} steps/s, every one a resume that passed through (ran as the resumed "
              "sandbox's init, which hibernated it as it ended)")
        print("(SeaweedFS `weed mini` on 127.0.0.1; every server a real `rollbox serve`; one client, sequential steps;"
              " CPU ms/step: busy CPU of the whole machine per step, SeaweedFS and this client included)")
    finally:
        for srv in servers:
            srv.stop()
        s3.stop()
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    asyncio.run(main())
