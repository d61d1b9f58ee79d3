"""Helpers for the service tests: a real `rollbox serve` process and CloudEvents built by the SDK; a real
``DurableRuntime`` over a real ``Runtime`` in this process."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from cloudevents.conversion import to_binary, to_structured
from cloudevents.http import CloudEvent, from_http
from prometheus_client.parser import text_string_to_metric_families

SERVE = [sys.executable, "-m", "rollbox.functions.cli", "serve"]


@contextlib.asynccontextmanager
async def durable_runtime(home: Path, objects: Any, name: str, **kw: Any) -> AsyncIterator[Any]:
    """A started ``DurableRuntime`` (``kw``: its settings; a live cap of 8 unless given) over ``objects``,
    on a started ``Runtime`` in ``home`` under a cgroup parent of its own (``name``); both closed after."""
    from rollbox.functions.durable.capacity import LiveCap
    from rollbox.functions.durable.runtime import DurableRuntime
    from rollbox.runtime.runtime import Runtime, RuntimeConfig

    rt = Runtime(RuntimeConfig(state_dir=home, cgroup_parent=f"rollbox-test-{os.getpid()}-{name}"))
    await rt.start()
    d = DurableRuntime(rt, objects, **{"cap": LiveCap(8), **kw})
    await d.start()
    try:
        yield d
    finally:
        await d.close()
        await rt.close()


@dataclass
class ServerProc:
    proc: subprocess.Popen[bytes]
    log_path: Path
    url: str = ""
    port: int = 0
    stopped_rc: int | None = field(default=None)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log_records(self) -> list[dict[str, Any]]:
        out = []
        for line in self.log_path.read_text(errors="replace").splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                out.append({"raw": line})
        return out

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout_s: float = 60.0) -> int:
        """SIGTERM by pid; wait for the exit; SIGKILL (and report -9) if it does not come."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self.stopped_rc = self.proc.returncode
        return self.proc.returncode


def start_server(log_dir: Path, *args: str, env: dict[str, str] | None = None, timeout_s: float = 90.0,
                 **popen: Any) -> ServerProc:
    """``popen``: more Popen arguments (``user=``, ``group=``: a server run as another user)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"serve-{uuid.uuid4().hex[:8]}.log"
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLBOX_") and k not in ("PORT", "HOST")}
    full_env.update(env or {})
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([*SERVE, "--port", "0", *args], stdout=log, stderr=subprocess.STDOUT, env=full_env,
                                **popen)
    srv = ServerProc(proc, log_path)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for rec in srv.log_records():
            if rec.get("msg") == "listening":
                srv.port = int(rec["port"])
                srv.url = f"http://127.0.0.1:{srv.port}/"
                return srv
        if proc.poll() is not None:
            raise RuntimeError(f"rollbox serve exited with {proc.returncode}:\n{log_path.read_text()}")
        time.sleep(0.05)
    srv.stop()
    raise RuntimeError(f"rollbox serve did not start in {timeout_s}s:\n{log_path.read_text()}")


def event(etype: str, data: Any, *, id: str | None = None, source: str = "/tests/functions") -> CloudEvent:
    return CloudEvent(
        {
            "type": etype,
            "source": source,
            "id": id or uuid.uuid4().hex,
            "datacontenttype": "application/json",
        },
        data,
    )


def encode(ev: CloudEvent, mode: str) -> tuple[dict[str, str], bytes]:
    headers, body = to_structured(ev) if mode == "structured" else to_binary(ev)
    return dict(headers), body


@dataclass
class Reply:
    status: int
    headers: httpx.Headers
    event: CloudEvent
    mode: str

    @property
    def type(self) -> str:
        return str(self.event["type"])

    @property
    def data(self) -> Any:
        return self.event.data

    @property
    def subject(self) -> str | None:
        return self.event.get("subject")


def parse(resp: httpx.Response) -> Reply:
    ct = resp.headers.get("content-type", "")
    mode = "structured" if ct.startswith("application/cloudevents+json") else "binary"
    ev = from_http(dict(resp.headers), resp.content)
    assert ev["specversion"] == "1.0"
    assert ev["source"] and ev["id"]
    return Reply(resp.status_code, resp.headers, ev, mode)


async def send(http: httpx.AsyncClient, url: str, ev: CloudEvent, mode: str = "binary") -> Reply:
    headers, body = encode(ev, mode)
    return parse(await http.post(url, headers=headers, content=body))


async def post_raw(http: httpx.AsyncClient, url: str, headers: dict[str, str], body: bytes) -> Reply:
    return parse(await http.post(url, headers=headers, content=body))


def metric(text: str, name: str, **labels: str) -> float:
    """The sum of the samples named ``name`` (``..._total`` for a counter) in Prometheus text whose
    labels include ``labels``; 0 if there are none."""
    return sum(smp.value for fam in text_string_to_metric_families(text) for smp in fam.samples
               if smp.name == name and all(smp.labels.get(k) == v for k, v in labels.items()))


async def metrics_of(http: httpx.AsyncClient, srv: ServerProc) -> str:
    return (await http.get(srv.url + "metrics")).text
