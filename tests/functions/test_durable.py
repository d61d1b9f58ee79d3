"""Durable sandboxes across real `rollbox serve` replicas: the store is the truth, a replica a cache.

Two (or more) real server processes share one real SeaweedFS bucket, as Knative replicas share S3;
the local-store cases run one server on its default local store and restart it.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import os
import signal
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from rollbox.functions.durable.store import BEHIND_WEIGHT, FRESH_ABOVE, FRESH_WEIGHT, TRUST_BELOW
from svc_testkit import Reply, ServerProc, event, send, start_server

from tests.snapshots.s3server import ACCESS_KEY, SECRET_KEY, SeaweedS3

pytestmark = pytest.mark.slow

CREATE, EXEC, DESTROY = "dev.rollbox.sandbox.create", "dev.rollbox.sandbox.exec", "dev.rollbox.sandbox.destroy"


class Replicas:
    """Starts `rollbox serve` processes that share one store; each has its own home (its cache)."""

    def __init__(self, base: Path, store_env: dict[str, str]):
        self.base = base
        self.store_env = store_env
        self.started: list[ServerProc] = []

    def start(self, *args: str, home: Path | None = None) -> ServerProc:
        name = uuid.uuid4().hex[:6]
        srv = start_server(self.base / name, "--home", str(home or self.base / f"home-{name}"), *args,
                           env=self.store_env)
        self.started.append(srv)
        return srv

    def stop_all(self) -> None:
        for srv in self.started:
            srv.stop()


@pytest.fixture
def s3_replicas(seaweed: SeaweedS3, tmp_path: Path) -> Iterator[Replicas]:
    bucket = seaweed.new_bucket()
    env = {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_REGION": "us-east-1",
           "ROLLBOX_STORE": f"s3://{bucket}/rb", "AWS_ENDPOINT_URL": seaweed.endpoint, "ROLLBOX_S3_MAX_ATTEMPTS": "2"}
    reps = Replicas(tmp_path, env)
    try:
        yield reps
    finally:
        reps.stop_all()


@pytest.fixture
def local_replicas(tmp_path: Path) -> Iterator[Replicas]:
    reps = Replicas(tmp_path, {})
    try:
        yield reps
    finally:
        reps.stop_all()


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=60) as client:
        yield client


async def step(http: httpx.AsyncClient, srv: ServerProc, sid: str, *, id: str | None = None, **data: Any) -> Reply:
    return await send(http, srv.url, event(EXEC, {"sandbox_id": sid, **data}, id=id))


async def create(http: httpx.AsyncClient, srv: ServerProc, **data: Any) -> str:
    r = await send(http, srv.url, event(CREATE, data))
    assert r.status == 200, r.data
    return str(r.data["sandbox_id"])


APPEND = "open('log.txt', 'a').write('{0}\\n'); print(open('log.txt').read(), end='')"


def metric(text: str, name: str, **labels: str) -> float:
    """The sum of a metric's samples named ``name`` whose labels include ``labels``."""
    return sum(smp.value for fam in text_string_to_metric_families(text) for smp in fam.samples
               if smp.name == name and all(smp.labels.get(k) == v for k, v in labels.items()))


async def test_steps_alternate_between_replicas_and_see_every_earlier_step(
        s3_replicas: Replicas, http: httpx.AsyncClient) -> None:
    a, b = s3_replicas.start(), s3_replicas.start()
    sid = await create(http, a)
    expected = ""
    for i in range(6):
        srv = (a, b)[i % 2]
        r = await step(http, srv, sid, code=APPEND.format(f"step{i}"))
        expected += f"step{i}\n"
        assert (r.status, r.data["stdout"]) == (200, expected), r.data
        # every step lands on the replica that did not run the one before (the first on its
        # create's, which committed it hibernated): resumed
        assert r.data["resumed"] is True, r.data
        if i > 0:
            assert r.data["resume_ms"] > 0
    text = (await http.get(b.url + "metrics")).text
    assert metric(text, "rollbox_resumes_total") == 3
    assert metric(text, "rollbox_stale_copies_total") == 2  # B noticed A had moved its copy on, twice
    # background processes do not survive a resume; files do (docs/design.md)
    r = await step(http, a, sid, command="sleep 300 & echo started")
    r = await step(http, b, sid, command="ps -e -o comm= | grep -c '^sleep$' || true; wc -l < log.txt")
    assert r.data["stdout"].split() == ["0", "6"], r.data


async def test_kill_9_after_an_acknowledged_step_loses_nothing(s3_replicas: Replicas, http: httpx.AsyncClient) -> None:
    a, b = s3_replicas.start(), s3_replicas.start()
    sid = await create(http, a)
    payload = uuid.uuid4().hex
    eid = uuid.uuid4().hex
    r = await step(http, a, sid, id=eid, command=f"echo {payload} >> kept.txt; cat kept.txt")
    assert r.status == 200
    os.kill(a.pid, signal.SIGKILL)  # right after the reply
    a.proc.wait(10)
    r = await step(http, b, sid, command="cat kept.txt")
    assert (r.status, r.data["stdout"], r.data["resumed"]) == (200, payload + "\n", True), r.data
    # the acknowledged event, redelivered to the survivor, is not run again: its recorded reply
    again = await step(http, b, sid, id=eid, command=f"echo {payload} >> kept.txt; cat kept.txt")
    assert (again.status, again.data["stdout"]) == (200, payload + "\n")
    r = await step(http, b, sid, command="wc -l < kept.txt")
    assert r.data["stdout"].strip() == "1"


