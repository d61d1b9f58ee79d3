"""Root filesystems from Debian's packages, built with mmdebstrap, as layers shared between snapshots.

A template's ``base: {debian: {...}}`` names a suite and packages. Without ``over`` it is one layer: a
minimal Debian (``--variant=minbase``) with python3 (the zygote's interpreter), ca-certificates and
the packages asked for. With ``over: other.yaml`` it is two: that template's Debian layer (built once,
shared by every template on it: the same layer id) and over it a layer holding only what installing
this template's packages changed (an overlay diff: new and changed files, a whiteout for each file
removed). Each toolchain is built from Debian's archive, never from what the host has installed.

    root    mmdebstrap --mode=root, as root or, for any other user, as root of a user namespace holding
            its subordinate ids (snapshots/userns.py; the layer is the same: each file keeps its owner)
    mirror  deb.debian.org: SUITE, SUITE-updates and SUITE-security, component main
    pycs    Debian's timestamp pycs made unchecked-hash (a layer keeps no mtimes)
    slim    no man pages, docs (copyright files kept), locales or info; no apt lists or caches,
            logs, /dev nodes (the runtime's skeleton gives /dev), machine-id, hostname, resolv.conf
    users   /etc/passwd and /etc/group carry the sandbox user (uid 1000), /etc/hosts the sandbox's
    time    SOURCE_DATE_EPOCH fixed, so the same packages give the same layer id; snapshot.debian.org
            is not reachable, so versions move with the archive: the layer's /var/lib/dpkg/status holds
            them all, the build cache record every one, the manifest's VERSION the packages named

Layers are reused: a build record per recipe (suite, packages, commands, the layer below) in
``<store>/debian/`` names the layer last built for it; a later build of the same recipe uses that
layer while it is in the store and younger than ROLLBOX_DEBIAN_MAX_AGE_DAYS (default 7; 0 rebuilds
every time, picking up the archive's updates).
"""

from __future__ import annotations

import collections
import filecmp
import hashlib
import json
import os
import shutil
import stat
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollbox.runtime.errors import InvalidRequest, StoreError
from rollbox.runtime.isolation import libc
from rollbox.runtime.isolation.users import SANDBOX_GID, SANDBOX_UID
from rollbox.snapshots import userns
from rollbox.snapshots.layers import pack_to_file, remove_tree
from rollbox.snapshots.manifest import LayerRef
from rollbox.snapshots.store_local import LocalStore

BUILDER_VERSION = 3  # part of every build record's key: a change of what a build does rebuilds
MIRROR = "http://deb.debian.org/debian"
SECURITY_MIRROR = "http://deb.debian.org/debian-security"
BASE_PACKAGES = ("python3", "ca-certificates")
PYTHON = "/usr/bin/python3"
DIST_PACKAGES = "/usr/lib/python3/dist-packages"  # Debian's Python packages: the zygote runs with -S
# bookworm's release day: /etc/shadow's dates and whatever else a package stamps with "now"
SOURCE_DATE_EPOCH = "1686355200"
MAX_AGE_DAYS = 7.0
SLIM = (
    "path-exclude=/usr/share/man/*", "path-exclude=/usr/share/doc/*", "path-include=/usr/share/doc/*/copyright",
    "path-exclude=/usr/share/locale/*", "path-include=/usr/share/locale/locale.alias",
    "path-exclude=/usr/share/info/*", "path-exclude=/usr/share/lintian/*", "path-exclude=/usr/share/linda/*",
)
HOSTS = "127.0.0.1 localhost sandbox\n::1 localhost\n"
# man pages are left out, but update-alternatives (the JDK's postinst) links into this directory
MAN1 = "usr/share/man/man1"
# what apt, dpkg and the build leave behind that no sandbox needs (globs under the root)
DROP = (
    "dev/*", "run/*", "tmp/*", "var/tmp/*", "var/cache/apt/*.bin", "var/cache/apt/archives/*.deb",
    "var/lib/apt/lists/*", "var/log/*", "var/cache/debconf/*-old", "var/lib/dpkg/*-old", "etc/hostname",
    "etc/resolv.conf", "var/cache/ldconfig/aux-cache", "root/.npm", "root/.cache", "etc/apt/apt.conf.d/99mmdebstrap",
)

