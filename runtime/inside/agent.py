"""The sandbox agent: pid 1 of a sandbox, forked from a zygote, already contained.

It runs no untrusted code itself. For each exec it forks a worker (the warm interpreter, copy-on-write)
that runs the code or command with the supervisor's pipes as fds 0-2; it reaps every process (it is
init), and on the supervisor's word kills everything else in the sandbox (kill(-1) from init spares
only init). Stdlib only.
"""

from __future__ import annotations

import _signal  # type: ignore[import-not-found]  # (the C module under signal: no stubs)
import atexit
import binascii
import builtins
import errno
import linecache
import os
import resource
import shutil
import signal
import socket
import sys
import threading
import traceback
import types
from collections.abc import Callable, Mapping
from typing import Any

from rollbox.runtime.inside import proto
from rollbox.runtime.inside.proto import DiffEntry, Kind, Op

HOME = "/home/sandbox"
MAX_READ_FILE_BYTES = 16 * 1024 * 1024
MAX_READ_TOTAL_BYTES = 32 * 1024 * 1024  # all read-back files of one exec (the reply frame is capped)


def _noop(_sig: int, _frame: Any) -> None:
    return None


CODE_NAME = "<string>"  # the file name of a step's code, as python -c names its code


def _uncaught(exc: BaseException) -> None:
    """Print an exception the user's code did not catch as python does, without this module's
    frames: the user sees their code's frames only. Through ``sys.excepthook`` if the code set one;
    python's own is the traceback module's printing (which, unlike the built-in hook of pythons
    before 3.13, shows the lines of "<string>")."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next
    exc.__traceback__ = tb  # (the built-in hook prints the exception's own traceback, not its argument)
    try:
        if sys.excepthook is sys.__excepthook__:
            traceback.print_exception(type(exc), exc, tb)
        else:
            sys.excepthook(type(exc), exc, tb)
    except BaseException:
        traceback.print_exception(type(exc), exc, tb)


# Made by the zygote once warm (``warmed``), so that a sandbox's program finds them ready: each
# of these steps in a fresh copy-on-write fork writes pages all over the warm heap (copying each), ~150
# page faults per sandbox together. WARM_ENV: os.environ as the warm-up left it; STD_STREAMS: the
# program's sys.stdin, sys.stdout and sys.stderr, unused until then (the zygote's fds 0, 1 and 2 are
# /dev/null and a pipe, as the program's are: the same buffering as if they were opened there).
WARM_ENV: dict[str, str] | None = None
STD_STREAMS: tuple[Any, Any, Any] | None = None


def _std_streams() -> tuple[Any, Any, Any]:
    return (open(0, closefd=False),
            open(1, "w", closefd=False),
            open(2, "w", closefd=False, errors="backslashreplace", buffering=1))


def warmed() -> None:
    """(In the zygote, after its warm-up) make what every sandbox's program starts with."""
    global WARM_ENV, STD_STREAMS
    WARM_ENV = dict(os.environ)
    STD_STREAMS = _std_streams()


def _run_code(src: str, env: dict[str, str]) -> int:
    if env != WARM_ENV:
        os.environ.clear()
        os.environ.update(env)
    sys.argv = ["-c"]
    sys.path.insert(0, "")
    sys.stdin, sys.stdout, sys.stderr = STD_STREAMS or _std_streams()
    np_random = sys.modules.get("numpy.random")
    if np_random is not None:  # forks share the zygote's legacy numpy RNG state: give each run its own
        np_random.seed()
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = builtins
    sys.modules["__main__"] = main
    # As ``python -c``: the code is "<string>", its lines shown in tracebacks (as python 3.13 does)
    linecache.cache[CODE_NAME] = (len(src), None, src.splitlines(True), CODE_NAME)
    sys.unraisablehook = _unraisable  # (an exception in __del__ or at exit shows those lines too)
    rc = 0
    try:
        exec(compile(src, CODE_NAME, "exec"), main.__dict__)
    except SystemExit as e:
        if e.code is None:
            rc = 0
        elif isinstance(e.code, int):
            rc = e.code & 0xFF
        else:
            print(e.code, file=sys.stderr)
            rc = 1
    except BaseException as exc:
        _uncaught(exc)
        rc = 1
    try:
        threading._shutdown()  # type: ignore[attr-defined]  # wait for non-daemon threads, as python does
        atexit._run_exitfuncs()
    except BaseException as exc:
        _uncaught(exc)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            pass
    return rc


