"""Create and fork replies carry the isolation report in one line unless the event asks for all of it
(issue 26: ~2.5 KB of isolation text per sandbox in every reply), against the session's real `rollbox
serve`; `rollbox doctor` keeps printing it in full (tests/functions/test_cli.py runs it)."""

from __future__ import annotations

import json

import httpx
import pytest
from rollbox.functions.client import Client, InvalidDataError, Sandbox
from rollbox.runtime import report
from rollbox.runtime.spec import SandboxInfo
from svc_testkit import ServerProc, event, send

CREATE, FORK, DESTROY = "dev.rollbox.sandbox.create", "dev.rollbox.sandbox.fork", "dev.rollbox.sandbox.destroy"


async def test_a_create_reply_carries_the_summary_and_the_report_only_when_asked(
        server: ServerProc, http: httpx.AsyncClient) -> None:
    brief = await send(http, server.url, event(CREATE, {}))
    assert brief.status == 200, brief.data
    assert brief.data["isolation"] is None
    summary = brief.data["isolation_summary"]
    assert summary.startswith(("root; namespaces ", "rootless; namespaces ")) and "seccomp" in summary, summary
    full = await send(http, server.url, event(CREATE, {"include_isolation": True}))
    assert full.status == 200, full.data
    assert set(full.data["isolation"]) == set(report.LAYERS)
    assert full.data["isolation_summary"] == report.summary(full.data["isolation"])
    small, large = len(json.dumps(brief.data)), len(json.dumps(full.data))
    assert large - small > 1500 and small < 1000, (small, large, brief.data)  # the whole reply's data

    forked = await send(http, server.url, event(FORK, {"sandbox_id": brief.data["sandbox_id"], "count": 3}))
    assert forked.status == 200, forked.data
    assert [c["isolation"] for c in forked.data["sandboxes"]] == [None] * 3
    assert all(c["isolation_summary"] for c in forked.data["sandboxes"])
    told = await send(http, server.url, event(FORK, {"snapshot": "python", "count": 2, "include_isolation": True}))
    assert told.status == 200, told.data
    assert all(set(c["isolation"]) == set(report.LAYERS) for c in told.data["sandboxes"])
    sids = [brief.data["sandbox_id"], full.data["sandbox_id"]]
    sids += [c["sandbox_id"] for r in (forked, told) for c in r.data["sandboxes"]]
    for sid in sids:
        assert (await send(http, server.url, event(DESTROY, {"sandbox_id": sid}))).status == 200

    bad = await send(http, server.url, event(CREATE, {"include_isolation": "yes"}))
    assert bad.status == 400 and "include_isolation" in bad.data["message"], bad.data


async def test_the_client_asks_for_the_report(server: ServerProc) -> None:
    async with Client(server.url) as client:
        async with await Sandbox.create(client) as sb:
            assert sb.info.isolation is None and sb.info.isolation_summary
            kids = await sb.fork(2, include_isolation=True)
            assert all(k.info.isolation and set(k.info.isolation) == set(report.LAYERS) for k in kids)
            for k in kids:
                await k.kill()
        async with await Sandbox.create(client, include_isolation=True) as sb:
            assert sb.info.isolation is not None and sb.info.isolation["seccomp"].startswith("filter loaded")
        with pytest.raises(InvalidDataError):
            await client.send(CREATE, {"include_isolation": 1}, expect="dev.rollbox.sandbox.created",
                              model=SandboxInfo, read_timeout_s=30)


def test_the_summary_names_what_fell_back() -> None:
    """Rendered from the runtime's own layer texts: a report whose probes did not come back, and one
    without cgroups, say so in the summary."""
    unread = report.render(rootless=True, uid=1000, host_ns={}, backend=None, backend_reason="no delegated cgroup",
                           bpf=b"\0" * 80, facts=None)
    line = report.summary(unread)
    assert line.startswith("rootless; namespaces ?; ") and "no cgroup (rlimits)" in line, line
    assert "seccomp NOT in force" in line and "see the full report for: namespaces, user, filesystem" in line, line
