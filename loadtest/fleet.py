"""The fleet model: a training burst of trainers' rollout workers played through Knative's autoscaler
(KPA) on top of one replica's measured capacity curve (loadtest/bench_capacity.py --sweep).

    .venv/bin/python loadtest/fleet.py                       # 100,000 users, think 60-120 s, 2 bursts
    .venv/bin/python loadtest/fleet.py --users 100000 --think-min-s 600 --think-max-s 1200 \\
        --capacity /tmp/cap/capacity.csv --png /tmp/fleet.png --csv /tmp/fleet.csv

It prints, every --print-every-s seconds of the burst, and plots (--png): replicas, requests queued
(at the activator and the queue-proxies), step latency p50/p99, cold starts, S3 requests/s and cost
per second, beside an always-on fleet sized for the peak; then the totals (replica-seconds, cost,
step p50/p99, requests arrived/served/queued/dropped).

The model is a pure function of its inputs (`simulate(Burst, Kpa, Capacity, Prices, seed)`): one tick
per second, the users' think times drawn from a seeded generator. What each part does, and where it
comes from in Knative Serving's source, is in docs/capacity.md ("The fleet model").

Users: a closed loop, as a trainer's rollout workers are. Each user sends a request, waits for its
reply, thinks (uniform in [think-min, think-max], whole seconds) and sends the next; users join at
--users/--ramp-s per second, stay --hold-s, and leave at the burst's end. A request is a step: the
capacity curve is one replica's steps/s and step latency.

Serving: requests wait in one FIFO (the activator's buffer when no replica is ready, the
queue-proxies' otherwise); each second the ready replicas take up to replicas x the replica's
capacity (its measured saturation steps/s, lowered so that steps/s x p50 stays within
containerConcurrency); a request's latency is its wait plus the curve's p50 (98 % of them) or p99
(2 %) at the replicas' load averaged over ~10 s (as the curve's points were measured). A request that waited timeoutSeconds is dropped (Knative
answers 504; its user thinks and goes on).

Knative (knative/base/service.yaml is parsed: target, target-utilization-percentage, window,
scale-down-delay, min-scale, max-scale, containerConcurrency, timeoutSeconds, the pod's resource
requests; the cluster-wide config-autoscaler values are Knative's defaults, flags here): each second
the observed concurrency (requests in the replicas by Little's law, plus the queue) goes into the
stable (window) and panic (window x 10 %) averages; every 2 s the decider of
pkg/autoscaler/scaling/autoscaler.go computes the desired pods: ceil(average / (target x
utilization)) bounded by max-scale-up-rate x ready and ready / max-scale-down-rate, panic entered
when ceil(panic / target) / ready >= 200 % and left after a stable window without, no scale-down in
panic, the maximum over scale-down-delay, then scale to zero only after the pods were active a stable
window and the revision was inactive for scale-to-zero-grace-period (pkg/reconciler/autoscaling/
kpa/scaler.go), bounded by min/max-scale. With no pod, a request is buffered and the activator pokes
the autoscaler at once. A new pod serves --pod-start-s after it is created (the measured cold start).

Checked against measurement (`--check-against`): the model's steady state for the loads one replica
was measured at (a sweep's CSV: open episodes x think, each thinking uniform 0.5-1.5 x think, sent
straight to the replica as the sweep does: one replica always ready, no containerConcurrency, no
drops), beside what was measured: steps/s and step p99, their relative errors, and a verdict (every
one within --tolerance, 25 %). `--check-run DIR` measures first, on one replica of this box, in one
sweep: the curve's points and the two check points between them (the curve is made of the others, so
the check is not the curve read back); ~6 minutes on a quiet box (estimated; 10 min 20 s on this one
while other jobs loaded it), `--quick` ~40 s (plumbing, not a verdict):

    .venv/bin/python loadtest/fleet.py --check-run /tmp/check       # then the verdict
    .venv/bin/python loadtest/fleet.py --check-against /tmp/check/check.csv --capacity /tmp/check/curve.csv
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import math
import re
import sys
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parents[1]
SERVICE_YAML = ROOT / "knative" / "base" / "service.yaml"
DEFAULT_CAPACITY = Path(__file__).resolve().parent / "capacity_default.csv"
ANN = "autoscaling.knative.dev/"
SLOW_SHARE = 0.02  # the share of a second's requests given the curve's p99 (the rest its p50)
RATE_AVERAGE_S = 10.0  # the time constant of the replica's rate the curve's latency is read at


def duration_s(text: str | int | float) -> float:
    """A Kubernetes/Go duration as Knative's annotations write them ("60s", "2m", "1m30s", "1h") or seconds."""
    if isinstance(text, int | float):
        return float(text)
    parts = re.fullmatch(r"((?:\d+(?:\.\d+)?(?:h|m|s|ms))+)", text.strip())
    if not parts:
        try:
            return float(text)
        except ValueError:
            raise ValueError(f"not a duration: {text!r} (write e.g. 60s, 2m, 1m30s)") from None
    unit = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}
    return sum(float(n) * unit[u] for n, u in re.findall(r"(\d+(?:\.\d+)?)(h|ms|m|s)", text))


def quantity(text: str | int | float) -> float:
    """A Kubernetes quantity: "2" or "500m" cores, "4Gi" bytes."""
    s = str(text).strip()
    suffix = {"m": 1e-3, "Ki": 2.0**10, "Mi": 2.0**20, "Gi": 2.0**30, "Ti": 2.0**40, "k": 1e3, "M": 1e6, "G": 1e9}
    for k in sorted(suffix, key=len, reverse=True):
        if s.endswith(k):
            return float(s[: -len(k)]) * suffix[k]
    return float(s)