# Signals whose default action ends a process. The init of a pid namespace ignores them unless it
# handles them, so a one-shot program (run as init) that sends itself one would never stop: it gets a
# handler that ends it as the signal would have (exit status 128 + signal; a forked child, which may
# die by the signal itself, is killed by it).
_ENDING_SIGNALS = tuple(int(s) for s in (
    signal.SIGHUP, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGALRM, signal.SIGVTALRM, signal.SIGPROF,
    signal.SIGQUIT, signal.SIGIO, signal.SIGPWR))
# In a sandbox's processes, signal handlers are set through _signal (ints), not signal.signal, whose
# enum conversions write pages all over the warm heap (each a copy-on-write fault in a fresh fork).
_SIG_DFL, _SIGCHLD, _SIGPIPE = int(signal.SIG_DFL), int(signal.SIGCHLD), int(signal.SIGPIPE)


def _end_like_default(sig: int, _frame: Any) -> None:
    if os.getpid() != 1:
        _signal.signal(sig, _SIG_DFL)
        os.kill(os.getpid(), sig)
        return
    os._exit(128 + sig)


def _unraisable(u: Any) -> None:
    """python's default ``sys.unraisablehook`` (an exception raised in ``__del__`` or an atexit
    callback), printed by the traceback module, which shows the lines of "<string>"."""
    if u.object is not None:
        print(f"{u.err_msg or 'Exception ignored in'}: {u.object!r}", file=sys.stderr)
    elif u.err_msg:
        print(u.err_msg, file=sys.stderr)
    traceback.print_exception(u.exc_type, u.exc_value, u.exc_traceback)
    sys.stderr.flush()


def _worker(msg: dict[str, Any], fds: list[int], env: dict[str, str]) -> None:
    """In the forked worker: wire the pipes, then become the user's program. Never returns."""
    try:
        signal.set_wakeup_fd(-1)
        _signal.signal(_SIGCHLD, _SIG_DFL)
        os.setsid()
        try:  # the OOM killer takes the user's program, not init (os.open: no io objects made)
            oom = os.open("/proc/self/oom_score_adj", os.O_WRONLY)
            try:
                os.write(oom, b"1000")
            finally:
                os.close(oom)
        except OSError:
            pass
        for target, fd in enumerate(fds[:3]):
            os.dup2(fd, target)
        os.closerange(3, 1 << 16)
        os.chdir(HOME)
        run_env = dict(env)
        run_env.update(msg.get("env") or {})
        if msg.get("command") is not None:
            _signal.signal(_SIGPIPE, _SIG_DFL)
            os.execve("/bin/sh", ["sh", "-c", msg["command"]], run_env)
        from rollbox.runtime.isolation import libc

        libc.prctl(libc.PR_SET_DUMPABLE, 1)
        if os.getpid() == 1:
            for sig in _ENDING_SIGNALS:
                _signal.signal(sig, _end_like_default)
        os._exit(_run_code(msg["code"], run_env))
    except BaseException as exc:
        try:
            os.write(2, f"rollbox: could not start: {exc}\n".encode())
        finally:
            os._exit(127)


class FileNotWritten(Exception):
    """A file of an exec's ``files`` could not be written: the message names it and says why."""


def _write_files(files: dict[str, str]) -> None:
    """Write an exec's files in order (a relative path is under HOME), making missing parent
    directories; the first one that cannot be written stops the step (FileNotWritten)."""
    for path, content in files.items():
        full = path if path.startswith("/") else os.path.join(HOME, path)
        try:
            os.makedirs(os.path.dirname(full) or "/", exist_ok=True)
            with open(full, "w", encoding="utf-8") as f:
                f.write(content)
        except OSError as exc:
            raise FileNotWritten(f"files[{path!r}]: cannot write {full}: {_why_not(full, exc)}") from exc


