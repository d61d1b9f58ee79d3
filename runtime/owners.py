"""Who made a leftover, and clearing what a dead runtime left.

Every sandbox cgroup, zygote staging directory and fork scratch layer a runtime makes is named
after its owner: ``<pid>.<start time>-...``, the start time being the process's (field 22 of
``/proc/<pid>/stat``, clock ticks since boot). An owner is alive only if that pid runs now *and*
started then *and* is not a zombie: a dead server's pid that is a zombie (its parent has not
reaped it yet) or was reused by another process does not keep its leftovers alive.

``sweep`` removes a dead owner's leftovers: a cgroup that still holds processes (a sandbox that
outlived its server) has them killed first (``cgroup.kill``, or SIGKILL to each after thawing its
freezer) and is removed on a later sweep once they are gone. Names without a start time (older
versions: ``<pid>-...``) are judged by the pid alone, zombies counted dead.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import os
import shutil
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from rollbox.runtime.isolation.cgroupfs import kill_procs

__all__ = ["Sweep", "alive", "owner_of", "tag"]

log = logging.getLogger("rollbox.runtime")


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, start time) of a live-or-zombie pid, None if there is none."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read().decode(errors="replace")
    except OSError:  # gone (or not ours to read)
        return None
    fields = raw[raw.rindex(")") + 2:].split()  # after "pid (comm) ": state is field 3
    return fields[0], int(fields[19])


@functools.cache
def tag() -> str:
    """This process's owner tag."""
    st = _stat(os.getpid())
    return f"{os.getpid()}.{st[1] if st else 0}"


def owner_of(name: str) -> str | None:
    """The owner tag a leftover's name starts with (``<pid>.<start>`` or, older, ``<pid>``)."""
    head = name.removeprefix("scratch-").split("-", 1)[0]
    pid, _, start = head.partition(".")
    if not pid.isdigit() or (start and not start.isdigit()):
        return None
    return head


def alive(owner: str) -> bool:
    if owner == tag():
        return True
    pid, _, start = owner.partition(".")
    st = _stat(int(pid))
    if st is None or st[0] in ("Z", "X", "x"):
        return False
    return not start or int(start) == st[1]


@dataclass
class Sweep:
    """Clears dead owners' leftovers, again and again (``run``): what cannot go yet is retried, and
    each failure is logged once."""

    removed: int = 0
    failed: int = 0  # leftovers a sweep could not remove (each counted once)
    _reported: set[str] = field(default_factory=set)
    # other owners whose things the last sweep found and left alone: when one of them dies, sweep again
    _watched: frozenset[str] = frozenset()

    def run(self, cgroups: Iterable[str], dirs: Iterable[Path], trees: Iterable[Path]) -> int:
        """Remove dead owners' ``cgroups`` (paths), empty ``dirs`` and whole ``trees``; returns how
        many of them remain. Live owners' are left alone (and watched: ``owner_died``)."""
        left = 0
        living: set[str] = set()

        def dead(owner: str | None) -> bool:
            if owner is None or owner in living:
                return False
            if alive(owner):
                living.add(owner)
                return False
            return True

        for path in cgroups:
            if dead(owner_of(os.path.basename(path))) and not self._rmdir_cgroup(path):
                left += 1
        for d in dirs:
            if dead(owner_of(d.name)) and not self._remove(d, d.rmdir):
                left += 1
        for t in trees:
            if dead(owner_of(t.name)) and not self._remove(t, functools.partial(_rmtree, t)):
                left += 1
        self._watched = frozenset(living - {tag()})
        return left

    def owner_died(self) -> bool:
        """Whether an owner whose things the last sweep left alone has died since (another runtime
        on the same host or home, killed after this one started): its things are due now, not at the
        next periodic sweep. One /proc read per such owner."""
        return any(not alive(owner) for owner in self._watched)

    def _rmdir_cgroup(self, path: str) -> bool:
        try:
            os.rmdir(path)
        except FileNotFoundError:
            return True
        except OSError as exc:
            if exc.errno == errno.EBUSY:  # processes still in it: end them, remove it next time
                _kill_all(path)
                return False
            self._failed(path, exc)
            return False
        self.removed += 1
        self._reported.discard(path)
        return True

    def _remove(self, path: Path, how: Callable[[], object]) -> bool:
        try:
            how()
        except FileNotFoundError:
            return True
        except OSError as exc:
            self._failed(str(path), exc)
            return False
        self.removed += 1
        self._reported.discard(str(path))
        return True

    def _failed(self, path: str, exc: OSError) -> None:
        if path not in self._reported:
            self._reported.add(path)
            self.failed += 1
            log.warning("cannot remove %s, left by a runtime that died: %s (retried)", path,
                        exc.strerror or exc)


def _rmtree(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)


def _kill_all(cgroup: str) -> None:
    """SIGKILL every process in a dead owner's cgroup (v2: ``cgroup.kill``; v1: thaw, then each pid,
    again while new ones appear: a process forked just before its parent was killed)."""
    kill = os.path.join(cgroup, "cgroup.kill")
    if os.path.exists(kill):
        with contextlib.suppress(OSError):
            Path(kill).write_text("1")
            return
    freezer = os.path.join(cgroup, "freezer.state")
    if os.path.exists(freezer):
        with contextlib.suppress(OSError):
            Path(freezer).write_text("THAWED")
    kill_procs(os.path.join(cgroup, "cgroup.procs"), max_passes=20)
