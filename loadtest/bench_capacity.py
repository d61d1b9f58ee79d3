"""Capacity of a local fleet, all in: N `rollbox serve` replicas + SeaweedFS + HAProxy (fleet_local.py)
driven by distributed Locust (a master and --processes workers, loadtest/locustfile.py), then a
scale-to-zero-and-back wave with every episode open.

Prints the machine CPU per request by component (each component's process tree, its reaped children
included: the replicas' servers (their threads included), their zygotes and sandboxes, SeaweedFS,
HAProxy, Locust's master and workers),
summed over the requests Locust sent (retries included) while the fleet was up; step p50/p99; the
peak memory (PSS) of each component; open episodes; and for the wave: how long the replicas took to
start and be routed, the time from their start to the first reply (an exec of an episode opened
before, resumed from S3), and the wave's steps as Locust's users saw them (each worker logs every step:
when it was first sent and its round trip, retries included): step p50/p99 of the steps sent from the
replicas' start until --wave-s later, and apart those sent while the fleet was down or draining (their
retries waited through the outage). Every 5 s it records each component's CPU (``<base>/locust_cpu.csv``)
and what the replicas did (``<base>/locust_replicas.jsonl``, from their /metrics: requests by type,
resumes, S3 requests by operation, the garbage collector's pauses, ...).

    .venv/bin/python loadtest/bench_capacity.py --users 6000 --spawn-rate 30 --think-min-s 120 \\
        --think-max-s 240 --wave-at-s 330 --run-s 450        # ~8 min; as root
    .venv/bin/python loadtest/bench_capacity.py --users 100 --spawn-rate 50 --think-min-s 1 \\
        --think-max-s 2 --wave-at-s 20 --run-s 40             # a quick look

With --sweep it measures ONE replica's capacity curve instead (loadtest/capacity_sweep.py: offered
load swept by open episodes x think time; a CSV and a PNG, the input of loadtest/fleet.py):

    .venv/bin/python loadtest/bench_capacity.py --sweep --quick --out /tmp/cap   # under a minute
    .venv/bin/python loadtest/bench_capacity.py --sweep --out /tmp/cap           # ~8 min

The machine's busy CPU over the same interval (from /proc/stat) is printed too: on a machine shared
with other work it is higher than the sum of the components.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fleet_local import CONTAINER_CONCURRENCY, WEED_PROCS, Fleet, format_drain, locust_master_args, send

ROOT = Path(__file__).resolve().parents[1]
TICK = os.sysconf("SC_CLK_TCK")
MIB = 1024 * 1024


def proc_stat(pid: int) -> list[str]:
    """/proc/PID/stat's fields after the command name: [0] state, [1] ppid, [2] pgrp, [7] minflt,
    [8] cminflt, [11:15] utime stime cutime cstime. Raises OSError when the process is gone."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rpartition(")")[2].split()


def _processes() -> Iterator[tuple[int, list[str]]]:
    """(pid, ``proc_stat``) of every process now (those gone while read are skipped)."""
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                yield int(entry.name), proc_stat(int(entry.name))
            except OSError:
                continue


def _children() -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for pid, fields in _processes():
        out.setdefault(int(fields[1]), []).append(pid)
    return out


def _tree(root: int, children: dict[int, list[int]]) -> list[int]:
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, ()))
    return out


def tree_cpu_split_s(root: int, children: dict[int, list[int]]) -> tuple[float, float]:
    """(user, kernel) CPU seconds of ``root`` and its live descendants, and of the children they have reaped."""
    user = kernel = 0
    for pid in _tree(root, children):
        try:
            fields = proc_stat(pid)
            user += int(fields[11]) + int(fields[13])  # utime + cutime
            kernel += int(fields[12]) + int(fields[14])  # stime + cstime
        except (OSError, IndexError, ValueError):
            continue
    return user / TICK, kernel / TICK


def tree_cpu_s(root: int, children: dict[int, list[int]]) -> float:
    """CPU seconds of ``root`` and its live descendants, and of the children they have reaped."""
    return sum(tree_cpu_split_s(root, children))


def own_cpu_s(pid: int) -> float:
    try:
        return sum(int(x) for x in proc_stat(pid)[11:13]) / TICK
    except (OSError, ValueError):
        return 0.0