def _write_binary(files: dict[str, list[Any]]) -> None:
    """Write an exec's binary files (path -> [base64, mode]), as ``_write_files`` does its text ones."""
    for path, (b64, mode) in files.items():
        full = path if path.startswith("/") else os.path.join(HOME, path)
        try:
            os.makedirs(os.path.dirname(full) or "/", exist_ok=True)
            fd = os.open(full, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            try:
                os.fchmod(fd, int(mode) & 0o7777)
                data = memoryview(binascii.a2b_base64(b64))
                while data:
                    data = data[os.write(fd, data):]
            finally:
                os.close(fd)
        except (OSError, binascii.Error, ValueError) as exc:
            why = _why_not(full, exc) if isinstance(exc, OSError) else f"not base64: {exc}"
            raise FileNotWritten(f"files[{path!r}]: cannot write {full}: {why}") from exc


def _why_not(full: str, exc: OSError) -> str:
    """Why a file could not be written, naming the path in the way (a file where a directory must be)."""
    if exc.errno in (errno.EEXIST, errno.ENOTDIR):
        parent = os.path.dirname(full)
        while parent not in ("", "/"):
            if os.path.lexists(parent) and not os.path.isdir(parent):
                return f"{parent} is a file, not a directory"
            parent = os.path.dirname(parent)
    if exc.errno == errno.EISDIR:
        return "a directory is there"
    return exc.strerror or str(exc)


def _read_files(paths: list[str]) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    budget = MAX_READ_TOTAL_BYTES
    for path in paths:
        full = path if path.startswith("/") else os.path.join(HOME, path)
        try:
            with open(full, "rb") as f:
                data = f.read(min(MAX_READ_FILE_BYTES, budget))
        except OSError:
            out[path] = None
            continue
        budget -= len(data)
        out[path] = data.decode("utf-8", "replace")
    return out


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.unlink(path)


def _inject(msg: Mapping[str, Any], fds: list[int]) -> None:
    """Make this sandbox's files those of a forked parent: apply its overlay diff (opaque dirs
    emptied, whiteouts deleted, then its entries recreated, file contents copied in the kernel from
    the passed memfd), as the sandbox user. Metadata the user may not set (on a root-owned
    directory such as /tmp) is left as it is."""
    src = fds[0] if fds else -1
    try:
        for path in msg.get("opaque") or []:
            if os.path.isdir(path):
                for name in os.listdir(path):
                    _remove(os.path.join(path, name))
        for path in msg.get("whiteouts") or []:
            _remove(path)
        dirs = []
        for e in proto.inject_entries(msg):
            path, kind = e.path, e.kind
            if kind == Kind.DIR:
                if not os.path.isdir(path):
                    if os.path.lexists(path):
                        _remove(path)
                    os.mkdir(path, 0o700)
                dirs.append(e)
                continue
            if os.path.lexists(path):
                _remove(path)
            if kind == Kind.SYMLINK:
                os.symlink(e.link, path)
            elif kind == Kind.HARDLINK:
                os.link(e.link, path)
            else:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                try:
                    done, n = 0, e.size
                    while done < n:
                        sent = os.sendfile(fd, src, e.offset + done, n - done)
                        if sent == 0:
                            raise OSError(f"short diff for {path}")
                        done += sent
                    os.fchmod(fd, e.mode)
                    os.utime(fd, (e.mtime, e.mtime))
                finally:
                    os.close(fd)
        for e in reversed(dirs):  # modes and mtimes last: creating the files changed them
            try:
                os.chmod(e.path, e.mode)
                os.utime(e.path, (e.mtime, e.mtime))
            except PermissionError:
                pass
    finally:
        for fd in fds:
            os.close(fd)


def _prime() -> None:
    """Run the fork path (frame decode, _inject, reply encode) once on entries that change nothing, so
    the copy-on-write faults it takes in this fresh fork of the zygote (its objects' refcounts are
    written) are paid now, while pooled, and not by the fork that will use this sandbox."""
    reader = proto.Reader()
    reader.feed(proto.encode(proto.inject_msg([DiffEntry("/", Kind.DIR, 0o755, 0.0)], [], [])), [])
    msg = reader.next() or {}
    msg["entries"].append(DiffEntry("/proc/.rollbox-prime", Kind.FILE, 0o600, 0.0).wire())
    try:
        _inject(msg, [])
    except OSError:  # the file entry cannot be made under /proc: that is the point
        pass
    proto.encode(proto.InjectedMsg(op=Op.INJECTED))


def _spare_main(chan: socket.socket, env: dict[str, str]) -> None:
    """A worker forked ahead of demand: it waits for its exec, so the fork is off the critical path."""
    signal.set_wakeup_fd(-1)
    _signal.signal(_SIGCHLD, _SIG_DFL)
    keep = chan.fileno()
    os.closerange(3, keep)
    os.closerange(keep + 1, 1 << 16)
    reader = proto.Reader()
    try:
        msg = proto.recv(chan, reader)
    except OSError:
        msg = None
    if msg is None:
        os._exit(0)
    _worker(msg, reader.take_fds(), env)


def serve(sock: socket.socket, upper_fd: int, env: dict[str, str], probed: dict[str, Any] | None = None, *,
          bare: bool = False) -> None:
    """The agent loop. Never returns: when the supervisor hangs up, the sandbox ends. ``probed``: what
    containment put in force, read back (runtime/inside/probe.py), sent with READY when asked for.
    ``bare``: this process was forked without Python's fork handling (libc.fork_bare)."""
    devnull = os.open("/dev/null", os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    os.close(devnull)
    wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    _signal.signal(_SIGCHLD, _noop)
    signal.set_wakeup_fd(wake_w)
    ready = proto.ReadyMsg(op=Op.READY) if probed is None else proto.ReadyMsg(op=Op.READY, probe=probed)
    proto.send(sock, ready, [upper_fd])
    os.close(upper_fd)
    Agent(sock, env, bare).run(wake_r)


class Agent:
    """A sandbox's init after containment: one method per op the supervisor sends (``handlers``).
    It holds the running step's worker, an idle spare worker forked ahead of a step, and the step's
    EXEC frame (what to read back when its worker ends)."""

    def __init__(self, sock: socket.socket, env: dict[str, str], bare: bool = False) -> None:
        self.sock = sock
        self.env = env
        self.bare = bare  # forked without Python's fork handling: it runs that before any user code
        self.reader = proto.Reader()
        self.worker: int | None = None
        self.spare: tuple[int, socket.socket] | None = None
        self.pending: dict[str, Any] = {}  # the running (or last) step's EXEC
        # This process moved itself into its cgroup before anything else (zygote.contain), so every
        # fork is counted. When asked for (SPARE: a step is on its way) or when an exec says its
        # steps come fast, keep one spare worker while idle. A pooled sandbox has none: a one-shot
        # run needs none.
        self.wants_spare = False
        self.handlers: dict[str, Callable[[dict[str, Any]], None]] = {
            Op.EXEC: self.on_exec, Op.SPARE: self.on_spare, Op.PRIME: self.on_prime, Op.KILL: self.on_kill,
            Op.PING: self.on_ping, Op.INJECT: self.on_inject, Op.FREEZE: self.on_freeze, Op.THAW: self.on_thaw,
        }

    def run(self, wake_r: int) -> None:
        """Serve frames in order, reaping children as they exit. Never returns."""
        sock, reader = self.sock, self.reader
        while True:
            if self.wants_spare and self.spare is None and self.worker is None and not self.pending.get("last"):
                self.fork_spare()
            readable, exited = proto.wait(sock, wake_r)
            if exited:
                self.reap()
            if readable:
                data, anc, _f, _a = sock.recvmsg(1 << 16, proto.ANC_SPACE, proto.RECV_FLAGS)
                if not data:
                    self.kill_all()
                    os._exit(0)
                reader.feed(data, anc)
                while (msg := reader.next()) is not None:
                    handler = self.handlers.get(proto.op_of(msg) or "")
                    if handler is not None:
                        handler(msg)

    # ------------------------------------------------------------- ops
    def on_exec(self, msg: dict[str, Any]) -> None:
        self.pending = msg
        self.wants_spare = bool(msg.get("spare"))  # the steps come fast: the next one is near
        self.start(msg, self.reader.take_fds())

    def on_spare(self, _msg: dict[str, Any]) -> None:
        self.wants_spare = True

    def on_prime(self, _msg: dict[str, Any]) -> None:
        _prime()

    def on_kill(self, _msg: dict[str, Any]) -> None:
        self.kill_all()
        # no spare worker after a timed-out step: the supervisor reads the sandbox's files as soon as
        # its cgroup holds this init alone (Runtime.frozen)
        self.wants_spare = False

    def on_ping(self, _msg: dict[str, Any]) -> None:
        proto.send(self.sock, proto.bare(Op.PONG))

    def on_inject(self, msg: dict[str, Any]) -> None:
        try:
            _inject(msg, self.reader.take_fds())
            proto.send(self.sock, proto.InjectedMsg(op=Op.INJECTED))
        except Exception as exc:
            proto.send(self.sock, proto.InjectedMsg(op=Op.INJECTED, error=f"{type(exc).__name__}: {exc}"))

    def on_freeze(self, _msg: dict[str, Any]) -> None:
        """Hold every other process still while the files are read."""
        try:
            os.kill(-1, signal.SIGSTOP)
        except ProcessLookupError:
            pass
        proto.send(self.sock, proto.bare(Op.FROZEN))

    def on_thaw(self, _msg: dict[str, Any]) -> None:
        try:  # (no answer: frames are handled in order)
            os.kill(-1, signal.SIGCONT)
        except ProcessLookupError:
            pass

    # ------------------------------------------------------------- processes
    def fork_spare(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            pid = os.fork()
        except OSError:  # the pids limit is full (a fork bomb still running): fork on demand later
            ours.close()
            theirs.close()
            return
        if pid == 0:
            ours.close()
            _spare_main(theirs, self.env)
        theirs.close()
        self.spare = (pid, ours)

    def reap(self) -> None:
        while True:
            try:
                pid, status, ru = os.wait4(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if self.spare is not None and pid == self.spare[0]:
                self.spare[1].close()
                self.spare = None
            if pid == self.worker:
                self.worker = None
                files = _read_files(self.pending.get("read_files") or [])
                proto.send(self.sock, proto.exit_report(
                    Op.EXIT, status, ru.ru_utime + ru.ru_stime, ru.ru_maxrss * 1024, files=files, alone=self.alone()))

    def alone(self) -> bool:
        """Nothing of the step outlived it: this pid namespace holds only init (and an idle spare).
        Orphans are this init's children before their parent is reaped, so none is missed."""
        keep = {1, self.spare[0]} if self.spare is not None else {1}
        try:
            return all(int(p) in keep for p in os.listdir("/proc") if p.isdigit())
        except OSError:
            return False

    def kill_all(self) -> None:
        for _ in range(1000):
            try:
                os.kill(-1, signal.SIGKILL)
            except ProcessLookupError:
                break
            self.reap()
        self.reap()

    def start(self, msg: dict[str, Any], fds: list[int]) -> None:
        try:
            _write_files(msg.get("files") or {})
            _write_binary(msg.get("binary") or {})
            if msg.get("inline"):
                # A one-shot step: the program becomes this process (pid 1). _worker closes the
                # supervisor's channel first; the zygote reports the exit; its end ends the sandbox.
                # STARTED tells the supervisor the program ran (else a run may take another sandbox)
                # and what the agent had used so far (CPU is metered from the zygote's report).
                me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
                cpu = me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime
                proto.send(self.sock, proto.StartedMsg(op=Op.STARTED, cpu_s=cpu))
                if self.bare:  # as os.fork would have done (random reseeds): the user's code runs here
                    from rollbox.runtime.isolation import libc

                    libc.after_fork_child()
                _worker(msg, fds, self.env)
            pid = 0
            if self.spare is not None:
                pid, chan = self.spare
                self.spare = None
                try:
                    proto.send(chan, msg, fds)
                except OSError:  # the spare died (killed with everything else): fork afresh
                    pid = 0
                chan.close()
            if pid == 0:
                pid = os.fork()
                if pid == 0:
                    _worker(msg, fds, self.env)
        except Exception as exc:  # files that cannot be written, no process to fork: the step is refused
            if isinstance(exc, FileNotWritten):
                why = f"{exc}; the program did not run"
            else:
                why = exc.strerror if isinstance(exc, OSError) and exc.strerror else f"{type(exc).__name__}: {exc}"
                why = f"could not start the process: {why}"
            proto.send(self.sock, proto.exit_report(Op.EXIT, 126 << 8, files={}, error=why))
            return
        finally:
            for fd in fds:
                os.close(fd)
        self.worker = pid