@dataclass(frozen=True)
class Kpa:
    """The autoscaler's inputs for one revision. Per-revision values come from the Service (parse it with
    ``from_service``); the cluster-wide ones (config-autoscaler) default to Knative's own defaults."""

    target: float  # autoscaling.knative.dev/target (concurrent requests per pod)
    utilization: float  # target-utilization-percentage / 100
    container_concurrency: int  # spec.containerConcurrency (0: unlimited)
    min_scale: int
    max_scale: int  # 0: unbounded
    stable_window_s: float  # autoscaling.knative.dev/window
    scale_down_delay_s: float
    timeout_s: float  # spec.timeoutSeconds: a request buffered this long is dropped
    cpu_request: float  # cores per pod (resources.requests.cpu)
    memory_request_gib: float
    panic_window_pct: float = 10.0  # config-autoscaler defaults from here on
    panic_threshold_pct: float = 200.0
    max_scale_up_rate: float = 1000.0
    max_scale_down_rate: float = 2.0
    scale_to_zero_grace_s: float = 30.0
    tick_s: int = 2  # pkg/autoscaler/scaling/multiscaler.go tickInterval

    @classmethod
    def from_service(cls, path: Path = SERVICE_YAML, **overrides: Any) -> Kpa:
        doc = yaml.safe_load(path.read_text())
        tmpl = doc["spec"]["template"]
        ann = tmpl.get("metadata", {}).get("annotations", {})
        spec = tmpl["spec"]
        cls_name = ann.get(ANN + "class", "kpa.autoscaling.knative.dev")
        if cls_name != "kpa.autoscaling.knative.dev" or ann.get(ANN + "metric", "concurrency") != "concurrency":
            raise ValueError(f"{path}: the model knows the KPA on concurrency, not {cls_name} / {ann.get(ANN + 'metric')}")
        req = spec["containers"][0].get("resources", {}).get("requests", {})
        cc = int(spec.get("containerConcurrency", 0))
        values: dict[str, Any] = {
            "target": float(ann.get(ANN + "target", cc or 100)),
            "utilization": float(ann.get(ANN + "target-utilization-percentage", 70)) / 100,
            "container_concurrency": cc,
            "min_scale": int(ann.get(ANN + "min-scale", 0)),
            "max_scale": int(ann.get(ANN + "max-scale", 0)),
            "stable_window_s": duration_s(ann.get(ANN + "window", "60s")),
            "scale_down_delay_s": duration_s(ann.get(ANN + "scale-down-delay", "0s")),
            "timeout_s": float(spec.get("timeoutSeconds", 300)),
            "cpu_request": quantity(req.get("cpu", "1")),
            "memory_request_gib": quantity(req.get("memory", "1Gi")) / 2**30,
        }
        if ANN + "panic-window-percentage" in ann:
            values["panic_window_pct"] = float(ann[ANN + "panic-window-percentage"])
        if ANN + "panic-threshold-percentage" in ann:
            values["panic_threshold_pct"] = float(ann[ANN + "panic-threshold-percentage"])
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)

    @property
    def target_value(self) -> float:
        """What the decider divides by (pkg/reconciler/autoscaling/resources/target.go ResolveMetricTarget):
        min(target, containerConcurrency) x utilization, at least 0.01."""
        total = min(self.target, self.container_concurrency) if self.container_concurrency else self.target
        return max(0.01, total * self.utilization)

    @property
    def panic_window_s(self) -> int:
        return max(1, round(self.stable_window_s * self.panic_window_pct / 100))


@dataclass(frozen=True)
class Capacity:
    """One replica's measured curve: steps/s it served against its step p50/p99 (seconds), and the
    per-step costs around it. ``source`` says where it came from."""

    rate: tuple[float, ...]
    p50_s: tuple[float, ...]
    p99_s: tuple[float, ...]
    s3_requests_per_step: float = 0.0
    cpu_ms_per_step: float = 0.0
    cold_start_s: float | None = None
    source: str = ""
    saturated: bool = True  # a point past the replica's limit was measured: the limit was found

    @classmethod
    def from_csv(cls, path: Path, steps: str = "durable") -> Capacity:
        """bench_capacity.py --sweep's CSV (lines starting with # are comments). ``steps``: which points
        make the curve: "durable" (most episodes hibernated between steps, so a step resumes from S3:
        trainers thinking longer than --hibernate-after-s), "live" (the others), or "all"."""
        if steps not in ("durable", "live", "all"):
            raise ValueError(f"steps must be durable, live or all, not {steps!r}")
        lines = path.read_text().splitlines()
        comments = [ln[1:].strip() for ln in lines if ln.startswith("#")]
        rows = list(csv.DictReader(ln for ln in lines if ln.strip() and not ln.startswith("#")))
        rows = [r for r in rows if float(r["steps_per_s"]) > 0]
        if steps != "all" and rows and "hibernated_episodes" in rows[0]:
            durable = [r for r in rows if int(r["hibernated_episodes"]) > int(r["live_sandboxes"])]
            rows = durable if steps == "durable" else [r for r in rows if r not in durable]
        if not rows:
            raise ValueError(f"{path}: no sweep point of {steps} steps with steps_per_s > 0")
        rows.sort(key=lambda r: (float(r.get("offered_steps_per_s") or r["steps_per_s"]), float(r["steps_per_s"])))
        # a curve, not a cloud, in order of offered load: keep the points whose steps/s grow. A point that
        # served no more than a lighter load is past the knee (a saturated replica may serve a bit less
        # at a higher offered load): its latency belongs to the top of the curve, as a wall just above
        # the fastest rate, not to that lighter point's own rate (which would raise the curve below the
        # knee: --check-against found it)
        rate, p50, p99 = [], [], []
        wall = False
        for r in rows:
            x = float(r["steps_per_s"])
            a, b = float(r["step_p50_ms"]) / 1000, float(r["step_p99_ms"]) / 1000
            if rate and x <= rate[-1] + 1e-9:
                if not wall:
                    rate.append(rate[-1] * 1.001)
                    p50.append(p50[-1])
                    p99.append(p99[-1])
                    wall = True
                p50[-1], p99[-1] = max(p50[-1], a), max(p99[-1], b)
                continue
            if wall and x <= rate[-1] + 1e-9:
                continue
            wall = False
            rate.append(x)
            p50.append(max(a, p50[-1] if p50 else 0.0))
            p99.append(max(b, p99[-1] if p99 else 0.0))

        def mean(col: str) -> float:
            vals = [float(r[col]) for r in rows if r.get(col) not in (None, "", "nan")]
            return sum(vals) / len(vals) if vals else 0.0

        cold = [float(r["cold_start_s"]) for r in rows if r.get("cold_start_s") not in (None, "", "nan")]
        # saturated: a point whose steps waited longer than its think, or that served under 70 % of
        # open / think (capacity_sweep.saturation)
        saturated = any(float(r["step_p50_ms"]) / 1000 > float(r.get("think_s") or "inf")
                        or float(r["steps_per_s"]) < 0.7 * float(r.get("offered_steps_per_s") or "nan") for r in rows)
        return cls(tuple(rate), tuple(p50), tuple(p99), s3_requests_per_step=mean("s3_requests_per_step"),
                   cpu_ms_per_step=mean("cpu_ms_per_step_all"), cold_start_s=min(cold) if cold else None,
                   source=" / ".join(comments) or str(path),
                   saturated=saturated)

    @property
    def max_rate(self) -> float:
        return self.rate[-1]

    def latency(self, per_replica_rate: float) -> tuple[float, float]:
        """Step p50 and p99 (s) of a replica serving ``per_replica_rate`` steps/s (linear between the
        measured points, flat outside them)."""
        x = per_replica_rate
        return float(np.interp(x, self.rate, self.p50_s)), float(np.interp(x, self.rate, self.p99_s))

    def concurrency_at(self, share: float, container_concurrency: int = 0) -> float:
        """Requests inside one replica (steps/s x p50, Little's law) when it serves ``share`` of its
        usable rate: the Service's target x utilization that makes the KPA keep replicas there."""
        x = share * self.usable_rate(container_concurrency)
        return x * self.latency(x)[0]

    def usable_rate(self, container_concurrency: int) -> float:
        """The most steps/s one replica takes: its saturation rate, and no more than keeps
        steps/s x p50 (requests inside it) within containerConcurrency."""
        if not container_concurrency:
            return self.max_rate
        best = 0.0
        for x in np.linspace(0.0, self.max_rate, 400):
            if x * self.latency(float(x))[0] <= container_concurrency:
                best = float(x)
        return best


