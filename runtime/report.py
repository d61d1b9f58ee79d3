"""The isolation report: what is in force, per layer, for ``rollbox doctor`` and every SandboxInfo.

Nothing here is a fixed description. Each layer is rendered from what was found: the runtime's
start-up probes (the cgroup backend it could set up and why not the others, the seccomp program it
built, the host's namespaces), what the first sandbox of each zygote read back from its own /proc
right after containment (runtime/inside/probe.py: namespaces, ids and their maps, capabilities,
no_new_privs, seccomp mode, mounts, network interfaces), and, for one sandbox, what the supervisor
did for it (its cgroup and the limits written there, or the rlimits that replaced it) and where its
init is now (/proc/<pid>/cgroup). A layer that is off or fell back says so, with the probe's error.
Every later sandbox of a zygote passes the same required steps as the probed one (a failed step ends
the sandbox), so the read-back stands for them too.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from rollbox.runtime.isolation import rlimits as rlimit_values
from rollbox.runtime.isolation import seccomp
from rollbox.runtime.isolation.cgroups import Backend, Group
from rollbox.runtime.isolation.cgroups_v1 import V1, V1Group
from rollbox.runtime.isolation.cgroups_v2 import V2, V2Group
from rollbox.runtime.spec import Limits

if TYPE_CHECKING:
    from rollbox.runtime.execution import Sandbox
    from rollbox.runtime.runtime import Runtime

__all__ = ["LAYERS", "RuntimeReports", "cpu", "render", "summary"]

LAYERS = ("mode", "namespaces", "user", "filesystem", "cgroups", "cpu", "rlimits", "seccomp", "limits")
NOT_READ = "not read back yet: no sandbox has started in this runtime"
MiB = 1024 * 1024


def _size(n: int) -> str:
    if n >= MiB and n % MiB == 0:
        return f"{n // MiB} MiB"
    return f"{n} bytes"


def _errors(facts: Mapping[str, Any] | None, *keys: str) -> str | None:
    """Why a fact is missing: the probe's error for it, or that no probe came back."""
    if facts is None:
        return NOT_READ
    errors = facts.get("errors") or {}
    for key in (*keys, "probe"):
        if key in errors:
            return f"not read back: {errors[key]}"
    return None


def mode(rootless: bool, uid: int) -> str:
    if rootless:
        return f"rootless (supervisor uid {uid}): user namespaces, no privilege on the host"
    return f"root (supervisor uid {uid}): each sandbox drops to an unprivileged uid on the host"


def namespaces(facts: Mapping[str, Any] | None, host_ns: Mapping[str, int]) -> str:
    why = _errors(facts, "ns")
    if why or facts is None:
        return why or NOT_READ
    ns: Mapping[str, int] = facts.get("ns") or {}
    new = [n for n in ns if n in host_ns and ns[n] != host_ns[n]]
    shared = [n for n in ns if n in host_ns and ns[n] == host_ns[n]]
    out = f"unshared from the host: {', '.join(new) or 'none'}; shared with the host: {', '.join(shared) or 'none'}"
    net = facts.get("net")
    if "net" in new and isinstance(net, list):
        out += f"; network interfaces: {', '.join(map(str, net)) or 'none'}"
    if "uts" in new and "hostname" in facts:
        out += f"; hostname: {facts['hostname']}"
    return out


def _caps(status: Mapping[str, str]) -> str:
    eff = status.get("CapEff", "?")
    return "no capabilities" if eff.strip("0") == "" else f"capabilities CapEff={eff}"


