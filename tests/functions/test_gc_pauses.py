"""The garbage collector's pauses in /metrics (``rollbox_gc_pause_seconds_total``): counted from
``gc.callbacks`` in this process, as a replica counts its own."""

from __future__ import annotations

import gc

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from rollbox.functions.service.metrics import _GcCollector, gc_pauses


def _samples(registry: CollectorRegistry) -> dict[tuple[str, str], float]:
    text = generate_latest(registry).decode()
    return {(s.name, s.labels["generation"]): s.value for fam in text_string_to_metric_families(text)
            for s in fam.samples if s.name.startswith("rollbox_gc_")}


def test_a_full_collection_is_counted_with_its_time_and_installed_once() -> None:
    pauses = gc_pauses()
    assert gc_pauses() is pauses and gc.callbacks.count(pauses) == 1
    registry = CollectorRegistry()
    registry.register(_GcCollector(pauses))
    before = _samples(registry)
    garbage = []
    for _ in range(50_000):  # cycles, so the collection has work to do
        a: list[object] = []
        a.append(a)
        garbage.append(a)
    del garbage, a
    gc.collect(2)
    gc.collect(0)
    after = _samples(registry)
    assert after[("rollbox_gc_collections_total", "2")] >= before[("rollbox_gc_collections_total", "2")] + 1
    assert after[("rollbox_gc_collections_total", "0")] >= before[("rollbox_gc_collections_total", "0")] + 1
    # walking 50,000 cycles takes time (a few ms): the pause is measured, not only counted
    assert after[("rollbox_gc_pause_seconds_total", "2")] > before[("rollbox_gc_pause_seconds_total", "2")]
    assert after[("rollbox_gc_pause_seconds_total", "1")] >= before[("rollbox_gc_pause_seconds_total", "1")]