async def test_sigterm_drains_and_a_fresh_replica_continues(s3_replicas: Replicas, http: httpx.AsyncClient) -> None:
    a = s3_replicas.start()
    sids = [await create(http, a) for _ in range(3)]
    for n, sid in enumerate(sids):
        assert (await step(http, a, sid, command=f"echo {n} > n.txt")).status == 200
    assert a.stop() == 0
    assert any(rec.get("msg") == "hibernated" and rec.get("sandboxes") == 3 for rec in a.log_records())
    fresh = s3_replicas.start()  # another home: an empty cache
    for n, sid in enumerate(sids):
        r = await step(http, fresh, sid, command="cat n.txt")
        assert (r.status, r.data["stdout"], r.data["resumed"]) == (200, f"{n}\n", True), r.data


async def test_one_event_sent_to_both_replicas_runs_once(s3_replicas: Replicas, http: httpx.AsyncClient) -> None:
    a, b = s3_replicas.start(), s3_replicas.start()
    sid = await create(http, a)
    await step(http, b, sid, code="print('warm b')")  # both hold a live copy now (A's is stale)
    eid = uuid.uuid4().hex
    code = "open('once.txt', 'a').write('line\\n')"
    first = await step(http, a, sid, id=eid, code=code)
    second = await step(http, b, sid, id=eid, code=code)
    assert first.status == second.status == 200 and first.data == second.data
    r = await step(http, a, sid, command="cat once.txt")
    assert r.data["stdout"] == "line\n"


async def test_concurrent_steps_through_two_replicas_one_commits_the_other_is_409(
        s3_replicas: Replicas, http: httpx.AsyncClient) -> None:
    a, b = s3_replicas.start(), s3_replicas.start()
    sid = await create(http, a)
    await step(http, b, sid, code="print(1)")
    await step(http, a, sid, code="print(1)")  # both replicas hold a copy at the same generation
    await step(http, b, sid, code="print(1)")
    await step(http, a, sid, code="print(1)")
    seen = []
    for _ in range(5):  # each round both copies are current; the two steps race for one generation
        await step(http, b, sid, code="print(1)")  # B at n+1, A's copy is stale and noticed
        await step(http, a, sid, code="print(1)")  # A at n+2, B's stale
        ra, rb = await asyncio.gather(
            step(http, a, sid, code="import time; time.sleep(0.3); open('who.txt', 'a').write('a\\n')"),
            step(http, b, sid, code="import time; time.sleep(0.3); open('who.txt', 'a').write('b\\n')"))
        seen.append(sorted((ra.status, rb.status)))
        ok = [r for r in (ra, rb) if r.status == 200]
        busy = [r for r in (ra, rb) if r.status == 409]
        assert len(ok) >= 1, (ra.data, rb.data)
        for r in busy:
            assert r.data["code"] == "sandbox_busy" and r.headers["retry-after"], r.data
    assert [200, 409] in seen, seen  # the race was lost at least once...
    lines = (await step(http, a, sid, command="cat who.txt")).data["stdout"].split()
    assert len(lines) == sum(s.count(200) for s in seen)  # ...and a loser's step left nothing behind


async def test_destroy_on_one_replica_is_410_on_the_other(s3_replicas: Replicas, http: httpx.AsyncClient) -> None:
    a, b = s3_replicas.start(), s3_replicas.start()
    sid = await create(http, a)
    await step(http, b, sid, code="print(1)")
    r = await send(http, a.url, event(DESTROY, {"sandbox_id": sid}))
    assert r.status == 200 and r.data["execs"] == 1 and r.data["billed_s"] >= 1, r.data
    r = await step(http, b, sid, code="print(1)")
    assert (r.status, r.data["code"], r.data["details"]["reason"]) == (410, "sandbox_gone", "destroyed"), r.data
    r = await send(http, b.url, event(DESTROY, {"sandbox_id": sid}))  # repeating a destroy: the same record
    assert r.status == 200 and r.data["execs"] == 1


async def test_store_outage_during_a_step_is_503_and_nothing_half_written(
        s3_replicas: Replicas, seaweed: SeaweedS3, http: httpx.AsyncClient) -> None:
    a = s3_replicas.start()
    sid = await create(http, a)
    assert (await step(http, a, sid, command="echo before > f.txt")).status == 200
    seaweed.stop()
    try:
        r = await step(http, a, sid, command="echo during > f.txt")
        assert (r.status, r.data["code"]) == (503, "store_unavailable"), r.data
        assert r.headers["retry-after"]
    finally:
        seaweed.start()
    r = await step(http, a, sid, command="cat f.txt")
    assert (r.status, r.data["stdout"]) == (200, "before\n"), r.data  # the unacknowledged step left nothing


async def running(tag: str) -> bool:
    """Whether a process with ``tag`` in its command line runs (on the host), waiting up to 5 s for it to go."""
    for _ in range(50):
        if not subprocess.run(["pgrep", "-f", tag], capture_output=True).stdout:
            return False
        await asyncio.sleep(0.1)
    return True


