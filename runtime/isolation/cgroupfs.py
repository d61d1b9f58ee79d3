"""cgroup files: what the v1 and v2 backends share (reading and writing cgroup files, the CPU policy,
stats, and the ``Group`` and ``Backend`` interfaces). ``cgroups.select`` picks a backend."""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

# An emptied group still charged with more than this (page cache its last sandbox read) is reclaimed
# before reuse. Less is kernel memory of the dead sandbox (its network namespace, say) that the kernel
# frees on its own within a second (measured: 40-130 KiB right after a one-shot run).
RECLAIM_ABOVE_BYTES = 1 << 20

# CPU: every sandbox's group gets the same weight, whatever it runs (a fork bomb's thousand processes
# share one sandbox's weight), and the parent of them all is capped at the host's cores less a reserve
# kept for the supervisor (the server, its zygotes), so it can always enforce timeouts and answer.
CPU_PERIOD_US = 100_000
SANDBOX_SHARES_V1 = 1024  # cpu.shares (the v1 default, written explicitly)
SANDBOX_WEIGHT_V2 = 100  # cpu.weight (the v2 default, written explicitly)
MIN_SANDBOXES_CORES = 0.1  # the parent's cap never goes below this, whatever the reserve
# While a timed-out step's killed processes exit (tearing down their memory is CPU charged to the
# sandbox) and its init reaps them, the sandbox's weight is raised this many times: nothing of the
# step runs any more, and the sandbox's next step does not wait behind every other sandbox for it.
CLEANUP_BOOST = 16


def host_cores() -> int:
    """CPUs this process may run on (its affinity mask: what a container was given, not the host's)."""
    return len(os.sched_getaffinity(0))


def _quota_cores(directory: Path) -> float | None:
    """The CFS quota of one cgroup in CPUs (v2 cpu.max, v1 cpu.cfs_quota_us), None if it has none."""
    try:
        q, _, period = read(directory / "cpu.max").partition(" ")
        return None if q == "max" else int(q) / int(period)
    except (OSError, ValueError):
        pass
    try:
        q = read(directory / "cpu.cfs_quota_us").strip()
        return None if q.startswith("-") else int(q) / int(read(directory / "cpu.cfs_period_us"))
    except (OSError, ValueError):
        return None


def available_cores(directory: Path, root: Path) -> float:
    """The CPU the cgroups above ``directory`` (up to ``root``, its hierarchy's mount point) let it
    use: this process's CPUs, or less where an ancestor has a quota (a container's CPU limit)."""
    best = float(host_cores())
    d = directory
    while d != root and d.parent != d:
        d = d.parent
        q = _quota_cores(d)
        if q is not None:
            best = min(best, q)
    return best


def sandboxes_cores(available: float, reserved_cores: float) -> float:
    """The CPU every sandbox together may use: what is available less ``reserved_cores``."""
    return max(MIN_SANDBOXES_CORES, available - reserved_cores)


def capped_cores(asked: float, cap_cores: float | None) -> float:
    """The CPU a sandbox asking for ``asked`` cores gets under a parent capped at ``cap_cores``."""
    return asked if cap_cores is None else min(asked, cap_cores)


def quota_us(cores: float) -> int:
    """A CFS quota per CPU_PERIOD_US for ``cores`` CPUs (the kernel's minimum is 1 ms)."""
    return max(1000, int(cores * CPU_PERIOD_US))


@dataclass(frozen=True)
class CpuPolicy:
    """What the backend wrote for CPU: the cap on all sandboxes together (None if it could not be
    written, with why), and the equal weight each sandbox's group gets."""

    cap_cores: float | None
    reserved_cores: float
    available_cores: float  # this process's CPUs, or an ancestor group's quota if smaller
    weight: str  # "cpu.shares 1024" / "cpu.weight 100", or why there is none
    error: str = ""


@dataclass(frozen=True)
class CgroupStats:
    cpu_s: float
    peak_memory_bytes: int
    oom_kills: int
    pids_max_hits: int
    pids_peak: int = -1  # the most processes it held at once (pids.peak, never reset), -1 if unknown