# Debian byte-compiles Python modules into timestamp pycs (which record their source's mtime: a layer
# keeps none, so every import would compile again in memory, as a sandbox cannot write the pyc) or,
# with SOURCE_DATE_EPOCH set, checked-hash ones (which hash the source at every import). Each layer
# turns the pycs it brought into unchecked-hash ones: valid whatever the mtimes, nothing to check.
PYC_UNCHECKED = """
import glob, importlib.util, py_compile, sys
n = 0
for pyc in glob.glob('/usr/lib/python3*/**/__pycache__/*.pyc', recursive=True):
    with open(pyc, 'rb') as f:
        head = f.read(8)
    if head[:4] != importlib.util.MAGIC_NUMBER or head[4] & 1 and not head[4] & 2:
        continue  # another Python's, or unchecked-hash already
    try:
        src = importlib.util.source_from_cache(pyc)
    except ValueError:
        continue
    opt = 2 if '.opt-2.' in pyc else 1 if '.opt-1.' in pyc else 0
    try:
        py_compile.compile(src, cfile=pyc, dfile=src, optimize=opt, doraise=True,
                           invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH)
        n += 1
    except (OSError, py_compile.PyCompileError):
        pass
print(f'{n} pycs made unchecked-hash')
"""

Step = Callable[[str], None]


@dataclass(frozen=True)
class Recipe:
    """What one Debian layer is built from (``below``: the ids of the layers it is a diff over)."""

    suite: str
    packages: tuple[str, ...]
    run: tuple[str, ...] = ()
    below: tuple[str, ...] = ()  # the layers this one is a diff over, bottom first

    @property
    def key(self) -> str:
        blob = json.dumps({"v": BUILDER_VERSION, "suite": self.suite, "packages": sorted(self.packages),
                           "run": list(self.run), "below": list(self.below), "arch": os.uname().machine},
                          sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:32]


@dataclass
class Built:
    """A Debian layer as built (or reused): its ref and every package's version in the whole root."""

    layer: LayerRef
    versions: dict[str, str] = field(default_factory=dict)
    reused: bool = False
    seconds: float = 0.0


def mirrors(suite: str) -> list[str]:
    """The sources of a suite: itself, its updates and its security updates (main)."""
    lines = [f"deb {MIRROR} {suite} main"]
    if suite not in ("sid", "unstable", "experimental"):
        lines += [f"deb {MIRROR} {suite}-updates main", f"deb {SECURITY_MIRROR} {suite}-security main"]
    return lines


def check_can_build() -> str:
    """The mmdebstrap binary, or InvalidRequest saying why a Debian root cannot be built here: as root,
    mmdebstrap; as another user also what a user namespace with its subordinate ids needs (userns.check)."""
    tool = shutil.which("mmdebstrap") or ("/usr/bin/mmdebstrap" if os.path.exists("/usr/bin/mmdebstrap") else None)
    if tool is None:
        raise InvalidRequest("base.debian: building a root filesystem from Debian's packages needs mmdebstrap "
                             "(a Debian package: as root, `apt-get install mmdebstrap`; scripts/bootstrap names it)")
    if os.geteuid() != 0:
        userns.check()
    return tool