def user(facts: Mapping[str, Any] | None, rootless: bool) -> str:
    why = _errors(facts, "status", "uid_map")
    if why or facts is None:
        return why or NOT_READ
    status: Mapping[str, str] = facts.get("status") or {}
    uid = (status.get("Uid") or "?").split()[0]
    gid = (status.get("Gid") or "?").split()[0]
    host = f"host uid {facts.get('host_uid', '?')} gid {facts.get('host_gid', '?')}"
    nnp = "no_new_privs"
    if status.get("NoNewPrivs") != "1":
        nnp = f"no_new_privs OFF (NoNewPrivs={status.get('NoNewPrivs')})"
    uid_map = facts.get("uid_map", "?")
    if rootless:
        how = (f"user namespace (uid_map '{uid_map}' onto the zygote's namespace, which maps onto the caller): "
               f"every sandbox runs as the caller, whose per-user budgets all sandboxes share; {_shares(facts)}")
    elif str(facts.get("host_uid")) != uid and f" {uid} {facts.get('host_uid')} 1 " in f" {' '.join(uid_map.split())} ":
        # its map puts 1000 on a host uid of its own, the namespace's owner (runtime/slots.py; seen from
        # inside, the owner is 1000 itself); its lower layers are idmapped onto it
        how = (f"a user namespace of its own owned by host uid {facts.get('host_uid')}, which its processes run "
               "as (uid 1000 inside; its lower layers are idmapped mounts, so files keep uid 1000), one per sandbox: "
               "its processes, inotify instances and watches, message queues, pending signals, pipe buffers "
               "and keyrings count against budgets of its own")
    elif uid_map.split()[:3] != ["0", "0", "4294967295"]:
        how = f"user namespace (uid_map '{uid_map}')"
    elif facts.get("userns_owner", 0):  # identity maps, in a namespace owned by a uid of its own
        how = (f"a user namespace of its own (identity maps) owned by host uid {facts['userns_owner']}, one "
               "per sandbox: its processes, inotify instances and watches, message queues and pending "
               "signals count against budgets of its own (pipe buffers and keyrings stay per host uid: "
               "this host's layers take no idmapped mounts)")
    else:
        how = "no user namespace: setresuid on the host"
    return f"uid {uid} gid {gid} inside = {host}; {how}; {_caps(status)}, {nnp}"


def _shares(facts: Mapping[str, Any]) -> str:
    """Rootless: the caps a sandbox's own user namespace puts on its share (runtime/isolation/users.py)."""
    budgets: Mapping[str, int] = facts.get("budgets") or {}
    rl: Mapping[str, list[int]] = facts.get("rlimits") or {}
    unset = 2**31 - 1  # a new namespace's own table: no cap of its own
    capped = [f"{budgets[k]} {what}" for k, what in (
        ("max_inotify_instances", "inotify instances"), ("max_inotify_watches", "inotify watches"),
        ("max_fanotify_groups", "fanotify groups"), ("max_fanotify_marks", "fanotify marks"),
    ) if budgets.get(k, unset) < unset]
    shared = ("pipe buffers are per host uid, so shared; keyring syscalls are denied; subordinate uid "
              "ranges are not used")
    if not capped:
        return f"its own namespace caps none of the caller's budgets ({shared})"
    capped += [f"{what} {_rlimit(k, rl[k][0])}" for k, what in (
        ("msgqueue", "message queue bytes"), ("sigpending", "pending signals")) if k in rl]
    return f"its own namespace caps its share: {', '.join(capped)} ({shared})"


def filesystem(facts: Mapping[str, Any] | None, limits: Limits | None) -> str:
    why = _errors(facts, "mounts")
    if why or facts is None:
        return why or NOT_READ
    mounts: list[list[str]] = [m for m in facts.get("mounts") or [] if isinstance(m, list) and len(m) == 4]
    root = next((m for m in reversed(mounts) if m[0] == "/"), None)
    if root is None:
        return "no root mount found in the sandbox's mount table"
    _, fstype, opts, sopts = root
    out = f"root: {fstype} ({opts.split(',')[0]}"
    out += ", nosuid" if "nosuid" in opts.split(",") else ""
    out += ", nodev" if "nodev" in opts.split(",") else ""
    out += ")"
    if fstype == "overlay":
        lower = next((o.split("=", 1)[1] for o in sopts.split(",") if o.startswith("lowerdir=")), "")
        n = len(lower.split(":")) if lower else 0
        upper = "upperdir=" in sopts
        out += (f" over {n} read-only lower layers ({n - 1} of the snapshot, then the skeleton)" if n > 1
                else " over 1 read-only lower layer (the skeleton)")
        out += "; upper: a private tmpfs"
        out += f" of {_size(limits.disk_max_bytes)}" if limits else ", size-capped per sandbox"
        out += "" if upper else " MISSING (read-only root)"
    others = [m for m in mounts if m[0] != "/"]
    ro = [m[0] for m in others if m[1] != "tmpfs" and m[2].split(",")[0] == "ro"]
    masked = [m[0] for m in others if m[1] == "tmpfs" and m[2].split(",")[0] == "ro"]
    host_root = any(m[0] == "/" and m is not root for m in mounts)
    out += "; pivot_root: the host's root is " + ("STILL MOUNTED" if host_root else "not in its mount table")
    if ro:
        out += f"; read-only binds: {', '.join(ro[:8])}" + (" ..." if len(ro) > 8 else "")
    if masked:
        out += f"; masked: {', '.join(masked[:8])}" + (" ..." if len(masked) > 8 else "")
    proc = next((m for m in others if m[0] == "/proc"), None)
    out += "; /proc: " + (f"{proc[1]} of its own pid namespace" if proc else "none")
    return out


