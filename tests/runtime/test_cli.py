"""`rollbox run` and `rollbox doctor` as a user types them."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROLLBOX = [sys.executable, "-m", "rollbox.functions.cli.main"]


def run(*args: str, tmp: Path, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, ROLLBOX_HOME=str(tmp))
    return subprocess.run([*ROLLBOX, *args], capture_output=True, text=True, env=env, input=stdin, timeout=120)


def test_run_passes_output_and_exit_status_through(tmp_path: Path) -> None:
    p = run("run", "--code", "import sys; print('out'); print('err', file=sys.stderr); sys.exit(7)", tmp=tmp_path)
    assert (p.returncode, p.stdout, p.stderr) == (7, "out\n", "err\n")


def test_run_file_and_json_record(tmp_path: Path) -> None:
    script = tmp_path / "s.py"
    script.write_text("print(sum(range(10)))\n")
    p = run("run", "--json", str(script), tmp=tmp_path)
    rec = json.loads(p.stdout)
    assert p.returncode == 0 and rec["stdout"] == "45\n" and rec["exit_code"] == 0 and rec["timed_out"] is False


def test_run_of_a_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    p = run("run", str(tmp_path / "nope.py"), tmp=tmp_path)
    assert p.returncode == 2 and p.stdout == "", p
    assert p.stderr == f"rollbox run: cannot read {tmp_path / 'nope.py'}: No such file or directory\n", p.stderr


def test_each_command_loads_only_its_own_module(tmp_path: Path) -> None:
    """`rollbox run` pays no import of the service (pyarrow, functions-framework); --help lists all."""
    code = ("import sys; from rollbox.functions.cli import main as cli; rc = cli.main(['run', '--code', 'pass']); "
            "print(sorted(m for m in ('pyarrow', 'functions_framework', 'rollbox.functions.service.server') if m in sys.modules))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env=dict(os.environ, ROLLBOX_HOME=str(tmp_path)), timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == "[]", p
    h = run("--help", tmp=tmp_path)
    assert h.returncode == 0 and all(c in h.stdout for c in ("run", "serve", "snapshot", "trajectories", "knative")), h


def test_run_timeout_exits_137_and_says_so(tmp_path: Path) -> None:
    p = run("run", "--timeout-s", "1", "--command", "sleep 30", tmp=tmp_path)
    assert p.returncode == 137 and "timed out" in p.stderr


def test_run_keeps_the_snapshots_limits_unless_asked(tmp_path: Path) -> None:
    hog = "x = bytearray(400 * 2**20); x[::4096] = b'x' * len(x[::4096]); print('kept')"
    p = run("run", "--json", "--code", hog, tmp=tmp_path)  # the snapshot's 512 MiB
    assert (p.returncode, json.loads(p.stdout)["stdout"]) == (0, "kept\n"), p.stderr
    p = run("run", "--json", "--memory-mb", "64", "--code", hog, tmp=tmp_path)
    rec = json.loads(p.stdout)  # killed by the cgroup (137, oom_killed), or MemoryError under the rlimit fallback
    assert rec["exit_code"] != 0 and "kept" not in rec["stdout"] and (rec["oom_killed"] or "MemoryError" in rec["stderr"])
    from rollbox.functions.cli.runtime import limit_overrides

    assert limit_overrides({"memory_mb": None, "timeout_s": 30.0}, 900.0) == {}  # nothing asked: nothing forced
    assert limit_overrides({"memory_mb": 64, "timeout_s": 1000.0}, 900.0) == {"memory_max_bytes": 64 * 2**20,
                                                                              "lifetime_s": 1060.0}


def test_run_keeps_a_templates_own_limits(tmp_path: Path) -> None:
    """A snapshot built from a template that declares its limits (as python-sci declares 1 GiB) keeps
    them under `rollbox run`: only the limits given on the command line replace the snapshot's."""
    (tmp_path / "tight.yaml").write_text("name: tight\nlimits: {memory_max_bytes: 100663296}\n")  # 96 MiB
    built = run("snapshot", "build", str(tmp_path / "tight.yaml"), tmp=tmp_path)
    assert built.returncode == 0, built.stderr
    # over 96 MiB: the cgroup's limit, or RLIMIT_DATA's without one (rootless)
    hog = "x = bytearray(400 * 2**20); x[::4096] = b'x' * len(x[::4096]); print('kept')"
    p = run("run", "--json", "--snapshot", "tight", "--timeout-s", "20", "--code", hog, tmp=tmp_path)
    rec = json.loads(p.stdout)  # 96 MiB, not the 512 MiB default: killed by the cgroup, or MemoryError
    assert rec["exit_code"] != 0 and "kept" not in rec["stdout"], rec
    assert rec["oom_killed"] or "MemoryError" in rec["stderr"], rec
    p = run("run", "--json", "--snapshot", "tight", "--memory-mb", "640", "--code", hog, tmp=tmp_path)
    assert (p.returncode, json.loads(p.stdout)["stdout"]) == (0, "kept\n"), p.stderr  # asked for: replaced


