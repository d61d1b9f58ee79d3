"""functions/knative.py pre-warming against a FAKE Kubernetes API server: a real http.server on
127.0.0.1 in a thread that answers the one PATCH endpoint of a Knative Service and records what it
got. It is a fake because no Kubernetes API server can run here; the kubernetes client is real."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import kubernetes.client
import pytest
from rollbox.functions.knative import KnativeError, prewarm, release
from rollbox.runtime.errors import InvalidRequest, RollboxError

PATH = "/apis/serving.knative.dev/v1/namespaces/rl/services/rollbox"


@dataclass
class FakeApi:
    status: int = 200
    requests: list[tuple[str, str, str, Any]] = field(default_factory=list)  # method, path, content-type, body


@pytest.fixture
def fake() -> Iterator[tuple[FakeApi, kubernetes.client.ApiClient]]:
    state = FakeApi()

    class Handler(BaseHTTPRequestHandler):
        def do_PATCH(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            state.requests.append(("PATCH", self.path, self.headers["Content-Type"], body))
            status = state.status if self.path == PATH else 404
            reply = body if status == 200 else {"kind": "Status", "code": status, "message": "fake"}
            data = json.dumps(reply).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    cfg = kubernetes.client.Configuration(host=f"http://127.0.0.1:{server.server_address[1]}")
    cfg.retries = 0
    api_client = kubernetes.client.ApiClient(cfg)
    try:
        yield state, api_client
    finally:
        api_client.close()
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def patch(min_scale: str) -> dict[str, Any]:
    return {"spec": {"template": {"metadata": {"annotations": {"autoscaling.knative.dev/min-scale": min_scale}}}}}


def test_prewarm_then_release_send_the_exact_merge_patches(fake: tuple[FakeApi, Any]) -> None:
    state, api_client = fake
    prewarm("rl", "rollbox", 12, api_client=api_client)
    release("rl", "rollbox", api_client=api_client)
    assert state.requests == [
        ("PATCH", PATH, "application/merge-patch+json", patch("12")),
        ("PATCH", PATH, "application/merge-patch+json", patch("0")),
    ]


@pytest.mark.parametrize(("status", "hint"), [(404, "no such Service"), (500, "refused the patch"), (403, "patch")])
def test_api_errors_become_knative_errors(fake: tuple[FakeApi, Any], status: int, hint: str) -> None:
    state, api_client = fake
    state.status = status
    with pytest.raises(KnativeError, match=hint) as info:
        prewarm("rl", "rollbox", 3, api_client=api_client)
    err = info.value
    assert isinstance(err, RollboxError) and isinstance(err.__cause__, kubernetes.client.ApiException)
    assert (err.status, err.namespace, err.service) == (status, "rl", "rollbox")
    assert f"HTTP {status}" in err.message and "rl/rollbox" in err.message


def test_unknown_service_is_a_404_knative_error(fake: tuple[FakeApi, Any]) -> None:
    state, api_client = fake
    with pytest.raises(KnativeError, match="no such Service") as info:
        release("rl", "nope", api_client=api_client)
    assert info.value.status == 404 and state.requests[0][1].endswith("/services/nope")


def test_unreachable_api_server_is_a_knative_error() -> None:
    cfg = kubernetes.client.Configuration(host="http://127.0.0.1:1")
    cfg.retries = 0
    unreachable = kubernetes.client.ApiClient(cfg)
    try:
        with pytest.raises(KnativeError, match="cannot reach") as info:
            prewarm("rl", "rollbox", 1, api_client=unreachable)
    finally:
        unreachable.close()
    assert info.value.status is None


@pytest.mark.parametrize("bad", [-1, True, 1.5])
def test_bad_min_scale_is_refused_before_any_request(fake: tuple[FakeApi, Any], bad: Any) -> None:
    state, api_client = fake
    with pytest.raises(InvalidRequest, match="min_scale"):
        prewarm("rl", "rollbox", bad, api_client=api_client)
    assert state.requests == []
