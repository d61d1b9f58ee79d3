"""Restore: where sandboxes come from.

A ``WarmSource`` turns a snapshot into running sandboxes: started once per snapshot recipe (the cold
path), then asked to ``spawn`` one sandbox per restore. Each spawned sandbox is a process that has
passed the containment checklist and speaks the agent protocol (runtime/inside/agent.py) on the
socket it is given, starting with its "ready" frame — that contract is all the rest of the runtime
relies on.

``Zygote`` is the source today: a warmed interpreter (the snapshot's warm recipe re-made on this
host) that sandboxes are forked from. A process-memory source — CRIU restoring a checkpointed
process image, N copies from one image, each as pid 1 of its own pid namespace — plugs in here:
``SnapshotView.process_image`` names the image, ``Runtime.warm_source`` chooses the source.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import os
import shutil
import signal
import socket
import uuid
from pathlib import Path
from typing import Any, Protocol

import rollbox.runtime
from rollbox.runtime import owners
from rollbox.runtime.channel import Channel
from rollbox.runtime.errors import IsolationError
from rollbox.runtime.inside import proto
from rollbox.runtime.inside.boot import BOOT as _BOOT
from rollbox.runtime.inside.proto import Op, ZygoteConfig
from rollbox.runtime.snapshot import SnapshotView, host_python

RUNTIME_DIR = str(Path(rollbox.runtime.__file__).resolve().parent)
BASE_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "HOME": "/home/sandbox",
    "USER": "sandbox",
    "LOGNAME": "sandbox",
    "LANG": "C.UTF-8",
    "TMPDIR": "/tmp",
    "PYTHONDONTWRITEBYTECODE": "1",
}


def boot_args(python: str, fd: int, module: str, *args: str) -> list[str]:
    """The command line of a stdlib-only helper: ``rollbox.runtime.inside.<module>.main(fd, *args)``
    under ``python -I -S``, loading this runtime's package from its files (not the caller's path)."""
    return [python, "-I", "-S", "-c", _BOOT, str(fd), RUNTIME_DIR, module, *args]


class WarmSource(Protocol):
    """What the runtime needs from a source of restored sandboxes."""

    view: SnapshotView

    @property
    def alive(self) -> bool: ...

    async def start(self, timeout_s: float = ...) -> None: ...

    async def spawn(self, params: proto.SpawnParams, cgroup_fds: list[int]) -> tuple[int, socket.socket]: ...

    def exit_report(self, pid: int) -> asyncio.Future[dict[str, Any]]:
        """How the sandbox ``pid`` (as ``spawn`` returned it) ended: wait status, CPU seconds and peak
        RSS from its parent's wait4. A one-shot run's program is the sandbox's init, and only the
        source that forked it can reap it."""
        ...

    def forget(self, pid: int, report: asyncio.Future[dict[str, Any]] | None = None) -> None:
        """The sandbox ``pid`` is gone from the runtime: drop what is kept about its exit (only if it
        is still ``report``, the future ``exit_report`` gave for it: pids are reused)."""
        ...

    async def close(self) -> None: ...


class Zygote:
    """The supervisor's handle on one zygote process (a ``WarmSource``)."""

    def __init__(self, view: SnapshotView, *, state_dir: Path, skel: Path, seccomp_bpf: bytes, rootless: bool,
                 user_budgets: dict[str, int] | None = None):
        self.view = view
        self.user_budgets = user_budgets or {}
        self.state_dir = state_dir
        self.skel = skel
        self.seccomp_bpf = seccomp_bpf
        self.rootless = rootless
        self.proc: asyncio.subprocess.Process | None = None
        self.chan: Channel | None = None
        self.staging = state_dir / "zygotes" / f"{owners.tag()}-{uuid.uuid4().hex[:12]}"
        self.warm_info: dict[str, Any] = {}
        self._ids = itertools.count()
        self._waiting: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._exits: dict[int, asyncio.Future[dict[str, Any]]] = {}  # by pid, from spawn until forget
        self._reader: asyncio.Task[None] | None = None
        self._stderr_tail = b""
        self._stderr_task: asyncio.Task[None] | None = None

    @property
    def env(self) -> dict[str, str]:
        env = dict(BASE_ENV)
        prefix_bin = os.path.dirname(self.view.warm.python)
        if not prefix_bin.startswith("/usr/"):
            env["PATH"] = f"{prefix_bin}:{env['PATH']}"
        env.update(self.view.env)
        return env

    async def start(self, timeout_s: float = 300.0) -> None:
        self.staging.mkdir(parents=True, exist_ok=True)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        view = self.view
        # A snapshot with a root of its own (dir, oci, debian bases: no host binds) names an interpreter
        # inside that root: the host's Python makes the view, then the zygote re-executes itself as
        # the snapshot's own interpreter there (zygote.main), so it never depends on what the host has.
        inside = view.warm.python if view.warm_layers and not view.host_binds else None
        try:
            self.proc = await asyncio.create_subprocess_exec(
                *boot_args(host_python() if inside else view.warm.python, theirs.fileno(), "zygote"),
                pass_fds=[theirs.fileno()], env={"LANG": "C.UTF-8"}, stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE, cwd="/", start_new_session=True,
            )
        finally:
            theirs.close()
        self._stderr_task = asyncio.create_task(self._drain_stderr())
        self.chan = Channel(ours)
        warm_layers = list(view.layers[len(view.layers) - view.warm_layers :]) if view.warm_layers else []
        await self.chan.send(ZygoteConfig(
            rootless=self.rootless,
            user_budgets=self.user_budgets,
            staging=str(self.staging),
            skel=str(self.skel),
            layer_root=view.layer_root,
            warm_layers=warm_layers,
            host_binds=list(view.host_binds),
            host_masks=list(view.host_masks),
            sys_path=list(view.warm.sys_path),
            imports=list(view.warm.imports),
            env=self.env,
            seccomp=base64.b64encode(self.seccomp_bpf).decode(),
            runtime_dir=RUNTIME_DIR,
            reexec=inside,
        ).wire())
        try:
            msg = await asyncio.wait_for(self.chan.recv(), timeout_s)
        except TimeoutError:
            msg = None
        if msg is None or proto.op_of(msg) != Op.WARM:
            await self.close()
            tail = self._stderr_tail.decode(errors="replace").strip().splitlines()[-8:]
            raise IsolationError(
                f"zygote for snapshot {view.id!r} failed to start: " + (" | ".join(tail) or "no output"),
                snapshot_id=view.id,
            )
        self.warm_info = msg
        self._reader = asyncio.create_task(self._read_replies())

    async def _drain_stderr(self) -> None:
        assert self.proc and self.proc.stderr
        while chunk := await self.proc.stderr.read(4096):
            self._stderr_tail = (self._stderr_tail + chunk)[-8192:]

    async def _read_replies(self) -> None:
        assert self.chan
        while (msg := await self.chan.recv()) is not None:
            op = proto.op_of(msg)
            if op == Op.EXITED:
                fut = self._exits.get(msg.get("pid", -1))
            else:
                fut = self._waiting.pop(msg.get("req", -1), None)
                if op == Op.SPAWNED and fut and not fut.done():  # before any later frame: its exit may be next
                    self._exits[int(msg["pid"])] = asyncio.get_running_loop().create_future()
            if fut and not fut.done():
                fut.set_result(msg)
        self._fail_pending()

    def _fail_pending(self) -> None:
        """The zygote is gone: no spawn will be answered and no exit reported."""
        for fut in (*self._waiting.values(), *self._exits.values()):
            if not fut.done():
                fut.set_exception(IsolationError("zygote exited", snapshot_id=self.view.id))
                fut.exception()  # retrieved: an exit report nobody awaits is not an error to log
        self._waiting.clear()

    def exit_report(self, pid: int) -> asyncio.Future[dict[str, Any]]:
        fut = self._exits.get(pid)
        if fut is None:  # not spawned by this zygote, or forgotten
            fut = asyncio.get_running_loop().create_future()
            fut.set_exception(IsolationError(f"no sandbox {pid} in this zygote", snapshot_id=self.view.id))
        return fut

    def forget(self, pid: int, report: asyncio.Future[dict[str, Any]] | None = None) -> None:
        fut = self._exits.get(pid)
        if fut is None or (report is not None and fut is not report):  # the pid is another sandbox's now
            return
        del self._exits[pid]
        if not fut.done():
            fut.cancel()

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None and not (self.chan and self.chan.closed)

    async def spawn(self, params: proto.SpawnParams, cgroup_fds: list[int]) -> tuple[int, socket.socket]:
        """Fork one sandbox (``params``: what its SPAWN asks for); returns its pid in the zygote's pid
        namespace and the supervisor's end of its control socket (which carries the host pid with the
        sandbox's first frame). The sandbox moves itself into its cgroup through ``cgroup_fds``
        (cgroup.procs files the supervisor opened) before anything else."""
        if not self.alive or self.chan is None:
            raise IsolationError("zygote is not running", snapshot_id=self.view.id)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        # The kernel stamps what the sandbox sends with its pid as seen from here (the host).
        ours.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        req = next(self._ids)
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._waiting[req] = fut
        try:
            await self.chan.send(proto.spawn_msg(req, params), [theirs.fileno(), *cgroup_fds])
        except BaseException:
            self._waiting.pop(req, None)
            ours.close()
            raise
        finally:
            theirs.close()
        try:
            msg = await asyncio.wait_for(fut, 30)
        except BaseException:
            ours.close()
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self.forget(int(fut.result().get("pid", -1)))
            raise
        if proto.op_of(msg) != Op.SPAWNED:
            ours.close()
            raise IsolationError(f"spawn failed: {msg.get('error')}", snapshot_id=self.view.id)
        return int(msg["pid"]), ours

    async def close(self) -> None:
        if self.chan:
            self.chan.close()
        if self.proc and self.proc.returncode is None:
            # os.kill, not Process.kill: Popen.send_signal polls first (waitpid WNOHANG), which reaps a
            # zygote that has just exited on its own (its channel closed above) before asyncio's child
            # watcher does; the watcher then logs "Unknown child process pid" on stderr (a rootless
            # `rollbox run` on a loaded box). Unreaped, the pid is still this zygote's.
            try:
                os.kill(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.proc:
            await self.proc.wait()
        self._fail_pending()  # its reader is cancelled below: nobody may wait on it after this
        for task in (self._reader, self._stderr_task):
            if task:
                task.cancel()
                try:
                    await task
                except (asyncio.CancelledError, Exception):
                    pass
        shutil.rmtree(self.staging, ignore_errors=True)
