"""A sandbox cgroup that cannot be removed is not silent: logged once with its path, counted, exported.

The cgroup is made unremovable for real (a child cgroup inside it: rmdir gets EBUSY), both as root
and, through test_rootless, in a delegated subtree.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from rollbox.functions.service.metrics import Metrics
from rollbox.runtime.runtime import Runtime, RuntimeConfig

pytestmark = pytest.mark.asyncio(loop_scope="function")


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


async def test_a_cgroup_that_will_not_go_is_logged_counted_and_exported(tmp_path: Path) -> None:
    parent = os.environ.get("ROLLBOX_TEST_CGROUP_PARENT", f"rollbox-test-{os.getpid()}")
    rt = Runtime(RuntimeConfig(state_dir=tmp_path, cgroup_parent=parent))
    metrics = Metrics(live_count=rt.live_count, pool_sizes=rt.pool_sizes, inflight=lambda: 0)
    metrics.watch_cleanup(lambda: rt.cleanup_failures)
    await rt.start()
    if rt.cgroup_backend is None:
        await rt.close()
        pytest.skip(f"no cgroup backend here: {rt.cgroup_reason}")
    stuck: list[Path] = []
    logger = logging.getLogger("rollbox.runtime")
    seen = _Records()
    logger.addHandler(seen)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        assert b'rollbox_cleanup_failures_total{kind="cgroup"} 0.0' in generate_latest(metrics.registry)
        info = await rt.create()
        group = rt.sandboxes[info.sandbox_id].group
        assert group is not None
        stuck = [Path(p) / "stuck" for p in group.paths()]
        stuck[0].mkdir()  # a child cgroup: its parent cannot be removed while it exists
        await rt.destroy(info.sandbox_id)  # the emptied group is kept for reuse ...
        await rt.close()  # ... and removed at close, which fails for this one
    finally:
        await rt.close()
        logger.removeHandler(seen)
        logger.setLevel(level)
        for d in stuck:
            if d.is_dir():
                d.rmdir()
        for d in stuck:
            if d.parent.is_dir():
                d.parent.rmdir()
        if rt.cgroup_backend:
            rt.cgroup_backend.close()
    assert rt.cleanup_failures["cgroup"] == 1
    records = [r for r in seen.records if "cgroup" in r.getMessage()]
    assert len(records) == 1, [r.getMessage() for r in records]
    assert records[0].levelno == logging.WARNING
    assert f"cannot remove cgroup {stuck[0].parent}" in records[0].getMessage()
    assert records[0].fields["cgroup"] == group.paths()  # type: ignore[attr-defined]
    assert b'rollbox_cleanup_failures_total{kind="cgroup"} 1.0' in generate_latest(metrics.registry)