def build_layer(store: LocalStore, recipe: Recipe, *, step: Step, label: str,
                max_age_days: float | None = None) -> Built:
    """The layer for ``recipe``: reused from the build record when still fresh, else built now."""
    record = _record_path(store, recipe)
    age_limit = max_age_days if max_age_days is not None else _max_age_days()
    if age_limit > 0:
        try:
            rec = json.loads(record.read_text())
            fresh = time.time() - float(rec["built_at"]) < age_limit * 86400
            ref = LayerRef(id=rec["layer"], size_bytes=rec["size_bytes"])
            if fresh and store.has_layer(ref.id):
                step(f"{label}: reusing layer {ref.id[:12]} built {_ago(float(rec['built_at']))}")
                return Built(ref, dict(rec["versions"]), reused=True)
        except (OSError, ValueError, KeyError, TypeError):
            pass
    tool = check_can_build()
    started = time.monotonic()
    work = Path(store.tmp_dir())
    try:
        job = {"op": "build", "tool": tool, "work": str(work), "label": label, "host_root": os.geteuid() == 0,
               "below": [str(store.layer_path(x)) for x in recipe.below],
               "recipe": {"suite": recipe.suite, "packages": list(recipe.packages), "run": list(recipe.run),
                          "below": list(recipe.below)}}
        # rootless: the same build, as root of a user namespace holding the caller's subordinate ids
        done = run_build_job(job, step) if os.geteuid() == 0 else userns.run(job, step)
        versions = done["versions"]
        step(f"{label}: storing the layer")
        store.put_layer(done["id"], str(work / "layer.tar"))
        ref = LayerRef(id=done["id"], size_bytes=done["size_bytes"])
    finally:
        _remove_work(work)
    seconds = time.monotonic() - started
    record.parent.mkdir(parents=True, exist_ok=True)
    tmp = record.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"layer": ref.id, "size_bytes": ref.size_bytes, "built_at": time.time(),
                               "seconds": round(seconds, 1), "suite": recipe.suite,
                               "packages": list(recipe.packages), "run": list(recipe.run), "below": list(recipe.below),
                               "versions": versions}, indent=1, sort_keys=True))
    os.replace(tmp, record)
    step(f"{label}: layer {ref.id[:12]} ({ref.size_bytes / 1e6:.0f} MB) in {seconds:.0f} s")
    return Built(ref, versions, seconds=seconds)


def run_build_job(job: dict[str, Any], step: Step) -> dict[str, Any]:
    """Build a recipe's root under ``job["work"]`` and pack its layer (the root, or its diff against the
    layers below) into ``work/layer.tar``; returns the tar's id and size and the root's package
    versions. Runs as root: the host's, or (rootless) that of the user namespace ``userns.run`` makes."""
    r = job["recipe"]
    recipe = Recipe(r["suite"], tuple(r["packages"]), tuple(r["run"]), tuple(r["below"]))
    work, label, lowers = Path(job["work"]), job["label"], list(job["below"])
    mounted: Path | None = None
    root, diff = work / "root", work / "diff"
    try:
        below: Path | None = None
        if len(lowers) == 1:
            below = Path(lowers[0])
        elif lowers:  # the layers below, stacked as the sandbox will see them
            below = mounted = work / "below"
            below.mkdir()
            # a rootless store marks opaque directories with user.overlay.opaque, which userxattr reads
            opts = f"lowerdir={':'.join(reversed(lowers))}" + ("" if job.get("host_root", True) else ",userxattr")
            libc.mount("overlay", str(below), "overlay", libc.MS_RDONLY, opts)
        _mmdebstrap(job["tool"], recipe, root, below, step=step, label=label)
        _tidy(root)
        versions = _versions(root)
        missing = [p for p in recipe.packages if p.split("=")[0].split(":")[0] not in versions]
        if missing:
            raise StoreError(f"{label}: packages asked for but not installed: {', '.join(missing)}")
        if below is None:
            src = root
        else:
            step(f"{label}: diffing against layer {recipe.below[-1][:12]}")
            diff_trees(str(below), str(root), str(diff))
            src = diff
        step(f"{label}: packing the layer")
        packed = pack_to_file(src, work / "layer.tar", owner=None)
    finally:
        if mounted is not None:
            libc.umount2(str(mounted), libc.MNT_DETACH)
        for tree in (root, diff, work / "below"):
            remove_tree(tree)
    return {"id": packed.id, "size_bytes": packed.size_bytes, "versions": versions}


def _remove_work(work: Path) -> None:
    """Remove a build's directory; rootless, what a killed build left there (files of subordinate owners)
    is removed inside a user namespace that maps them."""
    try:
        remove_tree(work)
    except PermissionError:
        if os.geteuid() == 0:
            raise
        userns.remove(str(work))


def _record_path(store: LocalStore, recipe: Recipe) -> Path:
    return store.root / "debian" / f"{recipe.key}.json"


