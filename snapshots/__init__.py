"""rollbox.snapshots: what sandboxes are restored from — layers, manifests, templates and stores.

    template, template_dir = load_template("snapshots/templates/python.yaml")
    manifest = build(template, template_dir, LocalStore())         # manifest.id: the snapshot id
    copy_snapshot(LocalStore(), S3Store("s3://bucket/prefix"), manifest.id)   # a push
    resolver = StoreResolver(LayerCache(LocalStore(), S3Store("s3://bucket/prefix")))
    runtime = Runtime(RuntimeConfig(layer_root=Path(resolver.layer_root)), resolver=resolver)

Building:
    Template         a template (the YAML a user writes), validated
    load_template    read and validate a template file: (Template, the directory its paths start from)
    build            build a template into a local store; returns its Manifest
    checkpoint       commit a sandbox's overlay upper directory as a child snapshot of its parent
    Manifest         what a snapshot is: its layers, base, warm recipe, env, limits, VERSION; ``.id``
Stores:
    Store            the interface every store implements (layers, manifests, names)
    LocalStore       a local directory (default: the home, ``ROLLBOX_HOME``)
    S3Store          an S3 bucket (``s3://bucket/prefix``, any S3-compatible endpoint)
    copy_snapshot    copy a snapshot's missing layers, manifest and name between stores (push, pull)
    LayerCache       a local store in front of a remote one, filled lazily, size-capped
    StoreResolver    the runtime's resolver over a store or cache: name or id -> SnapshotView

Store errors are rollbox.runtime's (``SnapshotNotFound``, ``StoreError``, ``StoreUnavailable``,
``IntegrityError``). The format, ids and what the checksums protect: docs/snapshots.md.

Exports load lazily (importing ``rollbox.snapshots.state`` loads no S3 client), except ``build`` and
``checkpoint``: they share their module's name, which the import system binds on the package as soon
as anything imports that module, so a lazy export would turn into the module.
"""

import importlib as _importlib
import typing as _typing

from rollbox.snapshots.build import build
from rollbox.snapshots.checkpoint import checkpoint

if _typing.TYPE_CHECKING:
    from rollbox.snapshots.cache import LayerCache
    from rollbox.snapshots.manifest import Manifest
    from rollbox.snapshots.resolver import StoreResolver
    from rollbox.snapshots.store import Store, copy_snapshot
    from rollbox.snapshots.store_local import LocalStore
    from rollbox.snapshots.store_s3 import S3Store
    from rollbox.snapshots.template import Template, load_template

__all__ = [
    "LayerCache",
    "LocalStore",
    "Manifest",
    "S3Store",
    "Store",
    "StoreResolver",
    "Template",
    "build",
    "checkpoint",
    "copy_snapshot",
    "load_template",
]

_WHERE = {
    "LayerCache": "rollbox.snapshots.cache",
    "LocalStore": "rollbox.snapshots.store_local",
    "Manifest": "rollbox.snapshots.manifest",
    "S3Store": "rollbox.snapshots.store_s3",
    "Store": "rollbox.snapshots.store",
    "StoreResolver": "rollbox.snapshots.resolver",
    "Template": "rollbox.snapshots.template",
    "copy_snapshot": "rollbox.snapshots.store",
    "load_template": "rollbox.snapshots.template",
}


def __getattr__(name: str) -> _typing.Any:
    if name in _WHERE:
        return getattr(_importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'rollbox.snapshots' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
