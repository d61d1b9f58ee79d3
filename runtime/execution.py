"""A live sandbox as the supervisor sees it: its state (``SandboxState`` and why it ended), its
steps (run by ``runtime/step.py``'s StepRunner, with timeouts and output caps enforced from outside),
its filesystem diffs applied, its usage, and its end (``close``).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import select
import signal
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Literal

from rollbox.runtime.channel import Channel, encode
from rollbox.runtime.errors import IsolationError, SandboxDied
from rollbox.runtime.inside import proto
from rollbox.runtime.inside.proto import Diff, Op
from rollbox.runtime.isolation.cgroup_pool import CgroupPool
from rollbox.runtime.isolation.cgroups import CgroupStats, Group
from rollbox.runtime.isolation.users import SANDBOX_UID
from rollbox.runtime.restore import WarmSource
from rollbox.runtime.slots import Slot
from rollbox.runtime.snapshot import SnapshotView
from rollbox.runtime.spec import ExecRequest, ExecResult, Limits, Usage
from rollbox.runtime.step import KILL_GRACE_S, REPORT_WAIT_S, StepOutcome, StepRunner, kill_all_but_init

__all__ = ["Metered", "Sandbox", "SandboxState"]

KILLED_EXIT_WAIT_S = 0.5  # see Sandbox.only_init_left


class SandboxState(StrEnum):
    """Where a sandbox is in its life; once it has ended, ``Sandbox.end_reason`` says why."""

    LIVE = "live"  # its init runs: it takes steps
    DIED = "died"  # its init ended by itself (killed from outside, out of memory, its lifetime)
    FINISHED = "finished"  # a one-shot step's program, its init, ended
    ABANDONED = "abandoned"  # killed by the supervisor: its agent misbehaved or a caller gave up mid-frame
    CLOSED = "closed"  # ended on purpose (destroyed, expired, shut down)


Metered = Literal["sandbox", "run"]


@dataclass
class Sandbox:
    id: str
    view: SnapshotView
    limits: Limits
    pid: int
    pidfd: int
    chan: Channel
    group: Group | None
    upper_fd: int
    source: WarmSource | None = None  # what spawned it, its pid there, and how its init ended
    source_pid: int = -1
    ended: asyncio.Future[dict[str, Any]] | None = None
    release_slot: Callable[[Slot, bool], None] | None = None
    _stats_fresh: bool = True  # cg_base still describes the sandbox as no step has touched it
    extra_layers: tuple[str, ...] = ()
    cg_base: CgroupStats | None = None  # the (reused) cgroup's counters when this sandbox joined it
    cg_final: CgroupStats | None = None  # its counters once every process of the sandbox was gone
    cgroups: CgroupPool | None = None  # the pool ``group`` was lent from (and goes back to)
    # An fd of its mount namespace, held so that its init's exit does not tear that namespace down
    # (unmounting its overlay and tmpfs waits for expedited RCU grace periods: under load, seconds on
    # the path of a one-shot run's reply); ``release_fd`` closes it later, off the event loop.
    mntns_fd: int = -1
    release_fd: Callable[[int], None] | None = None
    user_slot: Slot | None = None  # its user namespace (owned by a host uid of its own), if any
    nproc_first: bool = False  # RLIMIT_NPROC is its pids limit (runtime.rlimit_params): pids.peak tells a hit
    netns_fd: int = -1  # its network namespace, when it joined one made on the host (runtime/netns.py)
    release_netns: Callable[[int, bool], None] | None = None
    metadata: dict[str, str] = field(default_factory=dict)
    created_at: float = field(default_factory=time.monotonic)
    last_used: float = field(default_factory=time.monotonic)
    execs: int = 0
    step_ended: float | None = None  # monotonic time its last step ended (None: none yet)
    alone: bool = False  # its agent said no process but itself (and an idle spare) outlived the last step
    step_kills: int = 0  # processes the supervisor killed on step timeouts
    killed_step: bool = False  # its last step timed out: the host killed every process but its init
    owed_exit: bool = False  # a timed-out step's "exit" is still to come from the agent (see settle)
    forked_from: str | None = None
    pooled: bool = False
    metered: Metered | None = "sandbox"  # how its life is billed when it ends here: sandbox | run | None (elsewhere)
    create_ms: float = 0.0
    cpu_s: float = 0.0
    peak_memory_bytes: int = 0
    busy: bool = False
    state: SandboxState = SandboxState.LIVE
    end_reason: str | None = None  # why it ended ("died", "finished", "destroyed", ...), once it has
    usage: Usage | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    _closing: asyncio.Future[Usage] | None = None
    exited: asyncio.Event = field(default_factory=asyncio.Event)

    def watch(self) -> None:
        """Notice the sandbox's death (killed, OOM of its init, lifetime) without polling."""
        loop = asyncio.get_running_loop()

        def init_exited() -> None:
            loop.remove_reader(self.pidfd)
            self.exited.set()
            self._end(SandboxState.DIED, "died")

        loop.add_reader(self.pidfd, init_exited)

    def alive(self) -> bool:
        """True unless the sandbox's init has exited (asks the kernel through the pidfd, now)."""
        if self.state is not SandboxState.LIVE:
            return False
        p = select.poll()
        p.register(self.pidfd, select.POLLIN)
        if p.poll(0):
            self._end(SandboxState.DIED, "died")
            self.exited.set()
            return False
        return True

    def _end(self, state: SandboxState, reason: str, *, overwrite: bool = False) -> None:
        """It has ended (once: the first end is kept, unless ``overwrite``)."""
        if self.state is SandboxState.LIVE or overwrite:
            self.state, self.end_reason = state, reason

    def gone(self, ran: bool = True) -> SandboxDied:
        """The error for a request that found this sandbox ended (``ran``: the request reached it)."""
        return SandboxDied(f"sandbox {self.id} is gone ({self.end_reason})", ran=ran, sandbox_id=self.id)

    def take_up(self, sandbox_id: str | None, metadata: dict[str, str] | None, *, forked_from: str | None,
                pooled: bool, create_ms: float, metered: Metered | None) -> None:
        """It starts its life as a sandbox (restored just now, or taken from a pool): its id (None:
        the one it was made with), metadata, where it was forked from, how it was made, how its life
        is billed; its lifetime and idle clocks start now."""
        if sandbox_id is not None:
            self.id = sandbox_id
        self.metadata = dict(metadata or {})
        self.forked_from = forked_from
        self.pooled = pooled
        self.create_ms = create_ms
        self.metered = metered
        self.created_at = self.last_used = time.monotonic()

    def backdate(self, age_s: float) -> None:
        """Its lifetime counts from ``age_s`` ago (a durable sandbox resumed: from its create)."""
        self.created_at = time.monotonic() - age_s

    def bill_elsewhere(self) -> None:
        """Its life is billed by someone else (the durable layer, once at its end): not here."""
        self.metered = None

    def touch(self) -> None:
        self.last_used = time.monotonic()

    @property
    def upper_path(self) -> str:
        """The sandbox's upper (diff) directory, readable by the supervisor through its fd."""
        return f"/proc/{os.getpid()}/fd/{self.upper_fd}/upper"

    @property
    def owner_shift(self) -> tuple[int, int] | None:
        """(its host uid, 1000) if its processes run as a host uid of their own: the files it wrote
        to its upper directory are that uid's (and gid's) there, and go into a layer as 1000's."""
        slot = self.user_slot
        return (slot.uid, SANDBOX_UID) if slot is not None and slot.shifted else None

    @property
    def is_live(self) -> bool:
        return self.state is SandboxState.LIVE

    def finished(self) -> None:
        """Its init, a one-shot step's program, has ended (or was killed at the step's deadline)."""
        self._end(SandboxState.FINISHED, "finished")

    def lost_before_step(self) -> SandboxDied:
        """Its agent could not be sent a step: it is gone, and nothing of the step ran."""
        self._end(SandboxState.DIED, "died")
        return self.gone(ran=False)

    def begin_step(self) -> CgroupStats | None:
        """A step starts: its CPU weight is back to equal (raised since a timed-out step, whose
        killed processes took it to exit), and the cgroup's counters before it (nothing ran since
        the sandbox joined its group: the counters, and peak, as then)."""
        self._unboost()
        if self._stats_fresh:
            before = self.cg_base
            self._stats_fresh = False
        else:
            before = self.group.stats() if self.group else None
            if self.group:
                self.group.reset_peak()
        self.alone = False
        return before

    def end_step(self, outcome: StepOutcome) -> None:
        """Count a step's end: its usage, whether anything of it outlived it, whether it ended the sandbox."""
        if outcome.init_ended:  # its init was reaped: nothing of it runs
            self.cg_final = outcome.after
        self.execs += 1
        self.killed_step = outcome.timed_out
        if outcome.report is None:  # the agent is gone: the sandbox died under this step
            self._end(SandboxState.DIED, "died")
        else:
            self.alone = outcome.alone
        self.cpu_s += outcome.cpu_s
        self.peak_memory_bytes = max(self.peak_memory_bytes, outcome.peak_memory_bytes)

    async def only_init_left(self) -> bool:
        """Whether its cgroup holds its init alone: nothing but the agent can write. After a timed-out
        step, whose processes the host killed, waited for up to KILLED_EXIT_WAIT_S while they exit.
        Then its files are read without a word from its agent, which a busy box may take seconds to
        give (it reaps the killed first, then stops the rest): a durable step's commit after a timeout
        does not wait for that (the agent's report is read before its next frame).

        Meanwhile the host's kill is repeated on whatever else is in the group: until the next step
        nothing but the init may run there, and something can. The agent is told of the timeout
        (KILL) only after the host's kill; one that reaps its killed worker first reports the step's
        end and, its steps coming fast, forks its spare worker, which it kills only once it reads
        the KILL — on a busy box, or with the agent stopped, not within this wait."""
        if self.group is None:
            return False
        deadline = time.monotonic() + (KILLED_EXIT_WAIT_S if self.killed_step else 0.0)
        while True:
            if set(self.group.pids()) <= {self.pid}:
                return True
            if time.monotonic() >= deadline:
                return False
            kill_all_but_init(self.pid, self.group)  # (only after a timed-out step: else no wait)
            await asyncio.sleep(0.01)

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError, OSError):
            signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)

    async def prime(self) -> None:
        """Have the agent run its fork path once on nothing (see agent._prime): a pooled sandbox of a
        snapshot that is being forked then applies a parent's diff faster."""
        self._stats_fresh = False  # that work is not the first step's
        with contextlib.suppress(OSError):
            await self.chan.send(proto.bare(Op.PRIME))

    async def want_spare(self) -> None:
        """A step is about to come: have the agent fork its worker now (a resumed sandbox, whose step
        waits only for its files). Otherwise a sandbox has a spare only while its steps come within
        step.SPARE_WINDOW_S of each other; pooled sandboxes have none (a one-shot run's program runs as the
        sandbox's init)."""
        self._stats_fresh = False
        with contextlib.suppress(OSError):
            await self.chan.send(proto.bare(Op.SPARE))

    async def exec(self, req: ExecRequest, last: bool = False, since: float | None = None) -> ExecResult:
        """Run one step. ``last`` says no step follows (one-shot runs): unless files are to be read
        back after it, the program runs as the sandbox's init itself (one process fewer to fork and
        reap; like ``docker run`` without ``--init``), and its end ends the sandbox. The step's
        ``timeout_s`` counts from ``since`` (monotonic; a one-shot run's start, its sandbox's
        acquisition included), else from when this sandbox takes the step (the end of a previous
        timed-out step's wait included): the reply comes at the deadline, whatever came first."""
        async with self.lock:
            if self.state is not SandboxState.LIVE:
                raise self.gone()
            self.busy = True
            deadline = (time.monotonic() if since is None else since) + req.timeout_s
            try:
                await self.settle()
                return await StepRunner(self, req, last, deadline).run()
            except asyncio.CancelledError:
                # The caller gave up mid-step: the agent's reply would be read by the next step and
                # every result after it would be one step late. The sandbox cannot be trusted on.
                self.abandon("cancelled during an exec")
                raise
            finally:
                self.busy = False
                self.last_used = self.step_ended = time.monotonic()

    def abandon(self, why: str) -> None:
        """Kill the sandbox now: its control channel is out of step (or its agent misbehaved)."""
        self._end(SandboxState.ABANDONED, why)
        self.kill()

    async def expect(self, *ops: str, timeout_s: float | None = None) -> dict[str, Any] | None:
        """The agent's next reply, which must be one of ``ops``; None if the agent is gone. Anything
        else means the channel is out of step or the agent is compromised: the sandbox is killed."""
        if timeout_s is None:
            msg = await self.chan.recv()
        else:
            msg = await asyncio.wait_for(self.chan.recv(), timeout_s)
        if msg is not None and proto.op_of(msg) not in ops:
            self.abandon(f"protocol error: expected {'/'.join(ops)}, got {str(proto.op_of(msg))[:40]!r}")
            raise self.gone()
        return msg

    async def inject(self, diff: Diff) -> None:
        """Apply a forked parent's filesystem diff (see ``pack_upper``) inside this sandbox."""
        async with self.lock:
            if self.state is not SandboxState.LIVE:
                raise self.gone()
            try:
                await self.settle()
            except asyncio.CancelledError:
                self.abandon("cancelled during a fork")
                raise
            self._stats_fresh = False
            frame = diff.frame
            if frame is None:  # encoded once per fork, sent to every child
                frame = diff.frame = encode(diff.message())
            await self.chan.send(frame, [diff.fd])
            try:
                reply = await self.expect(Op.INJECTED)
            except asyncio.CancelledError:
                self.abandon("cancelled during a fork")
                raise
            if reply is None or reply.get("error"):
                raise IsolationError(f"could not copy the parent's files: {reply.get('error') if reply else 'died'}",
                                     sandbox_id=self.id)

    async def kill_step(self) -> Mapping[str, Any] | None:
        """Timeout: the supervisor kills every process of the sandbox but its init, from the host
        (``kill_all_but_init``), then tells the agent (which kills what it still sees and reaps). The
        agent's report of the step's end (with its read-back files) is awaited REPORT_WAIT_S: the
        agent shares its sandbox's CPU share with every other sandbox, so under load it may take
        longer; then the step ends as killed now, and the report is read before the next frame."""
        self.step_kills += kill_all_but_init(self.pid, self.group)
        if self.group is not None:
            self.group.boost(True)  # the killed processes' exits and the reaping are all that runs
        try:
            await self.chan.send(proto.bare(Op.KILL))
            return await self.expect(Op.EXIT, timeout_s=REPORT_WAIT_S)  # (boosted until its next step)
        except TimeoutError:  # (an OSError too: caught first)
            self.owed_exit = True
            return proto.exit_report(Op.EXIT, signal.SIGKILL, files={})
        except OSError:  # the agent is gone
            self._end(SandboxState.ABANDONED, "killed: did not stop on timeout", overwrite=True)
            self.kill()
            return None

    async def settle(self) -> None:
        """Read the report a timed-out step's agent still owes (``kill_step``), with the sandbox's
        lock held, before any other frame. An agent that does not give it within KILL_GRACE_S of being
        asked is stuck (its init itself): the sandbox goes, and nothing of the next request ran."""
        if not self.owed_exit:
            return
        try:
            msg = await self.expect(Op.EXIT, timeout_s=KILL_GRACE_S)
        except TimeoutError:
            msg = None
        if msg is None:
            self.abandon("killed: did not stop on timeout")
            raise self.gone(ran=False)
        self.owed_exit = False

    def _unboost(self) -> None:
        if self.group is not None:
            self.group.boost(False)

    async def close(self, reason: str) -> Usage:
        """Kill the sandbox and release what it holds, once: concurrent and repeated calls get the
        same usage record (a second release would hand one cgroup to two sandboxes)."""
        if self._closing is None:
            self._closing = asyncio.ensure_future(self._close(reason))
        return await asyncio.shield(self._closing)

    async def _close(self, reason: str) -> Usage:
        if self.usage is not None:
            return self.usage
        self._end(SandboxState.CLOSED, reason)
        self.kill()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.exited.wait(), 10)
        if self.group:  # (its pool sets a reused group's weight back, once its killed processes are gone)
            stats = self.cg_final or self.group.stats()
            self.cpu_s = max(self.cpu_s, stats.cpu_s - (self.cg_base.cpu_s if self.cg_base else 0.0))
            self.peak_memory_bytes = max(self.peak_memory_bytes, stats.peak_memory_bytes)
            assert self.cgroups is not None  # (a group is lent from a pool)
            self.cgroups.release(self.group)
        if self.user_slot is not None and self.release_slot is not None:
            self.release_slot(self.user_slot, self.exited.is_set())  # reused only once all its processes are gone
            self.user_slot = None
        self.chan.close()
        if self.source is not None:
            self.source.forget(self.source_pid, self.ended)
        asyncio.get_running_loop().remove_reader(self.pidfd)
        for fd in (self.upper_fd, self.pidfd):
            with contextlib.suppress(OSError):
                os.close(fd)
        self.upper_fd = -1  # (read by whoever still holds this Sandbox: its upper directory is gone)
        if self.mntns_fd >= 0:  # its mounts go now, in the background
            if self.release_fd is not None:
                self.release_fd(self.mntns_fd)
            else:
                os.close(self.mntns_fd)
            self.mntns_fd = -1
        if self.netns_fd >= 0:  # reused only once its init has exited: nothing of it is left there
            if self.release_netns is not None:
                self.release_netns(self.netns_fd, self.exited.is_set())
            else:
                os.close(self.netns_fd)
            self.netns_fd = -1
        wall = time.monotonic() - self.created_at
        self.usage = Usage(
            sandbox_id=self.id,
            snapshot_id=self.view.id,
            metadata=self.metadata,
            wall_s=round(wall, 6),
            cpu_s=round(self.cpu_s, 6),
            peak_memory_bytes=self.peak_memory_bytes,
            billed_s=max(1, math.ceil(wall)),
            execs=self.execs,
            reason=reason,
        )
        return self.usage