def tree_pss(root: int, children: dict[int, list[int]]) -> int:
    total = 0
    for pid in _tree(root, children):
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                total += next((int(line.split()[1]) for line in f if line.startswith("Pss:")), 0) * 1024
        except OSError:
            continue
    return total


def machine_cpu_s() -> tuple[float, float]:
    """(busy, stolen) CPU seconds of the whole machine, from /proc/stat's first line: busy is every
    state but idle and iowait (steal included); stolen is what the hypervisor gave to others while
    this VM wanted it."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return (sum(v[:8]) - v[3] - v[4]) / TICK, v[7] / TICK


def machine_busy_s() -> float:
    return machine_cpu_s()[0]


def stop_group(proc: subprocess.Popen[bytes], grace_s: float = 30.0) -> None:
    """SIGTERM ``proc``'s process group (``proc`` started a session of its own), SIGKILL what is left of
    it after ``grace_s``; ``proc`` is reaped."""
    def alive() -> bool:  # (a zombie nobody reaps is not)
        return any(_state(pid) not in ("Z", "") for pid in _group(proc.pid))

    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):  # (a SIGKILL lands a moment later)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        deadline = time.monotonic() + wait_s
        while alive() and time.monotonic() < deadline:
            proc.poll()
            time.sleep(0.1)
        if not alive():
            break
    proc.wait()


def _group(pgid: int) -> list[int]:
    return [pid for pid, fields in _processes() if int(fields[2]) == pgid]


def _state(pid: int) -> str:
    try:
        return proc_stat(pid)[0]
    except OSError:
        return ""


@dataclass
class Components:
    """The fleet's process trees by component, as they are now (replicas change at the wave)."""

    fleet: Fleet
    locust_pid: int

    def roots(self) -> dict[str, list[int]]:
        pids = self.fleet.pids()
        return {"replicas": [p for k, p in pids.items() if k.startswith("replica")],
                "seaweedfs": [pids["seaweedfs"]], "haproxy": [pids["haproxy"]], "locust": [self.locust_pid]}

    def cpu(self) -> dict[str, float]:
        """CPU seconds by component; the replicas split into the servers' own processes (their threads
        included) and their descendants (zygotes and sandboxes)."""
        ch = _children()
        out = {name: sum(tree_cpu_s(r, ch) for r in roots) for name, roots in self.roots().items()}
        servers = sum(own_cpu_s(r) for r in self.roots()["replicas"])
        return {"servers": servers, "sandboxes": out.pop("replicas") - servers, **out}


@dataclass
class Sampler:
    """Every 5 s: each component's memory (PSS; the peak is kept) and, with ``cpu_csv``, its CPU over
    those 5 s in cores, beside the machine's busy and stolen time: where the CPU went, moment by moment
    (a sweep's listing, the ramp's end, the wave), not only over the run."""

    components: Components
    peaks: dict[str, int] = field(default_factory=dict)
    stop: threading.Event = field(default_factory=threading.Event)
    cpu_csv: Path | None = None

    def run(self) -> None:
        last: tuple[float, dict[str, list[int]], dict[str, float], float, float] | None = None
        out = open(self.cpu_csv, "w", newline="") if self.cpu_csv is not None else None  # noqa: SIM115
        writer = csv.writer(out) if out is not None else None
        try:
            first = True  # sampled at once: the first 5 s have their row (a short run's wave leaves few)
            while first or not self.stop.wait(5.0):
                first = False
                ch, roots = _children(), self.components.roots()
                for name, pids in roots.items():
                    self.peaks[name] = max(self.peaks.get(name, 0), sum(tree_pss(r, ch) for r in pids))
                if writer is None:
                    continue
                now, cpu, (busy, steal) = time.time(), self.components.cpu(), machine_cpu_s()
                if last is None:
                    writer.writerow(["unix_time", *(f"{k}_cores" for k in cpu), "machine_busy_cores",
                                     "machine_steal_cores"])
                # the same processes: not across the wave's restart, nor over a window in which a tree lost
                # a process that no parent inside it reaped (its total went back: what it spent is not known)
                elif last[1] == roots and all(cpu[k] >= last[2][k] for k in cpu):
                    span = now - last[0]
                    writer.writerow([f"{now:.0f}", *(f"{(cpu[k] - last[2][k]) / span:.3f}" for k in cpu),
                                     f"{(busy - last[3]) / span:.3f}", f"{(steal - last[4]) / span:.3f}"])
                    out.flush()  # type: ignore[union-attr]
                last = (now, roots, cpu, busy, steal)
        finally:
            if out is not None:
                out.close()


