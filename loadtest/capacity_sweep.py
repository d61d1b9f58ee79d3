"""One replica's capacity curve (`bench_capacity.py --sweep`): offered load swept against ONE `rollbox
serve` on SeaweedFS (fleet_local's Fleet with one replica; requests go to the replica's own port, as a
queue-proxy sends them), by open episodes x think time.

    .venv/bin/python loadtest/bench_capacity.py --sweep --quick --out /tmp/cap      # ~1 min, 3 points
    .venv/bin/python loadtest/bench_capacity.py --sweep --out /tmp/cap              # ~8 min, 10 points

Each episode is a trainer's rollout: create, then steps (append a line to a state file, print the
file's sha256; every reply is checked) with a think time before each (uniform in 0.5-1.5 x --think),
until the sweep moves on. The points run in order on the same replica; before each the open episodes
are made (or destroyed) to its count; then --warmup-s (at least one think time) and a --window-s
measured window. Think times
below the replica's --hibernate-after-s keep sandboxes live; longer ones make every step resume its
episode from S3 (a durable step).

Per point (CSV, one row; PNG, four panels): offered and served steps/s, step p50/p99 (the whole
round trip, retries of 429/503 included), machine CPU per step split into the server (its process,
threads included), its sandboxes (zygotes and sandboxes: its descendants), the store (SeaweedFS's
tree) and the load generator (this process's asyncio thread); the machine's busy CPU beside (the box
is shared); memory (PSS) per live sandbox (the sandboxes' growth over the replica's idle baseline /
live sandboxes, when there are 4 or more) and per open episode (the server's and SeaweedFS's growth / open episodes); S3
requests and bytes per step (SeaweedFS's own counters for the bucket) and S3 bytes stored per open
episode (the bucket listed); 429/503 retries; and the replica's cold start (start to first reply).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import csv
import hashlib
import os
import random
import statistics
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_capacity import MIB, TICK, _children, _tree, machine_busy_s, own_cpu_s, tree_cpu_s, tree_pss
from fleet_local import Fleet

STATE = "state.txt"
COLUMNS = [
    "point", "open_episodes", "think_s", "offered_steps_per_s", "steps_per_s", "step_p50_ms", "step_p99_ms",
    "steps", "retries", "failures",
    "cpu_ms_per_step_server", "cpu_ms_per_step_sandboxes", "cpu_ms_per_step_store", "cpu_ms_per_step_loadgen",
    "cpu_ms_per_step_all", "machine_busy_ms_per_step",
    "live_sandboxes", "hibernated_episodes", "replica_pss_mib", "store_pss_mib",
    "mem_per_live_sandbox_kib", "mem_per_open_episode_kib",
    "s3_requests_per_step", "s3_bytes_per_step", "s3_stored_bytes_per_open_episode", "cold_start_s",
]
FULL = [(4, 2.0), (12, 2.0), (24, 2.0), (40, 2.0), (64, 2.0), (100, 20.0), (200, 20.0), (300, 20.0), (400, 20.0),
        (600, 20.0), (1000, 20.0)]
QUICK = [(6, 1.0), (24, 1.0), (30, 5.0)]


def event(etype: str, data: dict[str, Any]) -> tuple[dict[str, str], dict[str, Any]]:
    return ({"ce-specversion": "1.0", "ce-type": f"dev.rollbox.sandbox.{etype}", "ce-source": "/bench/capacity-sweep",
             "ce-id": uuid.uuid4().hex, "content-type": "application/json"}, data)


@dataclass
class Episode:
    sid: str
    trajectory: bytes = b""
    stop: bool = False


@dataclass
class Load:
    """The load generator: episodes as asyncio tasks on one thread (its CPU is that thread's)."""

    url: str
    seed: int
    connections: int = 64
    think_s: float = 1.0
    latencies: list[tuple[float, float]] = field(default_factory=list)  # (finished at, seconds)
    retries: int = 0
    failures: list[str] = field(default_factory=list)
    episodes: dict[str, tuple[Episode, asyncio.Task[None]]] = field(default_factory=dict)
    loop: asyncio.AbstractEventLoop = field(default_factory=asyncio.new_event_loop)
    tid: int = 0

    def start(self) -> None:
        ready = threading.Event()

        def run() -> None:
            self.tid = threading.get_native_id()
            asyncio.set_event_loop(self.loop)
            self.http = httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=self.connections))
            ready.set()
            self.loop.run_forever()

        threading.Thread(target=run, daemon=True).start()
        ready.wait()

    def call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def cpu_s(self) -> float:
        try:
            with open(f"/proc/self/task/{self.tid}/stat") as f:
                return sum(int(x) for x in f.read().rpartition(")")[2].split()[11:13]) / TICK
        except OSError:
            return 0.0

    async def send(self, etype: str, data: dict[str, Any]) -> dict[str, Any]:
        """One event; 429/503 are retried after Retry-After (counted), anything else non-200 raises."""
        headers, body = event(etype, data)
        for _ in range(60):
            r = await self.http.post(self.url, headers=headers, json=body)
            if r.status_code in (429, 503):
                self.retries += 1
                await asyncio.sleep(float(r.headers.get("retry-after", "1")))
                continue
            if r.status_code != 200:
                raise RuntimeError(f"{etype}: {r.status_code} {r.text[:200]}")
            reply: dict[str, Any] = r.json() if r.content else {}
            return reply
        raise RuntimeError(f"{etype}: still refused after 60 tries")

    async def episode(self, ep: Episode, rng: random.Random) -> None:
        n = 0
        while not ep.stop:
            await asyncio.sleep(rng.uniform(0.5, 1.5) * self.think_s)
            if ep.stop:
                return
            n += 1
            line = f"step {n}: {uuid.uuid4().hex[:8]}"
            code = (f"import hashlib\nwith open({STATE!r}, 'a') as f:\n    f.write({line!r} + '\\n')\n"
                    f"print(hashlib.sha256(open({STATE!r}, 'rb').read()).hexdigest())\n")
            t0 = time.monotonic()
            try:
                r = await self.send("exec", {"sandbox_id": ep.sid, "code": code, "timeout_s": 60})
            except (httpx.HTTPError, RuntimeError) as exc:
                self.failures.append(f"{ep.sid}: {exc}")
                return
            ep.trajectory += line.encode() + b"\n"
            if r.get("stdout") != hashlib.sha256(ep.trajectory).hexdigest() + "\n":
                self.failures.append(f"{ep.sid}: step {n} stdout {str(r.get('stdout'))[:70]!r}: state lost?")
                return
            now = time.monotonic()
            self.latencies.append((now, now - t0))

    async def resize(self, count: int) -> None:
        """Open or destroy episodes until ``count`` are open (creates 16 at a time)."""
        sem = asyncio.Semaphore(16)

        async def open_one(i: int) -> None:
            async with sem:
                r = await self.send("create", {"snapshot": "python"})
            ep = Episode(r["sandbox_id"])
            task = asyncio.ensure_future(self.episode(ep, random.Random(f"{self.seed}-{ep.sid}")))
            self.episodes[ep.sid] = (ep, task)

        async def close_one(sid: str) -> None:
            ep, task = self.episodes.pop(sid)
            ep.stop = True
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
            async with sem:
                with contextlib.suppress(RuntimeError, httpx.HTTPError):
                    await self.send("destroy", {"sandbox_id": sid})

        if count > len(self.episodes):
            await asyncio.gather(*(open_one(i) for i in range(count - len(self.episodes))))
        else:
            await asyncio.gather(*(close_one(s) for s in list(self.episodes)[count:]))

    async def cancel(self) -> None:
        for ep, task in self.episodes.values():
            ep.stop = True
            task.cancel()
        await asyncio.gather(*(t for _, t in self.episodes.values()), return_exceptions=True)

    def stop(self) -> None:
        """Cancel every episode (not destroyed: the fleet and its bucket go after)."""
        with contextlib.suppress(Exception):
            self.call(self.cancel())
        with contextlib.suppress(Exception):
            self.call(self.http.aclose())
        self.loop.call_soon_threadsafe(self.loop.stop)


