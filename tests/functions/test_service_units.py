"""The pure parts: schemas are current, config casting is strict, the idempotency cache keeps its promises."""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time

import pytest
from rollbox.functions.contract import schemas
from rollbox.functions.contract.models import CreateData, ExecData, Limits
from rollbox.functions.durable.residency import PRESSURE_MEMORY_S
from rollbox.functions.durable.runtime import DurableRuntime
from rollbox.functions.service.idempotency import Conflict, IdempotencyCache
from rollbox.functions.service.server import OPTIONS, ConfigError, resolve
from rollbox.runtime.runtime import Runtime, RuntimeConfig
from rollbox.snapshots.state import LocalObjects, SandboxRecord


def test_json_schemas_are_current() -> None:
    assert schemas.stale() == [], "run: python -m rollbox.functions.contract.schemas"
    assert schemas.main(["--check"]) == 0


def test_stale_schema_is_detected(tmp_path) -> None:  # type: ignore[no-untyped-def]
    for name, text in schemas.render().items():
        (tmp_path / name).write_text(text)
    assert schemas.stale(tmp_path) == []
    (tmp_path / "dev.rollbox.sandbox.exec.json").write_text("{}")
    (tmp_path / "dev.rollbox.old.json").write_text("{}")
    assert schemas.stale(tmp_path) == ["dev.rollbox.sandbox.exec.json", "dev.rollbox.old.json"]


def _args(**kw: str) -> argparse.Namespace:
    ns = argparse.Namespace(**{o.dest: None for o in OPTIONS})
    for k, v in kw.items():
        setattr(ns, k, v)
    return ns


def test_config_flag_env_default() -> None:
    cfg = resolve(_args(), {})
    assert (cfg.host, cfg.port, cfg.service.max_live) == ("127.0.0.1", 8080, 256)
    cfg = resolve(_args(), {"PORT": "9000", "HOST": "::1", "ROLLBOX_MAX_LIVE": "5", "ROLLBOX_GRACE_S": "2.5"})
    assert (cfg.host, cfg.port, cfg.service.max_live, cfg.grace_s) == ("::1", 9000, 5, 2.5)
    cfg = resolve(_args(port="9001"), {"PORT": "9000"})
    assert cfg.port == 9001  # the flag wins