# What the replicas did, every 5 s (``Activity``): counters as (metric, the label that splits it or None)
ACTIVITY_COUNTERS = (("rollbox_requests_total", "type"), ("rollbox_resumes_total", None),
                     ("rollbox_hibernations_total", "reason"), ("rollbox_store_requests_total", "operation"),
                     ("rollbox_state_conflicts_total", None), ("rollbox_stale_copies_total", None),
                     ("rollbox_admission_rejects_total", "reason"), ("rollbox_spool_flushes_total", None),
                     ("rollbox_spool_syncs_total", None), ("rollbox_gc_pause_seconds_total", "generation"),
                     ("rollbox_gc_collections_total", "generation"))
ACTIVITY_GAUGES = ("rollbox_inflight_requests", "rollbox_waiting_requests", "rollbox_live_sandboxes",
                   "rollbox_pool_size")


def replica_counters(metrics: str) -> dict[str, float]:
    """One replica's /metrics text as {column: value}: each of ``ACTIVITY_COUNTERS`` summed by its label's
    value (``rollbox_requests_total`` by event type, its statuses together), and ``ACTIVITY_GAUGES``
    summed over their labels. A column is "name" or "name:label value", the ``rollbox_`` and
    ``_total`` left out."""
    from prometheus_client.parser import text_string_to_metric_families

    split = dict(ACTIVITY_COUNTERS)
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(metrics):
        for smp in fam.samples:
            if smp.name in split:
                label = split[smp.name]
                if smp.name == "rollbox_store_requests_total" and smp.labels.get("operation") == "HeadBucket":
                    continue
                name = smp.name.removeprefix("rollbox_").removesuffix("_total")
                if label is not None:
                    name += ":" + smp.labels.get(label, "").rpartition(".")[2]  # (a type's last word)
            elif smp.name in ACTIVITY_GAUGES:
                name = smp.name.removeprefix("rollbox_")
            else:
                continue
            out[name] = out.get(name, 0.0) + smp.value
    return out


@dataclass
class Activity:
    """Every 5 s, beside ``Sampler``'s CPU: what the replicas did in those 5 s (requests by type, resumes,
    hibernations, S3 requests by operation: a sweep shows as listings, conflicts, spool flushes, the
    garbage collector's pauses by generation) and their
    gauges then (in flight, waiting, live, pool), summed over the replicas, as a JSON line: what a stretch
    of extra CPU was spent on. A replica's counters count from its start: over the wave's restart, a
    window counts the new processes' from theirs."""

    fleet: Fleet
    path: Path
    stop: threading.Event = field(default_factory=threading.Event)

    def scrape(self, http: httpx.Client) -> dict[int, dict[str, float]]:
        out: dict[int, dict[str, float]] = {}
        for srv, port in zip(self.fleet.replicas, self.fleet.replica_ports, strict=True):
            if srv is None:
                continue
            try:
                out[srv.pid] = replica_counters(http.get(f"http://127.0.0.1:{port}/metrics").text)
            except httpx.HTTPError:
                continue  # (draining, down, starting: the window counts the others)
        return out

    def run(self) -> None:
        gauges = {name.removeprefix("rollbox_") for name in ACTIVITY_GAUGES}
        last: dict[int, dict[str, float]] = {}
        with httpx.Client(timeout=5) as http, open(self.path, "w") as out:
            while True:
                now, seen = time.time(), self.scrape(http)
                if seen:
                    names = sorted({k for v in seen.values() for k in v})
                    # counters: new since the last scrape (a replica not seen then: since its start)
                    counts = {c: sum(v.get(c, 0.0) - last.get(pid, {}).get(c, 0.0) for pid, v in seen.items())
                              for c in names if c.partition(":")[0] not in gauges}
                    now_at = {g: sum(v.get(g, 0.0) for v in seen.values())
                              for g in names if g.partition(":")[0] in gauges}
                    out.write(json.dumps({"t": round(now, 1), "replicas": len(seen),
                                          "counts": {k: v for k, v in counts.items() if v},
                                          "gauges": now_at}) + "\n")
                    out.flush()
                last.update(seen)  # (one that did not answer: its next window counts from the last it did)
                if self.stop.wait(5.0):
                    return


