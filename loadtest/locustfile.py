"""Locust: RL trainers playing episodes against `rollbox serve`, as CloudEvents (binary mode).

An episode is what a trainer's rollout worker does: create a sandbox, then a few exec steps, each
after a think time (the model writing its next action), then destroy. Every step appends a line to
a file in the sandbox and prints the sha256 of the whole file, so a step only passes if the
sandbox kept the state of the steps before it; some actions are wrong on purpose and must exit 1.
Wrong content (event type, exit code, stdout) is a failure (`resp.failure`).

429 and 503 (and 409 `sandbox_busy`) are honoured as a trainer's client does: wait Retry-After
(1 s if absent, capped), send the SAME event again (same ce-source and ce-id, which the service's
idempotency makes safe), within bounded attempts and time. So is a request that got no reply at all
(a keep-alive connection the server closed as it was reused, a reset): the event may or may not
have run, and resending it is how a client finds out (it runs once either way). A refused connection
(nothing listens) is a failure at once. Each refused attempt is a success row
named `retry <type>` (e.g. `retry create`), apart from the outcome rows `create`, `exec`, `destroy`;
giving up is a failure of the outcome row. With `--hosts` (replicas behind a load balancer) every
request goes to the next host in turn, so consecutive steps of one episode hit different replicas.

    rollbox serve &                      # 127.0.0.1:8080
    locust -f loadtest/locustfile.py --headless --host http://127.0.0.1:8080 --server-pid $!
    ROLLBOX_LOCUST_SHAPE=none locust -f loadtest/locustfile.py --headless -u 20 -r 5 -t 2m \\
        --hosts http://127.0.0.1:8080,http://127.0.0.1:8081 --think-min-s 0.5 --think-max-s 2
    python loadtest/locustfile.py --host http://127.0.0.1:8080 --think-min-s 0 --think-max-s 0   # one episode (run_single_user)

Load shape: ROLLBOX_LOCUST_SHAPE=burst (default) plays a burst, a pause at zero users, a second
burst (`--burst-users`, `--stage-s` per stage) and ends; =none leaves Locust's own `-u -r -t`. It is
an environment variable, not a flag, because Locust picks the shape class when it imports this file,
before it parses the flags. Ramping down kills users mid-episode (their sandbox is destroyed in
on_stop); `--stop-timeout S` lets them finish their episode first.

At the end a summary is printed (episodes, retries by type and code, requests per host, the peak
memory (PSS) of `--server-pid` and all its descendants sampled every 2 s, the servers' /metrics counters
rollbox_resumes_total and rollbox_hibernations_total, or n/a) and the exit code is 1 if the outcome
rows (retry rows left out) fail more than `--max-fail-ratio` or their p99 is over `--max-p99-ms`.
Every flag also reads an environment variable: see `_flags` below (Locust's --help prints before
it imports the locustfile, so it does not list them).

Distributed, as a 100k run is driven: one master, one worker per core (`--processes -1` on one box;
`--master` / `--worker --master-host H` across boxes, as knative/loadtest/ deploys them). Each worker
sends its counters (episodes, retries by code, open episodes, its own peak RSS) with every stats
report; the master's summary sums the latest of each, beside Locust's own aggregated rows (step
p50/p99 from the `exec` row) and the open episodes sampled every 5 s. The users of one worker process
share one connection pool per host (`--connections`, 64): a trainer multiplexes its rollouts over a
client's pool, so 100k users are not 100k sockets; a user waits for a free connection, and that wait
is in its request's time. `--server-pid` takes several pids (replicas, SeaweedFS, HAProxy): the peak of
their trees' summed PSS. `--summary-json F` writes the summary for scripts (loadtest/bench_capacity.py).

    python loadtest/fleet_local.py --replicas 2 --port 18400 -- --hibernate-after-s 30 &   # prints pids
    ROLLBOX_LOCUST_SHAPE=none locust -f loadtest/locustfile.py --headless --processes -1 -u 5000 -r 50 \
        -t 10m --host http://127.0.0.1:18400 --think-min-s 60 --think-max-s 120 --server-pid P1,P2,P3,P4
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import logging
import os
import random
import resource
import shlex
import sys
import time
import urllib.request
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from email.utils import parsedate_to_datetime
from typing import Any

import gevent
import locust.argument_parser
import locust.runners
from geventhttpclient.client import HTTPClientPool
from locust import FastHttpUser, LoadTestShape, events, run_single_user, task
from locust.exception import StopUser
from locust.runners import MasterRunner, WorkerRunner
from locust.stats import RequestStats, StatsEntry

SHAPES = ("burst", "none")
SHAPE = os.environ.get("ROLLBOX_LOCUST_SHAPE", "burst")
if SHAPE not in SHAPES:
    raise SystemExit(f"ROLLBOX_LOCUST_SHAPE: {SHAPE!r} is not one of {', '.join(SHAPES)}")

PREFIX = "dev.rollbox.sandbox."
ERROR_TYPE = "dev.rollbox.error"
RETRY_ROW = "retry "  # + the request's row name: refused attempts that were retried
DEFAULT_RETRY_AFTER_S = 1.0
MIB = 1024 * 1024
# the python snapshot's default limits, sent explicitly as a trainer does: equal to the defaults,
# creates can come from the warm pool; other values load the restore path instead
LIMITS = {"memory_max_bytes": 512 * MIB, "cpu_max_cores": 1.0}
DEFAULT_IDLE_S, DEFAULT_LIFETIME_S = 300.0, 900.0  # the python snapshot's idle and lifetime limits
STATE_FILE = "trajectory.txt"
WRONG_ACTION_RATIO = 0.25  # a policy's actions are mostly right, sometimes not (exit code 1)
EXEC_TIMEOUT_S = 30.0
SERVER_METRICS = ("rollbox_resumes_total", "rollbox_hibernations_total")
NETWORK_TIMEOUT_S = 180.0  # a reply's wait: above the server's --request-deadline-s plus an exec's timeout
CONNECT_TIMEOUT_S = 10.0
OPEN_SAMPLE_S = 5.0  # open episodes are sampled this often for the summary's series

log = logging.getLogger("rollbox.locust")

# Locust (2.47) rebuilds its whole argument parser once per option for every spawn message a worker
# gets (runners.py: `k not in argument_parser.default_args_dict()` inside a comprehension): with
# --processes and a long ramp that was over half of each worker's CPU (py-spy), taken from the
# server it measures. The defaults do not change while it runs, so build them once.
if not hasattr(locust.argument_parser.default_args_dict, "cache_info"):
    locust.argument_parser.default_args_dict = functools.cache(locust.argument_parser.default_args_dict)

# It also counts a worker's users by class by walking every user's greenlet (Runner.user_classes_count),
# seven times per spawn message (start_worker compares, spawn_users logs, spawning_complete asserts and
# reports it) and once per stats report: ~28 ms a walk at 50,000 users per worker, so ~0.2 cores per worker
# at the end of a 100 users/s ramp, taken from the box it measures while its steps begin. A worker here
# runs one user class, whose count is the size of its users' greenlet group (a user's greenlet leaves the
# group when it ends, in the event loop's next turn: until then the walk skips it and this counts it).
_walk_user_classes_count = locust.runners.Runner.user_classes_count


def _user_classes_count(self: locust.runners.Runner) -> dict[str, int]:
    if len(self.user_classes) != 1:
        return _walk_user_classes_count.fget(self)  # type: ignore[no-any-return]
    return {self.user_classes[0].__name__: len(self.user_greenlets)}


locust.runners.Runner.user_classes_count = property(_user_classes_count)  # type: ignore[method-assign,assignment]


@events.init_command_line_parser.add_listener
def _flags(parser: Any) -> None:
    def flag(name: str, env: str, kind: type, default: Any, text: str) -> None:
        parser.add_argument(name, type=kind, default=default, env_var=env, help=f"{text} (env {env}; default {default})")

    flag("--think-min-s", "ROLLBOX_LOCUST_THINK_MIN_S", float, 2.0, "shortest think time before a step or episode")
    flag("--think-max-s", "ROLLBOX_LOCUST_THINK_MAX_S", float, 10.0, "longest think time (uniform between the two)")
    flag("--steps", "ROLLBOX_LOCUST_STEPS", int, 3, "exec steps per episode")
    flag("--episodes", "ROLLBOX_LOCUST_EPISODES", int, None, "episodes per user, then it stops (default: until the end)")
    flag("--hosts", "ROLLBOX_LOCUST_HOSTS", str, "", "comma-separated replicas, used in turn (default: --host)")
    flag("--retry-attempts", "ROLLBOX_LOCUST_RETRY_ATTEMPTS", int, 5, "attempts per event on 429/503/409 busy/no reply")
    flag("--retry-budget-s", "ROLLBOX_LOCUST_RETRY_BUDGET_S", float, 60.0, "time per event for its retries")
    flag("--retry-after-max-s", "ROLLBOX_LOCUST_RETRY_AFTER_MAX_S", float, 10.0, "cap on one Retry-After wait")
    flag("--max-fail-ratio", "ROLLBOX_LOCUST_MAX_FAIL_RATIO", float, 0.01, "exit 1 above this failure ratio")
    flag("--max-p99-ms", "ROLLBOX_LOCUST_MAX_P99_MS", float, 5000.0, "exit 1 above this p99")
    flag("--server-pid", "ROLLBOX_LOCUST_SERVER_PID", str, "",
         "comma-separated pids (the targets: replicas, the store, the load balancer): the peak memory (PSS) of "
         "them and their descendants is reported")
    flag("--connections", "ROLLBOX_LOCUST_CONNECTIONS", int, 64,
         "connections per host shared by all users of a worker process (a trainer's pool); 0: one pool per user")
    flag("--summary-json", "ROLLBOX_LOCUST_SUMMARY_JSON", str, "", "also write the summary as JSON to this file")
    flag("--experiment", "ROLLBOX_LOCUST_EXPERIMENT", str, "locust", "the experiment label of every episode")
    flag("--step-log", "ROLLBOX_LOCUST_STEP_LOG", str, "",
         "each worker process appends a line per exec step to FILE.<pid>: the Unix time it was first sent, its "
         "round trip in ms (retries included) and its final HTTP status (0: none), for windows of the run")
    flag("--burst-users", "ROLLBOX_LOCUST_USERS", int, 50, "users in each burst of the burst shape")
    flag("--stage-s", "ROLLBOX_LOCUST_STAGE_S", float, 30.0, "seconds per stage of the burst shape")


@dataclass(frozen=True)
class Settings:
    """The flags, checked; a bad value is an error that names its flag."""

    think_min_s: float
    think_max_s: float
    steps: int
    episodes: int | None
    hosts: tuple[str, ...]  # empty: Locust's --host
    retry_attempts: int
    retry_budget_s: float
    retry_after_max_s: float
    max_fail_ratio: float
    max_p99_ms: float
    server_pids: tuple[int, ...]
    experiment: str = "locust"
    connections: int = 64
    step_log: str = ""

    @classmethod
    def of(cls, o: Any) -> Settings:
        hosts = tuple(h.strip().rstrip("/") for h in o.hosts.split(",") if h.strip())
        pids = [p.strip() for p in str(o.server_pid or "").split(",") if p.strip()]
        checks = [
            (o.think_min_s >= 0, "--think-min-s must be >= 0"),
            (o.think_max_s >= o.think_min_s, "--think-max-s must be >= --think-min-s"),
            (o.steps >= 1, "--steps must be >= 1"),
            (o.episodes is None or o.episodes >= 1, "--episodes must be >= 1"),
            (all(h.startswith(("http://", "https://")) for h in hosts), "--hosts: each must start with http(s)://"),
            (o.retry_attempts >= 1, "--retry-attempts must be >= 1 (1: no retry)"),
            (o.retry_budget_s >= 0 and o.retry_after_max_s >= 0, "--retry-budget-s/--retry-after-max-s must be >= 0"),
            (0 <= o.max_fail_ratio <= 1, "--max-fail-ratio must be in [0, 1]"),
            (all(p.isdigit() and int(p) > 0 for p in pids), "--server-pid: each must be a pid > 0"),
            (o.connections >= 0, "--connections must be >= 0"),
            (o.burst_users >= 1 and o.stage_s > 0, "--burst-users must be >= 1 and --stage-s > 0"),
        ]
        if problems := [text for ok, text in checks if not ok]:
            raise ValueError("; ".join(problems))
        return cls(o.think_min_s, o.think_max_s, o.steps, o.episodes, hosts, o.retry_attempts, o.retry_budget_s,
                   o.retry_after_max_s, o.max_fail_ratio, o.max_p99_ms, tuple(int(p) for p in pids), o.experiment,
                   o.connections, o.step_log)


@dataclass
class Tally:
    """This process's counters for the summary (Locust's own stats hold the rows). Each worker sends
    its own, whole, with every stats report; the master sums the latest of each worker."""

    episodes_done: int = 0
    episodes_cut: int = 0  # ended early: a failure, a gone sandbox, or the user was stopped
    open: int = 0  # episodes created and not yet destroyed (their sandboxes exist now)
    open_peak: int = 0
    retries: Counter[str] = field(default_factory=Counter)  # "exec 429 overloaded" -> n
    gave_up: Counter[str] = field(default_factory=Counter)
    per_host: Counter[int] = field(default_factory=Counter)  # position in --hosts -> requests
    rss_peak_bytes: int = 0  # this Locust process's own peak resident memory

    def opened(self, n: int) -> None:
        self.open += n
        self.open_peak = max(self.open_peak, self.open)

    def as_dict(self) -> dict[str, Any]:
        self.rss_peak_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return {"episodes_done": self.episodes_done, "episodes_cut": self.episodes_cut, "open": self.open,
                "open_peak": self.open_peak, "retries": dict(self.retries), "gave_up": dict(self.gave_up),
                "per_host": {str(k): v for k, v in self.per_host.items()}, "rss_peak_bytes": self.rss_peak_bytes}

    @classmethod
    def total(cls, parts: list[dict[str, Any]]) -> Tally:
        t = cls()
        for d in parts:
            t.episodes_done += d["episodes_done"]
            t.episodes_cut += d["episodes_cut"]
            t.open += d["open"]
            t.open_peak += d["open_peak"]  # (each worker's own peak: an upper bound of the sum's)
            t.retries.update(d["retries"])
            t.gave_up.update(d["gave_up"])
            t.per_host.update({int(k): v for k, v in d["per_host"].items()})
            t.rss_peak_bytes += d["rss_peak_bytes"]
        return t


TALLY = Tally()
STEP_LOG: list[Any] = []  # this process's --step-log file, once opened


def _log_step(path: str, sent_at: float, ms: float, status: int) -> None:
    """One exec step's line in this process's own file (line-buffered: a worker may end by os._exit)."""
    if not STEP_LOG:
        STEP_LOG.append(open(f"{path}.{os.getpid()}", "a", buffering=1))  # noqa: SIM115 - the process's life
    STEP_LOG[0].write(f"{sent_at:.3f},{ms:.1f},{status}\n")


WORKER_TALLIES: dict[str, dict[str, Any]] = {}  # on the master: each worker's latest report
OPEN_SERIES: list[tuple[float, int]] = []  # on the master (or alone): (seconds since start, open episodes)


@dataclass(frozen=True)
class Outcome:
    status: int  # 0: no HTTP reply
    data: dict[str, Any] | None  # the reply's data, when it was the right event with the right content


@dataclass(frozen=True)
class Action:
    """One step of the policy: append a line to the state file, print the file's sha256."""

    data: dict[str, Any]
    exit_code: int
    trajectory: bytes  # the state file's content after this step

    @classmethod
    def next(cls, step: int, episode: str, before: bytes) -> Action:
        line = f"step {step} of {episode}: {uuid.uuid4().hex[:8]}"
        wrong = random.random() < WRONG_ACTION_RATIO
        if step % 2:
            code = (f"import hashlib\nwith open({STATE_FILE!r}, 'a') as f:\n    f.write({line!r} + '\\n')\n"
                    f"print(hashlib.sha256(open({STATE_FILE!r}, 'rb').read()).hexdigest())\n")
            data: dict[str, Any] = {"code": code + ("assert False, 'wrong answer'\n" if wrong else "")}
        else:
            command = f"printf '%s\\n' {shlex.quote(line)} >> {STATE_FILE} && sha256sum {STATE_FILE} | cut -d' ' -f1"
            data = {"command": command + (" && exit 1" if wrong else "")}
        return cls({**data, "timeout_s": EXEC_TIMEOUT_S}, int(wrong), before + line.encode() + b"\n")

    def check(self, r: dict[str, Any]) -> str | None:
        want = hashlib.sha256(self.trajectory).hexdigest() + "\n"
        if r.get("timed_out"):
            return "timed out"
        if r.get("exit_code") != self.exit_code:
            return f"exit code {r.get('exit_code')}, wanted {self.exit_code}; stderr {str(r.get('stderr'))[-200:]!r}"
        if r.get("stdout") != want:
            lines = self.trajectory.count(b"\n")
            return f"stdout {str(r.get('stdout'))[:80]!r} is not the sha256 of the {lines}-line state file: state lost?"
        return None


