"""SIGTERM under load: readiness fails, new events get 503, every admitted event gets its reply, exit 0."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from pathlib import Path

import httpx
from rollbox.functions.contract.models import ERROR, SANDBOX_RESULT, SANDBOX_RUN
from svc_testkit import event as ce
from svc_testkit import send, start_server

N = 24


def inflight(text: str) -> float:
    m = re.search(r"^rollbox_inflight_requests (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


async def test_sigterm_drains_in_flight_work(tmp_path: Path) -> None:
    # all N started at once (beyond --max-running they would wait their turn, and a drain hands those
    # back with 503 at once: tests/functions/test_drain_backlog.py)
    srv = start_server(tmp_path, "--grace-s", "30", "--max-running", str(N))
    try:
        async with httpx.AsyncClient(
            timeout=httpx.Timeout(10, read=60), limits=httpx.Limits(max_connections=N + 8)
        ) as http:
            kept = (await send(http, srv.url, ce("dev.rollbox.sandbox.create", {}))).data["sandbox_id"]
            work = [
                asyncio.create_task(
                    send(http, srv.url, ce(SANDBOX_RUN, {"code": f"import time; time.sleep(2); print({i})"}))
                )
                for i in range(N)
            ]
            deadline = time.monotonic() + 30
            while inflight((await http.get(srv.url + "metrics")).text) < N:
                assert time.monotonic() < deadline, "the runs were never all in flight"
                await asyncio.sleep(0.02)
            os.kill(srv.pid, signal.SIGTERM)
            await asyncio.sleep(0.2)
            ready = await http.get(srv.url + "readyz")
            assert (ready.status_code, ready.json()["status"]) == (503, "draining")
            late = await send(http, srv.url, ce(SANDBOX_RUN, {"code": "print('late')"}))
            assert (late.status, late.type, late.data["code"]) == (503, ERROR, "shutting_down")
            assert int(late.headers["retry-after"]) >= 1
            # a destroy is still accepted: it frees what the drain waits for
            bye = await send(http, srv.url, ce("dev.rollbox.sandbox.destroy", {"sandbox_id": kept}))
            assert (bye.status, bye.type, bye.data["reason"]) == (200, "dev.rollbox.sandbox.destroyed", "destroyed")
            replies = await asyncio.gather(*work)
        # every event admitted before SIGTERM got its full reply
        assert [(r.status, r.type) for r in replies] == [(200, SANDBOX_RESULT)] * N
        assert sorted(int(r.data["stdout"]) for r in replies) == list(range(N))
        srv.proc.wait(40)
        assert srv.proc.returncode == 0
        msgs = [x.get("msg") for x in srv.log_records()]
        assert "draining" in msgs and msgs[-2:] == ["stopped", "exiting"]
        assert msgs.index("stopping") < msgs.index("draining")  # the signal, as the loop got to it
    finally:
        rc = srv.stop()
    assert rc == 0


async def test_sigterm_grace_is_a_bound(tmp_path: Path) -> None:
    srv = start_server(tmp_path, "--grace-s", "1")
    try:
        async with httpx.AsyncClient(timeout=httpx.Timeout(10, read=60)) as http:
            stuck = asyncio.create_task(send(http, srv.url, ce(SANDBOX_RUN, {"code": "import time; time.sleep(60)",
                                                                             "timeout_s": 120})))
            deadline = time.monotonic() + 30
            while inflight((await http.get(srv.url + "metrics")).text) < 1:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.02)
            t0 = time.monotonic()
            os.kill(srv.pid, signal.SIGTERM)
            await asyncio.to_thread(srv.proc.wait, 30)
            took = time.monotonic() - t0
            # the grace is over long before the sandbox would have finished: cancelled, destroyed, exit 0
            assert srv.proc.returncode == 0 and took < 15, took
            r = await stuck  # answered, not dropped: a 503 event saying to retry elsewhere
            assert (r.status, r.type, r.data["code"]) == (503, ERROR, "shutting_down")
            assert "grace period" in r.data["message"] and int(r.headers["retry-after"]) >= 1
        msgs = [x.get("msg") for x in srv.log_records()]
        assert "grace period over; cancelling in-flight events" in msgs and msgs[-2:] == ["stopped", "exiting"]
    finally:
        srv.stop()


STALLED_EXIT = """
import sys, threading, time
from rollbox.functions.service import server