def scrape(url: str) -> dict[str, float]:
    """Prometheus text from ``url`` as {name{labels}: value}."""
    out: dict[str, float] = {}
    text = httpx.get(url, timeout=10).text
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[s.name + "{" + ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())) + "}"] = s.value
    return out


def s3_counters(fleet: Fleet) -> tuple[float, float]:
    """SeaweedFS's own counters for the fleet's bucket: requests, bytes sent + received."""
    m = scrape(f"http://127.0.0.1:{fleet.s3.ports['metricsPort']}/metrics")
    tag = f"bucket={fleet.bucket}"
    reqs = sum(v for k, v in m.items() if k.startswith("SeaweedFS_s3_request_total{") and tag in k)
    nbytes = sum(v for k, v in m.items() if k.startswith("SeaweedFS_s3_bucket_traffic_") and tag in k)
    return reqs, nbytes


def stored_bytes(fleet: Fleet) -> int:
    client = fleet.s3.client()
    total = 0
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=fleet.bucket):
        total += sum(int(o["Size"]) for o in page.get("Contents", []))
    return total


@dataclass
class Probe:
    fleet: Fleet

    def pids(self) -> tuple[int, int]:
        p = self.fleet.pids()
        return p["replica-1"], p["seaweedfs"]

    def cpu(self, load: Load) -> dict[str, float]:
        server, store = self.pids()
        ch = _children()
        own = own_cpu_s(server)
        return {"server": own, "sandboxes": tree_cpu_s(server, ch) - own, "store": tree_cpu_s(store, ch),
                "loadgen": load.cpu_s()}

    def memory(self) -> dict[str, float]:
        server, store = self.pids()
        ch = _children()
        own = tree_pss(server, {})  # the server process alone
        return {"server": own, "sandboxes": sum(tree_pss(p, {}) for p in _tree(server, ch) if p != server),
                "store": tree_pss(store, ch)}

    def live(self) -> int:
        port = self.fleet.replica_ports[0]
        m = scrape(f"http://127.0.0.1:{port}/metrics")
        return int(sum(v for k, v in m.items() if k.startswith("rollbox_live_sandboxes")))