def _created(r: dict[str, Any]) -> str | None:
    return None if isinstance(r.get("sandbox_id"), str) and r["sandbox_id"] else "no sandbox_id in the reply"


def _retry_after_s(headers: Any, cap_s: float) -> float:
    """Retry-After in seconds (delta-seconds or an HTTP date), 1 s if absent or unreadable, capped."""
    raw = headers.get("retry-after")
    wait = DEFAULT_RETRY_AFTER_S
    if raw:
        try:
            wait = float(raw)
        except ValueError:
            try:
                wait = parsedate_to_datetime(raw).timestamp() - time.time()
            except (TypeError, ValueError):
                pass
    return min(max(wait, 0.0), cap_s)


def _error(body: bytes) -> tuple[str, str]:
    """(code, message) of a dev.rollbox.error reply's data, or ("", the start of the body)."""
    try:
        data = json.loads(body)
        return str(data.get("code", "")), str(data.get("message", ""))
    except (ValueError, AttributeError):
        return "", body[:200].decode(errors="replace")


def _retryable(status: int, code: str) -> bool:
    # status 0: no reply (the connection closed or reset); resending the same event is safe
    return status in (429, 503) or (status == 0 and code == "no_reply") or (status == 409 and code == "sandbox_busy")


class EpisodeUser(FastHttpUser):
    _numbers = itertools.count()

    def on_start(self) -> None:
        self.cfg = Settings.of(self.environment.parsed_options)
        self.hosts = self.cfg.hosts or (str(self.host).rstrip("/"),)
        self.turn = next(self._numbers)  # users start at different hosts, then take them in turn
        self.episodes = 0
        self.live: str | None = None  # the sandbox to destroy if the user is stopped mid-episode

    def limits(self) -> dict[str, Any]:
        """LIMITS, with the idle and lifetime limits raised when the think times outlast them (a trainer
        thinking 10-20 min between steps must, or its sandboxes expire while it thinks). Limits other
        than the snapshot's defaults are not served from its warm pool: such creates and resumes restore."""
        lim: dict[str, Any] = dict(LIMITS)
        # a think, and as long again for the step's own wait and retries: on a saturated fleet, or through a
        # scale-to-zero wave, minutes (at 20,000 users thinking 2-4 min on 2 cores, a think + 60 s let some
        # sandboxes expire); short thinks keep the snapshot's limits (their waits are seconds)
        idle_s = 2 * self.cfg.think_max_s + 60
        lifetime_s = self.cfg.steps * self.cfg.think_max_s + 120
        if idle_s > DEFAULT_IDLE_S or lifetime_s > DEFAULT_LIFETIME_S:  # then with room to spare
            lim["idle_s"] = min(max(1.5 * idle_s, DEFAULT_IDLE_S), 24 * 3600)
            lim["lifetime_s"] = min(max(1.5 * lifetime_s, DEFAULT_LIFETIME_S), 7 * 24 * 3600)
        return lim

    def wait_time(self) -> float:
        return self.think_s()

    def think_s(self) -> float:
        return random.uniform(self.cfg.think_min_s, self.cfg.think_max_s)

    def next_host(self) -> tuple[int, str]:
        slot = self.turn % len(self.hosts)
        self.turn += 1
        return slot, self.hosts[slot]

    def send(self, kind: str, data: dict[str, Any], reply: str,
             check: Callable[[dict[str, Any]], str | None] | None = None) -> Outcome:
        """POST one CloudEvent, retried with the same (source, id) while refused; the reply must be
        `reply` and pass `check`, or the request fails."""
        headers = {
            "ce-specversion": "1.0",
            "ce-type": PREFIX + kind,
            "ce-source": "/loadtest/locust",
            "ce-id": uuid.uuid4().hex,
            "content-type": "application/json",
        }
        body = json.dumps(data)
        started = time.monotonic()
        for attempt in itertools.count(1):
            slot, host = self.next_host()
            with self.client.post(host + "/", data=body, headers=headers, name=kind, catch_response=True) as resp:
                TALLY.per_host[slot] += 1
                status, reply_headers, raw = resp.status_code or 0, resp.headers or {}, resp.content or b""
                ce_type = reply_headers.get("ce-type")
                if status == 0:
                    refused = isinstance(getattr(resp, "error", None), ConnectionRefusedError)
                    code, message = "refused" if refused else "no_reply", repr(getattr(resp, "error", None))
                else:
                    code, message = _error(raw) if ce_type == ERROR_TYPE or status != 200 else ("", "")
                if not _retryable(status, code):
                    return self._judge(resp, status, ce_type, raw, code, message, reply, check)
                wait_s = _retry_after_s(reply_headers, self.cfg.retry_after_max_s)
                elapsed_s = time.monotonic() - started
                if attempt >= self.cfg.retry_attempts or elapsed_s + wait_s > self.cfg.retry_budget_s:
                    TALLY.gave_up[f"{kind} {status} {code}"] += 1
                    resp.failure(f"gave up after {attempt} attempts in {elapsed_s:.1f} s: HTTP {status} {code}")
                    return Outcome(status, None)
                TALLY.retries[f"{kind} {status} {code}"] += 1
                resp.request_meta["name"] = RETRY_ROW + kind  # its own row in the stats, not a failure
                resp.success()
            gevent.sleep(wait_s)
        raise AssertionError("unreachable")

    @staticmethod
    def _judge(resp: Any, status: int, ce_type: str | None, raw: bytes, code: str, message: str, reply: str,
               check: Callable[[dict[str, Any]], str | None] | None) -> Outcome:
        if status == 0:
            resp.failure(f"no reply: {getattr(resp, 'error', None)!r}")
            return Outcome(status, None)
        if status != 200 or ce_type != PREFIX + reply:
            resp.failure(f"HTTP {status} {ce_type}: {code} {message[:200]}".rstrip())
            return Outcome(status, None)
        try:
            data = json.loads(raw)
        except ValueError:
            data = None
        if not isinstance(data, dict):
            resp.failure("reply data is not a JSON object")
            return Outcome(status, None)
        if check is not None and (problem := check(data)):
            resp.failure(problem)
            return Outcome(status, None)
        return Outcome(status, data)

    @task
    def episode(self) -> None:
        if self.play_episode():
            TALLY.episodes_done += 1
        else:
            TALLY.episodes_cut += 1
        self.episodes += 1
        if self.cfg.episodes is not None and self.episodes >= self.cfg.episodes:
            raise StopUser()

    def play_episode(self) -> bool:
        """create, steps, destroy; True if every request passed."""
        episode = uuid.uuid4().hex[:12]
        meta = {"experiment": self.cfg.experiment, "episode": episode}
        created = self.send("create", {"snapshot": "python", "metadata": meta, "limits": self.limits()}, "created",
                            _created)
        if created.data is None:
            return False
        sid = self.live = created.data["sandbox_id"]
        TALLY.opened(1)
        trajectory, replied, unanswered, complete = b"", 0, 0, True
        for step in range(1, self.cfg.steps + 1):
            gevent.sleep(self.think_s())  # the model writes its next action
            action = Action.next(step, episode, trajectory)
            sent_at, t0 = time.time(), time.monotonic()
            out = self.send("exec", {"sandbox_id": sid, **action.data}, "result", action.check)
            if self.cfg.step_log:
                _log_step(self.cfg.step_log, sent_at, (time.monotonic() - t0) * 1000, out.status)
            replied += out.status == 200
            unanswered += out.status == 0
            if out.status == 410:  # sandbox_gone / sandbox_died: destroyed or expired, nothing to destroy
                self.live = None
                TALLY.opened(-1)
                return False
            if out.data is None:
                complete = False
                break
            trajectory = action.trajectory

        def usage(r: dict[str, Any]) -> str | None:
            if r.get("sandbox_id") != sid:
                return f"destroyed {r.get('sandbox_id')!r}, not {sid!r}"
            execs = r.get("execs")
            if not isinstance(execs, int) or not replied <= execs <= replied + unanswered:
                return f"usage counts {execs} execs, {replied} were answered"
            return None

        # the trainer's score of the episode, recorded with its trajectory: here, every step answered right
        outcome = {"reward": 1.0 if complete and replied == self.cfg.steps else 0.0}
        done = self.send("destroy", {"sandbox_id": sid, "outcome": outcome}, "destroyed", usage)
        self.live = None
        TALLY.opened(-1)
        return complete and done.data is not None

    def on_stop(self) -> None:
        if getattr(self, "live", None) is not None:  # stopped mid-episode: do not leave the sandbox to its idle timeout
            sid, self.live = self.live, None
            TALLY.episodes_cut += 1
            self.send("destroy", {"sandbox_id": sid}, "destroyed")
            TALLY.opened(-1)