async def hibernated_idle(http: httpx.AsyncClient, srv: ServerProc, n: int) -> None:
    deadline = time.monotonic() + 15
    while metric((await http.get(srv.url + "metrics")).text, "rollbox_hibernations_total", reason="idle") < n:
        assert time.monotonic() < deadline, "the idle sandbox did not hibernate"
        await asyncio.sleep(0.2)


async def test_idle_sandbox_hibernates_and_the_next_step_resumes_it(
        local_replicas: Replicas, http: httpx.AsyncClient) -> None:
    srv = local_replicas.start("--hibernate-after-s", "1")
    sid = await create(http, srv)
    tag = uuid.uuid4().hex
    r = await step(http, srv, sid, command=f"echo kept > k.txt; python3 -c 'import time; time.sleep(300)' rollbox-{tag} &")
    assert r.status == 200
    found = subprocess.run(["pgrep", "-f", f"rollbox-{tag}"], capture_output=True, text=True).stdout.split()
    assert found, "the background process should run while the sandbox is live"
    await hibernated_idle(http, srv, 1)
    text = (await http.get(srv.url + "metrics")).text
    assert metric(text, "rollbox_hibernations_total", reason="idle") == 1
    assert metric(text, "rollbox_live_sandboxes") == 0  # its processes ended, its memory released
    assert not await running(f"rollbox-{tag}")
    r = await step(http, srv, sid, command="cat k.txt")
    assert (r.status, r.data["stdout"], r.data["resumed"]) == (200, "kept\n", True), r.data


async def test_a_step_after_a_long_pause_passes_through_and_a_quick_one_stays_live(
        local_replicas: Replicas, http: httpx.AsyncClient) -> None:
    srv = local_replicas.start("--hibernate-after-s", "1")
    sid = await create(http, srv)
    assert (await step(http, srv, sid, code=APPEND.format("a"))).status == 200
    await hibernated_idle(http, srv, 1)
    # idle longer than a live copy lasts (1 s): the step runs as the resumed sandbox's init, and the
    # sandbox hibernates with it; what it wrote is committed, what it left running is gone
    tag = f"rollbox-{uuid.uuid4().hex}"
    r = await step(http, srv, sid, command=f"echo b >> log.txt; cat log.txt; python3 -c 'import time; time.sleep(300)' {tag} &")
    assert (r.status, r.data["stdout"], r.data["resumed"], r.data["hibernated"], r.data["sandbox_alive"]) \
        == (200, "a\nb\n", True, True, True), r.data
    assert not await running(tag)
    text = (await http.get(srv.url + "metrics")).text
    assert metric(text, "rollbox_hibernations_total", reason="step") == 1
    assert metric(text, "rollbox_live_sandboxes") == 0
    # the next step comes at once: resumed (files as committed), and this time it stays live
    r = await step(http, srv, sid, command=f"cat log.txt; python3 -c 'import time; time.sleep(300)' {tag}-2 &")
    assert (r.status, r.data["stdout"], r.data["resumed"], r.data["hibernated"]) == (200, "a\nb\n", True, None), r.data
    assert subprocess.run(["pgrep", "-f", f"{tag}-2"], capture_output=True).stdout, "a live sandbox keeps its processes"
    r = await step(http, srv, sid, command="echo c >> log.txt; cat log.txt")
    assert (r.status, r.data["stdout"], r.data["resumed"]) == (200, "a\nb\nc\n", None), r.data
    # a step that passes through and times out: its init is killed, its files are kept, the sandbox goes on
    await hibernated_idle(http, srv, 2)
    r = await step(http, srv, sid, command="echo t > t.txt; sleep 30", timeout_s=1)
    assert (r.status, r.data["timed_out"], r.data["hibernated"], r.data["sandbox_alive"]) == (200, True, True, True), r.data
    r = await step(http, srv, sid, command="cat log.txt t.txt")
    assert (r.status, r.data["stdout"]) == (200, "a\nb\nc\nt\n"), r.data
    # files to read back after the program: the agent reads them, so that step stays live
    await hibernated_idle(http, srv, 3)
    r = await step(http, srv, sid, command="echo r > r.txt", read_files=["r.txt"])
    assert (r.status, r.data["files"], r.data["resumed"], r.data["hibernated"]) == (200, {"r.txt": "r\n"}, True, None)
    # a step refused once its sandbox was resumed (a timeout past the sandbox's lifetime) leaves a live
    # copy that is not passing through: the next step runs on it as on any live copy (and says resumed:
    # the step before it that ran was before the hibernation)
    await hibernated_idle(http, srv, 4)
    r = await step(http, srv, sid, command="true", timeout_s=3600)
    assert (r.status, r.data["code"], "lifetime_s" in r.data["message"]) == (400, "invalid_data", True), r.data
    r = await step(http, srv, sid, command="cat r.txt", read_files=["r.txt"])
    assert (r.status, r.data["files"], r.data["resumed"], r.data["hibernated"]) == (200, {"r.txt": "r\n"}, True, None)


