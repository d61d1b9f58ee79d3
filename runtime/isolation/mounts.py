"""Mounts: the zygote's read-only view of a snapshot, and each sandbox's copy-on-write root.

Stdlib only (runs inside zygotes). Inside a zygote's view, the raw material for sandbox roots sits
under /.rollbox (layers, skeleton, host /dev); a sandbox's root never shows it: pivot_root drops the
zygote's tree.

    zygote view  = overlay(warm layers + skeleton, read-only) + host binds (ro) + masks
    sandbox root = overlay(extra layers + warm layers + skeleton, upper on a size-capped tmpfs)
                   + host binds (ro) + masks + /proc + minimal /dev
"""

from __future__ import annotations

import os

from rollbox.runtime.isolation import libc
from rollbox.runtime.isolation.libc import (
    MNT_DETACH,
    MS_BIND,
    MS_NODEV,
    MS_NOEXEC,
    MS_NOSUID,
    MS_PRIVATE,
    MS_RDONLY,
    MS_REC,
    MS_REMOUNT,
    mount,
)

RB = "/.rollbox"
LAYERS = RB + "/layers"
SKEL = RB + "/skel"
HOSTDEV = RB + "/dev"
HOSTPROC = RB + "/proc"
SANDBOX = RB + "/sb"
RUNTIME = RB + "/rt"  # the runtime's own files, for a zygote that re-executes as the snapshot's Python
DEVICES = ("null", "zero", "full", "random", "urandom", "tty")


def _bind_ro(src: str, dst: str, extra: int = 0) -> None:
    mount(src, dst, None, MS_BIND)
    mount("none", dst, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV | extra)


def _mask(dst: str) -> None:
    mount("tmpfs", dst, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=4k,mode=555")


def prepare_zygote_view(staging: str, skel: str, layer_root: str, warm_layers: list[str],
                        host_binds: list[str], host_masks: list[str], runtime_dir: str | None = None) -> None:
    """In a fresh mount namespace: build the snapshot's read-only view in ``staging`` and pivot into it.
    ``runtime_dir``: bound read-only at ``RUNTIME`` (a zygote that re-executes inside the view loads
    its code from there; sandboxes never see it)."""
    mount("none", "/", None, MS_REC | MS_PRIVATE)
    mount("tmpfs", staging, "tmpfs", MS_NOSUID | MS_NODEV, "size=64k,mode=755")
    root = os.path.join(staging, "root")
    os.mkdir(root)
    if warm_layers:
        lower = ":".join([os.path.join(layer_root, x) for x in warm_layers] + [skel])
        mount("overlay", root, "overlay", MS_RDONLY, f"lowerdir={lower}")
    else:
        _bind_ro(skel, root)
    _bind_ro(layer_root, root + LAYERS)
    _bind_ro(skel, root + SKEL)
    mount("/dev", root + HOSTDEV, None, MS_BIND | MS_REC)  # recursive: a userns may not split locked submounts
    # A user namespace may mount a new proc only where a proc is already fully visible.
    mount("/proc", root + HOSTPROC, None, MS_BIND | MS_REC)
    if runtime_dir:
        _bind_ro(runtime_dir, root + RUNTIME)
    for path in host_binds:
        _bind_ro(path, root + path)
    for path in host_masks:
        _mask(root + path)
    os.chdir(root)
    libc.pivot_root(".", ".")
    libc.umount2(".", MNT_DETACH)
    os.chdir("/")


def make_dev_links(dev: str) -> None:
    """The /dev symlinks and a world-writable /dev/shm (for POSIX semaphores, multiprocessing)."""
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"),
                         ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2")):
        os.symlink(target, f"{dev}/{name}")
    os.mkdir(f"{dev}/shm")
    os.chmod(f"{dev}/shm", 0o1777)


def idmapped_lowers(userns_fd: int) -> tuple[int, int]:
    """The view's layer store and skeleton seen through the id map of ``userns_fd`` (detached mounts:
    made by the zygote once per user slot, shared by the sandboxes it forks into that slot)."""
    layers = libc.idmapped_clone(LAYERS, userns_fd)
    try:
        return layers, libc.idmapped_clone(SKEL, userns_fd)
    except OSError:
        os.close(layers)
        raise


def build_sandbox_root(layers: list[str], host_binds: list[str], host_masks: list[str], disk_bytes: int,
                       rootless: bool, idmapped: list[int] | None = None) -> int:
    """In the sandbox's new mount namespace (as pid 1 of its pid namespace): make its root and pivot
    into it. Returns an O_PATH fd of the tmpfs that holds the upper layer (for checkpoints).

    ``idmapped``: the fds of ``idmapped_lowers`` (made by the zygote) for the sandbox's user namespace,
    whose map puts uid 1000 on a host uid of its own (see runtime/slots.py). Every
    lower layer is then stacked as an idmapped mount through that map: its files stay owned by 1000
    on disk while the sandbox's processes, running as its own host uid, see them as theirs. The
    upper layer is not idmapped (a clone of it per sandbox cost ~2 % of restore time, measured): what
    the sandbox writes is owned by its host uid there, and whatever packs the upper directory into a
    layer (a snapshot, a fork's scratch layer) gives those files back to 1000 (``Sandbox.owner_shift``).
    A durable step's diff carries no owners."""
    mount("tmpfs", SANDBOX, "tmpfs", MS_NOSUID | MS_NODEV, f"size={disk_bytes},mode=755")
    for d in ("upper", "work", "root"):
        os.mkdir(f"{SANDBOX}/{d}")
    root = f"{SANDBOX}/root"
    if idmapped:
        layer_dir, skel = (f"{HOSTPROC}/self/fd/{fd}" for fd in idmapped)  # (the view has no /proc)
    else:
        layer_dir, skel = LAYERS, SKEL
    lower = ":".join([f"{layer_dir}/{x}" for x in layers] + [skel])
    opts = f"lowerdir={lower},upperdir={SANDBOX}/upper,workdir={SANDBOX}/work"
    # Plain copy-up only (no redirect_dir, no metacopy): an upper dir is then a self-contained layer
    # that a checkpoint can stack under other sandboxes. userxattr (rootless) implies both off.
    opts += ",userxattr" if rootless else ",redirect_dir=off,metacopy=off"
    # As root the skeleton already holds /dev's nodes (see skeleton.py), so the root overlay allows
    # device nodes (nothing below it can hold others: layers refuse them, the sandbox cannot mknod)
    # and /dev needs no mounts of its own. Rootless, a user namespace forces nodev: /dev is a tmpfs
    # with the host's nodes bound in.
    mount("overlay", root, "overlay", MS_NOSUID | (MS_NODEV if rootless else 0), opts)
    # The overlay holds its layers' mounts (the zygote's, shared: closing our copies frees nothing).
    for fd in idmapped or ():
        os.close(fd)
    for path in host_binds:
        _bind_ro(path, root + path)
    for path in host_masks:
        _mask(root + path)
    mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    if rootless:
        dev = root + "/dev"
        mount("tmpfs", dev, "tmpfs", MS_NOSUID | MS_NOEXEC, "size=64m,mode=755")
        for name in DEVICES:
            open(f"{dev}/{name}", "w").close()
            mount(f"{HOSTDEV}/{name}", f"{dev}/{name}", None, MS_BIND)
        make_dev_links(dev)
    upper_fd = os.open(SANDBOX, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    os.chdir(root)
    libc.pivot_root(".", ".")
    libc.umount2(".", MNT_DETACH)
    os.chdir("/")
    return upper_fd
