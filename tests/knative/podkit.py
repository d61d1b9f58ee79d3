"""The image of `rollbox serve` (scripts/image) run as knative/base/service.yaml runs it, under podman:
what the pod tests and loadtest/bench_coldstart.py share.

``image()`` builds the oci-archive when it is missing or older than the sources it is made of, and
loads it into podman. ``Pod`` runs it with exactly the container spec of the manifest, read from the
YAML: its capabilities (drop ALL, add the listed ones; no --privileged), runAsUser, its env (values
given inline; the ConfigMap's are passed by the caller), its args; with runc (crun refuses this
host's hybrid cgroups) and on the host's network, so it reaches a SeaweedFS on 127.0.0.1.
"""

from __future__ import annotations

import fcntl
import json
import os
import resource
import shutil
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tests.snapshots.s3server import free_ports

REPO = Path(__file__).resolve().parents[2]
SERVICE = REPO / "knative" / "base" / "service.yaml"
SOURCES = ("functions", "runtime", "snapshots", "knative/image", "scripts/image", "pyproject.toml")
TOOLS = ("podman", "buildah", "mmdebstrap", "runc")


def missing_tools() -> list[str]:
    return [t for t in TOOLS if shutil.which(t) is None and not Path(f"/usr/sbin/{t}").exists()]


def base_image() -> str:
    """The pod tests' image (``image()``), or a skip when not root; the tools it needs asserted present."""
    import pytest

    if os.geteuid() != 0:
        pytest.skip("the pod tests need root (rootful podman with runc, as CI runs them)")
    missing = missing_tools()
    assert not missing, f"{', '.join(missing)} missing: scripts/bootstrap installs them when run as root"
    return image()


def version() -> str:
    import tomllib

    with open(REPO / "pyproject.toml", "rb") as f:
        return str(tomllib.load(f)["project"]["version"])


def _newest_source() -> float:
    newest = 0.0
    for name in SOURCES:
        p = REPO / name
        paths = [p] if p.is_file() else [q for q in p.rglob("*") if q.is_file() and "__pycache__" not in q.parts]
        newest = max([newest, *(q.stat().st_mtime for q in paths)])
    return newest


