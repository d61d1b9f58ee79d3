"""The durable layer's Prometheus metrics: resumes, hibernations, commits, conflicts, stale copies."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

__all__ = ["DurableMetrics"]

_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


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
