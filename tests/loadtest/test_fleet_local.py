"""loadtest/fleet_local.py: real `rollbox serve` replicas on one SeaweedFS bucket behind a real HAProxy,
scaled to zero (SIGTERM: drained) and back with empty caches; every episode's next step resumes from S3."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.snapshots.s3server import SeaweedS3

ROOT = Path(__file__).resolve().parents[2]
CREATE, EXEC = "dev.rollbox.sandbox.create", "dev.rollbox.sandbox.exec"
APPEND = "open('log.txt', 'a').write('{0}\\n'); print(open('log.txt').read(), end='')"

pytestmark = pytest.mark.slow


def load_fleet_local() -> ModuleType:
    spec = importlib.util.spec_from_file_location("fleet_local", ROOT / "loadtest" / "fleet_local.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["fleet_local"] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def fleet(seaweed: SeaweedS3, tmp_path: Path) -> Iterator[Any]:
    fl = load_fleet_local()
    with fl.Fleet(tmp_path / "fleet", 2, serve_args=["--hibernate-after-s", "60", "--prewarm", "python"],
                  s3=seaweed) as f:
        yield f


def metric(text: str, name: str, **labels: str) -> float:
    return sum(smp.value for fam in text_string_to_metric_families(text) for smp in fam.samples
               if smp.name == name and all(smp.labels.get(k) == v for k, v in labels.items()))


def send(http: httpx.Client, url: str, etype: str, data: dict[str, Any]) -> httpx.Response:
    import uuid
    headers = {"ce-specversion": "1.0", "ce-type": etype, "ce-source": "/tests/loadtest", "ce-id": uuid.uuid4().hex,
               "content-type": "application/json"}
    return http.post(url, headers=headers, json=data)


def test_episodes_across_replicas_survive_scale_to_zero_and_back(fleet: Any) -> None:
    with httpx.Client(timeout=60) as http:
        sids = []
        for _ in range(3):  # odd: round-robin sends each episode's next request to the other replica
            r = send(http, fleet.url, CREATE, {"snapshot": "python"})
            assert r.status_code == 200, r.text
            sids.append(r.json()["sandbox_id"])
        steps: dict[str, str] = {sid: "" for sid in sids}
        resumed_before = 0
        for i in range(2):  # two steps each, round-robin: consecutive requests land on the other replica
            for sid in sids:
                r = send(http, fleet.url, EXEC, {"sandbox_id": sid, "code": APPEND.format(f"{sid} {i}")})
                steps[sid] += f"{sid} {i}\n"
                assert r.status_code == 200 and r.json()["stdout"] == steps[sid], r.text
                resumed_before += bool(r.json().get("resumed"))
        assert resumed_before == 6, "a step landed on the replica that ran the one before (affinity?)"
        for port in fleet.replica_ports:
            text = http.get(f"http://127.0.0.1:{port}/metrics").text
            assert metric(text, "rollbox_requests_total", type=EXEC, status="200") == 3, text[-2000:]
        first_pids = set(fleet.pids().values())

        codes = fleet.scale_to_zero()
        assert codes == [0, 0]  # both drained and exited cleanly
        assert fleet.routed() == 0
        down = send(http, fleet.url, EXEC, {"sandbox_id": sids[0], "code": "print(1)"})
        assert down.status_code == 503  # HAProxy: no replica

        took = fleet.scale_up()
        assert took < 60 and fleet.routed() == 2
        assert not first_pids & {p for k, p in fleet.pids().items() if k.startswith("replica")}
        for sid in sids:  # empty caches: every next step resumes from S3, with every earlier step's file
            r = send(http, fleet.url, EXEC, {"sandbox_id": sid, "code": APPEND.format(f"{sid} after")})
            steps[sid] += f"{sid} after\n"
            assert r.status_code == 200, r.text
            assert r.json()["stdout"] == steps[sid] and r.json()["resumed"] is True, r.json()
