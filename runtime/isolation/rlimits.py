"""Rlimits: per-process ceilings set before untrusted code runs (stdlib only)."""

from __future__ import annotations

import os
import resource

# Without a cgroup, every process of a sandbox runs at this nice value: where they compete with the
# supervisor one by one (no autogroup, or the same one), the supervisor keeps ~9x a sandbox process's share.
FALLBACK_NICE = 10
# Without a cgroup, RLIMIT_DATA leaves shared mappings (MAP_SHARED anonymous memory, memfds) uncounted:
# the address space is capped too, this far above the memory limit, as a backstop only. A JVM sized to a
# 1 GiB limit peaks at ~3.1 GiB of address space; V8 and lld ran under limit + 256 MiB.
AS_BACKSTOP_BYTES = 4 << 30


def apply(nofile: int, fsize_bytes: int, nproc: int | None = None, data_bytes: int | None = None,
          nice: int | None = None, as_bytes: int | None = None) -> None:
    """core 0, nofile, fsize; nproc, data and a raised nice value only where cgroups cannot limit pids,
    memory and CPU. Memory is RLIMIT_DATA, not RLIMIT_AS: since Linux 4.7 it counts the private writable
    mappings (brk and anonymous mmap: the memory a program fills), not the ranges it only reserves
    (PROT_NONE), so a JVM, V8 or lld that reserves gigabytes of address space still starts. ``as_bytes``:
    the address-space backstop for what RLIMIT_DATA does not count (shared mappings), far above it."""
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))
    resource.setrlimit(resource.RLIMIT_FSIZE, (fsize_bytes, fsize_bytes))
    if nproc is not None:
        resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
    if data_bytes is not None:
        resource.setrlimit(resource.RLIMIT_DATA, (data_bytes, data_bytes))
    if as_bytes is not None:
        resource.setrlimit(resource.RLIMIT_AS, (as_bytes, as_bytes))
    if nice is not None:
        os.setpriority(os.PRIO_PROCESS, 0, max(nice, os.getpriority(os.PRIO_PROCESS, 0)))  # never lowered
