"""Where ``rollbox serve`` keeps snapshots: the store, the local cache in front of it, the resolver.

    --store unset            the local store in --home (the embedded default)
    --store DIR              the local store in DIR
    --store s3://bucket/p    S3, through a local cache (--cache-dir, default --home) capped at
                             --cache-max-bytes (LRU; never a layer a live sandbox or zygote uses)

In every case the runtime's ``layer_root`` is the local store's ``layers/``: checkpoints are
committed there and pulled layers are unpacked there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from rollbox.runtime.errors import StoreError
from rollbox.snapshots.cache import LayerCache
from rollbox.snapshots.resolver import StoreResolver
from rollbox.snapshots.state import LocalObjects, Objects
from rollbox.snapshots.store import parse_s3_url
from rollbox.snapshots.store_local import LocalStore

if TYPE_CHECKING:
    from rollbox.snapshots.store_s3 import S3Store

__all__ = ["StoreConfig", "check_store_url", "in_use_of", "open_local", "open_remote", "open_store", "state_objects"]


@dataclass(frozen=True)
class StoreConfig:
    """The snapshot-store flags of ``rollbox serve`` (each has an environment variable)."""

    home: Path | None = None
    store: str | None = None
    cache_dir: Path | None = None
    cache_max_bytes: int | None = None
    s3_endpoint_url: str | None = None
    s3_region: str | None = None
    aws_profile: str | None = None
    s3_max_attempts: int = 3


def check_store_url(raw: str) -> str:
    """A directory or ``s3://bucket[/prefix]``; raises ``ValueError`` naming what is wrong."""
    url = raw.strip()
    if not url:
        raise ValueError("must not be empty: a directory or s3://bucket/prefix")
    if "://" in url:
        try:
            parse_s3_url(url)
        except StoreError as exc:
            raise ValueError(exc.message) from None
    return url


def open_store(cfg: StoreConfig) -> StoreResolver:
    """The resolver over the configured store (S3 is not contacted here: a server may start during
    an S3 outage and serve what its cache holds)."""
    resolver = open_local(cfg)
    resolver.cache.remote = open_remote(cfg)
    return resolver


def open_local(cfg: StoreConfig) -> StoreResolver:
    """The resolver over the local part alone: the local store, or the cache in front of S3 before
    ``open_remote`` (boto3 and its client: ~0.4 s) is attached as its ``remote``. ``rollbox serve``
    starts its runtime and prewarmed zygotes on it meanwhile."""
    if _s3_url(cfg) is None:
        return StoreResolver(LayerCache(LocalStore(cfg.store or cfg.home)))
    return StoreResolver(LayerCache(LocalStore(cfg.cache_dir or cfg.home), max_bytes=cfg.cache_max_bytes))


def open_remote(cfg: StoreConfig) -> S3Store | None:
    """The S3 store of ``--store s3://...`` (None for a local one); raises ``StoreError``."""
    url = _s3_url(cfg)
    if url is None:
        return None
    from rollbox.snapshots.store_s3 import S3Store

    return S3Store(url, endpoint_url=cfg.s3_endpoint_url, region=cfg.s3_region, profile=cfg.aws_profile,
                   max_attempts=cfg.s3_max_attempts)


def _s3_url(cfg: StoreConfig) -> str | None:
    return cfg.store if cfg.store is not None and cfg.store.startswith("s3://") else None


def state_objects(cache: LayerCache) -> Objects:
    """Where durable sandbox state lives: beside the snapshots, in S3 when the store is S3, else in
    the local store's directory (``sandboxes/``, ``blobs/``)."""
    if cache.remote is not None:
        from rollbox.snapshots.store_s3 import S3Objects, S3Store

        assert isinstance(cache.remote, S3Store)
        return S3Objects(cache.remote)
    return LocalObjects(cache.local.root)


def in_use_of(layers_in_use: Callable[[], frozenset[str]]) -> Callable[[str], bool]:
    """``LayerCache.in_use`` from ``Runtime.layers_in_use`` (a set the event loop replaces whole, so
    the cache's worker threads may read it at any time)."""

    def in_use(layer_id: str) -> bool:
        return layer_id in layers_in_use()

    return in_use
