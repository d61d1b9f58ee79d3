"""Building a template into a snapshot: base layers, a packages layer, a files layer, a manifest.

1. base   ``host``: no layer (the runtime binds the host's /usr etc. read-only);
          ``dir``:  the directory as one layer (owners kept);
          ``oci``:  one layer per image layer, OCI whiteouts turned into overlay whiteouts;
          ``debian``: a root built from Debian's packages (snapshots/debian.py): the shared layer of
                  the template named by ``over`` (if any), then one with what this template's packages add.
2. packages  ``pip install --target`` into ``/opt/rollbox/site-packages`` (wheels only by default,
          ``--no-compile``), then byte-compiled with ``unchecked-hash`` pycs, which do not depend
          on mtimes; versions read from the installed ``*.dist-info``.
3. files  the template's files with their modes.
4. the manifest (VERSION: base, Python, packages, rollbox), stored with the template's name.

Built layers are owned by root (``owner=(0, 0)``) and every mtime is 0 in the layer tar, so the
same template and the same inputs (base, wheels) give the same layer and snapshot ids.
"""

from __future__ import annotations

import email.parser
import os
import stat
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from rollbox.runtime.errors import InvalidRequest, StoreError
from rollbox.runtime.snapshot import ROLLBOX_VERSION
from rollbox.snapshots import debian
from rollbox.snapshots.layers import remove_tree, unpack_oci
from rollbox.snapshots.manifest import LayerRef, Manifest, Version, Warm
from rollbox.snapshots.oci import read_image
from rollbox.snapshots.store_local import LocalStore
from rollbox.snapshots.template import (
    PACKAGES_PREFIX,
    DebianBase,
    DebianSpec,
    DirBase,
    FileSpec,
    OciBase,
    PipOptions,
    Template,
    load_template,
)

Step = Callable[[str], None]
"""Told what the build is doing now (drives a progress display)."""


def build(template: Template, template_dir: Path, store: LocalStore, *, pip_extra: PipOptions | None = None,
          on_step: Step | None = None) -> Manifest:
    """Build ``template`` into ``store``; returns the manifest (its ``id`` is the snapshot id)."""
    step = on_step or (lambda _msg: None)
    files, warm_path, warm_imports = _warm_files(template)
    work = Path(store.tmp_dir())
    try:
        base = _base(template.base, template_dir, store, work, step)  # 1. base
        layers = list(base.layers)
        packages: dict[str, str] = {}
        sys_path: tuple[str, ...] = ()
        if template.packages:  # 2. packages
            ref, packages = _packages_layer(template, template_dir, store, work, step, pip_extra)
            layers.append(ref)
            sys_path = (PACKAGES_PREFIX,)
        if files:  # 3. files
            layers.append(_files_layer(files, template_dir, store, work, step))
    finally:
        remove_tree(work)
    manifest = _manifest(template, base, layers, packages, (*warm_path, *sys_path), warm_imports)  # 4.
    store.put_manifest(manifest)
    store.set_name(template.name, manifest.id)
    step(f"snapshot {template.name} = {manifest.id}")
    return manifest


@dataclass
class _Base:
    """What the base gives the snapshot."""

    label: str  # the manifest's and VERSION's base
    layers: list[LayerRef] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)  # an OCI image's
    packages: dict[str, str] = field(default_factory=dict)  # a Debian base's: deb:<name> -> version
    python: str | None = None  # a Debian base's Python version


def _warm_files(template: Template) -> tuple[dict[str, FileSpec], tuple[str, ...], tuple[str, ...]]:
    """The template's files (with the preload module, if any), the warm sys.path and imports."""
    files = dict(template.files)
    warm_path: tuple[str, ...] = template.warm.sys_path
    warm_imports = template.warm.imports
    if isinstance(template.base, DebianBase):
        warm_path = (debian.DIST_PACKAGES, *warm_path)
    if template.warm.preload:
        files[f"{WARM_DIR}/{PRELOAD_MODULE}.py"] = FileSpec(content=preload_module(template.warm.preload))
        warm_path, warm_imports = (*warm_path, WARM_DIR), (PRELOAD_MODULE, *warm_imports)
    return files, warm_path, warm_imports


