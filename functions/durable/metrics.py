"""The durable layer's Prometheus metrics: resumes, hibernations, commits, conflicts, stale copies, and
the store's requests."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

__all__ = ["DurableMetrics"]

_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class _StoreRequests(Collector):
    """Requests the replica sent to its store, by operation, read from the S3 client at scrape time."""

    def __init__(self, sent: Callable[[], Mapping[str, int]]):
        self._sent = sent

    def collect(self) -> Iterator[Metric]:
        fam = CounterMetricFamily("rollbox_store_requests",
                                  "Requests sent to the S3 store (each attempt), by operation: durable state, "
                                  "blobs, snapshots' layers and manifests", labels=["operation"])
        for op, n in sorted(self._sent().items()):
            fam.add_metric([op], n)
        yield fam


class DurableMetrics:
    """The durable layer's metrics, registered in the replica's registry."""

    def __init__(self, registry: CollectorRegistry | None):
        r = registry or CollectorRegistry()
        self.resumes = Counter("rollbox_resumes", "Sandboxes resumed from their durable state", registry=r)
        self.hibernations = Counter("rollbox_hibernations",
                                    "Live sandboxes ended with their state in the store: idle, pressure (at the "
                                    "live cap), step (passed through), drain",
                                    ["reason"], registry=r)
        self.resume_seconds = Histogram("rollbox_resume_seconds", "Time to resume a sandbox from the store",
                                        buckets=_LATENCY, registry=r)
        self.store_write_seconds = Histogram("rollbox_state_write_seconds",
                                             "Time to commit a step's state to the store", buckets=_LATENCY,
                                             registry=r)
        self.conflicts = Counter("rollbox_state_conflicts",
                                 "Steps not committed because another replica committed that generation first",
                                 registry=r)
        self.stale = Counter("rollbox_stale_copies", "Live copies dropped because another replica moved on",
                             registry=r)
        self.registry = r

    def watch_store(self, sent: Callable[[], Mapping[str, int]]) -> None:
        """Export the store's requests by operation (``Objects.requests_sent``) as
        ``rollbox_store_requests_total{operation}``."""
        self.registry.register(_StoreRequests(sent))