def history(prefix: Path, name: str) -> list[dict[str, str]]:
    path = Path(f"{prefix}_stats_history.csv")
    if not path.exists():
        return []
    with open(path) as f:
        return [r for r in csv.DictReader(f) if r["Name"] == name]


def requests_at(prefix: Path, t: float) -> int:
    """Requests Locust had sent (every row, retries included) by Unix time ``t``."""
    rows = [r for r in history(prefix, "Aggregated") if int(r["Timestamp"]) <= t]
    return int(rows[-1]["Total Request Count"]) if rows else 0


def store_ops(metrics: str) -> dict[str, int]:
    """A replica's S3 requests so far by operation, from its /metrics text (rollbox_store_requests_total),
    but its bucket checks (HeadBucket)."""
    return {k.partition(":")[2]: int(v) for k, v in replica_counters(metrics).items() if k.startswith("store_requests:")}


def store_requests(http: httpx.Client, fleet: Fleet) -> tuple[dict[str, int], int]:
    """The replicas' S3 requests so far by operation (``store_ops``), and the CloudEvents they answered
    (rollbox_requests_total), summed over the replicas."""
    ops: dict[str, int] = {}
    events = 0
    for port in fleet.replica_ports:
        text = http.get(f"http://127.0.0.1:{port}/metrics").text
        for op, n in store_ops(text).items():
            ops[op] = ops.get(op, 0) + n
        events += int(sum(v for k, v in replica_counters(text).items() if k.startswith("requests:")))
    return ops, events


def step_log(prefix: Path) -> list[tuple[float, float, int]]:
    """Every exec step the Locust workers logged (--step-log): (Unix time first sent, ms, final status)."""
    out = []
    for path in prefix.parent.glob(f"{prefix.name}_steps.csv.*"):
        for line in path.read_text().splitlines():
            try:
                at, ms, status = line.split(",")
                out.append((float(at), float(ms), int(status)))
            except ValueError:
                continue  # a line cut short by a worker's exit
    return out


