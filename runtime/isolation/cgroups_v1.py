"""cgroup v1: one directory per sandbox in each of the memory, pids, cpu and cpuacct hierarchies.

CPU: each sandbox's group has cpu.shares 1024 (equal, however many processes it runs) and its own
CFS quota (its ``cpu_cores``); the parent's CFS quota caps all sandboxes together at the host's
cores less the supervisor's reserve. v1 refuses a child quota above its parent's (EINVAL), so a
sandbox's quota is at most the parent's.
"""

from __future__ import annotations

import os
from pathlib import Path

from rollbox.runtime.isolation.cgroupfs import (
    CLEANUP_BOOST,
    CPU_PERIOD_US,
    RECLAIM_ABOVE_BYTES,
    SANDBOX_SHARES_V1,
    CgroupStats,
    CpuPolicy,
    KeptFiles,
    available_cores,
    capped_cores,
    close_fds,
    kill_procs,
    mounts_of,
    open_procs,
    quota_us,
    read_peak,
    read_pids,
    remove_dirs,
    remove_parent,
    sandboxes_cores,
)
from rollbox.runtime.isolation.cgroupfs import read as _read
from rollbox.runtime.isolation.cgroupfs import write as _write

CONTROLLERS = ("memory", "pids", "cpu", "cpuacct")


class V1Group:
    """The cgroups of one sandbox (created by ``prepare``, populated by ``attach``, removed by ``close``)."""

    def __init__(self, dirs: dict[str, Path], cap_cores: float | None = None):
        self.dirs = dirs
        self.cap_cores = cap_cores  # the parent's cap: a quota above it is refused
        self.unique = list(dict.fromkeys(dirs.values()))  # co-mounted controllers (cpu,cpuacct) share one
        self.reusable = True
        self.limits: tuple[int, int, float] | None = None  # as last written
        self.swap_limited = False  # memory.memsw (memory+swap) written too: needs swap accounting
        self.boosted = False  # cpu.shares as last written: boosted for a cleanup, or the equal share
        self._procs: list[int] = []
        self._kept = KeptFiles()
        mem = dirs["memory"]
        self._stat_paths = (str(mem / "memory.oom_control"), str(mem / "memory.max_usage_in_bytes"),
                            str(dirs["cpuacct"] / "cpuacct.usage") if "cpuacct" in dirs else "",
                            str(dirs["pids"] / "pids.events"), str(dirs["pids"] / "pids.peak"))
        # files written or read on every step, as strings (a Path join per call showed in profiles)
        self._peak_file = str(mem / "memory.max_usage_in_bytes")
        self._procs_file = str(dirs["pids"] / "cgroup.procs")
        self._shares_file = str(dirs["cpu"] / "cpu.shares")

    def procs_fds(self) -> list[int]:
        if not self._procs:
            self._procs = [open_procs(d) for d in self.unique]
        return self._procs

    def needs_reclaim(self) -> bool:
        try:
            return int(_read(self.dirs["memory"] / "memory.usage_in_bytes")) > RECLAIM_ABOVE_BYTES
        except (OSError, ValueError):
            return False

    def reclaim(self) -> None:
        """Uncharge the page cache the last sandbox left charged to this (emptied) group, so the next
        one starts from zero (its limit and its peak are its own). Slow-ish: off the event loop."""
        try:
            _write(self.dirs["memory"] / "memory.force_empty", "0")
        except OSError:
            pass

    def configure(self, memory_bytes: int, pids_max: int, cpu_cores: float) -> None:
        m = self.dirs["memory"]
        if self.limits == (memory_bytes, pids_max, cpu_cores):
            return  # a reused group with the same limits: nothing to write
        self.limits = None
        memsw = m / "memory.memsw.limit_in_bytes"
        # memory+swap may never be below memory: raise it first, then set memory, then match them.
        for path in (memsw, m / "memory.limit_in_bytes", memsw):
            try:
                _write(path, str(memory_bytes))
                self.swap_limited = path == memsw
            except OSError:
                if path.name == "memory.limit_in_bytes":
                    raise
                self.swap_limited = False
        _write(self.dirs["pids"] / "pids.max", str(pids_max))
        _write(self.dirs["cpu"] / "cpu.cfs_quota_us", str(quota_us(self.cpu_cores(cpu_cores))))
        self.limits = (memory_bytes, pids_max, cpu_cores)

    def cpu_cores(self, asked: float) -> float:
        """The quota written for ``asked`` cores: at most the parent's cap."""
        return capped_cores(asked, self.cap_cores)

    def paths(self) -> list[str]:
        return [str(d) for d in self.unique]

    def pids(self) -> list[int]:
        return read_pids(self.dirs["pids"] / "cgroup.procs")

    def boost(self, on: bool) -> None:
        if on == self.boosted:
            return
        try:
            _write(self._shares_file, str(SANDBOX_SHARES_V1 * (CLEANUP_BOOST if on else 1)))
            self.boosted = on
        except OSError:
            pass

    def unthrottle(self) -> None:
        self.limits = None  # (configure writes them all again)
        try:
            _write(self.dirs["cpu"] / "cpu.cfs_quota_us",
                   str(quota_us(self.cap_cores)) if self.cap_cores is not None else "-1")
        except OSError:
            pass
        self.boost(True)

    def kill(self) -> None:
        kill_procs(self._procs_file)

    def is_empty(self) -> bool:
        try:
            return not _read(self._procs_file).strip()
        except OSError:
            return False

    def attach(self, pid: int) -> None:
        for d in self.unique:
            _write(d / "cgroup.procs", str(pid))

    def stats(self) -> CgroupStats:
        oom_control, max_usage, usage, pids_events, pids_peak = self._stat_paths
        oom = self._kept.read_kv(oom_control).get("oom_kill", 0)
        try:
            peak = int(self._kept.read(max_usage))
        except (OSError, ValueError):
            peak = 0
        try:
            cpu_ns = int(self._kept.read(usage))
        except (OSError, ValueError):
            cpu_ns = 0
        pids_max_hits = self._kept.read_kv(pids_events).get("max", 0)
        return CgroupStats(cpu_s=cpu_ns / 1e9, peak_memory_bytes=peak, oom_kills=oom, pids_max_hits=pids_max_hits,
                           pids_peak=read_peak(self._kept, pids_peak))

    def pids_peak(self) -> int:
        return read_peak(self._kept, str(self.dirs["pids"] / "pids.peak"))

    def reset_peak(self) -> None:
        try:
            _write(self._peak_file, "0")
        except OSError:
            pass

    def close(self) -> None:
        """Kill what is left in the group and remove its directories; OSError (naming each that
        stayed) if any could not be."""
        close_fds(self._procs)
        self._kept.close()
        self.kill()
        remove_dirs(self.unique)