def _backend_where(backend: Backend) -> str:
    if isinstance(backend, V1):
        dirs = {str(p) for p in backend.parents.values()}
        return f"controllers {', '.join(backend.parents)} under {', '.join(sorted(dirs))}"
    if isinstance(backend, V2):
        return f"controllers {', '.join(backend.enabled) or 'none'} under {backend.parent}"
    return backend.name


def _membership(pid: int, paths: list[str]) -> str:
    """Whether the sandbox's init is in the group now (/proc/<pid>/cgroup, read by the supervisor)."""
    try:
        fd = os.open(f"/proc/{pid}/cgroup", os.O_RDONLY | os.O_CLOEXEC)
        try:
            text = os.read(fd, 1 << 16).decode(errors="replace")
        finally:
            os.close(fd)
    except OSError as exc:
        return f"its init's membership could not be read: {exc}"
    rel = [r for r in (line.split(":", 2)[-1] for line in text.splitlines()) if r not in ("", "/")]
    missing = [p for p in paths if not any(p.endswith(r) for r in rel)]
    if missing:
        return f"its init is NOT in {', '.join(missing)} (/proc/{pid}/cgroup: {', '.join(rel) or 'root'})"
    return "its init is in it (/proc/<pid>/cgroup)"


def _group_limits(group: Group) -> str:
    lim = getattr(group, "limits", None)
    if lim is None:
        return "limits NOT written"
    memory, pids, cores = lim
    cores = group.cpu_cores(cores)  # at most the parent's cap
    quota = max(1000, int(cores * 100_000))
    if isinstance(group, V1Group):
        swap = " (memory+swap too)" if group.swap_limited else " (swap not limited: no swap accounting)"
        return f"memory {_size(memory)}{swap}, pids {pids}, cpu {cores:g} CPU (cfs quota {quota}/100000 µs)"
    if isinstance(group, V2Group):
        parts = []
        if "memory" in group.enabled:
            parts.append(f"memory {_size(memory)} (swap 0)")
        if "pids" in group.enabled:
            parts.append(f"pids {pids}")
        if "cpu" in group.enabled:
            parts.append(f"cpu {cores:g} CPU (cpu.max {quota} 100000)")
        return ", ".join(parts) or "no controller enabled"
    return f"memory {_size(memory)}, pids {pids}, cpu {cores:g} CPU"


def cgroups(backend: Backend | None, reason: str, group: Group | None, pid: int | None,
            rlimits: Mapping[str, int] | None) -> str:
    if backend is None:
        out = "none (disabled by the runtime's configuration)" if reason == "disabled" else f"none ({reason})"
        if rlimits is not None:
            cap = f"RLIMIT_DATA {_size(rlimits['data_bytes'])}" if "data_bytes" in rlimits else "memory not limited"
            if "as_bytes" in rlimits:
                cap += f" (RLIMIT_AS {_size(rlimits['as_bytes'])} as a backstop for shared mappings)"
            cap += f", RLIMIT_NPROC {rlimits['nproc']}" if "nproc" in rlimits else ", pids not limited"
            return out + f"; fell back to rlimits: {cap}; cpu not limited"
        return out + "; memory and pids fall back to rlimits (RLIMIT_DATA, RLIMIT_NPROC), cpu is not limited"
    out = f"{backend.name}: {reason}; {_backend_where(backend)}"
    if pid is None:
        return out + "; one group per sandbox with its limits"
    if group is None:
        return out + "; this sandbox has NO group"
    paths = group.paths()
    names = {os.path.basename(p) for p in paths}
    where = f"{names.pop()} in each" if len(paths) > 1 and len(names) == 1 else ", ".join(paths)
    return f"{out}; this sandbox's group: {where}: {_group_limits(group)}; {_membership(pid, paths)}"


def _autogroup() -> str:
    try:
        with open("/proc/sys/kernel/sched_autogroup_enabled") as f:
            on = f.read().strip() == "1"
    except OSError:
        return "the kernel has no autogroup scheduling"
    if on:
        return ("the kernel's autogroup is on: each step's session is one scheduling group, so a fork bomb's "
                "processes share one share (code that calls setsid gets one more)")
    return "the kernel's autogroup is off: each process is scheduled on its own"