class Group(Protocol):
    reusable: bool  # False if a new sandbox could not start from clean counters in it

    def configure(self, memory_bytes: int, pids_max: int, cpu_cores: float) -> None: ...
    def is_empty(self) -> bool: ...
    def paths(self) -> list[str]: ...
    def attach(self, pid: int) -> None: ...
    def procs_fds(self) -> list[int]: ...
    def needs_reclaim(self) -> bool: ...
    def reclaim(self) -> None: ...
    def stats(self) -> CgroupStats: ...
    def reset_peak(self) -> None: ...
    def cpu_cores(self, asked: float) -> float:
        """The CPU a sandbox asking for ``asked`` cores is given here (at most the parent's cap)."""
        ...
    def pids(self) -> list[int]:
        """Host pids of every process in the group now (its cgroup.procs)."""
        ...
    def pids_peak(self) -> int:
        """The most processes the group ever held at once (pids.peak), -1 where the kernel has none."""
        ...
    def boost(self, on: bool) -> None:
        """Raise the group's CPU weight CLEANUP_BOOST times (on) or set it back (off); best effort."""
        ...
    def unthrottle(self) -> None:
        """Its sandbox has ended and what is left in it only exits (a fork bomb's processes tearing
        down their memory: seconds of CPU): its own CPU quota is lifted to the parent's cap and its
        weight raised (``boost``), so those exits are not held to the sandbox's share. Before the
        group is lent again ``configure`` writes its limits and ``boost(False)`` its weight."""
        ...
    def kill(self) -> None:
        """SIGKILL every process in the group (v2: cgroup.kill; v1: each one listed, again while new
        ones appear); best effort."""
        ...
    def close(self) -> None:
        """Kill what is left in the group and remove it; raises OSError naming what stayed (a process
        that would not leave, a child group)."""
        ...


class Backend(Protocol):
    name: str
    cpu: CpuPolicy

    def prepare(self, name: str, memory_bytes: int, pids_max: int, cpu_cores: float) -> Group: ...
    def leftovers(self) -> list[str]: ...
    def close(self) -> list[str]:
        """Remove the parent of the sandboxes' groups; returns the groups that keep it (another
        runtime's, or one that would not go), [] once it is gone."""
        ...


def write(path: Path | str, value: str) -> None:
    """One write to a cgroup file (three syscalls: no buffered text file around it)."""
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


