"""A runtime's cgroups go when it closes, even right after a fork bomb; one that cannot be removed is
not silent: logged once with its path, counted, exported, and so is the parent it keeps.

The cgroup is made unremovable for real (a child cgroup inside it: rmdir gets EBUSY), both as root
and, through test_rootless, in a delegated subtree.
"""

from __future__ import annotations

import logging
import os
import subprocess
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from rollbox.functions.service.metrics import Metrics
from rollbox.runtime.isolation.cgroups import mounts_of
from rollbox.runtime.runtime import Runtime, RuntimeConfig
from rollbox.runtime.spec import ExecRequest, Limits

from .conftest import cgroup_parent

pytestmark = pytest.mark.asyncio(loop_scope="function")


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


async def test_a_cgroup_that_will_not_go_is_logged_counted_and_exported(tmp_path: Path) -> None:
    parent = cgroup_parent()
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
    assert len(records) == 2, [r.getMessage() for r in records]  # the group, then the parent it keeps
    assert [r.levelno for r in records] == [logging.WARNING] * 2
    assert f"cannot remove cgroup {stuck[0].parent}" in records[0].getMessage()
    assert records[0].fields["cgroup"] == group.paths()  # type: ignore[attr-defined]
    assert "parent stays behind" in records[1].getMessage()
    assert records[1].fields["cgroup"] == [str(stuck[0].parent)]  # type: ignore[attr-defined]
    assert b'rollbox_cleanup_failures_total{kind="cgroup"} 1.0' in generate_latest(metrics.registry)


WILD_FORK_BOMB = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"


async def test_a_runtime_closed_right_after_a_fork_bombs_timeout_leaves_no_cgroup(tmp_path: Path) -> None:
    """A CLI run or a test with its own cgroup parent closes its Runtime as soon as a fork bomb's run
    replied (at its deadline, its sandbox still tearing down): close kills whatever is still in the
    sandbox's cgroup (here also a process that would not end with the sandbox: one of the test's,
    moved into its group), waits for it to go, and removes the group and the parent."""
    parent = cgroup_parent("closed")
    rt = Runtime(RuntimeConfig(state_dir=tmp_path, cgroup_parent=parent, pool_max=0))
    await rt.start()
    lingering = None
    try:
        if rt.cgroup_backend is None:
            pytest.skip(f"no cgroup backend here: {rt.cgroup_reason}")
        r = await rt.run(ExecRequest(code=WILD_FORK_BOMB, timeout_s=1.0), limits=Limits(pids_max=512, cpu_max_cores=1.0))
        assert r.timed_out and r.exit_code == 137, r
        groups = [*rt.cgroups.lent, *rt.cgroups.releasing, *rt.cgroups.free]
        assert len(groups) == 1, groups  # the bomb's
        lingering = subprocess.Popen(["sleep", "600"], preexec_fn=lambda: groups[0].attach(os.getpid()))
    finally:
        await rt.close()  # right away
    assert lingering is not None and lingering.wait(timeout=10) == -9
    roots = set(mounts_of("cgroup").values()) | set(mounts_of("cgroup2").values())
    left = [str(Path(r) / parent) for r in roots if (Path(r) / parent).exists()]
    assert not left, f"cgroups left after the runtime closed: {left}"
    assert rt.cleanup_failures["cgroup"] == 0
