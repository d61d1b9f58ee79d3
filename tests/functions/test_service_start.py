"""A replica's start: snapshots named by --prewarm have their zygote and a ready sandbox before any
event asks (a replica scaled from zero answers its first event from the pool); a name that cannot
be prewarmed is logged and served on demand, never a failed start. A real `rollbox serve`."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
from svc_testkit import ServerProc, event, send, start_server

from tests.snapshots.s3server import ACCESS_KEY, SECRET_KEY, SeaweedS3

ROLLBOX = [sys.executable, "-m", "rollbox.functions.cli.main"]


def _wait_log(srv: ServerProc, pred: object, timeout_s: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for rec in srv.log_records():
            if pred(rec):  # type: ignore[operator]
                return rec
        time.sleep(0.05)
    raise AssertionError(f"no such log record in {timeout_s} s:\n{srv.log_path.read_text()[-3000:]}")


async def _first_run(srv: ServerProc) -> dict:
    async with httpx.AsyncClient(timeout=60) as http:
        reply = await send(http, srv.url, event("dev.rollbox.sandbox.run", {"code": "print(6 * 7)"}))
    assert reply.status == 200 and reply.data["stdout"] == "42\n", reply
    return reply.data


async def test_prewarmed_snapshot_answers_the_first_run_from_its_pool(tmp_path: Path) -> None:
    srv = start_server(tmp_path, "--prewarm", "python, no-such-snapshot", "--durability", "off", "--record", "off")
    try:
        warm = _wait_log(srv, lambda r: r.get("msg") == "prewarmed")
        assert warm["snapshot"] == "python" and warm["s"] > 0, warm
        missing = _wait_log(srv, lambda r: r.get("msg", "").startswith("not prewarmed"))
        assert missing["snapshot"] == "no-such-snapshot" and "no-such-snapshot" in missing["msg"], missing
        first = await _first_run(srv)
        assert first["pooled"] is True, first  # taken ready from the pool the start filled
    finally:
        assert srv.stop() == 0, srv.log_path.read_text()[-3000:]


async def test_without_prewarm_the_first_run_starts_its_sandbox(tmp_path: Path) -> None:
    srv = start_server(tmp_path, "--durability", "off", "--record", "off", env={"ROLLBOX_PREWARM": ""})
    try:
        first = await _first_run(srv)
        assert first["pooled"] is False, first
        assert not any(r.get("msg") == "prewarmed" for r in srv.log_records())
    finally:
        assert srv.stop() == 0, srv.log_path.read_text()[-3000:]


async def test_a_snapshot_only_in_s3_is_prewarmed_once_the_store_is_attached(tmp_path: Path, seaweed: SeaweedS3) -> None:
    """The runtime starts on the local cache alone while the S3 client loads; a prewarmed name the
    cache lacks waits for S3 and is pulled from it, so it too answers its first run from the pool."""
    tpl = tmp_path / "demo.yaml"
    tpl.write_text("name: prewarm-demo\nwarm: {imports: [json]}\n")
    builder = tmp_path / "builder"
    aws = {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_REGION": "us-east-1",
           "AWS_ENDPOINT_URL": seaweed.endpoint}
    store = f"s3://{seaweed.new_bucket()}/p"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "ROLLBOX_"))}
    for args in (["build", str(tpl)], ["push", "prewarm-demo", "--store", store]):
        done = subprocess.run([*ROLLBOX, "snapshot", *args, "--home", str(builder)], env={**env, **aws},
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout + done.stderr
    srv = start_server(tmp_path, "--home", str(tmp_path / "replica"), "--store", store, "--prewarm", "prewarm-demo",
                       "--durability", "off", "--record", "off", env=aws)
    try:
        warm = _wait_log(srv, lambda r: r.get("msg") in ("prewarmed", "not prewarmed") or
                         str(r.get("msg", "")).startswith("not prewarmed"))
        assert warm["msg"] == "prewarmed" and warm["snapshot"] == "prewarm-demo", warm
        async with httpx.AsyncClient(timeout=60) as http:
            reply = await send(http, srv.url, event("dev.rollbox.sandbox.run",
                                                    {"snapshot": "prewarm-demo", "code": "print(6 * 7)"}))
        assert reply.status == 200 and reply.data["stdout"] == "42\n" and reply.data["pooled"] is True, reply.data
    finally:
        assert srv.stop() == 0, srv.log_path.read_text()[-3000:]


def _maps(pid: int) -> str:
    return Path(f"/proc/{pid}/maps").read_text()


async def test_a_replica_loads_pyarrow_after_its_start_and_records_its_first_steps(tmp_path: Path) -> None:
    """pyarrow (~0.2 s of a replica's CPU) is only for writing Parquet: a replica listens and answers
    without it, and loads it a few seconds later (the flush's warm-up) or at its first flush. The
    recording works as before: the first run's step is in the store as Parquet after the drain."""
    home = tmp_path / "home"
    srv = start_server(tmp_path, "--home", str(home), "--durability", "off", "--flush-interval-s", "60")
    try:
        await _first_run(srv)
        assert "/pyarrow/" not in _maps(srv.proc.pid), "pyarrow was loaded by the start"
        deadline = time.monotonic() + 30
        while "/pyarrow/" not in _maps(srv.proc.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert "/pyarrow/" in _maps(srv.proc.pid), "the warm-up did not load pyarrow"
        assert "/pandas/" not in _maps(srv.proc.pid), "pandas was loaded"
    finally:
        assert srv.stop() == 0, srv.log_path.read_text()[-3000:]
    from rollbox.functions.analysis.trajectories import read
    from rollbox.snapshots.state import LocalObjects

    steps = read("trajectories", LocalObjects(home))
    assert steps.column("stdout").to_pylist() == ["42\n"]