@dataclass(frozen=True)
class Burst:
    """Trainers' rollout workers: ``bursts`` training bursts of ``users`` closed-loop users each."""

    users: int = 100_000
    think_min_s: int = 60
    think_max_s: int = 120
    ramp_s: int = 600  # users join at users / ramp_s per second
    hold_s: int = 600
    gap_s: int = 1200  # idle between bursts (long enough for the fleet to reach zero)
    bursts: int = 2
    lead_s: int = 30  # idle before the first burst
    tail_s: int = 1200  # idle after the last

    def __post_init__(self) -> None:
        if not (1 <= self.think_min_s <= self.think_max_s):
            raise ValueError("need 1 <= think_min_s <= think_max_s")
        if self.users < 0 or self.ramp_s < 1 or self.hold_s < 0 or self.bursts < 1:
            raise ValueError("need users >= 0, ramp_s >= 1, hold_s >= 0, bursts >= 1")

    def windows(self) -> list[tuple[int, int]]:
        """(start, end) of each burst, seconds."""
        out, t = [], self.lead_s
        for _ in range(self.bursts):
            out.append((t, t + self.ramp_s + self.hold_s))
            t += self.ramp_s + self.hold_s + self.gap_s
        return out

    @property
    def duration_s(self) -> int:
        return self.windows()[-1][1] + self.tail_s

    @property
    def peak_rate(self) -> float:
        """Requests/s offered at the peak with instant replies: users / mean think."""
        return self.users / ((self.think_min_s + self.think_max_s) / 2)


@dataclass(frozen=True)
class Prices:
    """Dollars, inputs: a pod's requested cores and memory by the hour, and S3's requests (defaults: AWS
    list prices, us-east-1: Fargate $0.04048 per vCPU-hour and $0.004445 per GB-hour; S3 Standard
    $0.005 per 1,000 PUTs and $0.0004 per 1,000 GETs, a step's S3 requests priced half and half)."""

    vcpu_hour: float = 0.04048
    gib_hour: float = 0.004445
    s3_request: float = (0.005 + 0.0004) / 2 / 1000

    def replica_s(self, kpa: Kpa) -> float:
        return (kpa.cpu_request * self.vcpu_hour + kpa.memory_request_gib * self.gib_hour) / 3600


@dataclass
class Trace:
    """Per second: what the fleet did. Totals in ``totals``."""

    t: list[int] = field(default_factory=list)
    users: list[int] = field(default_factory=list)
    arrived: list[int] = field(default_factory=list)
    served: list[int] = field(default_factory=list)
    dropped: list[int] = field(default_factory=list)
    queued: list[int] = field(default_factory=list)
    ready: list[int] = field(default_factory=list)
    pending: list[int] = field(default_factory=list)
    cold_starts: list[int] = field(default_factory=list)
    panic: list[bool] = field(default_factory=list)
    concurrency: list[float] = field(default_factory=list)
    step_p50_s: list[float] = field(default_factory=list)
    step_p99_s: list[float] = field(default_factory=list)
    s3_rps: list[float] = field(default_factory=list)
    cost_per_s: list[float] = field(default_factory=list)
    decisions: list[tuple[int, int, int]] = field(default_factory=list)  # (t, ready then, pods wanted)
    totals: dict[str, float] = field(default_factory=dict)
    samples: list[tuple[int, float, float]] = field(default_factory=list)  # (second, latency s, requests)


