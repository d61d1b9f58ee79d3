"""Checkpoints: a sandbox's overlay upper directory becomes a layer on top of its parent snapshot.

The child manifest is the parent's with one more layer (the diff) and ``parent`` set to the parent's
id; ``warm_layers`` is unchanged, so children restore from the parent's zygote and only add their
diff as a per-sandbox lower layer. Snapshots thus form a tree (fork, replay). Owners in the diff are
kept as found, except ``remap`` (from, to): a sandbox whose processes run as a host uid of their own
(``Sandbox.owner_shift``) owns what it wrote by that uid, packed as the sandbox user's. Whiteouts and
opaque directories the kernel wrote into the upper directory are kept as such. The caller must make
sure nothing writes to the upper directory while it is read (freeze the sandbox's cgroup, or stop it).
"""

from __future__ import annotations

import os

from rollbox.snapshots.manifest import Manifest, check_name
from rollbox.snapshots.store_local import LocalStore


def checkpoint(store: LocalStore, parent: Manifest, upper_dir: str | os.PathLike[str], *,
               name: str | None = None, remap: tuple[int, int] | None = None) -> Manifest:
    """Commit ``upper_dir`` as a layer over ``parent`` in ``store``; returns the child manifest."""
    if name is not None:
        check_name(name)
    store.put_manifest(parent)  # the tree stays complete in this store
    ref = store.add_layer_dir(upper_dir, owner=None, remap=remap)
    layers = (*parent.layers, ref)
    if ref in parent.layers and not any(os.scandir(upper_dir)):
        # nothing changed over a parent that has the empty layer already: the kernel refuses one
        # directory twice in an overlay's lower layers (ELOOP), and the empty layer shows nothing
        layers = parent.layers
    child = parent.model_copy(update={"layers": layers, "parent": parent.id})
    child = Manifest.model_validate(child.model_dump())  # re-validated, as if read from a store
    store.put_manifest(child)
    if name is not None:
        store.set_name(name, child.id)
    return child
