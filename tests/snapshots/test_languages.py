"""Language snapshots: the runner model's table, the Debian layer diff, and a real build from Debian's
packages (mmdebstrap, as root) run in sandboxes.

The build test keeps its store in ROLLBOX_TEST_LANGUAGES_HOME (default /var/tmp/rollbox-test-languages),
reused across runs: its first run on a machine builds the shared Debian layer and Lua's (~1.5 min
here), later runs reuse both from the build records (a few seconds). Remove the directory to build
from scratch.
"""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path
from typing import Any

import pytest
from rollbox.runtime.errors import InvalidRequest
from rollbox.runtime.isolation import libc
from rollbox.runtime.runtime import Runtime, RuntimeConfig
from rollbox.runtime.spec import ExecRequest, Limits
from rollbox.snapshots import languages, userns
from rollbox.snapshots.build import build
from rollbox.snapshots.debian import diff_trees
from rollbox.snapshots.resolver import StoreResolver
from rollbox.snapshots.store_local import LocalStore
from rollbox.snapshots.template import load_template

from tests import langhome

TEMPLATES = Path(__file__).resolve().parents[2] / "snapshots" / "templates"
# SandboxFusion's Language literal (sandbox/runners/types.py)
SANDBOXFUSION = ("python", "cpp", "nodejs", "go", "go_test", "java", "php", "csharp", "bash", "typescript", "sql",
                 "rust", "cuda", "lua", "R", "perl", "D_ut", "ruby", "scala", "julia", "pytest", "junit",
                 "kotlin_script", "jest", "verilog", "python_gpu", "lean", "swift", "racket")
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="Debian roots are built as root (mmdebstrap --mode=root)")


def test_every_sandboxfusion_language_has_a_row_and_each_row_a_template_of_its_snapshot() -> None:
    assert sorted(languages.LANGUAGES) == sorted(SANDBOXFUSION)
    for name in languages.SUPPORTED:
        row = languages.language(name)
        assert row.template and row.source and row.run, name
        tpl, _ = load_template(TEMPLATES / row.template)
        assert tpl.name == row.snapshot, name
    assert {"julia", "lean", "swift", "cuda", "python_gpu"}.isdisjoint(languages.SUPPORTED)


@pytest.mark.parametrize("name", ["julia", "swift", "cuda"])
def test_a_language_without_a_toolchain_is_refused_naming_it_and_why(name: str) -> None:
    with pytest.raises(languages.UnsupportedLanguage, match=rf"language '{name}' is not supported: .*Debian 12|"
                                                          rf"language '{name}' is not supported: needs"):
        languages.plan(name, "print(1)")
    with pytest.raises(languages.UnsupportedLanguage, match=r"unknown language 'cobol'; supported: python, "):
        languages.plan("cobol", "DISPLAY 'HI'.")


def test_plans_follow_sandboxfusion_naming_rules() -> None:
    p = languages.plan("php", "  echo 1;")
    assert p.files == {"main.php": "<?php\necho 1;"} and p.run == "php -f main.php"
    p = languages.plan("junit", "import x;\npublic final class CalcTest { }")
    assert list(p.files) == ["CalcTest.java"] and p.tests == "junit"
    assert languages.plan("junit", "class T {}").files.keys() == {"Main.java"}
    p = languages.plan("scala", "object Hello extends App { println(1) }")
    assert p.run == "scala Hello" and p.compile == "scalac main.scala" and p.compile_error is None
    assert languages.plan("scala", "class X").compile_error == "Object name not found."
    p = languages.plan("cpp", "int main(){}")
    assert p.compile is not None and p.compile.startswith("g++ -std=c++17 main.cpp -o main") and p.run == "./main"
    assert p.artifacts == ("main",)
    assert "babel.config.js" in languages.plan("jest", "test('x', () => {})").files
    assert languages.missing_snapshot("cpp").endswith("rollbox snapshot build snapshots/templates/cpp.yaml "
                                                      "(from Debian's packages)")