class BurstAndScaleToZero(LoadTestShape):
    """A training burst, a pause at zero users (the warm pool drains), a second burst, then stop."""

    abstract = SHAPE != "burst"  # not a shape at all with ROLLBOX_LOCUST_SHAPE=none: -u -r -t apply

    def tick(self) -> tuple[int, float] | None:
        opts = self.runner.environment.parsed_options
        users, stage_s = opts.burst_users, opts.stage_s
        stages = ((users, max(1.0, users / 5)), (0, float(users)), (users, float(users)))  # sudden after idling
        stage = int(self.get_run_time() // stage_s)
        return stages[stage] if stage < len(stages) else None


def _proc_tree_pss_bytes(root: int) -> int | None:
    """The summed PSS of `root` and all its descendants (each shared page split between the processes
    that map it, so the zygote's heap that every sandbox shares counts once, not once per sandbox, as
    RSS would); None if `root` is gone."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/stat") as f:
                    ppid = int(f.read().rpartition(")")[2].split()[1])
            except (OSError, IndexError, ValueError):
                continue  # ended while we looked
            children.setdefault(ppid, []).append(int(entry.name))
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                pss_kb = next((int(line.split()[1]) for line in f if line.startswith("Pss:")), 0)
        except OSError:
            if pid == root:
                return None
            continue
        total += pss_kb * 1024
        todo.extend(children.get(pid, ()))
    return total


class MemorySampler:
    """Samples the PSS of process trees every 2 s (5 s for more than one) in a greenlet; keeps the peak
    of their sum and of each."""

    def __init__(self, pids: tuple[int, ...]) -> None:
        self.pids = pids
        self.peak_bytes = 0
        self.peaks = dict.fromkeys(pids, 0)
        self.samples = 0
        self.greenlet = gevent.spawn(self._run)

    def _run(self) -> None:
        while True:
            found = {pid: pss for pid in self.pids if (pss := _proc_tree_pss_bytes(pid)) is not None}
            if found:
                self.peak_bytes = max(self.peak_bytes, sum(found.values()))
                for pid, pss in found.items():
                    self.peaks[pid] = max(self.peaks[pid], pss)
                self.samples += 1
            gevent.sleep(2.0 if len(self.pids) == 1 else 5.0)

    def report(self) -> str:
        if not self.samples:
            return f"n/a (no process {', '.join(map(str, self.pids))})"
        if len(self.pids) == 1:
            return (f"{self.peak_bytes / MIB:.1f} MiB (pid {self.pids[0]} and descendants, peak of {self.samples} "
                    "samples)")
        each = ", ".join(f"{pid} {peak / MIB:.1f}" for pid, peak in self.peaks.items())
        return (f"{self.peak_bytes / MIB:.1f} MiB (pids {', '.join(map(str, self.pids))} and descendants, peak of the "
                f"sum over {self.samples} samples; each tree's peak MiB: {each})")


SAMPLER: list[MemorySampler | None] = []  # the one sampler of this process, once the test started
OPEN_SAMPLER: list[gevent.Greenlet] = []


@events.init.add_listener
def _check_flags(environment: Any, **_: Any) -> None:
    if environment.parsed_options is None:
        return
    try:
        cfg = Settings.of(environment.parsed_options)
    except ValueError as exc:
        log.error("rollbox locustfile: %s", exc)
        sys.exit(2)
    if cfg.hosts and not environment.host:
        environment.host = cfg.hosts[0]  # Locust wants a base host; every request names its own
    if cfg.connections and EpisodeUser.client_pool is None:
        # one pool per process, shared by its users: a user waits for a free connection as a trainer's
        # rollout workers do for its client's pool, so 100k users are not 100k sockets
        EpisodeUser.client_pool = HTTPClientPool(concurrency=cfg.connections, network_timeout=NETWORK_TIMEOUT_S,
                                                 connection_timeout=CONNECT_TIMEOUT_S)


@events.report_to_master.add_listener
def _tally_to_master(client_id: str, data: dict[str, Any], **_: Any) -> None:
    data["rollbox_tally"] = TALLY.as_dict()


@events.worker_report.add_listener
def _tally_from_worker(client_id: str, data: dict[str, Any], **_: Any) -> None:
    if "rollbox_tally" in data:
        WORKER_TALLIES[client_id] = data["rollbox_tally"]


def _tally(environment: Any) -> Tally:
    """Every worker's counters summed on the master; this process's own when it runs the users."""
    if isinstance(environment.runner, MasterRunner):
        return Tally.total(list(WORKER_TALLIES.values()))
    TALLY.as_dict()
    return TALLY


def _sample_open(environment: Any) -> None:
    t0 = time.monotonic()
    while True:
        OPEN_SERIES.append((time.monotonic() - t0, _tally(environment).open))
        gevent.sleep(OPEN_SAMPLE_S)


@events.test_start.add_listener
def _start_sampler(environment: Any, **_: Any) -> None:
    opts = environment.parsed_options
    if opts is None or isinstance(environment.runner, WorkerRunner) or SAMPLER:
        return
    SAMPLER.append(MemorySampler(Settings.of(opts).server_pids) if opts.server_pid else None)
    OPEN_SAMPLER.append(gevent.spawn(_sample_open, environment))


def _server_counters(host: str) -> str:
    try:
        with urllib.request.urlopen(host + "/metrics", timeout=5) as r:
            text = r.read().decode(errors="replace")
    except OSError as exc:
        return ", ".join(f"{name} n/a" for name in SERVER_METRICS) + f" (/metrics: {exc})"
    values: dict[str, float] = {}
    for line in text.splitlines():
        name, _, rest = line.partition(" ")
        name = name.partition("{")[0]
        if name in SERVER_METRICS:
            values[name] = values.get(name, 0.0) + float(rest.split()[0])
    return ", ".join(f"{name} {values[name]:g}" if name in values else f"{name} n/a" for name in SERVER_METRICS)


def _outcome_rows(stats: RequestStats) -> StatsEntry:
    """All rows but the retry rows, merged: what the thresholds judge."""
    merged = StatsEntry(stats, "outcomes", "", use_response_times_cache=False)
    for entry in stats.entries.values():
        if not entry.name.startswith(RETRY_ROW):
            merged.extend(entry)
    return merged


@events.quitting.add_listener
def _summary_and_thresholds(environment: Any, **_: Any) -> None:
    if isinstance(environment.runner, WorkerRunner) or environment.parsed_options is None:
        return
    cfg = Settings.of(environment.parsed_options)
    hosts = cfg.hosts or ((environment.host or "").rstrip("/"),)
    for g in [s.greenlet for s in SAMPLER if s is not None] + OPEN_SAMPLER:
        g.kill(block=False)
    tally = _tally(environment)
    rows = _outcome_rows(environment.stats)
    p99 = rows.get_response_time_percentile(0.99) or 0
    retried = sum(e.num_requests for e in environment.stats.entries.values() if e.name.startswith(RETRY_ROW))
    step = environment.stats.entries.get(("exec", "POST"))
    step_p50 = step.get_response_time_percentile(0.5) if step and step.num_requests else None
    step_p99 = step.get_response_time_percentile(0.99) if step and step.num_requests else None
    workers = len(WORKER_TALLIES) if isinstance(environment.runner, MasterRunner) else 1
    memory = SAMPLER[0].report() if SAMPLER and SAMPLER[0] is not None else "n/a (no --server-pid)"
    series = OPEN_SERIES[:: max(1, len(OPEN_SERIES) // 12)]
    series += [p for p in OPEN_SERIES[-1:] if p not in series]
    open_peak = max((n for _, n in OPEN_SERIES), default=tally.open)

    def counts(c: Counter[str]) -> str:
        return ", ".join(f"{k} x{n}" for k, n in sorted(c.items())) or "none"

    def ms(v: float | None) -> str:
        return "n/a" if v is None else f"{v:.0f} ms"

    print("rollbox locust summary")
    print(f"  users' processes: {workers} (counters summed over them)")
    print(f"  episodes: {tally.episodes_done} complete, {tally.episodes_cut} cut short")
    print(f"  requests: {rows.num_requests}, {rows.num_failures} failed ({rows.fail_ratio:.2%}), p99 {p99:.0f} ms"
          " (retry rows left out)")
    print(f"  steps (exec): {step.num_requests if step else 0}, p50 {ms(step_p50)}, p99 {ms(step_p99)}")
    print(f"  retries: {retried} ({counts(tally.retries)}); gave up: {counts(tally.gave_up)}")
    print(f"  open episodes: peak {open_peak} (sampled every {OPEN_SAMPLE_S:g} s), at the end {tally.open}; over time: "
          + " ".join(f"{t:.0f}s:{n}" for t, n in series))
    print("  hosts: " + "; ".join(f"#{i + 1} {h} {tally.per_host[i]} requests" for i, h in enumerate(hosts)))
    print(f"  server peak memory (PSS): {memory}")
    print(f"  locust peak memory (RSS): users' processes {tally.rss_peak_bytes / MIB:.1f} MiB summed"
          + (f", master {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.1f} MiB"
             if isinstance(environment.runner, MasterRunner) else ""))
    for host in dict.fromkeys(hosts):
        print(f"  server {host}: {_server_counters(host)}")
    if environment.parsed_options.summary_json:
        summary = {
            "processes": workers, "episodes_done": tally.episodes_done, "episodes_cut": tally.episodes_cut,
            "requests": rows.num_requests, "failures": rows.num_failures, "p99_ms": p99, "retries": retried,
            "retries_by_code": dict(tally.retries), "gave_up": dict(tally.gave_up),
            "steps": step.num_requests if step else 0, "step_p50_ms": step_p50, "step_p99_ms": step_p99,
            "open_peak": open_peak, "open_series": OPEN_SERIES, "targets_peak_pss_bytes":
            SAMPLER[0].peak_bytes if SAMPLER and SAMPLER[0] is not None else None,
            "locust_rss_peak_bytes": tally.rss_peak_bytes, "per_host": dict(tally.per_host),
        }
        with open(environment.parsed_options.summary_json, "w") as f:
            json.dump(summary, f)

    problems = []
    if rows.num_requests == 0:
        problems.append("no requests were made")
    if rows.fail_ratio > cfg.max_fail_ratio:
        problems.append(f"fail ratio {rows.fail_ratio:.3f} > {cfg.max_fail_ratio}")
    if p99 > cfg.max_p99_ms:
        problems.append(f"p99 {p99:.0f} ms > {cfg.max_p99_ms:.0f} ms")
    if problems:
        print("rollbox locust thresholds failed: " + "; ".join(problems))
        environment.process_exit_code = 1


if __name__ == "__main__":
    # one user, one episode, requests printed: for the debugger (flags as for locust, e.g. --host, --think-min-s 0 --think-max-s 0)
    os.environ.setdefault("ROLLBOX_LOCUST_EPISODES", "1")
    EpisodeUser.host = os.environ.get("ROLLBOX_URL", "http://127.0.0.1:8080")
    run_single_user(EpisodeUser)
