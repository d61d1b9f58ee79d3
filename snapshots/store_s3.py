"""The S3 store: snapshots in any S3-compatible bucket, through boto3.

Keys under ``s3://bucket/prefix``::

    prefix/layers/<layer id>.tar       canonical layer tars (multipart upload above a threshold)
    prefix/manifests/<snapshot id>.json
    prefix/names/<name>                a snapshot id

Endpoint, region and credentials come from the arguments or boto3's usual sources
(``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_PROFILE``, config
files). Retries with exponential backoff are botocore's ``standard`` mode; multipart transfers are
boto3's ``TransferConfig``. botocore/s3transfer errors are converted here, once, into rollbox errors:
unreachable or 5xx -> ``StoreUnavailable``; missing key -> ``SnapshotNotFound``/``StoreError``;
denied, missing bucket, no credentials -> ``StoreError`` saying what to fix. Every layer and manifest
read is verified against its sha256 before it is returned.

Retention tiers are bucket lifecycle rules (``lifecycle_rules``, ``S3Store.set_lifecycle``), one per
tier, each filtered on a prefix under the store's::

    prefix/sandboxes/, prefix/blobs/   hot: durable step state, expires (blobs a lifetime later)
    prefix/trajectories/               warm Parquet, moved to a cold storage class
    prefix/usage/                      warm Parquet, the bill: no rule, never expires
    prefix/                            incomplete multipart uploads aborted after a day
    layers/, manifests/, names/        snapshots: no rule
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import datetime
import hashlib
import logging
import math
import os
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import boto3
import boto3.exceptions
import botocore.config
import botocore.credentials
import botocore.exceptions
from boto3.s3.transfer import TransferConfig
from rollbox.runtime.errors import (
    IntegrityError,
    InvalidRequest,
    RollboxError,
    SnapshotNotFound,
    StoreError,
    StoreUnavailable,
)
from rollbox.runtime.spec import Limits
from rollbox.snapshots.calls import StoreDeadline
from rollbox.snapshots.layers import check_layer_id
from rollbox.snapshots.manifest import Manifest, check_name, check_snapshot_id
from rollbox.snapshots.state import REFRESH_AFTER_S, in_key_range
from rollbox.snapshots.store import ByteCallback, parse_s3_url

MiB = 1024 * 1024
log = logging.getLogger(__name__)
_UNREACHABLE = (
    botocore.exceptions.EndpointConnectionError,
    botocore.exceptions.ConnectionClosedError,
    botocore.exceptions.ConnectTimeoutError,
    botocore.exceptions.ReadTimeoutError,
    botocore.exceptions.ResponseStreamingError,
)
_NOT_FOUND = ("NoSuchKey", "404", "NotFound")
_DENIED = ("AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch", "Forbidden")


# Retention tiers (see the module docstring). A sandbox lives at most Limits.lifetime_s, so its state
# must outlive that; a blob can be first uploaded by one sandbox and named by another created up to
# a lifetime later, so blobs live one lifetime longer than step records.
DAY_S = 24 * 3600
MAX_LIFETIME_DAYS = math.ceil(next(
    float(m.le) for m in Limits.model_fields["lifetime_s"].metadata if hasattr(m, "le")) / DAY_S)
STATE_DAYS = MAX_LIFETIME_DAYS + 1
COLD_DAYS = 30
COLD_CLASS = "GLACIER_IR"  # readable without a restore (GLACIER needs one before the Parquet can be read)
COLD_CLASSES = ("GLACIER", "DEEP_ARCHIVE", "GLACIER_IR", "STANDARD_IA", "ONEZONE_IA", "INTELLIGENT_TIERING")
_MIN_DAYS = {"STANDARD_IA": 30, "ONEZONE_IA": 30}  # S3 refuses earlier transitions to these
RULE_ID_PREFIX = "rollbox-"
_RULE_ID_MAX = 255
LifecycleRule = dict[str, Any]


def lifecycle_rules(prefix: str, *, state_days: int = STATE_DAYS, cold_days: int = COLD_DAYS,
                    cold_class: str | None = COLD_CLASS) -> list[LifecycleRule]:
    """The lifecycle rules of a store at ``prefix`` (as in ``S3Store.prefix``), in the shape of boto3's
    ``put_bucket_lifecycle_configuration``. ``cold_class`` None leaves trajectories where they are
    (for servers without storage classes). Raises ``InvalidRequest`` naming the bad value."""
    if state_days <= MAX_LIFETIME_DAYS:
        raise InvalidRequest(
            f"state_days {state_days} is too short: a sandbox lives up to {MAX_LIFETIME_DAYS} days and its "
            f"durable state must outlive it; use at least {MAX_LIFETIME_DAYS + 1}")
    if cold_days < 1:
        raise InvalidRequest(f"cold_days {cold_days}: must be at least 1")
    if cold_class is not None:
        if cold_class not in COLD_CLASSES:
            raise InvalidRequest(f"cold_class {cold_class!r} is not an S3 transition storage class; use one "
                                 f"of {', '.join(COLD_CLASSES)}")
        if cold_days < _MIN_DAYS.get(cold_class, 1):
            raise InvalidRequest(f"cold_days {cold_days}: S3 moves objects to {cold_class} after "
                                 f"{_MIN_DAYS[cold_class]} days at the earliest")
    prefix = prefix.strip("/")
    base, suffix = (f"{prefix}/", f":{prefix}") if prefix else ("", "")
    if len(RULE_ID_PREFIX + "trajectories" + suffix) > _RULE_ID_MAX:
        raise InvalidRequest(f"store prefix {prefix!r} is too long for S3 lifecycle rule ids "
                             f"({_RULE_ID_MAX} characters at most, with {RULE_ID_PREFIX}<tier>:)")

    def rule(tier: str, sub: str, action: LifecycleRule) -> LifecycleRule:
        return {"ID": f"{RULE_ID_PREFIX}{tier}{suffix}", "Filter": {"Prefix": base + sub}, "Status": "Enabled",
                **action}

    rules = [
        rule("sandboxes", "sandboxes/", {"Expiration": {"Days": state_days}}),
        # a blob lives a lifetime past its last (re)write: reused ones older than a day are rewritten
        rule("blobs", "blobs/", {"Expiration": {"Days": state_days + MAX_LIFETIME_DAYS + 1}}),
        # the compile cache (outcomes and artifacts, claims, timeout verdicts): one entry per program
        # compiled, which an RL run makes anew at every sample; an expired one is compiled again when used
        rule("compiled", "compiled/", {"Expiration": {"Days": state_days}}),
    ]
    if cold_class is not None:
        rules.append(rule("trajectories", "trajectories/",
                          {"Transitions": [{"Days": cold_days, "StorageClass": cold_class}]}))
    rules.append(rule("multipart", "", {"AbortIncompleteMultipartUpload": {"DaysAfterInitiation": 1}}))
    return rules


def is_own_rule(rule: LifecycleRule, prefix: str) -> bool:
    """Is ``rule`` one ``lifecycle_rules`` makes for a store at ``prefix``? Rule ids are
    ``rollbox-<tier>:<prefix>`` (``rollbox-<tier>`` at the bucket's root), so stores at other prefixes
    of the same bucket, and rules that are not rollbox's, are told apart."""
    rule_id = str(rule.get("ID", ""))
    return rule_id.startswith(RULE_ID_PREFIX) and rule_id.partition(":")[2] == prefix.strip("/")


class S3Store:
    """A snapshot store in an S3 bucket (see the module docstring)."""

    def __init__(
        self,
        url: str,
        *,
        endpoint_url: str | None = None,
        region: str | None = None,
        profile: str | None = None,
        access_key_id: str | None = None,
        secret_access_key: str | None = None,
        max_attempts: int = 3,
        connect_timeout_s: float = 3.0,
        read_timeout_s: float = 15.0,  # between bytes; callers' deadlines bound a whole call (snapshots.calls)
        multipart_threshold_bytes: int = 64 * MiB,
        multipart_chunk_bytes: int = 16 * MiB,
        max_concurrency: int = 4,
    ):
        self.url = url
        self.bucket, self.prefix = parse_s3_url(url)
        try:
            session = boto3.session.Session(profile_name=profile)
            self._client = session.client(
                "s3",
                endpoint_url=endpoint_url,
                region_name=region or session.region_name or "us-east-1",
                aws_access_key_id=access_key_id,
                aws_secret_access_key=secret_access_key,
                config=botocore.config.Config(
                    retries={"max_attempts": max_attempts, "mode": "standard"},
                    connect_timeout=connect_timeout_s,
                    read_timeout=read_timeout_s,
                    s3={"addressing_style": "path"} if endpoint_url else None,
                ),
            )
        except botocore.exceptions.BotoCoreError as exc:
            raise StoreError(f"cannot configure the S3 client for {url}: {exc}") from exc
        self.endpoint = self._client.meta.endpoint_url
        self.max_attempts = max_attempts
        # durable state's hot calls (a record's GET, its create-only PUT) go through obstore when it is
        # installed: a fifth of botocore's CPU per call (loadtest/profile_s3_step.py); botocore does the rest
        # (an endpoint botocore found elsewhere, AWS_ENDPOINT_URL or a config file, is a custom one too)
        custom = endpoint_url or (None if self.endpoint.endswith(".amazonaws.com") else self.endpoint)
        self._fast = _fast_client(session, self.bucket, endpoint_url=custom,
                                  region=self._client.meta.region_name, access_key_id=access_key_id,
                                  secret_access_key=secret_access_key, max_attempts=max_attempts,
                                  connect_timeout_s=connect_timeout_s, read_timeout_s=read_timeout_s)
        self._transfer = TransferConfig(
            multipart_threshold=multipart_threshold_bytes,
            multipart_chunksize=multipart_chunk_bytes,
            max_concurrency=max_concurrency,
            use_threads=max_concurrency > 1,
        )
        self.stats: collections.Counter[str] = collections.Counter()
        self._stats_lock = threading.Lock()
        # HTTP requests sent, by S3 operation (each attempt of a retried call counts): what a step costs
        self.requests: collections.Counter[str] = collections.Counter()
        self._client.meta.events.register("before-send.s3", self._sent)

    def __repr__(self) -> str:
        return f"S3Store({self.url!r}, endpoint={self.endpoint!r})"

    def _key(self, *parts: str) -> str:
        return "/".join(p for p in (self.prefix, *parts) if p)

    def _count(self, what: str) -> None:
        with self._stats_lock:
            self.stats[what] += 1

    def _sent(self, event_name: str = "", **_: Any) -> None:
        """botocore's ``before-send`` hook: count the request (returns None: the request is sent)."""
        with self._stats_lock:
            self.requests[event_name.rpartition(".")[2]] += 1

    def requests_sent(self) -> dict[str, int]:
        """HTTP requests sent to S3 so far, by operation (GetObject, PutObject, ListObjectsV2, ...)."""
        with self._stats_lock:
            return dict(self.requests)

    # ------------------------------------------------------------------------- the boundary
    @contextlib.contextmanager
    def _errors(self, doing: str, *, snapshot_id: str | None = None,
                layer_id: str | None = None) -> Iterator[None]:
        """Convert botocore / s3transfer errors raised while ``doing`` into rollbox errors."""
        try:
            yield
        except RollboxError:
            raise
        except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError,
                boto3.exceptions.Boto3Error) as exc:
            raise self._convert(exc, doing, snapshot_id=snapshot_id, layer_id=layer_id) from exc

    def _convert(self, exc: BaseException, doing: str, *, snapshot_id: str | None,
                 layer_id: str | None) -> RollboxError:
        root = _root_cause(exc)
        where = f"S3 {self.endpoint} bucket {self.bucket!r}"
        kw: dict[str, Any] = {"snapshot_id": snapshot_id, "layer_id": layer_id}
        if isinstance(root, _UNREACHABLE):
            return StoreUnavailable(
                f"{where} is unreachable while {doing} ({root}; tried {self.max_attempts} times with "
                "backoff); check that the S3 endpoint is up, then retry", **kw)
        if isinstance(root, botocore.exceptions.NoCredentialsError):
            return StoreError(
                f"no AWS credentials for {where} while {doing}: set AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY, or --aws-profile / AWS_PROFILE", **kw)
        if isinstance(root, botocore.exceptions.ClientError):
            err = root.response.get("Error", {})
            code = str(err.get("Code", ""))
            status = int(root.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
            if code == "NoSuchBucket":
                return StoreError(f"{where} does not exist (while {doing}); create the bucket first", **kw)
            if code in _DENIED:
                return StoreError(f"{where} refused access while {doing} ({code}): check the "
                                  "credentials and the bucket policy", **kw)
            if status >= 500 or code in ("SlowDown", "ServiceUnavailable", "InternalError"):
                return StoreUnavailable(f"{where} failed while {doing} ({code}, HTTP {status}, after "
                                        f"{self.max_attempts} attempts); retry later", **kw)
            return StoreError(f"{where} refused {doing}: {code} {err.get('Message', '')}".rstrip(), **kw)
        return StoreError(f"{where} failed while {doing}: {root}", **kw)

    def _exists(self, key: str, doing: str, **kw: str | None) -> bool:
        with self._errors(doing, **kw):
            try:
                self._client.head_object(Bucket=self.bucket, Key=key)
            except botocore.exceptions.ClientError as exc:
                if str(exc.response.get("Error", {}).get("Code")) in _NOT_FOUND:
                    return False
                raise
        return True

    def _get_bytes(self, key: str, doing: str, **kw: str | None) -> bytes | None:
        with self._errors(doing, **kw):
            try:
                resp = self._client.get_object(Bucket=self.bucket, Key=key)
                data: bytes = resp["Body"].read()
            except botocore.exceptions.ClientError as exc:
                if str(exc.response.get("Error", {}).get("Code")) in _NOT_FOUND:
                    return None
                raise
        return data

    def _put_bytes(self, key: str, data: bytes, doing: str, **kw: str | None) -> None:
        with self._errors(doing, **kw):
            self._client.put_object(Bucket=self.bucket, Key=key, Body=data)

    def _list(self, prefix: str, doing: str) -> list[str]:
        return [key for key, _ in self._list_modified(prefix, doing)]

    def _list_modified(self, prefix: str, doing: str) -> list[tuple[str, float]]:
        """The keys under ``prefix``, each with its LastModified (Unix time)."""
        out: list[tuple[str, float]] = []
        with self._errors(doing):
            for page in self._client.get_paginator("list_objects_v2").paginate(
                    Bucket=self.bucket, Prefix=prefix):
                out.extend((obj["Key"], obj["LastModified"].timestamp()) for obj in page.get("Contents", []))
        return out

    def check(self) -> None:
        """Can this store be used now? Raises ``StoreUnavailable`` (cannot reach it: retry later) or
        ``StoreError`` naming what to fix (no credentials, access denied, no such bucket)."""
        with self._errors("checking the bucket"):
            try:
                self._client.head_bucket(Bucket=self.bucket)
            except botocore.exceptions.ClientError as exc:
                status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
                if status == 404 or str(exc.response.get("Error", {}).get("Code")) in ("404", "NoSuchBucket"):
                    raise StoreError(f"S3 {self.endpoint} bucket {self.bucket!r} does not exist; create the "
                                     "bucket first") from exc
                raise

    # ----------------------------------------------------------------------- lifecycle rules
    def lifecycle(self) -> list[LifecycleRule]:
        """Every lifecycle rule on the bucket (this store's, other stores', not rollbox's); [] if none."""
        with self._errors("reading the bucket's lifecycle rules"):
            try:
                resp = self._client.get_bucket_lifecycle_configuration(Bucket=self.bucket)
            except botocore.exceptions.ClientError as exc:
                if str(exc.response.get("Error", {}).get("Code")) == "NoSuchLifecycleConfiguration":
                    return []
                raise
        return list(resp.get("Rules") or [])

    def set_lifecycle(self, *, state_days: int = STATE_DAYS, cold_days: int = COLD_DAYS,
                      cold_class: str | None = COLD_CLASS) -> list[LifecycleRule]:
        """Replace this store's lifecycle rules with ``lifecycle_rules(...)``, keeping every other rule
        on the bucket (read, merge, write: the same arguments twice give the same configuration; S3 has
        no conditional write for it, so two concurrent writers can lose each other's change). Returns the
        bucket's rules as read back afterwards."""
        ours = lifecycle_rules(self.prefix, state_days=state_days, cold_days=cold_days, cold_class=cold_class)
        merged = [r for r in self.lifecycle() if not is_own_rule(r, self.prefix)] + ours
        where = f"S3 {self.endpoint} bucket {self.bucket!r}"
        with self._errors("setting the bucket's lifecycle rules"):
            try:
                self._client.put_bucket_lifecycle_configuration(
                    Bucket=self.bucket, LifecycleConfiguration={"Rules": merged})
            except botocore.exceptions.ClientError as exc:
                err = exc.response.get("Error", {})
                if str(err.get("Code")) != "NotImplemented":
                    raise  # 501 is not an outage: _convert would call it StoreUnavailable
                status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
                said = f"NotImplemented, HTTP {status}: {err.get('Message', '')!r}"
                moves = [r for r in ours if "Transitions" in r]
                if moves:
                    raise StoreError(
                        f"{where} does not implement storage-class transitions ({said}), which rule "
                        f"{moves[0]['ID']} needs to move trajectories/ to {cold_class}; nothing was changed. Set "
                        "the other rules without it (rollbox store init --no-transition) or use a server "
                        "with storage classes") from exc
                raise StoreError(f"{where} does not implement lifecycle rules ({said}); nothing was "
                                 "changed") from exc
        back = self.lifecycle()
        lost = sorted({r["ID"] for r in ours} - {r.get("ID") for r in back})
        if lost:
            raise StoreError(f"{where} accepted the lifecycle rules but did not keep {', '.join(lost)}; "
                             "it may not support them")
        return back

    # -------------------------------------------------------------------------------- layers
    def has_layer(self, layer_id: str) -> bool:
        key = self._key("layers", f"{check_layer_id(layer_id)}.tar")
        return self._exists(key, f"looking for layer {layer_id}", layer_id=layer_id)

    def put_layer(self, layer_id: str, tar_path: str, *, on_bytes: ByteCallback | None = None) -> None:
        key = self._key("layers", f"{check_layer_id(layer_id)}.tar")
        got = _sha256_file(tar_path)
        if got != layer_id:
            raise IntegrityError(f"refusing to upload layer {layer_id}: {tar_path} hashes to {got}",
                                 layer_id=layer_id)
        if self.has_layer(layer_id):
            return
        size = os.path.getsize(tar_path)
        with self._errors(f"uploading layer {layer_id}", layer_id=layer_id):
            if size < self._transfer.multipart_threshold:
                # one PUT: s3transfer's manager costs ~200 ms on first use and ~5 ms a call after
                with open(tar_path, "rb") as body:
                    self._client.put_object(Bucket=self.bucket, Key=key, Body=body)
                if on_bytes is not None:
                    on_bytes(size)
            else:
                self._client.upload_file(tar_path, self.bucket, key, Config=self._transfer, Callback=on_bytes)
        self._count("layer_uploads")

    def get_layer(self, layer_id: str, dest_path: str, *, on_bytes: ByteCallback | None = None) -> None:
        key = self._key("layers", f"{check_layer_id(layer_id)}.tar")
        doing = f"downloading layer {layer_id}"
        self._count("layer_downloads")
        try:
            with self._errors(doing, layer_id=layer_id):
                try:
                    self._client.download_file(self.bucket, key, dest_path, Config=self._transfer,
                                               Callback=on_bytes)
                except botocore.exceptions.ClientError as exc:
                    if str(exc.response.get("Error", {}).get("Code")) in _NOT_FOUND:
                        raise StoreError(f"layer {layer_id} is missing from {self.url} (a manifest "
                                         "names it): push the snapshot again", layer_id=layer_id) from exc
                    raise
            got = _sha256_file(dest_path)
            if got != layer_id:
                size = os.path.getsize(dest_path)
                raise IntegrityError(
                    f"layer {layer_id} downloaded from {self.url} is corrupt or truncated: its "
                    f"{size} bytes hash to {got}; it was not used (push the snapshot again)",
                    layer_id=layer_id)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(dest_path)
            raise

    # ----------------------------------------------------------------------------- manifests
    def has_manifest(self, snapshot_id: str) -> bool:
        key = self._key("manifests", f"{check_snapshot_id(snapshot_id)}.json")
        return self._exists(key, f"looking for snapshot {snapshot_id}", snapshot_id=snapshot_id)

    def put_manifest(self, manifest: Manifest) -> str:
        sid = manifest.id
        self._put_bytes(self._key("manifests", f"{sid}.json"), manifest.canonical_json(),
                        f"uploading manifest {sid}", snapshot_id=sid)
        return sid

    def get_manifest(self, snapshot_id: str) -> Manifest:
        key = self._key("manifests", f"{check_snapshot_id(snapshot_id)}.json")
        data = self._get_bytes(key, f"reading snapshot {snapshot_id}", snapshot_id=snapshot_id)
        if data is None:
            raise SnapshotNotFound(f"no snapshot {snapshot_id} in {self.url}", snapshot_id=snapshot_id)
        return Manifest.from_bytes(data, expected_id=snapshot_id)

    def list_ids(self) -> list[str]:
        prefix = self._key("manifests") + "/"
        return sorted(k[len(prefix):].removesuffix(".json") for k in self._list(prefix, "listing snapshots"))

    # --------------------------------------------------------------------------------- names
    def set_name(self, name: str, snapshot_id: str) -> None:
        try:
            check_name(name)
        except ValueError as exc:
            raise StoreError(str(exc), snapshot_id=snapshot_id) from None
        self._put_bytes(self._key("names", name), check_snapshot_id(snapshot_id).encode(),
                        f"naming snapshot {snapshot_id} {name!r}", snapshot_id=snapshot_id)

    def create_name(self, name: str, snapshot_id: str) -> str:
        try:
            check_name(name)
        except ValueError as exc:
            raise StoreError(str(exc), snapshot_id=snapshot_id) from None
        doing = f"naming snapshot {snapshot_id} {name!r} (if unnamed)"
        with self._errors(doing, snapshot_id=snapshot_id):
            try:
                self._client.put_object(Bucket=self.bucket, Key=self._key("names", name),
                                        Body=check_snapshot_id(snapshot_id).encode(), IfNoneMatch="*")
            except botocore.exceptions.ClientError as exc:
                code = str(exc.response.get("Error", {}).get("Code", ""))
                status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
                if status not in (409, 412) and code not in ("PreconditionFailed", "ConditionalRequestConflict"):
                    raise
                named = self._get_name(name)
                return named if named is not None else self.create_name(name, snapshot_id)
        return snapshot_id

    def _get_name(self, name: str) -> str | None:
        data = self._get_bytes(self._key("names", name), f"resolving name {name!r}", snapshot_id=name)
        return None if data is None else data.decode().strip()

    def names(self) -> dict[str, str]:
        prefix = self._key("names") + "/"
        out = {}
        for key in self._list(prefix, "listing names"):
            sid = self._get_name(key[len(prefix):])
            if sid is not None:
                out[key[len(prefix):]] = sid
        return out

    def resolve_id(self, name_or_id: str) -> str:
        try:
            check_snapshot_id(name_or_id)
            is_id = True
        except IntegrityError:
            is_id = False
        if is_id and self.has_manifest(name_or_id):
            return name_or_id
        if not is_id:
            try:
                check_name(name_or_id)
            except ValueError:
                pass
            else:
                sid = self._get_name(name_or_id)
                if sid is not None:
                    return check_snapshot_id(sid)
        raise SnapshotNotFound(f"no snapshot named {name_or_id!r} in {self.url}", snapshot_id=name_or_id)

    # -------------------------------------------------------------------------------- delete
    def delete(self, snapshot_id: str) -> list[str]:
        manifest = self.get_manifest(snapshot_id)
        doing = f"deleting snapshot {snapshot_id}"
        for name, sid in self.names().items():
            if sid == snapshot_id:
                with self._errors(doing, snapshot_id=snapshot_id):
                    self._client.delete_object(Bucket=self.bucket, Key=self._key("names", name))
        with self._errors(doing, snapshot_id=snapshot_id):
            self._client.delete_object(Bucket=self.bucket, Key=self._key("manifests", f"{snapshot_id}.json"))
        still_used = {ref.id for sid in self.list_ids() for ref in self.get_manifest(sid).layers}
        removed = []
        for ref in manifest.layers:
            if ref.id not in still_used:
                with self._errors(doing, snapshot_id=snapshot_id, layer_id=ref.id):
                    self._client.delete_object(Bucket=self.bucket, Key=self._key("layers", f"{ref.id}.tar"))
                removed.append(ref.id)
        return removed


def _fast_client(session: boto3.session.Session, bucket: str, *, endpoint_url: str | None, region: str,
                 access_key_id: str | None, secret_access_key: str | None, max_attempts: int,
                 connect_timeout_s: float, read_timeout_s: float) -> Any | None:
    """An obstore client of the bucket, signing with botocore's credentials (the same sources, refreshed
    as botocore refreshes them), or None: obstore not installed, or no credentials (botocore's calls
    then say what to fix)."""
    try:
        import obstore.store
    except ImportError:
        return None
    if access_key_id is not None and secret_access_key is not None:
        creds: Any = botocore.credentials.Credentials(access_key_id, secret_access_key)
    else:
        creds = session.get_credentials()  # (the profile and botocore's chain)
    if creds is None:
        return None
    refreshes = isinstance(creds, botocore.credentials.RefreshableCredentials)

    def credential() -> dict[str, Any]:
        frozen = creds.get_frozen_credentials()
        return {"access_key_id": frozen.access_key, "secret_access_key": frozen.secret_key, "token": frozen.token,
                # asked again within minutes when botocore refreshes them (roles, web identity)
                "expires_at": datetime.datetime.now(datetime.UTC) + datetime.timedelta(minutes=5) if refreshes
                else None}

    kw: dict[str, Any] = {"region": region}
    if endpoint_url:
        kw.update(endpoint=endpoint_url, virtual_hosted_style_request=False)
    return obstore.store.S3Store(
        bucket, credential_provider=credential,  # type: ignore[arg-type]
        client_options={"allow_http": bool(endpoint_url and endpoint_url.startswith("http://")),
                        "connect_timeout": datetime.timedelta(seconds=connect_timeout_s),
                        "timeout": datetime.timedelta(seconds=read_timeout_s)},
        retry_config={"max_retries": max(0, max_attempts - 1), "retry_timeout": datetime.timedelta(seconds=30),
                      "backoff": {"init_backoff": datetime.timedelta(milliseconds=100),
                                  "max_backoff": datetime.timedelta(seconds=5), "base": 2}},
        **kw)


class S3Objects:
    """Plain objects under an ``S3Store``'s prefix, for the durable sandbox state
    (``rollbox.snapshots.state``): create-only puts (``If-None-Match: *``), reads, listing, deletes.
    Errors are converted as for snapshots."""

    def __init__(self, store: S3Store):
        self.store = store
        self.url = store.url
        self._unconditional_logged = False  # the server refused If-Match on DeleteObject: said once

    def requests_sent(self) -> dict[str, int]:
        return self.store.requests_sent()

    def put_new(self, key: str, data: bytes) -> bool:
        """Create ``key`` only if it does not exist; False if it does (another writer was first). A
        retried request whose first try landed is told apart by reading the object back."""
        st = self.store
        if st._fast is not None:
            import obstore

            st._sent(event_name="PutObject")
            with self._fast_errors(f"writing {key}"):
                try:
                    obstore.put(st._fast, st._key(key), data, mode="create", use_multipart=False)
                except (obstore.exceptions.AlreadyExistsError, obstore.exceptions.PreconditionError):
                    return self.get(key) == data
            return True
        with st._errors(f"writing {key}"):
            try:
                st._client.put_object(Bucket=st.bucket, Key=st._key(key), Body=data, IfNoneMatch="*")
            except botocore.exceptions.ClientError as exc:
                code = str(exc.response.get("Error", {}).get("Code", ""))
                status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
                if status in (409, 412) or code in ("PreconditionFailed", "ConditionalRequestConflict"):
                    return self.get(key) == data
                raise
        return True

    @property
    def awaitable(self) -> bool:
        """Whether ``put_new_async`` and ``get_async`` run without a thread (obstore is installed)."""
        return self.store._fast is not None

    async def put_new_async(self, key: str, data: bytes) -> bool:
        """``put_new`` awaited on the event loop (only where ``awaitable``): obstore's own async call,
        whose Rust runtime sends the request and wakes the loop once with the answer. A store thread's
        round trip cost the loop more CPU (a thread's wake-up, two hand-offs of the GIL) than the call."""
        import obstore

        st = self.store
        assert st._fast is not None
        st._sent(event_name="PutObject")
        with self._fast_errors(f"writing {key}"):
            try:
                await obstore.put_async(st._fast, st._key(key), data, mode="create", use_multipart=False)
            except (obstore.exceptions.AlreadyExistsError, obstore.exceptions.PreconditionError):
                return await self.get_async(key) == data
        return True

    async def get_async(self, key: str) -> bytes | None:
        """``get`` awaited on the event loop (only where ``awaitable``; see ``put_new_async``)."""
        import obstore

        st = self.store
        assert st._fast is not None
        st._sent(event_name="GetObject")
        with self._fast_errors(f"reading {key}"):
            try:
                result = await obstore.get_async(st._fast, st._key(key))
                return bytes(await result.bytes_async())
            except FileNotFoundError:
                return None

    def put_content(self, key: str, data: bytes, *, refresh_after_s: float = REFRESH_AFTER_S) -> None:
        st = self.store
        full = st._key(key)
        with st._errors(f"writing {key}"):
            try:
                st._client.put_object(Bucket=st.bucket, Key=full, Body=data, IfNoneMatch="*")
                return
            except botocore.exceptions.ClientError as exc:
                status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
                if status not in (409, 412):
                    raise
            head = st._client.head_object(Bucket=st.bucket, Key=full)
            age = time.time() - head["LastModified"].timestamp()
            if age > refresh_after_s:  # the same bytes, written again: its expiry counts from now
                st._client.copy_object(Bucket=st.bucket, Key=full, CopySource={"Bucket": st.bucket, "Key": full},
                                       MetadataDirective="REPLACE", Metadata={"refreshed": str(int(time.time()))})
                st._count("refreshes")

    def get(self, key: str) -> bytes | None:
        st = self.store
        if st._fast is None:
            return st._get_bytes(st._key(key), f"reading {key}")
        import obstore

        st._sent(event_name="GetObject")
        with self._fast_errors(f"reading {key}"):
            try:
                return bytes(obstore.get(st._fast, st._key(key)).bytes())
            except FileNotFoundError:
                return None

    @contextlib.contextmanager
    def _fast_errors(self, doing: str) -> Iterator[None]:
        """obstore's errors as rollbox's, as ``S3Store._convert`` does botocore's."""
        import obstore.exceptions as oe

        st = self.store
        where = f"S3 {st.endpoint} bucket {st.bucket!r}"
        try:
            yield
        except (oe.PermissionDeniedError, oe.UnauthenticatedError) as exc:
            raise StoreError(f"{where} refused access while {doing}: check the credentials and the bucket "
                             f"policy ({_first_line(exc)})") from exc
        except oe.BaseError as exc:  # unreachable, timed out, 5xx after its retries
            raise StoreUnavailable(f"{where} is unreachable or failing while {doing} ({_first_line(exc)}; tried "
                                   f"{st.max_attempts} times with backoff); check that the S3 endpoint is up, then "
                                   "retry") from exc

    def _base(self) -> int:
        """How much of a full key is the store's prefix (keys here are relative to it)."""
        return len(self.store._key("") + "/") if self.store.prefix else 0

    def keys(self, prefix: str) -> list[str]:
        """Keys under ``prefix`` (relative to the store's prefix), in S3's (lexicographic) order."""
        return [k for k, _ in self.listing(prefix)]

    def listing(self, prefix: str, after: str | None = None, before: str | None = None) -> list[tuple[str, float]]:
        """``keys`` with each one's LastModified (Unix time); in the range (after, before) when given
        (botocore lists them all and keeps those: the ranged listing is ``listing_pages``'s)."""
        st, base = self.store, self._base()
        keys = [(k[base:], t) for k, t in st._list_modified(st._key(prefix), f"listing {prefix}")]
        return [(k, t) for k, t in keys if in_key_range(k, after, before)]

    async def listing_pages(self, prefix: str, page_deadline_s: float, after: str | None = None,
                            before: str | None = None) -> AsyncIterator[list[tuple[str, float]]]:
        """``listing`` a page (up to 1,000 keys) at a time, awaited on the event loop (only where
        ``awaitable``): obstore lists and parses in its Rust runtime, at ~1/15 of botocore's CPU for the
        same keys, and a caller that stops (cancelled: a drain) leaves no thread listing on. Each page
        within ``page_deadline_s`` (``StoreDeadline``). A range (after, before) starts the listing just
        below ``after`` (S3's StartAfter; a store that lists by directory, as SeaweedFS does, skips a whole
        directory named exactly so), keeps the keys after it, and stops at ``before``."""
        import obstore

        st, base = self.store, self._base()
        assert st._fast is not None
        offset = None
        if after:  # e.g. .../sb-f -> .../sb-e~: below ``after`` (the keys between are filtered out below)
            offset = st._key(after[:-1] + chr(max(ord(after[-1]) - 1, 0)) + "~")
        stream = obstore.list(st._fast, prefix=st._key(prefix), offset=offset, chunk_size=1000)
        pages = 0
        with self._fast_errors(f"listing {prefix}"):
            while True:
                try:
                    async with asyncio.timeout(page_deadline_s):
                        page = await stream.__anext__()
                except StopAsyncIteration:
                    if not pages:  # (an empty listing is one request; the end of a longer one is none)
                        st._sent(event_name="ListObjectsV2")
                    return
                except TimeoutError:
                    raise StoreDeadline(f"the store did not answer within {page_deadline_s:g} s while listing "
                                        f"{prefix}") from None
                pages += 1
                st._sent(event_name="ListObjectsV2")
                keys = [(m["path"][base:], m["last_modified"].timestamp()) for m in page]
                if after is None and before is None:
                    yield keys
                    continue
                yield [(k, t) for k, t in keys if in_key_range(k, after, before)]
                if before is not None and keys and keys[-1][0] >= before:  # the range ended in this page
                    return

    def delete(self, keys: list[str]) -> None:
        st = self.store
        for i in range(0, len(keys), 1000):
            batch = [{"Key": st._key(k)} for k in keys[i:i + 1000]]
            with st._errors(f"deleting {len(batch)} objects"):
                st._client.delete_objects(Bucket=st.bucket, Delete={"Objects": batch, "Quiet": True})


    def delete_own(self, key: str, body: bytes) -> bool:
        """Delete ``key`` only if it holds ``body``: ``DeleteObject`` with ``If-Match`` on the ETag of
        ``body`` (the MD5 of a single-part put, which is how ``put_new`` writes); where the ETag is not
        the MD5 (SSE-KMS), the object's own ETag once its body is read and found equal. A server that
        answers 501 NotImplemented to a conditional delete gets a read, a compare and a plain delete (a
        writer replacing the object in between loses it). True if deleted; False if it held something
        else or was absent (S3 answers 412 for both; SeaweedFS 4 too)."""
        st = self.store
        full = st._key(key)
        etag = f'"{hashlib.md5(body, usedforsecurity=False).hexdigest()}"'
        with st._errors(f"deleting {key} if it is still ours"):
            for _ in range(2):
                outcome = self._delete_if_match(full, etag)
                if outcome == "unconditional":
                    break
                if outcome != "differs":
                    return outcome == "deleted"
                try:
                    got = st._client.get_object(Bucket=st.bucket, Key=full)
                    data: bytes = got["Body"].read()
                except botocore.exceptions.ClientError as exc:
                    if str(exc.response.get("Error", {}).get("Code")) in _NOT_FOUND:
                        return False
                    raise
                if data != body or got["ETag"] == etag:
                    return False
                etag = got["ETag"]  # ours, under an ETag that is not its MD5: that one
            else:
                return False
            if not self._unconditional_logged:
                self._unconditional_logged = True
                log.warning(f"{st.endpoint} does not implement If-Match on DeleteObject (501): objects this "
                            "replica owns are compared, then deleted without a condition")
            if st._get_bytes(full, f"reading {key}") != body:
                return False
            st._client.delete_object(Bucket=st.bucket, Key=full)
        return True

    def _delete_if_match(self, full: str, etag: str) -> str:
        """One conditional delete: "deleted", "differs" (412: another body, or absent) or
        "unconditional" (the server does not implement the condition)."""
        st = self.store
        try:
            st._client.delete_object(Bucket=st.bucket, Key=full, IfMatch=etag)
        except botocore.exceptions.ClientError as exc:
            code = str(exc.response.get("Error", {}).get("Code", ""))
            status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
            if status == 412 or code == "PreconditionFailed":
                return "differs"
            if status == 501 or code == "NotImplemented":
                return "unconditional"
            if code in _NOT_FOUND:
                return "differs"
            raise
        return "deleted"


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__


def _root_cause(exc: BaseException) -> BaseException:
    """The botocore error behind s3transfer/boto3 wrappers (they chain it or keep it as an attr)."""
    seen = set()
    cur: BaseException = exc
    while id(cur) not in seen:
        seen.add(id(cur))
        nxt = getattr(cur, "last_exception", None) or cur.__cause__ or cur.__context__
        if not isinstance(nxt, BaseException):
            break
        if isinstance(cur, (botocore.exceptions.ClientError, *_UNREACHABLE)):
            break
        cur = nxt
    return cur


def _sha256_file(path: str) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(MiB):
            sha.update(chunk)
    return sha.hexdigest()
