"""``rollbox doctor``: which isolation layers are active on this host, and why any is not.

Each layer is probed for real (in a throwaway child process), then one sandbox is created and used,
and what is in force in that sandbox is printed per layer (runtime/report.py: read back from inside
it and from what the runtime set up for it, each fallback with the probe's error).
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile

from rollbox.runtime import report
from rollbox.runtime.isolation import cgroups, libc, seccomp


def _probe(fn: object) -> str | None:
    """Run ``fn`` in a forked child; None if it succeeded, else the error it reported."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            fn()  # type: ignore[operator]
            os._exit(0)
        except BaseException as exc:
            os.write(w, str(exc).encode()[:500])
            os._exit(1)
    os.close(w)
    msg = os.read(r, 1000).decode()
    os.close(r)
    _, status = os.waitpid(pid, 0)
    return None if os.waitstatus_to_exitcode(status) == 0 else (msg or f"status {status}")


def _userns_if_rootless() -> None:
    if os.geteuid() != 0:
        from rollbox.runtime.isolation.users import enter_rootless_userns

        enter_rootless_userns()


def _ns(flag: int) -> object:
    def go() -> None:
        _userns_if_rootless()
        libc.unshare(flag)
    return go


def _overlay() -> None:
    _userns_if_rootless()
    libc.unshare(libc.CLONE_NEWNS)
    libc.mount("none", "/", None, libc.MS_REC | libc.MS_PRIVATE)
    d = tempfile.mkdtemp(prefix="rollbox-doctor-")
    try:
        libc.mount("tmpfs", d, "tmpfs", 0, "size=1m")
        for x in ("l", "u", "w", "m"):
            os.mkdir(f"{d}/{x}")
        opts = f"lowerdir={d}/l,upperdir={d}/u,workdir={d}/w" + (",userxattr" if os.geteuid() else "")
        libc.mount("overlay", f"{d}/m", "overlay", 0, opts)
        libc.umount2(d, libc.MNT_DETACH)
    finally:
        os.rmdir(d)


def _seccomp() -> None:
    seccomp.apply(seccomp.build_filter())
    try:
        libc.unshare(libc.CLONE_NEWNS)
    except OSError:
        return
    raise RuntimeError("filter loaded but unshare was not refused")


def _subordinate_uids(path: str = "/etc/subuid") -> str:
    """Rootless: whether /etc/subuid grants the caller a range, and why rollbox does not use one."""
    import pwd

    uid = os.geteuid()
    names = {str(uid)}
    with contextlib.suppress(KeyError):
        names.add(pwd.getpwuid(uid).pw_name)
    granted, text = 0, ""
    with contextlib.suppress(OSError), open(path) as f:
        text = f.read()
    for line in text.splitlines():
        parts = line.strip().split(":")
        if len(parts) == 3 and parts[0] in names and parts[2].isdigit():
            granted += int(parts[2])
    caps = ("each sandbox's own namespace caps its share of the caller's budgets (--rootless-budget-share)")
    if granted:
        return (f"subordinate uids: {path} grants {granted}; used to build language snapshots (Debian's packages, "
                "in a user namespace that maps them), not by sandboxes: the kernel charges every nested "
                "namespace's counts to the caller too, and files would need idmapped layers, which a rootless "
                f"namespace may not mount; instead {caps}")
    who = next(iter(sorted(names - {str(uid)})), str(uid))
    return (f"subordinate uids: none granted in {path}, so language snapshots cannot be built as this user (as root: "
            f"usermod --add-subuids 100000-165535 --add-subgids 100000-165535 {who}); every sandbox runs as uid "
            f"{uid}, and {caps}")


async def diagnose() -> tuple[bool, list[str]]:
    from rollbox.runtime.runtime import Runtime, RuntimeConfig
    from rollbox.runtime.spec import ExecRequest

    lines = [f"rollbox doctor — uid {os.geteuid()} ({'root' if os.geteuid() == 0 else 'rootless'}), "
             f"kernel {os.uname().release}, python {sys.version.split()[0]}"]
    ok = True
    checks = [
        ("user namespace", _ns(libc.CLONE_NEWUSER), os.geteuid() != 0),
        ("mount namespace", _ns(libc.CLONE_NEWNS), True),
        ("pid namespace", _ns(libc.CLONE_NEWPID), True),
        ("ipc namespace", _ns(libc.CLONE_NEWIPC), True),
        ("uts namespace", _ns(libc.CLONE_NEWUTS), True),
        ("net namespace", _ns(libc.CLONE_NEWNET), True),
        ("overlayfs", _overlay, True),
        ("seccomp", _seccomp, True),
    ]
    for name, fn, required in checks:
        err = _probe(fn)
        if err is None:
            lines.append(f"  ok   {name}")
        else:
            ok = ok and not required
            lines.append(f"  {'FAIL' if required else 'warn'} {name}: {err}")
    if os.geteuid() != 0:
        lines.append(f"  info {_subordinate_uids()}")
    reserved = RuntimeConfig.model_fields["cpu_reserved_cores"].default
    backend, why = cgroups.select(cgroups.default_parent(), reserved_cores=reserved)
    if backend is None:
        lines.append(f"  warn cgroups: not available ({why}); memory and pids fall back to rlimits")
        lines.append(f"  warn cpu: {report.cpu(None, None, None, None)}")
    else:
        backend.close()
        lines.append(f"  ok   cgroups: {why}")
        lines.append(f"  {'ok  ' if backend.cpu.cap_cores is not None else 'warn'} cpu: "
                     f"{report.cpu(backend, None, None, None)}")
    try:
        async with Runtime(RuntimeConfig()) as rt:
            info = await rt.create()
            try:
                r = await rt.exec(info.sandbox_id, ExecRequest(command="id -u; hostname"))
            finally:
                await rt.destroy(info.sandbox_id)
            if r.exit_code != 0 or r.stdout.split() != ["1000", "sandbox"]:
                raise RuntimeError(f"unexpected result: exit {r.exit_code}, {r.stdout!r} {r.stderr!r}")
            lines.append("  ok   sandbox: created, ran `id -u; hostname` as uid 1000 in host 'sandbox', destroyed")
            lines.append(f"layers in force in that sandbox ({info.sandbox_id}):")
            lines.extend(f"  {k}: {v}" for k, v in (info.isolation or {}).items())
    except Exception as exc:
        ok = False
        lines.append(f"  FAIL sandbox: {exc}")
    return ok, lines
