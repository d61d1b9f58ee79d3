"""Where a replica's own CPU goes on durable steps on S3: one `rollbox serve` on SeaweedFS run under
cProfile (its event loop's thread; the store calls' threads are not profiled: see profile_s3_step.py),
driven by episodes as the fleet run plays them with long think times: create, then steps that each
find their sandbox hibernated (--hibernate-after-s 0.02; 0 would be never) and resume it from S3, then destroy.

Prints the server process's CPU per request (threads included), its children's (zygotes and
sandboxes) and SeaweedFS's, the S3 requests per request by operation, then the profile's top functions by own time and by cumulative time.

    .venv/bin/python loadtest/profile_replica.py --episodes 40 --steps 3
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pstats
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

sys.path.insert(0, str(ROOT / "loadtest"))
from bench_capacity import _children, tree_cpu_s  # noqa: E402

from tests.snapshots.s3server import ACCESS_KEY, SECRET_KEY, SeaweedS3, free_ports  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")
STEP = ("import hashlib\nwith open('trajectory.txt', 'a') as f:\n    f.write('step\\n')\n"
        "print(hashlib.sha256(open('trajectory.txt', 'rb').read()).hexdigest())\n")


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


def cpu(pid: int) -> tuple[float, float]:
    """(own CPU s, threads included; its descendants' CPU s: zygotes and sandboxes, reaped ones too)."""
    with open(f"/proc/{pid}/stat") as f:
        v = [int(x) for x in f.read().rpartition(")")[2].split()[11:13]]
    own = sum(v) / TICK
    return own, tree_cpu_s(pid, _children()) - own


def store_requests(url: str) -> dict[str, int]:
    """The replica's S3 requests so far by operation (rollbox_store_requests_total), but its bucket checks."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "metrics", timeout=10).text
    out = {smp.labels["operation"]: int(smp.value) for fam in text_string_to_metric_families(text)
           for smp in fam.samples if smp.name == "rollbox_store_requests_total" and smp.labels["operation"] != "HeadBucket"}
    out["(resumes)"] = int(sum(smp.value for fam in text_string_to_metric_families(text) for smp in fam.samples
                               if smp.name == "rollbox_resumes_total"))
    out["(hibernated creates)"] = int(sum(smp.value for fam in text_string_to_metric_families(text) for smp in fam.samples
                                          if smp.name == "rollbox_hibernations_total" and smp.labels["reason"] == "create"))
    return out


async def send(http: httpx.AsyncClient, url: str, etype: str, data: dict[str, Any]) -> dict[str, Any]:
    headers = {"ce-specversion": "1.0", "ce-type": f"dev.rollbox.sandbox.{etype}", "ce-source": "/profile",
               "ce-id": uuid.uuid4().hex, "content-type": "application/json"}
    r = await http.post(url, headers=headers, json=data)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


async def drive(url: str, episodes: int, steps: int, concurrency: int) -> int:
    sem = asyncio.Semaphore(concurrency)
    count = 0

    async def one(http: httpx.AsyncClient) -> None:
        nonlocal count
        async with sem:
            sid = (await send(http, url, "create", {"snapshot": "python"}))["sandbox_id"]
            for _ in range(steps):
                await asyncio.sleep(0.05)  # idle past --hibernate-after-s 0.02: the next step resumes it
                await send(http, url, "exec", {"sandbox_id": sid, "code": STEP})
            await send(http, url, "destroy", {"sandbox_id": sid})
            count += steps + 2

    async with httpx.AsyncClient(timeout=120) as http:
        await asyncio.gather(*(one(http) for _ in range(episodes)))
    return count


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--episodes", type=int, default=40)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--no-cprofile", action="store_true", help="run the server as is: its CPU by thread only")
    ap.add_argument("--warm-episodes", type=int, default=4,
                    help="episodes played before measuring (pools, connections); 0: measure from a fresh replica")
    args = ap.parse_args()
    base = Path(tempfile.mkdtemp(prefix="rollbox-profile-replica-"))
    s3 = SeaweedS3(base / "s3")
    s3.start()
    proc: subprocess.Popen[bytes] | None = None
    try:
        bucket = s3.new_bucket()
        env = {**{k: v for k, v in os.environ.items() if not k.startswith("ROLLBOX_")},
               "AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_REGION": "us-east-1",
               "AWS_ENDPOINT_URL": s3.endpoint, "ROLLBOX_STORE": f"s3://{bucket}/p"}
        (port,) = free_ports(1)
        prof = base / "serve.prof"
        log = open(base / "serve.log", "wb")  # noqa: SIM115 - handed to the child
        profiler = [] if args.no_cprofile else ["-m", "cProfile", "-o", str(prof)]
        proc = subprocess.Popen([sys.executable, *profiler, "-m", "rollbox.functions.cli", "serve", "--port", str(port), "--home", str(base / "home"), "--log-level", "warning",
                                 "--hibernate-after-s", "0.02"], stdout=log, stderr=subprocess.STDOUT, env=env)
        log.close()
        url = f"http://127.0.0.1:{port}/"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "readyz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        if args.warm_episodes:  # warm: pools, connections, the first resumes
            asyncio.run(drive(url, args.warm_episodes, args.steps, 4))
        assert s3.proc is not None
        idle0, i0 = tree_cpu_s(s3.proc.pid, _children()), time.monotonic()
        time.sleep(3.0)  # SeaweedFS's own background work, to take out of its share
        weed_idle_s = (tree_cpu_s(s3.proc.pid, _children()) - idle0) / (time.monotonic() - i0)
        own0, kids0, th0, weed0, req0 = *cpu(proc.pid), threads_cpu(proc.pid), tree_cpu_s(s3.proc.pid, _children()), \
            store_requests(url)
        t0 = time.monotonic()
        n = asyncio.run(drive(url, args.episodes, args.steps, args.concurrency))
        own1, kids1, th1, weed1, req1 = *cpu(proc.pid), threads_cpu(proc.pid), tree_cpu_s(s3.proc.pid, _children()), \
            store_requests(url)
        took = time.monotonic() - t0
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(120)
        print(f"{n} requests in {took:.1f} s ({args.episodes} episodes of create, {args.steps} resumed steps, destroy; "
              f"c{args.concurrency})" + ("" if args.no_cprofile else "; under cProfile, so slower than without it") + ":")
        print(f"  server process (threads included) {(own1 - own0) * 1000 / n:.2f} ms/request; its descendants "
              f"(zygotes, sandboxes) {(kids1 - kids0) * 1000 / n:.2f} ms/request")
        for name in sorted(th1, key=lambda k: th0.get(k, 0.0) - th1[k]):
            if (d := th1[name] - th0.get(name, 0.0)) > 0:
                print(f"    thread {name:<24} {d * 1000 / n:6.2f} ms/request")
        weed = weed1 - weed0 - weed_idle_s * took
        all_in = own1 - own0 + kids1 - kids0 + weed
        print(f"  SeaweedFS {weed * 1000 / n:.2f} ms/request (its idle {weed_idle_s * 1000:.0f} ms/s taken out); "
              f"all three {all_in * 1000 / n:.2f} ms/request")
        sent = {op: k - req0.get(op, 0) for op, k in req1.items() if k > req0.get(op, 0)}
        print(f"  steps that resumed their sandbox: {sent.pop('(resumes)', 0)} of {args.episodes * args.steps}; "
              f"creates that restored none (committed hibernated): {sent.pop('(hibernated creates)', 0)} of {args.episodes}")
        print(f"  S3 requests per request {sum(sent.values()) / n:.2f}: "
              + ", ".join(f"{op} {k / n:.2f}" for op, k in sorted(sent.items())))
        if args.no_cprofile:
            return 0
        st = pstats.Stats(str(prof))
        st.sort_stats("tottime").print_stats(args.top)
        st.sort_stats("cumulative").print_stats(args.top)
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(10)
        s3.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