class V1:
    name = "v1"

    def __init__(self, parent: str, reserved_cores: float = 0.0):
        roots = mounts_of("cgroup")
        self.roots = roots
        self.parents: dict[str, Path] = {}
        for ctrl in CONTROLLERS:
            if ctrl not in roots:
                raise OSError(f"cgroup v1 controller {ctrl!r} is not mounted")
            self.parents[ctrl] = Path(roots[ctrl]) / parent
        for p in self.parents.values():
            p.mkdir(exist_ok=True)
            if not os.access(p, os.W_OK):
                raise PermissionError(f"{p}: not writable (no delegated cgroup)")
        self.cpu = self._cap(reserved_cores)

    def _cap(self, reserved_cores: float) -> CpuPolicy:
        """Cap the parent at the host's cores less the reserve (best effort: a parent shared with a
        runtime whose sandboxes have larger quotas refuses a smaller one)."""
        cpu = self.parents["cpu"]
        available = available_cores(cpu, Path(self.roots["cpu"]))
        cap = sandboxes_cores(available, reserved_cores)
        weight = f"cpu.shares {SANDBOX_SHARES_V1}"
        try:
            _write(cpu / "cpu.cfs_period_us", str(CPU_PERIOD_US))
            _write(cpu / "cpu.cfs_quota_us", str(quota_us(cap)))
        except OSError as exc:
            return CpuPolicy(None, reserved_cores, available, weight,
                             f"cannot write {cpu}/cpu.cfs_quota_us: {exc.strerror or exc}")
        return CpuPolicy(cap, reserved_cores, available, weight)

    def prepare(self, name: str, memory_bytes: int, pids_max: int, cpu_cores: float) -> V1Group:
        dirs = {c: p / name for c, p in self.parents.items()}
        for d in dict.fromkeys(dirs.values()):
            try:
                d.mkdir()
            except FileNotFoundError:  # another runtime sharing the parent removed it on close
                d.parent.mkdir(exist_ok=True)
                d.mkdir()
                self.cpu = self._cap(self.cpu.reserved_cores)
        try:
            _write(dirs["memory"] / "memory.swappiness", "0")
        except OSError:
            pass
        _write(dirs["cpu"] / "cpu.cfs_period_us", str(CPU_PERIOD_US))
        _write(dirs["cpu"] / "cpu.shares", str(SANDBOX_SHARES_V1))
        group = V1Group(dirs, self.cpu.cap_cores)
        group.configure(memory_bytes, pids_max, cpu_cores)
        return group

    def leftovers(self) -> list[str]:
        return [str(d) for p in dict.fromkeys(self.parents.values()) if p.is_dir() for d in p.iterdir() if d.is_dir()]

    def close(self) -> list[str]:
        return [d for p in dict.fromkeys(self.parents.values()) for d in remove_parent(p)]