async def test_steps_that_change_many_files_or_large_ones_are_committed_as_small_ones_are(
        local_replicas: Replicas, http: httpx.AsyncClient) -> None:
    # a commit scans a small upper directory on the event loop and a larger one in a thread
    # (snapshots/state.py SMALL_SCAN: 256 entries, 256 KiB to read): both must commit the same files
    srv = local_replicas.start("--hibernate-after-s", "1")
    sid = await create(http, srv)
    many = "import os, hashlib\nos.makedirs('d', exist_ok=True)\n" \
           "for i in range(300): open(f'd/{i}.txt', 'w').write(str(i))\n" \
           "open('big.bin', 'wb').write(hashlib.sha256(b'x').digest() * 10000)\n"
    check = "import os, hashlib\nprint(len(os.listdir('d')), sum(int(open(f'd/{n}').read()) for n in os.listdir('d')), " \
            "hashlib.sha256(open('big.bin', 'rb').read()).hexdigest()[:12], open('s.txt').read())"
    want = f"300 {sum(range(300))} {hashlib.sha256(hashlib.sha256(b'x').digest() * 10000).hexdigest()[:12]}"
    r = await step(http, srv, sid, code=many + "open('s.txt', 'w').write('one')")
    assert r.status == 200 and r.data["exit_code"] == 0, r.data
    r = await step(http, srv, sid, code="open('s.txt', 'w').write('two')")  # a small change on a large upper
    assert r.status == 200 and r.data["exit_code"] == 0, r.data
    await hibernated_idle(http, srv, 1)
    r = await step(http, srv, sid, code=check)  # resumed with all 302 files (passes through)
    assert (r.status, r.data["stdout"].strip(), r.data["hibernated"]) == (200, f"{want} two", True), r.data
    r = await step(http, srv, sid, code="import os\nos.remove('big.bin')\nopen('s.txt', 'w').write('three')")
    assert r.status == 200, r.data
    r = await step(http, srv, sid, code="import os\nprint(os.path.exists('big.bin'), len(os.listdir('d')), open('s.txt').read())")
    assert (r.status, r.data["stdout"].strip()) == (200, "False 300 three"), r.data


def sandboxes_made(text: str) -> float:
    """Sandboxes this replica restored (or took from its pool) for requests: its resumes, and the
    creates that made a live sandbox."""
    return metric(text, "rollbox_resumes_total") + metric(text, "rollbox_sandbox_create_seconds_count")


async def test_a_create_restores_no_sandbox_its_first_step_does(
        local_replicas: Replicas, http: httpx.AsyncClient) -> None:
    """A create runs nothing in its sandbox: it is committed hibernated and its first step (or fork,
    snapshot) resumes it. So a create and destroy without a step make no sandbox, a create and a step
    make one; a create that names no snapshot or asks for bad limits is still refused at create."""
    srv = local_replicas.start()
    # the isolation a create reports is what the replica's sandboxes read back: its prewarm's (which goes
    # on after the server listens) must have run for the summary to say more than "not read back yet"
    for _ in range(300):
        if any(r.get("msg") == "prewarmed" for r in srv.log_records()):
            break
        await asyncio.sleep(0.05)
    else:
        raise AssertionError("the replica never prewarmed its snapshot")

    async def made() -> str:
        return (await http.get(srv.url + "metrics")).text

    r = await send(http, srv.url, event(CREATE, {"metadata": {"task": "t1"}}))
    assert (r.status, r.data["hibernated"], r.data["pooled"]) == (200, True, False), r.data
    assert "namespaces mnt" in r.data["isolation_summary"] and r.data["metadata"] == {"task": "t1"}
    assert r.data["limits"]["memory_max_bytes"] > 0 and r.data["env_version"], r.data
    r = await send(http, srv.url, event(DESTROY, {"sandbox_id": r.data["sandbox_id"]}))
    assert (r.status, r.data["execs"], r.data["wall_s"], r.data["billed_s"]) == (200, 0, 0, 0), r.data  # never live
    text = await made()
    assert (sandboxes_made(text), metric(text, "rollbox_live_sandboxes")) == (0, 0)
    assert metric(text, "rollbox_hibernations_total", reason="create") == 1

    sid = await create(http, srv)
    r = await step(http, srv, sid, command="echo first > f.txt; cat f.txt")  # its first step resumes it
    assert (r.status, r.data["stdout"], r.data["resumed"]) == (200, "first\n", True), r.data
    assert sandboxes_made(await made()) == 1
    r = await step(http, srv, sid, command="cat f.txt")  # right after: its live copy lasted
    assert (r.status, r.data["stdout"], r.data["resumed"]) == (200, "first\n", None), r.data
    assert sandboxes_made(await made()) == 1

    # a fork of, and a snapshot of, a sandbox never restored resume it first
    fresh = await create(http, srv)
    r = await send(http, srv.url, event("dev.rollbox.sandbox.fork", {"sandbox_id": fresh, "count": 2}))
    assert r.status == 200 and len(r.data["sandboxes"]) == 2, r.data
    other = await create(http, srv)
    r = await send(http, srv.url, event("dev.rollbox.sandbox.snapshot", {"sandbox_id": other}))
    assert r.status == 200 and r.data["snapshot_id"], r.data
    r = await step(http, srv, other, command="echo still here")
    assert (r.status, r.data["stdout"]) == (200, "still here\n"), r.data

    r = await send(http, srv.url, event(CREATE, {"snapshot": "no-such-snapshot"}))
    assert (r.status, r.data["code"]) == (404, "snapshot_not_found") and "no-such-snapshot" in r.data["message"]
    r = await send(http, srv.url, event(CREATE, {"limits": {"memory_max_bytes": 1}}))
    assert r.status == 400 and "memory_max_bytes" in r.data["message"], r.data
    assert metric(await made(), "rollbox_hibernations_total", reason="create") == 4  # (the refused made none)


