"""The isolation report (SandboxInfo.isolation, ``rollbox doctor``) against the kernel's own account.

Each layer the report names is checked from another side: from inside the sandbox by an exec (not
the probe that fed the report), or from the host (/proc/<pid>/..., the cgroup files). Run as root
(cgroup v1 here) and, through test_rootless, as an unprivileged user with a delegated v1 subtree.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from rollbox.runtime.inside import probe
from rollbox.runtime.isolation import cgroups
from rollbox.runtime.isolation.cgroups_v1 import V1
from rollbox.runtime.runtime import Runtime, RuntimeConfig
from rollbox.runtime.spec import ExecRequest, Limits

pytestmark = pytest.mark.asyncio(loop_scope="module")
MiB = 1024 * 1024
ROOTLESS = os.geteuid() != 0
NS_INODES = ("import json, os\nprint(json.dumps({n: os.stat('/proc/self/ns/' + n).st_ino for n in os.listdir('/proc/self/ns')"
             " if not n.endswith('_for_children')}))")


def ns_owner(pid: int) -> int:
    """The host uid owning the user namespace of a process, read from the host."""
    return probe.userns_owner(f"/proc/{pid}/ns/user")


def _unshared(report: dict[str, str]) -> set[str]:
    head = report["namespaces"].split(";")[0]
    assert head.startswith("unshared from the host: "), report["namespaces"]
    return set(head.removeprefix("unshared from the host: ").split(", "))


def _host_uid(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Uid:"):
            return int(line.split()[1])
    raise AssertionError("no Uid line")


async def test_sandbox_report_matches_the_kernel(rt: Runtime) -> None:
    info = await rt.create()
    sb = rt.sandboxes[info.sandbox_id]
    rep = info.isolation
    try:
        # namespaces: the ones whose inode differs from ours, measured by a step inside the sandbox
        r = await rt.exec(info.sandbox_id, ExecRequest(code=NS_INODES))
        inside = json.loads(r.stdout)
        ours = {n: os.stat(f"/proc/self/ns/{n}").st_ino for n in inside}
        assert _unshared(rep) == {n for n in inside if inside[n] != ours[n]}
        assert {"mnt", "pid", "ipc", "uts", "net"} <= _unshared(rep)
        assert "user" in _unshared(rep)  # rootless: nested in the zygote's; as root: one owned by its own uid
        assert "network interfaces: lo" in rep["namespaces"]
        # mode and user: the uid inside, and the uid the host sees the sandbox's init run as
        assert rep["mode"].startswith("rootless" if ROOTLESS else "root")
        r = await rt.exec(info.sandbox_id, ExecRequest(command="id -u; grep -E '^(Seccomp|NoNewPrivs):' /proc/self/status"))
        uid, nnp, mode = r.stdout.split("\n")[:3]
        assert f"uid {uid} " in rep["user"] and uid == "1000"
        assert f"= host uid {_host_uid(sb.pid)} " in rep["user"]
        assert ("user namespace (uid_map" in rep["user"]) is ROOTLESS
        if ROOTLESS:
            assert _host_uid(sb.pid) == os.getuid()
            # its share of the caller's budgets, as read back from inside (the caps its namespace holds)
            b = rt.user_budgets
            assert (f"its own namespace caps its share: {b['max_inotify_instances']} inotify instances, "
                    f"{b['max_inotify_watches']} inotify watches, ") in rep["user"], rep["user"]
            assert (f"message queue bytes {b['RLIMIT_MSGQUEUE']}, pending signals {b['RLIMIT_SIGPENDING']} "
                    "(pipe buffers") in rep["user"], rep["user"]
        else:  # the owner of its namespace, as the host reads it (NS_GET_OWNER_UID)
            owner = ns_owner(sb.pid)
            assert owner >= 65536, owner
            assert rt.restorer.user_slots is not None
            if rt.restorer.user_slots.shifted:  # its processes run as that owner, its layers idmapped onto it
                assert _host_uid(sb.pid) == owner
                assert f"a user namespace of its own owned by host uid {owner}, which its processes run as" \
                    in rep["user"], rep["user"]
            else:  # identity maps: uid 1000 on the host, as in a container whose root refuses idmapped mounts
                assert _host_uid(sb.pid) == 1000
                assert f"a user namespace of its own (identity maps) owned by host uid {owner}," in rep["user"], \
                    rep["user"]
        assert "no capabilities" in rep["user"] and ("no_new_privs" in rep["user"]) is (nnp.split()[1] == "1")
        # seccomp: the mode the kernel reports for a process of the sandbox
        assert mode.split()[1] == "2" and rep["seccomp"].startswith("filter loaded (Seccomp=2")
        # filesystem: the root mount's type, from inside
        r = await rt.exec(info.sandbox_id, ExecRequest(command="awk '$5 == \"/\" {split($0, a, \" - \"); print a[2]}' "
                                                       "/proc/self/mountinfo | tail -1 | cut -d' ' -f1"))
        assert rep["filesystem"].startswith(f"root: {r.stdout.strip()} (") and r.stdout.strip() == "overlay"
        assert f"tmpfs of {info.limits.disk_max_bytes // MiB} MiB" in rep["filesystem"]
        # cgroups: the backend in use, its controllers, this sandbox's group and the limits written there
        backend = rt.cgroup_backend
        if backend is None:
            assert rep["cgroups"].startswith("none (") and "fell back to rlimits" in rep["cgroups"]
        else:
            assert sb.group is not None
            assert rep["cgroups"].startswith(f"{backend.name}: cgroup {backend.name} at {rt.config.cgroup_parent}")
            for ctrl in ("memory", "pids", "cpu"):
                assert re.search(rf"controllers [a-z, ]*\b{ctrl}\b", rep["cgroups"]), rep["cgroups"]
            for path in sb.group.paths():
                assert Path(path).name in rep["cgroups"]
                assert str(sb.pid) in (Path(path) / "cgroup.procs").read_text().split()
            assert "its init is in it" in rep["cgroups"]
            mem = int(re.search(r"memory (\d+) MiB", rep["cgroups"]).group(1))  # type: ignore[union-attr]
            pids = int(re.search(r"pids (\d+)", rep["cgroups"]).group(1))  # type: ignore[union-attr]
            assert (mem * MiB, pids) == (info.limits.memory_max_bytes, info.limits.pids_max)
            if isinstance(backend, V1):
                d = Path(backend.parents["memory"]) / Path(sb.group.paths()[0]).name
                assert int((d / "memory.limit_in_bytes").read_text()) == mem * MiB
                assert int((Path(backend.parents["pids"]) / d.name / "pids.max").read_text()) == pids
            assert "RLIMIT" not in rep["rlimits"]
            if sb.nproc_first:  # a uid of its own and a group with pids.peak: RLIMIT_NPROC fails forks first
                assert f"nproc {pids} (counted in its own user namespace)" in rep["rlimits"], rep["rlimits"]
                r = await rt.exec(info.sandbox_id, ExecRequest(command="grep '^Max processes' /proc/self/limits"))
                assert r.stdout.split()[2:4] == [str(pids), str(pids)], r.stdout
            else:
                assert "nproc" not in rep["rlimits"]
        assert rep["limits"].startswith(f"exec timeout per request (at most the lifetime), lifetime "
                                        f"{info.limits.lifetime_s:g} s")
        assert rt.isolation_report(info.sandbox_id)["cgroups"] == rep["cgroups"]
    finally:
        await rt.destroy(info.sandbox_id)


async def test_report_notices_a_sandbox_outside_its_cgroup(rt: Runtime) -> None:
    """The report reads where the sandbox's init is now: moved out of its group, it says so."""
    if not isinstance(rt.cgroup_backend, V1):
        pytest.skip("moves a process between v1 groups (v2 forbids processes in the parent)")
    info = await rt.create()
    sb = rt.sandboxes[info.sandbox_id]
    assert sb.group is not None
    paths = sb.group.paths()
    try:
        for p in paths:
            (Path(p).parent / "cgroup.procs").write_text(str(sb.pid))
        assert "its init is NOT in " in rt.isolation_report(info.sandbox_id)["cgroups"]
        for p in paths:
            (Path(p) / "cgroup.procs").write_text(str(sb.pid))
        assert "its init is in it" in rt.isolation_report(info.sandbox_id)["cgroups"]
    finally:
        await rt.destroy(info.sandbox_id)