def _max_age_days() -> float:
    raw = os.environ.get("ROLLBOX_DEBIAN_MAX_AGE_DAYS", "").strip()
    if not raw:
        return MAX_AGE_DAYS
    try:
        return float(raw)
    except ValueError:
        raise InvalidRequest(f"ROLLBOX_DEBIAN_MAX_AGE_DAYS={raw!r}: not a number of days") from None


def _ago(t: float) -> str:
    s = max(0.0, time.time() - t)
    return f"{s / 3600:.1f} h ago" if s < 2 * 86400 else f"{s / 86400:.0f} days ago"


def _mmdebstrap(tool: str, recipe: Recipe, root: Path, below: Path | None, *, step: Step, label: str) -> None:
    env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8",
           "SOURCE_DATE_EPOCH": os.environ.get("SOURCE_DATE_EPOCH", SOURCE_DATE_EPOCH),
           "TMPDIR": str(root.parent), "HOME": "/root"}
    inside = ("chroot \"$1\" /usr/bin/env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin "
              "HOME=/root LANG=C.UTF-8 DEBIAN_FRONTEND=noninteractive SOURCE_DATE_EPOCH=\"$SOURCE_DATE_EPOCH\" ")
    cmd = [tool, "--mode=root", "--dpkgopt=force-unsafe-io", "--aptopt=Acquire::Languages \"none\"",
           "--aptopt=APT::Install-Recommends \"false\"", *(f"--dpkgopt={o}" for o in SLIM)]
    if below is None:
        cmd += ["--variant=minbase", "--include=" + ",".join(dict.fromkeys((*BASE_PACKAGES, *recipe.packages)))]
    else:
        # the layer below, copied in as it is; apt installs this recipe's packages over it
        cmd += ["--variant=custom", f"--setup-hook=sync-in {below} /", f"--setup-hook=mkdir -p \"$1\"/{MAN1}"]
        if recipe.packages:
            cmd.append("--customize-hook=" + inside + "apt-get install --yes --no-install-recommends -o "
                       "Dpkg::Use-Pty=0 " + " ".join(_quote(p) for p in recipe.packages))
    for command in recipe.run:
        cmd.append("--customize-hook=" + inside + "/bin/sh -ec " + _quote(command))
    cmd.append("--customize-hook=" + inside + "PYTHONHASHSEED=0 /bin/sh -c "
               + _quote("[ ! -x /usr/bin/python3 ] || exec /usr/bin/python3 -c " + _quote(PYC_UNCHECKED)))
    cmd += [recipe.suite, str(root), *mirrors(recipe.suite)]
    step(f"{label}: mmdebstrap {recipe.suite} " + " ".join(recipe.packages or BASE_PACKAGES))
    tail: collections.deque[str] = collections.deque(maxlen=40)
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                          env=env, text=True, errors="replace") as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.rstrip()
            tail.append(line)
            if line.startswith("I: "):
                step(f"{label}: {line[3:]}")
            elif line.startswith(("Unpacking ", "Setting up ")):
                step(f"{label}: {line}")
    if proc.returncode != 0:
        raise StoreError(f"{label}: mmdebstrap failed (exit {proc.returncode}):\n" + "\n".join(list(tail)[-25:]))


def _quote(s: str) -> str:
    return "'" + s.replace("'", "'\"'\"'") + "'"


def _tidy(root: Path) -> None:
    """Drop what no sandbox needs; give the root the sandbox user and the sandbox's hosts file."""
    for pattern in DROP:
        for path in root.glob(pattern):
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
    (root / MAN1).mkdir(parents=True, exist_ok=True)
    etc = root / "etc"
    (etc / "hosts").write_text(HOSTS)
    _add_line(etc / "passwd", "sandbox", f"sandbox:x:{SANDBOX_UID}:{SANDBOX_GID}:sandbox:/home/sandbox:/bin/sh\n")
    _add_line(etc / "group", "sandbox", f"sandbox:x:{SANDBOX_GID}:\n")


def _add_line(path: Path, name: str, line: str) -> None:
    text = path.read_text()
    if not any(x.split(":", 1)[0] == name for x in text.splitlines()):
        path.write_text(text + ("" if text.endswith("\n") or not text else "\n") + line)