async def test_at_the_live_cap_creates_hibernate_idle_sandboxes(
        local_replicas: Replicas, http: httpx.AsyncClient) -> None:
    srv = local_replicas.start("--max-live", "2")
    sids = []
    for n in range(5):
        sid = await create(http, srv)
        assert (await step(http, srv, sid, command=f"echo {n} > n.txt")).status == 200
        sids.append(sid)
    text = (await http.get(srv.url + "metrics")).text
    assert metric(text, "rollbox_live_sandboxes") <= 2
    assert metric(text, "rollbox_hibernations_total", reason="pressure") >= 3
    for n, sid in enumerate(sids):  # every episode is still there
        r = await step(http, srv, sid, command="cat n.txt")
        assert (r.status, r.data["stdout"]) == (200, f"{n}\n"), r.data


async def test_at_the_live_cap_with_every_sandbox_running_a_resume_waits_for_a_step_to_end(
        local_replicas: Replicas, http: httpx.AsyncClient) -> None:
    srv = local_replicas.start("--max-live", "1")
    a = await create(http, srv)  # (committed hibernated: no live copy)
    b = await create(http, srv)
    running_step = asyncio.create_task(step(http, srv, a, command="sleep 1.5; echo a"))  # resumes a
    await asyncio.sleep(0.7)  # the only live sandbox is running a step: no idle one to hibernate
    t0 = time.monotonic()
    r = await step(http, srv, b, command="echo b")
    waited = time.monotonic() - t0
    assert (r.status, r.data["stdout"], r.data["resumed"]) == (200, "b\n", True), r.data  # not 429
    assert waited > 0.4, waited  # it waited for a's step to end
    assert (await running_step).data["stdout"] == "a\n"
    text = (await http.get(srv.url + "metrics")).text  # b's resume pushed a out once a's step ended
    assert [metric(text, "rollbox_hibernations_total", reason=why) for why in ("pressure", "step")] == [1, 0]


async def test_restart_on_the_local_store_keeps_episodes_and_replays_acknowledged_events(
        local_replicas: Replicas, tmp_path: Path, http: httpx.AsyncClient) -> None:
    home = tmp_path / "home"
    srv = local_replicas.start(home=home)
    sid = await create(http, srv)
    eid = uuid.uuid4().hex
    r = await step(http, srv, sid, id=eid, code=APPEND.format("once"))
    assert (r.status, r.data["stdout"]) == (200, "once\n")
    os.kill(srv.pid, signal.SIGKILL)
    srv.proc.wait(10)
    again = local_replicas.start(home=home)
    r2 = await step(http, again, sid, id=eid, code=APPEND.format("once"))  # the client's retry
    assert (r2.status, r2.data) == (200, r.data)  # the recorded reply; it did not run again
    r3 = await step(http, again, sid, command="cat log.txt")
    assert (r3.status, r3.data["stdout"]) == (200, "once\n")


async def test_lifetime_holds_across_hibernation_and_the_sweeper_cleans_up(
        local_replicas: Replicas, tmp_path: Path, http: httpx.AsyncClient) -> None:
    home = tmp_path / "home"
    ttl_s = 3.0  # the replay window: a destroyed sandbox's records go this long after its tombstone
    srv = local_replicas.start("--hibernate-after-s", "0.3", "--sweep-interval-s", "0.5",
                               "--idempotency-ttl-s", str(ttl_s), home=home)
    t0 = time.monotonic()
    # `short`'s lifetime ends about when `gone`'s records may go, so its own tombstone stays ~ttl_s longer
    # than they do, however late a busy box's sweep comes (one sweep removing both failed this test)
    short = (await send(http, srv.url, event(CREATE, {"timeout_s": ttl_s + 0.5}))).data["sandbox_id"]
    kept = await create(http, srv)
    gone = await create(http, srv)
    assert (await send(http, srv.url, event(DESTROY, {"sandbox_id": gone}))).status == 200
    assert (home / "sandboxes" / gone).is_dir()
    # destroyed sandboxes' records go once the replay window (--idempotency-ttl-s) has passed
    deadline = time.monotonic() + 15
    while (home / "sandboxes" / gone).exists() and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    assert not (home / "sandboxes" / gone).exists()
    # meanwhile `short` hibernated, then outlived its lifetime: its tombstone (the sweeper's, or this
    # step's on the expired record it reads) says so
    await asyncio.sleep(max(0.0, t0 + ttl_s + 0.7 - time.monotonic()))
    r = await step(http, srv, short, code="print(1)")
    assert (r.status, r.data["code"], r.data["details"].get("reason")) == (410, "sandbox_gone", "lifetime"), r.data
    r = await step(http, srv, kept, code="print(1)")
    assert (r.status, r.data["resumed"]) == (200, True), r.data
    assert (home / "sandboxes" / kept).is_dir()