def _base(base: Literal["host"] | DirBase | OciBase | DebianBase, template_dir: Path, store: LocalStore,
          work: Path, step: Step) -> _Base:
    """1. The base's layers (none for ``host``)."""
    if base == "host":
        return _Base("host")
    if isinstance(base, DirBase):
        src = _path(template_dir, base.dir)
        if not src.is_dir():
            raise InvalidRequest(f"base.dir: {src} is not a directory")
        step(f"base: packing {src}")
        ref = store.add_layer_dir(src, owner=None)
        return _Base(f"dir:{ref.id}", [ref])
    if isinstance(base, DebianBase):
        built = _debian_layers(base.debian, template_dir, store, step)
        deb_versions = built[-1].versions
        named = [*debian.BASE_PACKAGES, *(p for b in built for p in b.named)]
        return _Base(f"debian:{base.debian.suite}:{built[0].layer.id}", [b.layer for b in built],
                     packages={f"deb:{n}": deb_versions[n] for n in dict.fromkeys(_pkg_name(p) for p in named)
                               if n in deb_versions},
                     python=deb_versions.get("python3", "unknown").split(":")[-1].split("-")[0])
    assert isinstance(base, OciBase)
    image = read_image(_path(template_dir, base.oci), base.image)
    layers: list[LayerRef] = []
    for i, digest in enumerate(image.layers, 1):
        step(f"base: OCI layer {i}/{len(image.layers)} {digest[7:19]}")
        layer_dir = work / f"oci-{i}"
        with image.open_layer(digest) as blob:
            unpack_oci(blob, layer_dir, opaque_xattr=store.opaque_xattr)
            blob.verify()
        layers.append(store.add_layer_dir(layer_dir, owner=None))
        remove_tree(layer_dir)
    return _Base(f"oci:{image.manifest_digest}", layers, env=dict(image.env))


def _packages_layer(template: Template, template_dir: Path, store: LocalStore, work: Path, step: Step,
                    pip_extra: PipOptions | None) -> tuple[LayerRef, dict[str, str]]:
    """2. The template's packages, pip-installed and byte-compiled, as a layer; their versions."""
    step(f"packages: pip install {' '.join(template.packages)}")
    layer_dir = work / "packages"
    target = layer_dir / PACKAGES_PREFIX.lstrip("/")
    _pip_install(template, template_dir, target, pip_extra)
    step("packages: byte-compiling")
    _compile(target)
    packages = _installed(target)
    _normalise_dirs(layer_dir, files=True)
    step(f"packages: packing {len(packages)} distributions")
    return store.add_layer_dir(layer_dir), packages


def _files_layer(files: dict[str, FileSpec], template_dir: Path, store: LocalStore, work: Path,
                 step: Step) -> LayerRef:
    """3. The template's files, with their modes, as a layer."""
    step(f"files: {len(files)}")
    layer_dir = work / "files"
    layer_dir.mkdir()
    for path, spec in sorted(files.items()):
        dest = layer_dir / path.lstrip("/")
        dest.parent.mkdir(parents=True, exist_ok=True)
        if spec.content is not None:
            dest.write_text(spec.content)
        else:
            assert spec.source is not None
            try:
                dest.write_bytes(_path(template_dir, spec.source).read_bytes())
            except OSError as exc:
                raise InvalidRequest(f"files.{path}.source: cannot read {spec.source}: "
                                     f"{exc.strerror}") from None
        os.chmod(dest, spec.mode)
    _normalise_dirs(layer_dir)
    return store.add_layer_dir(layer_dir)


def _manifest(template: Template, base: _Base, layers: list[LayerRef], packages: dict[str, str],
              warm_path: tuple[str, ...], warm_imports: tuple[str, ...]) -> Manifest:
    """4. The manifest: every layer warm, the warm Python and VERSION."""
    env = {**base.env, **template.env}
    # a non-host base's Python cannot be asked here; official images say it in PYTHON_VERSION
    here = sys.version.split()[0]
    python_version = here if template.base == "host" else base.python or env.get("PYTHON_VERSION", "unknown")
    python = template.python or (debian.PYTHON if isinstance(template.base, DebianBase) else None)
    return Manifest(
        base=base.label,
        layers=tuple(layers),
        warm_layers=len(layers),
        warm=Warm(python=python, sys_path=warm_path, imports=warm_imports),
        env=env,
        limits=template.limits,
        version=Version(base=base.label, python=python_version, packages={**base.packages, **packages},
                        rollbox=ROLLBOX_VERSION),
    )


WARM_DIR = "/opt/rollbox/warm"
PRELOAD_MODULE = "rollbox_preload"


def preload_module(globs: tuple[str, ...]) -> str:
    """The module a zygote imports to read ``globs`` once (into the page cache shared by every run);
    its ``__version__`` (the warm report's) is the number of bytes read."""
    return (
        '"""Made by rollbox snapshot build (warm.preload): reads these files once, when the zygote warms."""\n'
        "import glob\n\n"
        f"PATHS = {list(globs)!r}\n\n\n"
        "def _read() -> int:\n"
        "    n = 0\n"
        "    for pattern in PATHS:\n"
        "        for path in sorted(glob.glob(pattern, recursive=True)):\n"
        "            try:\n"
        "                with open(path, 'rb') as f:\n"
        "                    while chunk := f.read(1 << 20):\n"
        "                        n += len(chunk)\n"
        "            except OSError:\n"
        "                pass\n"
        "    return n\n\n\n"
        "__version__ = str(_read())\n"
    )


