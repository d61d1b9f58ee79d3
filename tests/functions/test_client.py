"""The trainer-facing client against a real server: E2B-shaped sandboxes, one-shot runs, typed errors,
and retries of exactly what the contract says to retry, within a bounded time."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
from rollbox.functions.client import (
    ERROR_CLASSES,
    Client,
    ClientError,
    CommandExitError,
    EndpointNotFoundError,
    IdempotencyConflictError,
    InternalError,
    InvalidDataError,
    InvalidRequestError,
    NotFoundError,
    OverloadedError,
    PayloadTooLargeError,
    Sandbox,
    SandboxGoneError,
    SandboxNotFoundError,
    ServiceError,
    ShuttingDownError,
    SnapshotNotFoundError,
    StoreUnavailableError,
    TransportError,
    UnknownTypeError,
)
from rollbox.functions.client import http as client_module
from rollbox.functions.contract.models import ErrorCode
from rollbox.runtime.spec import ExecResult, Limits, Usage
from svc_testkit import ServerProc, metric, metrics_of, start_server

from tests.snapshots.s3server import free_ports


async def test_sandbox_context_manager(server: ServerProc) -> None:
    async with await Sandbox.create(server.url, metadata={"experiment": "client", "episode": "1"}) as sb:
        assert sb.id.startswith("sb-") and sb.info.metadata["episode"] == "1"
        r = await sb.exec(code="x = 6 * 7\nprint(x)")
        assert isinstance(r, ExecResult) and (r.exit_code, r.stdout) == (0, "42\n")
        r = await sb.exec(command="cat note.txt", files={"note.txt": "hello"})
        assert r.stdout == "hello"
        r = await sb.exec(code="print(input()[::-1])", stdin="abc\n", read_files=["note.txt"])
        assert (r.stdout, r.files) == ("cba\n", {"note.txt": "hello"})
    # leaving the block killed it...
    with pytest.raises(ClientError, match="was killed") as killed:
        await sb.exec(code="print(1)")
    assert killed.value.sandbox_id == sb.id
    # ...on the service too, which says the sandbox is gone (destroyed), not unknown
    async with Client(server.url) as client:
        with pytest.raises(SandboxGoneError) as info:
            await Sandbox(client, sb.info, owns_client=False).exec(code="print(1)")
        assert info.value.sandbox_id == sb.id and info.value.status == 410
        assert info.value.code == "sandbox_gone" and info.value.details["reason"] == "destroyed"
        with pytest.raises(NotFoundError) as unknown:  # one that never existed
            await client.send("dev.rollbox.sandbox.exec", {"sandbox_id": "sb-nope", "code": "1"},
                              expect="dev.rollbox.sandbox.result", model=ExecResult, read_timeout_s=10,
                              sandbox_id="sb-nope")
        assert (unknown.value.status, unknown.value.code) == (404, "sandbox_not_found")


async def test_kill_is_idempotent(server: ServerProc) -> None:
    async with Client(server.url) as client:
        sb = await client.create(timeout_s=60)
        assert sb.info.limits.lifetime_s == 60
        await sb.exec(code="print(1)")
        first = await sb.kill()
        assert isinstance(first, Usage) and first.execs == 1 and first.sandbox_id == sb.id
        assert await sb.kill() == first
        again = Sandbox(client, sb.info, owns_client=False)  # a second handle to the same, dead sandbox
        assert await again.kill() == first  # destroy is idempotent on the service too


async def test_one_shot_run_and_command_exit(server: ServerProc) -> None:
    async with Client(server.url) as client:
        r = await client.run(code="print(1)")
        assert (r.exit_code, r.stdout) == (0, "1\n")
        r = await client.run(command="exit 3")
        assert r.exit_code == 3
        with pytest.raises(CommandExitError) as info:
            await client.run(code="import sys; print('bad', file=sys.stderr); sys.exit(3)", check=True)
        err = info.value
        assert (err.exit_code, err.stderr) == (3, "bad\n") and err.sandbox_id == err.result.sandbox_id
        r = await client.run(code="print(len(open('/proc/self/status').read()) > 0)", limits=Limits(pids_max=16))
        assert r.stdout == "True\n"


async def test_invalid_request_names_the_field(server: ServerProc) -> None:
    async with Client(server.url) as client:
        with pytest.raises(InvalidRequestError) as info:
            await client.run(code="print(1)", files={"../escape": "x"})
        assert info.value.status == 400 and "files" in str(info.value)
        with pytest.raises(NotFoundError) as nf:
            await client.create("no-such-snapshot")
        assert nf.value.code == "snapshot_not_found"


async def test_concurrent_episodes_share_one_client(server: ServerProc) -> None:
    async with Client(server.url) as client:

        async def episode(i: int) -> int:
            async with await Sandbox.create(client, metadata={"episode": str(i)}) as sb:
                r = await sb.exec(code=f"print({i} * 2)")
                return int(r.stdout)

        assert await asyncio.gather(*(episode(i) for i in range(8))) == [i * 2 for i in range(8)]
        assert not client.closed  # sandboxes created through a shared client leave it open


def connections_to(port: int) -> int:
    """This process's open TCP connections to 127.0.0.1:port, read from the kernel (/proc/net/tcp:
    connections whose remote end is the port, established, on a socket this process holds)."""
    fds = Path("/proc/self/fd")
    held = set()
    for fd in fds.iterdir():
        with contextlib.suppress(OSError):
            held.add(os.readlink(fd))
    count = 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        remote, state, inode = fields[2], fields[3], fields[9]
        count += (remote == f"0100007F:{port:04X}" and state == "01" and f"socket:[{inode}]" in held)
    return count


async def test_sandboxes_of_one_client_share_its_one_pool(server: ServerProc) -> None:
    """N sandboxes from one Client, and a Sandbox.create(url) of its own, each send through one pool:
    requests one after another reuse one connection (the client spread them over 16 pools, each with
    its own connection: 15 connections for the first 15 requests), concurrent ones open only as many as run
    at once, and closing the client closes them all."""
    assert connections_to(server.port) == 0
    async with Client(server.url) as client:
        sandboxes = [await Sandbox.create(client, metadata={"episode": str(i)}) for i in range(3)]
        for sb in sandboxes:
            for _ in range(3):
                assert (await sb.exec(code="print(1)")).stdout == "1\n"
            await sb.kill()
        assert connections_to(server.port) == 1  # 3 creates, 9 execs, 3 kills: one connection

        async def episode(i: int) -> str:
            async with await Sandbox.create(client, metadata={"episode": f"c{i}"}) as sb:
                return (await sb.exec(code=f"print({i})")).stdout

        assert await asyncio.gather(*(episode(i) for i in range(4))) == [f"{i}\n" for i in range(4)]
        assert 1 <= connections_to(server.port) <= 4  # at most one per request in flight at once
    assert connections_to(server.port) == 0  # the client closed its pool

    sb = await Sandbox.create(server.url)  # a client of its own: one pool, one connection
    for i in range(5):
        assert (await sb.exec(code=f"print({i})")).stdout == f"{i}\n"
    assert connections_to(server.port) == 1
    await sb.kill()
    assert sb.client.closed and connections_to(server.port) == 0


async def test_forks_of_a_sandbox_with_its_own_client_outlive_the_parent(server: ServerProc) -> None:
    """Sandbox.create(url)'s client is shared by the sandboxes forked from it: killing the parent first
    leaves the children their pool (it closed it under them: their exec failed with httpx's "client
    has been closed"), and the pool closes when the last of them is killed."""
    parent = await Sandbox.create(server.url)
    await parent.exec(command="echo kept > f.txt")
    children = await parent.fork(2)
    await parent.kill()
    assert not parent.client.closed
    for child in children:
        assert (await child.exec(command="cat f.txt")).stdout == "kept\n"
    await children[0].kill()
    assert not parent.client.closed
    await children[1].kill()
    await children[1].kill()  # idempotent: counted once
    assert parent.client.closed and connections_to(server.port) == 0


async def test_unreachable_service_is_a_transport_error() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening: connections are refused
        async with Client(f"http://127.0.0.1:{port}", retries=1) as client:
            with pytest.raises(TransportError):
                await client.run(code="print(1)")
        assert client.closed


# -- every error code, typed; retries of what is retryable, bounded in time ------------------------

RETRYABLE_CODES = {"sandbox_busy", "overloaded", "shutting_down", "store_unavailable",  # the contract's
                   "insufficient_storage", "request_timeout"}


def test_every_error_code_of_the_contract_has_its_own_class() -> None:
    codes = {v for k, v in vars(ErrorCode).items() if k.isupper()}
    assert set(ERROR_CLASSES) == codes, codes ^ set(ERROR_CLASSES)
    assert len(set(ERROR_CLASSES.values())) == len(codes)  # its own: no two codes share a class
    for code, cls in ERROR_CLASSES.items():
        assert cls.retryable is (code in RETRYABLE_CODES), code
        assert cls.__name__ in client_module.__all__
    # the classes a caller groups by still catch their codes
    assert issubclass(ERROR_CLASSES["store_unavailable"], OverloadedError)
    assert issubclass(ERROR_CLASSES["sandbox_gone"], NotFoundError)
    assert issubclass(ERROR_CLASSES["unsupported"], InvalidRequestError)
    assert issubclass(ERROR_CLASSES["store_corrupt"], InternalError)
    # a code this client does not know (a newer server's) is typed by its status
    assert client_module._error_class(404, "snapshot_archived") is NotFoundError
    assert client_module._error_class(429, "slow_down") is OverloadedError
    assert client_module._error_class(418, "teapot") is InvalidRequestError
    assert client_module._error_class(507, "full") is client_module.InsufficientStorageError  # retried
    assert client_module._error_class(502, "bad_gateway") is InternalError


async def requests_answered(http: httpx.AsyncClient, srv: ServerProc, etype: str) -> float:
    return metric(await metrics_of(http, srv), "rollbox_requests_total", type=etype)


async def test_typed_errors_from_a_real_server_are_never_retried(server: ServerProc, http: httpx.AsyncClient) -> None:
    run = "dev.rollbox.sandbox.run"
    async with Client(server.url) as client:
        before = await requests_answered(http, server, run)
        with pytest.raises(InvalidDataError) as bad:
            await client.run(code="print(1)", files={"../escape": "x"})
        with pytest.raises(SnapshotNotFoundError) as no_snapshot:
            await client.run(code="print(1)", snapshot="no-such-snapshot")
        assert (bad.value.attempts, no_snapshot.value.attempts) == (1, 1)
        assert await requests_answered(http, server, run) - before == 2  # each sent once
        with pytest.raises(SandboxNotFoundError) as no_sandbox:
            await client.send("dev.rollbox.sandbox.exec", {"sandbox_id": "sb-nope", "code": "1"},
                              expect="dev.rollbox.sandbox.result", model=ExecResult, read_timeout_s=10)
        assert (no_sandbox.value.status, no_sandbox.value.code) == (404, "sandbox_not_found")
        with pytest.raises(UnknownTypeError):
            await client.send("dev.rollbox.sandbox.explode", {}, expect="x", model=ExecResult, read_timeout_s=10)
        await client.run(code="print(1)", event_id="reused-id")
        with pytest.raises(IdempotencyConflictError) as conflict:
            await client.run(code="print(2)", event_id="reused-id")
        assert conflict.value.status == 409 and conflict.value.attempts == 1  # a 409 that is not sandbox_busy
    async with Client(server.url + "no/such/path") as wrong_url:
        with pytest.raises(EndpointNotFoundError) as nf:
            await wrong_url.run(code="print(1)")
        assert (nf.value.status, nf.value.code) == (404, "not_found")


@pytest.fixture(scope="module")
def one_slot(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    """One live sandbox at most, Retry-After 1 s, 64 KiB bodies."""
    srv = start_server(tmp_path_factory.mktemp("one-slot"), "--max-live", "1", "--durability", "off",
                       "--retry-after-s", "1", "--max-body-bytes", "65536")
    yield srv
    assert srv.stop() == 0, srv.log_path.read_text()[-3000:]


@pytest.fixture
async def held(one_slot: ServerProc) -> AsyncIterator[Sandbox]:
    """The server's only slot, taken (released at the end of the test if it still is)."""
    async with Client(one_slot.url) as client:
        sb = await client.create()
        try:
            yield sb
        finally:
            await sb.kill()


async def test_overloaded_is_retried_after_retry_after_until_it_fits(
        one_slot: ServerProc, held: Sandbox, http: httpx.AsyncClient) -> None:
    rejects = metric(await metrics_of(http, one_slot), "rollbox_admission_rejects_total", reason="live")

    async def free_the_slot() -> None:
        await asyncio.sleep(1.5)
        await held.kill()

    async with Client(one_slot.url) as client:
        t0 = time.monotonic()
        freeing = asyncio.create_task(free_the_slot())
        r = await client.run(code="print('fits')")
        took = time.monotonic() - t0
        await freeing
    assert r.stdout == "fits\n"
    refused = metric(await metrics_of(http, one_slot), "rollbox_admission_rejects_total", reason="live") - rejects
    # refused at 0 s and 1 s (each retry waited the 1 s Retry-After), served at 2 s once the slot is free
    assert refused >= 2 and refused * 1.0 <= took < 8.0, (refused, took)


async def test_retries_stop_at_the_budget_with_the_typed_error(
        one_slot: ServerProc, held: Sandbox, http: httpx.AsyncClient) -> None:
    async with Client(one_slot.url, retry_budget_s=2.7) as client:
        t0 = time.monotonic()
        with pytest.raises(OverloadedError) as info:
            await client.run(code="print(1)")
        took = time.monotonic() - t0
    err = info.value
    assert type(err) is OverloadedError and (err.status, err.code, err.retry_after_s) == (429, "overloaded", 1.0)
    # sent at 0, 1 and 2 s; a fourth attempt would start past the 2.7 s budget: not made
    assert err.attempts == 3 and 2.0 <= took < 3.5, (err.attempts, took)
    async with Client(one_slot.url, retries=1) as client:  # a count of retries bounds them too
        with pytest.raises(OverloadedError) as info:
            await client.run(code="print(1)")
    assert info.value.attempts == 2


async def test_payload_too_large_is_typed(one_slot: ServerProc) -> None:
    async with Client(one_slot.url) as client:
        with pytest.raises(PayloadTooLargeError) as info:
            await client.run(code="print(1)", files={"big.txt": "x" * 70_000})
    assert (info.value.status, info.value.attempts) == (413, 1)


async def test_store_unavailable_surfaces_as_such_within_the_budget(tmp_path: Path) -> None:
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))  # bound, never listening: the store refuses connections
        srv = start_server(tmp_path, "--store", "s3://rollbox-nowhere/rb", "--s3-endpoint-url",
                           f"http://127.0.0.1:{closed.getsockname()[1]}",
                           env={"ROLLBOX_HOME": str(tmp_path / "home"), "AWS_ACCESS_KEY_ID": "k",
                                "AWS_SECRET_ACCESS_KEY": "s", "AWS_REGION": "us-east-1"})
        try:
            async with Client(srv.url, retry_budget_s=8.0) as client:
                t0 = time.monotonic()
                with pytest.raises(ServiceError) as info:
                    await client.create("not-held-here")
                took = time.monotonic() - t0
            err = info.value
            assert type(err) is StoreUnavailableError, err  # not a generic OverloadedError
            assert (err.status, err.code, err.retry_after_s) == (503, "store_unavailable", 5.0)
            # retried once after its Retry-After (5 s); the next retry would start past the 8 s budget
            assert err.attempts == 2 and 5.0 <= took < 12.0, (err.attempts, took)
        finally:
            assert srv.stop() == 0, srv.log_path.read_text()[-3000:]


