"""Building templates: host base + packages from local wheels, dir base, files; same inputs give the
same ids; an OCI image layout base with its whiteouts, checked through a real overlay mount."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import stat
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from rollbox.runtime.errors import IntegrityError, InvalidRequest
from rollbox.snapshots.build import build
from rollbox.snapshots.layers import layer_id
from rollbox.snapshots.resolver import StoreResolver
from rollbox.snapshots.store_local import LocalStore
from rollbox.snapshots.template import PACKAGES_PREFIX, load_template

from .s3server import make_wheel

ROOT = os.geteuid() == 0


def write_template(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_host_base_with_packages_and_files_is_reproducible(tmp_path: Path) -> None:
    make_wheel(tmp_path / "wheels")
    (tmp_path / "task.py").write_text("print('task')\n")
    tpl = write_template(tmp_path / "t.yaml", """
name: demo
base: host
packages: [rbdemo==1.0]
pip: {find_links: [./wheels], no_index: true}
files:
  /etc/motd: {content: "hello\\n"}
  /srv/task.py: {source: ./task.py, mode: 0o755}
env: {A: "1"}
warm: {imports: [rbdemo]}
limits: {memory_max_bytes: 268435456}
""")
    template, where = load_template(tpl)
    steps: list[str] = []
    store = LocalStore(tmp_path / "store")
    m = build(template, where, store, on_step=steps.append)
    assert m.base == "host" and len(m.layers) == 2 and m.warm_layers == 2
    assert m.version.packages == {"rbdemo": "1.0"}
    assert m.version.python == sys.version.split()[0] and m.version.base == "host"
    assert m.warm.sys_path == (PACKAGES_PREFIX,) and m.warm.imports == ("rbdemo",)
    assert store.resolve_id("demo") == m.id
    assert any("pip install" in s for s in steps)

    pkgs = store.layer_path(m.layers[0].id) / PACKAGES_PREFIX.lstrip("/")
    out = subprocess.run([sys.executable, "-S", "-c", "import rbdemo; print(rbdemo.VALUE, rbdemo.__file__)"],
                         env={"PYTHONPATH": str(pkgs)}, capture_output=True, text=True, check=True)
    assert out.stdout.split()[0] == "42"
    pyc = next((pkgs / "rbdemo" / "__pycache__").glob("__init__.*.pyc")).read_bytes()
    assert int.from_bytes(pyc[4:8], "little") == 0b01  # hash-based, unchecked: no mtimes involved
    files = store.layer_path(m.layers[1].id)
    assert (files / "etc" / "motd").read_text() == "hello\n"
    assert stat.S_IMODE((files / "srv" / "task.py").stat().st_mode) == 0o755
    if ROOT:
        assert (files / "srv" / "task.py").stat().st_uid == 0

    view = StoreResolver(store).resolve("demo")
    assert view.layers == (m.layers[1].id, m.layers[0].id)
    assert view.host_binds and view.warm.sys_path == (PACKAGES_PREFIX,)
    assert view.limits.memory_max_bytes == 268435456 and view.env == {"A": "1"}

    # same template, same wheels, another store and another time: same ids
    again = build(template, where, LocalStore(tmp_path / "store2"))
    assert again.id == m.id and [r.id for r in again.layers] == [r.id for r in m.layers]
    # a different wheel: a different packages layer and snapshot
    (tmp_path / "wheels" / "rbdemo-1.0-py3-none-any.whl").unlink()
    make_wheel(tmp_path / "wheels", value=43)
    changed = build(template, where, LocalStore(tmp_path / "store3"))
    assert changed.layers[0].id != m.layers[0].id and changed.layers[1].id == m.layers[1].id
    assert changed.id != m.id


def test_pip_failure_is_reported(tmp_path: Path) -> None:
    tpl = write_template(tmp_path / "t.yaml", "name: demo\npackages: [rb-not-here]\npip: {no_index: true}\n")
    template, where = load_template(tpl)
    with pytest.raises(InvalidRequest, match=r"(?s)packages: pip install failed .*rb-not-here"):
        build(template, where, LocalStore(tmp_path / "store"))
    assert list((tmp_path / "store" / "tmp").iterdir()) == []


def test_dir_base(tmp_path: Path) -> None:
    root = tmp_path / "rootfs"
    (root / "usr" / "bin").mkdir(parents=True)
    (root / "usr" / "bin" / "python3").write_text("#!fake\n")
    tpl = write_template(tmp_path / "t.yaml", "name: d\nbase: {dir: ./rootfs}\npython: /usr/bin/python3\n")
    template, where = load_template(tpl)
    m = build(template, where, LocalStore(tmp_path / "store"))
    assert len(m.layers) == 1 and m.layers[0].id == layer_id(root)
    assert m.base == f"dir:{m.layers[0].id}"
    view = StoreResolver(LocalStore(tmp_path / "store")).resolve("d")
    assert view.warm.python == "/usr/bin/python3" and view.host_binds == ()


# ------------------------------------------------------------------------------------ OCI base


def _tar(entries: dict[str, bytes | None]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in entries.items():
            info = tarfile.TarInfo(name)
            if data is None:
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                tar.addfile(info)
            else:
                info.size, info.mode = len(data), 0o644
                tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _blob(layout: Path, data: bytes) -> dict[str, object]:
    digest = hashlib.sha256(data).hexdigest()
    (layout / "blobs" / "sha256").mkdir(parents=True, exist_ok=True)
    (layout / "blobs" / "sha256" / digest).write_bytes(data)
    return {"digest": f"sha256:{digest}", "size": len(data)}


def make_oci_layout(layout: Path) -> None:
    bottom = gzip.compress(_tar({
        "./etc/": None, "./etc/a": b"a\n", "./etc/b": b"b\n", "./dir/": None, "./dir/x": b"x\n",
        "./usr/": None, "./usr/bin/": None, "./usr/bin/python3": b"#!fake\n",
    }), mtime=0)
    top = _tar({"etc/.wh.a": b"", "dir/.wh..wh..opq": b"", "dir/z": b"z\n"})
    config = json.dumps({"config": {"Env": ["PATH=/usr/bin", "PYTHON_VERSION=3.11.9"]},
                         "rootfs": {"type": "layers"}}).encode()
    manifest = json.dumps({
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", **_blob(layout, config)},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", **_blob(layout, bottom)},
                   {"mediaType": "application/vnd.oci.image.layer.v1.tar", **_blob(layout, top)}],
    }).encode()
    index = {"schemaVersion": 2, "manifests": [{
        "mediaType": "application/vnd.oci.image.manifest.v1+json", **_blob(layout, manifest),
        "annotations": {"org.opencontainers.image.ref.name": "demo"}}]}
    (layout / "index.json").write_text(json.dumps(index))
    (layout / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')


def test_oci_layout_base_turns_whiteouts_into_overlay_ones(tmp_path: Path) -> None:
    make_oci_layout(tmp_path / "layout")
    tpl = write_template(tmp_path / "t.yaml", """
