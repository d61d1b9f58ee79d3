"""Execution: a live sandbox as the supervisor sees it — exec with timeouts and output caps enforced
from outside, usage metering, and destroy.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import math
import os
import select
import signal
import stat
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Literal, cast

from rollbox.runtime.channel import Channel, encode
from rollbox.runtime.errors import IsolationError, SandboxDied
from rollbox.runtime.inside import proto
from rollbox.runtime.inside.proto import Diff, DiffEntry, Kind, Op
from rollbox.runtime.isolation.cgroup_pool import CgroupPool
from rollbox.runtime.isolation.cgroups import CgroupStats, Group
from rollbox.runtime.isolation.users import SANDBOX_UID
from rollbox.runtime.restore import WarmSource
from rollbox.runtime.slots import Slot
from rollbox.runtime.snapshot import SnapshotView
from rollbox.runtime.spec import ExecRequest, ExecResult, Limits, Usage

KILL_GRACE_S = 3.0  # after a step's processes were killed, how long the agent has to report its end
# ... of which a timed-out step waits this long (for its read-back files); past it the step returns
# as killed and the agent's report is read before the sandbox's next frame (``settle``).
REPORT_WAIT_S = 0.2
# A one-shot run killed at its deadline replies after at most this long: its init's end is reported
# only once every process of its pid namespace is gone, which a fork bomb's thousands make seconds.
# The reply does not wait for that; the sandbox is ended in the background (Runtime.run).
KILLED_REPLY_WAIT_S = 0.1
# A step that starts within this long of the sandbox's previous one leaves a spare worker behind it
# (forked by the agent ahead of the next step, ~1 ms off that step's path). Steps further apart, the
# common case of an RL episode whose model thinks for seconds, leave none: an idle sandbox holds no
# second process (its memory halves) and one that hibernates never forked a worker it did not use.
SPARE_WINDOW_S = 2.0
DRAIN_AFTER_EXIT_S = 0.2  # how long background holders of stdout may keep it open after the exit
KILLED_DRAIN_S = 0.05  # ... after a timeout's kill
# Past the output cap, a stream is still read to its end (the program is not stalled: it ends as it
# would, with its output cut at the cap), but dropped without copying (spliced to /dev/null) and at
# most this fast: a program that writes without end costs the supervisor a few wakeups a second.
DISCARD_BYTES_PER_S = 256 * 1024 * 1024
DISCARD_PIPE_BYTES = 1 << 20  # the pipe is grown to this once past the cap (fewer, larger drains)
_F_SETPIPE_SZ = 1031


class _Capture:
    """Reads a pipe to EOF keeping the first ``cap`` bytes; the rest is counted and dropped, at most
    DISCARD_BYTES_PER_S. What was captured survives cancellation."""

    def __init__(self, fd: int, cap: int):
        self.fd = fd
        self.cap = cap
        self.buf = bytearray()
        self.total = 0
        self._null = -1

    @property
    def truncated(self) -> bool:
        return self.total > self.cap

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        event = asyncio.Event()
        loop.add_reader(self.fd, event.set)
        try:
            while True:
                await event.wait()
                event.clear()
                got = self._take()
                if got is None:
                    return
                if got and self.total > self.cap:  # dropping: let the pipe fill before the next drain
                    loop.remove_reader(self.fd)
                    await asyncio.sleep(got / DISCARD_BYTES_PER_S)
                    loop.add_reader(self.fd, event.set)
        finally:
            loop.remove_reader(self.fd)
            if self._null >= 0:
                os.close(self._null)

    def _take(self) -> int | None:
        """Read what the pipe holds now (keeping up to the cap, dropping the rest): the bytes taken,
        None at EOF."""
        got = 0
        while got < 4 * DISCARD_PIPE_BYTES:  # (a writer as fast as this reader cannot hold it here)
            try:
                if len(self.buf) < self.cap:
                    chunk = os.read(self.fd, 1 << 16)
                    n = len(chunk)
                    self.buf += chunk[:self.cap - len(self.buf)]
                else:
                    n = self._drop()
            except BlockingIOError:
                return got
            if n == 0:
                return None
            got += n
            self.total += n
        return got

    def _drop(self) -> int:
        if self._null < 0:  # the first drop: a larger pipe, and /dev/null to splice into
            with contextlib.suppress(OSError):
                fcntl.fcntl(self.fd, _F_SETPIPE_SZ, DISCARD_PIPE_BYTES)
            self._null = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
        try:
            return os.splice(self.fd, self._null, DISCARD_PIPE_BYTES, flags=os.SPLICE_F_NONBLOCK)
        except OSError as exc:
            if isinstance(exc, BlockingIOError) or exc.errno not in (errno.EINVAL, errno.ENOSYS):
                raise
            return len(os.read(self.fd, DISCARD_PIPE_BYTES))  # (no splice here)


async def _feed(fd: int, data: bytes) -> None:
    loop = asyncio.get_running_loop()
    view = memoryview(data)
    try:
        while view:
            try:
                n = os.write(fd, view)
                view = view[n:]
            except BlockingIOError:
                ev = asyncio.Event()
                loop.add_writer(fd, ev.set)
                try:
                    await ev.wait()
                finally:
                    loop.remove_writer(fd)
            except BrokenPipeError:
                return
    finally:
        os.close(fd)


class UpperTooLarge(Exception):
    """An upper directory with more entries than a walk's ``limit`` (``walk_upper``)."""


