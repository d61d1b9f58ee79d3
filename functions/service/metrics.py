"""Prometheus metrics of the service, in a registry of its own (one per Service)."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from pydantic import BaseModel
from rollbox.runtime.pool import Pool
from rollbox.runtime.spec import ExecResult, SandboxInfo, Usage

__all__ = ["Metrics"]

_CREATE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_REQUEST_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class _PoolCollector(Collector):
    def __init__(self, pool_sizes: Callable[[], dict[str, int]]):
        self._pool_sizes = pool_sizes

    def collect(self) -> Iterator[Metric]:
        fam = GaugeMetricFamily("rollbox_pool_size", "Ready sandboxes in the warm pool", labels=["snapshot"])
        for snapshot, n in sorted(self._pool_sizes().items()):
            fam.add_metric([snapshot], n)
        yield fam


class _PoolFailuresCollector(Collector):
    """What the warm pools failed to do, per snapshot, read from the pools at scrape time (each pool
    counts and logs its own failures: runtime/pool.py)."""

    def __init__(self, pools: Callable[[], Iterable[Pool]]):
        self._pools = pools

    def collect(self) -> Iterator[Metric]:
        builds = CounterMetricFamily("rollbox_pool_build_failures",
                                     "Sandboxes a warm pool failed to build (each run of failures is logged once)",
                                     labels=["snapshot"])
        shortfalls = CounterMetricFamily("rollbox_pool_prewarm_shortfalls",
                                         "Waits for N ready sandboxes (prewarm) that ran out of time",
                                         labels=["snapshot"])
        totals: dict[str, tuple[int, int]] = {}
        for pool in self._pools():
            b, p = totals.get(pool.snapshot_id, (0, 0))
            totals[pool.snapshot_id] = (b + pool.build_failures, p + pool.prewarm_shortfalls)
        for snapshot, (b, p) in sorted(totals.items()):
            builds.add_metric([snapshot], b)
            shortfalls.add_metric([snapshot], p)
        yield builds
        yield shortfalls


class _CleanupFailuresCollector(Collector):
    """Clean-up the runtime could not do (a sandbox cgroup that would not go, ...), by kind, read from
    the runtime's counter at scrape time (each failure is logged once where it happens)."""

    def __init__(self, failures: Callable[[], Mapping[str, int]]):
        self._failures = failures

    def collect(self) -> Iterator[Metric]:
        fam = CounterMetricFamily("rollbox_cleanup_failures",
                                  "Things the runtime could not clean up and left in place", labels=["kind"])
        for kind, n in sorted(self._failures().items()):
            fam.add_metric([kind], n)
        yield fam


class _GcPauses:
    """The time this process spent in Python's cyclic garbage collector, by generation (``gc.callbacks``):
    a collection stops every thread, the event loop's too, and a full one (generation 2) walks every
    container object the process holds, so its length grows with what a replica keeps. One per process
    (``gc_pauses``), whatever thread collects. (How many collections: ``gc.get_stats()``.)"""

    def __init__(self) -> None:
        self.seconds = [0.0, 0.0, 0.0]
        self._started: float | None = None

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:  # (a collection holds the GIL from its start to its stop)
            self.seconds[info["generation"]] += time.perf_counter() - self._started
            self._started = None


_GC_PAUSES = _GcPauses()


def gc_pauses() -> _GcPauses:
    """The process's ``_GcPauses``, counting from the first call."""
    if _GC_PAUSES not in gc.callbacks:
        gc.callbacks.append(_GC_PAUSES)
    return _GC_PAUSES


class _GcCollector(Collector):
    def __init__(self, pauses: _GcPauses):
        self._pauses = pauses

    def collect(self) -> Iterator[Metric]:
        seconds = CounterMetricFamily("rollbox_gc_pause_seconds",
                                      "Time in Python's cyclic garbage collector (every thread stopped), by generation",
                                      labels=["generation"])
        runs = CounterMetricFamily("rollbox_gc_collections",
                                   "Python's cyclic garbage collections since the process started, by generation",
                                   labels=["generation"])
        for g, stats in enumerate(gc.get_stats()):
            seconds.add_metric([str(g)], self._pauses.seconds[g])
            runs.add_metric([str(g)], stats["collections"])
        yield seconds
        yield runs


