"""Layer format: deterministic ids, a faithful round trip (whiteouts, opaque dirs, links), and
unsafe or corrupt tars refused with nothing left behind."""

from __future__ import annotations

import io
import os
import stat
import tarfile
from pathlib import Path

import pytest
from rollbox.runtime.errors import IntegrityError
from rollbox.snapshots.layers import layer_id, pack, pack_to_file, unpack

ROOT = os.geteuid() == 0
OPAQUE = "trusted.overlay.opaque" if ROOT else "user.overlay.opaque"


def make_tree(root: Path, *, reverse: bool = False, mtime: int = 1_700_000_000) -> Path:
    """A layer with every kind of entry, created in either order."""
    steps = [
        lambda: (root / "etc").mkdir(),
        lambda: (root / "etc" / "motd").write_text("hello\n"),
        lambda: (root / "bin").mkdir(),
        lambda: (root / "bin" / "tool").write_bytes(b"#!/bin/sh\necho hi\n" * 1000),
        lambda: os.symlink("../etc/motd", root / "bin" / "motd-rel"),
        lambda: os.symlink("/etc/motd", root / "bin" / "motd-abs"),
        lambda: os.link(root / "etc" / "motd", root / "bin" / "motd-hard"),
        lambda: os.mknod(root / "gone", stat.S_IFCHR | 0o000, os.makedev(0, 0)),
        lambda: (root / "opaque").mkdir(),
        lambda: (root / "opaque" / "only.txt").write_text("only me\n"),
        lambda: os.setxattr(root / "opaque", OPAQUE, b"y"),
        lambda: os.mkfifo(root / "fifo"),
        lambda: (root / "empty").mkdir(),
        lambda: (root / "ro").mkdir(),
        lambda: (root / "ro" / "f").write_text("x"),
    ]
    root.mkdir()
    order = list(range(len(steps)))
    # dependencies: parents before children; reverse only independent top-level groups
    groups = [[0, 1], [2, 3, 4, 5], [6], [7], [8, 9, 10], [11], [12], [13, 14]]
    if reverse:
        groups = groups[::-1]
        groups.remove([6])
        groups.append([6])  # the hardlink needs etc/motd and bin/
    order = [i for g in groups for i in g]
    for i in order:
        steps[i]()
    os.chmod(root / "bin" / "tool", 0o755)
    os.chmod(root / "ro", 0o555)
    for dirpath, dirs, files in os.walk(root):
        for n in dirs + files:
            os.utime(os.path.join(dirpath, n), (mtime, mtime), follow_symlinks=False)
    return root


def test_round_trip_keeps_whiteouts_opaque_dirs_and_links(tmp_path: Path) -> None:
    src = make_tree(tmp_path / "src")
    tar = tmp_path / "layer.tar"
    packed = pack_to_file(src, tar)
    assert packed.size_bytes == tar.stat().st_size
    out = tmp_path / "out"
    with open(tar, "rb") as f:
        got = unpack(f, out, expected_id=packed.id)
    assert got.id == packed.id

    st = os.lstat(out / "gone")
    assert stat.S_ISCHR(st.st_mode) and st.st_rdev == 0
    xattr = "trusted.overlay.opaque" if ROOT else "user.overlay.opaque"
    assert os.getxattr(out / "opaque", xattr) == b"y"
    assert os.readlink(out / "bin" / "motd-rel") == "../etc/motd"
    assert os.readlink(out / "bin" / "motd-abs") == "/etc/motd"
    assert os.lstat(out / "bin" / "motd-hard").st_ino == os.lstat(out / "etc" / "motd").st_ino
    assert stat.S_ISFIFO(os.lstat(out / "fifo").st_mode)
    assert stat.S_IMODE(os.lstat(out / "bin" / "tool").st_mode) == 0o755
    assert stat.S_IMODE(os.lstat(out / "ro").st_mode) == 0o555
    assert (out / "ro" / "f").read_text() == "x"
    assert (out / "bin" / "tool").read_bytes() == (src / "bin" / "tool").read_bytes()
    assert (out / "empty").is_dir()
    # the unpacked tree packs to the same id again
    assert layer_id(out) == packed.id


@pytest.mark.skipif(not ROOT, reason="trusted.* xattrs need root")
def test_opaque_xattr_namespace_is_a_parameter_and_not_part_of_the_id(tmp_path: Path) -> None:
    src = make_tree(tmp_path / "src")
    buf = io.BytesIO()
    packed = pack(src, buf)
    out = tmp_path / "rootless"
    buf.seek(0)
    unpack(buf, out, expected_id=packed.id, opaque_xattr="user.overlay.opaque")
    assert os.getxattr(out / "opaque", "user.overlay.opaque") == b"y"
    with pytest.raises(OSError):
        os.getxattr(out / "opaque", "trusted.overlay.opaque")
    assert layer_id(out) == packed.id