async def serve(cfg):  # a serve that leaves a thread behind that will not end soon
    threading.Thread(target=time.sleep, args=(60,), name="left-behind").start()
    return 0

server.serve, server.EXIT_STALL_S = serve, 1.0
sys.exit(server._main(server.argparse.Namespace(**{o.dest: None for o in server.OPTIONS})))
"""


def test_a_stalled_exit_is_bounded_and_shows_its_stacks(tmp_path: Path) -> None:
    """After "stopped", joining what is left of the threads may not hold the exit: past EXIT_STALL_S the
    stacks go to stderr and the process ends (exit 1), not after the thread's 60 s."""
    import subprocess
    import sys

    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", STALLED_EXIT], capture_output=True, text=True, timeout=50,
                         env={**os.environ, "ROLLBOX_HOME": str(tmp_path)})
    took = time.monotonic() - t0
    assert out.returncode == 1 and took < 20, (out.returncode, took, out.stderr[-2000:])
    assert "Timeout (0:00:01)!" in out.stderr and "threading.py" in out.stderr  # the stacks: the stall's thread
    assert "exiting" in out.stderr  # the loop closed first; the stall was after it


async def test_after_the_drain_the_listener_stays_open_while_requests_still_come(tmp_path: Path) -> None:
    """A load balancer keeps sending a replica requests until its health check sees /readyz answer 503.
    A replica with nothing to drain closed its port at once, so those requests met a refused connection
    (the balancer's own 503, without Retry-After). It now answers each 503 shutting_down with
    Retry-After until none came for 0.5 s (at most --drain-linger-s), then exits; an idle one at once."""
    srv = start_server(tmp_path / "busy", "--drain-linger-s", "10")  # (closed by the quiet, long before)
    idle = start_server(tmp_path / "idle")
    try:
        async with httpx.AsyncClient(timeout=httpx.Timeout(10)) as http:
            probe = ce("dev.rollbox.sandbox.exec", {"sandbox_id": "sb-nothere", "command": "true"})
            assert (await send(http, srv.url, probe)).status == 404  # up: an answer, not a connection error
            os.kill(srv.pid, signal.SIGTERM)
            t0 = time.monotonic()
            answers: list[tuple[int, str, str]] = []
            while time.monotonic() - t0 < 1.2:  # past the drain (nothing to drain: a few ms)
                r = await send(http, srv.url, ce("dev.rollbox.sandbox.exec",
                                                 {"sandbox_id": "sb-nothere", "command": "true"}))
                answers.append((r.status, r.data.get("code", ""), r.headers.get("retry-after", "")))
                await asyncio.sleep(0.05)
            stopped_sending = time.monotonic()
            rc = await asyncio.to_thread(srv.proc.wait, 30)
            closed_after = time.monotonic() - stopped_sending
            t1 = time.monotonic()
            os.kill(idle.pid, signal.SIGTERM)
            idle_rc = await asyncio.to_thread(idle.proc.wait, 30)
            idle_took = time.monotonic() - t1
    finally:
        srv.stop()
        idle.stop()
    # (the first may still be served: the signal is handled as the loop gets to it)
    refusals = answers[next((i for i, a in enumerate(answers) if a[0] != 404), len(answers)):]
    assert len(refusals) >= 15, answers
    assert all(a[:2] == (503, "shutting_down") for a in refusals), answers  # the replica's refusal, none dropped
    assert all(int(a[2]) >= 1 for a in refusals), answers
    # it closed once the requests stopped (0.5 s of quiet), not at the end of its 10 s linger
    assert rc == 0 and 0.3 < closed_after < 4.0, (rc, closed_after)
    assert "lingered" in [x.get("msg") for x in srv.log_records()]
    assert idle_rc == 0 and "lingered" not in [x.get("msg") for x in idle.log_records()], idle_took
