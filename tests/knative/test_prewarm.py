"""functions/cli/knative.py pre-warming against a FAKE Kubernetes API server: a real http.server on
127.0.0.1 in a thread that answers a Knative Service's PATCH and GET and its Revision's GET, and
records what it got. It is a fake because no Kubernetes API server can run here; the kubernetes
client is real, and so is the `rollbox knative` command, pointed at the fake through a kubeconfig."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import kubernetes.client
import pytest
from rollbox.functions.cli.knative import KnativeError, KubernetesNotConfigured, prewarm, release, scale, wait_ready
from rollbox.runtime.errors import InvalidRequest, RollboxError

PATH = "/apis/serving.knative.dev/v1/namespaces/rl/services/rollbox"
REVISIONS = "/apis/serving.knative.dev/v1/namespaces/rl/revisions/"


@dataclass
class FakeApi:
    status: int = 200
    requests: list[tuple[str, str, str, Any]] = field(default_factory=list)  # method, path, content-type, body
    min_scale: str = "0"
    # what the Revision reports on each successive GET (the last one repeats): (ready, actualReplicas)
    replicas: list[tuple[bool, int]] = field(default_factory=lambda: [(True, 0)])
    port: int = 0

    def service(self) -> dict[str, Any]:
        ready, _ = self.replicas[0]
        return {"apiVersion": "serving.knative.dev/v1", "kind": "Service", "metadata": {"name": "rollbox"},
                "spec": {"template": {"metadata": {"annotations": {
                    "autoscaling.knative.dev/min-scale": self.min_scale}}}},
                "status": {"latestCreatedRevisionName": "rollbox-00002",
                           "latestReadyRevisionName": "rollbox-00002" if ready else "rollbox-00001"}}

    def revision(self) -> dict[str, Any]:
        _, actual = self.replicas.pop(0) if len(self.replicas) > 1 else self.replicas[0]
        return {"kind": "Revision", "metadata": {"name": "rollbox-00002"},
                "status": {"actualReplicas": actual, "desiredReplicas": int(self.min_scale)}}


@pytest.fixture
def fake() -> Iterator[tuple[FakeApi, kubernetes.client.ApiClient]]:
    state = FakeApi()

    class Handler(BaseHTTPRequestHandler):
        def do_PATCH(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            state.requests.append(("PATCH", self.path, self.headers["Content-Type"], body))
            status = state.status if self.path == PATH else 404
            if status == 200:
                state.min_scale = body["spec"]["template"]["metadata"]["annotations"][
                    "autoscaling.knative.dev/min-scale"]
            self.reply(status, body)

        def do_GET(self) -> None:
            state.requests.append(("GET", self.path, "", None))
            if state.status != 200:
                self.reply(state.status, None)
            elif self.path == PATH:
                self.reply(200, state.service())
            elif self.path == REVISIONS + "rollbox-00002":
                self.reply(200, state.revision())
            else:
                self.reply(404, None)

        def reply(self, status: int, body: Any) -> None:
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
    state.port = server.server_address[1]
    cfg = kubernetes.client.Configuration(host=f"http://127.0.0.1:{state.port}")
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


@pytest.mark.parametrize(("status", "hint"), [(404, "no such Service"), (500, "refused the request"), (403, "patch")])
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


def test_scale_reads_min_scale_and_the_newest_revisions_replicas(fake: tuple[FakeApi, Any]) -> None:
    state, api_client = fake
    state.replicas = [(True, 3)]
    prewarm("rl", "rollbox", 3, api_client=api_client)
    now = scale("rl", "rollbox", api_client=api_client)
    assert (now.min_scale, now.revision, now.ready, now.actual, now.desired) == (3, "rollbox-00002", True, 3, 3)


def test_wait_ready_polls_until_the_replicas_run_and_times_out_naming_what_it_saw(fake: tuple[FakeApi, Any]) -> None:
    state, api_client = fake
    state.replicas = [(False, 0), (True, 1), (True, 4)]
    slept: list[float] = []
    now = wait_ready("rl", "rollbox", 4, timeout_s=60, poll_s=0.5, api_client=api_client, sleep=slept.append)
    assert now.actual == 4 and len(slept) == 2
    state.replicas = [(True, 1)]
    with pytest.raises(KnativeError, match=r"1 of 4 replicas ready after 0\.2 s"):
        wait_ready("rl", "rollbox", 4, timeout_s=0.2, poll_s=0.05, api_client=api_client)


def _kubeconfig(tmp_path: Any, port: int, namespace: str | None) -> str:
    context: dict[str, Any] = {"cluster": "fake", "user": "me"}
    if namespace:
        context["namespace"] = namespace
    path = tmp_path / "kubeconfig"
    path.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "fake",
        "clusters": [{"name": "fake", "cluster": {"server": f"http://127.0.0.1:{port}"}}],
        "contexts": [{"name": "fake", "context": context}],
        "users": [{"name": "me", "user": {"token": "t"}}],
    }))
    return str(path)


def _rollbox(kubeconfig: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {"KUBECONFIG": kubeconfig, "PATH": "/usr/bin:/bin", "HOME": "/nonexistent"}
    return subprocess.run([sys.executable, "-m", "rollbox.functions.cli", "knative", *args], env=env,
                          capture_output=True, text=True, timeout=60)


def test_the_knative_command_prewarms_waits_reports_and_releases(fake: tuple[FakeApi, Any], tmp_path: Any) -> None:
    state, _ = fake
    kubeconfig = _kubeconfig(tmp_path, state.port, "rl")  # the namespace comes from the kubeconfig context
    state.replicas = [(False, 0), (True, 2)]
    done = _rollbox(kubeconfig, "prewarm", "--replicas", "2", "--wait-s", "30")
    assert done.returncode == 0, done.stderr
    assert "rl/rollbox: min-scale 2" in done.stdout and "2 replicas ready (revision rollbox-00002)" in done.stdout
    assert ("PATCH", PATH, "application/merge-patch+json", patch("2")) in state.requests
    done = _rollbox(kubeconfig, "status", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"namespace": "rl", "service": "rollbox", "min_scale": 2,
                                       "revision": "rollbox-00002", "ready": True, "actual": 2, "desired": 2}
    done = _rollbox(kubeconfig, "release")
    assert done.returncode == 0 and state.min_scale == "0", done.stderr


def test_the_knative_command_names_what_failed(fake: tuple[FakeApi, Any], tmp_path: Any) -> None:
    state, _ = fake
    kubeconfig = _kubeconfig(tmp_path, state.port, None)
    done = _rollbox(kubeconfig, "release", "--namespace", "rl", "--service", "nope")
    assert done.returncode == 1 and "rl/nope failed: HTTP 404" in done.stderr and "no such Service" in done.stderr
    done = _rollbox(kubeconfig, "status")  # no namespace anywhere: "default"
    assert done.returncode == 1 and "default/rollbox" in done.stderr
    done = _rollbox(kubeconfig, "prewarm", "--namespace", "rl", "--replicas", "-1")
    assert done.returncode == 2 and "min_scale must be an integer >= 0" in done.stderr
    state.replicas = [(True, 0)]
    done = _rollbox(kubeconfig, "prewarm", "--namespace", "rl", "--replicas", "3", "--wait-s", "0.3")
    assert done.returncode == 1 and "0 of 3 replicas ready" in done.stderr


def test_without_the_kubernetes_client_the_command_says_what_to_install(tmp_path: Any) -> None:
    blocked = ("import sys; sys.modules['kubernetes'] = None\n"  # as if the knative extra were not installed
               "from rollbox.functions.cli.main import main; sys.exit(main(sys.argv[1:]))")
    done = subprocess.run([sys.executable, "-c", blocked, "knative", "release", "--namespace", "rl"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "pip install 'rollbox[knative]'" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("command", [("status",), ("release",), ("prewarm", "--replicas", "2")])
def test_without_a_kubeconfig_the_command_says_so_in_one_line(tmp_path: Any, command: tuple[str, ...],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Not in a pod and no kubeconfig (issue 26: a 44-line ConfigException traceback): one line naming
    what is missing and where it looked, exit 2 (nothing was asked of any API server)."""
    done = _rollbox(str(tmp_path / "no-such-kubeconfig"), *command)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and done.stdout == ""
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "no usable kubeconfig at " + str(tmp_path / "no-such-kubeconfig") in done.stderr, done.stderr
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "no-such-kubeconfig"))
    with pytest.raises(KubernetesNotConfigured, match="no usable kubeconfig"):  # from Python: a KnativeError
        scale("rl", "rollbox")
