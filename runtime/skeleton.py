"""The skeleton: the bottom layer under every sandbox root (mount points, /etc basics, home, tmp).

Built once per (host binds, uid) into the state directory and reused; rebuilt when its recipe changes.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import threading
from pathlib import Path

from rollbox.runtime.isolation import mounts
from rollbox.runtime.isolation.users import SANDBOX_GID, SANDBOX_UID

PASSWD = (
    "root:x:0:0:root:/root:/bin/sh\n"
    f"sandbox:x:{SANDBOX_UID}:{SANDBOX_GID}:sandbox:/home/sandbox:/bin/sh\n"
    "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"
)
GROUP = f"root:x:0:\nsandbox:x:{SANDBOX_GID}:\nnogroup:x:65534:\n"
HOSTS = "127.0.0.1 localhost sandbox\n::1 localhost\n"
# Host /etc entries a base system needs to run programs (dynamic linker cache, alternatives, zoneinfo).
ETC_COPIES = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "alternatives", "localtime", "os-release",
              "debian_version", "mime.types", "protocols", "services", "nsswitch.conf")


def build(state_dir: Path, host_binds: tuple[str, ...], rootless: bool) -> Path:
    recipe = {"v": 6, "binds": host_binds, "uid": SANDBOX_UID, "rootless": rootless,
              "etc": [os.path.exists(f"/etc/{n}") for n in ETC_COPIES]}
    key = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:16]
    skel = state_dir / f"skel-{key}"
    done = state_dir / f"skel-{key}.complete"
    if done.exists() and skel.is_dir():
        return skel
    # built aside, then renamed into place: per process *and thread* (two snapshots' zygotes starting
    # at once in one server build it in two threads; the loser of the rename uses the winner's)
    tmp = state_dir / f".skel-{key}-{os.getpid()}-{threading.get_ident()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for d in ("usr", "proc", "dev", "etc", "root", "var/tmp", "run", "opt", "mnt", "home"):
        (tmp / d).mkdir(parents=True, exist_ok=True)
    for d in ("tmp", "var/tmp"):
        (tmp / d).mkdir(exist_ok=True)
        os.chmod(tmp / d, 0o1777)
    for top in ("bin", "sbin", "lib", "lib64", "lib32", "libx32"):
        host = Path("/") / top
        if host.is_symlink():
            os.symlink(os.readlink(host), tmp / top)
        elif host.is_dir():
            (tmp / top).mkdir()
    for bind in host_binds:
        (tmp / bind.lstrip("/")).mkdir(parents=True, exist_ok=True)
    for sub in ("layers", "skel", "dev", "proc", "sb", "rt"):
        (tmp / mounts.RB.lstrip("/") / sub).mkdir(parents=True, exist_ok=True)
    if not rootless:  # /dev's nodes live here as root (the sandbox root overlay allows devices then)
        for name in mounts.DEVICES:
            st = os.stat(f"/dev/{name}")
            os.mknod(tmp / "dev" / name, stat.S_IFCHR | 0o666, st.st_rdev)
            os.chmod(tmp / "dev" / name, 0o666)
        mounts.make_dev_links(str(tmp / "dev"))
    etc = tmp / "etc"
    (etc / "passwd").write_text(PASSWD)
    (etc / "group").write_text(GROUP)
    (etc / "hosts").write_text(HOSTS)
    (etc / "hostname").write_text("sandbox\n")
    for name in ETC_COPIES:
        src = Path("/etc") / name
        if src.is_symlink():
            os.symlink(os.readlink(src), etc / name)
        elif src.is_dir():
            shutil.copytree(src, etc / name, symlinks=True)
        elif src.is_file():
            shutil.copy2(src, etc / name)
    home = tmp / "home" / "sandbox"
    home.mkdir()
    if not rootless:
        os.chown(home, SANDBOX_UID, SANDBOX_GID)
    os.chmod(home, 0o755)
    try:
        os.rename(tmp, skel)
    except OSError:  # built concurrently by another process: use theirs
        shutil.rmtree(tmp, ignore_errors=True)
    done.write_text(key)
    return skel