async def test_a_draining_server_is_shutting_down(tmp_path: Path, http: httpx.AsyncClient) -> None:
    srv = start_server(tmp_path, "--retry-after-s", "1")
    try:
        busy = asyncio.create_task(http.post(srv.url, headers={
            "ce-specversion": "1.0", "ce-type": "dev.rollbox.sandbox.run", "ce-source": "/t", "ce-id": "busy",
            "content-type": "application/json"}, content=b'{"code": "import time; time.sleep(4)"}'))
        deadline = time.monotonic() + 30
        while metric(await metrics_of(http, srv), "rollbox_inflight_requests") < 1:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
        os.kill(srv.pid, signal.SIGTERM)
        while (await http.get(srv.url + "readyz")).status_code != 503:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
        async with Client(srv.url, retry_budget_s=1.5) as client:
            with pytest.raises(ShuttingDownError) as info:
                await client.run(code="print(1)")
        assert (info.value.status, info.value.code) == (503, "shutting_down") and info.value.attempts == 2
        assert (await busy).status_code == 200
    finally:
        srv.stop()


async def test_connection_errors_are_retried_until_the_server_is_up(tmp_path: Path) -> None:
    port = free_ports(1)[0]
    async with Client(f"http://127.0.0.1:{port}", retry_budget_s=2.0) as client:
        t0 = time.monotonic()
        with pytest.raises(TransportError) as info:
            await client.run(code="print(1)")
        # retries at ~0.2, 0.6 and 1.4 s, then the next (3 s) would start past the budget: at least 3
        # attempts even if the first ones are slow on a busy machine, and no retry after the budget
        assert info.value.attempts >= 3 and time.monotonic() - t0 < 4.0
    srvs: list[ServerProc] = []

    def start_later() -> None:
        time.sleep(0.5)
        srvs.append(start_server(tmp_path, "--port", str(port)))

    try:
        async with Client(f"http://127.0.0.1:{port}", retry_budget_s=60.0) as client:
            starting = asyncio.create_task(asyncio.to_thread(start_later))
            r = await client.run(code="print('up')")  # refused until the server listens; then served
            await starting
        assert r.stdout == "up\n"
    finally:
        for srv in srvs:
            srv.stop()