async def test_client_raises_store_unavailable_within_its_retry_budget(
        s3_replicas: Replicas, seaweed: SeaweedS3) -> None:
    from rollbox.functions.client import Client, StoreUnavailableError

    a = s3_replicas.start()
    seaweed.stop()
    try:
        async with Client(a.url, retries=5, retry_budget_s=3.0) as client:
            t0 = time.monotonic()
            with pytest.raises(StoreUnavailableError) as info:
                await client.create()
            took = time.monotonic() - t0
        # the reply's Retry-After (5 s) does not fit the 3 s budget: raised at once, typed by its code
        assert info.value.status == 503 and info.value.code == "store_unavailable" and took < 3.0, took
    finally:
        seaweed.start()


async def assert_files(http: httpx.AsyncClient, srv: ServerProc, sid: str, acked: list[int]) -> None:
    """Every file an acknowledged step wrote is there, once, with its content (and no other)."""
    r = await step(http, srv, sid, command="cd /tmp && for f in f*; do [ -e \"$f\" ] && echo \"$f $(cat \"$f\")\"; done; true")
    assert r.status == 200, r.data
    assert sorted(r.data["stdout"].split("\n")[:-1]) == sorted(f"f{n} x{n}" for n in acked), r.data


async def test_a_duplicate_on_the_other_replica_leaves_the_episode_whole(
        s3_replicas: Replicas, http: httpx.AsyncClient) -> None:
    # issue 25.1: after B answered a duplicate of A's step from the record, B's next commit named inline
    # contents in a generation that does not hold them: A's resume failed (500) until the sandbox was gone
    a, b = s3_replicas.start(), s3_replicas.start()
    sid = await create(http, a)
    acked: list[int] = []

    async def write(srv: ServerProc, n: int, id: str | None = None) -> Reply:
        r = await step(http, srv, sid, id=id, command=f"echo x{n} > /tmp/f{n}")
        assert r.status == 200, r.data
        if n not in acked:
            acked.append(n)
        return r

    for n in range(4):
        await write((a, b)[n % 2], n)
        await assert_files(http, (b, a)[n % 2], sid, acked)
    eid = uuid.uuid4().hex
    first = await write(a, 4, id=eid)
    again = await step(http, b, sid, id=eid, command="echo x4 > /tmp/f4")
    assert (again.status, again.data) == (200, first.data)
    # (long enough that the generations holding inline files pass 32: a set of them is not sorted then)
    for n, srv in enumerate((b, a, a, b, a, b, b, a, b, a, a, b), start=5):
        await write(srv, n)
        for other in (a, b):
            await assert_files(http, other, sid, acked)


async def test_racing_steps_through_two_replicas_with_files_are_200_and_409(
        s3_replicas: Replicas, http: httpx.AsyncClient) -> None:
    a, b = s3_replicas.start(), s3_replicas.start()
    sid = await create(http, a)
    acked: list[int] = []
    n = 0
    seen = []
    for srv in (a, b, a, b):
        assert (await step(http, srv, sid, command=f"echo x{n} > /tmp/f{n}")).status == 200
        acked.append(n)
        n += 1
    eid = uuid.uuid4().hex
    assert (await step(http, a, sid, id=eid, command=f"echo x{n} > /tmp/f{n}")).status == 200
    assert (await step(http, b, sid, id=eid, command=f"echo x{n} > /tmp/f{n}")).status == 200
    acked.append(n)
    n += 1
    for _ in range(3):
        for srv in (b, a):  # both copies current and live
            assert (await step(http, srv, sid, command=f"echo x{n} > /tmp/f{n}")).status == 200
            acked.append(n)
            n += 1
        ra, rb = await asyncio.gather(
            step(http, a, sid, command=f"sleep 0.3; echo x{n} > /tmp/f{n}"),
            step(http, b, sid, command=f"sleep 0.3; echo x{n + 1} > /tmp/f{n + 1}"))
        statuses = sorted((ra.status, rb.status))
        seen.append(statuses)
        assert statuses in ([200, 409], [200, 200]), (ra.data, rb.data)
        for k, r in ((n, ra), (n + 1, rb)):
            if r.status == 200:
                acked.append(k)
            else:
                assert r.data["code"] == "sandbox_busy", r.data
        n += 2
        for srv in (a, b):
            await assert_files(http, srv, sid, acked)
    assert [200, 409] in seen, seen  # the race was lost at least once (a 500 before the fix)


async def store_requests(http: httpx.AsyncClient, srv: ServerProc) -> dict[str, int]:
    """The replica's S3 requests by operation, but for its readiness checks of the bucket (HeadBucket)."""
    text = (await http.get(srv.url + "metrics")).text
    return {smp.labels["operation"]: int(smp.value) for fam in text_string_to_metric_families(text)
            for smp in fam.samples if smp.name == "rollbox_store_requests_total" and smp.value
            and smp.labels["operation"] != "HeadBucket"}