async def test_report_says_rlimits_when_cgroups_are_off(tmp_path: Path) -> None:
    """cgroups forced off (as test_fallback does): the report says rlimits, with the values the kernel holds."""
    lim = Limits(pids_max=24, memory_max_bytes=96 * MiB)
    async with Runtime(RuntimeConfig(state_dir=tmp_path, cgroup="none")) as rt:
        assert rt.cgroup_backend is None
        before = rt.isolation_report()
        assert before["cgroups"].startswith("none (disabled by the runtime's configuration); memory and pids fall "
                                            "back to rlimits")
        assert "not read back yet" in before["namespaces"]  # nothing is claimed before a sandbox proves it
        info = await rt.create(limits=lim)
        try:
            rep = info.isolation
            assert rep["cgroups"] == ("none (disabled by the runtime's configuration); fell back to rlimits: "
                                      "RLIMIT_DATA 96 MiB (RLIMIT_AS 4192 MiB as a backstop for shared mappings), "
                                      "RLIMIT_NPROC 24; cpu not limited")
            assert "nproc 24 (counted in its own user namespace)" in rep["rlimits"]  # rootless, and as root with slots
            assert ", data 96 MiB" in rep["rlimits"], rep["rlimits"]
            # memory is capped by RLIMIT_DATA at the limit; the address space only 4 GiB above (a JVM reserves)
            r = await rt.exec(info.sandbox_id, ExecRequest(command="grep -E '^Max (processes|data size|address space)' "
                                                           "/proc/self/limits"))
            got = dict(re.findall(r"^(Max [a-z ]+?)\s+(\d+|unlimited)\s", r.stdout, re.M))
            assert got == {"Max processes": "24", "Max data size": str(96 * MiB), "Max address space":
                           str(96 * MiB + (4 << 30))}, r.stdout
            seen = rt.isolation_report()["rlimits"]
            assert "read back in a sandbox: core 0, nofile 1024" in seen and "data 96 MiB, as 4192 MiB" in seen, seen
        finally:
            await rt.destroy(info.sandbox_id)


async def test_report_names_why_a_cgroup_version_was_not_used(tmp_path: Path) -> None:
    """Asked for cgroup v2 on a host whose v2 hierarchy has none of the controllers: the probe's error."""
    roots = cgroups.mounts_of("cgroup2")
    if "" not in roots:
        pytest.skip("no cgroup2 hierarchy mounted")
    if {"memory", "pids", "cpu"} <= set((Path(roots[""]) / "cgroup.controllers").read_text().split()):
        pytest.skip("this host's cgroup v2 carries the controllers")
    parent = f"rollbox-report-{os.getpid()}"
    async with Runtime(RuntimeConfig(state_dir=tmp_path, cgroup="v2", cgroup_parent=parent)) as rt:
        info = await rt.create()
        await rt.destroy(info.sandbox_id)
    assert re.match(r"none \(v2: cgroup v2 at \S+ lacks controllers \[.*'memory'.*\]", info.isolation["cgroups"]), \
        info.isolation["cgroups"]
    assert "fell back to rlimits: RLIMIT_DATA" in info.isolation["cgroups"]
