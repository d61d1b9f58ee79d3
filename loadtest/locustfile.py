"""Locust: trainers playing real RL episodes against `rollbox serve`, as CloudEvents (binary mode).

One scenario: an episode is create -> a few exec steps (model-written code: some succeed, some fail)
-> destroy. A load shape plays a burst, a scale-to-zero pause, and a second burst; a `quitting`
listener turns the run red (exit code 1) if failures or the p99 go over their thresholds.

    rollbox serve &                      # 127.0.0.1:8080
    locust -f loadtest/locustfile.py --headless --host http://127.0.0.1:8080
    python loadtest/locustfile.py        # one user, one episode, in the debugger (run_single_user)

Environment: ROLLBOX_LOCUST_STAGE_S (seconds per shape stage, default 30), ROLLBOX_LOCUST_USERS
(burst size, default 50), ROLLBOX_LOCUST_STEPS (execs per episode, default 3),
ROLLBOX_LOCUST_MAX_FAIL_RATIO (default 0.01), ROLLBOX_LOCUST_MAX_P99_MS (default 5000).
"""

from __future__ import annotations

import json
import os
import random
import uuid
from typing import Any

from locust import FastHttpUser, LoadTestShape, between, events, run_single_user, task

STAGE_S = float(os.environ.get("ROLLBOX_LOCUST_STAGE_S", "30"))
USERS = int(os.environ.get("ROLLBOX_LOCUST_USERS", "50"))
STEPS = int(os.environ.get("ROLLBOX_LOCUST_STEPS", "3"))
MAX_FAIL_RATIO = float(os.environ.get("ROLLBOX_LOCUST_MAX_FAIL_RATIO", "0.01"))
MAX_P99_MS = float(os.environ.get("ROLLBOX_LOCUST_MAX_P99_MS", "5000"))

PREFIX = "dev.rollbox.sandbox."
# (code, the exit code it must give): what a policy's actions look like — mostly right, sometimes not
ACTIONS = [
    ("print(sum(range(10)))", 0),
    ("import json; print(json.dumps({'reward': 1}))", 0),
    ("assert 1 + 1 == 3, 'wrong answer'", 1),
    ("import sys; sys.exit(2)", 2),
]


class EpisodeUser(FastHttpUser):
    wait_time = between(0.0, 0.5)

    def event(
        self, kind: str, data: dict[str, Any], reply: str, name: str, *, exit_code: int | None = None
    ) -> dict[str, Any] | None:
        """POST one CloudEvent; mark the request failed unless the reply is the right event (and exit code)."""
        headers = {
            "ce-specversion": "1.0",
            "ce-type": PREFIX + kind,
            "ce-source": "/loadtest/locust",
            "ce-id": uuid.uuid4().hex,
            "content-type": "application/json",
        }
        with self.client.post("/", data=json.dumps(data), headers=headers, name=name, catch_response=True) as resp:
            if resp.status_code != 200:
                resp.failure(f"HTTP {resp.status_code}: {(resp.text or '')[:200]}")
                return None
            if resp.headers.get("ce-type") != PREFIX + reply:
                resp.failure(f"reply type {resp.headers.get('ce-type')!r}, wanted {PREFIX + reply!r}")
                return None
            try:
                body: dict[str, Any] = json.loads(resp.text or "")
            except ValueError:
                resp.failure("reply data is not JSON")
                return None
            if exit_code is not None and body.get("exit_code") != exit_code:
                resp.failure(f"exit code {body.get('exit_code')}, wanted {exit_code} for {data.get('code')!r}")
                return None
            return body

    @task
    def episode(self) -> None:
        meta = {"experiment": "locust", "episode": uuid.uuid4().hex[:12]}
        info = self.event("create", {"metadata": meta}, "created", "create")
        if info is None:
            return
        sid = info["sandbox_id"]
        try:
            for _ in range(STEPS):
                code, want = random.choice(ACTIONS)
                if self.event("exec", {"sandbox_id": sid, "code": code}, "result", "exec", exit_code=want) is None:
                    break
        finally:
            self.event("destroy", {"sandbox_id": sid}, "destroyed", "destroy")


class BurstAndScaleToZero(LoadTestShape):
    """A training burst, a pause at zero users (the warm pool drains), a second burst, then stop."""

    stages = (
        (1, USERS, max(1.0, USERS / 5)),  # stage length in STAGE_S units, users, spawn rate
        (1, 0, USERS),
        (1, USERS, float(USERS)),  # a sudden burst after idling
    )

    def tick(self) -> tuple[int, float] | None:
        t = self.get_run_time()
        end = 0.0
        for length, users, rate in self.stages:
            end += length * STAGE_S
            if t < end:
                return users, rate
        return None


@events.quitting.add_listener
def _thresholds(environment: Any, **_: Any) -> None:
    total = environment.stats.total
    p99 = total.get_response_time_percentile(0.99) or 0
    problems = []
    if total.num_requests == 0:
        problems.append("no requests were made")
    if total.fail_ratio > MAX_FAIL_RATIO:
        problems.append(f"fail ratio {total.fail_ratio:.3f} > {MAX_FAIL_RATIO}")
    if p99 > MAX_P99_MS:
        problems.append(f"p99 {p99:.0f} ms > {MAX_P99_MS:.0f} ms")
    if problems:
        print("rollbox locust thresholds failed: " + "; ".join(problems))
        environment.process_exit_code = 1


if __name__ == "__main__":
    EpisodeUser.host = os.environ.get("ROLLBOX_URL", "http://127.0.0.1:8080")
    run_single_user(EpisodeUser)
