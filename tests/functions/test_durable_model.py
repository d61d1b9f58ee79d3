"""Model-based test of the durable semantics (issue 25.1): a Hypothesis state machine whose rules are
what the world does to real `rollbox serve` replicas sharing one real SeaweedFS, checked after every
rule against a model of what each sandbox must hold.

The world (rules), through HTTP with CloudEvents built by the SDK:
    step            an exec on any replica that writes, appends, deletes, renames, chmods, hard-links and
                    symlinks files (small ones inline in the records, large ones blobs) and lists them
                    all; some write a file through the exec's ``files`` or read back with ``read_files``
    burst           steps on several sandboxes at once, through any replicas
    resend          an acknowledged event (create, exec, fork, snapshot, destroy) sent again, to any
                    replica; ``resend_altered``: its identity with other content
    duplicate       one event delivered twice at once, to two replicas (or one)
    race            two events on one sandbox at once through two replicas: an exec, and an exec, a fork
                    or a destroy; the loser is sometimes retried, as its 409 asks
    kill -9         of a replica, idle or with an exec, fork, create or destroy in flight (whose client
                    then sends it elsewhere), restarted on the same home
    drain           SIGTERM with a step in flight, exit 0, restarted (on a fresh home or the same)
    hibernate       replica 1 runs with --max-live 2 (pressure), replica 2 with --hibernate-after-s 1
                    (the `idle` rule lets its live copies hibernate; the next step there passes through)
    lifetimes       sandboxes made with a 2 or 4 s lifetime: 410 once it passed, on every replica
                    (replica 0 sweeps the store every 2 s)
    timeouts        a step killed at its timeout (what it wrote before is kept)
    fork, snapshot  and a sandbox created from that snapshot (its files in a lower layer: copy-up,
                    whiteouts and opaque directories over it)
    destroy         then every replica answers 410 for it; a destroy again returns the same record
    store hiccup    SeaweedFS stopped (SIGSTOP) for a moment while a step is in flight; with
                    ROLLBOX_MODEL_OUTAGES=1 also past the store deadline: 503, the client retries

The model: each sandbox's files (contents and modes, hard links as overlayfs keeps them over snapshot
layers, symlinks, the directory), whether it ended, how many execs it acknowledged; each acknowledged
event's first reply. Checked after every rule: every acknowledged step's effect is there exactly once
(every exec appends its own token to a journal file and lists all files; the listing must be the
model's), never a 500 (replies, and errors in the replicas' logs), a re-sent event's reply is the first
one, racing steps give one 200 and 409 sandbox_busy for the other (or two 200 in some order when they
did not overlap), an ended sandbox is 410 on every replica, and its usage counts the model's execs.

CI runs a bounded, derandomized number of sequences (ROLLBOX_MODEL_EXAMPLES, ROLLBOX_MODEL_STEPS);
loadtest/durable_model_long.py runs many random ones. Rules draw sandboxes by index with fixed bounds
(and preconditions count rules, not outcomes): real replicas are not deterministic, and Hypothesis
calls a sequence's data generation flaky if what it may draw depends on what happened.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import httpx
import pytest
from cloudevents.http import CloudEvent
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from svc_testkit import SERVE, Reply, ServerProc, encode, event, metric, parse

from tests.snapshots.s3server import ACCESS_KEY, SECRET_KEY, SeaweedS3

pytestmark = pytest.mark.slow

CREATE, EXEC, DESTROY, FORK, SNAPSHOT = (f"dev.rollbox.sandbox.{t}"
                                         for t in ("create", "exec", "destroy", "fork", "snapshot"))
SOURCE = "/tests/durable-model"
# replica i's flags: 0 sweeps the store every 2 s (expiring sandboxes as steps run), 1 hibernates under
# pressure (two live sandboxes), 2 after a second idle
REPLICA_ARGS: tuple[tuple[str, ...], ...] = (("--sweep-interval-s", "2"), ("--max-live", "2"),
                                             ("--hibernate-after-s", "1"))
MAX_LIVE = (256, 2, 256)

# ------------------------------------------------------------------------------------------ the world


class Replica:
    """One `rollbox serve` on the shared store. Started without waiting: ``url`` waits until it listens,
    so a restart overlaps the rules that use the other replicas."""

    def __init__(self, base: Path, index: int, env: dict[str, str]):
        self.base = base
        self.index = index
        self.env = env
        self.args = REPLICA_ARGS[index]
        self.home = base / f"home-{index}-0"
        self.srv: ServerProc | None = None
        self.logs: list[tuple[Path, int]] = []  # every log this replica wrote, and how far it was read
        self.launches = 0

    def launch(self, fresh_home: bool = False) -> None:
        assert self.srv is None or not self.srv.alive()
        if fresh_home:
            self.home = self.base / f"home-{self.index}-{self.launches}"
        self.launches += 1
        log_path = self.base / f"replica-{self.index}-{self.launches}.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLBOX_") and k not in ("PORT", "HOST")}
        env.update(self.env)
        with open(log_path, "wb") as log:
            proc = subprocess.Popen([*SERVE, "--port", "0", "--home", str(self.home), *self.args],
                                    stdout=log, stderr=subprocess.STDOUT, env=env)
        self.srv = ServerProc(proc, log_path)
        self.logs.append((log_path, 0))

    @property
    def url(self) -> str:
        srv = self.srv
        assert srv is not None
        deadline = time.monotonic() + 90
        while not srv.url:
            for rec in srv.log_records():
                if rec.get("msg") == "listening":
                    srv.port = int(rec["port"])
                    srv.url = f"http://127.0.0.1:{srv.port}/"
            if srv.url:
                break
            if srv.proc.poll() is not None:
                raise AssertionError(f"replica {self.index} exited with {srv.proc.returncode}:\n"
                                     f"{srv.log_path.read_text()[-4000:]}")
            assert time.monotonic() < deadline, f"replica {self.index} did not start:\n{srv.log_path.read_text()}"
            time.sleep(0.02)
        return srv.url

    def kill9(self) -> None:
        assert self.srv is not None
        self.url  # noqa: B018 - a replica killed while starting would leave nothing to test
        os.kill(self.srv.pid, signal.SIGKILL)
        self.srv.proc.wait(10)

    def drain(self) -> int:
        """SIGTERM; its exit status."""
        assert self.srv is not None
        self.url  # noqa: B018
        os.kill(self.srv.pid, signal.SIGTERM)
        return self.srv.proc.wait(60)

    def stop(self) -> int | None:
        if self.srv is None:
            return None
        return self.srv.stop()

    def new_log_records(self) -> list[dict[str, Any]]:
        out = []
        for n, (path, offset) in enumerate(self.logs):
            with contextlib.suppress(FileNotFoundError), open(path, "rb") as f:
                f.seek(offset)
                data = f.read()
                cut = data.rfind(b"\n") + 1  # whole lines only
                self.logs[n] = (path, offset + cut)
                for line in data[:cut].splitlines():
                    try:
                        out.append(json.loads(line))
                    except ValueError:
                        out.append({"raw": line.decode(errors="replace")})
        return out


class Cluster:
    """Replicas sharing one SeaweedFS bucket (as Knative replicas share S3), and an HTTP client."""

    def __init__(self, seaweed: SeaweedS3, base: Path, n: int = len(REPLICA_ARGS)):
        self.seaweed = seaweed
        base.mkdir(parents=True, exist_ok=True)
        self.bucket = bucket = seaweed.new_bucket()
        env = {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_REGION": "us-east-1",
               "ROLLBOX_STORE": f"s3://{bucket}/rb", "AWS_ENDPOINT_URL": seaweed.endpoint,
               "ROLLBOX_S3_MAX_ATTEMPTS": "2"}
        self.replicas = [Replica(base, i, env) for i in range(n)]
        for r in self.replicas:
            r.launch()
        self.http = httpx.Client(timeout=httpx.Timeout(10.0, read=120.0))
        self.pool = ThreadPoolExecutor(4, thread_name_prefix="model-client")

    def children_in_store(self, parent: str) -> list[str]:
        """The sandboxes whose first record in the store says they were forked from ``parent``."""
        s3 = self.seaweed.client()
        found = []
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix="rb/sandboxes/"):
            for obj in page.get("Contents", []):
                if obj["Key"].endswith("/0000000000.json"):
                    body = s3.get_object(Bucket=self.bucket, Key=obj["Key"])["Body"].read()
                    if json.loads(body.split(b"\n", 1)[0]).get("forked_from") == parent:
                        found.append(obj["Key"].split("/")[2])
        return sorted(found)

    def send(self, i: int, ev: CloudEvent, mode: str = "binary") -> Reply | None:
        """The reply, or None if the connection broke (the replica was killed meanwhile)."""
        headers, body = encode(ev, mode)
        url = self.replicas[i].url
        try:
            return parse(self.http.post(url, headers=headers, content=body))
        except (httpx.TransportError, httpx.RemoteProtocolError):
            return None

    def submit(self, i: int, ev: CloudEvent, mode: str = "binary") -> Future[Reply | None]:
        self.replicas[i].url  # noqa: B018 - up before the request leaves: the delays below count from here
        return self.pool.submit(self.send, i, ev, mode)

    @contextlib.contextmanager
    def store_paused(self) -> Iterator[None]:
        """The store accepts connections and answers nothing (its processes stopped) until the block ends."""
        assert self.seaweed.proc is not None
        os.killpg(self.seaweed.proc.pid, signal.SIGSTOP)
        try:
            yield
        finally:
            os.killpg(self.seaweed.proc.pid, signal.SIGCONT)

    def close(self) -> list[int | None]:
        self.pool.shutdown(wait=True)
        self.http.close()
        return [r.stop() for r in self.replicas]


# ------------------------------------------------------------------------------------------ the model

# run inside the sandbox: apply OPS in /home/sandbox/m, then print every entry there
PROGRAM = r'''
import hashlib, json, os, shutil, sys, time
os.makedirs("/home/sandbox/m", exist_ok=True)
os.chdir("/home/sandbox/m")
def parent(p):
    if "/" in p:
        os.makedirs(p.rsplit("/", 1)[0], exist_ok=True)
for op in json.loads(OPS):
    k = op[0]
    if k == "sleep":
        time.sleep(op[1])
    elif k in ("write", "append", "big"):
        p = op[1]
        if os.path.islink(p):
            os.remove(p)
        parent(p)
        size = op[3] if len(op) > 3 else 70000
        text = op[2] if k != "big" else (op[2] + "-") * (size // (len(op[2]) + 1) + 1)
        with open(p, "a" if k == "append" else "w", encoding="utf-8") as f:
            f.write(text)
    elif k == "delete":
        if os.path.lexists(op[1]):
            os.remove(op[1])
    elif k == "link":
        if not os.path.islink(op[1]) and os.path.isfile(op[1]) and not os.path.lexists(op[2]):
            parent(op[2])
            os.link(op[1], op[2])
    elif k == "symlink":
        if not os.path.lexists(op[1]):
            parent(op[1])
            os.symlink(op[2], op[1])
    elif k == "rmtree":
        shutil.rmtree("s", ignore_errors=True)
    elif k == "rename":
        s, d = op[1], op[2]
        if os.path.lexists(s) and not (os.path.lexists(d) and os.path.samestat(os.lstat(s), os.lstat(d))):
            parent(d)
            os.replace(s, d)
    elif k == "chmod":
        if os.path.lexists(op[1]) and not os.path.islink(op[1]):
            os.chmod(op[1], op[2])
    sys.stderr.write(".")  # one per op done (a step killed at its timeout says how far it got)
    sys.stderr.flush()
out = {}
for dp, dns, fns in os.walk("."):
    for n in dns + fns:
        p = os.path.normpath(os.path.join(dp, n))
        if os.path.islink(p):
            out[p] = ["l", os.readlink(p)]
        elif os.path.isdir(p):
            out[p] = ["d"]
        else:
            data = open(p, encoding="utf-8").read()
            short = data if len(data) <= 200 else "sha256:" + hashlib.sha256(data.encode()).hexdigest()
            out[p] = ["f", short, oct(os.lstat(p).st_mode & 0o777)]
print(json.dumps(out, sort_keys=True))
'''

PATHS = ("a", "b", "c", "s/x", "s/y")
HOME = "/home/sandbox/m"  # where PROGRAM works
WORDS = st.text(alphabet="ab é\n", max_size=6)
OP = st.one_of(
    st.tuples(st.sampled_from(["write", "append"]), st.sampled_from(PATHS), WORDS),
    st.tuples(st.just("delete"), st.sampled_from(PATHS)),
    st.tuples(st.just("link"), st.sampled_from(PATHS), st.sampled_from(PATHS)),
    st.tuples(st.just("symlink"), st.sampled_from(PATHS), st.sampled_from(PATHS)),
    st.just(("rmtree",)),
    st.tuples(st.just("rename"), st.sampled_from(PATHS), st.sampled_from(PATHS)),
    st.tuples(st.just("chmod"), st.sampled_from(PATHS), st.sampled_from([0o600, 0o640, 0o755])),
    st.tuples(st.just("big"), st.sampled_from(PATHS), st.text(alphabet="xyz", min_size=1, max_size=3)),
).map(list)
OPS = st.lists(OP, max_size=4)
REPLICA = st.integers(0, len(REPLICA_ARGS) - 1)
MODES = st.sampled_from(["binary", "structured"])


def short(text: str) -> str:
    return text if len(text) <= 200 else "sha256:" + hashlib.sha256(text.encode()).hexdigest()


class Node:
    """A file's content, shared by its hard links. ``lower``: in a snapshot layer under the sandbox;
    overlayfs copies it up on the first write through one name, which then no longer shares it."""

    def __init__(self, content: str, lower: bool = False, mode: int = 0o644):
        self.content = content
        self.lower = lower
        self.mode = mode


@dataclass
class Tree:
    """What /home/sandbox/m holds."""

    files: dict[str, Node] = field(default_factory=dict)
    links: dict[str, str] = field(default_factory=dict)
    dirs: set[str] = field(default_factory=set)

    def copy(self, lower: bool = False) -> Tree:
        tree = copy.deepcopy(self)  # (one deepcopy: hard links stay shared)
        if lower:
            for node in tree.files.values():
                node.lower = True
        return tree

    def _parent(self, p: str) -> None:
        if "/" in p:
            self.dirs.add(p.rsplit("/", 1)[0])

    def _own(self, p: str) -> Node:
        node = self.files[p]
        if node.lower:  # copied up
            node = self.files[p] = Node(node.content, mode=node.mode)
        return node

    def apply(self, op: list[Any]) -> None:
        k = op[0]
        if k in ("write", "append", "big"):
            p = op[1]
            self.links.pop(p, None)
            self._parent(p)
            size = op[3] if len(op) > 3 else 70000  # (a blob: over INLINE_MAX_BYTES)
            text = op[2] if k != "big" else (op[2] + "-") * (size // (len(op[2]) + 1) + 1)
            if p in self.files:
                node = self._own(p)
                node.content = node.content + text if k == "append" else text
            else:
                self.files[p] = Node(text)
        elif k == "delete":
            self.files.pop(op[1], None)
            self.links.pop(op[1], None)
        elif k == "link":
            s, d = op[1], op[2]
            if s in self.files and d not in self.files and d not in self.links:
                self._parent(d)
                self.files[d] = self._own(s)
        elif k == "symlink":
            if op[1] not in self.files and op[1] not in self.links:
                self._parent(op[1])
                self.links[op[1]] = op[2]
        elif k == "rename":
            s, d = op[1], op[2]
            if (s in self.files or s in self.links) and not (s in self.files and self.files.get(d) is self.files[s]):
                self._parent(d)
                if s in self.files:
                    node = self._own(s)  # (overlayfs copies a lower file up to rename it)
                    del self.files[s]
                    self.links.pop(d, None)
                    self.files[d] = node
                else:
                    self.files.pop(d, None)
                    self.links[d] = self.links.pop(s)
        elif k == "chmod":
            if op[1] in self.files:
                self._own(op[1]).mode = op[2]
        elif k == "rmtree":
            self.files = {p: n for p, n in self.files.items() if not p.startswith("s/")}
            self.links = {p: t for p, t in self.links.items() if not p.startswith("s/")}
            self.dirs.discard("s")

    def listing(self) -> dict[str, list[Any]]:
        out: dict[str, list[Any]] = {d: ["d"] for d in self.dirs}
        out.update({p: ["l", t] for p, t in self.links.items()})
        # (no hard-link groups: overlayfs gives a lower file copied up its lower inode number, and a new
        # link to it the upper one; that names share a file shows in their contents after a write)
        out.update({p: ["f", short(n.content), oct(n.mode)] for p, n in self.files.items()})
        return out


LIFETIME_SLACK_S = 1.5  # past its lifetime a live copy is reaped within the reaper's interval (0.5 s); a margin
LIFETIMES = st.sampled_from([None, None, None, 2.0, 4.0])  # None: the default (900 s)


@dataclass
class Sandbox:
    sid: str
    trees: list[Tree]  # what it may hold: one, or more while the order of two racing steps is not known
    lifetime_s: float | None = None  # a short lifetime (None: longer than any sequence)
    born: tuple[float, float] = (0.0, 0.0)  # (monotonic) its create was sent, answered: it was made between
    ended: str | None = None  # "destroyed" (by an event), "lifetime" (seen expired); None: it may still run
    execs: int = 0  # acknowledged exec steps: what its usage record must count
    destroy_reply: dict[str, Any] | None = None

    def __repr__(self) -> str:  # (how Hypothesis prints a failing sequence)
        return f"<sandbox {self.sid}>"

    @property
    def exec_timeout_s(self) -> float:
        return min(10.0, self.lifetime_s or 10.0)

    def state(self, call: Call) -> str:
        """For a request sent and answered when ``call`` was (the server decided in between): 'live',
        'gone', or 'either' (its lifetime may have passed)."""
        if self.ended is not None:
            return "gone"
        if self.lifetime_s is None or call.answered < self.born[0] + self.lifetime_s:
            return "live"
        if call.sent > self.born[1] + self.lifetime_s + LIFETIME_SLACK_S:
            return "gone"
        return "either"


@dataclass
class Snap:
    snapshot_id: str
    trees: list[Tree]

    def __repr__(self) -> str:
        return f"<snapshot {self.snapshot_id[:12]}>"


@dataclass
class Acked:
    """An event answered 200, and its first reply."""

    ev: CloudEvent
    status: int
    data: Any
    kind: str


@dataclass
class Call:
    """One request as its client saw it: its reply (None: the connection broke), when it was sent and
    answered (monotonic). A client that sends it again until it is answered keeps ``sent``."""

    reply: Reply | None
    sent: float
    answered: float


def exec_event(sb: Sandbox, ops: list[list[Any]], *, sleep_s: float = 0.0, pre: tuple[str, str] | None = None,
               read: list[str] | None = None, timeout_s: float | None = None,
               hang_s: float = 0.0) -> tuple[CloudEvent, list[list[Any]]]:
    """An exec that appends its own token to the journal ``j``, then applies ``ops`` and lists every file;
    and the ops the model applies for it. ``sleep_s`` first; ``pre``: (path, text) written through the
    exec's ``files`` before it runs; ``read``: paths read back through ``read_files``; ``hang_s`` last
    (past ``timeout_s``: killed before it lists anything)."""
    eid = uuid.uuid4().hex
    run = ([["sleep", sleep_s]] if sleep_s else []) + [["append", "j", eid[:8] + "\n"], *ops] + \
        ([["sleep", hang_s]] if hang_s else [])
    data: dict[str, Any] = {"sandbox_id": sb.sid, "code": f"OPS = {json.dumps(run)!r}\n{PROGRAM}",
                            "timeout_s": timeout_s or sb.exec_timeout_s}
    if pre is not None:
        data["files"] = {f"{HOME}/{pre[0]}": pre[1]}
    if read:
        data["read_files"] = [f"{HOME}/{p}" for p in read]
    return event(EXEC, data, id=eid, source=SOURCE), ([["write", *pre]] if pre else []) + run


def after(tree: Tree, ops: list[list[Any]]) -> Tree:
    new = tree.copy()
    for op in ops:
        new.apply(op)
    return new


def ran(trees: list[Tree], ops: list[list[Any]], listing: dict[str, Any]) -> list[Tree]:
    """Of the states a sandbox may be in, those after ``ops`` that list as ``listing`` does."""
    return [t for t in (after(tree, ops) for tree in trees) if t.listing() == listing]


def copies(trees: list[Tree], lower: bool = False) -> list[Tree]:
    return [t.copy(lower) for t in trees]


def altered(ev: CloudEvent) -> CloudEvent:
    """The same event identity (source, id) with other content."""
    data = dict(ev.data)
    if ev["type"] == EXEC:
        data["code"] += "\n# altered"
    elif ev["type"] == DESTROY:
        data["outcome"] = {"reward": 1.0}
    else:
        data["metadata"] = {"altered": "1"}
    return CloudEvent({k: v for k, v in ev.get_attributes().items() if k != "time"}, data)


# ------------------------------------------------------------------------------------------ the machine


def traced(f: Callable[..., Any]) -> Callable[..., Any]:
    """A rule that notes itself in the sequence's trail, and prints the trail with the first failure as
    it happened: real replicas are not deterministic, so Hypothesis' replay of a failing sequence (to
    shrink or report it) may take another path or call its data generation flaky."""
    @functools.wraps(f)
    def rule_(self: DurableModel, *args: Any, **kwargs: Any) -> None:
        # drawn as indices (fixed bounds, whatever happened so far: Hypothesis needs that), used as objects
        if isinstance(kwargs.get("sb"), int):
            kwargs["sb"] = self.pick(kwargs["sb"])
        if isinstance(kwargs.get("snap"), int):
            kwargs["snap"] = self.snaps[kwargs["snap"] % len(self.snaps)] if self.snaps else None
        shown = ", ".join([*map(repr, args), *(f"{k}={v!r}" for k, v in kwargs.items())])
        self.trail.append("  " * self.depth + f"{f.__name__}({shown})")  # (indented: a rule a rule calls)
        if self.depth == 0:
            self.fresh = []
        self.depth += 1
        try:
            f(self, *args, **kwargs)
        except BaseException as exc:
            self.report(exc)
            raise
        finally:
            self.depth -= 1
    return rule_


EXPENSIVE_PER_SEQUENCE = int(os.environ.get("ROLLBOX_MODEL_EXPENSIVE", "1"))  # restarts, idling, long pauses
OUTAGES = os.environ.get("ROLLBOX_MODEL_OUTAGES") == "1"  # store pauses past the deadline (8 s each)
MAX_SANDBOXES = 8  # rules that may make one, per sequence (a precondition must not depend on what they made)
SB = st.integers(0, MAX_SANDBOXES - 1)  # a sandbox of the sequence, by index (modulo how many there are)
SNAP = st.integers(0, 7)
ANY = st.integers(0, 10_000)
KILL_KINDS = st.sampled_from(["exec", "exec", "fork", "create", "destroy"])


class DurableModel(RuleBasedStateMachine):
    cluster: ClassVar[Cluster]
    sequences: ClassVar[int] = 0  # counted for the long run's report
    rules_run: ClassVar[int] = 0

    def __init__(self) -> None:
        super().__init__()
        self.w = self.cluster
        self.sbs: dict[str, Sandbox] = {}  # every sandbox the sequence made, in order
        self.fresh: list[Sandbox] = []  # those the last rule made
        self.snaps: list[Snap] = []
        self.acked: list[Acked] = []
        self.making = 0  # rules run that may make sandboxes
        self.expensive = 0
        self.trail: list[str] = []  # the rules run so far, for a failure's report (``traced``)
        self.depth = 0
        DurableModel.sequences += 1

    def pick(self, i: int) -> Sandbox:
        sbs = list(self.sbs.values())
        return sbs[i % len(sbs)]

    def new_sandbox(self, r: int, lifetime: float | None = None) -> Sandbox:
        """(written-out sequences) ``create``, and the sandbox it made."""
        self.create(r, lifetime)
        return self.fresh[-1]

    def report(self, exc: BaseException) -> None:
        """Print the sequence as run with its first failure (once: rules call rules)."""
        if not getattr(exc, "_rollbox_reported", False):
            exc._rollbox_reported = True  # type: ignore[attr-defined]
            print("\n=== durable model: a sequence failed; as it ran:\n  " +
                  "\n  ".join(self.trail) + f"\n{type(exc).__name__}: {str(exc)[:6000]}\n", file=sys.stderr,
                  flush=True)

    # -- the client ----------------------------------------------------------------------------------

    def call(self, r: int, ev: CloudEvent, mode: str = "binary") -> Call:
        self.w.replicas[r].url  # noqa: B018 - (its start is not the request's time)
        sent = time.monotonic()
        reply = self.w.send(r, ev, mode)
        return Call(reply, sent, time.monotonic())

    def call_soon(self, r: int, ev: CloudEvent) -> Future[Call]:
        self.w.replicas[r].url  # noqa: B018
        return self.w.pool.submit(self.call, r, ev)

    def until_answered(self, r: int, ev: CloudEvent, first: Call, tries: int = 60) -> Call:
        """A client sending ``ev`` to replica ``r`` until it gets a final reply (it retries a 503, a 429,
        a 409 sandbox_busy and a broken connection), from the first attempt ``first`` on."""
        call = first
        for _ in range(tries):
            reply = call.reply
            if reply is not None and not (reply.status in (429, 503) or
                                          (reply.status == 409 and reply.data["code"] == "sandbox_busy")):
                return Call(reply, first.sent, call.answered)
            assert reply is None or reply.status != 500, reply.data
            time.sleep(0.3)
            call = self.call(r, ev)
        raise AssertionError(f"event {ev['id']} not answered after {tries} tries: {call.reply and call.reply.data}")

    # -- checks ------------------------------------------------------------------------------------

    def expect(self, reply: Reply | None, status: int, code: str | None = None) -> Reply:
        assert reply is not None, "the replica closed the connection"
        assert reply.status != 500, f"500: {reply.data}"
        assert reply.status == status, (reply.status, reply.data)
        if code is not None:
            assert reply.data["code"] == code, reply.data
        return reply

    def ended(self, sb: Sandbox, call: Call) -> bool:
        """Whether ``call`` was rightly answered as the end of ``sb``: 410 sandbox_gone if it is gone (or
        may be, past its lifetime); any other reply then fails, as a 410 while it must be live does."""
        state = sb.state(call)
        reply = call.reply
        if state == "live" or (state == "either" and (reply is None or reply.status != 410)):
            return False
        self.expect(reply, 410, "sandbox_gone")
        assert reply is not None
        reason = reply.data["details"].get("reason")
        assert reason in ("destroyed", "lifetime") and (sb.ended is None or
                                                         (reason == "destroyed") == (sb.ended == "destroyed")), \
            (reply.data, sb.ended)
        sb.ended = sb.ended or "lifetime"
        return True

    def check_exec(self, sb: Sandbox, reply: Reply, ops: list[list[Any]]) -> None:
        """A 200 exec: it ran, and what it listed (and read back) is the model after its ops; the model
        moves on."""
        got = self.listing(reply)
        want = ran(sb.trees, ops, got)
        assert want, f"files of {sb.sid}:\n got  {got}\n want " + \
            "\n   or ".join(str(after(t, ops).listing()) for t in sb.trees)
        read = {p.removeprefix(HOME + "/"): text for p, text in reply.data["files"].items()}
        want = [t for t in want if all(text == (t.files[p].content if p in t.files else None)
                                       for p, text in read.items())]
        assert want, f"files of {sb.sid} read back: {read}"
        sb.trees = want
        sb.execs += 1

    @staticmethod
    def listing(reply: Reply) -> dict[str, Any]:
        assert reply.data["exit_code"] == 0 and set(reply.data["stderr"]) <= {"."}, reply.data
        got: dict[str, Any] = json.loads(reply.data["stdout"])
        return got

    def ack(self, ev: CloudEvent, reply: Reply, kind: str) -> None:
        self.acked.append(Acked(ev, reply.status, reply.data, kind))

    def open_ones(self) -> list[Sandbox]:
        return [sb for sb in self.sbs.values() if sb.ended is None]

    def made(self, info: dict[str, Any], trees: list[Tree], call: Call) -> Sandbox:
        lifetime = info["limits"]["lifetime_s"]
        sb = Sandbox(info["sandbox_id"], trees, lifetime if lifetime < 600 else None, (call.sent, call.answered))
        assert sb.sid not in self.sbs, f"{sb.sid} made twice"
        self.sbs[sb.sid] = sb
        self.fresh.append(sb)
        return sb

    @invariant()
    def no_errors_logged(self) -> None:
        DurableModel.rules_run += 1
        bad = []
        for r in self.w.replicas:
            for rec in r.new_log_records():
                # (an error reply's own line is "event" with its status; a 503's is "runtime error" too)
                if rec.get("status") in (500, 502) or "Traceback" in str(rec.get("raw", "")) or (
                        rec.get("level") in ("error", "critical") and rec.get("msg") not in ("event", "runtime error")):
                    bad.append(rec)
        if bad:
            exc = AssertionError("errors in the replicas' logs:\n" + "\n".join(json.dumps(b)[:3000] for b in bad))
            self.report(exc)
            raise exc

    # -- what each kind of reply means for the model --------------------------------------------------

    def exec_done(self, sb: Sandbox, ev: CloudEvent, ops: list[list[Any]], call: Call) -> None:
        if not self.ended(sb, call):
            self.check_exec(sb, self.expect(call.reply, 200), ops)
            self.ack(ev, call.reply, "exec")  # type: ignore[arg-type]

    def create_done(self, ev: CloudEvent, call: Call, trees: list[Tree]) -> Sandbox:
        reply = self.expect(call.reply, 200)
        sb = self.made(reply.data, trees, call)
        self.ack(ev, reply, "create")
        return sb

    def fork_done(self, sb: Sandbox, ev: CloudEvent, count: int, r: int, call: Call) -> list[Sandbox]:
        if self.ended(sb, call):
            return []
        if count + 1 > MAX_LIVE[r]:  # the children and their parent cannot all be live on that replica
            self.expect(call.reply, 429, "overloaded")
            return []
        reply = self.expect(call.reply, 200)
        assert len(reply.data["sandboxes"]) == count, reply.data
        self.ack(ev, reply, "fork")
        return self.forked(sb, reply, call)

    def forked(self, parent: Sandbox, reply: Reply, call: Call) -> list[Sandbox]:
        children = []
        for info in reply.data["sandboxes"]:
            assert info["forked_from"] == parent.sid, info
            children.append(self.made(info, copies(parent.trees), call))
        return children

    def destroy_done(self, sb: Sandbox, ev: CloudEvent, call: Call) -> None:
        reply = self.expect(call.reply, 200)
        if sb.destroy_reply is not None:  # repeating a destroy (a new event) returns the same record
            assert reply.data == sb.destroy_reply, (reply.data, sb.destroy_reply)
            return
        # (past its lifetime, its end may have been recorded first)
        reasons = ("destroyed",) if sb.state(call) == "live" and sb.ended is None else ("destroyed", "lifetime")
        assert (reply.data["sandbox_id"], reply.data["execs"]) == (sb.sid, sb.execs) and \
            reply.data["reason"] in reasons and reply.data["billed_s"] >= (reply.data["wall_s"] > 0), \
            (reply.data, sb.execs, reasons)
        sb.ended = "destroyed" if reply.data["reason"] == "destroyed" else "lifetime"
        sb.destroy_reply = reply.data
        self.ack(ev, reply, "destroy")

    # -- rules -------------------------------------------------------------------------------------

    @initialize(r=REPLICA)
    @traced
    def first(self, r: int) -> None:
        self.create(r)

    @precondition(lambda self: self.making < MAX_SANDBOXES)
    @rule(r=REPLICA, lifetime=LIFETIMES)
    @traced
    def create(self, r: int, lifetime: float | None = None) -> None:
        self.making += 1
        ev = event(CREATE, {} if lifetime is None else {"timeout_s": lifetime}, source=SOURCE)
        self.create_done(ev, self.call(r, ev), [Tree()])

    @rule(sb=SB, r=REPLICA, ops=OPS, mode=MODES,
          pre=st.none() | st.tuples(st.sampled_from(PATHS), WORDS), read=st.booleans())
    @traced
    def step(self, sb: Sandbox, r: int, ops: list[list[Any]], mode: str = "binary",
             pre: tuple[str, str] | None = None, read: bool = False) -> None:
        """An exec; with ``pre`` one file is written through its ``files`` first, with ``read`` the
        regular files are read back through its ``read_files`` too (a step that cannot pass through)."""
        if pre is not None and any(pre[0] in t.links for t in sb.trees):
            pre = None  # (``files`` writes through a symlink, to its target: not modelled)
        paths = None
        if read:
            ends = [after(t, ([["write", *pre]] if pre else []) + ops) for t in sb.trees]
            paths = [p for p in PATHS if not any(p in t.links for t in ends)]
        ev, full = exec_event(sb, ops, pre=pre, read=paths)
        self.exec_done(sb, ev, full, self.call(r, ev, mode))

    @rule(steps=st.lists(st.tuples(SB, REPLICA, OPS), min_size=2, max_size=4))
    @traced
    def burst(self, steps: list[tuple[int, int, list[list[Any]]]]) -> None:
        """Steps on several sandboxes at once, each through any replica (replica 1 holds two live at most:
        a step there may wait for room, or be refused with 429 and sent again, as a client does)."""
        sent: list[tuple[Sandbox, int, CloudEvent, list[list[Any]], Future[Call]]] = []
        for i, r, ops in steps:
            sb = self.pick(i)
            if any(sb is s[0] for s in sent):
                continue
            ev, full = exec_event(sb, ops, sleep_s=0.05)
            sent.append((sb, r, ev, full, self.call_soon(r, ev)))
        for sb, r, ev, full, fut in sent:
            call = fut.result()
            if sb.ended is None and call.reply is not None and call.reply.status == 429:
                call = self.until_answered(r, ev, call)
            self.exec_done(sb, ev, full, call)

    @precondition(lambda self: self.may_spend())
    @rule(sb=SB, r=REPLICA, ops=OPS)
    @traced
    def step_timing_out(self, sb: Sandbox, r: int, ops: list[list[Any]]) -> None:
        """An exec killed at its timeout after its ops: acknowledged (timed_out, 137), and what it wrote
        before is kept (the next step lists it). How many ops it did before the kill its stderr says
        (one dot each): on a loaded machine the kill may come before the last, or the first."""
        self.spend()
        ev, full = exec_event(sb, ops, timeout_s=min(1.0, sb.exec_timeout_s), hang_s=30)
        call = self.call(r, ev)
        if self.ended(sb, call):
            return
        reply = self.expect(call.reply, 200)
        assert (reply.data["timed_out"], reply.data["exit_code"]) == (True, 137), reply.data
        done = reply.data["stderr"].count(".")
        assert done < len(full), reply.data  # (the last op sleeps 30 s)
        # the ops it said it did; or one more, done as the kill came before its dot
        sb.trees = [after(t, full[:n]) for n in (done, done + 1) for t in sb.trees]
        sb.execs += 1
        self.ack(ev, reply, "exec")

    @rule(i=ANY, r=REPLICA, mode=MODES)  # (the first create is always acknowledged)
    @traced
    def resend(self, i: int, r: int, mode: str) -> None:
        self.resend_one(self.acked[i % len(self.acked)], r, mode)

    def resend_one(self, first: Acked, r: int, mode: str = "binary") -> None:
        reply = self.expect(self.call(r, first.ev, mode).reply, first.status)
        assert reply.data == first.data, f"a re-sent {first.kind} event got another reply:\n" \
                                         f" first {first.data}\n again {reply.data}"

    @rule(i=ANY, r=REPLICA)
    @traced
    def resend_altered(self, i: int, r: int) -> None:
        """An acknowledged event's identity with other content: refused on every replica, nothing runs."""
        events = [a for a in self.acked if a.kind != "snapshot"]
        first = events[i % len(events)]
        self.expect(self.call(r, altered(first.ev)).reply, 409, "idempotency_conflict")

    @rule(sb=SB, r1=REPLICA, r2=REPLICA, ops1=OPS, ops2=OPS,
          second=st.sampled_from(["exec", "fork", "destroy"]), retry=st.booleans())
    @traced
    def race(self, sb: Sandbox, r1: int, r2: int, ops1: list[list[Any]], ops2: list[list[Any]],
             second: str = "exec", retry: bool = False) -> None:
        """Two events on one sandbox at once through two replicas (or one): an exec, and an exec, a fork
        or a destroy. The loser is 409 sandbox_busy and changed nothing; with ``retry`` it is sent again,
        as its 409 asks. (Not on a sandbox with a short lifetime: one of them could see it expired.)"""
        self.making += 1
        if sb.lifetime_s is not None and sb.ended is None:
            self.step(sb, r1, ops1)
            return None
        ev1, full1 = exec_event(sb, ops1, sleep_s=0.25)
        full2: list[list[Any]] = []
        if second == "exec":
            ev2, full2 = exec_event(sb, ops2, sleep_s=0.25)
        else:
            ev2 = event(FORK if second == "fork" else DESTROY,
                        {"sandbox_id": sb.sid, **({"count": 1} if second == "fork" else {})}, source=SOURCE)
        f1, f2 = self.call_soon(r1, ev1), self.call_soon(r2, ev2)
        c1, c2 = f1.result(), f2.result()
        if sb.ended is not None:
            assert self.ended(sb, c1)
            if second == "destroy":  # a destroy of a destroyed sandbox returns its record
                self.destroy_done(sb, ev2, c2)
            else:
                assert self.ended(sb, c2)
            return None
        rep1, rep2 = c1.reply, c2.reply
        assert rep1 is not None and rep2 is not None
        for rep in (rep1, rep2):
            assert rep.status in (200, 409, 410), (rep.status, rep.data)
            if rep.status == 409:
                assert rep.data["code"] == "sandbox_busy" and rep.headers.get("retry-after"), rep.data
        assert 200 in (rep1.status, rep2.status), (rep1.data, rep2.data)
        assert rep2.status != 410, rep2.data
        children: list[Sandbox] = []

        def again(r: int, ev: CloudEvent) -> Call:
            return self.until_answered(r, ev, self.call(r, ev))

        def apply2(call: Call) -> None:
            if second == "fork":
                children.extend(self.fork_done(sb, ev2, 1, r2, call))
            elif second == "destroy":
                self.destroy_done(sb, ev2, call)
            else:
                self.exec_done(sb, ev2, full2, call)

        if second == "destroy" and rep2.status == 200 and rep1.status != 200:
            apply2(c2)  # destroyed first: the exec lost (409) or came after it (410)
            if rep1.status == 410 or retry:
                self.exec_done(sb, ev1, full1, c1 if rep1.status == 410 else again(r1, ev1))
        elif rep1.status == rep2.status == 200:  # they did not overlap: one ran after the other
            if second == "exec":
                l1, l2 = self.listing(rep1), self.listing(rep2)
                one_two = ran(ran(sb.trees, full1, l1), full2, l2)
                two_one = ran(ran(sb.trees, full2, l2), full1, l1)
                assert one_two or two_one, f"racing steps on {sb.sid} listed {l1} and {l2}: in no order " \
                    f"from {[t.listing() for t in sb.trees]}"
                sb.trees = one_two + two_one
                sb.execs += 2
                self.ack(ev2, rep2, "exec")
                self.ack(ev1, rep1, "exec")
            else:  # (a destroy after the exec; a fork before or after it: its children hold either)
                before = sb.trees
                self.exec_done(sb, ev1, full1, c1)
                apply2(c2)
                for child in children:
                    child.trees = copies(before) + copies(sb.trees)
        elif rep1.status == 200:
            assert rep2.status == 409, rep2.data
            self.exec_done(sb, ev1, full1, c1)
            if retry:
                apply2(again(r2, ev2))
        else:
            assert rep1.status == 409, rep1.data
            apply2(c2)
            if retry:
                self.exec_done(sb, ev1, full1, again(r1, ev1))
        return None

    @rule(sb=SB, kind=st.sampled_from(["exec", "create", "fork", "destroy"]),
          r1=REPLICA, r2=REPLICA, ops=OPS)
    @traced
    def duplicate_at_once(self, sb: Sandbox, kind: str, r1: int, r2: int, ops: list[list[Any]]) -> None:
        """One event delivered twice at once (a broker's redelivery racing the first, a client's retry
        racing its first try), to two replicas or one: it takes effect once, and both are answered with
        the one reply (one may be 409 sandbox_busy first, as a lost race is: its retry gets the reply)."""
        self.making += 1
        if kind != "create" and sb.lifetime_s is not None and sb.ended is None:
            self.step(sb, r1, ops)
            return None
        full: list[list[Any]] = []
        if kind == "exec":
            ev, full = exec_event(sb, ops, sleep_s=0.1)
        elif kind == "create":
            ev = event(CREATE, {}, source=SOURCE)
        else:
            ev = event(FORK if kind == "fork" else DESTROY,
                       {"sandbox_id": sb.sid, **({"count": 1} if kind == "fork" else {})}, source=SOURCE)
        f1, f2 = self.call_soon(r1, ev), self.call_soon(r2, ev)
        c1, c2 = f1.result(), f2.result()
        if kind in ("exec", "fork") and sb.ended is not None:
            assert self.ended(sb, c1) and self.ended(sb, c2)
            return None
        c1, c2 = self.until_answered(r1, ev, c1), self.until_answered(r2, ev, c2)
        assert c1.reply is not None and c2.reply is not None
        assert (c1.reply.status, c1.reply.data) == (c2.reply.status, c2.reply.data), \
            f"one {kind} event, two replies:\n {c1.reply.status} {c1.reply.data}\n {c2.reply.status} {c2.reply.data}"
        if kind == "exec":
            self.exec_done(sb, ev, full, c1)
        elif kind == "create":
            self.create_done(ev, c1, [Tree()])
        elif kind == "fork":
            self.fork_done(sb, ev, 1, r1, c1)
        else:
            self.destroy_done(sb, ev, c1)
        return None

    @precondition(lambda self: self.making < MAX_SANDBOXES)
    @rule(sb=SB, r=REPLICA, count=st.integers(1, 2))
    @traced
    def fork(self, sb: Sandbox, r: int, count: int) -> None:
        self.making += 1
        ev = event(FORK, {"sandbox_id": sb.sid, "count": count}, source=SOURCE)
        self.fork_done(sb, ev, count, r, self.call(r, ev))

    @rule(sb=SB, r=REPLICA)
    @traced
    def snapshot(self, sb: Sandbox, r: int) -> None:
        ev = event(SNAPSHOT, {"sandbox_id": sb.sid}, source=SOURCE)
        call = self.call(r, ev)
        if self.ended(sb, call):
            return
        reply = self.expect(call.reply, 200)
        self.ack(ev, reply, "snapshot")
        self.snaps.append(Snap(reply.data["snapshot_id"], copies(sb.trees)))

    @precondition(lambda self: self.making < MAX_SANDBOXES)
    @rule(snap=SNAP, r=REPLICA)
    @traced
    def create_from(self, snap: Snap | None, r: int) -> None:
        """A sandbox from one of the sequence's snapshots (none yet: from the built-in one)."""
        self.making += 1
        if snap is None:
            ev = event(CREATE, {}, source=SOURCE)
            self.create_done(ev, self.call(r, ev), [Tree()])
            return
        ev = event(CREATE, {"snapshot": snap.snapshot_id}, source=SOURCE)
        self.create_done(ev, self.call(r, ev), copies(snap.trees, lower=True))
        assert self.acked[-1].data["snapshot_id"] == snap.snapshot_id, self.acked[-1].data

    @rule(sb=SB, r=REPLICA)
    @traced
    def destroy(self, sb: Sandbox, r: int) -> None:
        ev = event(DESTROY, {"sandbox_id": sb.sid}, source=SOURCE)
        self.destroy_done(sb, ev, self.call(r, ev))

    # -- the world misbehaving (expensive: a few per sequence) ---------------------------------------

    def may_spend(self) -> bool:
        return self.expensive < EXPENSIVE_PER_SEQUENCE

    def spend(self) -> None:
        self.expensive += 1

    @precondition(may_spend)
    @rule(r=REPLICA)
    @traced
    def kill9(self, r: int) -> None:
        """kill -9 of an idle replica; it restarts on the same home (its dead self's leftovers swept)."""
        self.spend()
        self.w.replicas[r].kill9()
        self.w.replicas[r].launch()

    @precondition(lambda self: self.may_spend() and self.making < MAX_SANDBOXES)
    @rule(sb=SB, kind=KILL_KINDS, r=REPLICA, other=REPLICA, ops=OPS,
          delay=st.sampled_from([0.0, 0.03, 0.1, 0.3]))
    @traced
    def kill9_in_flight(self, sb: Sandbox, kind: str, r: int, other: int, ops: list[list[Any]], delay: float) -> None:
        """kill -9 while an event is in flight (an exec, a fork, a create, a destroy): its client gets no
        reply and sends it again (to another replica, or this one restarted) until answered. Whether
        the first attempt committed or not, it counts once."""
        self.spend()
        self.making += 1
        full: list[list[Any]] = []
        if kind == "exec":
            ev, full = exec_event(sb, ops, sleep_s=0.1)
        elif kind == "create":
            ev = event(CREATE, {}, source=SOURCE)
        else:
            ev = event(FORK if kind == "fork" else DESTROY, {"sandbox_id": sb.sid, "count": 1}
                       if kind == "fork" else {"sandbox_id": sb.sid}, source=SOURCE)
        fut = self.call_soon(r, ev)
        time.sleep(delay)
        self.w.replicas[r].kill9()
        self.w.replicas[r].launch()
        call = fut.result()
        if call.reply is None:
            call = self.until_answered(other, ev, call)
        if kind == "exec":
            self.exec_done(sb, ev, full, call)
        elif kind == "create":
            self.create_done(ev, call, [Tree()])
        elif kind == "fork":
            self.fork_done(sb, ev, 1, other, call)
        else:
            self.destroy_done(sb, ev, call)
        return None

    @precondition(may_spend)
    @rule(sb=SB, r=REPLICA, other=REPLICA, ops=OPS, fresh=st.booleans())
    @traced
    def drain(self, sb: Sandbox, r: int, other: int, ops: list[list[Any]], fresh: bool) -> None:
        """SIGTERM with a step in flight: the step is answered (or refused with 503 and sent elsewhere),
        the replica exits 0 and a new one starts (on a fresh home: scaled from zero; or the same)."""
        self.spend()
        ev, full = exec_event(sb, ops, sleep_s=0.2)
        fut = self.call_soon(r, ev)
        time.sleep(0.08)
        replica = self.w.replicas[r]
        assert replica.drain() == 0, replica.srv and replica.srv.log_path.read_text()[-3000:]
        replica.launch(fresh_home=fresh)
        call = fut.result()
        if call.reply is None or call.reply.status == 503:
            if call.reply is not None:
                assert call.reply.data["code"] == "shutting_down", call.reply.data
            call = self.until_answered(other, ev, call)
        self.exec_done(sb, ev, full, call)

    @precondition(may_spend)
    @rule()
    @traced
    def idle(self) -> None:
        """Nothing happens for longer than replica 2 keeps an idle live copy: its copies hibernate, and
        its next step on each passes through (runs as the resumed sandbox's init)."""
        self.spend()
        time.sleep(1.6)

    @rule(sb=SB, r=REPLICA, ops=OPS, pause=st.sampled_from([0.05, 0.3, 1.0]))
    @traced
    def store_hiccup(self, sb: Sandbox, r: int, ops: list[list[Any]], pause: float) -> None:
        """The store stops answering for a moment (less than the store deadline) during a step."""
        ev, full = exec_event(sb, ops, sleep_s=0.05)
        fut = self.call_soon(r, ev)
        with self.w.store_paused():
            time.sleep(pause)
        self.exec_done(sb, ev, full, fut.result())

    @precondition(lambda self: OUTAGES and self.may_spend())
    @rule(sb=SB, r=REPLICA, other=REPLICA, ops=OPS, at=st.sampled_from([0.0, 0.2, 0.33, 0.4]))
    @traced
    def store_outage(self, sb: Sandbox, r: int, other: int, ops: list[list[Any]], at: float) -> None:
        """The store stops answering (for longer than the store deadline) ``at`` seconds into a step:
        503, and what the step had written (its commit) may still land when the store is back. The
        client retries until it is answered: the step counts once, either way. (The step runs for
        0.3 s: it commits at about 0.33 s. One that committed before the store stopped is a step as any.)"""
        self.spend()
        ev, full = exec_event(sb, ops, sleep_s=0.3)
        fut = self.call_soon(r, ev)
        time.sleep(at)
        with self.w.store_paused():
            call = fut.result()
        if call.reply is not None and call.reply.status in (200, 410):  # it committed before the store stopped
            return self.exec_done(sb, ev, full, call)
        if sb.ended is None:
            assert call.reply is not None and call.reply.status == 503, call.reply and call.reply.data
            assert call.reply.data["code"] == "store_unavailable" and call.reply.headers["retry-after"], \
                call.reply.data
        self.exec_done(sb, ev, full, self.until_answered(other, ev, call))

    # -- the end of a sequence ---------------------------------------------------------------------

    @traced
    def teardown(self) -> None:
        """Every sandbox left is read back and destroyed; every one is then 410 on every replica."""
        for sb in list(self.sbs.values()):
            if sb.ended is None:
                self.step(sb, 0, [])
            if sb.destroy_reply is None:
                self.destroy(sb, 0)
        for sb in self.sbs.values():
            for r in range(len(self.w.replicas)):
                ev, _ = exec_event(sb, [])
                assert self.ended(sb, self.call(r, ev))
        self.no_errors_logged()


