"""Language snapshots built and run by an ordinary user: `rollbox serve` as the unprivileged user of
tests/runtime/test_rootless.py, whose first /run_code for lua builds lua's snapshot from Debian's
packages (mmdebstrap in a user namespace with the user's subordinate ids, snapshots/userns.py) and
runs the program in it, rootless.

The store is kept across runs in ROLLBOX_TEST_ROOTLESS_LANGUAGES_HOME (default
/var/tmp/rollbox-test-languages-rootless, owned by that user), as the root language tests keep
theirs: the shared Debian base (the bash snapshot) is built on a machine's first run (~30-100 s
here, depending on the load) and reused later; lua's own layer (lua5.4 over the base: mmdebstrap,
the diff, the packing, all in the namespace) is built again on every run (~15-25 s). A layer with a
whiteout, built the same way, runs in the user's sandboxes and, copied as a pull would, in root's.
A C++ compile runs too when that store holds the cpp snapshot (`rollbox languages build cpp` as that user, with
ROLLBOX_HOME set to it, puts it there: ~60 s more, once).
"""

from __future__ import annotations

import fcntl
import json
import os
import pwd
import shutil
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from rollbox.snapshots.store_local import LocalStore
from svc_testkit import ServerProc, start_server

from tests.runtime.test_rootless import LOCK, REPO, _ensure_user, _reachable

HOME = Path(os.environ.get("ROLLBOX_TEST_ROOTLESS_LANGUAGES_HOME", "/var/tmp/rollbox-test-languages-rootless"))

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="as root it runs `rollbox serve` as an unprivileged user"),
    pytest.mark.slow,
]