# -- limits: only those given replace the snapshot's own ---------------------------------------------

TIGHT_MEMORY = 96 * 2**20


@pytest.fixture(scope="module")
def tight_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    """A server whose store holds ``tight``: a snapshot whose template declares its own memory limit."""
    import subprocess
    import sys

    home = tmp_path_factory.mktemp("tight-home")
    (home / "tight.yaml").write_text(f"name: tight\nlimits: {{memory_max_bytes: {TIGHT_MEMORY}}}\n")
    subprocess.run([sys.executable, "-m", "rollbox.functions.cli", "snapshot", "build", str(home / "tight.yaml"),
                    "--home", str(home)], check=True, capture_output=True, timeout=120)
    srv = start_server(tmp_path_factory.mktemp("tight"), env={"ROLLBOX_HOME": str(home)})
    yield srv
    assert srv.stop() == 0, srv.log_path.read_text()[-3000:]


async def test_limits_given_merge_over_the_snapshots_own(tight_server: ServerProc) -> None:
    hog = "x = bytearray(200 * 2**20); x[::4096] = b'x' * len(x[::4096]); print('kept')"
    async with Client(tight_server.url) as client:
        async with await Sandbox.create(client, "tight", limits=Limits(pids_max=20), timeout_s=60) as sb:
            lim = sb.info.limits
            assert (lim.memory_max_bytes, lim.pids_max, lim.lifetime_s) == (TIGHT_MEMORY, 20, 60), lim
        forks = await client.fork(snapshot="tight", count=2, limits=Limits(pids_max=20))
        for child in forks:
            assert (child.info.limits.memory_max_bytes, child.info.limits.pids_max) == (TIGHT_MEMORY, 20)
            await child.kill()
        r = await client.run(code=hog, snapshot="tight", limits=Limits(pids_max=20))
        assert r.exit_code != 0 and "kept" not in r.stdout, r  # the snapshot's 96 MiB held, not 512 MiB
        r = await client.run(code=hog, snapshot="tight", limits=Limits(memory_max_bytes=320 * 2**20))
        assert (r.exit_code, r.stdout) == (0, "kept\n"), r  # the limit given replaced the snapshot's
