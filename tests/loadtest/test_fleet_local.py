"""loadtest/fleet_local.py: real `rollbox serve` replicas on one SeaweedFS bucket behind a real HAProxy,
scaled to zero (SIGTERM: drained) and back with empty caches; every episode's next step resumes from S3."""

from __future__ import annotations

import importlib.util
import sys
import time
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


def haproxy_stat(fleet: Any, proxy: str, server: str, column: str) -> int:
    """One number from HAProxy's stats (its socket), e.g. the frontend's most concurrent sessions."""
    import csv
    rows = list(csv.reader(fleet.haproxy_cli("show stat").decode().lstrip("# ").splitlines()))
    col = {name: i for i, name in enumerate(rows[0])}
    row = next(r for r in rows[1:] if r[col["pxname"]] == proxy and r[col["svname"]] == server)
    return int(row[col[column]] or 0)


def processes_naming(text: str) -> list[int]:
    """Pids of the processes whose command line holds ``text``."""
    out = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and text in (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                out.append(int(proc.name))
        except OSError:
            continue
    return out


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


def test_a_replica_that_cannot_start_leaves_no_other_running(seaweed: SeaweedS3, tmp_path: Path) -> None:
    """The first replica's port is taken, so it exits at once: the fleet's start fails, and the replica
    that did start is stopped with the rest (it used to be left running, its pid known to nobody)."""
    import socket

    fl = load_fleet_local()
    f = fl.Fleet(tmp_path / "fleet", 2, s3=seaweed)
    homes = str(tmp_path / "fleet" / "homes")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", f.replica_ports[0]))
        taken.listen()
        with pytest.raises(RuntimeError, match="Address already in use"):
            f.start()
    assert f.replicas == [None, None] and f.haproxy is None
    assert processes_naming(homes) == []


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
        for phases in fleet.last_drain:  # each step of each drain, in order, seconds after its SIGTERM
            assert list(phases) == ["stopping", "draining", "hibernated", "flushed", "stopped", "exiting", "exit"], phases
            assert list(phases.values()) == sorted(phases.values()) and phases["exit"] < 30, phases
        for _ in range(60):  # HAProxy's next check (every 0.5 s) finds them gone, if the drain was quicker
            if fleet.routed() == 0:
                break
            time.sleep(0.05)
        assert fleet.routed() == 0
        # as Knative's activator does, HAProxy holds a request while no replica is up (here for 1 s, then 503)
        fleet.set_activator_wait_s(1.0)
        t0 = time.monotonic()
        down = send(http, fleet.url, EXEC, {"sandbox_id": sids[0], "code": "print(1)"})
        assert down.status_code == 503 and time.monotonic() - t0 >= 1.0, down  # HAProxy: no replica, still
        fleet.set_activator_wait_s(60.0)

        # started while a client sends a request through HAProxy (held there until a replica is routed): its
        # first 200 (a create of its own, destroyed after: the episodes' sandboxes stay in S3 alone, for the
        # steps below)
        restart = fleet.restart_probed(
            lambda h: send(h, fleet.url, CREATE, {"snapshot": "python"}),
            after=lambda h, r: send(h, fleet.url, "dev.rollbox.sandbox.destroy", {"sandbox_id": r.json()["sandbox_id"]}))
        assert restart.routed_s < 60 and fleet.routed() == 2
        assert restart.first_reply_s is not None and 0 < restart.first_reply_s < restart.routed_s + 10, restart
        assert not first_pids & {p for k, p in fleet.pids().items() if k.startswith("replica")}
        for sid in sids:  # empty caches: every next step resumes from S3, with every earlier step's file
            r = send(http, fleet.url, EXEC, {"sandbox_id": sid, "code": APPEND.format(f"{sid} after")})
            steps[sid] += f"{sid} after\n"
            assert r.status_code == 200, r.text
            assert r.json()["stdout"] == steps[sid] and r.json()["resumed"] is True, r.json()


def test_distributed_locust_shares_connections_and_sums_workers(fleet: Any, tmp_path: Path) -> None:
    """Locust as a 100k run drives it, in small: a master and 2 worker processes, 24 users, each
    process's users sharing 2 connections; the summary sums both workers' counters."""
    import json
    import os
    import subprocess

    clean = {k: v for k, v in os.environ.items() if not k.startswith("ROLLBOX_")}
    out_json = tmp_path / "summary.json"
    pids = ",".join(str(p) for k, p in fleet.pids().items() if k.startswith("replica") or k == "haproxy")
    master = sys.modules["fleet_local"].locust_master_args()  # (the module the fleet fixture loaded)
    p = subprocess.run(
        [sys.executable, "-m", "locust", "-f", str(ROOT / "loadtest" / "locustfile.py"), "--headless",
         "--only-summary", "--processes", "2", *master, "-u", "24", "-r", "24", "-t", "8s", "--stop-timeout", "10",
         "--host", fleet.url.rstrip("/"), "--think-min-s", "0.2", "--think-max-s", "0.5", "--connections", "2",
         "--server-pid", pids, "--summary-json", str(out_json)],
        capture_output=True, text=True, timeout=90, env={**clean, "ROLLBOX_LOCUST_SHAPE": "none"})
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    summary = json.loads(out_json.read_text())
    assert summary["processes"] == 2, summary
    assert summary["failures"] == 0 and summary["episodes_done"] > 0 and summary["steps"] > 0, summary
    assert summary["step_p50_ms"] > 0 and summary["step_p99_ms"] >= summary["step_p50_ms"], summary
    assert max(n for _, n in summary["open_series"]) > 0, summary  # open episodes, summed over workers
    assert summary["targets_peak_pss_bytes"] > 50 * 2**20 and summary["locust_rss_peak_bytes"] > 0, summary
    assert "users' processes: 2" in out and "open episodes: peak" in out, out[-3000:]
    # 24 users, 2 processes x 2 shared connections (+1: the summary reads /metrics through it at the end):
    # HAProxy never had more than 5 client connections at once (a pool per user: up to 24)
    assert 1 <= haproxy_stat(fleet, "rollbox", "FRONTEND", "smax") <= 5, out[-2000:]


def test_the_fleets_seaweedfs_runs_with_the_go_threads_it_is_given(tmp_path: Path) -> None:
    fl = load_fleet_local()
    assert fl.Fleet(tmp_path / "a", 1).s3.procs == fl.WEED_PROCS == 1  # (not started)
    assert fl.Fleet(tmp_path / "b", 1, weed_procs=0).s3.procs is None  # Go's default
    s3 = SeaweedS3(tmp_path / "s3", procs=1)
    s3.start()
    try:
        assert s3.proc is not None
        environ = Path(f"/proc/{s3.proc.pid}/environ").read_bytes().split(b"\0")
        assert b"GOMAXPROCS=1" in environ
        s3.client().create_bucket(Bucket="procs")  # and it serves
    finally:
        s3.stop()


def test_requests_held_at_zero_are_shared_by_the_replicas_as_they_start(seaweed: SeaweedS3, tmp_path: Path) -> None:
    """Knative's containerConcurrency, as HAProxy's per-replica maxconn: no replica is sent more than
    its share at once, the rest wait at HAProxy. Six steps sent while the fleet is at zero wait at the
    activator; when the replicas start, each is sent 2 at a time (without the cap, HAProxy hands them
    all out at once: 3 each when both are routed together, all six to one routed alone), and both serve
    the held steps."""
    import concurrent.futures

    fl = load_fleet_local()
    assert "maxconn 2\n" in fl.haproxy_config(1, [2], tmp_path / "sock", container_concurrency=2)
    assert " maxconn" not in fl.haproxy_config(1, [2], tmp_path / "sock", container_concurrency=0).split("backend")[1]
    with fl.Fleet(tmp_path / "fleet", 2, serve_args=["--hibernate-after-s", "60"], s3=seaweed,
                  container_concurrency=2, activator_wait_s=60) as f, httpx.Client(timeout=60) as http:
        sids = []
        for _ in range(6):
            r = send(http, f.url, CREATE, {"snapshot": "python"})
            assert r.status_code == 200, r.text
            sids.append(r.json()["sandbox_id"])
        assert f.scale_to_zero() == [0, 0]
        while f.routed():
            time.sleep(0.05)
        def step(sid: str) -> httpx.Response:  # 2 s each: a replica given all six would have run them at once
            with httpx.Client(timeout=60) as client:
                return send(client, f.url, EXEC, {"sandbox_id": sid, "code": "import time; time.sleep(2); print(2)"})

        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            futs = [pool.submit(step, sid) for sid in sids]
            time.sleep(1.0)  # all six wait at HAProxy's activator
            f.scale_up()
            replies = [fut.result() for fut in futs]
        assert [r.status_code for r in replies] == [200] * 6, [r.text for r in replies]
        assert all(r.json()["stdout"] == "2\n" and r.json()["resumed"] for r in replies)
        smax = [haproxy_stat(f, "replicas", f"r{i}", "smax") for i in (1, 2)]
        served = [haproxy_stat(f, "replicas", f"r{i}", "stot") for i in (1, 2)]
        assert max(smax) <= 2, smax  # never more than its share at once
        assert haproxy_stat(f, "replicas", "BACKEND", "qmax") >= 1  # the rest waited at HAProxy
        # both replicas served the held steps (each also had its creates before the zero: 3 each)
        assert min(served) >= 3 + 1, served


def test_the_script_measures_scales_from_zero_and_back(tmp_path: Path) -> None:
    """`fleet_local.py --restarts N`: an episode opened, the fleet stopped and started N times, each
    start's routing and the episode's next reply printed, then their medians; exit 0 when every start
    answered, and nothing left running."""
    import json
    import os
    import subprocess

    clean = {k: v for k, v in os.environ.items() if not k.startswith("ROLLBOX_")}
    p = subprocess.run([sys.executable, str(ROOT / "loadtest" / "fleet_local.py"), "--replicas", "2", "--restarts", "2",
                        "--base", str(tmp_path / "fleet")], capture_output=True, text=True, timeout=180, env=clean)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    lines = p.stdout.strip().splitlines()
    starts = [json.loads(x) for x in lines[:-1]]
    assert len(starts) == 2, p.stdout
    for s in starts:
        assert s["drain_exit_codes"] == [0, 0], s
        assert 0 < s["routed_s"] < 60 and s["first_reply_s"] is not None and 0 < s["first_reply_s"] < 60, s
    assert lines[-1].startswith("2 replicas scaled from zero 2 times: routed after ") and "0 without a reply" in lines[-1]
    left = subprocess.run(["pgrep", "-f", str(tmp_path / "fleet")], capture_output=True, text=True).stdout.split()
    assert left == [], left  # (replicas, SeaweedFS and HAProxy all run with paths under --base)