async def test_s3_requests_per_step_kind(s3_replicas: Replicas, http: httpx.AsyncClient) -> None:
    """What each kind of step asks of S3 (rollbox_store_requests_total, by operation): a create is its
    create-only PUT alone (a redelivered one learns of its sandbox from that PUT's 412); a step on a
    replica that never saw the sandbox lists its records, reads the newest and commits (the listing
    says it is the newest: a commit since is caught by the create-only PUT)."""
    quiet = ("--record", "off", "--sweep-interval-s", "3600")
    a, b = s3_replicas.start(*quiet), s3_replicas.start(*quiet)

    async def asks(srv: ServerProc, ev: Any) -> tuple[Reply, dict[str, int]]:
        before = await store_requests(http, srv)
        r = await send(http, srv.url, ev)
        after = await store_requests(http, srv)
        return r, {op: n - before.get(op, 0) for op, n in after.items() if n != before.get(op, 0)}

    made = event(CREATE, {})
    r, n = await asks(a, made)
    assert r.status == 200 and n == {"PutObject": 1}, (r.data, n)
    sid = r.data["sandbox_id"]
    r, n = await asks(a, event(EXEC, {"sandbox_id": sid, "code": APPEND.format("s1")}))  # its live copy is here
    assert r.status == 200 and n == {"GetObject": 1, "PutObject": 1}, (r.data, n)
    r, n = await asks(b, event(EXEC, {"sandbox_id": sid, "code": APPEND.format("s2")}))  # never seen on b
    assert r.data["stdout"] == "s1\ns2\n" and n == {"ListObjectsV2": 1, "GetObject": 1, "PutObject": 1}, (r.data, n)
    r, n = await asks(b, made)  # the create again, on the replica that did not make it: the same sandbox
    assert r.status == 200 and r.data["sandbox_id"] == sid, r.data
    r, n = await asks(a, event(DESTROY, {"sandbox_id": sid}))  # a's copy is stale: the newer record, and none after
    assert r.status == 200 and n == {"GetObject": 2, "PutObject": 1}, (r.data, n)
    c = s3_replicas.start(*quiet)  # scaled to zero and back: a replica with nothing cached
    r, n = await asks(c, event(EXEC, {"sandbox_id": sid, "code": "print(1)"}))
    assert r.status == 410 and n == {"ListObjectsV2": 1, "GetObject": 1}, (r.data, n)
    r = await send(http, c.url, made)  # the create again where its sandbox is not live: told by the PUT's 412
    assert r.status == 200 and r.data["sandbox_id"] == sid, r.data


async def test_a_replica_whose_lookups_find_fresh_sandboxes_reads_their_first_two_generations_not_a_listing(
        s3_replicas: Replicas, http: httpx.AsyncClient) -> None:
    """Behind a balancer without affinity, an episode's first step lands on the replica that did not
    create its sandbox half the time. Once such lookups have kept finding the sandbox at its create's
    generation, the replica reads generations 0 and 1 at once instead of listing: generation 0 alone
    found is the newest (two GETs, no listing). A sandbox that moved on costs the listing as well (its
    generation 1, already read, is not read again), and one or two of those bring the listing back."""
    quiet = ("--record", "off", "--sweep-interval-s", "3600")
    a, b = s3_replicas.start(*quiet), s3_replicas.start(*quiet)
    listed, guessed, first = {"ListObjectsV2": 1, "GetObject": 1, "PutObject": 1}, {"GetObject": 2, "PutObject": 1}, []

    async def first_step_on_b(sid: str, lines: str = "") -> dict[str, int]:
        before = await store_requests(http, b)
        r = await step(http, b, sid, code=APPEND.format("b"))
        assert (r.status, r.data["stdout"]) == (200, lines + "b\n"), r.data
        after = await store_requests(http, b)
        return {op: n - before.get(op, 0) for op, n in after.items() if n != before.get(op, 0)}

    for _ in range(12):  # fresh sandboxes (a's creates): listed, until b has seen enough of them
        first.append(await first_step_on_b(await create(http, a)))
    n = math.ceil(math.log(1 - FRESH_ABOVE) / math.log(1 - FRESH_WEIGHT)) + 1  # (the moving average from 0)
    assert first == [listed] * (n - 1) + [guessed] * (12 - n + 1), first
    moved: list[dict[str, int]] = []
    for _ in range(3):  # sandboxes a created and stepped: b reads 0 and 1, finds 1, lists; then lists first
        sid = await create(http, a)
        assert (await step(http, a, sid, code=APPEND.format("a"))).status == 200
        moved.append(await first_step_on_b(sid, "a\n"))
    assert moved[0] == {"GetObject": 2, "ListObjectsV2": 1, "PutObject": 1} and moved[-1] == listed, moved