def _percentile(samples: list[tuple[float, float]], q: float) -> float:
    """The q-th percentile of weighted samples (value, weight)."""
    if not samples:
        return float("nan")
    samples = sorted(samples)
    total = sum(w for _, w in samples)
    acc = 0.0
    for v, w in samples:
        acc += w
        if acc >= total * q / 100 - 1e-9:
            return v
    return samples[-1][0]


class _Window:
    """Per-second samples averaged over a window as Knative's TimedFloat64Buckets.WindowAverage does:
    divided by the seconds since the first sample (at most the window); the first sample restarts
    after a window with none (pkg/autoscaler/aggregation/bucketing.go)."""

    def __init__(self, window_s: int):
        self.window = window_s
        self.samples: deque[tuple[int, float]] = deque()
        self.first: int | None = None
        self.last: int | None = None

    def record(self, t: int, value: float) -> None:
        if self.last is None or t - self.last >= self.window:
            self.first = t
            self.samples.clear()
        self.samples.append((t, value))
        self.last = t

    def average(self, t: int) -> float:
        while self.samples and self.samples[0][0] <= t - self.window:
            self.samples.popleft()
        if self.first is None or self.last is None or t - self.last >= self.window:
            return 0.0
        n = min(t - self.first + 1, self.window)
        return sum(v for _, v in self.samples) / n


@dataclass
class _Decider:
    """pkg/autoscaler/scaling/autoscaler.go Scale(), then the delay window and scaler.go's scale-to-zero."""

    kpa: Kpa
    panic_since: int | None = None
    max_panic_pods: int = 0
    delay: deque[tuple[int, int]] = field(default_factory=deque)
    active_since: int | None = None
    inactive_since: int | None = None

    def scale(self, t: int, ready: int, stable: float, panic: float, current: int) -> int:
        k = self.kpa
        ready_f = max(1.0, float(ready))
        max_up = math.ceil(k.max_scale_up_rate * ready_f)
        max_down = math.floor(ready_f / k.max_scale_down_rate)
        dspc = math.ceil(round(stable / k.target_value, 9))
        dppc = math.ceil(round(panic / k.target_value, 9))
        stable_pods = int(min(max(dspc, max_down), max_up))
        panic_pods = int(min(max(dppc, max_down), max_up))
        over = dppc / ready_f >= k.panic_threshold_pct / 100
        if over:
            self.panic_since = t  # enter, or extend
        elif self.panic_since is not None and self.panic_since + k.stable_window_s < t:
            self.panic_since, self.max_panic_pods = None, 0
        desired = stable_pods
        if self.panic_since is not None:
            desired = max(desired, panic_pods)
            self.max_panic_pods = max(self.max_panic_pods, desired)
            desired = self.max_panic_pods  # no scale-down in panic
        if k.scale_down_delay_s > 0:
            self.delay.append((t, desired))
            while self.delay and self.delay[0][0] <= t - k.scale_down_delay_s:
                self.delay.popleft()
            desired = max(d for _, d in self.delay)
        # scaler.go handleScaleToZero: 0 only once the pods were active a stable window and the
        # revision has been inactive (the activator in the path) for the grace period
        if desired == 0:
            if self.active_since is not None and t - self.active_since < k.stable_window_s:
                desired = 1
            else:
                if self.inactive_since is None:
                    self.inactive_since = t
                if t - self.inactive_since < k.scale_to_zero_grace_s:
                    desired = current  # no change yet
        else:
            self.inactive_since = None
        if desired < k.min_scale:
            desired = k.min_scale
        if k.max_scale and desired > k.max_scale:
            desired = k.max_scale
        return desired