# ------------------------------------------------------------------------------------------ CI

EXAMPLES = int(os.environ.get("ROLLBOX_MODEL_EXAMPLES", "15"))
STEPS = int(os.environ.get("ROLLBOX_MODEL_STEPS", "20"))


def model_settings(examples: int = EXAMPLES, steps: int = STEPS, *, derandomize: bool = True,
                   shrink: bool = False) -> settings:
    """CI: derandomized (the same sequences every run), no shrinking (a failure prints its whole
    sequence; shrinking real replicas takes minutes, and timing makes some failures flaky)."""
    phases = [Phase.explicit, Phase.reuse, Phase.generate] + ([Phase.shrink] if shrink else [])
    return settings(max_examples=examples, stateful_step_count=steps, deadline=None, derandomize=derandomize,
                    database=None, print_blob=True, phases=phases, report_multiple_bugs=False,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                                           HealthCheck.data_too_large])


@pytest.fixture(scope="module")
def cluster(seaweed: SeaweedS3, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """Three replicas for the module, kept across sequences (a rule may restart one)."""
    world = Cluster(seaweed, tmp_path_factory.mktemp("durable-model"))
    DurableModel.cluster = world
    try:
        yield world
    finally:
        rcs = world.close()
    assert rcs == [0] * len(rcs), rcs


@pytest.fixture
def model(cluster: Cluster) -> Iterator[DurableModel]:
    """One sequence written out (the issue's, and the regressions Hypothesis found), checked as any."""
    m = DurableModel()
    yield m
    m.teardown()


@pytest.mark.timeout(600)
def test_random_sequences_keep_the_durable_promises(cluster: Cluster) -> None:
    t0 = time.monotonic()
    before = DurableModel.sequences, DurableModel.rules_run
    run_state_machine_as_test(DurableModel, settings=model_settings())
    print(f"durable model: {DurableModel.sequences - before[0]} sequences, "
          f"{DurableModel.rules_run - before[1]} rules in {time.monotonic() - t0:.1f} s")


def test_issue_25_1_a_duplicate_on_the_other_replica_then_kill_and_race(model: DurableModel) -> None:
    """Issue 25.1's sequence: steps alternating A/B 20x; one exec event sent to A and again to B (B
    answers A's reply); a step on B; the next on A (was 500: inline contents paired with the wrong
    generation); A killed; a step on B; racing steps through both."""
    a, b = 0, 1
    sb = model.new_sandbox(a)
    for n in range(20):  # each writes a file of its own, read back on both replicas
        model.step(sb, (a, b)[n % 2], [["write", f"f{n}", f"{n}"]])
        model.step(sb, a, [])
        model.step(sb, b, [])
    ev, full = exec_event(sb, [["append", "c", "once\n"]])
    model.exec_done(sb, ev, full, model.call(a, ev))
    model.resend_one(model.acked[-1], b)  # B answers A's reply
    model.step(sb, b, [["append", "c", "b\n"]])
    model.step(sb, a, [["append", "c", "a\n"]])
    model.w.replicas[a].kill9()
    model.step(sb, b, [["append", "c", "after kill\n"]])
    model.w.replicas[a].launch()
    for _ in range(3):
        model.race(sb, a, b, [["append", "c", "ra\n"]], [["append", "c", "rb\n"]])
    for first in model.acked:  # every acknowledged event, again, to each replica: its first reply
        for r in (a, b, 2):
            model.resend_one(first, r, "structured")


# ------------------------------------------------------------------------------------------ regressions
# Sequences Hypothesis found, written out; each failed before its fix.


def test_a_step_passing_through_commits_its_large_files(model: DurableModel) -> None:
    """A step that passes through (replica 2, after its live copy hibernated) ends its sandbox with it;
    its files are read through the dead sandbox's upper directory, whose descriptor was closed before
    the large ones (blobs) were uploaded: FileNotFoundError, 500."""
    sb = model.new_sandbox(2)
    model.step(sb, 2, [["write", "a", "small"]])
    model.idle()
    model.step(sb, 2, [["big", "b", "x"]])
    model.step(sb, 0, [["append", "b", "more"]])


def test_a_fork_at_the_live_cap_hibernates_an_idle_sandbox(model: DurableModel) -> None:
    """Replica 1 holds two live sandboxes at most. A fork of one of them while another idles there was
    429 (the runtime's cap), where a create or a resume hibernates the idle one to make room."""
    a = model.new_sandbox(1)
    model.step(a, 1, [["write", "a", "parent"]])
    model.create(1)
    model.fork(a, 1, 1)
    (child,) = model.fresh
    model.step(child, 1, [["append", "a", " child"]])
    model.step(a, 1, [["append", "a", " still"]])


def resumes(w: Cluster, r: int) -> float:
    """Replica ``r``'s count of sandboxes resumed from the store (its /metrics)."""
    return metric(w.http.get(w.replicas[r].url + "metrics").text, "rollbox_resumes_total")


def test_a_fork_that_lost_its_race_can_be_retried(model: DurableModel) -> None:
    """A fork whose parent's commit lost the race (409: "nothing of this request was kept, retry it")
    had committed its children already, under ids derived from the event alone: the retry made the same
    ids and was 409 (their records exist) forever. The lost attempt's children are gone, too."""
    a, b = 0, 1
    sb = model.new_sandbox(a)
    model.step(sb, a, [["big", "a", "x", 40 << 20]])
    model.step(sb, a, [["write", "b", "1"]])  # A holds it live; B must resume it (its 40 MB file) to fork
    fork = event(FORK, {"sandbox_id": sb.sid, "count": 1}, source=SOURCE)
    resumed = resumes(model.w, b)
    slow = model.w.submit(b, fork)
    deadline = time.monotonic() + 60
    while resumes(model.w, b) == resumed:  # B has read the sandbox's newest record and resumed it
        assert not slow.done() and time.monotonic() < deadline, "the fork on B never resumed its sandbox"
        time.sleep(0.005)
    srv = model.w.replicas[b].srv
    assert srv is not None
    os.kill(srv.pid, signal.SIGSTOP)  # B, mid-fork, waits (a sleep would race on a loaded box) ...
    try:
        model.step(sb, a, [["append", "b", "2"]])  # ... while A commits first: the fork's commit of the parent loses
    finally:
        os.kill(srv.pid, signal.SIGCONT)
    lost = model.expect(slow.result(), 409, "sandbox_busy")
    assert lost.headers["retry-after"]
    (child,) = model.fork_done(sb, fork, 1, b, model.call(b, fork))  # the retry its 409 asks for
    model.step(child, 2, [["append", "b", "child"]])
    for r in (a, b, 2):
        model.resend_one(model.acked[-2], r)
    assert model.w.children_in_store(sb.sid) == [child.sid]


def test_a_lifetime_counts_from_the_create_not_from_a_resume(model: DurableModel) -> None:
    """A sandbox's lifetime holds across replicas: a copy resumed on another replica got the whole
    lifetime again from its resume, and ran steps after the sandbox had expired."""
    a, b = 0, 1
    sb = model.new_sandbox(a, lifetime=3.0)
    model.step(sb, a, [["write", "a", "1"]])
    time.sleep(max(0.0, sb.born[1] + 2.0 - time.monotonic()))
    model.step(sb, b, [["write", "a", "2"]])  # resumed on B, 2 s into its 3 s
    time.sleep(max(0.0, sb.born[1] + 3.0 + LIFETIME_SLACK_S - time.monotonic()) + 0.1)
    ev, _ = exec_event(sb, [])
    call = model.call(b, ev)
    assert sb.state(call) == "gone"
    assert model.ended(sb, call)
    assert call.reply is not None and call.reply.data["details"]["reason"] == "lifetime", call.reply.data


def test_a_destroy_of_an_expired_sandbox_is_recorded_as_any_event(model: DurableModel) -> None:
    """A destroy that found the sandbox ended already (its lifetime passed) answered with the record of
    that end without noting its event: sent again with other content to another replica, it was
    answered 200 (the replica that first saw it: 409 idempotency_conflict)."""
    sb = model.new_sandbox(0, lifetime=2.0)
    model.step(sb, 0, [["write", "a", "1"]])
    time.sleep(max(0.0, sb.born[1] + 2.0 + LIFETIME_SLACK_S - time.monotonic()) + 0.1)
    model.step(sb, 1, [])  # 410: expired
    assert sb.ended == "lifetime"
    model.destroy(sb, 1)
    first = model.acked[-1]
    assert first.kind == "destroy" and first.data["reason"] == "lifetime", first
    for r in (0, 2, 1):  # (the others first: the replica that answered has the event in its own cache)
        model.expect(model.call(r, altered(first.ev)).reply, 409, "idempotency_conflict")
        model.resend_one(first, r)


def test_a_reply_recorded_by_a_newer_replica_is_replayed(model: DurableModel) -> None:
    """Replicas of two versions share the store during a rolling upgrade. A reply a newer one recorded,
    with a field this version does not know, was a 500 when the event came again to an older one (its
    reply models refuse unknown fields). (The record is rewritten here as a newer replica would write
    it; records are otherwise never rewritten.) Found by this test's own run while another change
    added ``isolation_summary`` to create replies and restarted replicas ran the newer code."""
    sb = model.new_sandbox(0)
    first = model.acked[-1]
    s3, key = model.w.seaweed.client(), f"rb/sandboxes/{sb.sid}/0000000000.json"
    raw = s3.get_object(Bucket=model.w.bucket, Key=key)["Body"].read()
    head, rest = raw.split(b"\n", 1)
    record = json.loads(head)
    record["reply"]["added_by_a_newer_version"] = {"nested": True}
    record["reply"]["limits"]["added_too"] = 1
    s3.put_object(Bucket=model.w.bucket, Key=key, Body=json.dumps(record).encode() + b"\n" + rest)
    for r in (1, 2):  # (replica 0 answers from its own cache)
        model.resend_one(first, r)  # this version's fields of it: the first reply
    model.step(sb, 1, [["write", "a", "1"]])


def test_a_store_outage_past_the_deadline_is_503_and_the_step_counts_once(model: DurableModel) -> None:
    """The store hangs while a step commits, past the store deadline: 503 store_unavailable with
    Retry-After; the commit may land once the store is back, and the client's retry (to another
    replica) is answered from it or runs the step: either way it counts once (~10 s: the deadline)."""
    sb = model.new_sandbox(0)
    model.step(sb, 1, [["write", "a", "before"]])
    model.store_outage(sb, 1, 2, [["append", "a", " during"]], 0.2)
    model.step(sb, 0, [["append", "a", " after"]])


def test_a_step_its_lifetime_cuts_short_is_410_sandbox_gone(model: DurableModel) -> None:
    """A step running as its sandbox's lifetime passed was 410 sandbox_died (the runtime's reaper ended
    the sandbox in use), where every other step on it, on any replica, is 410 sandbox_gone (lifetime)."""
    sb = model.new_sandbox(0, lifetime=2.0)
    model.step(sb, 0, [["write", "a", "1"]])
    time.sleep(max(0.0, sb.born[1] + 1.0 - time.monotonic()))
    ev, _ = exec_event(sb, [["write", "b", "2"], ["sleep", 1.5]], timeout_s=1.9)
    call = model.call(0, ev)
    assert call.answered > sb.born[0] + 2.0 and model.ended(sb, call), call.reply and call.reply.data
    assert call.reply is not None and call.reply.data["details"]["reason"] == "lifetime", call.reply.data


def test_a_step_that_loses_to_a_destroy_is_410(model: DurableModel) -> None:
    """A step that lost its commit to a destroy on another replica (or to an expiry recorded there) was
    409 sandbox_busy, "retry it", for a sandbox that is gone: its retry could only be 410. Found when
    a replica's reaper recorded an expiry while another replica ran a step on the sandbox."""
    sb = model.new_sandbox(0)
    model.step(sb, 0, [["write", "a", "1"]])
    model.step(sb, 1, [["write", "a", "2"]])  # both hold it live
    ev, _ = exec_event(sb, [["write", "a", "3"]], sleep_s=0.6)
    slow = model.call_soon(0, ev)
    time.sleep(0.2)
    model.destroy(sb, 1)
    call = slow.result()
    assert model.ended(sb, call) and call.reply is not None, call.reply and call.reply.data
    assert call.reply.data["details"]["reason"] == "destroyed", call.reply.data


def test_a_snapshot_of_an_unchanged_sandbox_from_a_snapshot_can_be_restored(model: DurableModel) -> None:
    """A snapshot of a sandbox that changed nothing is the empty layer over its parent; a sandbox from
    that, snapshotted unchanged again, stacked the same empty layer twice, which the kernel refuses in
    one overlay (ELOOP): every create from the second snapshot was a 500."""
    model.create(0)
    model.snapshot(model.fresh[-1], 1)  # nothing changed: the empty layer over the built-in snapshot
    model.create_from(model.snaps[-1], 2)
    model.snapshot(model.fresh[-1], 0)  # nothing changed again
    model.create_from(model.snaps[-1], 1)
    sb = model.fresh[-1]
    model.step(sb, 1, [["write", "a", "1"]])
    model.snapshot(sb, 1)  # a layer that is not empty, over those
    model.create_from(model.snaps[-1], 0)
    model.step(model.fresh[-1], 2, [["append", "a", "2"]])