def test_jvm_plans_size_the_heap_from_the_sandboxs_memory_limit_not_the_hosts() -> None:
    """Every JVM language's java (and javac, scalac, scala, kotlinc through -J) gets MaxRAM at the sandbox's
    limit with the heap at 75% of it; no limit, no flags; other languages never get them."""
    gib = 1 << 30
    flags = f"-XX:MaxRAM={gib} -XX:MaxRAMPercentage=75"
    j = f"-J-XX:MaxRAM={gib} -J-XX:MaxRAMPercentage=75"
    p = languages.plan("java", "public class Main {}", memory_max_bytes=gib)
    assert p.compile == f"javac {j} -cp .:/usr/share/java/javatuples.jar Main.java"
    assert p.run == f"java -XX:+UseSerialGC {flags} -cp .:/usr/share/java/javatuples.jar -ea Main"
    p = languages.plan("junit", "public class CalcTest {}", memory_max_bytes=gib)
    assert p.compile is not None and p.compile.startswith(f"javac {j} -cp .:")
    assert p.run.startswith(f"java -XX:+UseSerialGC {flags} -jar ")
    p = languages.plan("scala", "object Hello extends App { println(1) }", memory_max_bytes=gib)
    assert (p.compile, p.run) == (f"scalac {j} main.scala", f"scala {j} Hello")
    p = languages.plan("kotlin_script", "println(1)", memory_max_bytes=gib)
    assert p.compile == f"kotlinc {j} main.kts RollboxKts.kt -d ."
    assert p.run.startswith(f"java -XX:+UseSerialGC {flags} -Xmx256M -Xms32M -cp .:") and p.run.endswith(" RollboxKtsKt")
    half = languages.plan("java", "class A {}", memory_max_bytes=512 << 20)
    assert f"-XX:MaxRAM={512 << 20} " in half.run and f"-J-XX:MaxRAM={512 << 20} " in (half.compile or "")
    unsized = languages.plan("java", "class A {}")
    assert "MaxRAM" not in unsized.run + (unsized.compile or "") and "{" not in unsized.run + (unsized.compile or "")
    for name in languages.SUPPORTED:
        p = languages.plan(name, "object Main", memory_max_bytes=gib)
        jvm = name in ("java", "junit", "scala", "kotlin_script")
        assert ("MaxRAM" in p.run) == jvm and "{jvm" not in f"{p.run} {p.compile}", name
        assert ("MaxRAM" in (p.compile or "")) == (jvm and p.compile is not None), name


