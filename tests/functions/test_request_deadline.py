"""Every request gets a reply within its deadline (issue 28: a create waited past the client's 120 s).

A real `rollbox serve` with a 2 s `--request-deadline-s` and a small `--max-queued`, saturated by
concurrent slow steps of one sandbox (they run one at a time, so the later ones wait behind the
earlier ones for longer than their deadline): every request is answered within the deadline plus
its own timeout_s plus slack, refused ones with 429 and Retry-After; the steps refused at their
deadline still ran, once, and the retry of the same event gets what they ended with.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from svc_testkit import Reply, ServerProc, event, metric, send, start_server

CREATE, EXEC = "dev.rollbox.sandbox.create", "dev.rollbox.sandbox.exec"
DEADLINE_S, STEP_TIMEOUT_S, SLEEP_S = 2.0, 3.0, 1.5  # (a step ends in time on a loaded box: 1.5 s to spare)
BUDGET_S = DEADLINE_S + STEP_TIMEOUT_S  # what an exec may take before its reply
SLACK_S = 2.0  # a loaded box's scheduling, HTTP and the reply's own work
STEPS, QUEUE = 8, 6  # 8 at once, 6 admitted (one runs, five wait), 2 refused at once


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServerProc]:
    srv = start_server(tmp_path / "serve", "--request-deadline-s", str(DEADLINE_S), "--max-queued", str(QUEUE))
    yield srv
    rc = srv.stop()
    assert rc == 0, f"rollbox serve exited with {rc}:\n{srv.log_path.read_text()[-4000:]}"


async def test_every_request_is_answered_within_its_deadline(server: ServerProc) -> None:
    async with httpx.AsyncClient(timeout=httpx.Timeout(10.0, read=60.0),
                                 limits=httpx.Limits(max_connections=32)) as http:
        r = await send(http, server.url, event(CREATE, {"snapshot": "python"}))
        assert r.status == 200, r.data
        sid = r.data["sandbox_id"]

        async def step(i: int) -> tuple[float, Reply]:
            t0 = time.monotonic()
            ev = event(EXEC, {"sandbox_id": sid, "timeout_s": STEP_TIMEOUT_S,
                              "command": f"sleep {SLEEP_S}; echo {i} >> log.txt; wc -l < log.txt"}, id=f"step-{i}")
            rep = await send(http, server.url, ev)
            return time.monotonic() - t0, rep

        answers = await asyncio.gather(*(step(i) for i in range(STEPS)))
        took = [round(t, 2) for t, _ in answers]
        # every one answered in time (without the deadline the last admitted one waits 5 x 1.5 s, then runs 1.5 s)
        assert max(took) <= BUDGET_S + SLACK_S, took
        by_status: dict[int, list[Reply]] = {}
        for _, rep in answers:
            by_status.setdefault(rep.status, []).append(rep)
        assert set(by_status) <= {200, 429}, {s: [x.data for x in rs] for s, rs in by_status.items()}
        for rep in by_status.get(429, []):
            assert rep.data["code"] == "overloaded" and int(rep.headers["retry-after"]) >= 1, (rep.headers, rep.data)
        refused_at_deadline = [rep for rep in by_status.get(429, []) if "--request-deadline-s" in rep.data["message"]]
        refused_queue = [rep for rep in by_status.get(429, []) if "in flight" in rep.data["message"]]
        assert len(refused_queue) == STEPS - QUEUE, [x.data for x in by_status.get(429, [])]
        assert refused_at_deadline, took  # some waited past their deadline behind the others
        assert len(refused_at_deadline) + len(refused_queue) == len(by_status[429])
        done = by_status.get(200, [])
        assert done and all(rep.data["exit_code"] == 0 for rep in done), [x.data for x in done]

        # the work of those answered at their deadline went on: once the sandbox is idle, a retry of
        # the same event (same source and id) gets the step's own result, and nothing ran twice
        late_ids = {str(rep.event["subject"] or "") for rep in refused_at_deadline}
        assert late_ids == {sid}
        await asyncio.sleep(len(refused_at_deadline) * SLEEP_S + 1.0)
        admitted = STEPS - len(refused_queue)
        ids = [f"step-{i}" for i in range(STEPS)]
        statuses = [rep.status for _, rep in answers]
        retried = []
        for eid, status, (_, rep) in zip(ids, statuses, answers, strict=True):
            if status == 429 and rep in refused_at_deadline:
                cmd = f"sleep {SLEEP_S}; echo {eid[5:]} >> log.txt; wc -l < log.txt"
                again = await send(http, server.url, event(EXEC, {"sandbox_id": sid, "timeout_s": STEP_TIMEOUT_S,
                                                                  "command": cmd}, id=eid))
                assert again.status == 200 and again.data["exit_code"] == 0, again.data
                retried.append(int(again.data["stdout"]))
        counts = sorted([int(rep.data["stdout"]) for rep in done] + retried)
        assert counts == list(range(1, admitted + 1)), counts  # each admitted step ran once, in turn
        check = await send(http, server.url, event(EXEC, {"sandbox_id": sid, "command": "wc -l < log.txt"}))
        assert check.status == 200 and int(check.data["stdout"]) == admitted, check.data
        text = (await http.get(server.url + "metrics")).text
        assert metric(text, "rollbox_admission_rejects_total", reason="deadline") == len(refused_at_deadline)