@dataclass
class _DebianLayer:
    layer: LayerRef
    versions: dict[str, str]
    named: tuple[str, ...]


def _debian_layers(spec: DebianSpec, template_dir: Path, store: LocalStore, step: Step) -> list[_DebianLayer]:
    """The Debian layers of a template, bottom first: those of the template it is built ``over`` (and
    so on down), each shared with every template over the same one, then its own."""
    chain: list[tuple[str, DebianSpec]] = [("", spec)]
    where = template_dir
    seen: set[Path] = set()
    while chain[-1][1].over is not None:
        over = chain[-1][1].over
        assert over is not None
        path = _path(where, over)
        if path in seen or len(chain) > 8:
            raise InvalidRequest(f"base.debian.over: {over} leads back to itself (templates built over each other "
                                 "must end in one without 'over')")
        seen.add(path)
        tpl, where = load_template(path)
        if not isinstance(tpl.base, DebianBase):
            raise InvalidRequest(f"base.debian.over: {over} is not a template with a debian base")
        if tpl.base.debian.suite != spec.suite:
            raise InvalidRequest(f"base.debian.suite: {spec.suite!r} differs from {over}'s {tpl.base.debian.suite!r}")
        chain.append((tpl.name, tpl.base.debian))
    out: list[_DebianLayer] = []
    for name, s in reversed(chain):
        below = tuple(x.layer.id for x in out)
        label = f"layer {name}" if name else ("toolchain" if below else "base")
        built = debian.build_layer(store, debian.Recipe(s.suite, s.packages, s.run, below=below),
                                   step=step, label=label)
        out.append(_DebianLayer(built.layer, built.versions, s.packages))
    return out


def _pkg_name(p: str) -> str:
    return p.split("=")[0].split(":")[0]


def _path(template_dir: Path, p: str) -> Path:
    return (template_dir / p).resolve()


def _pip_install(template: Template, template_dir: Path, target: Path, extra: PipOptions | None) -> None:
    opts = [template.pip, *([extra] if extra else [])]
    cmd = [sys.executable, "-m", "pip", "install", "--target", str(target), "--no-compile",
           "--disable-pip-version-check", "--no-warn-script-location", "--no-input", "--quiet"]
    for opt in opts:
        for link in opt.find_links:
            cmd += ["--find-links", str(_path(template_dir, link))]
        if opt.no_index:
            cmd.append("--no-index")
        if opt.index_url:
            cmd += ["--index-url", opt.index_url]
        cmd += list(opt.extra_args)
    if all(opt.only_binary for opt in opts):
        cmd.append("--only-binary=:all:")
    cmd += ["--", *template.packages]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update({"PYTHONDONTWRITEBYTECODE": "1", "SOURCE_DATE_EPOCH": "0"})
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
        raise InvalidRequest(f"packages: pip install failed (exit {proc.returncode}):\n{tail}")


def _compile(target: Path) -> None:
    """unchecked-hash pycs: valid whatever the source mtimes; tracebacks name the sandbox path."""
    cmd = [sys.executable, "-m", "compileall", "-q", "-j", "1", "--invalidation-mode", "unchecked-hash",
           "-s", str(target), "-p", PACKAGES_PREFIX, str(target)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False,
                          env={**os.environ, "PYTHONHASHSEED": "0"})
    if proc.returncode not in (0, 1):  # 1: some file did not compile (test data, py2 leftovers)
        raise StoreError(f"byte-compiling {target} failed: {proc.stderr.strip()[-2000:]}")


def _installed(target: Path) -> dict[str, str]:
    out = {}
    for meta in sorted(target.glob("*.dist-info/METADATA")):
        msg = email.parser.BytesHeaderParser().parsebytes(meta.read_bytes())
        if msg["Name"] and msg["Version"]:
            out[str(msg["Name"]).lower().replace("_", "-")] = str(msg["Version"])
    return out


def _normalise_dirs(root: Path, *, files: bool = False) -> None:
    """Modes the build created, made independent of the umask: directories 0755 and (``files``)
    regular files 0755 if anyone may execute them, else 0644."""
    for dirpath, _dirs, names in os.walk(root):
        os.chmod(dirpath, 0o755)
        for name in names if files else ():
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            if stat.S_ISREG(st.st_mode):
                os.chmod(path, 0o755 if st.st_mode & 0o111 else 0o644)