class Metrics:
    def __init__(
        self,
        *,
        live_count: Callable[[], int],
        pool_sizes: Callable[[], dict[str, int]],
        inflight: Callable[[], int],
        pools: Callable[[], Iterable[Pool]] | None = None,
        waiting: Callable[[], int] | None = None,
        cleanup_failures: Callable[[], Mapping[str, int]] | None = None,
        registry: CollectorRegistry | None = None,
    ):
        """``registry``: where to register (the replica's, shared with the durable layer and the
        recorder; default: a new one)."""
        self.registry = r = registry or CollectorRegistry()
        self.requests = Counter(
            "rollbox_requests", "CloudEvent requests answered", ["type", "status"], registry=r
        )
        self.request_seconds = Histogram(
            "rollbox_request_seconds",
            "Time to answer a request",
            ["type"],
            buckets=_REQUEST_BUCKETS,
            registry=r,
        )
        self.replays = Counter(
            "rollbox_idempotent_replays", "Duplicate events answered from the cache", registry=r
        )
        self.create_seconds = Histogram(
            "rollbox_sandbox_create_seconds",
            "Sandbox create latency in the runtime",
            ["source"],
            buckets=_CREATE_BUCKETS,
            registry=r,
        )
        self.execs = Counter("rollbox_execs", "Execs run (exec and run events)", ["type"], registry=r)
        self.record_failures = Counter("rollbox_record_failures",
                                       "Answered steps whose trajectory row could not be spooled", registry=r)
        self.exit_codes = Counter("rollbox_exec_exit_codes", "Exit codes of execs", ["code"], registry=r)
        self.timeouts = Counter("rollbox_exec_timeouts", "Execs killed at their timeout", registry=r)
        self.oom_kills = Counter("rollbox_exec_oom_kills", "Execs killed for memory", registry=r)
        self.destroyed = Counter("rollbox_sandboxes_destroyed", "Sandboxes destroyed by request", registry=r)
        self.rejects = Counter(
            "rollbox_admission_rejects", "Requests refused by admission control", ["reason"], registry=r
        )
        live = Gauge("rollbox_live_sandboxes", "Live sandboxes", registry=r)
        live.set_function(lambda: float(live_count()))
        inf = Gauge("rollbox_inflight_requests", "Requests admitted and not yet answered", registry=r)
        inf.set_function(lambda: float(inflight()))
        if waiting is not None:
            wait = Gauge("rollbox_waiting_requests", "Requests admitted and waiting their turn (--max-running), "
                         "not started", registry=r)
            wait.set_function(lambda: float(waiting()))
        r.register(_PoolCollector(pool_sizes))
        r.register(_GcCollector(gc_pauses()))
        if pools is not None:
            r.register(_PoolFailuresCollector(pools))
        if cleanup_failures is not None:
            self.watch_cleanup(cleanup_failures)

    def watch_cleanup(self, failures: Callable[[], Mapping[str, int]]) -> None:
        """Export the runtime's clean-up failures (``Runtime.cleanup_failures``) as
        ``rollbox_cleanup_failures_total{kind}``."""
        self.registry.register(_CleanupFailuresCollector(failures))

    def record_reply(self, request_type: str, data: BaseModel) -> None:
        if isinstance(data, SandboxInfo):
            if data.hibernated:  # no sandbox was made (rollbox_hibernations_total{reason="create"} counts these)
                return
            self.create_seconds.labels("pooled" if data.pooled else "restored").observe(data.create_ms / 1000)
        elif isinstance(data, ExecResult):
            if data.create_ms is not None:  # a one-shot run: its sandbox was acquired too
                self.create_seconds.labels("pooled" if data.pooled else "restored").observe(data.create_ms / 1000)
            self.execs.labels(request_type).inc()
            self.exit_codes.labels(str(data.exit_code)).inc()
            if data.timed_out:
                self.timeouts.inc()
            if data.oom_killed:
                self.oom_kills.inc()
        elif isinstance(data, Usage):
            self.destroyed.inc()