def test_debian_templates_are_checked_before_anything_is_built(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nbase: {debian: {packages: [g++, 'rm -rf /']}}\n")
    with pytest.raises(InvalidRequest, match=r"is invalid:\n  base\.debian\.packages: Value error, 'rm -rf /' is not a Debian"):
        load_template(bad)
    loop = tmp_path / "loop.yaml"
    loop.write_text("name: loop\nbase: {debian: {over: loop.yaml, packages: [lua5.4]}}\n")
    tpl, where = load_template(loop)
    with pytest.raises(InvalidRequest, match=r"base\.debian\.over: loop\.yaml leads back to itself"):
        build(tpl, where, LocalStore(tmp_path / "store"))
    # not root, and no subordinate ids to build with: said before anything is downloaded, with the fix
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setattr(userns, "SUBUID", str(tmp_path / "subuid"))
    (tmp_path / "subuid").write_text("someone-else:100000:65536\n")
    lua, lua_dir = load_template(TEMPLATES / "lua.yaml")
    monkeypatch.setenv("ROLLBOX_DEBIAN_MAX_AGE_DAYS", "0")  # no build record may serve it
    if userns._which("newuidmap") is None:
        with pytest.raises(InvalidRequest, match=r"newuidmap and newgidmap \(Debian package uidmap\).*apt-get install uidmap"):
            build(lua, lua_dir, LocalStore(tmp_path / "store"))
        return
    with pytest.raises(InvalidRequest, match=rf"needs a range of 65536 subordinate ids .*{tmp_path}/subuid .*grants it none.*"
                                             r"usermod --add-subuids 100000-165535 --add-subgids 100000-165535"):
        build(lua, lua_dir, LocalStore(tmp_path / "store"))
    assert not list((tmp_path / "store" / "tmp").iterdir())


def test_a_rootless_build_maps_the_callers_first_large_enough_subordinate_range(tmp_path: Path,
                                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    if userns._which("newuidmap") is None or userns._which("newgidmap") is None:
        pytest.skip("newuidmap/newgidmap are not installed (Debian package uidmap)")
    import pwd

    me = pwd.getpwuid(os.geteuid()).pw_name
    (tmp_path / "subuid").write_text(f"other:200000:65536\n{me}:300000:1000\n{me}:400000:65536\n")
    (tmp_path / "subgid").write_text(f"{os.geteuid()}:500000:70000\n")
    monkeypatch.setattr(userns, "SUBUID", str(tmp_path / "subuid"))
    monkeypatch.setattr(userns, "SUBGID", str(tmp_path / "subgid"))
    maps = userns.check()
    assert maps.uid_args() == ["0", str(os.geteuid()), "1", "1", "400000", "65535"]
    assert maps.gid_args() == ["0", str(os.getegid()), "1", "1", "500000", "65535"]


@as_root
def test_diff_trees_stacked_over_the_lower_tree_shows_the_full_one(tmp_path: Path) -> None:
    """What a toolchain layer holds: new and changed entries, whiteouts for removals, nothing unchanged;
    mounted over the lower tree it shows exactly the full tree."""
    lower, full = tmp_path / "lower", tmp_path / "full"
    for d in (lower, full):
        (d / "etc" / "keep").mkdir(parents=True)
        (d / "etc" / "keep" / "same").write_text("same\n")
        (d / "usr" / "lib").mkdir(parents=True)
    (lower / "etc" / "changed").write_text("old\n")
    (full / "etc" / "changed").write_text("new\n")
    (lower / "etc" / "gone").write_text("bye\n")
    (lower / "etc" / "gone-dir" / "sub").mkdir(parents=True)
    (lower / "etc" / "mode").write_text("x\n")
    (full / "etc" / "mode").write_text("x\n")
    os.chmod(full / "etc" / "mode", 0o600)
    (lower / "was-dir").mkdir()
    (lower / "was-dir" / "f").write_text("f\n")
    (full / "was-dir").write_text("now a file\n")
    (full / "usr" / "lib" / "new.so").write_bytes(b"\x7fELF")
    os.symlink("new.so", full / "usr" / "lib" / "link.so")
    want = _tree(full)

    out = tmp_path / "diff"
    assert diff_trees(str(lower), str(full), str(out)) == 7
    got = _tree(out)
    assert "etc/keep/same" not in got and "etc/keep" not in got
    assert got["etc/changed"] == ("f", 0o644, b"new\n")
    assert got["etc/gone"] == ("whiteout",) and got["etc/gone-dir"] == ("whiteout",)
    assert got["etc/mode"][1] == 0o600 and got["was-dir"][0] == "f" and got["usr/lib/link.so"] == ("l", "new.so")

    mnt = tmp_path / "mnt"
    mnt.mkdir()
    libc.mount("overlay", str(mnt), "overlay", libc.MS_RDONLY, f"lowerdir={out}:{lower}")
    try:
        assert _tree(mnt) == want
    finally:
        libc.umount2(str(mnt), libc.MNT_DETACH)


def _tree(root: Path) -> dict[str, tuple[object, ...]]:
    out: dict[str, tuple[object, ...]] = {}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            p = os.path.join(dirpath, name)
            rel, st = os.path.relpath(p, root), os.lstat(p)
            if stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:
                out[rel] = ("whiteout",)
            elif stat.S_ISLNK(st.st_mode):
                out[rel] = ("l", os.readlink(p))
            elif stat.S_ISDIR(st.st_mode):
                out[rel] = ("d", stat.S_IMODE(st.st_mode))
            else:
                out[rel] = ("f", stat.S_IMODE(st.st_mode), Path(p).read_bytes())
    return out


def test_unpacked_layers_give_every_entry_the_tars_mtime(tmp_path: Path) -> None:
    """Racket uses a compiled .zo only when it is not older than its source: with unpack-time mtimes a
    source unpacked after its .zo looked newer and every `racket` run compiled racket/base (3-6 s)."""
    src = tmp_path / "src"
    (src / "collects" / "compiled").mkdir(parents=True)
    (src / "collects" / "compiled" / "base_rkt.zo").write_bytes(b"zo")
    (src / "collects" / "base.rkt").write_text("#lang racket/base\n")
    os.symlink("base.rkt", src / "collects" / "link.rkt")
    store = LocalStore(tmp_path / "store")
    ref = store.add_layer_dir(src)
    root = store.layer_path(ref.id)
    mtimes = {str(p.relative_to(root)): p.lstat().st_mtime for p in [root, *root.rglob("*")]}
    assert set(mtimes.values()) == {0}, mtimes


LANG_HOME = langhome.LANG_HOME
IMAGE_ONLY_PYTHON = """
python: /opt/rollbox-test/python3
files:
  /opt/rollbox-test/python3: {content: "#!/bin/sh\\nexec /usr/bin/python3 \\"$@\\"\\n", mode: 0o755}
"""


@as_root
@pytest.mark.slow
@pytest.mark.timeout(900)
async def test_lua_and_bash_built_from_debian_share_the_base_layer_and_run_in_sandboxes(tmp_path: Path) -> None:
    if shutil.which("mmdebstrap") is None:
        pytest.skip("mmdebstrap is not installed (scripts/bootstrap installs it as root)")
    store = LocalStore(LANG_HOME)
    steps: list[str] = []
    with langhome.building():  # (the cached layers serve every later run)
        lua_tpl, lua_dir = load_template(TEMPLATES / "lua.yaml")
        lua = build(lua_tpl, lua_dir, store, on_step=steps.append)
        bash_tpl, bash_dir = load_template(TEMPLATES / "bash.yaml")
        bash = build(bash_tpl, bash_dir, store, on_step=steps.append)
    assert any("mmdebstrap" in s or "reusing layer" in s for s in steps), steps  # progress was told
    # the shared base: one layer id under both; Lua adds only its own small layer
    assert bash.layers[0].id == lua.layers[0].id and lua.base == f"debian:bookworm:{bash.layers[0].id}"
    assert lua.layers[1].size_bytes < 5_000_000 < lua.layers[0].size_bytes
    assert lua.version.packages["deb:lua5.4"].startswith("5.4.") and lua.version.python.startswith("3.11")
    assert lua.warm.python == "/usr/bin/python3" and "/usr/lib/python3/dist-packages" in lua.warm.sys_path

    # a zygote whose interpreter exists only inside the image (the host has no /opt/rollbox-test)
    spec = tmp_path / "image-python.yaml"  # lua's recipe (its layers reused) with another interpreter
    spec.write_text((TEMPLATES / "lua.yaml").read_text().replace("name: lua", "name: lua-image-python")
                    .replace("over: debian.yaml", f"over: {TEMPLATES}/debian.yaml") + IMAGE_ONLY_PYTHON)
    assert not Path("/opt/rollbox-test/python3").exists()
    img_tpl, img_dir = load_template(spec)
    with langhome.building():
        build(img_tpl, img_dir, store)

    state = tmp_path / "state"
    async with Runtime(RuntimeConfig(state_dir=state, layer_root=Path(store.layer_root)),
                       resolver=StoreResolver(store)) as rt:
        plan = languages.plan("lua", 'local n = io.read("n"); print(("hello %d from " .. _VERSION):format(n * 2))')
        res = await rt.run(ExecRequest(command=plan.run, files=plan.files, stdin="21\n"), snapshot=plan.snapshot)
        assert (res.exit_code, res.stdout) == (0, "hello 42 from Lua 5.4\n"), res.stderr
        res = await rt.run(ExecRequest(command="id -un; echo \"$HOME\"; test -w /tmp && echo tmp-ok; "
                                               "ls /etc/ssl/certs/ca-certificates.crt"), snapshot="bash")
        assert res.stdout == "sandbox\n/home/sandbox\ntmp-ok\n/etc/ssl/certs/ca-certificates.crt\n", res.stderr
        # Debian's pycs are unchecked-hash (flags 1): valid although the layer keeps no mtimes
        res = await rt.run(ExecRequest(command="python3 -c \"import importlib.util as u, json; "
                                               "print(open(u.cache_from_source(json.__file__), 'rb').read(8)[4])\""),
                           snapshot="bash")
        assert res.stdout == "1\n", res.stderr
        res = await rt.run(ExecRequest(code="import sys; print(sys.executable)"), snapshot="lua-image-python")
        assert (res.exit_code, res.stdout) == (0, "/usr/bin/python3\n"), res.stderr  # what the wrapper ran
        # no address-space cap that would stop a JVM or V8 reserving: memory is the cgroup's to limit, or
        # (no cgroup) RLIMIT_DATA's, which counts what is filled, not what is reserved
        res = await rt.run(ExecRequest(command="grep -E '^Max (address space|data size)' /proc/self/limits"),
                           snapshot="lua", limits=Limits(memory_max_bytes=256 << 20))
        data, space = (line.split()[3:5] for line in res.stdout.splitlines())
        assert space == (["unlimited"] * 2 if rt.cgroup_backend is not None else [str((256 << 20) + (4 << 30))] * 2)
        assert data == (["unlimited"] * 2 if rt.cgroup_backend is not None else [str(256 << 20)] * 2), res.stdout


# ----------------------------------------------------------------------- built on first use, or ahead of time


def test_a_builds_steps_count_its_debian_layers_packages_files_and_manifest() -> None:
    from rollbox.snapshots.language_builds import steps_of

    def steps(name: str) -> int:
        return steps_of(*load_template(TEMPLATES / f"{name}.yaml"))

    assert steps("bash") == 2  # the Debian base, the manifest
    assert steps("lua") == 4  # the shared base, lua's layer, the preload file, the manifest
    assert steps("junit") == 5  # over java over debian: three Debian layers


def test_a_build_record_left_by_a_dead_builder_is_not_building_and_a_failure_says_why(tmp_path: Path) -> None:
    import fcntl
    import json

    from rollbox.snapshots.language_builds import LanguageBuilds

    builds = LanguageBuilds(LocalStore(tmp_path))
    assert builds.status("lua").state == "missing"
    (tmp_path / "builds").mkdir()
    record = {"language": "lua", "snapshot": "lua", "state": "building", "step": 1, "steps": 4, "doing": "x"}
    (tmp_path / "builds" / "lua.json").write_text(json.dumps(record))
    assert builds.status("lua").state == "missing"  # no process holds its lock: nothing builds it
    fd = os.open(tmp_path / "builds" / "lua.lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)  # as the builder (another process) would
    try:
        assert builds.status("lua").describe() == "building lua, step 1/4: x"
    finally:
        os.close(fd)
    (tmp_path / "builds" / "lua.json").write_text(json.dumps({**record, "state": "failed", "error": "no network"}))
    assert builds.status("lua").describe() == "building lua failed: no network"


def test_the_languages_command_refuses_an_unknown_language_before_building_anything(tmp_path: Path) -> None:
    from rollbox.snapshots.cli import main

    assert main(["languages", "build", "lua", "cobol", "--home", str(tmp_path)]) == 2
    assert not (tmp_path / "builds").exists()


@as_root
@pytest.mark.timeout(900)  # the store's Debian layer may be another worker's build to wait for
def test_the_languages_command_builds_what_the_home_lacks_and_lists_it_ready(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The home's layers and Debian build records are the language test store's (its Debian base layer is
    reused; the build's own steps, manifest and name run here); bash needs nothing else."""
    import json

    from rollbox.snapshots.cli import main

    if shutil.which("mmdebstrap") is None:
        pytest.skip("mmdebstrap is not installed (scripts/bootstrap installs it as root)")
    with langhome.building() as lang_home:  # its layers are the store's
        for sub in ("layers", "layers-meta", "debian"):
            (lang_home / sub).mkdir(exist_ok=True)
            (tmp_path / sub).symlink_to(lang_home / sub)
        assert main(["languages", "build", "bash", "--home", str(tmp_path), "--json"]) == 0
    (built,) = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert built["state"] == "ready" and (tmp_path / "names" / "bash").read_text().strip() == built["snapshot_id"]
    assert main(["languages", "list", "--home", str(tmp_path), "--json"]) == 0
    rows = {r["language"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["bash"]["state"] == "ready" and rows["lua"]["state"] == "missing"


# ----------------------------------------------------------------------- built once for every replica (S3)


def _shared_builds(home: Path, url: str, make_s3: Any, templates: Path) -> Any:
    from rollbox.snapshots.language_builds import LanguageBuilds
    from rollbox.snapshots.store_s3 import S3Objects

    remote = make_s3(url)
    return LanguageBuilds(LocalStore(home), templates, remote=remote, claims=S3Objects(remote))


def test_replicas_sharing_s3_build_a_language_once_wait_for_a_claimed_build_and_take_over_a_dead_one(
        tmp_path: Path, s3_url: str, make_s3: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two replicas (LanguageBuilds on two homes) share a SeaweedFS bucket. ``bash``'s template here is a
    host-based one (seconds to build, no root), so the sharing is what is tested: the first replica builds
    and pushes it, the second uses it from the store; a build claimed by a third replica is waited for
    (then used, or its failure reported), and a claim whose builder stopped beating is taken over."""
    import json
    import threading
    import time

    from rollbox.snapshots import language_builds
    from rollbox.snapshots.store import copy_snapshot

    templates = tmp_path / "templates"
    templates.mkdir()
    (templates / "bash.yaml").write_text("name: bash\nwarm: {imports: [json]}\n")
    a = _shared_builds(tmp_path / "a", s3_url, make_s3, templates)
    b = _shared_builds(tmp_path / "b", s3_url, make_s3, templates)
    assert {p.language: p.state for p in b.statuses()}["bash"] == "missing"
    built = a.build("bash")
    assert a.started == 1 and a.remote.names()["bash"] == built.id  # pushed: layers, manifest, name
    assert a.claims.keys("language-builds/") == []  # the claim and its beat are gone
    (bash,) = [p for p in b.statuses() if p.language == "bash"]
    assert (bash.state, bash.snapshot_id, bash.where) == ("ready", built.id, "store")
    assert b.build("bash").id == built.id and b.started == 0  # the second replica builds nothing

    # a build claimed by another replica: waited for, then its snapshot used
    url2 = s3_url.replace("/snapshots", "/other")
    c = _shared_builds(tmp_path / "c", url2, make_s3, templates)
    claims = c.claims
    claims.put_new("language-builds/bash.claim", json.dumps({"replica": "elsewhere:7", "since": time.time()}).encode())
    claims.put_new("language-builds/bash.beat", json.dumps({"step": 1, "steps": 2, "doing": "base: mmdebstrap",
                                                            "beat": time.time()}).encode())
    (bash,) = [p for p in c.statuses() if p.language == "bash"]
    assert bash.describe() == "building bash on replica elsewhere:7, step 1/2: base: mmdebstrap"
    monkeypatch.setattr(language_builds, "POLL_S", 0.1)
    got: list[Any] = []
    waiter = threading.Thread(target=lambda: got.append(c.build("bash")))
    waiter.start()
    time.sleep(1.0)
    assert waiter.is_alive() and c.status("bash").describe().startswith("building bash on replica elsewhere:7")
    copy_snapshot(LocalStore(tmp_path / "a"), c.remote, "bash")  # the other replica's build lands
    claims.delete(["language-builds/bash.claim", "language-builds/bash.beat"])
    waiter.join(30)
    assert got and got[0].id == built.id and c.started == 0

    # a claimed build that failed: the waiters get its failure, nobody builds it again for a while
    url3 = s3_url.replace("/snapshots", "/third")
    d = _shared_builds(tmp_path / "d", url3, make_s3, templates)
    d.claims.put_new("language-builds/bash.failed", json.dumps({"replica": "elsewhere:7", "since": time.time(),
                                                                "error": "no network"}).encode())
    with pytest.raises(language_builds.SnapshotNotFound, match="building bash on replica elsewhere:7 failed: no network"):
        d.build("bash")
    assert d.started == 0
    # a claim whose builder stopped beating (killed): taken over, built here, pushed
    d.claims.delete(["language-builds/bash.failed"])
    old = time.time() - 3600
    d.claims.put_new("language-builds/bash.claim", json.dumps({"replica": "dead:1", "since": old}).encode())
    d.claims.put_new("language-builds/bash.beat", json.dumps({"beat": old}).encode())
    assert d.build("bash").id == built.id and d.started == 1  # (reproducible: the same snapshot)
    assert d.remote.names()["bash"] == built.id and d.claims.keys("language-builds/") == []


def test_a_replica_that_claims_a_build_just_after_another_ones_failed_gets_that_failure(
        tmp_path: Path, s3_url: str, make_s3: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Replica B looks (nothing claimed, nothing failed), replica A claims the build, fails at once (a
    template it cannot take; apt without a network fails in seconds too) and lets go of the claim, then
    B's claim succeeds: B looks once more and answers A's failure instead of building (and failing) too."""
    from rollbox.snapshots import language_builds

    templates = tmp_path / "templates"
    templates.mkdir()
    (templates / "bash.yaml").write_text("name: bash\nno_such_field: 1\n")
    a = _shared_builds(tmp_path / "a", s3_url, make_s3, templates)
    b = _shared_builds(tmp_path / "b", s3_url, make_s3, templates)
    looks: list[int] = []
    real = b._elsewhere

    def first_look_before_a_failed(snapshot: str) -> Any:
        looks.append(1)
        return None if len(looks) == 1 else real(snapshot)

    monkeypatch.setattr(b, "_elsewhere", first_look_before_a_failed)
    with pytest.raises(InvalidRequest, match="no_such_field"):
        a.build("bash")
    assert a.started == 1 and a.claims.keys("language-builds/") == ["language-builds/bash.failed"]
    with pytest.raises(language_builds.SnapshotNotFound, match=f"building bash on replica {a.me} failed"):
        b.build("bash")
    assert b.started == 0 and b.claims.keys("language-builds/") == ["language-builds/bash.failed"]


def test_a_replica_whose_claim_was_taken_over_releases_nothing_of_the_new_owners(
        tmp_path: Path, s3_url: str, make_s3: Any) -> None:
    """Replica A claims bash's build; while it builds, replica B takes the claim over (A gave no news for
    too long). A finishes and pushes, and its release leaves B's claim where it is."""
    import json
    import time

    templates = tmp_path / "templates"
    templates.mkdir()
    (templates / "bash.yaml").write_text("name: bash\nwarm: {imports: [json]}\n")
    a = _shared_builds(tmp_path / "a", s3_url, make_s3, templates)
    key = "language-builds/bash.claim"
    theirs = json.dumps({"language": "bash", "snapshot": "bash", "replica": "b:2", "since": time.time()}).encode()
    seen: list[bytes | None] = []

    def take_over(_: Any) -> None:
        if not seen:
            seen.append(a.claims.get(key))  # A's claim, as B found it stale
            a.claims.delete([key])
            assert a.claims.put_new(key, theirs)

    built = a.build("bash", on_progress=take_over)
    assert seen and json.loads(seen[0] or b"{}")["replica"] == a.me
    assert a.started == 1 and a.remote.names()["bash"] == built.id
    assert a.claims.get(key) == theirs  # B's claim stays B's to release


def test_a_home_holding_a_language_pushes_it_under_a_claim_create_only_and_a_store_error_is_only_logged(
        tmp_path: Path, s3_url: str, make_s3: Any, caplog: pytest.LogCaptureFixture) -> None:
    """A home that built bash before it shared a store (a baked image's) pushes it at start (``push_built``,
    what ``rollbox serve --store s3://...`` runs on a thread): not while another replica holds its claim,
    once the claim is gone (layers, manifest, name; no claim left), not again once there, never over a
    name another replica made, and a store that cannot be reached is logged, not raised."""
    import json
    import time

    from rollbox.snapshots.language_builds import LanguageBuilds
    from rollbox.snapshots.store_s3 import S3Objects, S3Store

    from tests.snapshots.s3server import ACCESS_KEY, SECRET_KEY, free_ports

    templates = tmp_path / "templates"
    templates.mkdir()
    (templates / "bash.yaml").write_text("name: bash\nwarm: {imports: [json]}\n")
    built = LanguageBuilds(LocalStore(tmp_path / "a"), templates).build("bash")
    a = _shared_builds(tmp_path / "a", s3_url, make_s3, templates)
    claim = json.dumps({"replica": "b:2", "since": time.time()}).encode()
    assert a.claims.put_new("language-builds/bash.claim", claim)
    assert a.push_built() == {"bash": "claimed"} and "bash" not in a.remote.names()
    assert a.claims.get("language-builds/bash.claim") == claim
    a.claims.delete(["language-builds/bash.claim"])
    assert a.push_built() == {"bash": "pushed"}
    assert a.remote.names() == {"bash": built.id} and a.remote.get_manifest(built.id) == built
    assert all(a.remote.has_layer(ref.id) for ref in built.layers) and a.claims.keys("language-builds/") == []
    assert a.push_built() == {"bash": "there"}
    third = _shared_builds(tmp_path / "a", s3_url.replace("/snapshots", "/third"), make_s3, templates)
    assert third.build("bash") == built and third.started == 0  # (a build asked for: the same push)
    assert third.remote.names() == {"bash": built.id} and third.claims.keys("language-builds/") == []

    other = _shared_builds(tmp_path / "a", s3_url.replace("/snapshots", "/other"), make_s3, templates)
    other.remote.set_name("bash", "0" * 64)  # another replica's bash, named first
    assert other.push_built() == {"bash": "named other"} and other.remote.names() == {"bash": "0" * 64}

    (port,) = free_ports(1)
    remote = S3Store(s3_url, endpoint_url=f"http://127.0.0.1:{port}", access_key_id=ACCESS_KEY,
                     secret_access_key=SECRET_KEY, max_attempts=1)
    gone = LanguageBuilds(LocalStore(tmp_path / "a"), templates, remote=remote, claims=S3Objects(remote))
    assert gone.push_built() == {"bash": "failed"}
    assert any("is here but was not pushed" in r.message and "unreachable" in r.message for r in caplog.records)