def cpu(backend: Backend | None, group: Group | None, limits: Limits | None,
        rlimits: Mapping[str, int] | None) -> str:
    """How CPU is shared: equal weight per sandbox, all of them capped below the host's cores so the
    supervisor keeps a reserve; or, without cgroups, what replaces that."""
    if backend is None:
        nice = (rlimits or {}).get("nice", rlimit_values.FALLBACK_NICE)
        return (f"no cgroup: no per-sandbox CPU cap or weight, no cap on all sandboxes together; fell back to "
                f"nice {nice} for every sandbox process (the supervisor keeps ~9x the share of one busy sandbox "
                f"process where they compete one by one); {_autogroup()}")
    pol = backend.cpu
    out = f"equal weight per sandbox ({pol.weight} in its group, however many processes it runs)"
    if pol.cap_cores is None:
        out += (f"; all sandboxes together NOT capped ({pol.error}): the supervisor has no reserved share "
                f"beyond its own weight")
    else:
        out += (f"; all sandboxes together capped at {pol.cap_cores:g} of {pol.available_cores:g} CPU by the parent's "
                f"{'cfs quota' if isinstance(backend, V1) else 'cpu.max'} ({pol.reserved_cores:g} reserved for "
                f"the supervisor)")
    if group is not None and limits is not None:
        cores = group.cpu_cores(limits.cpu_max_cores)
        out += f"; this sandbox: at most {cores:g} CPU"
    return out


def _rlimit(name: str, soft: int) -> str:
    if soft < 0:
        return "unlimited"
    return _size(soft) if name in ("fsize", "data", "as") else str(soft)


def rlimits(params: Mapping[str, int] | None, facts: Mapping[str, Any] | None, in_cgroup: bool,
            own_userns: bool) -> str:
    if params is None:  # the runtime's view: the rule, and what the latest probed sandbox read back
        out = "per sandbox: core 0, nofile and fsize from its limits"
        out += "" if in_cgroup else ", nproc and data (memory) too (no cgroup)"
        why = _errors(facts, "rlimits")
        if why or facts is None:
            return f"{out}; {why or NOT_READ}"
        got: Mapping[str, list[int]] = facts.get("rlimits") or {}
        seen = ", ".join(f"{k} {_rlimit(k, v[0])}" for k, v in got.items())
        return f"{out}; read back in a sandbox: {seen}"
    out = f"core 0, nofile {params['nofile']}, fsize {_size(params['fsize_bytes'])}"
    if "nproc" in params:
        out += f", nproc {params['nproc']}" + (" (counted in its own user namespace)" if own_userns else
                                               " (counted across every process of its host uid)")
    if "data_bytes" in params:
        out += f", data {_size(params['data_bytes'])}"
    if "as_bytes" in params:
        out += f", address space {_size(params['as_bytes'])}"
    if "nice" in params:
        out += f", nice {params['nice']}"
    return out


def seccomp_layer(facts: Mapping[str, Any] | None, bpf: bytes) -> str:
    built = (f"{len(bpf) // 8} BPF instructions built at start: {len(seccomp.DENIED_SYSCALLS)} syscalls denied "
             "(EPERM), clone with namespace flags EPERM, clone3 ENOSYS, socket families other than AF_UNIX EPERM")
    why = _errors(facts, "status")
    if why or facts is None:
        return f"{built}; in force: {why or NOT_READ}"
    status: Mapping[str, str] = facts.get("status") or {}
    if status.get("Seccomp") != "2":
        return f"{built}; NOT in force in the sandbox (Seccomp={status.get('Seccomp')})"
    return f"filter loaded (Seccomp=2, {status.get('Seccomp_filters', '?')} filter); {built}"


def limits_layer(limits: Limits | None) -> str:
    if limits is None:
        return "per sandbox: exec timeout, lifetime, idle, output cap (enforced from the supervisor)"
    return (f"exec timeout per request (at most the lifetime), lifetime {limits.lifetime_s:g} s, idle "
            f"{limits.idle_s:g} s, enforced from the supervisor (kill, exit 137); output capped at "
            f"{_size(limits.output_max_bytes)} per stream; disk {_size(limits.disk_max_bytes)}")


