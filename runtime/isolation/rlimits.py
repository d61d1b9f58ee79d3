"""Rlimits: per-process ceilings set before untrusted code runs (stdlib only)."""

from __future__ import annotations

import os
import resource

# Without a cgroup, every process of a sandbox runs at this nice value: where they compete with the
# supervisor one by one (no autogroup, or the same one), the supervisor keeps ~9x a sandbox process's share.
FALLBACK_NICE = 10


def apply(nofile: int, fsize_bytes: int, nproc: int | None = None, as_bytes: int | None = None,
          nice: int | None = None) -> None:
    """core 0, nofile, fsize; nproc, address space and a raised nice value only where cgroups cannot
    limit pids, memory and CPU."""
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))
    resource.setrlimit(resource.RLIMIT_FSIZE, (fsize_bytes, fsize_bytes))
    if nproc is not None:
        resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
    if as_bytes is not None:
        resource.setrlimit(resource.RLIMIT_AS, (as_bytes, as_bytes))
    if nice is not None:
        os.setpriority(os.PRIO_PROCESS, 0, max(nice, os.getpriority(os.PRIO_PROCESS, 0)))  # never lowered