def _versions(root: Path) -> dict[str, str]:
    """Every installed package's version, read from the root's dpkg database."""
    proc = subprocess.run(["dpkg-query", f"--admindir={root}/var/lib/dpkg", "-W",
                           "-f", "${db:Status-Abbrev}\t${Package}\t${Version}\n"],
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise StoreError(f"cannot read the package versions of {root}: {proc.stderr.strip()[-500:]}")
    out = {}
    for row in proc.stdout.splitlines():
        status, name, version = row.split("\t")
        if status.startswith("ii"):
            out[name] = version
    return dict(sorted(out.items()))


# --- the diff of a root against the layer below it -------------------------------------------------


def diff_trees(lower: str, full: str, out: str) -> int:
    """Move into ``out`` what ``full`` (a root built over a copy of ``lower``) has that ``lower`` lacks or
    holds otherwise (type, mode, owner, bytes, link target), with a whiteout (char 0/0) for each path
    of ``lower`` gone from ``full``: ``out`` stacked over ``lower`` shows ``full``. ``full`` is consumed.
    Returns the number of entries written."""
    os.mkdir(out)
    _copy_meta(os.lstat(full), out)
    return sum(1 for _ in _diff(lower, full, out, ""))


def _diff(lower: str, full: str, out: str, rel: str) -> Iterator[str]:
    here_full, here_low = os.path.join(full, rel), os.path.join(lower, rel)
    names = sorted(os.listdir(here_full))
    try:
        low_names = set(os.listdir(here_low)) if not os.path.islink(here_low) else set()
    except (FileNotFoundError, NotADirectoryError):
        low_names = set()
    for name in names:
        r = os.path.join(rel, name)
        f, lo = os.path.join(full, r), os.path.join(lower, r)
        st = os.lstat(f)
        try:
            lst: os.stat_result | None = os.lstat(lo) if name in low_names else None
        except FileNotFoundError:
            lst = None
        if stat.S_ISDIR(st.st_mode) and lst is not None and stat.S_ISDIR(lst.st_mode):
            changed = list(_diff(lower, full, out, r))
            if changed or not _same_meta(st, lst):
                _ensure_dir(full, out, r)
            yield from changed
            continue
        if lst is not None and _same(st, lst, f, lo):
            continue
        _ensure_dir(full, out, rel)
        os.rename(f, os.path.join(out, r))
        yield r
    for name in sorted(low_names - set(names)):
        r = os.path.join(rel, name)
        _ensure_dir(full, out, rel)
        os.mknod(os.path.join(out, r), stat.S_IFCHR, os.makedev(0, 0))
        yield r


def _same_meta(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_mode, a.st_uid, a.st_gid) == (b.st_mode, b.st_uid, b.st_gid)


def _same(a: os.stat_result, b: os.stat_result, pa: str, pb: str) -> bool:
    if not _same_meta(a, b):
        return False
    if stat.S_ISREG(a.st_mode):
        return a.st_size == b.st_size and filecmp.cmp(pa, pb, shallow=False)
    if stat.S_ISLNK(a.st_mode):
        return os.readlink(pa) == os.readlink(pb)
    if stat.S_ISCHR(a.st_mode) or stat.S_ISBLK(a.st_mode):
        return a.st_rdev == b.st_rdev
    return True


def _ensure_dir(full: str, out: str, rel: str) -> None:
    """``out/rel`` and its parents as directories with the modes and owners ``full`` gives them."""
    if not rel:
        return
    dest = os.path.join(out, rel)
    if os.path.isdir(dest):
        return
    _ensure_dir(full, out, os.path.dirname(rel))
    os.mkdir(dest)
    _copy_meta(os.lstat(os.path.join(full, rel)), dest)


def _copy_meta(st: os.stat_result, dest: str) -> None:
    os.chown(dest, st.st_uid, st.st_gid)
    os.chmod(dest, stat.S_IMODE(st.st_mode))


__all__ = ["BASE_PACKAGES", "DIST_PACKAGES", "PYTHON", "Built", "Recipe", "build_layer", "check_can_build",
           "diff_trees", "mirrors"]