def _why_not(user: pwd.struct_passwd) -> str | None:
    for tool in ("mmdebstrap", "newuidmap", "newgidmap"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (scripts/bootstrap installs mmdebstrap and uidmap as root)"
    for path in ("/etc/subuid", "/etc/subgid"):
        text = Path(path).read_text() if Path(path).exists() else ""
        if not any(line.split(":")[0] in (user.pw_name, str(user.pw_uid)) for line in text.splitlines()):
            return f"{path} grants {user.pw_name} no subordinate ids (useradd gives them when {path} exists)"
    return None


@pytest.fixture(scope="module")
def rootless_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    lock = open(LOCK, "w")  # noqa: SIM115  (one run as the rootless user at a time, as test_rootless)
    fcntl.flock(lock, fcntl.LOCK_EX)
    user = _ensure_user()
    why = _why_not(user)
    if why is not None:
        lock.close()
        pytest.skip(why)
    HOME.mkdir(exist_ok=True)
    os.chown(HOME, user.pw_uid, user.pw_gid)
    # lua's own layer is built again on every run: its snapshot name and its Debian build record go
    (HOME / "names" / "lua").unlink(missing_ok=True)
    for record in (HOME / "debian").glob("*.json") if (HOME / "debian").is_dir() else ():
        if json.loads(record.read_text()).get("packages") == ["lua5.4"]:
            record.unlink()
    # what a build killed half way leaves: a tree with files of a subordinate owner (dpkg's _apt, say),
    # which the user itself cannot remove; the store's clean-up removes it inside a user namespace
    sub_uid = next(int(line.split(":")[1]) for line in Path("/etc/subuid").read_text().splitlines()
                   if line.split(":")[0] in (user.pw_name, str(user.pw_uid)))
    leftover = HOME / "tmp" / "999999999.leftover"  # (no such pid: its process is gone)
    (leftover / "var" / "cache").mkdir(parents=True, exist_ok=True)
    (leftover / "var" / "cache" / "partial").write_text("x")
    for path in (HOME / "tmp", leftover, leftover / "var"):
        os.chown(path, user.pw_uid, user.pw_gid)
    for path in (leftover / "var" / "cache", leftover / "var" / "cache" / "partial"):
        os.chown(path, sub_uid + 42, sub_uid)
    python = Path(sys.executable)
    restore = _reachable([REPO, python.parent, Path(os.path.realpath(python)).parent])
    logs = tmp_path_factory.mktemp("rootless-serve")
    os.chown(logs, user.pw_uid, user.pw_gid)
    env = {"PATH": "/usr/bin:/bin:/usr/sbin:/sbin", "HOME": user.pw_dir, "LANG": "C.UTF-8",
           "ROLLBOX_DEBIAN_MAX_AGE_DAYS": "3650"}  # the cached base serves every later run
    srv = None
    try:
        srv = start_server(logs, "--home", str(HOME), "--durability", "off", env=env,
                           user=user.pw_uid, group=user.pw_gid, extra_groups=[])
        yield srv
    finally:
        if srv is not None:
            srv.stop()
        for d, mode in reversed(restore):
            os.chmod(d, mode)
        lock.close()


def _run_code(url: str, body: dict[str, object], wait_s: float = 600.0) -> dict[str, object]:
    """POST /run_code as verl does, retrying its 504 (the snapshot still building) until ``wait_s``."""
    deadline = time.monotonic() + wait_s
    while True:
        r = httpx.post(url + "run_code", json=body, timeout=httpx.Timeout(10.0, read=300.0))
        if r.status_code != 504 or time.monotonic() > deadline:
            assert r.status_code == 200, r.text
            out: dict[str, object] = r.json()
            return out
        assert "building" in r.json()["detail"], r.text
        time.sleep(2)


@pytest.mark.timeout(900)
def test_an_ordinary_user_builds_lua_on_first_use_and_runs_it(rootless_server: ServerProc) -> None:
    srv = rootless_server
    started = time.monotonic()
    reply = _run_code(srv.url, {"code": 'print("hello from lua " .. _VERSION)', "language": "lua",
                                "compile_timeout": 60, "run_timeout": 60})
    built_s = time.monotonic() - started
    assert reply["status"] == "Success", reply
    assert reply["run_result"]["stdout"] == "hello from lua Lua 5.4\n", reply  # type: ignore[index]
    # the build happened here, as this user, with its steps shown
    messages = [str(rec.get("msg", "")) for rec in srv.log_records()]
    assert any(m.startswith("building lua, step ") and "mmdebstrap" in m for m in messages), messages[-30:]
    assert any(m.startswith("built lua: snapshot lua = ") for m in messages), messages[-30:]
    langs = {row["language"]: row for row in httpx.get(srv.url + "languages", timeout=30).json()}
    assert langs["lua"]["state"] == "ready", langs["lua"]
    user = pwd.getpwnam("rollbox-rootless")
    sid = (HOME / "names" / "lua").read_text().strip()
    manifest = json.loads((HOME / "manifests" / f"{sid}.json").read_text())
    for layer in manifest["layers"]:  # the store is the user's: every layer unpacked as its files
        assert (HOME / "layers" / layer["id"]).stat().st_uid == user.pw_uid
    assert not any((HOME / "tmp").iterdir()), "the build, or the one killed before it, left files behind"
    print(f"lua built and answered in {built_s:.0f} s")

    # the shared base is the bash snapshot: bash runs from it
    reply = _run_code(srv.url, {"code": 'echo "hello from bash ${BASH_VERSINFO[0]}"', "language": "bash"})
    assert reply["status"] == "Success" and reply["run_result"]["stdout"] == "hello from bash 5\n", reply  # type: ignore[index]


def test_cpp_compiles_and_runs_rootless_when_the_store_holds_it(rootless_server: ServerProc) -> None:
    if not (HOME / "names" / "cpp").exists():
        pytest.skip(f"{HOME} has no cpp snapshot (as rollbox-rootless: ROLLBOX_HOME={HOME} rollbox languages "
                    "build cpp)")
    code = "#include <bits/stdc++.h>\nint main() { long a, b; std::cin >> a >> b; std::cout << a + b << '\\n'; }\n"
    reply = _run_code(rootless_server.url, {"code": code, "language": "cpp", "stdin": "2 40",
                                            "compile_timeout": 120, "run_timeout": 30})
    assert reply["status"] == "Success", reply
    assert reply["compile_result"]["return_code"] == 0 and reply["run_result"]["stdout"] == "42\n", reply  # type: ignore[index]


WHITEOUT_TEMPLATE = """name: whiteout-test
base:
  debian:
    over: {templates}/debian.yaml
    packages: []
    run: ["rm /etc/debian_version", "echo changed > /etc/issue"]
"""
CHECK = "test ! -e /etc/debian_version && cat /etc/issue"


def test_a_layer_built_rootless_with_a_whiteout_serves_rootless_and_root_sandboxes(rootless_server: ServerProc,
                                                                                   tmp_path: Path) -> None:
    """A layer over the base that removes a file holds a whiteout (char 0/0, made in the build's
    namespace); the user's sandboxes stack it rootless (userxattr), and root's, given the same layer
    from the user's store as a push and pull would copy it (its canonical tar), stack it as root.
    The layer is built on a machine's first run (~20 s) and kept in the store (lua's layer is the one
    built on every run)."""
    user = pwd.getpwnam("rollbox-rootless")
    spec = HOME / "whiteout-test.yaml"
    spec.write_text(WHITEOUT_TEMPLATE.format(templates=REPO / "snapshots" / "templates"))
    os.chown(spec, user.pw_uid, user.pw_gid)
    env = {"PATH": "/usr/bin:/bin:/usr/sbin:/sbin", "HOME": user.pw_dir, "LANG": "C.UTF-8",
           "ROLLBOX_HOME": str(HOME), "ROLLBOX_DEBIAN_MAX_AGE_DAYS": "3650"}
    cli = [sys.executable, "-m", "rollbox.functions.cli"]
    as_user = {"user": user.pw_uid, "group": user.pw_gid, "extra_groups": []}
    built = subprocess.run([*cli, "snapshot", "build", str(spec)], env=env, capture_output=True, text=True,
                           timeout=600, **as_user)  # type: ignore[call-overload]
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-2000:]
    sid = (HOME / "names" / "whiteout-test").read_text().strip()
    manifest = LocalStore(HOME).get_manifest(sid)
    top = manifest.layers[-1].id
    with tarfile.open(HOME / "blobs" / f"{top}.tar") as tar:
        wh = tar.getmember("etc/debian_version")
    assert wh.ischr() and (wh.devmajor, wh.devminor) == (0, 0)

    ran = subprocess.run([*cli, "run", "--snapshot", "whiteout-test", "--command", CHECK], env=env,
                         capture_output=True, text=True, timeout=120, **as_user)  # type: ignore[call-overload]
    assert (ran.returncode, ran.stdout) == (0, "changed\n"), ran.stderr[-2000:]

    root_store = LocalStore(tmp_path / "root-home")  # as root: owners applied, trusted.* xattrs
    for ref in manifest.layers:
        root_store.put_layer(ref.id, str(HOME / "blobs" / f"{ref.id}.tar"))
    root_store.set_name("whiteout-test", root_store.put_manifest(manifest))
    assert root_store.layer_path(manifest.layers[0].id).joinpath("etc", "shadow").stat().st_gid == 42  # shadow
    ran = subprocess.run([*cli, "run", "--home", str(tmp_path / "root-home"), "--snapshot", "whiteout-test",
                          "--command", CHECK], env={**env, "HOME": "/root", "ROLLBOX_HOME": str(tmp_path / "root-home")},
                         capture_output=True, text=True, timeout=120)
    assert (ran.returncode, ran.stdout) == (0, "changed\n"), ran.stderr[-2000:]
