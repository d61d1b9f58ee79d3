"""The pod, proven locally: the image scripts/image builds, run under rootful podman (runc) with exactly
the container spec of knative/base/service.yaml (its capabilities after dropping ALL, its user, env
and args; no --privileged), a real SeaweedFS on the host as its S3 store. Nothing is faked here; what
differs from a cluster is the VM (Kata) around the container and Knative's queue-proxy in front.

The first test of a fresh checkout builds the image (~2 min) and loads it into podman.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterator

import httpx
import pytest

from tests.functions.svc_testkit import event, send
from tests.knative import podkit
from tests.snapshots.s3server import ACCESS_KEY, SECRET_KEY, SeaweedS3

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]
CREATE, EXEC, RUN, DESTROY = (f"dev.rollbox.sandbox.{t}" for t in ("create", "exec", "run", "destroy"))


@pytest.fixture(scope="module")
def tag() -> str:
    return podkit.base_image()


@pytest.fixture
def pods(tag: str) -> Iterator[Callable[..., podkit.Pod]]:
    made: list[podkit.Pod] = []

    def make(env: dict[str, str] | None = None, args: list[str] | None = None,
             entrypoint: list[str] | None = None) -> podkit.Pod:
        pod = podkit.Pod(tag, env=env or {}, args=args, entrypoint=entrypoint)
        made.append(pod)
        return pod

    yield make
    for pod in made:
        pod.remove()


@pytest.fixture
def s3(seaweed: SeaweedS3) -> dict[str, str]:
    return podkit.s3_env(seaweed.endpoint, seaweed.new_bucket(), ACCESS_KEY, SECRET_KEY)


def test_the_manifest_grants_no_more_than_it_lists() -> None:
    args = podkit.podman_args(podkit.container_spec())
    assert args[:2] == ["--cap-drop", "ALL"] and "--privileged" not in args
    caps = {args[i + 1] for i, a in enumerate(args) if a == "--cap-add"}
    assert caps == {"SYS_ADMIN", "SETUID", "SETGID", "KILL", "CHOWN", "FOWNER", "DAC_OVERRIDE", "MKNOD", "SETFCAP"}


def test_doctor_in_the_pod_shows_every_layer_in_force(pods: Callable[..., podkit.Pod]) -> None:
    done = pods(args=["doctor"]).run_once(timeout_s=300)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    for layer in ("pid namespace", "net namespace", "overlayfs", "seccomp"):
        assert f"ok   {layer}" in out, out
    # the entrypoint made the container's cgroups writable: real per-sandbox groups, not rlimits
    assert "one group per sandbox" in out or "this sandbox's group" in out, out
    assert "ran `id -u; hostname` as uid 1000" in out, out
    # each sandbox in a user namespace of its own (per-sandbox kernel budgets) with the manifest's capabilities
    assert "a user namespace of its own (identity maps) owned by host uid" in out, out


def test_the_images_modules_load_from_their_bytecode(pods: Callable[..., podkit.Pod]) -> None:
    """Not compiled again at every start (timestamp .pyc files go stale when the image is made)."""
    done = pods(entrypoint=["/opt/rollbox/bin/python", "-v", "-c", "import rollbox.functions.service.server"]).run_once()
    assert done.returncode == 0, done.stderr[-3000:]
    loaded = [ln for ln in done.stderr.splitlines() if ln.startswith("# code object from '/opt/rollbox/")]
    stale = [ln for ln in done.stderr.splitlines() if "bytecode is stale" in ln or
             ln.startswith("# code object from /opt/rollbox/")]  # (unquoted: compiled from the source)
    ours = [ln for ln in loaded if "/rollbox/functions/service/__pycache__/server." in ln]
    assert len(loaded) > 50 and ours and not stale, (len(loaded), stale[:10])


async def test_a_run_and_an_episode_against_the_pod(pods: Callable[..., podkit.Pod], s3: dict[str, str]) -> None:
    pod = pods(env=s3).start()
    pod.wait_ready()
    async with httpx.AsyncClient(timeout=120) as http:
        r = await send(http, pod.url, event(RUN, {"snapshot": "python-sci",
                                                  "code": "import numpy; print(numpy.arange(4).sum())"}))
        assert r.status == 200 and r.data["exit_code"] == 0 and r.data["stdout"] == "6\n", r.data
        sid = (await send(http, pod.url, event(CREATE, {"metadata": {"episode": "e1"}}))).data["sandbox_id"]
        r = await send(http, pod.url, event(EXEC, {"sandbox_id": sid, "code": "open('a.txt', 'w').write('one')"}))
        assert r.status == 200 and r.data["exit_code"] == 0, r.data
        r = await send(http, pod.url, event(EXEC, {"sandbox_id": sid, "command": "cat a.txt; id -u"}))
        assert r.data["stdout"] == "one1000\n", r.data
        r = await send(http, pod.url, event(DESTROY, {"sandbox_id": sid}))
        assert r.status == 200 and r.data["execs"] == 2, r.data


async def test_64_sandboxes_fork_children_and_a_fork_bomb_stays_in_its_own(
        pods: Callable[..., podkit.Pod], s3: dict[str, str]) -> None:
    pod = pods(env=s3).start()
    pod.wait_ready()
    forking = "for i in 1 2 3 4; do sleep 1 & done; wait; echo ok"
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    limits = httpx.Limits(max_connections=80, max_keepalive_connections=80)
    async with httpx.AsyncClient(timeout=180, limits=limits) as http:
        runs = [send(http, pod.url, event(RUN, {"command": forking, "timeout_s": 60})) for _ in range(63)]
        runs.append(send(http, pod.url, event(RUN, {"code": bomb, "timeout_s": 5})))
        replies = await asyncio.gather(*runs)
        after = await send(http, pod.url, event(RUN, {"command": forking, "timeout_s": 60}))
    good = [r for r in replies[:63] if r.status == 200 and r.data["exit_code"] == 0 and r.data["stdout"] == "ok\n"]
    assert len(good) == 63, [r.data for r in replies[:63] if r not in good][:3]
    b = replies[63]
    assert b.status == 200 and b.data["timed_out"] and b.data["pids_limit_hit"], b.data
    assert after.status == 200 and after.data["stdout"] == "ok\n", after.data


async def test_sigterm_drains_and_a_fresh_pod_continues_the_episode(
        pods: Callable[..., podkit.Pod], s3: dict[str, str]) -> None:
    first = pods(env=s3).start()
    first.wait_ready()
    async with httpx.AsyncClient(timeout=120) as http:
        sid = (await send(http, first.url, event(CREATE, {}))).data["sandbox_id"]
        r = await send(http, first.url, event(EXEC, {"sandbox_id": sid, "code": "open('s.txt', 'w').write('kept')"}))
        assert r.status == 200 and r.data["exit_code"] == 0, r.data
        took = first.stop(timeout_s=60)  # SIGTERM, as the kubelet sends it
        assert first.exit_code() == 0 and took < 30, (took, first.logs()[-3000:])
        second = pods(env=s3).start()  # its own home: an empty cache, nothing of the first
        second.wait_ready()
        r = await send(http, second.url, event(EXEC, {"sandbox_id": sid, "command": "cat s.txt"}))
        assert r.status == 200 and r.data["stdout"] == "kept" and r.data["resumed"] is True, r.data
        r = await send(http, second.url, event(DESTROY, {"sandbox_id": sid}))
        assert r.status == 200, r.data


def test_a_pod_from_zero_uses_the_layers_built_into_it(pods: Callable[..., podkit.Pod], seaweed: SeaweedS3,
                                                      s3: dict[str, str]) -> None:
    """Its store names the snapshot (pushed from the image, as an operator does) but holds none of its
    layers: the pod's first python-sci run can only come from the layers built into the image.
    (How fast: loadtest/bench_coldstart.py.)"""
    done = pods(env=s3, args=["snapshot", "push", "python-sci"]).run_once()
    assert done.returncode == 0, done.stdout + done.stderr
    bucket, prefix = s3["ROLLBOX_STORE"][len("s3://"):].split("/", 1)
    client = seaweed.client()
    layers = [o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/layers/")["Contents"]]
    assert layers
    for key in layers:
        client.delete_object(Bucket=bucket, Key=key)
    pod = pods(env=s3).start()
    pod.wait_ready()
    r = httpx.post(pod.url, headers={"ce-specversion": "1.0", "ce-type": RUN, "ce-source": "/tests/pod",
                                     "ce-id": f"first-{time.time_ns()}", "content-type": "application/json"},
                   json={"snapshot": "python-sci", "code": "import pandas; print('ok')"}, timeout=120)
    assert r.status_code == 200 and r.json()["stdout"] == "ok\n", r.text
    assert r.json()["snapshot_id"] in done.stdout  # the snapshot the store names, not a local stand-in
    logs = pod.logs()
    assert "as held here" not in logs
    # the manifest's ROLLBOX_PREWARM: both baked snapshots' zygotes started with the pod, at once
    warmed = {json.loads(ln).get("snapshot") for ln in logs.splitlines() if '"msg": "prewarmed"' in ln}
    assert warmed == {"python", "python-sci"} and "not prewarmed" not in logs, logs[-4000:]