def read(path: Path | str) -> str:
    """A small cgroup file's text (three syscalls)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return os.read(fd, 1 << 16).decode()
    finally:
        os.close(fd)


def close_fds(fds: list[int]) -> None:
    """Close the fds a group keeps (its cgroup.procs files, say) and empty the list."""
    while fds:
        os.close(fds.pop())


def remove_dir(path: Path) -> None:
    """rmdir a cgroup, retrying for about 4 s while its last tasks finish exiting (EBUSY); gone
    already is fine. Raises OSError naming the cgroup (and the processes still in it) if it stays."""
    t0 = time.monotonic()
    for attempt in range(200):
        try:
            os.rmdir(path)
            return
        except FileNotFoundError:
            return
        except OSError as exc:
            if exc.errno != errno.EBUSY or attempt == 199:
                try:
                    left = " ".join(read(Path(path) / "cgroup.procs").split()) or "none"
                except OSError:
                    left = "unknown"
                raise OSError(exc.errno, f"cannot remove cgroup {path}: {exc.strerror} (tried {attempt + 1} times "
                              f"over {time.monotonic() - t0:.1f} s; processes still in it: {left})") from exc
            time.sleep(0.001 * min(attempt + 1, 20))


def remove_dirs(paths: list[Path]) -> None:
    """``remove_dir`` each of ``paths`` (one sandbox's cgroups in several v1 hierarchies); every one is
    tried, then one OSError names all that stayed."""
    failed: list[OSError] = []
    for path in paths:
        try:
            remove_dir(path)
        except OSError as exc:
            failed.append(exc)
    if failed:
        raise OSError(failed[0].errno, "; ".join(str(e.strerror) for e in failed))


def open_procs(directory: Path) -> int:
    """An fd of a cgroup's cgroup.procs, opened for writing by the supervisor. The kernel checks the
    opener's credentials, so a sandbox given it moves itself in (writes "0") at its very start, and
    the supervisor's event loop never waits on a migration."""
    return os.open(directory / "cgroup.procs", os.O_WRONLY | os.O_CLOEXEC)


def read_kv(path: Path) -> dict[str, int]:
    """A cgroup 'key value' file (memory.events, pids.events, cpu.stat ...) as ints; {} if unreadable."""
    try:
        return parse_kv(read(path))
    except OSError:
        return {}


def parse_kv(text: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for line in text.splitlines():
        k, _, v = line.partition(" ")
        if v.strip().lstrip("-").isdigit():
            out[k] = int(v)
    return out


class KeptFiles:
    """Files a group reads at every step (its stats), each opened once and then read with one pread at
    offset 0 (cgroup files are generated afresh on each read from the start): one syscall per read
    instead of three, on the event loop's thread, where each one is a chance to lose the GIL."""

    def __init__(self) -> None:
        self._fds: dict[str, int] = {}

    def read(self, path: str) -> str:
        fd = self._fds.get(path)
        if fd is None:
            fd = self._fds[path] = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        return os.pread(fd, 1 << 16, 0).decode()

    def read_kv(self, path: str) -> dict[str, int]:
        """``read_kv`` of a kept file; {} if unreadable."""
        try:
            return parse_kv(self.read(path))
        except OSError:
            return {}

    def close(self) -> None:
        while self._fds:
            os.close(self._fds.popitem()[1])


def mounts_of(fstype: str) -> dict[str, str]:
    """Mount points of cgroup hierarchies: v1 by controller name, v2 under the key ''."""
    out: dict[str, str] = {}
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields = left.split()
            rfields = right.split()
            if not rfields or rfields[0] != fstype:
                continue
            point = fields[4]
            if fstype == "cgroup2":
                out.setdefault("", point)
                continue
            for opt in rfields[2].split(","):
                if opt in ("memory", "pids", "cpu", "cpuacct", "freezer"):
                    out.setdefault(opt, point)
    return out


def read_peak(kept: KeptFiles, path: str) -> int:
    """A group's pids.peak (the most processes it held at once; never reset), -1 where the kernel has none."""
    try:
        return int(kept.read(path))
    except (OSError, ValueError):
        return -1


def kill_while_new(list_pids: Callable[[], Iterable[int]], max_passes: int = 100) -> int:
    """SIGKILL every process ``list_pids()`` names, again while new ones appear (a process forked just
    before its parent was killed; a killed one cannot fork). Returns how many were signalled."""
    seen: set[int] = set()
    for _ in range(max_passes):
        new = [p for p in list_pids() if p not in seen]
        if not new:
            break
        for p in new:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(p, signal.SIGKILL)
        seen.update(new)
    return len(seen)


def kill_procs(path: Path | str, max_passes: int = 100) -> int:
    """SIGKILL every process listed in a cgroup.procs file (``kill_while_new``)."""
    return kill_while_new(lambda: read_pids(Path(path)), max_passes)


def has_children(paths: list[str]) -> bool:
    """Whether any of a group's directories has a child cgroup (its removal then fails with EBUSY
    however long it is retried)."""
    for path in paths:
        try:
            with os.scandir(path) as it:
                if any(e.is_dir(follow_symlinks=False) for e in it):
                    return True
        except OSError:
            continue
    return False


def remove_parent(path: Path) -> list[str]:
    """rmdir the parent of sandbox groups; the child groups that keep it, [] if it is gone."""
    try:
        os.rmdir(path)
    except FileNotFoundError:
        pass
    except OSError:
        try:
            with os.scandir(path) as it:
                return sorted(e.path for e in it if e.is_dir(follow_symlinks=False))
        except OSError:
            return []
    return []


def read_pids(path: Path) -> list[int]:
    """The pids listed in a cgroup.procs file ([] if it cannot be read: the group is gone)."""
    try:
        return [int(p) for p in read(path).split()]
    except (OSError, ValueError):
        return []