def test_bad_env_value_is_a_clear_error(tmp_path: Path) -> None:
    env = dict(os.environ, ROLLBOX_HOME=str(tmp_path), ROLLBOX_TIMEOUT_S="soon")
    p = subprocess.run([*ROLLBOX, "run", "--code", "1"], capture_output=True, text=True, env=env, timeout=60)
    assert p.returncode != 0 and "ROLLBOX_TIMEOUT_S: not a valid number of seconds: 'soon'" in p.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="the layer list differs rootless; covered by test_rootless")
def test_doctor_lists_every_layer(tmp_path: Path) -> None:
    p = run("doctor", tmp=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    for layer in ("mount namespace", "pid namespace", "net namespace", "overlayfs", "seccomp", "cgroups", "sandbox"):
        assert f"ok   {layer}" in p.stdout
    # then what is in force in the sandbox it made, per layer, as read back and set up
    in_force = p.stdout.split("layers in force in that sandbox (sb-", 1)[1].splitlines()[1:]
    layers = dict(line.strip().split(": ", 1) for line in in_force)
    assert list(layers) == ["mode", "namespaces", "user", "filesystem", "cgroups", "cpu", "rlimits", "seccomp", "limits"]
    assert layers["namespaces"].startswith("unshared from the host: mnt, pid, ipc, uts, net, user;")
    # as root on this host (layers on ext4 take idmapped mounts): a host uid of its own, not 1000
    assert re.match(r"uid 1000 gid 1000 inside = host uid (\d+) gid 1000; a user namespace of its own owned by host "
                    r"uid \1, which its processes run as", layers["user"]) and "host uid 1000 " not in layers["user"], \
        layers["user"]
    assert layers["cgroups"].startswith(("v1: cgroup v1 at rollbox", "v2: cgroup v2 at rollbox"))
    assert "its init is in it" in layers["cgroups"]
    assert layers["seccomp"].startswith("filter loaded (Seccomp=2")


def test_doctor_counts_the_subordinate_uids_granted_by_name_or_uid(tmp_path: Path) -> None:
    import pwd

    from rollbox.runtime.doctor import _subordinate_uids

    uid = os.geteuid()
    name = pwd.getpwuid(uid).pw_name
    f = tmp_path / "subuid"
    f.write_text(f"someone:100000:65536\n{name}:165536:65536\n{uid}:231072:1000\nnot a range\n")
    assert _subordinate_uids(str(f)).startswith(f"subordinate uids: {f} grants 66536; used to build language snapshots")
    f.write_text("someone:100000:65536\n")
    assert _subordinate_uids(str(f)).startswith(f"subordinate uids: none granted in {f}, so language snapshots cannot "
                                                f"be built as this user (as root: usermod --add-subuids 100000-165535 "
                                                f"--add-subgids 100000-165535 {name}); every sandbox runs as uid")
    assert "none granted" in _subordinate_uids(str(tmp_path / "absent"))
