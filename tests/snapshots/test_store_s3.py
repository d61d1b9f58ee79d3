"""The S3 store against a real S3 server (SeaweedFS): push/pull, multipart, integrity, errors."""

from __future__ import annotations

import hashlib
import http.client
import http.server
import os
import socket
import threading
import time
import urllib.parse
from pathlib import Path

import pytest
from rollbox.runtime.errors import IntegrityError, SnapshotNotFound, StoreError, StoreUnavailable
from rollbox.snapshots.cache import LayerCache
from rollbox.snapshots.layers import layer_id
from rollbox.snapshots.resolver import StoreResolver
from rollbox.snapshots.state import LocalObjects, Objects
from rollbox.snapshots.store import copy_snapshot
from rollbox.snapshots.store_local import LocalStore
from rollbox.snapshots.store_s3 import S3Objects, S3Store

from .s3server import S3Factory, SeaweedS3, free_ports, sample_snapshot, store_factory

MiB = 1024 * 1024


def test_push_then_pull_into_an_empty_store_gives_the_same_snapshot(
        tmp_path: Path, s3_url: str, make_s3: S3Factory, seaweed: SeaweedS3) -> None:
    a = LocalStore(tmp_path / "a")
    manifest = sample_snapshot(a, tmp_path, big_bytes=12 * MiB, name="demo")
    s3 = make_s3(s3_url, multipart_threshold_bytes=5 * MiB, multipart_chunk_bytes=5 * MiB)

    pushed = copy_snapshot(a, s3, "demo")
    assert pushed.id == manifest.id
    assert s3.list_ids() == [manifest.id]
    assert s3.names() == {"demo": manifest.id}
    assert s3.stats["layer_uploads"] == 2
    # the big layer went up in parts (an S3 multipart ETag ends in -<parts>)
    big = manifest.layers[1]
    bucket, prefix = s3.bucket, s3.prefix
    etag = seaweed.client().head_object(Bucket=bucket, Key=f"{prefix}/layers/{big.id}.tar")["ETag"]
    assert etag.strip('"').endswith("-3"), etag
    # pushing again uploads nothing
    copy_snapshot(a, s3, "demo")
    assert s3.stats["layer_uploads"] == 2

    b = LocalStore(tmp_path / "b")
    pulled = copy_snapshot(s3, b, "demo")
    assert pulled.id == manifest.id and b.resolve_id("demo") == manifest.id
    for ref in manifest.layers:
        assert layer_id(b.layer_path(ref.id)) == ref.id
        assert tree_equal(a.layer_path(ref.id), b.layer_path(ref.id))
    assert list((b.root / "tmp").iterdir()) == []


def tree_equal(x: Path, y: Path) -> bool:
    from .s3server import tree_files

    return tree_files(x) == tree_files(y)


