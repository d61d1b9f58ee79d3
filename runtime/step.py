"""A step in a sandbox, as the supervisor runs it: ``StepRunner``.

    result = await StepRunner(sandbox, request, last, deadline).run()

Its parts: ``StepIO`` (the program's pipes: stdin fed, stdout and stderr captured up to the output
cap), the cgroup meter (the counters before and after: CPU, peak memory, OOM kills, pids limit
hits), and how the step ends — one of two ``StepEnd`` strategies: ``AgentEnd`` (a worker forked by
the sandbox's agent, which reports EXIT) or ``InlineEnd`` (a one-shot program that is the sandbox's
init, whose end its zygote reports). The deadline is enforced in one place (``StepRunner.run``): a
strategy's ``wait`` raises TimeoutError at it, and its ``stop`` kills the step. ``build_result``
makes the ExecResult. Limits are enforced from outside the sandbox (the kernel, and kills from the
host), never by code inside it.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import math
import os
import signal
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, cast

from rollbox.runtime.errors import SandboxDied
from rollbox.runtime.inside import proto
from rollbox.runtime.inside.proto import Op
from rollbox.runtime.isolation import cgroupfs
from rollbox.runtime.isolation.cgroups import CgroupStats, Group
from rollbox.runtime.spec import ExecRequest, ExecResult, Limits

if TYPE_CHECKING:
    from rollbox.runtime.execution import Sandbox

__all__ = [
    "KILL_GRACE_S",
    "REPORT_WAIT_S",
    "AgentEnd",
    "Capture",
    "InlineEnd",
    "StepEnd",
    "StepIO",
    "StepOutcome",
    "StepRunner",
    "build_result",
    "descendants",
    "kill_all_but_init",
    "zombie_end",
]

KILL_GRACE_S = 3.0  # after a step's processes were killed, how long the agent has to report its end
# ... of which a timed-out step waits this long (for its read-back files); past it the step returns
# as killed and the agent's report is read before the sandbox's next frame (``Sandbox.settle``).
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


class Capture:
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
    def members() -> list[int]:
        found = group.pids() if group is not None else descendants(init_pid)
        return [p for p in found if p != init_pid]

    return cgroupfs.kill_while_new(members, max_passes)


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


class StepIO:
    """A step's pipes: the program's stdin (its input fed from here; none: /dev/null), stdout and
    stderr (captured up to ``cap`` bytes each). ``theirs``: the ends the program gets (fds 0-2)."""

    def __init__(self, stdin: str | None, cap: int) -> None:
        if stdin:
            in_r, self.in_w = os.pipe2(os.O_CLOEXEC)
            os.set_blocking(self.in_w, False)
        else:  # no input: the program reads EOF from /dev/null (no pipe, no feeder)
            in_r, self.in_w = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC), -1
        self.stdin = stdin
        self.out_r, out_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self.err_r, err_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        os.set_blocking(out_w, True)
        os.set_blocking(err_w, True)
        self.theirs = [in_r, out_w, err_w]
        self.cap = cap
        self.captures: list[Capture] = []
        self.readers: list[asyncio.Task[None]] = []
        self.tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        """Read stdout and stderr, feed stdin."""
        self.captures = [Capture(self.out_r, self.cap), Capture(self.err_r, self.cap)]
        self.readers = [asyncio.create_task(c.run()) for c in self.captures]
        self.tasks = list(self.readers)
        if self.in_w >= 0:
            self.tasks.append(asyncio.create_task(_feed(self.in_w, (self.stdin or "").encode())))

    def close_theirs(self) -> None:
        for fd in self.theirs:
            os.close(fd)

    async def drain(self, timed_out: bool) -> None:
        """What the program's processes wrote is in the pipes: their ends close as they exit."""
        await asyncio.wait(self.readers, timeout=KILLED_DRAIN_S if timed_out else DRAIN_AFTER_EXIT_S)

    async def close(self) -> None:
        for t in self.tasks:
            if not t.done():
                t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for fd in (self.out_r, self.err_r):
            os.close(fd)


