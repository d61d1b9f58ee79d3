"""The zygote: a warmed-up interpreter that sandboxes are forked from (stdlib only).

Started by the supervisor as ``python -I -S`` with a control socket. It enters its own mount
namespace (and, rootless, its own user namespace), pivots into the snapshot's read-only view, imports
the warm recipe, then forks one sandbox per ``spawn`` request: copy-on-write memory is the in-memory
snapshot. ``contain()`` below is the checklist every sandbox passes before its agent starts.
"""

from __future__ import annotations

import base64
import gc
import importlib
import json
import os
import signal
import socket
import sys
import threading
from typing import Any

from rollbox.runtime.inside import agent, probe, proto
from rollbox.runtime.inside.boot import BOOT
from rollbox.runtime.inside.proto import Op, ZygoteConfig
from rollbox.runtime.isolation import libc, mounts, rlimits, seccomp, users


def contain(cfg: ZygoteConfig, bpf: libc.SeccompProgram, req: dict[str, Any], cgroup_fds: list[int]) -> int:
    """Checklist, in order; every step is required (a failure ends this sandbox, reported by the
    supervisor as an isolation error naming the syscall). ``req``: its SPAWN. Returns the upper-layer fd."""
    libc.prctl(libc.PR_SET_PDEATHSIG, signal.SIGKILL)
    userns_fd = cgroup_fds.pop(0) if req.get("userns") else -1
    netns_fd = cgroup_fds.pop(0) if req.get("netns") else -1
    for fd in cgroup_fds:  # into its cgroup first: everything after is counted and limited
        os.write(fd, b"0")
        os.close(fd)
    if netns_fd >= 0:  # an empty one made (or left empty by its last sandbox) on the host: joined
        libc.unshare(libc.CLONE_NEWNS | libc.CLONE_NEWIPC | libc.CLONE_NEWUTS)
        libc.setns(netns_fd, libc.CLONE_NEWNET)
        os.close(netns_fd)
    else:
        libc.unshare(libc.CLONE_NEWNS | libc.CLONE_NEWIPC | libc.CLONE_NEWUTS | libc.CLONE_NEWNET)
    upper_fd = mounts.build_sandbox_root(
        req["layers"], cfg.host_binds, cfg.host_masks, req["disk_bytes"], cfg.rootless, req.get("idmapped"),
    )
    libc.sethostname("sandbox")
    # --- privileges drop here: from now on the process is the unprivileged sandbox user ---
    users.drop_privileges(cfg.rootless, userns_fd, cfg.user_budgets)
    # After the drop: rootless, RLIMIT_NPROC then counts this sandbox's own user namespace only.
    rlimits.apply(req["nofile"], req["fsize_bytes"], req.get("nproc"), req.get("data_bytes"), req.get("nice"),
                  req.get("as_bytes"))
    libc.prctl(libc.PR_SET_PDEATHSIG, signal.SIGKILL)  # cleared by the credential change
    libc.prctl(libc.PR_SET_DUMPABLE, 0)
    seccomp.apply(bpf)
    return upper_fd


def _sandbox_main(cfg: ZygoteConfig, bpf: libc.SeccompProgram, req: dict[str, Any], sock: socket.socket,
                  cgroup_fds: list[int], bare: bool) -> None:
    try:
        upper_fd = contain(cfg, bpf, req, cgroup_fds)
    except BaseException as exc:
        try:
            proto.send(sock, proto.FailedMsg(op=Op.FAILED, error=f"{type(exc).__name__}: {exc}"))
        finally:
            os._exit(70)
    facts = None
    if req.get("probe"):  # asked of a zygote's first sandboxes: what is in force, read back from inside
        try:
            facts = probe.read_back()
        except Exception as exc:
            facts = {"errors": {"probe": f"{type(exc).__name__}: {exc}"}}
    try:
        agent.serve(sock, upper_fd, cfg.env, facts, bare=bare)
    finally:
        os._exit(71)


