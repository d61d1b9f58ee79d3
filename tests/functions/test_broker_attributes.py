"""Through a Knative Broker: the client puts the sandbox id in the CloudEvents `partitionkey` (one
Kafka partition, so ordered delivery, per sandbox), and a reply carries its request's `partitionkey`
and a RequestReply's `correlationid` as `replyid` (knative/overlays/kafka). Real server, real SDK."""

from __future__ import annotations

import httpx
from cloudevents.http import CloudEvent
from rollbox.functions.client import Client
from svc_testkit import ServerProc, encode, event, parse

RUN, CREATE, EXEC = "dev.rollbox.sandbox.run", "dev.rollbox.sandbox.create", "dev.rollbox.sandbox.exec"


def _with(ev: CloudEvent, **ext: str) -> CloudEvent:
    return CloudEvent({**ev.get_attributes(), **ext}, ev.get_data())


async def test_a_reply_carries_its_requests_partition_key_and_correlation_id(
        server: ServerProc, http: httpx.AsyncClient) -> None:
    first = _with(event(RUN, {"code": "print(1)"}), partitionkey="sb-abc", correlationid="c-1:r-9")
    for mode in ("binary", "structured"):
        headers, body = encode(first, mode)
        r = parse(await http.post(server.url, headers=headers, content=body))
        assert r.status == 200 and r.data["stdout"] == "1\n", r.data
        assert (r.event.get("partitionkey"), r.event.get("replyid")) == ("sb-abc", "c-1:r-9"), r.event
    # the same event again (a redelivery) through another RequestReply request: its own correlation id
    again = _with(first, correlationid="c-2:r-9")
    headers, body = encode(again, "binary")
    r = parse(await http.post(server.url, headers=headers, content=body))
    assert r.status == 200 and r.event.get("replyid") == "c-2:r-9"
    # an error reply carries them too; an event without them gets none
    headers, body = encode(_with(event(EXEC, {"sandbox_id": "sb-nope", "code": "1"}), correlationid="c-3"), "binary")
    r = parse(await http.post(server.url, headers=headers, content=body))
    assert r.status == 404 and r.event.get("replyid") == "c-3"
    headers, body = encode(event(RUN, {"code": "print(2)"}), "binary")
    r = parse(await http.post(server.url, headers=headers, content=body))
    assert r.status == 200 and r.event.get("replyid") is None and r.event.get("partitionkey") is None


async def test_the_client_keys_every_event_of_a_sandbox_by_its_id(server: ServerProc) -> None:
    seen: list[tuple[str, str | None]] = []

    async def capture(request: httpx.Request) -> None:
        seen.append((request.headers["ce-type"], request.headers.get("ce-partitionkey")))

    async with httpx.AsyncClient(timeout=60, event_hooks={"request": [capture]}) as http, \
            Client(server.url, http=http) as client:  # the real requests, as sent
        sb = await client.create()
        await sb.exec(code="print(1)")
        await sb.kill()
    sid = sb.sandbox_id
    assert seen == [(CREATE, None), (EXEC, sid), ("dev.rollbox.sandbox.destroy", sid)], seen