def percentile(values: list[float], q: float) -> float:
    """Nearest rank: the smallest value with at least ``q`` % of ``values`` at or below it."""
    s = sorted(values)
    return s[max(0, min(len(s) - 1, int(-(-q * len(s) // 100)) - 1))]


def window(steps: list[tuple[float, float, int]], t0: float, t1: float) -> str:
    """Steps first sent in [t0, t1): how many, how many answered 200, their round trips' p50/p99."""
    ms = [m for at, m, _ in steps if t0 <= at < t1]
    ok = sum(1 for at, _, st in steps if t0 <= at < t1 and st == 200)
    if not ms:
        return "no steps"
    return f"{len(ms)} steps ({ok} 200), p50 {percentile(ms, 50):.0f} ms, p99 {percentile(ms, 99):.0f} ms"


def first_user_reply(steps: list[tuple[float, float, int]], t_up: float) -> float | None:
    """Seconds from ``t_up`` (the replicas' start) to the first step a user got answered 200 after it,
    wherever it was sent from (held at HAProxy, retried, or new): when the fleet answered again."""
    ends = [at + ms / 1000 for at, ms, st in steps if st == 200 and at + ms / 1000 >= t_up]
    return min(ends) - t_up if ends else None


def main() -> int:
    if "--sweep" in sys.argv[1:]:
        import capacity_sweep

        return capacity_sweep.main(sys.argv[1:])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--processes", type=int, default=2, help="Locust worker processes (one per core)")
    ap.add_argument("--users", type=int, default=6000)
    ap.add_argument("--spawn-rate", type=float, default=30)
    ap.add_argument("--think-min-s", type=float, default=120)
    ap.add_argument("--think-max-s", type=float, default=240)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--connections", type=int, default=64, help="per Locust process and host")
    ap.add_argument("--run-s", type=float, default=450, help="Locust's run time")
    ap.add_argument("--wave-at-s", type=float, default=330, help="scale to zero this long after the start (0: no wave)")
    ap.add_argument("--down-s", type=float, default=10, help="how long the fleet stays at zero")
    ap.add_argument("--wave-s", type=float, default=60, help="the wave's step p99 is taken over this long")
    ap.add_argument("--base", type=Path, default=None)
    ap.add_argument("--weed-procs", type=int, default=WEED_PROCS, help="SeaweedFS's GOMAXPROCS (0: Go's default)")
    ap.add_argument("--container-concurrency", type=int, default=CONTAINER_CONCURRENCY,
                    help="requests HAProxy sends one replica at once, the rest wait there (0: no limit)")
    ap.add_argument("serve_args", nargs="*", help="after --: flags for every rollbox serve")
    args = ap.parse_args()
    base = args.base or Path(tempfile.mkdtemp(prefix="rollbox-capacity-"))
    serve_args = args.serve_args or ["--hibernate-after-s", "30"]
    prefix = base / "locust"
    fleet = Fleet(base / "fleet", args.replicas, serve_args=serve_args, weed_procs=args.weed_procs,
                  container_concurrency=args.container_concurrency)
    fleet.start()
    locust: subprocess.Popen[bytes] | None = None
    sampler: Sampler | None = None
    activity: Activity | None = None
    try:
        with httpx.Client(timeout=120) as http:
            clean = {k: v for k, v in os.environ.items() if not k.startswith("ROLLBOX_")}
            cmd = [sys.executable, "-m", "locust", "-f", str(ROOT / "loadtest" / "locustfile.py"), "--headless",
                   "--only-summary", "--processes", str(args.processes), *locust_master_args(), "-u", str(args.users),
                   "-r", str(args.spawn_rate), "-t", f"{args.run_s:.0f}s", "--stop-timeout", "30",
                   "--host", fleet.url.rstrip("/"), "--think-min-s", str(args.think_min_s),
                   "--think-max-s", str(args.think_max_s), "--steps", str(args.steps),
                   "--connections", str(args.connections), "--retry-attempts", "100", "--retry-budget-s", "300",
                   "--csv", str(prefix), "--csv-full-history", "--summary-json", f"{prefix}.json",
                   "--step-log", f"{prefix}_steps.csv"]
            log = open(f"{prefix}.out", "wb")  # noqa: SIM115 - handed to the child
            t_start = time.time()
            # its own process group: the workers it forks are stopped with it (an overloaded run's master
            # can exit while its workers still wait on requests; they were left running)
            locust = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                      env={**clean, "ROLLBOX_LOCUST_SHAPE": "none"})
            log.close()
            comps = Components(fleet, locust.pid)
            sampler = Sampler(comps, cpu_csv=Path(f"{prefix}_cpu.csv"))
            threading.Thread(target=sampler.run, daemon=True).start()
            activity = Activity(fleet, Path(f"{prefix}_replicas.jsonl"))
            threading.Thread(target=activity.run, daemon=True).start()
            cpu0, busy0 = comps.cpu(), machine_busy_s()
            wave: dict[str, Any] = {}
            if args.wave_at_s:
                time.sleep(max(0.0, t_start + args.wave_at_s - time.time()))
                cpu1, busy1, t1 = comps.cpu(), machine_busy_s(), time.time()
                s3_ops, s3_events = store_requests(http, fleet)
                # an episode of the probe's own, opened now (one made at the start would have passed
                # its idle limit): its step after the start is the first reply we wait for
                probe = send(http, fleet.url, "create", {"snapshot": "python"})
                probe.raise_for_status()
                probe_sid = probe.json()["sandbox_id"]
                assert send(http, fleet.url, "exec", {"sandbox_id": probe_sid, "code": "print(1)"}).status_code == 200
                t_down = time.time()
                codes = fleet.scale_to_zero()
                wave["drain_s"] = time.time() - t_down
                wave["exit_codes"] = codes
                wave["phases"] = format_drain(fleet.last_drain)
                time.sleep(args.down_s)

                def exec_probe(h: httpx.Client) -> httpx.Response:
                    return send(h, fleet.url, "exec", {"sandbox_id": probe_sid, "code": "print(1)"})

                restart = fleet.restart_probed(exec_probe)
                wave.update(routed_s=restart.routed_s, first_reply_s=restart.first_reply_s, t_up=restart.t_up,
                            t_down=t_down)
            locust.wait()
            if not args.wave_at_s:
                cpu1, busy1, t1 = comps.cpu(), machine_busy_s(), time.time()
                s3_ops, s3_events = store_requests(http, fleet)
        sampler.stop.set()
        summary = json.loads(Path(f"{prefix}.json").read_text())
    finally:
        if locust is not None:
            stop_group(locust)
        if sampler is not None:
            sampler.stop.set()
        if activity is not None:
            activity.stop.set()
        fleet.stop()

    reqs = requests_at(prefix, t1) or summary["requests"]
    cpu = {k: cpu1[k] - cpu0[k] for k in cpu0}
    print(f"fleet: {args.replicas} replicas ({' '.join(serve_args)}) + SeaweedFS + HAProxy; Locust: "
          f"{args.processes} processes, {args.users} users at {args.spawn_rate:g}/s, think {args.think_min_s:g}-"
          f"{args.think_max_s:g} s, {args.steps} steps, {args.connections} connections per process")
    span = t1 - t_start
    print(f"CPU per request while the fleet was up ({span:.0f} s, {reqs} requests, {reqs / span:.1f}/s):")
    for name, s in cpu.items():
        print(f"  {name:<10} {s * 1000 / max(reqs, 1):7.2f} ms  ({s:.1f} CPU s)")
    print(f"  {'all':<10} {sum(cpu.values()) * 1000 / max(reqs, 1):7.2f} ms  ({sum(cpu.values()):.1f} CPU s); "
          f"machine busy (shared) {(busy1 - busy0) * 1000 / max(reqs, 1):.2f} ms")
    print(f"steps: {summary['steps']}, p50 {summary['step_p50_ms']} ms, p99 {summary['step_p99_ms']} ms; requests "
          f"{summary['requests']}, failures {summary['failures']}, retries {summary['retries']} "
          f"{summary['retries_by_code']}; episodes {summary['episodes_done']} complete")
    print(f"open episodes: peak {summary['open_peak']}")
    print(f"S3 requests per CloudEvent answered while the fleet was up ({s3_events} events): "
          f"{sum(s3_ops.values()) / max(s3_events, 1):.2f} (" + ", ".join(
              f"{op} {n / max(s3_events, 1):.2f}" for op, n in sorted(s3_ops.items())) + ")")
    print("peak memory (PSS): " + ", ".join(f"{k} {v / MIB:.0f} MiB" for k, v in sampler.peaks.items())
          + f"; Locust's processes (RSS, summed) {summary['locust_rss_peak_bytes'] / MIB:.0f} MiB")
    print(f"CPU by component every 5 s, in cores, with the machine's busy and stolen time: {prefix}_cpu.csv")
    print(f"what the replicas did every 5 s (requests, resumes, S3 requests by operation, ...): {prefix}_replicas.jsonl")
    if wave:
        steps, t_up = step_log(prefix), wave["t_up"]
        ends = t_start + args.run_s
        cut = f" (Locust stopped {t_up + args.wave_s - ends:.0f} s before its end)" if ends < t_up + args.wave_s else ""
        first = f"{wave['first_reply_s']:.2f} s" if wave["first_reply_s"] is not None else "none"
        users = first_user_reply(steps, t_up)
        print(f"wave: drained in {wave['drain_s']:.1f} s (exit codes {wave['exit_codes']}), down {args.down_s:g} s; "
              f"started and routed in {wave['routed_s']:.2f} s; first reply {first} after the start (the probe's "
              f"step); first step answered to a user " + (f"{users:.2f} s" if users is not None else "none")
              + " after the start")
        print(f"  drain, s after SIGTERM per replica: {wave['phases']}")
        print(f"  steps sent in the wave (the {args.wave_s:g} s from the start){cut}: "
              f"{window(steps, t_up, t_up + args.wave_s)}")
        print(f"  steps sent while the fleet drained or was down (retried through it): "
              f"{window(steps, wave['t_down'], t_up)}")
    print(f"(machine shared with other work; files in {base})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