def walk_upper(upper: str, limit: int | None = None) -> Iterator[tuple[str, str, os.stat_result, str]]:
    """The entries of an overlay upper directory in walk order (children sorted by name, a directory
    before its contents): (path inside the sandbox, kind, stat, host path). Kinds: "w" whiteout
    (a deleted path), "d" directory, "o" opaque directory (hides what is below it), "l" symlink,
    "f" regular file; anything else (fifos, sockets) is skipped. ``limit``: UpperTooLarge once more
    entries than that were listed (a caller walking on the event loop gives the rest to a thread)."""
    stack = [""]
    left = limit
    while stack:
        rel = stack.pop()
        with os.scandir(os.path.join(upper, rel) if rel else upper) as it:
            if left is None:
                found = sorted(it, key=lambda e: e.name)
            else:
                found = []
                for e in it:
                    found.append(e)
                    left -= 1
                    if left < 0:
                        raise UpperTooLarge(f"{upper} holds more than {limit} entries")
                found.sort(key=lambda e: e.name)
        for e in found:
            path = f"/{rel}/{e.name}" if rel else f"/{e.name}"
            st = e.stat(follow_symlinks=False)
            if stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:
                yield path, "w", st, e.path
            elif stat.S_ISDIR(st.st_mode):
                opaque = False
                for attr in ("trusted.overlay.opaque", "user.overlay.opaque"):
                    with contextlib.suppress(OSError):
                        opaque = opaque or os.getxattr(e.path, attr, follow_symlinks=False) == b"y"
                yield path, "o" if opaque else "d", st, e.path
                stack.append(path.lstrip("/"))
            elif stat.S_ISLNK(st.st_mode):
                yield path, "l", st, e.path
            elif stat.S_ISREG(st.st_mode):
                yield path, "f", st, e.path


def give_back(tree: str, shift: tuple[int, int]) -> None:
    """Owners ``shift[0]`` (uid or gid) in ``tree`` become ``shift[1]``: a copy of a sandbox's upper
    directory stacked as a layer under other sandboxes (see ``Sandbox.owner_shift``)."""
    src, dst = shift
    for _, _, st, host_path in [("", "d", os.lstat(tree), tree), *walk_upper(tree)]:
        if src in (st.st_uid, st.st_gid):
            os.chown(host_path, dst if st.st_uid == src else st.st_uid, dst if st.st_gid == src else st.st_gid,
                     follow_symlinks=False)


def upper_diff(upper: str, file_content: Callable[[DiffEntry, os.stat_result, str], bool],
               limit: int | None = None) -> Diff | None:
    """An overlay upper directory as a diff a sandbox's agent can apply: its entries (directories,
    files, symlinks, hard links to an earlier path, in walk order, with modes and mtimes), the
    whiteouts (deleted paths) and the opaque directories. Where a regular file's content goes is the
    caller's: ``file_content(entry, stat, host path)`` fills in the entry's content fields, or says
    False to give up (then this returns None)."""
    entries: list[DiffEntry] = []
    whiteouts: list[str] = []
    opaque: list[str] = []
    seen: dict[tuple[int, int], str] = {}
    for path, kind, st, host_path in walk_upper(upper, limit):
        if kind == "w":
            whiteouts.append(path)
        elif kind in ("d", "o"):
            if kind == "o":
                opaque.append(path)
            entries.append(DiffEntry(path, Kind.DIR, stat.S_IMODE(st.st_mode), st.st_mtime))
        elif kind == "l":
            entries.append(DiffEntry(path, Kind.SYMLINK, link=os.readlink(host_path)))
        elif st.st_nlink > 1 and (st.st_dev, st.st_ino) in seen:
            entries.append(DiffEntry(path, Kind.HARDLINK, link=seen[(st.st_dev, st.st_ino)]))
        else:
            seen[(st.st_dev, st.st_ino)] = path
            entry = DiffEntry(path, Kind.FILE, stat.S_IMODE(st.st_mode), st.st_mtime)
            if not file_content(entry, st, host_path):
                return None
            entries.append(entry)
    return Diff(entries, whiteouts, opaque)


