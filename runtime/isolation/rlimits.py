"""Rlimits: per-process ceilings set before untrusted code runs (stdlib only)."""

from __future__ import annotations

import resource


def apply(nofile: int, fsize_bytes: int, nproc: int | None = None, as_bytes: int | None = None) -> None:
    """core 0, nofile, fsize; nproc and address space only where cgroups cannot limit pids/memory."""
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))
    resource.setrlimit(resource.RLIMIT_FSIZE, (fsize_bytes, fsize_bytes))
    if nproc is not None:
        resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
    if as_bytes is not None:
        resource.setrlimit(resource.RLIMIT_AS, (as_bytes, as_bytes))