@pytest.mark.parametrize(
    "env,needle",
    [
        ({"PORT": "http"}, "PORT: not a valid integer"),
        ({"ROLLBOX_MAX_QUEUED": "0"}, "ROLLBOX_MAX_QUEUED: must be >= 1"),
        ({"ROLLBOX_MAX_BODY_BYTES": "1e6"}, "ROLLBOX_MAX_BODY_BYTES: not a valid integer"),
        ({"ROLLBOX_IDEMPOTENCY_TTL_S": "inf"}, "ROLLBOX_IDEMPOTENCY_TTL_S: must be a finite number > 0"),
        ({"ROLLBOX_LOG_LEVEL": "loud"}, "ROLLBOX_LOG_LEVEL: not a log level"),
    ],
)
def test_config_is_cast_strictly(env: dict[str, str], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        resolve(_args(), env)


def test_contract_models() -> None:
    assert CreateData(timeout_s=60).effective_limits() == {"lifetime_s": 60}  # changes to the snapshot's defaults
    assert CreateData(limits={"pids_max": 9}, timeout_s=5).effective_limits() == {"pids_max": 9, "lifetime_s": 5}
    assert CreateData().effective_limits() is None  # the snapshot's defaults
    with pytest.raises(ValueError, match="lifetime"):
        CreateData(timeout_s=60, limits=Limits(lifetime_s=30))
    e = ExecData(sandbox_id="sb-1", code="print(1)", files={"./a/../b": "x"} if False else {"a/b": "x"})
    assert e.exec_request().model_dump() == {**e.model_dump(exclude={"sandbox_id"})}


async def test_cache_runs_once_and_replays() -> None:
    calls = 0

    async def work() -> str:
        nonlocal calls
        calls += 1
        await asyncio.sleep(0.05)
        return f"reply-{calls}"

    cache: IdempotencyCache[str] = IdempotencyCache(10, 60, cacheable=lambda r: True)
    got = await asyncio.gather(*(cache.run(("s", "1"), "fp", work) for _ in range(5)))
    assert calls == 1 and [r for r, _ in got] == ["reply-1"] * 5 and sum(rep for _, rep in got) == 4
    assert await cache.run(("s", "1"), "fp", work) == ("reply-1", True)
    with pytest.raises(Conflict):
        await cache.run(("s", "1"), "other", work)
    assert await cache.run(("other", "1"), "fp", work) == ("reply-2", False)


async def test_cache_forgets_uncacheable_and_expired_and_is_bounded() -> None:
    now = [0.0]
    n = 0

    async def work() -> str:
        nonlocal n
        n += 1
        return "busy" if n == 1 else f"ok-{n}"

    cache: IdempotencyCache[str] = IdempotencyCache(3, 10, cacheable=lambda r: r != "busy", clock=lambda: now[0])
    assert await cache.run(("s", "a"), "fp", work) == ("busy", False)
    assert await cache.run(("s", "a"), "fp", work) == ("ok-2", False)  # a refusal is not remembered
    now[0] = 11
    assert await cache.run(("s", "a"), "fp", work) == ("ok-3", False)  # expired
    for key in "bcde":
        await cache.run(("s", key), "fp", work)
    assert len(cache) == 3  # bounded: the oldest finished entries went first
    assert (await cache.run(("s", "e"), "fp", work))[1] is True


async def test_cache_waiters_take_over_when_the_first_is_cancelled() -> None:
    started = asyncio.Event()
    runs = 0

    async def slow() -> str:
        nonlocal runs
        runs += 1
        started.set()
        await asyncio.sleep(10)
        return "never"

    async def fast() -> str:
        nonlocal runs
        runs += 1
        return "second"

    cache: IdempotencyCache[str] = IdempotencyCache(10, 60, cacheable=lambda r: True)
    first = asyncio.create_task(cache.run(("s", "1"), "fp", slow))
    await started.wait()
    waiter = asyncio.create_task(cache.run(("s", "1"), "fp", fast))
    await asyncio.sleep(0.01)
    first.cancel()
    assert await waiter == ("second", False) and runs == 2


async def test_cache_is_bounded_by_bytes() -> None:
    async def big() -> str:
        return "x" * 400

    cache: IdempotencyCache[str] = IdempotencyCache(100, 60, cacheable=lambda r: True, max_bytes=1000, size_of=len)
    for key in "abcd":
        await cache.run(("s", key), "fp", big)
    assert cache.bytes <= 1000 and len(cache) == 2  # a and b went to make room
    assert (await cache.run(("s", "d"), "fp", big))[1] is True
    assert (await cache.run(("s", "a"), "fp", big))[1] is False


def test_every_runtime_error_has_one_reply_in_the_table() -> None:
    """One table maps the runtime's exceptions to statuses and codes; each leaf class finds its row,
    a subclass never hides behind its parent's row, and anything else is a 500 that leaks nothing."""
    from rollbox.functions.service.app import ERROR_TABLE, _runtime_error
    from rollbox.runtime import errors as rterr

    cases = {
        rterr.InvalidRequest("x"): (400, "invalid_data"),
        rterr.SandboxGone("x", reason="idle", sandbox_id="sb-1"): (410, "sandbox_gone"),
        rterr.SandboxBusy("x", sandbox_id="sb-1"): (409, "sandbox_busy"),
        rterr.SandboxNotFound("x", sandbox_id="sb-1"): (404, "sandbox_not_found"),
        rterr.SnapshotNotFound("x", snapshot_id="s"): (404, "snapshot_not_found"),
        rterr.SandboxDied("x"): (410, "sandbox_died"),
        rterr.Unsupported("process image", snapshot_id="s"): (422, "unsupported"),
        rterr.StoreUnavailable("down"): (503, "store_unavailable"),
        rterr.IntegrityError("bad"): (502, "store_corrupt"),
        rterr.StoreError("no"): (502, "store_error"),
        rterr.Overloaded("full", retry_after_s=3.0): (429, "overloaded"),
        rterr.ShuttingDown("runtime is shutting down"): (503, "shutting_down"),
        rterr.IsolationError("mount failed /secret/path"): (500, "internal"),
        Conflict("same id, other content"): (409, "idempotency_conflict"),  # the service's own, same table
    }
    for exc, want in cases.items():
        err = _runtime_error(exc)
        assert (err.status, err.code) == want, exc
        retryable = want[1] in ("sandbox_busy", "overloaded", "shutting_down", "store_unavailable")
        assert bool(err.retry_after_s) is retryable, exc  # Retry-After says "retry": only on what is retryable
    assert _runtime_error(rterr.SandboxGone("x", reason="idle")).details["reason"] == "idle"
    assert "/secret" not in _runtime_error(rterr.IsolationError("mount failed /secret/path")).message
    assert _runtime_error(rterr.Overloaded("full", retry_after_s=3.0)).retry_after_s == 3.0
    assert _runtime_error(rterr.ShuttingDown("draining", retry_after_s=7.0)).retry_after_s == 7.0  # its own
    assert _runtime_error(rterr.ShuttingDown("closing")).retry_after_s == 1.0  # else the row's
    rows = [cls for cls, _ in ERROR_TABLE]
    for i, cls in enumerate(rows):  # no row is shadowed by an earlier, more general one
        assert not any(issubclass(cls, earlier) for earlier in rows[:i]), cls


def test_no_other_place_maps_an_exception_to_a_status() -> None:
    """Replies to exceptions are built from ERROR_TABLE only: the service's own refusals (admission,
    drain, the grace period, idempotency conflicts) raise the runtime's classes and go through it.
    What is left building a ReplyError by hand is HTTP- and CloudEvent-level input checking."""
    import ast
    import inspect

    from rollbox.functions.service import app as service

    tree = ast.parse(inspect.getsource(service))
    by_hand = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "ReplyError":
            code = node.args[0] if node.args else None
            by_hand.append(ast.unparse(code) if code is not None else "?")
    assert sorted(by_hand) == sorted([
        "m.code",  # _runtime_error(): the table's row
        "ErrorCode.INTERNAL",  # _internal(): anything not in the table
        "ErrorCode.NOT_FOUND", "ErrorCode.METHOD_NOT_ALLOWED",  # HTTP: path, method
        "ErrorCode.REQUEST_TIMEOUT",  # HTTP: a body that stopped arriving
        "ErrorCode.UNKNOWN_TYPE", "ErrorCode.PAYLOAD_TOO_LARGE",  # the event: its type, its size
        "ErrorCode.INVALID_DATA", "ErrorCode.INVALID_DATA",  # its data: not an object, not the model
    ]), by_hand


def test_a_resumed_step_passes_through_when_its_pause_outlasts_a_live_copy(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The rule of ``Residency.passes`` (an unstarted real runtime: the rule reads only the clock,
    ``--hibernate-after-s`` and the last eviction under pressure)."""
    d = DurableRuntime(Runtime(RuntimeConfig(state_dir=tmp_path / "home")), LocalObjects(tmp_path / "store"),
                       hibernate_after_s=30.0).residency

    def paused(s: float) -> SandboxRecord:
        now = time.time()
        return SandboxRecord(sandbox_id="sb-x", generation=3, snapshot="python", limits=Limits(),
                             created_at=now - 600, last_used=now - s)

    assert d.passes(paused(31)) and not d.passes(paused(20))  # idle hibernation at 30 s
    d.evicted = (time.monotonic(), 2.0)  # under pressure, idle copies last ~2 s
    assert d.passes(paused(3)) and not d.passes(paused(1))
    d.evicted = (time.monotonic() - PRESSURE_MEMORY_S - 1, 2.0)  # that pressure is over
    assert not d.passes(paused(3)) and d.passes(paused(31))
    d.hibernate_after_s = 0  # never idle-hibernated, no pressure: every resumed sandbox stays live
    assert not d.passes(paused(3600))


def test_a_started_server_freezes_what_its_start_made_and_collects_young_objects_less_often() -> None:
    """``_settle_gc`` (run by ``rollbox serve`` once listening): the start's objects leave the collector's
    view and young collections run every ``GC_THRESHOLD0`` allocations, while cycles are still collected.
    In a child process: it changes the interpreter's collector for good."""
    code = (
        "import gc\n"
        "from rollbox.functions.service import server\n"
        "assert gc.get_freeze_count() == 0 and gc.get_threshold()[0] == 700\n"
        "server._settle_gc()\n"
        "assert gc.get_freeze_count() > 10000, gc.get_freeze_count()\n"
        "assert gc.get_threshold()[0] == server.GC_THRESHOLD0\n"
        "class C: pass\n"
        "a = C(); a.me = a; del a\n"
        "assert gc.collect() > 0\n"
        "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "ok", out.stderr


async def test_a_replys_head_and_body_go_out_as_one_write() -> None:
    """``HeadHeld`` (the transport uvicorn's cycle writes a reply through): the head is held for the
    body and both are sent as one write; a head with no body after it goes out at the end of the event
    loop's turn, or before a close; later writes pass straight through. The transport under it records
    what it is given: what reaches a socket is the real server's, tested through HTTP elsewhere."""
    from rollbox.functions.service.http_protocol import HeadHeld

    class Recording:
        def __init__(self) -> None:
            self.writes: list[bytes] = []
            self.closed = False

        def write(self, data: bytes) -> None:
            self.writes.append(data)

        def is_closing(self) -> bool:
            return self.closed

        def close(self) -> None:
            self.closed = True

        def get_extra_info(self, name: str) -> str:
            return f"extra {name}"

    loop = asyncio.get_running_loop()
    t = Recording()
    held = HeadHeld(t, loop)  # type: ignore[arg-type]
    held.write(b"HTTP/1.1 200 OK\r\n\r\n")
    held.write(b"body")
    held.write(b"more")
    assert t.writes == [b"HTTP/1.1 200 OK\r\n\r\nbody", b"more"]
    await asyncio.sleep(0)
    assert t.writes == [b"HTTP/1.1 200 OK\r\n\r\nbody", b"more"]  # nothing held was sent twice
    assert held.get_extra_info("peername") == "extra peername"

    t = Recording()
    held = HeadHeld(t, loop)  # type: ignore[arg-type]
    held.write(b"HTTP/1.1 204 No Content\r\n\r\n")
    assert t.writes == []
    await asyncio.sleep(0)
    assert t.writes == [b"HTTP/1.1 204 No Content\r\n\r\n"]

    t = Recording()
    held = HeadHeld(t, loop)  # type: ignore[arg-type]
    held.write(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\n")
    held.close()
    assert (t.writes, t.closed) == ([b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\n"], True)
    await asyncio.sleep(0)
    assert len(t.writes) == 1



async def test_admission_runs_max_running_in_order_and_a_long_one_leaves_its_place() -> None:
    """--max-running: the others wait their turn in order; one that has run turn_s (a program
    that sleeps) no longer holds its place, so it never holds the queue."""
    from rollbox.functions.durable.capacity import LiveCap
    from rollbox.functions.service.admission import Admission

    adm = Admission(cap=LiveCap(100), max_queued=10, retry_after_s=1, running=lambda: 0, max_running=2,
                    turn_s=0.3)
    order: list[str] = []
    release = {name: asyncio.Event() for name in ("a", "b", "c", "d")}

    async def request(name: str) -> None:
        async with adm.admit(creates_sandbox=False):
            order.append(name)
            await release[name].wait()

    tasks = {}
    for name in ("a", "b", "c", "d"):
        tasks[name] = asyncio.create_task(request(name))
        await asyncio.sleep(0.01)
    assert order == ["a", "b"] and adm.waiting == 2 and adm.running == 2
    release["a"].set()  # a ends before its time is up: the first waiting one starts, in order
    await asyncio.sleep(0.05)
    assert order == ["a", "b", "c"] and adm.waiting == 1 and adm.outlasted == 0
    await asyncio.sleep(0.3)  # b outlasted its time: d starts though b and c still run
    assert order == ["a", "b", "c", "d"] and adm.waiting == 0 and adm.running == 3 and adm.outlasted >= 1
    for name in ("b", "c", "d"):
        release[name].set()
    await asyncio.gather(*tasks.values())
    assert adm.started == 0 and adm.inflight == 0 and adm.running == 0  # each place given back once


def test_max_running_defaults_to_eight_per_cpu_the_sandboxes_get() -> None:
    from rollbox.functions.handlers.run_code import sandbox_cpus
    from rollbox.functions.service.admission import RUNNING_PER_CPU, ServiceConfig
    from rollbox.functions.service.app import Service

    class NoRuntime:  # (nothing runs: only the service's admission is looked at)
        def running_count(self) -> int:
            return 0

        def live_count(self) -> int:
            return 0

        def pool_sizes(self) -> dict[str, int]:
            return {}

    rt = NoRuntime()
    assert RUNNING_PER_CPU == 8 and ServiceConfig().max_running == 0
    assert Service(rt, ServiceConfig(), routes=()).admission.max_running == 8 * sandbox_cpus(rt)  # type: ignore[arg-type]
    assert Service(rt, ServiceConfig(max_running=5), routes=()).admission.max_running == 5  # type: ignore[arg-type]
