"""cgroup v2: one directory per sandbox under a delegated parent with memory, pids and cpu enabled.

CPU: each sandbox's group has cpu.weight 100 (equal, however many processes it runs) and its own
cpu.max (its ``cpu_cores``); the parent's cpu.max caps all sandboxes together at the host's cores
less the supervisor's reserve.
"""

from __future__ import annotations

import os
from pathlib import Path

from rollbox.runtime.isolation.cgroupfs import (
    CLEANUP_BOOST,
    CPU_PERIOD_US,
    RECLAIM_ABOVE_BYTES,
    SANDBOX_WEIGHT_V2,
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
    remove_dir,
    remove_parent,
    sandboxes_cores,
)
from rollbox.runtime.isolation.cgroupfs import read as _read
from rollbox.runtime.isolation.cgroupfs import write as _write

NEEDED = ("memory", "pids", "cpu")


class V2Group:
    def __init__(self, path: Path, enabled: tuple[str, ...] = NEEDED, cap_cores: float | None = None):
        self.path = path
        self.cap_cores = cap_cores  # the parent's cap (a larger cpu.max would not be had anyway)
        self.enabled = enabled
        self.reusable = True
        self.limits: tuple[int, int, float] | None = None  # as last written
        self._procs: list[int] = []
        self._peak_fd: list[int] = []  # memory.peak, opened once
        self.boosted = False  # cpu.weight as last written: boosted for a cleanup, or the equal weight
        self._kept = KeptFiles()
        self._stat_paths = (str(path / "cpu.stat"), str(path / "memory.events"), str(path / "pids.events"),
                            str(path / "pids.peak"))
        self._events_file = str(path / "cgroup.events")  # (read on every release: a string, no Path join)
        self._weight_file = str(path / "cpu.weight")

    def procs_fds(self) -> list[int]:
        if not self._procs:
            self._procs = [open_procs(self.path)]
        return self._procs

    def needs_reclaim(self) -> bool:
        if "memory" not in self.enabled:
            return False
        try:
            return int(_read(self.path / "memory.current")) > RECLAIM_ABOVE_BYTES
        except (OSError, ValueError):
            return False

    def reclaim(self) -> None:
        """Uncharge the page cache the last sandbox left charged to this (emptied) group."""
        try:
            _write(self.path / "memory.reclaim", _read(self.path / "memory.current").strip())
        except OSError:  # EAGAIN when not all of it could be reclaimed: what is left is little
            pass

    def configure(self, memory_bytes: int, pids_max: int, cpu_cores: float) -> None:
        if self.limits == (memory_bytes, pids_max, cpu_cores):
            return  # a reused group with the same limits: nothing to write
        self.limits = None
        if "memory" in self.enabled:
            _write(self.path / "memory.max", str(memory_bytes))
        if "pids" in self.enabled:
            _write(self.path / "pids.max", str(pids_max))
        if "cpu" in self.enabled:
            _write(self.path / "cpu.max", f"{quota_us(self.cpu_cores(cpu_cores))} {CPU_PERIOD_US}")
        self.limits = (memory_bytes, pids_max, cpu_cores)

    def cpu_cores(self, asked: float) -> float:
        """The cpu.max written for ``asked`` cores: at most the parent's cap."""
        return capped_cores(asked, self.cap_cores)

    def paths(self) -> list[str]:
        return [str(self.path)]

    def pids(self) -> list[int]:
        return read_pids(self.path / "cgroup.procs")

    def boost(self, on: bool) -> None:
        if "cpu" in self.enabled and on != self.boosted:
            try:
                _write(self._weight_file, str(SANDBOX_WEIGHT_V2 * (CLEANUP_BOOST if on else 1)))
                self.boosted = on
            except OSError:
                pass

    def is_empty(self) -> bool:
        try:
            return "populated 0" in _read(self._events_file)
        except OSError:
            return False

    def attach(self, pid: int) -> None:
        _write(self.path / "cgroup.procs", str(pid))

    def _peak(self) -> int:
        """This group's memory.peak through its own fd: since Linux 6.12 a reset applies to reads
        through the fd that wrote it, not to other readers."""
        if not self._peak_fd:
            self._peak_fd.append(os.open(self.path / "memory.peak", os.O_RDWR | os.O_CLOEXEC))
        return self._peak_fd[0]

    def stats(self) -> CgroupStats:
        try:
            peak = int(os.pread(self._peak(), 64, 0)) if "memory" in self.enabled else 0
        except (OSError, ValueError):
            peak = 0
        cpu_stat, memory_events, pids_events, pids_peak = self._stat_paths
        return CgroupStats(
            cpu_s=self._kept.read_kv(cpu_stat).get("usage_usec", 0) / 1e6,
            peak_memory_bytes=peak,
            oom_kills=self._kept.read_kv(memory_events).get("oom_kill", 0),
            pids_max_hits=self._kept.read_kv(pids_events).get("max", 0),
            pids_peak=read_peak(self._kept, pids_peak) if "pids" in self.enabled else -1,
        )

    def pids_peak(self) -> int:
        return read_peak(self._kept, str(self.path / "pids.peak"))

    def reset_peak(self) -> None:
        try:
            os.write(self._peak(), b"0")  # resettable since Linux 6.12, for this fd's reads
        except OSError:
            self.reusable = False  # its peak would carry the last sandbox's: never hand it on

    def unthrottle(self) -> None:
        self.limits = None  # (configure writes them all again)
        if "cpu" in self.enabled:
            try:
                _write(self.path / "cpu.max", f"max {CPU_PERIOD_US}")  # (the parent's cap still holds)
            except OSError:
                pass
        self.boost(True)

    def kill(self) -> None:
        try:
            _write(self.path / "cgroup.kill", "1")  # (since Linux 5.14)
        except OSError:
            kill_procs(self.path / "cgroup.procs")

    def close(self) -> None:
        """Kill what is left in the group and remove it; OSError (naming it) if it stays."""
        close_fds(self._procs)
        close_fds(self._peak_fd)
        self._kept.close()
        self.kill()
        remove_dir(self.path)