def test_ids_are_deterministic_and_content_sensitive(tmp_path: Path) -> None:
    a = make_tree(tmp_path / "a", mtime=1_000_000)
    b = make_tree(tmp_path / "b", reverse=True, mtime=2_000_000)
    assert layer_id(a) == layer_id(b)
    assert pack(a).id == layer_id(a)

    (b / "etc" / "motd").write_text("hellO\n")
    assert layer_id(a) != layer_id(b)
    (b / "etc" / "motd").write_text("hello\n")
    assert layer_id(a) == layer_id(b)
    os.chmod(b / "etc" / "motd", 0o600)
    assert layer_id(a) != layer_id(b)
    os.chmod(b / "etc" / "motd", 0o644)
    os.removexattr(b / "opaque", "trusted.overlay.opaque" if ROOT else "user.overlay.opaque")
    assert layer_id(a) != layer_id(b)


def test_owner_is_kept_or_forced(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "f").write_text("x")
    if ROOT:
        os.chown(src / "f", 1234, 5678)
    buf = io.BytesIO()
    pack(src, buf, owner=None)
    buf.seek(0)
    with tarfile.open(fileobj=buf) as tar:
        kept = tar.getmember("f")
    assert (kept.uid, kept.gid) == ((1234, 5678) if ROOT else (os.getuid(), os.getgid()))
    assert kept.mtime == 0 and kept.uname == "" and kept.gname == ""
    buf = io.BytesIO()
    pack(src, buf, owner=(0, 0))
    buf.seek(0)
    with tarfile.open(fileobj=buf) as tar:
        forced = tar.getmember("f")
    assert (forced.uid, forced.gid) == (0, 0)
    if ROOT:
        out = tmp_path / "out"
        buf.seek(0)
        unpack(buf, out, expected_id=None)
        assert os.stat(out / "f").st_uid == 0


def _tar(entries: list[tuple[tarfile.TarInfo, bytes | None]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for info, data in entries:
            if data is not None:
                info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


def _info(name: str, kind: bytes = tarfile.REGTYPE, link: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = link
    info.mode = 0o644
    return info


UNSAFE = {
    "dotdot": ([(_info("../escaped"), b"pwned")], "'..' component"),
    "absolute": ([(_info("/tmp/rollbox-escaped-abs"), b"pwned")], "absolute path"),
    "through-symlink": (
        [(_info("link", tarfile.SYMTYPE, "/tmp"), None), (_info("link/rollbox-escaped-sym"), b"pwned")],
        "not a directory",
    ),
    "symlink-climbs-out": ([(_info("up", tarfile.SYMTYPE, "../../etc/passwd"), None)], "leaves the layer"),
    "hardlink-outside": ([(_info("pw", tarfile.LNKTYPE, "../../../etc/passwd"), None)], "'..' component"),
    "hardlink-through-symlink": (
        [(_info("etc", tarfile.SYMTYPE, "/etc"), None), (_info("pw", tarfile.LNKTYPE, "etc/passwd"), None)],
        "not a directory",
    ),
    "device": ([(_info("null", tarfile.CHRTYPE), None)], None),
}


@pytest.mark.parametrize("case", sorted(UNSAFE))
def test_unsafe_tars_are_refused_and_leave_nothing(case: str, tmp_path: Path) -> None:
    entries, message = UNSAFE[case]
    if case == "device":
        entries[0][0].devmajor, entries[0][0].devminor = 1, 3
        message = "device nodes other than whiteouts"
    out = tmp_path / "out"
    with pytest.raises(IntegrityError, match=message or ""):
        unpack(io.BytesIO(_tar(entries)), out, expected_id=None)
    assert not out.exists()
    assert not (tmp_path / "escaped").exists()
    assert not Path("/tmp/rollbox-escaped-abs").exists()
    assert not Path("/tmp/rollbox-escaped-sym").exists()


def test_wrong_id_and_truncation_are_refused_and_leave_nothing(tmp_path: Path) -> None:
    src = make_tree(tmp_path / "src")
    buf = io.BytesIO()
    packed = pack(src, buf)
    data = buf.getvalue()

    flipped = bytearray(data)
    pos = data.index(b"#!/bin/sh")
    flipped[pos] ^= 0x01
    with pytest.raises(IntegrityError, match=f"layer {packed.id} is corrupt"):
        unpack(io.BytesIO(bytes(flipped)), tmp_path / "o1", expected_id=packed.id)
    assert not (tmp_path / "o1").exists()

    with pytest.raises(IntegrityError, match=r"truncated or corrupt|is corrupt"):
        unpack(io.BytesIO(data[: len(data) // 2]), tmp_path / "o2", expected_id=packed.id)
    assert not (tmp_path / "o2").exists()

    with pytest.raises(IntegrityError, match="invalid layer id"):
        unpack(io.BytesIO(data), tmp_path / "o3", expected_id="../" + "a" * 61)
