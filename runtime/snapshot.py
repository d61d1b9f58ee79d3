"""The runtime's small view of a snapshot: layers + warm recipe + manifest.

snapshots/ builds, stores and fetches snapshots; the runtime only needs to know which read-only
directories to stack, which host directories to bind read-only (for snapshots based on the host
system), and how to warm the zygote. Keep this surface small.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from rollbox.runtime.errors import SnapshotNotFound
from rollbox.runtime.spec import DEFAULT_LIMITS, Limits

ROLLBOX_VERSION = "0.1.0"


# What the built-in ``python`` snapshot's zygote imports (and the shipped python template lists the
# same): the stdlib modules model-written code reaches for most. Every sandbox is a fresh fork, so a
# module not imported here is imported again by every exec that uses it (``import hashlib`` alone
# costs ~3.5 ms of CPU per exec: it loads libcrypto; ``pathlib`` ~5 ms). Imported once here, the
# modules are shared copy-on-write by every sandbox. ``random`` reseeds itself in each fork.
STDLIB_WARM = (
    "base64", "bisect", "collections", "contextlib", "copy", "csv", "dataclasses", "datetime", "decimal",
    "enum", "fractions", "functools", "glob", "hashlib", "heapq", "io", "itertools", "json", "math",
    "operator", "pathlib", "random", "re", "shlex", "statistics", "string", "struct", "subprocess",
    "tempfile", "textwrap", "time", "typing", "uuid",
)


@dataclass(frozen=True)
class WarmRecipe:
    """How the zygote of a snapshot warms up: the interpreter it runs and what it imports."""

    python: str
    sys_path: tuple[str, ...] = ()
    imports: tuple[str, ...] = ()


@dataclass(frozen=True)
class SnapshotView:
    """What the runtime needs to restore sandboxes from a snapshot.

    ``layers`` are directory names under ``layer_root``, top first, each a read-only overlayfs lower
    layer. The bottom ``warm_layers`` of them are what the zygote sees while it warms up; layers above
    (a checkpointed sandbox's diff, say) are added per sandbox, so such snapshots share the zygote.
    ``host_binds`` are host directories bound read-only at the same path (host-based snapshots);
    ``host_masks`` are directories hidden under an empty read-only tmpfs.
    """

    id: str
    layer_root: str
    layers: tuple[str, ...]
    warm: WarmRecipe
    host_binds: tuple[str, ...] = ()
    host_masks: tuple[str, ...] = ()
    warm_layers: int = 0
    env: Mapping[str, str] = field(default_factory=dict)
    version: Mapping[str, Any] = field(default_factory=dict)
    limits: Limits = DEFAULT_LIMITS
    process_image: str | None = None  # a checkpointed process image (CRIU) instead of the warm recipe

    @property
    def zygote_key(self) -> tuple[Any, ...]:
        bottom = self.layers[len(self.layers) - self.warm_layers :] if self.warm_layers else ()
        return (self.layer_root, bottom, self.host_binds, self.host_masks, self.warm, tuple(self.env.items()),
                self.process_image)

    @property
    def extra_layers(self) -> tuple[str, ...]:
        return self.layers[: len(self.layers) - self.warm_layers]


class SnapshotResolver(Protocol):
    def resolve(self, name_or_id: str) -> SnapshotView: ...


def host_python() -> str:
    """The real interpreter behind this process, symlinks resolved (never a venv's ``python``, which
    would not exist inside a sandbox). A venv made from Debian's ``/usr/bin/python3`` is named
    ``python`` while Debian ships only ``python3`` and ``python3.X``: so ask ``sys._base_executable``
    (the interpreter the venv was made from) first, then the usual names in the base prefix."""
    ver = f"{sys.version_info.major}.{sys.version_info.minor}"
    bindir = os.path.join(sys.base_prefix, "bin")
    candidates = [getattr(sys, "_base_executable", "") or "", sys.executable if sys.prefix == sys.base_prefix else ""]
    candidates += [os.path.join(bindir, n) for n in (f"python{ver}", "python3", os.path.basename(sys.executable))]
    for c in candidates:
        real = os.path.realpath(c) if c else ""
        if real and os.path.isfile(real) and os.access(real, os.X_OK):
            return real
    raise FileNotFoundError(f"cannot find the Python interpreter behind {sys.executable}: tried "
                            + ", ".join(c for c in candidates if c))


def host_python_view(layer_root: str) -> SnapshotView:
    """The built-in ``python`` snapshot: the host's Python and base system, read-only, stdlib only."""
    prefix = os.path.realpath(sys.base_prefix)
    binds = ["/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib64", "/lib32"):
        if os.path.isdir(top) and not os.path.islink(top):
            binds.append(top)
    if not prefix.startswith("/usr/"):
        binds.append(prefix)
    # the interpreter may live outside its prefix (a uv- or pyenv-managed symlink farm): bind its home
    home = os.path.dirname(os.path.dirname(host_python()))
    if not any(home == b or home.startswith(b + "/") for b in binds):
        binds.append(home)
    ver = f"{sys.version_info.major}.{sys.version_info.minor}"
    site = os.path.join(prefix, "lib", f"python{ver}", "site-packages")
    masks = [site] if os.path.isdir(site) else []
    # Debian's system Python keeps third-party packages in dist-packages: hide them too.
    for d in ("/usr/lib/python3/dist-packages", f"/usr/local/lib/python{ver}/dist-packages"):
        if os.path.isdir(d):
            masks.append(d)
    return SnapshotView(
        id="python",
        layer_root=layer_root,
        layers=(),
        warm=WarmRecipe(python=host_python(), imports=STDLIB_WARM),
        host_binds=tuple(binds),
        host_masks=tuple(masks),
        version={
            "base": "host",
            "python": sys.version.split()[0],
            "packages": {},
            "rollbox": ROLLBOX_VERSION,
        },
    )


class BuiltinResolver:
    """Knows the built-in ``python`` snapshot, plus views registered at run time (tests, benchmarks)."""

    def __init__(self, layer_root: str):
        self.layer_root = layer_root
        self._views: dict[str, SnapshotView] = {"python": host_python_view(layer_root)}

    def register(self, view: SnapshotView) -> None:
        self._views[view.id] = view

    def resolve(self, name_or_id: str) -> SnapshotView:
        try:
            return self._views[name_or_id]
        except KeyError:
            known = ", ".join(sorted(self._views))
            raise SnapshotNotFound(
                f"no snapshot named {name_or_id!r}; known: {known}", snapshot_id=name_or_id
            ) from None