class V2:
    name = "v2"

    def __init__(self, parent: str, require: tuple[str, ...] = NEEDED, reserved_cores: float = 0.0):
        roots = mounts_of("cgroup2")
        if "" not in roots:
            raise OSError("no cgroup2 hierarchy is mounted")
        root = self.root = Path(roots[""])
        self.parent = root / parent
        probe = self.parent if self.parent.is_dir() else root
        available = set((probe / "cgroup.controllers").read_text().split())
        missing = [c for c in require if c not in available]
        if missing:
            raise OSError(f"cgroup v2 at {self.parent} lacks controllers {missing} (has {sorted(available)})")
        self.parent.mkdir(exist_ok=True)
        enable = " ".join(f"+{c}" for c in require)
        if enable:
            _write(self.parent / "cgroup.subtree_control", enable)
        self.enabled = require
        self.cpu = self._cap(reserved_cores)

    def _cap(self, reserved_cores: float) -> CpuPolicy:
        """Cap the parent at the host's cores less the reserve (its cpu.max)."""
        available = available_cores(self.parent, self.root)
        if "cpu" not in self.enabled:
            return CpuPolicy(None, reserved_cores, available, "none", "the cpu controller is not enabled")
        cap = sandboxes_cores(available, reserved_cores)
        try:
            _write(self.parent / "cpu.max", f"{quota_us(cap)} {CPU_PERIOD_US}")
        except OSError as exc:
            return CpuPolicy(None, reserved_cores, available, f"cpu.weight {SANDBOX_WEIGHT_V2}",
                             f"cannot write {self.parent}/cpu.max: {exc.strerror or exc}")
        return CpuPolicy(cap, reserved_cores, available, f"cpu.weight {SANDBOX_WEIGHT_V2}")

    def prepare(self, name: str, memory_bytes: int, pids_max: int, cpu_cores: float) -> V2Group:
        d = self.parent / name
        try:
            d.mkdir()
        except FileNotFoundError:  # another runtime sharing the parent removed it on close
            self.parent.mkdir(exist_ok=True)
            _write(self.parent / "cgroup.subtree_control", " ".join(f"+{c}" for c in self.enabled))
            d.mkdir()
            self.cpu = self._cap(self.cpu.reserved_cores)
        group = V2Group(d, self.enabled, self.cpu.cap_cores)
        if "memory" in self.enabled and (d / "memory.swap.max").exists():
            _write(d / "memory.swap.max", "0")
        if "cpu" in self.enabled:
            _write(d / "cpu.weight", str(SANDBOX_WEIGHT_V2))
        group.configure(memory_bytes, pids_max, cpu_cores)
        return group

    def leftovers(self) -> list[str]:
        return [str(d) for d in self.parent.iterdir() if d.is_dir()] if self.parent.is_dir() else []

    def close(self) -> list[str]:
        return remove_parent(self.parent)
