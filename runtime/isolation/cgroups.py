"""cgroups: pick v2 or v1 at run time (v2 where its controllers are delegated, else v1, else none).

The backends (cgroups_v1.py, cgroups_v2.py) build on the shared cgroup files code in cgroupfs.py,
re-exported here; the cgroups of sandboxes are made, lent, taken back and removed by
``cgroup_pool.CgroupPool`` alone.
"""

from __future__ import annotations

import os

from rollbox.runtime.isolation.cgroupfs import (
    CLEANUP_BOOST,
    CPU_PERIOD_US,
    MIN_SANDBOXES_CORES,
    RECLAIM_ABOVE_BYTES,
    SANDBOX_SHARES_V1,
    SANDBOX_WEIGHT_V2,
    Backend,
    CgroupStats,
    CpuPolicy,
    Group,
    KeptFiles,
    available_cores,
    capped_cores,
    close_fds,
    host_cores,
    mounts_of,
    open_procs,
    parse_kv,
    quota_us,
    read,
    read_kv,
    read_peak,
    read_pids,
    remove_dir,
    remove_dirs,
    sandboxes_cores,
    write,
)
from rollbox.runtime.isolation.cgroups_v1 import V1
from rollbox.runtime.isolation.cgroups_v2 import V2

__all__ = [
    "CLEANUP_BOOST",
    "CPU_PERIOD_US",
    "MIN_SANDBOXES_CORES",
    "RECLAIM_ABOVE_BYTES",
    "SANDBOX_SHARES_V1",
    "SANDBOX_WEIGHT_V2",
    "V1",
    "V2",
    "Backend",
    "CgroupStats",
    "CpuPolicy",
    "Group",
    "KeptFiles",
    "available_cores",
    "capped_cores",
    "close_fds",
    "default_parent",
    "host_cores",
    "mounts_of",
    "open_procs",
    "parse_kv",
    "quota_us",
    "read",
    "read_kv",
    "read_peak",
    "read_pids",
    "remove_dir",
    "remove_dirs",
    "sandboxes_cores",
    "select",
    "write",
]


def select(parent: str, prefer: str = "auto", reserved_cores: float = 0.0) -> tuple[Backend | None, str]:
    """The cgroup backend to use and why. ``prefer`` is auto | v1 | v2 | none. ``reserved_cores``:
    CPU kept from the sandboxes for the supervisor (the parent group's cap is the rest)."""
    reasons: list[str] = []
    order = {"auto": ("v2", "v1"), "v1": ("v1",), "v2": ("v2",), "none": ()}[prefer]
    for kind in order:
        try:
            backend: Backend = (V2(parent, reserved_cores=reserved_cores) if kind == "v2"
                                else V1(parent, reserved_cores=reserved_cores))
            skipped = f" (not {'; '.join(reasons)})" if reasons else ""
            return backend, f"cgroup {kind} at {parent}{skipped}"
        except OSError as exc:
            reasons.append(f"{kind}: {exc}")
    return None, "; ".join(reasons) or "disabled"


def default_parent() -> str:
    """``rollbox`` (``rollbox-UID`` rootless), or ROLLBOX_CGROUP_PARENT: installations sharing a host
    that should not share the sandboxes' CPU cap (benchmarks beside other runtimes)."""
    return os.environ.get("ROLLBOX_CGROUP_PARENT") or ("rollbox" if os.geteuid() == 0 else f"rollbox-{os.geteuid()}")