def simulate(burst: Burst, kpa: Kpa, cap: Capacity, prices: Prices | None = None, *, seed: int = 0,
             pod_start_s: float = 3.0, fixed_replicas: int | None = None, load: list[int] | None = None) -> Trace:
    """Play ``burst`` through the KPA (or through ``fixed_replicas`` always-on, ready from the start).
    ``load``: instead of closed-loop users, open-loop arrivals per second (tests drive steps with it)."""
    prices = prices or Prices()
    rng = np.random.default_rng(seed)
    duration = burst.duration_s if load is None else len(load)
    horizon = duration + burst.think_max_s + int(kpa.timeout_s) + 64
    due = np.zeros(horizon, dtype=np.int64)
    windows = burst.windows()
    burst_end = np.zeros(horizon, dtype=np.int64)  # for a request arriving at t: the end of its burst
    joins = np.zeros(horizon, dtype=np.int64)  # users sending their first request at t
    if load is None:
        for start, end in windows:
            joined = np.floor(burst.users * np.clip((np.arange(start, end + 1) - start + 1) / burst.ramp_s, 0, 1))
            joins[start:end + 1] += np.diff(np.concatenate([[0], joined])).astype(np.int64)
            burst_end[start:end + 1] = end
        due += joins
    else:
        due[: len(load)] = np.asarray(load, dtype=np.int64)
    mu = cap.usable_rate(kpa.container_concurrency)
    replica_cost = prices.replica_s(kpa)
    stable_w, panic_w = _Window(int(kpa.stable_window_s)), _Window(kpa.panic_window_s)
    decider = _Decider(kpa)
    queue: deque[list[int]] = deque()  # [arrival second, count]
    queued = 0
    ready = fixed_replicas or 0
    pending: deque[int] = deque()  # seconds at which the pods being started are ready
    carry = 0.0
    rate_avg = 0.0  # steps/s per replica, averaged as the curve's points were measured (RATE_AVERAGE_S)
    users = 0
    lat_samples: list[tuple[float, float]] = []
    tr = Trace()
    arrived_total = served_total = dropped_total = cold_total = 0
    replica_seconds = 0.0
    s3_total = 0.0

    def think(t: int, n: int, reply_s: float, end: int) -> None:
        """``n`` users got their reply at t + reply_s: each thinks and sends its next request (if the
        burst is still on then)."""
        nonlocal users
        if n <= 0 or load is not None:
            return
        draws = rng.integers(burst.think_min_s, burst.think_max_s + 1, size=n)
        # the reply's second, rounded at random (up with probability its fraction): on average reply_s,
        # where a ceiling added ~0.5 s to every think (20 % at 2-6 s thinks, as --check-against showed)
        nxt = t + np.floor(reply_s + rng.random(n)).astype(np.int64) + draws
        keep = nxt[nxt <= end]
        users -= n - len(keep)
        np.add.at(due, keep, 1)

    for t in range(duration):
        # pods that finished starting
        while pending and pending[0] <= t:
            pending.popleft()
            if ready == 0:
                decider.active_since = t
            ready += 1
        # arrivals (a user's first request makes it a user)
        a = int(due[t])
        users += int(joins[t])
        if a:
            queue.append([t, a])
            queued += a
        arrived_total += a
        # requests buffered for timeoutSeconds are dropped; their users go on
        dropped = 0
        while queue and t - queue[0][0] >= kpa.timeout_s:
            at, n = queue.popleft()
            queued -= n
            dropped += n
            think(t, n, 0.0, int(burst_end[at]))
        dropped_total += dropped
        # the ready replicas serve, FIFO
        budget = ready * mu + carry if ready else 0.0
        served = min(queued, math.floor(budget))
        carry = budget - served if queued > served and ready else 0.0
        per_replica = served / ready if ready else 0.0
        # the curve's latency at the replica's recent rate, not this second's count: its points are
        # averages over a window, and one busy second of a load below the knee is no saturation
        rate_avg += (per_replica - rate_avg) / RATE_AVERAGE_S
        l50, l99 = cap.latency(rate_avg)
        left = served
        tick_lat: list[tuple[float, float]] = []
        while left:
            at, n = queue[0]
            m = min(n, left)
            wait = float(t - at)
            tick_lat += [(wait + l50, m * (1 - SLOW_SHARE)), (wait + l99, m * SLOW_SHARE)]
            think(t, m, l50, int(burst_end[at]))
            left -= m
            if m == n:
                queue.popleft()
            else:
                queue[0][1] = n - m
        queued -= served
        served_total += served
        lat_samples += tick_lat
        tr.samples += [(t, v, w) for v, w in tick_lat]
        # what the queue-proxies and the activator report this second
        conc = served * l50 + queued
        if ready or pending or conc > 0:
            stable_w.record(t, conc)
            panic_w.record(t, conc)
        # the autoscaler: every tick, and at once when the activator holds requests and no pod exists
        cold = 0
        poke = ready == 0 and not pending and queued > 0
        if fixed_replicas is None and (t % kpa.tick_s == 0 or poke):
            current = ready + len(pending)
            want = decider.scale(t, ready, stable_w.average(t), panic_w.average(t), current)
            tr.decisions.append((t, ready, want))
            if want > current:
                cold = want - current
                pending.extend([t + math.ceil(pod_start_s)] * cold)
            while want < ready + len(pending):
                if pending:
                    pending.pop()
                else:
                    ready -= 1
            if ready == 0 and not pending:
                decider.active_since = None
        cold_total += cold
        pods = ready + len(pending)
        replica_seconds += pods
        s3 = served * cap.s3_requests_per_step
        s3_total += s3
        tr.t.append(t)
        tr.users.append(users)
        tr.arrived.append(a)
        tr.served.append(served)
        tr.dropped.append(dropped)
        tr.queued.append(queued)
        tr.ready.append(ready)
        tr.pending.append(len(pending))
        tr.cold_starts.append(cold)
        tr.panic.append(decider.panic_since is not None)
        tr.concurrency.append(conc)
        tr.step_p50_s.append(_percentile(tick_lat, 50) if tick_lat else float("nan"))
        tr.step_p99_s.append(_percentile(tick_lat, 99) if tick_lat else float("nan"))
        tr.s3_rps.append(s3)
        tr.cost_per_s.append(pods * replica_cost + s3 * prices.s3_request)
    tr.totals = {
        "arrived": arrived_total, "served": served_total, "dropped": dropped_total, "queued": queued,
        "replica_seconds": replica_seconds, "cold_starts": cold_total, "peak_replicas": max(tr.ready, default=0),
        "replica_cost": replica_seconds * replica_cost, "s3_requests": s3_total, "s3_cost": s3_total * prices.s3_request,
        "cost": replica_seconds * replica_cost + s3_total * prices.s3_request,
        "step_p50_s": _percentile(lat_samples, 50), "step_p99_s": _percentile(lat_samples, 99),
        "per_replica_steps_per_s": mu,
    }
    return tr


# the loads checked (open episodes, think s), inside the curve's range: 15 and 30 steps/s offered
CHECK_POINTS = ((300, 20.0), (600, 20.0))
CURVE_POINTS = ((200, 20.0), (400, 20.0), (800, 20.0))  # (a point far past the knee took minutes to open)
# --quick: plumbing in ~40 s, not a verdict; half the episodes at half the think time (and half the
# hibernation delay) offer the same steps/s, with as many steps hibernated, in half the warm-up
QUICK_CHECK = ((5, 2.0), (20, 2.0))
QUICK_CURVE = ((2, 2.0), (10, 2.0), (30, 2.0))