def render(*, rootless: bool, uid: int, host_ns: Mapping[str, int], backend: Backend | None, backend_reason: str,
           bpf: bytes, facts: Mapping[str, Any] | None, limits: Limits | None = None, group: Group | None = None,
           pid: int | None = None, rlimit_params: Mapping[str, int] | None = None) -> dict[str, str]:
    """The report, one line per layer (``LAYERS``). ``facts``: a probed sandbox's read-back (None if
    none came back yet). ``limits``, ``group``, ``pid``, ``rlimit_params``: one sandbox's, for its own
    report; without them, the runtime's."""
    layers: dict[str, Callable[[], str]] = {
        "mode": lambda: mode(rootless, uid),
        "namespaces": lambda: namespaces(facts, host_ns),
        "user": lambda: user(facts, rootless),
        "filesystem": lambda: filesystem(facts, limits),
        "cgroups": lambda: cgroups(backend, backend_reason, group, pid, rlimit_params if pid is not None else None),
        "cpu": lambda: cpu(backend, group, limits, rlimit_params if pid is not None else None),
        "rlimits": lambda: rlimits(rlimit_params if pid is not None else None, facts, backend is not None,
                                  rootless or bool((facts or {}).get("userns_owner"))),
        "seccomp": lambda: seccomp_layer(facts, bpf),
        "limits": lambda: limits_layer(limits),
    }
    out = {}
    for name, line in layers.items():
        try:
            out[name] = line()
        except (LookupError, TypeError, ValueError, AttributeError) as exc:  # a read-back of an unexpected shape
            out[name] = f"not rendered: {type(exc).__name__}: {exc}"
    return out


_FLAGS = ("NOT ", "MISSING", "STILL MOUNTED", "not read back", "not rendered", "OFF")


def summary(report: Mapping[str, str]) -> str:
    """The report in one line (what a create or fork reply carries by default): mode, the namespaces
    unshared, the user inside and on the host, the cgroup backend, seccomp, and the layers whose text
    says something fell back or could not be read back."""
    parts = []
    mode_text = report.get("mode", "")
    parts.append(mode_text.split(" (", 1)[0] or "mode ?")
    ns = report.get("namespaces", "")
    prefix = "unshared from the host: "
    parts.append("namespaces " + (ns[len(prefix):].split(";", 1)[0] if ns.startswith(prefix) else "?"))
    parts.append(report.get("user", "user ?").split(";", 1)[0])
    cg = report.get("cgroups", "")
    parts.append("no cgroup (rlimits)" if cg.startswith("none") else
                 f"cgroup {cg.split(':', 1)[0]}" if cg[:2] in ("v1", "v2") else "cgroups ?")
    sc = report.get("seccomp", "")
    parts.append("seccomp filter" if sc.startswith("filter loaded") else "seccomp NOT in force")
    flagged = [layer for layer, text in report.items() if any(f in text for f in _FLAGS)]
    if flagged:
        parts.append(f"see the full report for: {', '.join(flagged)}")
    return "; ".join(parts)


class RuntimeReports:
    """``render`` with a runtime's side of it: for one of its sandboxes, or for the runtime itself
    (its start-up probes and the latest sandbox read-back; rendered again only when those change)."""

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self._cached: tuple[tuple[Any, ...], dict[str, str]] | None = None  # (its inputs, the report)

    def runtime(self) -> dict[str, str]:
        rt = self.rt
        facts = next(reversed(list(rt.restorer.probed.values())), None)
        inputs = (facts, rt.cgroup_backend, getattr(rt.cgroup_backend, "cpu", None), rt.cgroup_reason,
                  rt.seccomp_bpf, rt.host_namespaces)
        cached = self._cached  # (a create committed hibernated replies with it: rendered once)
        if cached is None or any(a is not b for a, b in zip(cached[0], inputs, strict=True)):
            cached = self._cached = (inputs, self._render(facts))
        return dict(cached[1])

    def sandbox(self, sb: Sandbox) -> dict[str, str]:
        from rollbox.runtime.restorer import rlimit_params

        facts = self.rt.restorer.probed.get(sb.source) if sb.source is not None else None
        return self._render(facts, limits=sb.limits, group=sb.group, pid=sb.pid,
                            rlimit_params=rlimit_params(sb.limits, sb.group is not None, sb.nproc_first))

    def _render(self, facts: dict[str, Any] | None, **sandbox: Any) -> dict[str, str]:
        rt = self.rt
        return render(rootless=rt.config.rootless, uid=os.geteuid(), host_ns=rt.host_namespaces,
                      backend=rt.cgroup_backend, backend_reason=rt.cgroup_reason, bpf=rt.seccomp_bpf,
                      facts=facts, **sandbox)
