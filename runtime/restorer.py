"""The restorer: where a runtime's sandboxes are made.

One warm source (a zygote) per snapshot recipe, started on first use (the cold path); per sandbox:
a cgroup from the pool, a user namespace of its own where the host gives one (``slots``), the spawn
(the containment checklist runs in the child, runtime/inside/zygote.py), and the handshake: its
READY, host pid, pidfd and upper layer. What its first sandboxes read back of what is in force
(runtime/inside/probe.py) is kept per source for the isolation report.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import logging
import os
import secrets
import signal
import socket
import weakref
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, cast

from rollbox.runtime import owners, skeleton, slots
from rollbox.runtime.channel import Channel
from rollbox.runtime.errors import IsolationError, Unsupported
from rollbox.runtime.execution import Sandbox
from rollbox.runtime.inside import proto
from rollbox.runtime.inside.proto import Op
from rollbox.runtime.isolation import rlimits
from rollbox.runtime.isolation.cgroup_pool import CgroupPool
from rollbox.runtime.isolation.cgroups import Group
from rollbox.runtime.netns import NetNamespaces
from rollbox.runtime.restore import WarmSource, Zygote
from rollbox.runtime.snapshot import SnapshotView
from rollbox.runtime.spec import Limits

__all__ = ["Restorer", "rlimit_params"]

log = logging.getLogger("rollbox.runtime")


def _hold_mount_ns(pid: int, pidfd: int) -> int:
    """An fd of the mount namespace of the sandbox whose init is ``pid`` (``pidfd``), or -1."""
    try:
        fd = os.open(f"/proc/{pid}/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return -1
    try:
        signal.pidfd_send_signal(pidfd, 0)  # still that process: its pid was not reused meanwhile
    except OSError:
        os.close(fd)
        return -1
    return fd


def rlimit_params(limits: Limits, in_cgroup: bool, nproc_first: bool = False) -> dict[str, int]:
    """The rlimits a sandbox is given (runtime/isolation/rlimits.py). Without a cgroup, pids and memory
    fall back to RLIMIT_NPROC (counted per user namespace) and RLIMIT_DATA at the memory limit (the
    private writable mappings a program fills, not the address space it reserves: RLIMIT_AS would stop a
    JVM, V8 or lld from starting; it is set only as a backstop 4 GiB above, for the shared mappings
    RLIMIT_DATA does not count), and CPU to a raised nice value.

    ``nproc_first``: RLIMIT_NPROC at the pids limit in a cgroup too, for a sandbox whose processes
    run as a host uid of its own (where it counts that sandbox alone) in a group that keeps its
    pids.peak (which then tells that the limit was reached). The kernel checks RLIMIT_NPROC before it
    copies a forking process, the pids cgroup only after: a fork bomb at its limit then fails each
    fork at once, instead of copying its whole address space and tearing it down again, forever, under
    locks it shares with every process mapping the same files (every sandbox of its snapshot)."""
    params = {"nofile": limits.nofile_max, "fsize_bytes": limits.file_size_max_bytes}
    if not in_cgroup or nproc_first:
        params["nproc"] = limits.pids_max
    if not in_cgroup:  # in a cgroup memory is the cgroup's (and no rlimit caps memory)
        params["data_bytes"] = limits.memory_max_bytes
        params["as_bytes"] = limits.memory_max_bytes + rlimits.AS_BACKSTOP_BYTES  # shared mappings: bounded
        params["nice"] = rlimits.FALLBACK_NICE
    return params


@dataclasses.dataclass(frozen=True)
class _Origin:
    """Where a sandbox being restored comes from: its source, its id, its cgroup and user namespace."""

    source: WarmSource
    sid: str
    group: Group | None
    slot: slots.Slot | None
    nproc_first: bool
    netns: int | None = None  # an fd of the network namespace it joins (runtime/netns.py), if one was free


class Restorer:
    """Makes sandboxes for a runtime. ``cgroups``: the pool their groups come from. ``background``:
    runs work the runtime's close waits for. ``before_restore(view)``: called first, with the view
    about to be mounted (the runtime notes its layers as in use)."""

    def __init__(self, *, state_dir: Path, rootless: bool, cgroups: CgroupPool,
                 background: Callable[[Coroutine[Any, Any, None]], None],
                 before_restore: Callable[[SnapshotView], None]) -> None:
        self.state_dir = state_dir
        self.rootless = rootless
        self.cgroups = cgroups
        self._background = background
        self._before_restore = before_restore
        self.zygotes: dict[Any, WarmSource] = {}
        self.zygote_locks: dict[Any, asyncio.Lock] = {}
        self.user_slots: slots.UserSlots | None = None  # as root: a user namespace per sandbox
        self.netns: NetNamespaces | None = None  # as root: network namespaces made ahead and reused
        self.seccomp_bpf = b""
        self.user_budgets: dict[str, int] = {}
        # What the first sandbox of each warm source read back from its own /proc after containment
        # (runtime/inside/probe.py); held while the source is.
        self.probed: weakref.WeakKeyDictionary[WarmSource, dict[str, Any]] = weakref.WeakKeyDictionary()
        self._unmounter: concurrent.futures.ThreadPoolExecutor | None = None  # see _close_later

    def start(self, seccomp_bpf: bytes, user_budgets: dict[str, int], user_slots: slots.UserSlots | None,
              netns: NetNamespaces | None = None) -> None:
        """Sandboxes get this seccomp filter and these per-user budgets (rootless), and each a user
        namespace of its own from ``user_slots`` (prepared in the background, beside the first zygotes)
        and a network namespace from ``netns`` while it has one free (else they make their own)."""
        self.seccomp_bpf, self.user_budgets, self.user_slots = seccomp_bpf, user_budgets, user_slots
        self.netns = netns
        if user_slots is not None:
            self._background(self._prepare_slots(user_slots))

    async def stop_zygotes(self) -> None:
        for z in list(self.zygotes.values()):
            await z.close()
        self.zygotes.clear()

    def close_unmounter(self) -> None:
        if self._unmounter is not None:
            self._unmounter.shutdown(wait=True)  # (its closes were awaited by the runtime, as tasks)
            self._unmounter = None

    async def close_slots(self) -> None:
        if self.user_slots is not None:
            await self.user_slots.stop_making()  # (a batch under way: its helper reaped before the loop ends)
            self.user_slots.close()
        if self.netns is not None:
            self.netns.close()

    def release_netns(self, fd: int, gone: bool) -> None:
        """A sandbox's network namespace is free again (``gone``: its init has exited), or closed."""
        if self.netns is not None:
            self.netns.release(fd, gone)
        else:
            os.close(fd)

    async def _prepare_slots(self, user_slots: slots.UserSlots) -> None:
        try:
            await user_slots.prepare()
        except Exception as exc:
            self._no_slots(exc)

    def _no_slots(self, exc: Exception) -> None:
        if self.user_slots is not None:
            log.warning("no user namespace per sandbox (%s): every sandbox shares the sandbox uid's per-user "
                        "budgets", getattr(exc, "message", None) or exc)
            self.user_slots.close()
            self.user_slots = None

    def release_slot(self, slot: slots.Slot, gone: bool) -> None:
        if self.user_slots is not None:
            self.user_slots.release(slot, gone=gone)

    def skel(self, view: SnapshotView) -> Path:
        return skeleton.build(self.state_dir, view.host_binds, self.rootless)

    def warm_source(self, view: SnapshotView, skel: Path) -> WarmSource:
        """The source of this snapshot's sandboxes: a zygote re-made from its warm recipe; a
        process-image source (CRIU) is the seam's other side, not wired on this host yet."""
        if view.process_image is not None:
            raise Unsupported(
                f"snapshot {view.id!r} carries a process image; restoring process images (CRIU >= 4.1) is not "
                "wired into this runtime yet: build the snapshot with a warm recipe instead", snapshot_id=view.id)
        return Zygote(view, state_dir=self.state_dir, skel=skel, seccomp_bpf=self.seccomp_bpf,
                      rootless=self.rootless, user_budgets=self.user_budgets)

    async def zygote(self, view: SnapshotView) -> WarmSource:
        """The running source of ``view``'s sandboxes, started (the cold path) if needed."""
        key = view.zygote_key
        lock = self.zygote_locks.setdefault(key, asyncio.Lock())
        async with lock:
            z = self.zygotes.get(key)
            if z is not None and z.alive:
                return z
            if z is not None:
                await z.close()
            skel = await asyncio.to_thread(self.skel, view)
            z = self.warm_source(view, skel)
            try:
                await z.start()
            except BaseException:  # (cancelled too: a zygote half started is stopped and reaped, not left)
                await asyncio.shield(z.close())
                raise
            self.zygotes[key] = z
            return z

    async def restore(self, view: SnapshotView, limits: Limits, zygote: WarmSource | None = None) -> Sandbox:
        """Fork one sandbox from the snapshot's zygote and contain it (no pool)."""
        self._before_restore(view)
        z = zygote or await self.zygote(view)
        sid = "sb-" + secrets.token_hex(8)
        group = self.cgroups.acquire(f"{owners.tag()}-{sid}", limits.memory_max_bytes, limits.pids_max,
                                     limits.cpu_max_cores)
        params: proto.SpawnParams = {
            "layers": list(view.layers),
            "disk_bytes": limits.disk_max_bytes,
        }
        if z not in self.probed:  # the first sandbox(es) of a source read back what is in force
            params["probe"] = True
        with self.cgroups.restore(sid, group):
            slot = await self._slot()
            nproc_first = slot is not None and group is not None and group.pids_peak() >= 0
            params.update(cast(proto.SpawnParams, rlimit_params(limits, group is not None, nproc_first)))
            net = self.netns.acquire() if self.netns is not None else None
            try:
                return await self._contain(view, limits, _Origin(z, sid, group, slot, nproc_first, net), params)
            except BaseException:
                if slot is not None:  # a child of a failed spawn may still be on its way: not reused
                    self.release_slot(slot, False)
                if net is not None:  # (nor is its network namespace)
                    self.release_netns(net, False)
                raise

    async def _slot(self) -> slots.Slot | None:
        """The user namespace (its own owner uid) a new sandbox joins, if sandboxes get one."""
        if self.user_slots is None:
            return None
        try:
            return await self.user_slots.acquire()
        except IsolationError as exc:
            if self.user_slots is not None and self.user_slots.made == 0:  # the helper cannot make any
                self._no_slots(exc)
            else:  # none free and no more made: this sandbox shares the host's (rather than no sandbox)
                log.warning("sandbox without a user namespace of its own: %s", exc.message)
            return None

    async def _contain(self, view: SnapshotView, limits: Limits, origin: _Origin,
                       params: proto.SpawnParams) -> Sandbox:
        z, group, slot = origin.source, origin.group, origin.slot
        try:
            fds = group.procs_fds() if group else []
            if origin.netns is not None:  # the zygote takes it after the user namespace's
                params = {**params, "netns": True}
                fds = [origin.netns, *fds]
            if slot is not None:  # the zygote takes it as the first fd after the socket
                params = {**params, "userns": True, "idmap": slot.uid if slot.shifted else 0}
                fds = [slot.fd, *fds]
            zpid, sock = await z.spawn(params, fds)
        except BaseException:
            if group:
                self.cgroups.drop(group)
            raise
        try:
            return await self._handshake(view, limits, origin, sock, zpid)
        except BaseException:
            z.forget(zpid)
            raise

    async def _handshake(self, view: SnapshotView, limits: Limits, origin: _Origin, sock: socket.socket,
                         zpid: int) -> Sandbox:
        """The spawned sandbox's READY: its host pid and its upper layer; it is in its cgroup already.
        ``zpid``: its pid in its source's namespace."""
        source, group = origin.source, origin.group
        chan = Channel(sock, proto.SANDBOX_FRAME_BYTES)  # everything a sandbox sends is untrusted
        try:
            msg = await asyncio.wait_for(chan.recv(), 30)
        except asyncio.CancelledError:
            chan.close()  # the child sees its socket close and exits; its cgroup is released
            if group:
                self.cgroups.drop(group)
            raise
        except (TimeoutError, OSError):
            msg = None
        creds = chan.reader.creds
        if msg is None or proto.op_of(msg) != Op.READY or creds is None:
            chan.close()
            if creds is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(creds[0], 9)
            if group:
                self.cgroups.drop(group)
            why = msg.get("error") if msg else "sandbox exited during setup"
            raise IsolationError(f"sandbox setup failed: {why}", snapshot_id=view.id)
        pid = creds[0]
        if isinstance(msg.get("probe"), dict):  # the uid/gid it runs as, seen from here: the host's view
            self.probed[source] = {**msg["probe"], "host_uid": creds[1], "host_gid": creds[2]}
        fds = chan.take_fds()
        pidfd = -1
        try:
            pidfd = os.pidfd_open(pid)
            cg_base = None
            if group:
                group.reset_peak()
                cg_base = group.stats()
        except (OSError, ProcessLookupError) as exc:  # it died right after "ready" (its zygote crashed)
            chan.close()
            for fd in (*fds, pidfd):
                if fd >= 0:
                    os.close(fd)
            if group:
                self.cgroups.drop(group)
            raise IsolationError(f"sandbox died during setup: {exc}", snapshot_id=view.id) from exc
        sb = Sandbox(id=origin.sid, view=view, limits=limits, pid=pid, pidfd=pidfd, chan=chan, group=group,
                     upper_fd=fds[0] if fds else -1, source=source, source_pid=zpid, ended=source.exit_report(zpid),
                     release_slot=self.release_slot, cg_base=cg_base, cgroups=self.cgroups,
                     mntns_fd=_hold_mount_ns(pid, pidfd), release_fd=self._close_later, user_slot=origin.slot,
                     nproc_first=origin.nproc_first, netns_fd=-1 if origin.netns is None else origin.netns,
                     release_netns=self.release_netns)
        sb.watch()
        return sb

    def _close_later(self, fd: int) -> None:
        """Close ``fd`` in a thread of its own pool (the last fd of a sandbox's mount namespace: its
        unmounts wait for RCU grace periods, seconds on a loaded box, and must not hold up the default
        executor's work); the runtime's close waits for it."""
        if self._unmounter is None:
            self._unmounter = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="rollbox-unmount")
        done = asyncio.get_running_loop().run_in_executor(self._unmounter, os.close, fd)

        async def closed() -> None:
            await done

        self._background(closed())