def _check_deadline(deadline: float) -> None:
    """A step's end is judged when it is first looked for: past the deadline then, the step timed out,
    even if its program's end is already there to read (a timeout of 0, which SandboxFusion's callers send;
    an event loop busy past a short deadline). It used to count as in time when the end was seen first:
    a fast program was timed out on a quiet host and finished on a busy one."""
    if time.monotonic() >= deadline:
        raise TimeoutError


class StepEnd(Protocol):
    """How a step's end is learnt. ``wait``: its end report (None: the sandbox is gone), or
    TimeoutError at ``deadline``; then ``stop`` kills the step and gives what is known of its end.
    ``close``: after either, whatever the outcome."""

    async def wait(self, deadline: float) -> Mapping[str, Any] | None: ...
    async def stop(self) -> Mapping[str, Any] | None: ...
    async def close(self) -> None: ...


class AgentEnd:
    """A worker of the sandbox's agent runs the step; the agent reports its EXIT."""

    def __init__(self, sb: Sandbox) -> None:
        self.sb = sb

    async def wait(self, deadline: float) -> Mapping[str, Any] | None:
        _check_deadline(deadline)
        return await self.sb.expect(Op.EXIT, timeout_s=max(0.0, deadline - time.monotonic()))

    async def stop(self) -> Mapping[str, Any] | None:
        return await self.sb.kill_step()

    async def close(self) -> None:
        return None