async def test_a_replica_whose_sandboxes_stay_put_commits_with_the_put_alone_and_runs_again_when_behind(
        s3_replicas: Replicas, http: httpx.AsyncClient) -> None:
    """Once a replica's steps have kept finding their sandbox where they left it (one replica, or a load
    balancer with affinity), an exec runs on its live copy without reading the next generation first:
    one PUT. When another replica had moved the sandbox on after all, that PUT's 412 says so: nothing
    of the run is kept, the step runs again on the newest (every earlier step's line there, its own
    once), and the replica reads first again."""
    quiet = ("--record", "off", "--sweep-interval-s", "3600")
    a, b = s3_replicas.start(*quiet), s3_replicas.start(*quiet)
    sid = await create(http, a)
    lines = ""
    # each reads the next generation first and finds none: a's estimate falls from 0.5 below TRUST_BELOW
    for i in range(math.ceil(math.log(TRUST_BELOW / 0.5) / math.log(1 - BEHIND_WEIGHT))):
        r = await step(http, a, sid, code=APPEND.format(f"a{i}"))
        lines += f"a{i}\n"
        assert (r.status, r.data["stdout"]) == (200, lines), r.data
    before = await store_requests(http, a)
    r = await step(http, a, sid, code=APPEND.format("trusted"))
    lines += "trusted\n"
    after = await store_requests(http, a)
    assert (r.status, r.data["stdout"]) == (200, lines), r.data
    assert {op: n - before.get(op, 0) for op, n in after.items() if n != before.get(op, 0)} == {"PutObject": 1}
    r = await step(http, b, sid, code=APPEND.format("on b"))  # moved on behind a's back
    lines += "on b\n"
    assert (r.status, r.data["stdout"]) == (200, lines), r.data
    r = await step(http, a, sid, code=APPEND.format("again"))  # ran on a's stale copy, then on the newest
    lines += "again\n"
    assert (r.status, r.data["stdout"], r.data["resumed"]) == (200, lines, True), r.data
    before = await store_requests(http, a)
    r = await step(http, a, sid, code=APPEND.format("read first"))
    lines += "read first\n"
    after = await store_requests(http, a)
    assert (r.status, r.data["stdout"]) == (200, lines), r.data
    assert {op: n - before.get(op, 0) for op, n in after.items() if n != before.get(op, 0)} == \
        {"GetObject": 1, "PutObject": 1}


async def test_behind_a_round_robin_balancer_a_step_reads_one_generation_and_runs_again_if_two_were_committed(
        s3_replicas: Replicas, http: httpx.AsyncClient) -> None:
    """Steps alternating between two replicas (round robin, no affinity), each finding its sandbox
    hibernated: a step reads the generation the other replica committed and takes it as the newest
    without the GET that would find nothing after it: one GET and the commit's PUT. When two were
    committed elsewhere meanwhile, that PUT's 412 says so: nothing of the run is kept, it runs again
    on the newest (every earlier step's line there, its own once)."""
    args = ("--record", "off", "--sweep-interval-s", "3600", "--hibernate-after-s", "0.05")
    a, b = s3_replicas.start(*args), s3_replicas.start(*args)
    sid = await create(http, a)
    lines = ""

    async def on(srv: ServerProc, name: str) -> dict[str, int]:
        nonlocal lines
        await asyncio.sleep(0.3)  # past --hibernate-after-s: the step resumes from the store
        before = await store_requests(http, srv)
        r = await step(http, srv, sid, code=APPEND.format(name))
        lines += f"{name}\n"
        assert (r.status, r.data["stdout"], r.data["resumed"]) == (200, lines, True), r.data
        after = await store_requests(http, srv)
        return {op: n - before.get(op, 0) for op, n in after.items() if n != before.get(op, 0)}

    await on(a, "a0")
    await on(b, "b0")  # b never saw it: lists its records
    for i in range(1, 4):
        assert await on(a, f"a{i}") == {"GetObject": 1, "PutObject": 1}
        assert await on(b, f"b{i}") == {"GetObject": 1, "PutObject": 1}
    await on(a, "a4")
    await on(a, "a5")  # a twice: b's newest seen is now two generations back
    # read b3's successor a4 (not the newest), ran, the commit's 412; then a5, none after it, ran again
    assert await on(b, "b4") == {"GetObject": 4, "PutObject": 2}
    assert await on(a, "a6") == {"GetObject": 1, "PutObject": 1}


async def test_a_destroy_on_what_was_seen_is_the_put_alone_and_runs_again_when_behind(
        s3_replicas: Replicas, http: httpx.AsyncClient) -> None:
    """A destroy commits its tombstone as an exec commits a step: where the replica's steps keep finding
    their sandboxes where they left them, on what it saw last, unread: the PUT alone. When another
    replica had moved the sandbox on, that PUT's 412 says so and the destroy runs again on the newest:
    its usage counts the other replica's step, and the sandbox is gone everywhere."""
    quiet = ("--record", "off", "--sweep-interval-s", "3600")
    a, b = s3_replicas.start(*quiet), s3_replicas.start(*quiet)
    sid = await create(http, a)
    # each reads the next generation first and finds none: a's estimate falls from 0.5 below TRUST_BELOW
    steps = math.ceil(math.log(TRUST_BELOW / 0.5) / math.log(1 - BEHIND_WEIGHT))
    for i in range(steps):
        assert (await step(http, a, sid, code=f"print({i})")).status == 200
    moved = await create(http, a)
    before = await store_requests(http, a)
    r = await send(http, a.url, event(DESTROY, {"sandbox_id": sid}))
    after = await store_requests(http, a)
    assert r.status == 200 and r.data["execs"] == steps, r.data
    assert {op: n - before.get(op, 0) for op, n in after.items() if n != before.get(op, 0)} == {"PutObject": 1}
    assert (await step(http, b, moved, code="print('on b')")).status == 200  # behind a's back
    r = await send(http, a.url, event(DESTROY, {"sandbox_id": moved}))
    assert r.status == 200 and r.data["execs"] == 1, r.data
    for srv in (a, b):
        r = await step(http, srv, moved, code="print(1)")
        assert (r.status, r.data["code"]) == (410, "sandbox_gone"), r.data
        r = await step(http, srv, sid, code="print(1)")
        assert (r.status, r.data["code"]) == (410, "sandbox_gone"), r.data