def pack_upper(upper: str, max_bytes: int) -> Diff | None:
    """``upper_diff`` with the file contents one after another in a memfd (``fd``; each child copies
    its files from it in the kernel). None if the files exceed ``max_bytes``."""
    fd = os.memfd_create("rollbox-fork-diff", os.MFD_CLOEXEC)
    offset = 0

    def copy_in(entry: DiffEntry, st: os.stat_result, host_path: str) -> bool:
        nonlocal offset
        if offset + st.st_size > max_bytes:
            return False
        with open(host_path, "rb") as src:
            n = os.sendfile(fd, src.fileno(), 0, st.st_size) if st.st_size else 0
        entry.offset, entry.size = offset, n
        offset += n
        return True

    try:
        diff = upper_diff(upper, copy_in)
    except BaseException:
        os.close(fd)
        raise
    if diff is None:
        os.close(fd)
        return None
    diff.fd = fd
    return diff


def descendants(pid: int) -> list[int]:
    """Host pids of every descendant of ``pid`` (/proc/<pid>/task/<tid>/children, recursively). In a
    pid namespace an orphan is re-parented to its init, so under a sandbox's init: every other process
    of the sandbox."""
    out: list[int] = []
    todo = [pid]
    while todo:
        p = todo.pop()
        try:
            tids = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{p}/task/{tid}/children", "rb") as f:
                    kids = [int(k) for k in f.read().split()]
            except (OSError, ValueError):
                continue
            out.extend(kids)
            todo.extend(kids)
    return out


def kill_all_but_init(init_pid: int, group: Group | None, max_passes: int = 100) -> int:
    """SIGKILL every process of a sandbox but its init, from the host: the members of its cgroup, or
    (no cgroup) its init's descendants. Needs no CPU inside the sandbox, so a step that starves its
    own agent (a fork bomb under a small CPU quota) still ends at its deadline. Passes repeat while
    new processes appear (a process forked just before its parent was killed); a killed one cannot
    fork. Returns how many processes were signalled."""
    seen: set[int] = set()
    for _ in range(max_passes):
        found = group.pids() if group is not None else descendants(init_pid)
        new = [p for p in found if p != init_pid and p not in seen]
        if not new:
            break
        for p in new:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(p, signal.SIGKILL)
        seen.update(new)
    return len(seen)


def _exit_code(status: int) -> tuple[int, str | None]:
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = f"SIG{sig}"
        return 128 + sig, name
    if os.WIFEXITED(status):
        return os.WEXITSTATUS(status), None
    return 255, None


_TICKS = os.sysconf("SC_CLK_TCK")