class InlineEnd:
    """The step is run by the sandbox's init: its exit as its parent reaped it. The agent answers
    on the channel first — EXIT if it refused the step (files it could not write), else STARTED
    (with its own CPU so far) — then hangs up and becomes the program. The end is the zygote's
    report of its wait4, or, when the init's pidfd says it exited first (the zygote is busy forking:
    under load a fork waits seconds for the kernel's cgroup lock), its zombie's status read from
    /proc: the reply never waits for the zygote. Timeout: the init is killed, which ends every
    process of the sandbox; the reply does not wait for that teardown. An init that ended without
    STARTED never ran the program (a pooled sandbox whose zygote just died, say): SandboxDied with
    ran=False, so a one-shot run takes another sandbox."""

    def __init__(self, sb: Sandbox) -> None:
        assert sb.ended is not None
        self.sb = sb
        self.ended = sb.ended
        self.started: Mapping[str, Any] | None = None
        self.answer: asyncio.Future[dict[str, Any] | None] | None = None
        self.exited: asyncio.Future[Any] | None = None

    async def wait(self, deadline: float) -> Mapping[str, Any] | None:
        _check_deadline(deadline)
        sb, ended = self.sb, self.ended
        timeout_s = max(0.0, deadline - time.monotonic())
        answer = self.answer = asyncio.ensure_future(sb.expect(Op.EXIT, Op.STARTED))
        exited = self.exited = asyncio.ensure_future(sb.exited.wait())
        first: set[asyncio.Future[Any]] = {answer, ended, exited}
        await asyncio.wait(first, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        if (ended.done() or exited.done()) and not answer.done():  # the peer is gone: its last
            await asyncio.wait({answer}, timeout=KILL_GRACE_S)  # frames are there to read
        msg = None if not answer.done() or answer.cancelled() or answer.exception() is not None \
            else answer.result()
        if msg is not None and proto.op_of(msg) == Op.EXIT:
            return msg  # refused before it ran; the sandbox lives on
        self.started = msg
        if not ended.done() and not exited.done():  # the program runs: its end, or the deadline
            end: set[asyncio.Future[Any]] = {ended, exited}
            await asyncio.wait(end, timeout=max(0.0, deadline - time.monotonic()),
                               return_when=asyncio.FIRST_COMPLETED)
        if not ended.done() and not exited.done():
            raise TimeoutError
        return await self._report(timed_out=False)

    async def stop(self) -> Mapping[str, Any] | None:
        sb = self.sb
        sb.kill()
        if sb.group is not None:  # its processes' exits are all that runs in it now
            sb.group.boost(True)
        await asyncio.wait({self.ended}, timeout=KILLED_REPLY_WAIT_S)
        return await self._report(timed_out=True)

    async def _report(self, timed_out: bool) -> Mapping[str, Any] | None:
        sb, ended, exited = self.sb, self.ended, self.exited
        sb.finished()
        if self.started is None and not timed_out:
            raise SandboxDied(f"sandbox {sb.id} ended before its program started", ran=False, sandbox_id=sb.id)
        report: Mapping[str, Any] | None = ended.result() \
            if ended.done() and not ended.cancelled() and ended.exception() is None else None
        if report is None and exited is not None and exited.done() and not timed_out:
            # without a cgroup, the zygote's report is the only one with the peak memory: wait for it
            report = zombie_end(sb.pid, sb.pidfd) if sb.group is not None else None
            if report is None:  # reaped already (its report is on its way), or no cgroup
                await asyncio.wait({ended}, timeout=KILL_GRACE_S)
                report = ended.result() if ended.done() and not ended.cancelled() and \
                    ended.exception() is None else zombie_end(sb.pid, sb.pidfd)
        if report is None:
            return None
        own = dict(report)
        base_cpu = float(self.started.get("cpu_s", 0.0)) if self.started else 0.0  # the agent's, before the program
        own["cpu_s"] = max(0.0, float(own.get("cpu_s", 0.0)) - base_cpu)
        return own

    async def close(self) -> None:
        for fut in (self.answer, self.exited):
            if fut is not None:
                fut.cancel()
        if self.answer is not None:
            with contextlib.suppress(asyncio.CancelledError, SandboxDied):
                await self.answer
        if self.exited is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self.exited


@dataclass(frozen=True)
class StepOutcome:
    """How a step ended, from its end report and its cgroup's counters (``measure``)."""

    report: Mapping[str, Any] | None  # None: the sandbox died under the step
    timed_out: bool
    exit_code: int
    signal: str | None
    files: dict[str, str | None]
    cpu_s: float
    peak_memory_bytes: int
    oom_killed: bool
    pids_limit_hit: bool
    after: CgroupStats | None  # the group's counters after the step

    @property
    def alone(self) -> bool:
        """Nothing of the step outlived it (the agent's word)."""
        return not self.timed_out and self.report is not None and self.report.get("alone") is True

    @property
    def init_ended(self) -> bool:
        return self.report is not None and proto.init_ended(self.report)


def measure(report: Mapping[str, Any] | None, timed_out: bool, before: CgroupStats | None,
            after: CgroupStats | None, limits: Limits, nproc_first: bool) -> StepOutcome:
    """The cgroup meter: what the step used, from the counters before and after it (else the end
    report's word, untrusted without a cgroup)."""
    if report is None:
        # The agent is gone: the sandbox died under this exec (its init was OOM-killed, say).
        exit_code, sig = 137, "SIGKILL"  # type: tuple[int, str | None]
        files: dict[str, str | None] = {}
        cpu, peak = 0.0, 0
    else:
        exit_code, sig = _exit_code(int(report.get("status", 255 << 8)))
        files = report.get("files") or {}
        cpu, peak = float(report.get("cpu_s", 0.0)), int(report.get("maxrss_bytes", 0))
        if not math.isfinite(cpu) or cpu < 0:  # (the agent's word, without a cgroup: untrusted)
            cpu = 0.0
    oom = pids_hit = False
    if before and after:
        cpu = after.cpu_s - before.cpu_s
        peak = after.peak_memory_bytes
        oom = after.oom_kills > before.oom_kills
        pids_hit = after.pids_max_hits > before.pids_max_hits or (
            nproc_first and before.pids_peak < limits.pids_max <= after.pids_peak)
    return StepOutcome(report, timed_out, exit_code, sig, files, max(cpu, 0.0), peak, oom, pids_hit, after)


def build_result(sb: Sandbox, outcome: StepOutcome, io: StepIO, wall: float) -> ExecResult:
    """The step's ExecResult."""
    stdout, stderr = bytes(io.captures[0].buf), bytes(io.captures[1].buf)
    report = outcome.report
    if report is not None and report.get("error"):  # (nothing ran: the agent says why, naming the file)
        stderr += f"rollbox: {report['error']}\n".encode()
    return ExecResult(
        sandbox_id=sb.id,
        snapshot_id=sb.view.id,
        forked_from=sb.forked_from,
        exit_code=outcome.exit_code,
        signal=outcome.signal,
        stdout=stdout.decode("utf-8", "replace"),
        stderr=stderr.decode("utf-8", "replace"),
        stdout_truncated=io.captures[0].truncated,
        stderr_truncated=io.captures[1].truncated,
        timed_out=outcome.timed_out,
        oom_killed=outcome.oom_killed,
        pids_limit_hit=outcome.pids_limit_hit,
        wall_s=round(wall, 6),
        cpu_s=round(outcome.cpu_s, 6),
        peak_memory_bytes=outcome.peak_memory_bytes,
        files=outcome.files,
        sandbox_alive=report is not None and sb.is_live,
    )


class StepRunner:
    """One step: ``last`` says no step follows (one-shot runs): unless files are to be read back
    after it, the program runs as the sandbox's init itself (one process fewer to fork and reap;
    like ``docker run`` without ``--init``), and its end ends the sandbox. ``deadline``: monotonic."""

    def __init__(self, sb: Sandbox, req: ExecRequest, last: bool, deadline: float) -> None:
        self.sb, self.req, self.last, self.deadline = sb, req, last, deadline

    def _message(self, inline: bool) -> proto.ExecMsg:
        sb, req, last = self.sb, self.req, self.last
        now = time.monotonic()
        spare = not last and sb.step_ended is not None and now - sb.step_ended <= SPARE_WINDOW_S
        msg = proto.ExecMsg(op=Op.EXEC, env=req.env, files=req.files, read_files=req.read_files,
                            last=last, inline=inline, spare=spare)
        if req.binary_files:
            msg["binary"] = {path: [b64, mode] for path, (b64, mode) in req.binary_files.items()}
        if req.code is not None:
            msg["code"] = req.code
        else:
            msg["command"] = cast(str, req.command)
        return msg

    async def run(self) -> ExecResult:
        sb = self.sb
        before = sb.begin_step()  # (unboosted, and the meter's baseline)
        io = StepIO(self.req.stdin, sb.limits.output_max_bytes)
        inline = self.last and not self.req.read_files and sb.ended is not None
        end: StepEnd = InlineEnd(sb) if inline else AgentEnd(sb)
        msg = self._message(inline)
        t0 = time.monotonic()
        io.start()
        timed_out = False
        report: Mapping[str, Any] | None = None
        try:
            try:
                await sb.chan.send(msg, io.theirs)
            except OSError as exc:  # the agent is gone (its init died): nothing ran
                raise sb.lost_before_step() from exc
            finally:
                io.close_theirs()
            try:
                report = await end.wait(self.deadline)
            except TimeoutError:  # the one place a step's deadline is enforced
                timed_out = True
                report = await end.stop()
            finally:
                await end.close()
            wall = time.monotonic() - t0
            await io.drain(timed_out)
        finally:
            await io.close()
        after = sb.group.stats() if sb.group else None
        outcome = measure(report, timed_out, before, after, sb.limits, sb.nproc_first)
        sb.end_step(outcome)
        return build_result(sb, outcome, io, wall)