def image(*, layers: bool = True) -> str:
    """The image's tag in podman, built (scripts/image) and loaded when needed: by one process at a time
    (the suite's workers ask for it at once; the others wait, then find it built and loaded)."""
    suffix = "" if layers else "-nolayers"
    archive = REPO / "dist" / f"rollbox-{version()}{suffix}.oci.tar"
    tag = f"localhost/rollbox:{version()}{suffix}"
    archive.parent.mkdir(exist_ok=True)
    lock = os.open(archive.parent / f".image{suffix}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not archive.exists() or archive.stat().st_mtime < _newest_source():
            cmd = [str(REPO / "scripts" / "image"), "--out", str(archive)] + ([] if layers else ["--no-layers"])
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
            if done.returncode != 0:
                raise RuntimeError(f"scripts/image failed ({done.returncode}):\n{done.stderr[-4000:]}")
        loaded = subprocess.run(["podman", "image", "exists", tag], capture_output=True)
        stamp = f"{archive.stat().st_mtime_ns}"
        marker = REPO / "dist" / f".loaded{suffix}"
        if loaded.returncode != 0 or not marker.exists() or marker.read_text() != stamp:
            subprocess.run(["podman", "rmi", "-f", tag], capture_output=True)
            subprocess.run(["podman", "load", "-q", "-i", str(archive)], check=True, capture_output=True, timeout=600)
            marker.write_text(stamp)
    finally:
        os.close(lock)  # (releases the lock)
    return tag


def container_spec() -> dict[str, Any]:
    """The rollbox container of the manifest's pod template."""
    svc = yaml.safe_load(SERVICE.read_text())
    spec: dict[str, Any] = svc["spec"]["template"]["spec"]["containers"][0]
    return spec



def podman_args(spec: dict[str, Any]) -> list[str]:
    """The manifest's securityContext as podman flags: exactly its capabilities and user."""
    sc = spec.get("securityContext") or {}
    caps = sc.get("capabilities") or {}
    args = ["--cap-drop", "ALL"] if "ALL" in (caps.get("drop") or []) else []
    for cap in caps.get("add") or []:
        args += ["--cap-add", cap]
    if "runAsUser" in sc:
        args += ["--user", str(sc["runAsUser"])]
    if sc.get("allowPrivilegeEscalation") is False:
        args += ["--security-opt", "no-new-privileges"]
    assert not sc.get("privileged"), "the manifest must not ask for a privileged container"
    return args


def _limits() -> list[str]:
    # runc sets the container's rlimits without CAP_SYS_RESOURCE, so they may not exceed what its
    # parent has: below this process's hard limits (podman's defaults, 1048576 and 4194304, are above
    # this host's and the container fails to start; 49152 processes did too, 32768 started)
    nofile = min(16384, resource.getrlimit(resource.RLIMIT_NOFILE)[1])
    nproc = min(32768, resource.getrlimit(resource.RLIMIT_NPROC)[1])
    return ["--ulimit", f"nofile={nofile}:{nofile}", "--ulimit", f"nproc={nproc}:{nproc}"]


@dataclass
class Pod:
    tag: str
    env: dict[str, str] = field(default_factory=dict)
    args: list[str] | None = None  # default: the manifest's
    entrypoint: list[str] | None = None  # default: the manifest's command, else the image's
    name: str = field(default_factory=lambda: f"rollbox-test-{uuid.uuid4().hex[:8]}")
    port: int = field(default_factory=lambda: free_ports(1)[0])
    started_at: float = 0.0  # time.monotonic() when `podman run` was started

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/"

    def command(self, *, detach: bool = True) -> list[str]:
        spec = container_spec()
        env = {e["name"]: e["value"] for e in spec.get("env") or [] if "value" in e}
        env.update(self.env)
        env["PORT"] = str(self.port)  # Knative sets PORT from containerPort; the host network needs its own
        cmd = ["podman", "run", "-d" if detach else "--rm", "--name", self.name, "--runtime", "runc", "--network", "host",
               *podman_args(spec), *_limits()]
        for k, v in env.items():
            cmd += ["--env", f"{k}={v}"]
        if self.entrypoint or spec.get("command"):
            cmd += ["--entrypoint", json.dumps(self.entrypoint or spec["command"])]
        return [*cmd, self.tag, *(self.args if self.args is not None else spec.get("args") or [])]

    def start(self) -> Pod:
        self.started_at = time.monotonic()
        subprocess.run(self.command(), check=True, capture_output=True, text=True, timeout=120)
        return self

    def run_once(self, timeout_s: float = 600.0) -> subprocess.CompletedProcess[str]:
        """Run the container in the foreground (a one-off command such as `doctor`) and remove it."""
        return subprocess.run(self.command(detach=False), capture_output=True, text=True, timeout=timeout_s)

    def wait_ready(self, timeout_s: float = 60.0) -> float:
        """Seconds from `podman run` until /readyz answers 200."""
        import httpx

        deadline = time.monotonic() + timeout_s
        checked = time.monotonic()
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "readyz", timeout=1.0).status_code == 200:
                    return time.monotonic() - self.started_at
            except httpx.HTTPError:
                pass
            # `podman inspect` costs ~80 ms of CPU: asked every poll it would take a core from the
            # container it is timing, so once a second
            if time.monotonic() - checked >= 1.0:
                checked = time.monotonic()
                if not self.running():
                    raise RuntimeError(f"the container exited:\n{self.logs()[-4000:]}")
            time.sleep(0.02)
        raise RuntimeError(f"not ready in {timeout_s} s:\n{self.logs()[-4000:]}")

    def running(self) -> bool:
        out = subprocess.run(["podman", "inspect", "--format", "{{.State.Running}}", self.name],
                             capture_output=True, text=True)
        return out.stdout.strip() == "true"

    def exit_code(self) -> int:
        out = subprocess.run(["podman", "inspect", "--format", "{{.State.ExitCode}}", self.name],
                             capture_output=True, text=True, check=True)
        return int(out.stdout.strip())

    def logs(self) -> str:
        out = subprocess.run(["podman", "logs", self.name], capture_output=True, text=True)
        return out.stdout + out.stderr

    def stop(self, timeout_s: int = 60) -> float:
        """SIGTERM (what Kubernetes sends), SIGKILL after ``timeout_s``; returns the seconds it took."""
        t0 = time.monotonic()
        subprocess.run(["podman", "stop", "--time", str(timeout_s), self.name], capture_output=True,
                       timeout=timeout_s + 60)
        return time.monotonic() - t0

    def remove(self) -> None:
        subprocess.run(["podman", "rm", "-f", "--time", "0", self.name], capture_output=True, timeout=120)


def s3_env(endpoint: str, bucket: str, access_key: str, secret_key: str) -> dict[str, str]:
    """The s3 overlay's ConfigMap and Secret, pointed at a SeaweedFS on the host."""
    return {"ROLLBOX_STORE": f"s3://{bucket}/rollbox", "AWS_ENDPOINT_URL": endpoint, "AWS_REGION": "us-east-1",
            "AWS_ACCESS_KEY_ID": access_key, "AWS_SECRET_ACCESS_KEY": secret_key, "ROLLBOX_S3_MAX_ATTEMPTS": "5"}


def can_run() -> str | None:
    """Why the pod tests cannot run here, or None."""
    if os.geteuid() != 0:
        return "needs root (rootful podman with runc, as CI runs it)"
    if missing := missing_tools():
        return f"needs {', '.join(missing)}: scripts/bootstrap installs them as root"
    return None
