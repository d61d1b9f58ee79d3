"""The trainer-facing client against a real server: E2B-shaped sandboxes, one-shot runs, typed errors."""

from __future__ import annotations

import asyncio
import socket

import pytest
from rollbox.functions.client import (
    Client,
    ClientError,
    CommandExitError,
    InvalidRequestError,
    NotFoundError,
    Sandbox,
    SandboxGoneError,
    TransportError,
)
from rollbox.runtime.spec import ExecResult, Limits, Usage
from svc_testkit import ServerProc


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


async def test_unreachable_service_is_a_transport_error() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening: connections are refused
        async with Client(f"http://127.0.0.1:{port}", retries=1) as client:
            with pytest.raises(TransportError):
                await client.run(code="print(1)")
        assert client.closed