name: oci-demo
base: {oci: ./layout, image: demo}
python: /usr/bin/python3
env: {EXTRA: "1"}
""")
    template, where = load_template(tpl)
    store = LocalStore(tmp_path / "store")
    m = build(template, where, store)
    assert m.base.startswith("oci:sha256:") and len(m.layers) == 2
    assert m.env == {"PATH": "/usr/bin", "PYTHON_VERSION": "3.11.9", "EXTRA": "1"}
    assert m.version.python == "3.11.9"
    bottom, top = (store.layer_path(r.id) for r in m.layers)
    wh = os.lstat(top / "etc" / "a")
    assert stat.S_ISCHR(wh.st_mode) and wh.st_rdev == 0
    assert os.getxattr(top / "dir", store.opaque_xattr) == b"y"
    assert not (top / "etc" / ".wh.a").exists() and not (top / "dir" / ".wh..wh..opq").exists()
    assert (bottom / "etc" / "a").read_text() == "a\n"

    if not ROOT:
        pytest.skip("mounting overlayfs to check the merged view needs root")
    view = StoreResolver(store).resolve("oci-demo")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    lower = ":".join(str(Path(view.layer_root) / layer) for layer in view.layers)  # top first
    subprocess.run(["mount", "-t", "overlay", "overlay", "-o", f"lowerdir={lower}", str(mnt)], check=True)
    try:
        assert sorted(os.listdir(mnt / "etc")) == ["b"]
        assert sorted(os.listdir(mnt / "dir")) == ["z"]
        assert (mnt / "usr" / "bin" / "python3").read_text() == "#!fake\n"
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_a_corrupt_oci_blob_is_refused(tmp_path: Path) -> None:
    layout = tmp_path / "layout"
    make_oci_layout(layout)
    manifest_digest = json.loads((layout / "index.json").read_text())["manifests"][0]["digest"]
    manifest = json.loads((layout / "blobs" / "sha256" / manifest_digest[7:]).read_bytes())
    top = layout / "blobs" / "sha256" / manifest["layers"][1]["digest"][7:]
    top.write_bytes(top.read_bytes().replace(b"z\n", b"Z\n"))
    tpl = write_template(tmp_path / "t.yaml", "name: o\nbase: {oci: ./layout}\npython: /usr/bin/python3\n")
    template, where = load_template(tpl)
    store = LocalStore(tmp_path / "store")
    with pytest.raises(IntegrityError, match="does not match its digest"):
        build(template, where, store)
    assert store.list_ids() == [] and list((store.root / "tmp").iterdir()) == []
    with pytest.raises(InvalidRequest, match="not an OCI image layout"):
        build(load_template(write_template(tmp_path / "u.yaml",
                                           "name: o\nbase: {oci: ./nowhere}\npython: /p\n"))[0], where, store)
