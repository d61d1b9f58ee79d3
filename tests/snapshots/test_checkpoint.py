"""Checkpoints: the upper directory of a real overlay mount, with the whiteouts and opaque
directories the kernel wrote, becomes a child snapshot whose layers show exactly the same tree, here
and after a trip through S3."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from rollbox.runtime.errors import StoreError
from rollbox.snapshots.checkpoint import checkpoint
from rollbox.snapshots.layers import layer_id
from rollbox.snapshots.resolver import StoreResolver
from rollbox.snapshots.store import copy_snapshot
from rollbox.snapshots.store_local import LocalStore

from .s3server import S3Factory, sample_snapshot, tree_files

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounts overlayfs")


def mount(lower: list[str], mnt: Path, upper: Path | None = None, work: Path | None = None) -> None:
    opts = f"lowerdir={':'.join(lower)}"
    if upper is not None:
        opts += f",upperdir={upper},workdir={work},redirect_dir=off,metacopy=off"
    mnt.mkdir(exist_ok=True)
    subprocess.run(["mount", "-t", "overlay", "overlay", "-o", opts, str(mnt)], check=True)


def umount(mnt: Path) -> None:
    subprocess.run(["umount", str(mnt)], check=True)


def listing(root: Path) -> dict[str, bytes | str]:
    out: dict[str, bytes | str] = {}
    for dirpath, dirs, files in os.walk(root):
        for d in dirs:
            out[os.path.relpath(os.path.join(dirpath, d), root) + "/"] = "dir"
        for f in files:
            p = os.path.join(dirpath, f)
            out[os.path.relpath(p, root)] = Path(p).read_bytes()
    return out


def test_checkpoint_of_an_overlay_upper_dir(tmp_path: Path, s3_url: str, make_s3: S3Factory) -> None:
    store = LocalStore(tmp_path / "store")
    parent = sample_snapshot(store, tmp_path, name="parent")
    view = StoreResolver(store).resolve("parent")
    lower = [str(Path(view.layer_root) / layer) for layer in view.layers]

    upper, work, mnt = tmp_path / "upper", tmp_path / "work", tmp_path / "mnt"
    upper.mkdir()
    work.mkdir()
    mount(lower, mnt, upper, work)
    try:
        (mnt / "data" / "new.txt").write_text("written in the sandbox\n")
        (mnt / "etc" / "motd").unlink()  # a lower file deleted: a whiteout in upper
        shutil.rmtree(mnt / "data")  # a lower dir replaced: an opaque dir in upper
        (mnt / "data").mkdir()
        (mnt / "data" / "fresh").write_text("fresh\n")
        expected = listing(mnt)
    finally:
        umount(mnt)
    wh = os.lstat(upper / "etc" / "motd")  # the kernel's whiteout and opaque dir are in upper
    assert wh.st_rdev == 0 and os.getxattr(upper / "data", "trusted.overlay.opaque") == b"y"

    child = checkpoint(store, parent, upper, name="child")
    assert child.parent == parent.id and child.warm_layers == parent.warm_layers
    assert child.layers[:-1] == parent.layers and child.layers[-1].id == layer_id(upper)
    assert store.resolve_id("child") == child.id

    def merged_view(s: LocalStore) -> dict[str, bytes | str]:
        v = StoreResolver(s).resolve("child")
        m = tmp_path / "ro"
        mount([str(Path(v.layer_root) / layer) for layer in v.layers], m)
        try:
            return listing(m)
        finally:
            umount(m)

    assert merged_view(store) == expected
    assert "etc/motd" not in expected and expected["data/fresh"] == b"fresh\n" and "data/tag" not in expected

    # the same tree on another machine: through S3 into an empty store
    s3 = make_s3(s3_url)
    copy_snapshot(store, s3, "child")
    other = LocalStore(tmp_path / "other")
    pulled = copy_snapshot(s3, other, "child")
    assert pulled.id == child.id and pulled.parent == parent.id
    assert merged_view(other) == expected
    assert tree_files(other.layer_path(child.layers[-1].id)) == tree_files(upper)


def test_an_upper_dir_with_redirects_is_refused(tmp_path: Path) -> None:
    upper = tmp_path / "upper"
    (upper / "moved").mkdir(parents=True)
    os.setxattr(upper / "moved", "trusted.overlay.redirect", b"/orig")
    store = LocalStore(tmp_path / "store")
    parent = sample_snapshot(store, tmp_path)
    with pytest.raises(StoreError, match="redirect_dir=off"):
        checkpoint(store, parent, upper)
