"""The layer cache in front of S3: lazy pull on resolve, one download per layer however many
threads or tasks ask at once, and LRU eviction under a size cap that spares layers in use."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from rollbox.snapshots.cache import LayerCache
from rollbox.snapshots.resolver import StoreResolver
from rollbox.snapshots.store import copy_snapshot
from rollbox.snapshots.store_local import LocalStore

from tests.threads import at_once

from .s3server import S3Factory, sample_snapshot

MiB = 1024 * 1024


def pushed(tmp_path: Path, s3_url: str, make_s3: S3Factory, tags: str, big_bytes: int = 0):  # type: ignore[no-untyped-def]
    src = LocalStore(tmp_path / "src")
    s3 = make_s3(s3_url)
    manifests = {}
    for tag in tags:
        manifests[tag] = sample_snapshot(src, tmp_path, tag=tag, big_bytes=big_bytes, name=f"snap-{tag}")
        copy_snapshot(src, s3, f"snap-{tag}")
    return s3, manifests


def test_resolve_pulls_lazily_and_returns_the_runtime_view(tmp_path: Path, s3_url: str,
                                                            make_s3: S3Factory) -> None:
    s3, m = pushed(tmp_path, s3_url, make_s3, "a")
    cache = LocalStore(tmp_path / "cache")
    assert cache.list_ids() == []
    view = StoreResolver(LayerCache(cache, s3)).resolve("snap-a")
    manifest = m["a"]
    assert view.id == manifest.id
    assert view.layers == tuple(ref.id for ref in reversed(manifest.layers))  # top first
    assert view.layer_root == str(cache.root / "layers")
    assert view.warm.python == "/usr/bin/python3" and view.warm.imports == ("json",)
    assert view.env == {"TAG": "a"} and view.version["python"] == "3.11"
    assert (Path(view.layer_root) / view.layers[1] / "etc" / "motd").read_text() == "snapshot a\n"
    assert s3.stats["layer_downloads"] == 2
    # a second resolve is served from the cache (and by id, without asking S3 for the name)
    StoreResolver(LayerCache(cache, s3)).resolve(manifest.id)
    assert s3.stats["layer_downloads"] == 2
    # the built-in python snapshot is the fallback for that name only
    assert StoreResolver(LayerCache(cache, s3)).resolve("python").id == "python"


def test_concurrent_pulls_of_one_layer_download_it_once(tmp_path: Path, s3_url: str,
                                                        make_s3: S3Factory) -> None:
    s3, m = pushed(tmp_path, s3_url, make_s3, "a", big_bytes=16 * MiB)
    layer_ids = [ref.id for ref in m["a"].layers]

    cache = LayerCache(LocalStore(tmp_path / "threads"), s3)
    _, errors = at_once(lambda: cache.ensure(layer_ids), 8)
    assert errors == []
    assert s3.stats["layer_downloads"] == 2
    # every other ensure of a layer waited on the one download or found it done (which depends on
    # scheduling): none downloaded it again
    assert cache.stats["waits"] + cache.stats["hits"] == 8 * 2 - 2

    async def many() -> None:
        cache2 = LayerCache(LocalStore(tmp_path / "tasks"), s3)
        resolver = StoreResolver(cache2)
        views = await asyncio.gather(*(resolver.resolve_async("snap-a") for _ in range(8)))
        assert {v.id for v in views} == {m["a"].id}
        assert cache2.stats["pulls"] == 2

    asyncio.run(many())
    assert s3.stats["layer_downloads"] == 4


def test_lru_eviction_under_a_cap_spares_pinned_and_in_use_layers(tmp_path: Path, s3_url: str,
                                                                  make_s3: S3Factory) -> None:
    s3, m = pushed(tmp_path, s3_url, make_s3, "abcd", big_bytes=1 * MiB)
    size = {t: m[t].size_bytes for t in m}
    local = LocalStore(tmp_path / "cache")
    in_use: set[str] = set()
    cache = LayerCache(local, s3, max_bytes=int(2.5 * size["a"]), in_use=in_use.__contains__)
    resolver = StoreResolver(cache)

    def present(tag: str) -> bool:
        return all(local.has_layer(ref.id) for ref in m[tag].layers)

    resolver.resolve("snap-a")
    resolver.resolve("snap-b")
    assert present("a") and present("b")
    resolver.resolve("snap-a")  # a is now more recently used than b
    resolver.resolve("snap-c")
    assert present("a") and present("c") and not present("b")

    cache.pin(ref.id for ref in m["a"].layers)  # a is the least recently used, but pinned
    in_use.update(ref.id for ref in m["c"].layers)  # and c is in use by the runtime
    resolver.resolve("snap-d")
    assert present("a") and present("c") and present("d")  # over the cap rather than break a user
    cache.unpin(ref.id for ref in m["a"].layers)
    in_use.clear()
    cache.evict()
    assert not present("a") and present("c") and present("d")  # a was the least recently used
    total = sum(u.size_bytes for u in local.layer_usage())
    assert total <= cache.max_bytes  # type: ignore[operator]

    # an evicted snapshot comes back on the next resolve
    before = s3.stats["layer_downloads"]
    missing = [ref.id for ref in m["a"].layers if not local.has_layer(ref.id)]
    assert m["a"].layers[1].id in missing  # its big layer was the one to go
    resolver.resolve("snap-a")
    assert present("a") and s3.stats["layer_downloads"] == before + len(missing)


def test_locally_built_layers_are_never_evicted(tmp_path: Path) -> None:
    local = LocalStore(tmp_path / "cache")
    m = sample_snapshot(local, tmp_path, big_bytes=1 * MiB)
    cache = LayerCache(local, None, max_bytes=1024)
    assert cache.evict() == []
    assert all(local.has_layer(ref.id) for ref in m.layers)
    with pytest.raises(ValueError, match="max_bytes must be positive"):
        LayerCache(local, None, max_bytes=0)


def test_names_skip_another_writers_temp_files_and_names_removed_while_listing(tmp_path: Path) -> None:
    """A name being written (``.name.pid.ns`` before its rename) or removed during a listing is not
    an error: resolving by name runs while a concurrent pull writes the same name."""
    store = LocalStore(tmp_path / "store")
    sid = "a" * 64
    store.set_name("ready", sid)
    (store.root / "names" / ".ready.1.2").write_text(sid)        # a temp file mid-rename
    assert store.names() == {"ready": sid}
    with pytest.raises(Exception, match="names here: ready"):
        store.resolve_id("missing")