def predict_point(cap: Capacity, kpa: Kpa, users: int, think_s: float, *, seed: int = 0,
                  window_s: int = 120) -> tuple[float, float, float]:
    """The model's steady state for ``users`` closed-loop users thinking uniform 0.5-1.5 x ``think_s``
    (whole seconds, as the model draws them) on ONE replica, always ready, sent to it straight (as the
    sweep does: no queue-proxy, so no containerConcurrency and no drops): steps/s, step p50 and p99 (s)
    over ``window_s`` after a warm-up of a few think times."""
    lo = max(1, round(0.5 * think_s))
    hi = max(lo, round(1.5 * think_s))
    warm = 4 * hi + 30
    # held past the window by a think time: users whose next step would come after the burst's end leave
    burst = Burst(users=users, think_min_s=lo, think_max_s=hi, ramp_s=1, hold_s=warm + window_s + hi + 2, gap_s=0,
                  bursts=1, lead_s=0, tail_s=0)
    one = dataclasses.replace(kpa, container_concurrency=0, timeout_s=3600.0)
    tr = simulate(burst, one, cap, seed=seed, fixed_replicas=1)
    t0, t1 = warm + 1, warm + 1 + window_s
    served = sum(tr.served[t0:t1])
    samples = [(v, w) for t, v, w in tr.samples if t0 <= t < t1]
    return served / window_s, _percentile(samples, 50), _percentile(samples, 99)


def _sweep_rows(path: Path) -> tuple[list[str], list[dict[str, str]]]:
    lines = path.read_text().splitlines()
    comments = [ln for ln in lines if ln.startswith("#")]
    return comments, list(csv.DictReader(ln for ln in lines if ln.strip() and not ln.startswith("#")))


def check_against(measured: Path, cap: Capacity, kpa: Kpa, *, tolerance: float = 0.25,
                  seed: int = 0) -> tuple[list[dict[str, float]], bool]:
    """Each measured load of ``measured`` (a sweep's CSV) beside the model's prediction for it: steps/s
    and step p99, measured and predicted, and their relative errors; True if all are within ``tolerance``."""
    _, rows = _sweep_rows(measured)
    if not rows:
        raise ValueError(f"{measured}: no measured point")
    out = []
    for r in rows:
        users, think = int(r["open_episodes"]), float(r["think_s"])
        rate, _, p99 = predict_point(cap, kpa, users, think, seed=seed)
        m_rate, m_p99 = float(r["steps_per_s"]), float(r["step_p99_ms"]) / 1000
        out.append({"open_episodes": users, "think_s": think, "offered": users / think,
                    "measured_steps_per_s": m_rate, "predicted_steps_per_s": rate,
                    "steps_error": (rate - m_rate) / m_rate if m_rate else float("inf"),
                    "measured_p99_s": m_p99, "predicted_p99_s": p99,
                    "p99_error": (p99 - m_p99) / m_p99 if m_p99 else float("inf")})
    ok = all(abs(x["steps_error"]) <= tolerance and abs(x["p99_error"]) <= tolerance for x in out)
    return out, ok


def check_run(out: Path, *, quick: bool = False, seed: int = 0) -> tuple[Path, Path]:
    """Measure on one replica of this box (capacity_sweep, one run, every point in order of open
    episodes): the curve's points and the check points; write ``curve.csv`` (the curve's rows) and
    ``check.csv`` (the check points' rows) beside the sweep's own capacity.csv. Returns their paths."""
    import capacity_sweep  # (its fleet: SeaweedFS, one rollbox serve; as root)

    check, curve = (QUICK_CHECK, QUICK_CURVE) if quick else (CHECK_POINTS, CURVE_POINTS)
    points = sorted({*check, *curve})
    argv = ["--sweep", "--points", ",".join(f"{n}x{t:g}" for n, t in points), "--seed", str(seed), "--out", str(out)]
    if quick:
        argv += ["--warmup-s", "2", "--window-s", "4", "--hibernate-after-s", "1.5"]
    else:
        argv += ["--warmup-s", "10", "--window-s", "30"]
    rc = capacity_sweep.main(argv)
    if rc != 0:
        raise RuntimeError(f"the sweep failed (exit {rc}): see {out}")
    comments, rows = _sweep_rows(out / "capacity.csv")
    paths = []
    for name, wanted in (("curve.csv", curve), ("check.csv", check)):
        keep = [r for r in rows if (int(r["open_episodes"]), float(r["think_s"])) in set(wanted)]
        with open(out / name, "w", newline="") as f:
            f.write("\n".join(comments) + "\n")
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(keep)
        paths.append(out / name)
    return paths[0], paths[1]


def print_check(measured: Path, capacity: Path, cap: Capacity, kpa: Kpa, tolerance: float, seed: int) -> int:
    results, ok = check_against(measured, cap, kpa, tolerance=tolerance, seed=seed)
    print(f"the model (curve: {capacity}, {len(cap.rate)} points) against {measured} (one replica, steady state)")
    print(f"{'load':>12} {'offered':>8} | {'steps/s':>8} {'model':>8} {'error':>7} | {'p99 s':>8} {'model':>8} "
          f"{'error':>7}")
    for x in results:
        load = f"{x['open_episodes']}x{x['think_s']:g} s"
        print(f"{load:>12} {x['offered']:8.1f} | {x['measured_steps_per_s']:8.2f} "
              f"{x['predicted_steps_per_s']:8.2f} {x['steps_error']:+7.0%} | {x['measured_p99_s']:8.2f} "
              f"{x['predicted_p99_s']:8.2f} {x['p99_error']:+7.0%}")
    print(f"verdict: {'within' if ok else 'NOT within'} {tolerance:.0%} at every load (steps/s and p99)")
    return 0 if ok else 1


def always_on_replicas(burst: Burst, kpa: Kpa, cap: Capacity) -> int:
    """An always-on fleet sized for the peak: the peak's requests/s over what one replica serves at the
    Service's target utilization."""
    return max(1, math.ceil(burst.peak_rate / (cap.usable_rate(kpa.container_concurrency) * kpa.utilization)))