def _reexec(ctl: socket.socket, cfg: ZygoteConfig, pidns: int) -> None:
    """Become the snapshot's own interpreter (``cfg.reexec``, a path inside the view just pivoted
    into), loading this code from ``mounts.RUNTIME``; the configuration goes along in a memfd, the
    control socket and the pid namespace fd stay open across the exec. Never returns."""
    python = cfg.reexec
    assert python is not None
    fd = os.memfd_create("rollbox-zygote-cfg", 0)  # inherited: no MFD_CLOEXEC
    with open(fd, "wb", closefd=False) as f:
        f.write(json.dumps(cfg.wire()).encode())
    os.lseek(fd, 0, os.SEEK_SET)
    os.set_inheritable(ctl.fileno(), True)
    os.set_inheritable(pidns, True)
    sys.stdout.flush()
    try:
        os.execve(python, [python, "-I", "-S", "-c", BOOT, str(ctl.fileno()), mounts.RUNTIME, "zygote",
                           f"{fd},{pidns}"], {"LANG": "C.UTF-8"})
    except OSError as exc:
        sys.stderr.write(f"the snapshot's interpreter {python} cannot run inside its root: {exc}\n")
        sys.stderr.flush()
        os._exit(70)


def main(ctl_fd: int, resume: str = "") -> None:
    ctl = socket.socket(fileno=ctl_fd)
    reader = proto.Reader()
    if resume:  # re-executed as the snapshot's interpreter inside its view (see _reexec)
        cfg_fd, pidns = (int(x) for x in resume.split(","))
        with open(cfg_fd, "rb") as f:
            cfg = ZygoteConfig.parse(json.loads(f.read()))
        os.set_inheritable(ctl_fd, False)
        os.set_inheritable(pidns, False)
        libc.prctl(libc.PR_SET_PDEATHSIG, signal.SIGKILL)
        _serve(ctl, reader, cfg, pidns)
        return
    first = proto.recv(ctl, reader)
    if first is None:
        return
    cfg = ZygoteConfig.parse(first)
    libc.prctl(libc.PR_SET_PDEATHSIG, signal.SIGKILL)
    if cfg.rootless:
        # Root of a new user namespace. Its own pid namespace too: setns() back into the pid
        # namespace we fork sandboxes from needs CAP_SYS_ADMIN over it, which only one we own gives.
        users.enter_rootless_userns()
        libc.unshare(libc.CLONE_NEWPID)
        holder = os.fork()
        if holder:  # stays outside, mirroring the zygote's exit for the supervisor
            ctl.close()
            _, status = os.waitpid(holder, 0)
            os._exit(os.waitstatus_to_exitcode(status) & 0xFF)
        libc.prctl(libc.PR_SET_PDEATHSIG, signal.SIGKILL)
    else:
        libc.unshare(libc.CLONE_NEWNS)
    pidns = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
    mounts.prepare_zygote_view(
        cfg.staging, cfg.skel, cfg.layer_root, cfg.warm_layers, cfg.host_binds,
        cfg.host_masks, cfg.runtime_dir if cfg.reexec else None,
    )
    if cfg.reexec:
        _reexec(ctl, cfg, pidns)
    _serve(ctl, reader, cfg, pidns)


def _serve(ctl: socket.socket, reader: proto.Reader, cfg: ZygoteConfig, pidns: int) -> None:
    """In the snapshot's view: warm up, then fork a sandbox per spawn request until the socket closes."""
    bpf = libc.SeccompProgram(base64.b64decode(cfg.seccomp))
    versions = _warm_up(cfg)
    wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_w)
    children: set[int] = set()
    # per user slot (its host uid): the view's layer store and skeleton seen through its id map,
    # made on the slot's first sandbox and shared by every later one (runtime/slots.py)
    idmapped: dict[int, tuple[int, int]] = {}
    proto.send(ctl, proto.WarmMsg(op=Op.WARM, python=sys.version.split()[0], modules=versions, pid=os.getpid()))

    while True:
        readable, exited = proto.wait(ctl, wake_r)
        if exited:
            _reap(ctl, children)
        if not readable:
            continue
        data, anc, _f, _a = ctl.recvmsg(1 << 16, proto.ANC_SPACE, proto.RECV_FLAGS)
        if not data:
            for pid in children:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            os._exit(0)
        reader.feed(data, anc)
        while (msg := reader.next()) is not None:
            fds = reader.take_fds()  # the sandbox's socket, then its cgroup.procs files
            _spawn(ctl, cfg, bpf, pidns, msg, fds, idmapped, children)