def zombie_end(pid: int, pidfd: int) -> Mapping[str, Any] | None:
    """How a process that exited and is not reaped yet ended, from its /proc/<pid>/stat: its wait
    status (field 52) and its CPU with its reaped children's (fields 14-17), as its parent's report
    has them ("exited"; no peak memory). None if it still runs or was reaped already: ``pidfd``
    refers to it, and the read counts only if it is still unreaped after it (till then its pid
    cannot be another process's)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
        signal.pidfd_send_signal(pidfd, 0)
    except OSError:
        return None
    fields = raw[raw.rindex(b")") + 2:].split()  # after "pid (comm) " (comm may hold a ")")
    if len(fields) < 50 or fields[0] != b"Z":
        return None
    ticks = sum(int(x) for x in fields[11:15])
    return proto.exit_report(Op.EXITED, int(fields[49]), ticks / _TICKS, 0)


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
        SPARE_WINDOW_S of each other; pooled sandboxes have none (a one-shot run's program runs as the
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
                return await self._exec(req, last, deadline)
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

    async def _exec(self, req: ExecRequest, last: bool, deadline: float) -> ExecResult:
        self._unboost()  # (raised since a timed-out step, whose killed processes took it to exit)
        cap = self.limits.output_max_bytes
        if self._stats_fresh:  # nothing ran since the sandbox joined its group: counters (and peak) as then
            before = self.cg_base
            self._stats_fresh = False
        else:
            before = self.group.stats() if self.group else None
            if self.group:
                self.group.reset_peak()
        if req.stdin:
            in_r, in_w = os.pipe2(os.O_CLOEXEC)
            os.set_blocking(in_w, False)
        else:  # no input: the program reads EOF from /dev/null (no pipe, no feeder)
            in_r, in_w = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC), -1
        out_r, out_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        err_r, err_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        os.set_blocking(out_w, True)
        os.set_blocking(err_w, True)
        inline = last and not req.read_files and self.ended is not None
        self.alone = False
        now = time.monotonic()
        spare = not last and self.step_ended is not None and now - self.step_ended <= SPARE_WINDOW_S
        msg = proto.ExecMsg(op=Op.EXEC, env=req.env, files=req.files, read_files=req.read_files,
                            last=last, inline=inline, spare=spare)
        if req.code is not None:
            msg["code"] = req.code
        else:
            msg["command"] = cast(str, req.command)
        t0 = time.monotonic()
        captures = [_Capture(out_r, cap), _Capture(err_r, cap)]
        readers = [asyncio.create_task(c.run()) for c in captures]
        tasks: list[asyncio.Task[None]] = list(readers)
        if in_w >= 0:
            tasks.append(asyncio.create_task(_feed(in_w, (req.stdin or "").encode())))
        timed_out = False
        reply: Mapping[str, Any] | None = None
        try:
            try:
                await self.chan.send(msg, [in_r, out_w, err_w])
            except OSError as exc:  # the agent is gone (its init died): nothing ran
                self._end(SandboxState.DIED, "died")
                raise self.gone(ran=False) from exc
            finally:
                for fd in (in_r, out_w, err_w):
                    os.close(fd)
            if inline:
                reply, timed_out = await self._await_inline(max(0.0, deadline - time.monotonic()))
            else:
                try:
                    reply = await self.expect(Op.EXIT, timeout_s=max(0.0, deadline - time.monotonic()))
                except TimeoutError:
                    timed_out = True
                    reply = await self._kill_step()
            wall = time.monotonic() - t0
            # what a killed step's processes wrote is in the pipes: their ends close as they exit
            await asyncio.wait(readers, timeout=KILLED_DRAIN_S if timed_out else DRAIN_AFTER_EXIT_S)
        finally:
            for t in tasks:
                if not t.done():
                    t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for fd in (out_r, err_r):
                os.close(fd)
        stdout, stderr = bytes(captures[0].buf), bytes(captures[1].buf)
        out_trunc, err_trunc = captures[0].truncated, captures[1].truncated
        after = self.group.stats() if self.group else None
        if reply is not None and proto.init_ended(reply):  # its init was reaped: nothing of it runs
            self.cg_final = after
        self.execs += 1
        alive = reply is not None and self.state is SandboxState.LIVE
        self.killed_step = timed_out
        if reply is None:
            # The agent is gone: the sandbox died under this exec (its init was OOM-killed, say).
            self._end(SandboxState.DIED, "died")
            exit_code, sig = 137, "SIGKILL"  # type: tuple[int, str | None]
            files: dict[str, str | None] = {}
            cpu, peak = 0.0, 0
        else:
            exit_code, sig = _exit_code(int(reply.get("status", 255 << 8)))
            self.alone = not timed_out and reply.get("alone") is True
            files = reply.get("files") or {}
            cpu, peak = float(reply.get("cpu_s", 0.0)), int(reply.get("maxrss_bytes", 0))
            if not math.isfinite(cpu) or cpu < 0:  # (the agent's word, without a cgroup: untrusted)
                cpu = 0.0
            if reply.get("error"):  # (nothing ran: the agent says why, naming the file it could not write)
                stderr += f"rollbox: {reply['error']}\n".encode()
        oom = pids_hit = False
        if before and after:
            cpu = after.cpu_s - before.cpu_s
            peak = after.peak_memory_bytes
            oom = after.oom_kills > before.oom_kills
            pids_hit = after.pids_max_hits > before.pids_max_hits or (
                self.nproc_first and before.pids_peak < self.limits.pids_max <= after.pids_peak)
        self.cpu_s += max(cpu, 0.0)
        self.peak_memory_bytes = max(self.peak_memory_bytes, peak)
        return ExecResult(
            sandbox_id=self.id,
            snapshot_id=self.view.id,
            forked_from=self.forked_from,
            exit_code=exit_code,
            signal=sig,
            stdout=stdout.decode("utf-8", "replace"),
            stderr=stderr.decode("utf-8", "replace"),
            stdout_truncated=out_trunc,
            stderr_truncated=err_trunc,
            timed_out=timed_out,
            oom_killed=oom,
            pids_limit_hit=pids_hit,
            wall_s=round(wall, 6),
            cpu_s=round(max(cpu, 0.0), 6),
            peak_memory_bytes=peak,
            files=files,
            sandbox_alive=alive,
        )

    async def _await_inline(self, timeout_s: float) -> tuple[dict[str, Any] | None, bool]:
        """The end of a step run by the sandbox's init: its exit as its parent reaped it. The agent
        answers on the channel first — "exit" if it refused the step (files it could not write), else
        "started" (with its own CPU so far) — then hangs up and becomes the program. The end is the
        zygote's report of its wait4, or, when the init's pidfd says it exited first (the zygote is
        busy forking: under load a fork waits seconds for the kernel's cgroup lock), its zombie's
        status read from /proc: the reply never waits for the zygote. Timeout: the init is killed,
        which ends every process of the sandbox; the reply does not wait for that teardown. An init
        that ended without "started" never ran the program (a pooled sandbox whose zygote just died,
        say): SandboxDied with ran=False, so a one-shot run takes another sandbox."""
        assert self.ended is not None
        ended = self.ended
        deadline = time.monotonic() + timeout_s
        started: dict[str, Any] | None = None
        answer: asyncio.Future[dict[str, Any] | None] = asyncio.ensure_future(self.expect(Op.EXIT, Op.STARTED))
        exited: asyncio.Future[Any] = asyncio.ensure_future(self.exited.wait())

        def take_answer() -> dict[str, Any] | None:
            if not answer.done() or answer.cancelled() or answer.exception() is not None:
                return None
            return answer.result()

        try:
            first: set[asyncio.Future[Any]] = {answer, ended, exited}
            await asyncio.wait(first, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
            if (ended.done() or exited.done()) and not answer.done():  # the peer is gone: its last
                await asyncio.wait({answer}, timeout=KILL_GRACE_S)  # frames are there to read
            msg = take_answer()
            if msg is not None and proto.op_of(msg) == Op.EXIT:
                return msg, False  # refused before it ran; the sandbox lives on
            started = msg
            if not ended.done() and not exited.done():  # the program runs: its end, or the deadline
                end: set[asyncio.Future[Any]] = {ended, exited}
                await asyncio.wait(end, timeout=max(0.0, deadline - time.monotonic()),
                                   return_when=asyncio.FIRST_COMPLETED)
            timed_out = not ended.done() and not exited.done()
            if timed_out:
                self.kill()
                if self.group is not None:  # its processes' exits are all that runs in it now
                    self.group.boost(True)
                await asyncio.wait({ended}, timeout=KILLED_REPLY_WAIT_S)
            self._end(SandboxState.FINISHED, "finished")
            if started is None and not timed_out:
                raise SandboxDied(f"sandbox {self.id} ended before its program started", ran=False,
                                  sandbox_id=self.id)
            report: Mapping[str, Any] | None = ended.result() \
                if ended.done() and not ended.cancelled() and ended.exception() is None else None
            if report is None and exited.done() and not timed_out:
                # without a cgroup, the zygote's report is the only one with the peak memory: wait for it
                report = zombie_end(self.pid, self.pidfd) if self.group is not None else None
                if report is None:  # reaped already (its report is on its way), or no cgroup
                    await asyncio.wait({ended}, timeout=KILL_GRACE_S)
                    report = ended.result() if ended.done() and not ended.cancelled() and \
                        ended.exception() is None else zombie_end(self.pid, self.pidfd)
            if report is None:
                return None, timed_out
            own = dict(report)
            base_cpu = float(started.get("cpu_s", 0.0)) if started else 0.0  # the agent's, before the program
            own["cpu_s"] = max(0.0, float(own.get("cpu_s", 0.0)) - base_cpu)
            return own, timed_out
        finally:
            for fut in (answer, exited):
                fut.cancel()
            with contextlib.suppress(asyncio.CancelledError, SandboxDied):
                await answer
            with contextlib.suppress(asyncio.CancelledError):
                await exited

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

    async def _kill_step(self) -> Mapping[str, Any] | None:
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
        """Read the report a timed-out step's agent still owes (``_kill_step``), with the sandbox's
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
        if self.group:
            self._unboost()  # a reused group starts at the equal weight
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