def plot(auto: Trace, fixed: Trace, n_fixed: int, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = np.asarray(auto.t) / 60
    fig, ax = plt.subplots(6, 1, figsize=(11, 15), sharex=True)
    ax[0].plot(t, np.asarray(auto.ready) + np.asarray(auto.pending), label="autoscaled (ready + starting)")
    ax[0].plot(t, fixed.ready, label=f"always-on ({n_fixed})", linestyle="--")
    ax[0].set_ylabel("replicas")
    ax[1].plot(t, auto.queued, label="autoscaled")
    ax[1].plot(t, fixed.queued, label="always-on", linestyle="--")
    ax[1].set_ylabel("requests queued")
    ax[2].plot(t, auto.step_p99_s, label="autoscaled p99")
    ax[2].plot(t, auto.step_p50_s, label="autoscaled p50")
    ax[2].plot(t, fixed.step_p99_s, label="always-on p99", linestyle="--")
    ax[2].set_ylabel("step latency (s)")
    ax[2].set_yscale("log")
    ax[3].plot(t, np.cumsum(auto.cold_starts), label="autoscaled")
    ax[3].set_ylabel("cold starts (cumulative)")
    ax[4].plot(t, auto.s3_rps, label="autoscaled")
    ax[4].plot(t, fixed.s3_rps, label="always-on", linestyle="--")
    ax[4].set_ylabel("S3 requests/s")
    ax[5].plot(t, np.asarray(auto.cost_per_s) * 3600, label="autoscaled")
    ax[5].plot(t, np.asarray(fixed.cost_per_s) * 3600, label="always-on", linestyle="--")
    ax[5].set_ylabel("cost ($/hour)")
    ax[5].set_xlabel("minutes")
    for a in ax:
        a.legend(loc="upper right", fontsize=8)
        a.grid(alpha=0.3)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def write_csv(auto: Trace, fixed: Trace, path: Path) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["t_s", "users", "arrived", "served", "dropped", "queued", "ready", "starting", "cold_starts",
                    "panic", "step_p50_s", "step_p99_s", "s3_rps", "cost_usd_per_s",
                    "always_on_queued", "always_on_step_p99_s", "always_on_cost_usd_per_s"])
        for i in range(len(auto.t)):
            w.writerow([auto.t[i], auto.users[i], auto.arrived[i], auto.served[i], auto.dropped[i], auto.queued[i],
                        auto.ready[i], auto.pending[i], auto.cold_starts[i], int(auto.panic[i]),
                        f"{auto.step_p50_s[i]:.3f}", f"{auto.step_p99_s[i]:.3f}", f"{auto.s3_rps[i]:.1f}",
                        f"{auto.cost_per_s[i]:.6f}", fixed.queued[i], f"{fixed.step_p99_s[i]:.3f}",
                        f"{fixed.cost_per_s[i]:.6f}"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--users", type=int, default=100_000)
    ap.add_argument("--think-min-s", type=int, default=60)
    ap.add_argument("--think-max-s", type=int, default=120)
    ap.add_argument("--ramp-s", type=int, default=600)
    ap.add_argument("--hold-s", type=int, default=600)
    ap.add_argument("--gap-s", type=int, default=Burst.gap_s)
    ap.add_argument("--tail-s", type=int, default=Burst.tail_s)
    ap.add_argument("--bursts", type=int, default=2)
    ap.add_argument("--capacity", type=Path, default=DEFAULT_CAPACITY, help="bench_capacity.py --sweep's CSV")
    ap.add_argument("--steps", choices=("durable", "live", "all"), default="durable",
                    help="which sweep points make the curve (durable: episodes hibernated between steps)")
    ap.add_argument("--service", type=Path, default=SERVICE_YAML, help="the Knative Service to read the autoscaling from")
    ap.add_argument("--pod-start-s", type=float, default=None,
                    help="a new pod's time to its first reply (default: the capacity CSV's measured cold start)")
    ap.add_argument("--target", type=float, default=None, help="override the Service's autoscaling target")
    ap.add_argument("--max-scale", type=int, default=None, help="override the Service's max-scale")
    ap.add_argument("--max-scale-up-rate", type=float, default=None, help="config-autoscaler (default 1000)")
    ap.add_argument("--scale-to-zero-grace-s", type=float, default=None, help="config-autoscaler (default 30)")
    ap.add_argument("--vcpu-hour", type=float, default=Prices.vcpu_hour)
    ap.add_argument("--gib-hour", type=float, default=Prices.gib_hour)
    ap.add_argument("--s3-request", type=float, default=Prices.s3_request, help="dollars per S3 request")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--print-every-s", type=int, default=120)
    ap.add_argument("--png", type=Path, default=None)
    ap.add_argument("--csv", type=Path, default=None)
    ap.add_argument("--check-against", type=Path, default=None, metavar="MEASURED_CSV",
                    help="instead of a burst: the model's prediction for each load of this sweep CSV (one replica) "
                         "beside what was measured, with the relative errors and a verdict (exit 1 if outside)")
    ap.add_argument("--check-run", type=Path, default=None, metavar="DIR",
                    help="measure first (one replica on this box, ~6 min; as root): the curve's points and two check "
                         "loads in one sweep, into DIR/curve.csv and DIR/check.csv; then the check")
    ap.add_argument("--quick", action="store_true", help="with --check-run: short points (~40 s), no verdict to keep")
    ap.add_argument("--tolerance", type=float, default=0.25, help="the check's relative error allowed")
    args = ap.parse_args(argv)
    if args.check_run is not None or args.check_against is not None:
        kpa = Kpa.from_service(args.service)
        capacity, measured = args.capacity, args.check_against
        if args.check_run is not None:
            capacity, measured = check_run(args.check_run, quick=args.quick, seed=args.seed)
        assert measured is not None
        steps = "all" if args.quick else args.steps  # (the quick points are not all durable)
        return print_check(measured, capacity, Capacity.from_csv(capacity, steps), kpa, args.tolerance, args.seed)
    burst = Burst(users=args.users, think_min_s=args.think_min_s, think_max_s=args.think_max_s, ramp_s=args.ramp_s,
                  hold_s=args.hold_s, gap_s=args.gap_s, bursts=args.bursts, tail_s=args.tail_s)
    kpa = Kpa.from_service(args.service, target=args.target, max_scale=args.max_scale,
                           max_scale_up_rate=args.max_scale_up_rate, scale_to_zero_grace_s=args.scale_to_zero_grace_s)
    cap = Capacity.from_csv(args.capacity, args.steps)
    pod_start = args.pod_start_s if args.pod_start_s is not None else (cap.cold_start_s or 3.0)
    prices = Prices(args.vcpu_hour, args.gib_hour, args.s3_request)
    auto = simulate(burst, kpa, cap, prices, seed=args.seed, pod_start_s=pod_start)
    n_fixed = always_on_replicas(burst, kpa, cap)
    fixed = simulate(burst, kpa, cap, prices, seed=args.seed, pod_start_s=pod_start, fixed_replicas=n_fixed)
    mu = auto.totals["per_replica_steps_per_s"]
    print(f"capacity: {args.capacity}, {args.steps} steps ({cap.source})")
    print(f"  one replica: up to {cap.max_rate:.1f} steps/s measured, {mu:.1f} usable within containerConcurrency "
          f"{kpa.container_concurrency}; {cap.s3_requests_per_step:.2f} S3 requests and {cap.cpu_ms_per_step:.1f} ms "
          f"of machine CPU per step; pod start {pod_start:.2f} s")
    if not cap.saturated:
        print(f"  NOTE: no point of the curve was saturated: the replica's limit is above "
              f"{cap.max_rate:.1f} steps/s, unmeasured; the model holds it there (pessimistic)")
    print(f"knative: {args.service}: target {kpa.target:g} x utilization {kpa.utilization:g} -> {kpa.target_value:g} "
          f"concurrent per pod; window {kpa.stable_window_s:g} s, panic {kpa.panic_window_s} s at "
          f"{kpa.panic_threshold_pct:g} %, max-scale-up-rate {kpa.max_scale_up_rate:g}, scale-down-delay "
          f"{kpa.scale_down_delay_s:g} s, grace {kpa.scale_to_zero_grace_s:g} s, scale {kpa.min_scale}-{kpa.max_scale}, "
          f"timeout {kpa.timeout_s:g} s; pod {kpa.cpu_request:g} cores {kpa.memory_request_gib:g} GiB = "
          f"${prices.replica_s(kpa) * 3600:.4f}/hour")
    fit = cap.concurrency_at(0.7, kpa.container_concurrency)
    print(f"  a replica at 70 % of its usable rate holds {fit:.1f} requests (steps/s x p50): the KPA keeps replicas "
          f"there with target x utilization = {fit:.1f}, i.e. autoscaling.knative.dev/target "
          f"{fit / kpa.utilization:.1f} at {kpa.utilization:.0%} (the Service says {kpa.target:g})")
    print(f"load: {burst.bursts} x {burst.users} users, think {burst.think_min_s}-{burst.think_max_s} s, ramp "
          f"{burst.ramp_s} s, hold {burst.hold_s} s, gap {burst.gap_s} s; peak offered {burst.peak_rate:.0f} requests/s")
    print(f"{'min':>6} {'users':>7} {'req/s':>7} {'ready':>5} {'start':>5} {'queued':>7} {'panic':>5} "
          f"{'p50 s':>7} {'p99 s':>7} {'S3/s':>7} {'$/h':>7} | {'on:queued':>9} {'on:p99':>7} {'on:$/h':>7}")
    step = max(1, args.print_every_s)
    for i in range(0, len(auto.t), step):
        sl = slice(i, i + step)
        p99 = np.nanmax(auto.step_p99_s[sl]) if any(not math.isnan(x) for x in auto.step_p99_s[sl]) else float("nan")
        p50 = float(np.nanmedian(auto.step_p50_s[sl])) if not math.isnan(p99) else float("nan")
        fp99 = np.nanmax(fixed.step_p99_s[sl]) if any(not math.isnan(x) for x in fixed.step_p99_s[sl]) else float("nan")
        print(f"{i / 60:6.1f} {auto.users[i]:7d} {sum(auto.arrived[sl]) / step:7.0f} {auto.ready[i]:5d} "
              f"{auto.pending[i]:5d} {auto.queued[i]:7d} {'yes' if any(auto.panic[sl]) else '':>5} {p50:7.2f} "
              f"{p99:7.2f} {np.mean(auto.s3_rps[sl]):7.0f} {np.mean(auto.cost_per_s[sl]) * 3600:7.2f} | "
              f"{fixed.queued[i]:9d} {fp99:7.2f} {np.mean(fixed.cost_per_s[sl]) * 3600:7.2f}")
    for name, tr in (("autoscaled", auto), (f"always-on ({n_fixed} replicas)", fixed)):
        tt = tr.totals
        print(f"{name}: {tt['replica_seconds']:.0f} replica-seconds, peak {tt['peak_replicas']:.0f} replicas, "
              f"{tt['cold_starts']:.0f} cold starts; cost ${tt['cost']:.2f} (replicas ${tt['replica_cost']:.2f}, S3 "
              f"${tt['s3_cost']:.2f}, {tt['s3_requests']:.0f} requests); step p50 {tt['step_p50_s']:.2f} s, p99 "
              f"{tt['step_p99_s']:.2f} s; requests arrived {tt['arrived']:.0f} = served {tt['served']:.0f} + "
              f"queued {tt['queued']:.0f} + dropped {tt['dropped']:.0f}")
    title = (f"fleet model: {burst.bursts} x {burst.users} users, think {burst.think_min_s}-{burst.think_max_s} s; "
             f"KPA from {args.service.name}\ncapacity: {cap.source[:160]}")
    if args.png:
        plot(auto, fixed, n_fixed, args.png, title)
        print(f"plot: {args.png}")
    if args.csv:
        write_csv(auto, fixed, args.csv)
        print(f"csv: {args.csv}")
    return 0


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["Burst", "Capacity", "Kpa", "Prices", "Trace", "always_on_replicas", "check_against", "predict_point",
           "simulate"]