def test_a_corrupt_or_truncated_object_is_refused_and_the_cache_left_clean(
        tmp_path: Path, s3_url: str, make_s3: S3Factory, seaweed: SeaweedS3) -> None:
    a = LocalStore(tmp_path / "a")
    manifest = sample_snapshot(a, tmp_path, big_bytes=1 * MiB, name="demo")
    s3 = make_s3(s3_url)
    copy_snapshot(a, s3, "demo")
    top = manifest.layers[1]
    key = f"{s3.prefix}/layers/{top.id}.tar"
    client = seaweed.client()
    good = client.get_object(Bucket=s3.bucket, Key=key)["Body"].read()

    cache = LocalStore(tmp_path / "cache")
    resolver = StoreResolver(LayerCache(cache, s3))
    flipped = bytearray(good)
    flipped[len(good) // 2] ^= 0xFF
    for bad, what in ((bytes(flipped), "corrupt"), (good[: len(good) // 3], "truncated")):
        client.put_object(Bucket=s3.bucket, Key=key, Body=bad)
        with pytest.raises(IntegrityError, match=rf"layer {top.id} downloaded from .* is corrupt or trunc"):
            resolver.resolve("demo")
        assert not cache.has_layer(top.id), what
        assert list((cache.root / "tmp").iterdir()) == [], what
        assert not (cache.root / "layers-meta" / f"{top.id}.json").exists()

    client.put_object(Bucket=s3.bucket, Key=key, Body=good)
    view = resolver.resolve("demo")
    assert view.id == manifest.id
    assert (Path(view.layer_root) / top.id / "data" / "tag").read_text() == "a"


def test_a_corrupt_manifest_is_refused(tmp_path: Path, s3_url: str, make_s3: S3Factory,
                                       seaweed: SeaweedS3) -> None:
    a = LocalStore(tmp_path / "a")
    manifest = sample_snapshot(a, tmp_path, name="demo")
    s3 = make_s3(s3_url)
    copy_snapshot(a, s3, "demo")
    key = f"{s3.prefix}/manifests/{manifest.id}.json"
    data = manifest.canonical_json().replace(b'"TAG":"a"', b'"TAG":"b"')
    seaweed.client().put_object(Bucket=s3.bucket, Key=key, Body=data)
    with pytest.raises(IntegrityError, match=f"manifest of snapshot {manifest.id} is corrupt"):
        s3.get_manifest(manifest.id)
    with pytest.raises(IntegrityError):
        StoreResolver(LayerCache(LocalStore(tmp_path / "c"), s3)).resolve("demo")


def test_errors_say_what_to_fix(tmp_path: Path, s3_url: str, make_s3: S3Factory, seaweed: SeaweedS3) -> None:
    s3 = make_s3(s3_url)
    with pytest.raises(SnapshotNotFound, match="no snapshot named 'nope'"):
        s3.resolve_id("nope")
    with pytest.raises(StoreError, match=r"does not exist.*create the bucket"):
        make_s3("s3://rb-no-such-bucket/x").list_ids()
    wrong = S3Store(s3_url, endpoint_url=seaweed.endpoint, access_key_id="nobody",
                    secret_access_key="wrong", max_attempts=1)
    with pytest.raises(StoreError, match=r"refused access.*check the credentials"):
        wrong.list_ids()
    with pytest.raises(StoreError, match="invalid S3 store URL"):
        make_s3("http://bucket/x")
    # a layer whose tar does not hash to its id is never uploaded
    tar = tmp_path / "x.tar"
    tar.write_bytes(b"not a layer")
    with pytest.raises(IntegrityError, match="refusing to upload"):
        s3.put_layer("0" * 64, str(tar))


@pytest.mark.slow
def test_an_outage_fails_clearly_and_the_next_call_after_restart_succeeds(tmp_path: Path) -> None:
    server = SeaweedS3(tmp_path / "s3")
    server.start()
    try:
        url = f"s3://{server.new_bucket()}/snapshots"
        s3 = store_factory(server)(url, max_attempts=2)
        a = LocalStore(tmp_path / "a")
        first = sample_snapshot(a, tmp_path, tag="a", name="first")
        second = sample_snapshot(a, tmp_path, tag="b", name="second")
        copy_snapshot(a, s3, "first")
        copy_snapshot(a, s3, "second")
        cache = LocalStore(tmp_path / "cache")
        resolver = StoreResolver(LayerCache(cache, s3))
        assert resolver.resolve("first").id == first.id

        server.stop()
        # a snapshot already in the cache still resolves (by id, and by its cached name)
        assert resolver.resolve(first.id).id == first.id
        assert resolver.resolve("first").id == first.id
        # one that is not fails clearly, and leaves the cache as it was
        from rollbox.runtime.errors import StoreUnavailable

        with pytest.raises(StoreUnavailable, match=r"S3 http://127\.0\.0\.1:\d+ .* is unreachable"):
            resolver.resolve("second")
        with pytest.raises(StoreUnavailable, match="unreachable while downloading layer"):
            LayerCache(cache, s3).ensure([second.layers[1].id])
        with pytest.raises(StoreUnavailable):
            copy_snapshot(a, s3, "second")
        assert not cache.has_layer(second.layers[1].id)
        assert list((cache.root / "tmp").iterdir()) == []

        server.start()
        assert resolver.resolve("second").id == second.id
        assert cache.has_layer(second.layers[1].id)
    finally:
        server.stop()
    assert os.path.isdir(tmp_path / "s3" / "data")


def test_a_layer_modified_on_disk_is_not_pushed(tmp_path: Path, s3_url: str, make_s3: S3Factory) -> None:
    a = LocalStore(tmp_path / "a")
    manifest = sample_snapshot(a, tmp_path, name="demo")
    (a.layer_path(manifest.layers[1].id) / "data" / "tag").write_text("tampered")
    s3 = make_s3(s3_url)
    with pytest.raises(IntegrityError, match="was modified on disk"):
        copy_snapshot(a, s3, "demo")
    assert not s3.has_layer(manifest.layers[1].id) and s3.list_ids() == []


def test_durable_state_reads_and_create_only_writes_go_through_obstore(s3_url: str, make_s3: S3Factory,
                                                                       seaweed: SeaweedS3) -> None:
    """A record's GET and its create-only PUT (the durable step's hot calls) go through obstore, not
    botocore, with the same answers: None for a missing key, False when another writer was first, True
    for a retried write whose first try landed; and its errors converted as botocore's are."""
    s3 = make_s3(s3_url)
    objects = S3Objects(s3)

    def refuse(event_name: str = "", **_: object) -> None:
        raise AssertionError(f"botocore sent {event_name}")

    s3._client.meta.events.register("before-send.s3", refuse)
    key = "sandboxes/sb-1/000000000000.json"
    assert objects.get(key) is None
    assert objects.put_new(key, b"first") is True
    assert objects.put_new(key, b"second") is False  # taken: the other writer's bytes stay
    assert objects.put_new(key, b"first") is True  # the same bytes: a retry whose first try landed
    assert objects.get(key) == b"first"
    assert s3.requests_sent() == {"GetObject": 4, "PutObject": 3}
    s3._client.meta.events.unregister("before-send.s3", refuse)
    assert make_s3(s3_url)._client.get_object(Bucket=s3.bucket, Key=s3._key(key))["Body"].read() == b"first"

    wrong = S3Objects(S3Store(s3_url, endpoint_url=seaweed.endpoint, access_key_id="nobody",
                              secret_access_key="wrong", max_attempts=1))
    with pytest.raises(StoreError, match=r"refused access.*check the credentials"):
        wrong.get(key)
    with pytest.raises(StoreError, match=r"refused access.*check the credentials"):
        wrong.put_new("sandboxes/sb-2/000000000000.json", b"x")
    (port,) = free_ports(1)
    gone = S3Objects(S3Store(s3_url, endpoint_url=f"http://127.0.0.1:{port}", access_key_id="a",
                             secret_access_key="b", max_attempts=1))
    with pytest.raises(StoreUnavailable, match=r"unreachable or failing while reading"):
        gone.get(key)


async def test_durable_state_reads_and_commits_are_awaited_without_a_thread(s3_url: str, make_s3: S3Factory,
                                                                          seaweed: SeaweedS3) -> None:
    """The awaited forms of the hot calls (obstore's async API, on the event loop) answer as the
    threaded ones do, errors included; ``StateStore`` commits and reads a record on S3 with them, its
    store threads never started, and still gives a hung store's call its deadline (``StoreDeadline``)."""
    from rollbox.functions.durable.store import StateStore
    from rollbox.snapshots.calls import StoreDeadline
    from rollbox.snapshots.state import record_key

    s3 = make_s3(s3_url)
    objects = S3Objects(s3)
    assert objects.awaitable
    key = "sandboxes/sb-a/000000000000.json"
    assert await objects.get_async(key) is None
    assert await objects.put_new_async(key, b"first") is True
    assert await objects.put_new_async(key, b"second") is False
    assert await objects.put_new_async(key, b"first") is True
    assert await objects.get_async(key) == b"first" == objects.get(key)
    assert s3.requests_sent() == {"GetObject": 5, "PutObject": 3}
    wrong = S3Objects(S3Store(s3_url, endpoint_url=seaweed.endpoint, access_key_id="nobody",
                              secret_access_key="wrong", max_attempts=1))
    with pytest.raises(StoreError, match=r"refused access.*check the credentials"):
        await wrong.put_new_async("sandboxes/sb-b/000000000000.json", b"x")
    (port,) = free_ports(1)
    gone = S3Objects(S3Store(s3_url, endpoint_url=f"http://127.0.0.1:{port}", access_key_id="a",
                             secret_access_key="b", max_attempts=1))
    with pytest.raises(StoreUnavailable, match=r"unreachable or failing while reading"):
        await gone.get_async(key)

    store = StateStore(objects)
    record = b'{"not": "checked by the write"}'
    assert await store.put_record(record_key("sb-c", 0), record) is True
    assert await store.put_record(record_key("sb-c", 0), b"other") is False
    assert await store.read("sb-d", 0) is None
    assert store.calls._pool._threads == set()  # no call went through a store thread
    # a store that takes connections and never answers: the call ends at the store's deadline
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    try:
        hung = StateStore(S3Objects(S3Store(s3_url, endpoint_url=f"http://127.0.0.1:{listener.getsockname()[1]}",
                                            access_key_id="a", secret_access_key="b", max_attempts=1)))
        hung.calls.deadline_s = 0.5
        t0 = time.monotonic()
        with pytest.raises(StoreDeadline, match=r"within 0.5 s while committing"):
            await hung.put_record(record_key("sb-e", 0), record)
        with pytest.raises(StoreDeadline, match=r"within 0.5 s while reading"):
            await hung.read("sb-e", 0)
        assert time.monotonic() - t0 < 5
    finally:
        listener.close()


def test_durable_state_calls_use_the_endpoint_botocore_found_in_the_environment(
        s3_url: str, seaweed: SeaweedS3, monkeypatch: pytest.MonkeyPatch) -> None:
    """An endpoint given to botocore by its environment (AWS_ENDPOINT_URL, a config file) rather than
    as an argument is the obstore client's too: plain HTTP allowed for an http:// one, paths not hosts."""
    from .s3server import ACCESS_KEY, SECRET_KEY

    for k, v in {"AWS_ENDPOINT_URL": seaweed.endpoint, "AWS_ACCESS_KEY_ID": ACCESS_KEY,
                 "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_REGION": "us-east-1"}.items():
        monkeypatch.setenv(k, v)
    s3 = S3Store(s3_url, max_attempts=1)
    assert s3.endpoint == seaweed.endpoint and s3._fast is not None
    objects = S3Objects(s3)
    assert objects.put_new("sandboxes/sb-env/000000000000.json", b"env") is True
    assert objects.get("sandboxes/sb-env/000000000000.json") == b"env"


# ----------------------------------------------------------------------- objects released only by their owner


def _take_over(objects: Objects, key: str, body: bytes) -> None:
    """What a replica taking over a stale claim does: the old one deleted, its own created."""
    objects.delete([key])
    assert objects.put_new(key, body)


@pytest.mark.parametrize("where", ["local", "s3"])
def test_delete_own_removes_an_object_only_while_it_holds_what_this_writer_put(
        where: str, tmp_path: Path, s3_url: str, make_s3: S3Factory) -> None:
    """A claim taken over by another owner survives its first owner's release; the owner's own release
    removes it; an absent key is nobody's."""
    objects: Objects = LocalObjects(tmp_path / "objects") if where == "local" else S3Objects(make_s3(s3_url))
    key = "language-builds/lua.claim"
    first, second = b'{"replica": "a:1"}', b'{"replica": "b:2"}'
    assert objects.put_new(key, first)
    _take_over(objects, key, second)
    assert objects.delete_own(key, first) is False
    assert objects.get(key) == second
    assert objects.delete_own(key, second) is True
    assert objects.get(key) is None and objects.keys("language-builds/") == []
    assert objects.delete_own(key, second) is False


def test_seaweedfs_honours_if_match_on_delete_and_an_etag_that_is_not_the_md5_still_releases(
        s3_url: str, make_s3: S3Factory, seaweed: SeaweedS3) -> None:
    """The condition delete_own relies on, asked of the real server: DeleteObject with an If-Match that
    does not match is refused (412) and the object stays. An object whose ETag is not the MD5 of its
    body (a multipart upload's, as SSE-KMS gives too) is still released by its owner, by its own ETag."""
    import botocore.exceptions

    s3 = make_s3(s3_url)
    objects = S3Objects(s3)
    key = "language-builds/bash.claim"
    assert objects.put_new(key, b"theirs")
    with pytest.raises(botocore.exceptions.ClientError) as refused:
        s3._client.delete_object(Bucket=s3.bucket, Key=s3._key(key), IfMatch='"0123456789abcdef0123456789abcdef"')
    assert refused.value.response["ResponseMetadata"]["HTTPStatusCode"] == 412
    assert objects.get(key) == b"theirs"
    sent = s3.requests_sent().get("DeleteObject", 0)
    assert objects.delete_own(key, b"theirs") is True and objects.get(key) is None
    assert s3.requests_sent()["DeleteObject"] == sent + 1  # one conditional delete, nothing read first

    body = b"mine, in one part of a multipart upload"
    up = s3._client.create_multipart_upload(Bucket=s3.bucket, Key=s3._key(key))
    part = s3._client.upload_part(Bucket=s3.bucket, Key=s3._key(key), UploadId=up["UploadId"], PartNumber=1, Body=body)
    done = s3._client.complete_multipart_upload(Bucket=s3.bucket, Key=s3._key(key), UploadId=up["UploadId"],
                                                MultipartUpload={"Parts": [{"ETag": part["ETag"], "PartNumber": 1}]})
    assert done["ETag"].strip('"') != hashlib.md5(body, usedforsecurity=False).hexdigest()
    assert objects.delete_own(key, b"not mine") is False and objects.get(key) == body
    assert objects.delete_own(key, body) is True and objects.get(key) is None


class _NoConditionalDelete(http.server.BaseHTTPRequestHandler):
    """An S3 endpoint that does not implement If-Match on DeleteObject (older S3-compatible servers): a
    proxy to SeaweedFS answering 501 NotImplemented to such a delete, passing everything else through."""

    protocol_version = "HTTP/1.1"
    upstream = ""
    refused: list[str] = []

    def log_message(self, *args: object) -> None:
        pass

    def _relay(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.command == "DELETE" and "If-Match" in self.headers:
            type(self).refused.append(self.path)
            self._answer(501, {"Content-Type": "application/xml"},
                         b"<Error><Code>NotImplemented</Code><Message>A header you provided implies "
                         b"functionality that is not implemented</Message></Error>")
            return
        conn = http.client.HTTPConnection(urllib.parse.urlsplit(self.upstream).netloc, timeout=10)
        try:
            conn.request(self.command, self.path, body=body or None, headers=dict(self.headers.items()))
            resp = conn.getresponse()
            data = resp.read()
            headers = {k: v for k, v in resp.getheaders() if k.lower() not in ("transfer-encoding", "connection")}
            self._answer(resp.status, headers, data)
        finally:
            conn.close()

    def _answer(self, status: int, headers: dict[str, str], data: bytes) -> None:
        self.send_response(status)
        for k, v in headers.items():
            if k.lower() != "content-length":
                self.send_header(k, v)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _relay


def test_a_server_without_conditional_deletes_gets_a_read_a_compare_and_a_plain_delete(
        s3_url: str, seaweed: SeaweedS3, caplog: pytest.LogCaptureFixture) -> None:
    from .s3server import ACCESS_KEY, SECRET_KEY

    handler = type("Handler", (_NoConditionalDelete,), {"upstream": seaweed.endpoint, "refused": []})
    proxy = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    serving = threading.Thread(target=proxy.serve_forever, daemon=True)
    serving.start()
    try:
        objects = S3Objects(S3Store(s3_url, endpoint_url=f"http://127.0.0.1:{proxy.server_address[1]}",
                                    access_key_id=ACCESS_KEY, secret_access_key=SECRET_KEY, max_attempts=2))
        key = "language-builds/go.claim"
        assert objects.put_new(key, b"first")
        _take_over(objects, key, b"second")
        assert objects.delete_own(key, b"first") is False and objects.get(key) == b"second"
        assert objects.delete_own(key, b"second") is True and objects.get(key) is None
        assert len(handler.refused) == 2  # each asked with If-Match once (501 is not retried)
        assert sum("does not implement If-Match on DeleteObject" in r.message for r in caplog.records) == 1
    finally:
        proxy.shutdown()
        proxy.server_close()
        serving.join(5)


@pytest.mark.parametrize("where", ["local", "s3"])
def test_create_name_names_only_what_nobody_named(where: str, tmp_path: Path, s3_url: str,
                                                  make_s3: S3Factory) -> None:
    store = LocalStore(tmp_path / "store") if where == "local" else make_s3(s3_url)
    first, second = "1" * 64, "2" * 64
    assert store.create_name("lua", first) == first
    assert store.create_name("lua", second) == first and store.resolve_id("lua") == first
    store.set_name("lua", second)  # (set_name still re-points it)
    assert store.create_name("lua", first) == second
    with pytest.raises(StoreError):
        store.create_name("../x", first)