def _warm_up(cfg: ZygoteConfig) -> dict[str, str]:
    """The environment and imports of the warm recipe; returns the imported modules' versions."""
    os.environ.clear()
    os.environ.update(cfg.env)
    # Leave the supervisor's package path out of what sandboxes see.
    for p in cfg.drop_sys_path:
        while p in sys.path:
            sys.path.remove(p)
    sys.path.extend(cfg.sys_path)
    versions: dict[str, str] = {}
    for name in cfg.imports:
        mod = importlib.import_module(name)
        versions[name] = str(getattr(mod, "__version__", ""))
    # The compiler's AST types are made lazily by the first compile(): make them here, once, rather
    # than in every sandbox's first run (measured ~8 % of a one-shot run's CPU in the sandbox).
    compile("pass", "<warm>", "exec")
    sys.stdout.flush()
    sys.stderr.flush()
    agent.warmed()
    gc.collect()
    gc.freeze()  # keep the warm heap's pages shared between sandboxes
    return versions


def _reap(ctl: socket.socket, children: set[int]) -> None:
    """Reap every sandbox init that exited, reporting each (EXITED)."""
    while True:
        try:
            pid, status, ru = os.wait4(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            break
        children.discard(pid)
        # Only the parent learns how a sandbox's init ended; a one-shot run's program is that
        # init (an inline EXEC in agent.Agent), so its exit status reaches the supervisor from here.
        proto.send(ctl, proto.exit_report(Op.EXITED, status, ru.ru_utime + ru.ru_stime, ru.ru_maxrss * 1024,
                                          pid=pid))


def _spawn(ctl: socket.socket, cfg: ZygoteConfig, bpf: libc.SeccompProgram, pidns: int, msg: dict[str, Any],
           fds: list[int], idmapped: dict[int, tuple[int, int]], children: set[int]) -> None:
    """One SPAWN: fork the sandbox into a new pid namespace (answered SPAWNED, or ERROR)."""
    if proto.op_of(msg) != Op.SPAWN or not fds:
        for fd in fds:
            os.close(fd)
        proto.send(ctl, proto.ErrorMsg(op=Op.ERROR, req=msg.get("req"), error="bad spawn request"))
        return
    keep: list[int] = []
    try:
        if msg.get("idmap"):  # (set only with "userns": its namespace is fds[1])
            lowers = idmapped.get(msg["idmap"])
            if lowers is None:
                lowers = idmapped[msg["idmap"]] = mounts.idmapped_lowers(fds[1])
            keep = msg["idmapped"] = list(lowers)
        libc.unshare(libc.CLONE_NEWPID)
        # Without Python's fork handling (libc.fork_bare) while no other Python thread runs here: the
        # sandbox init runs this runtime's code only, and forks its workers with os.fork (every
        # at-fork hook runs there); it runs that handling itself before it becomes a one-shot program.
        bare = threading.active_count() == 1
        pid = libc.fork_bare() if bare else os.fork()
    except OSError as exc:
        for fd in fds:
            os.close(fd)
        proto.send(ctl, proto.ErrorMsg(op=Op.ERROR, req=msg["req"], error=str(exc)))
        return
    if pid == 0:
        signal.set_wakeup_fd(-1)
        ctl.detach()  # closed below with every other fd: nothing of the zygote's crosses over
        low = 3
        for fd in sorted(fds + keep):
            os.closerange(low, fd)
            low = fd + 1
        os.closerange(low, 1 << 16)
        _sandbox_main(cfg, bpf, msg, socket.socket(fileno=fds[0]), fds[1:], bare)
    libc.setns(pidns, libc.CLONE_NEWPID)
    for fd in fds:
        os.close(fd)
    children.add(pid)
    proto.send(ctl, proto.SpawnedMsg(op=Op.SPAWNED, req=msg["req"], pid=pid))