def cold_start(fleet: Fleet) -> float:
    """Scale the (idle) replica to zero and back: seconds from its start to the first reply of a create."""
    fleet.scale_to_zero()
    url = f"http://127.0.0.1:{fleet.replica_ports[0]}/"

    def create(h: httpx.Client) -> httpx.Response:
        headers, body = event("create", {"snapshot": "python"})
        return h.post(url, headers=headers, json=body)

    def destroy(h: httpx.Client, r: httpx.Response) -> None:
        headers, body = event("destroy", {"sandbox_id": r.json()["sandbox_id"]})
        h.post(url, headers=headers, json=body)

    first = fleet.restart_probed(create, after=destroy).first_reply_s
    return first if first is not None else float("nan")


def saturation(row: dict[str, Any]) -> bool:
    """A point past the replica's limit: its steps wait longer than the episodes think, or it serves under
    70 % of open episodes / think (a closed loop serves open / (think + latency), so some shortfall is
    the latency's, not a limit's)."""
    return bool(row["step_p50_ms"] / 1000 > row["think_s"] or row["steps_per_s"] < 0.7 * row["offered_steps_per_s"])


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * len(s) + 0.5) - 1))]


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(2, 2, figsize=(12, 8))
    for think in sorted({r["think_s"] for r in rows}):
        pts = [r for r in rows if r["think_s"] == think]
        label = f"think {think:g} s"
        ax[0][0].plot([r["offered_steps_per_s"] for r in pts], [r["steps_per_s"] for r in pts], "o-", label=label)
        ax[0][1].plot([r["steps_per_s"] for r in pts], [r["step_p50_ms"] for r in pts], "o-", label=f"p50, {label}")
        ax[0][1].plot([r["steps_per_s"] for r in pts], [r["step_p99_ms"] for r in pts], "s--", label=f"p99, {label}")
        ax[1][1].plot([r["steps_per_s"] for r in pts], [r["s3_requests_per_step"] for r in pts], "o-",
                      label=f"S3 requests/step, {label}")
    top = max(max(r["offered_steps_per_s"], r["steps_per_s"]) for r in rows)
    ax[0][0].plot([0, top], [0, top], ":", color="grey", label="served = offered")
    ax[0][0].set_xlabel("offered steps/s")
    ax[0][0].set_ylabel("served steps/s")
    ax[0][1].set_xlabel("served steps/s")
    ax[0][1].set_ylabel("step latency (ms)")
    ax[0][1].set_yscale("log")
    xs = list(range(len(rows)))
    bottom = [0.0] * len(rows)
    for comp in ("server", "sandboxes", "store", "loadgen"):
        vals = [r[f"cpu_ms_per_step_{comp}"] for r in rows]
        ax[1][0].bar(xs, vals, bottom=bottom, label=comp)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax[1][0].set_xticks(xs, [f"{r['open_episodes']}x{r['think_s']:g}s" for r in rows], rotation=45, fontsize=7)
    ax[1][0].set_ylabel("machine CPU per step (ms)")
    ax[1][0].set_xlabel("point: open episodes x think")
    ax[1][1].set_xlabel("served steps/s")
    ax[1][1].set_ylabel("S3 requests per step")
    for a in ax.flat:
        a.legend(fontsize=7)
        a.grid(alpha=0.3)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sweep", action="store_true", help="(how bench_capacity.py sends you here)")
    ap.add_argument("--quick", action="store_true", help="3 points, short windows: under a minute")
    ap.add_argument("--points", default="", help="open episodes x think s, comma-separated: 50x2,400x20 (all run)")
    ap.add_argument("--warmup-s", type=float, default=None)
    ap.add_argument("--window-s", type=float, default=None)
    ap.add_argument("--hibernate-after-s", type=float, default=None)
    ap.add_argument("--connections", type=int, default=64)
    ap.add_argument("--past-saturation", action="store_true",
                    help="run every point (by default, in the full sweep, once a point is saturated, its step p50 above the think time "
                         "or its steps/s under 70 %% of open / think, the later points of the same think time are "
                         "skipped: they would only queue longer)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="directory for capacity.csv, capacity.png, the fleet's logs")
    args = ap.parse_args(argv)
    points = ([(int(e), float(t)) for e, t in (p.split("x") for p in args.points.split(","))] if args.points
              else QUICK if args.quick else FULL)
    warmup = args.warmup_s if args.warmup_s is not None else (2.0 if args.quick else 10.0)
    window = args.window_s if args.window_s is not None else (5.0 if args.quick else 30.0)
    hibernate = args.hibernate_after_s if args.hibernate_after_s is not None else (3.0 if args.quick else 6.0)
    out = args.out or Path(tempfile.mkdtemp(prefix="rollbox-capacity-sweep-"))
    out.mkdir(parents=True, exist_ok=True)
    command = "bench_capacity.py " + " ".join(argv if argv is not None else sys.argv[1:])
    load1 = os.getloadavg()[0]
    fleet = Fleet(out / "fleet", 1, serve_args=["--hibernate-after-s", f"{hibernate:g}", "--sweep-interval-s", "1",
                                                "--prewarm", "python"])
    rows: list[dict[str, Any]] = []
    machine = f"shared machine: {os.cpu_count()} cores, load average {load1:.1f} at the start, other jobs running"
    csv_file = open(out / "capacity.csv", "w", newline="")  # noqa: SIM115 - a row per point, as they come
    csv_file.write(f"# {command}\n# {machine}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\n")
    writer = csv.DictWriter(csv_file, fieldnames=COLUMNS)
    writer.writeheader()
    saturated: set[float] = set()
    fleet.start()
    load: Load | None = None
    try:
        cold = cold_start(fleet)
        probe = Probe(fleet)
        time.sleep(1.0)
        base_mem = probe.memory()
        base_stored = stored_bytes(fleet)
        load = Load(f"http://127.0.0.1:{fleet.replica_ports[0]}/", args.seed, args.connections)
        load.start()
        for i, (count, think) in enumerate(points):
            if think in saturated and not (args.past_saturation or args.quick or args.points):
                print(f"point {i + 1}/{len(points)}: {count} open x think {think:g} s: skipped (saturated below)")
                continue
            load.think_s = think
            load.call(load.resize(count))
            time.sleep(max(warmup, think))  # every episode has stepped at this think time before the window
            cpu0, busy0, (s3r0, s3b0) = probe.cpu(load), machine_busy_s(), s3_counters(fleet)
            t0, n0 = time.monotonic(), len(load.latencies)
            time.sleep(window)
            t1 = time.monotonic()
            cpu1, busy1, (s3r1, s3b1) = probe.cpu(load), machine_busy_s(), s3_counters(fleet)
            lat = [s for at, s in load.latencies[n0:] if t0 <= at <= t1]
            mem, live = probe.memory(), probe.live()
            stored = stored_bytes(fleet) - base_stored
            steps = max(len(lat), 1)
            cpu = {k: (cpu1[k] - cpu0[k]) * 1000 / steps for k in cpu0}
            row: dict[str, Any] = {
                "point": i + 1, "open_episodes": count, "think_s": think, "offered_steps_per_s": count / think,
                "steps_per_s": len(lat) / (t1 - t0), "step_p50_ms": pct(lat, 50) * 1000,
                "step_p99_ms": pct(lat, 99) * 1000, "steps": len(lat), "retries": load.retries,
                "failures": len(load.failures),
                **{f"cpu_ms_per_step_{k}": v for k, v in cpu.items()},
                "cpu_ms_per_step_all": sum(cpu.values()),
                "machine_busy_ms_per_step": (busy1 - busy0) * 1000 / steps,
                "live_sandboxes": live, "hibernated_episodes": max(0, count - live),
                "replica_pss_mib": (mem["server"] + mem["sandboxes"]) / MIB, "store_pss_mib": mem["store"] / MIB,
                "mem_per_live_sandbox_kib": ((mem["sandboxes"] - base_mem["sandboxes"]) / live / 1024 if live >= 4
                                             else float("nan")),
                "mem_per_open_episode_kib": ((mem["server"] - base_mem["server"] + mem["store"] - base_mem["store"])
                                             / count / 1024),
                "s3_requests_per_step": (s3r1 - s3r0) / steps, "s3_bytes_per_step": (s3b1 - s3b0) / steps,
                "s3_stored_bytes_per_open_episode": stored / count, "cold_start_s": cold,
            }
            rows.append(row)
            writer.writerow({k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in row.items()})
            csv_file.flush()
            if saturation(row):
                saturated.add(think)  # the replica's limit at this think: higher loads only queue longer
            print(f"point {i + 1}/{len(points)}: {count} open x think {think:g} s: offered {count / think:.1f}, "
                  f"served {row['steps_per_s']:.1f} steps/s, p50 {row['step_p50_ms']:.0f} ms, p99 "
                  f"{row['step_p99_ms']:.0f} ms; CPU/step {row['cpu_ms_per_step_all']:.1f} ms (server "
                  f"{cpu['server']:.1f}, sandboxes {cpu['sandboxes']:.1f}, store {cpu['store']:.1f}, loadgen "
                  f"{cpu['loadgen']:.1f}; machine {row['machine_busy_ms_per_step']:.1f}); live {live}; S3 "
                  f"{row['s3_requests_per_step']:.2f} req and {row['s3_bytes_per_step'] / 1024:.1f} KiB per step",
                  flush=True)
        failures = list(load.failures)
    finally:
        csv_file.close()
        if load is not None:
            load.stop()
        fleet.stop()
    machine += f" (load average {os.getloadavg()[0]:.1f} at the end)"
    plot(rows, out / "capacity.png", f"one rollbox replica on SeaweedFS: {command}\n{machine}")
    cold_txt = f"{rows[0]['cold_start_s']:.2f} s" if rows else "n/a"
    print(f"cold start (start to first create's reply): {cold_txt}; "
          f"failures {len(failures)}{': ' + failures[0] if failures else ''}")
    mem_live = [r["mem_per_live_sandbox_kib"] for r in rows if r["live_sandboxes"] >= 4]
    mem_open = [r["mem_per_open_episode_kib"] for r in rows if r["hibernated_episodes"] >= r["open_episodes"] / 2]
    if mem_live:
        print(f"memory per live sandbox (median of points with >= 4 live): {statistics.median(mem_live):.0f} KiB")
    if mem_open:
        print(f"memory per open episode, mostly hibernated (median): {statistics.median(mem_open):.1f} KiB")
    print(f"csv: {out / 'capacity.csv'}\npng: {out / 'capacity.png'}\n({machine})")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
