"""The durable layer called through the Python API (no HTTP): the event a call serves is a parameter.

A real ``Runtime`` (namespaces, cgroups, overlay mounts) under a real ``DurableRuntime`` over a local
store, in this process.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from rollbox.functions.contract.eventref import EventRef
from rollbox.functions.durable.capacity import LiveCap
from rollbox.functions.durable.runtime import DurableRuntime
from rollbox.functions.handlers.routing import InProcess
from rollbox.functions.service.app import Service
from rollbox.runtime.spec import ExecRequest
from rollbox.snapshots.state import LocalObjects, record_key
from svc_testkit import durable_runtime


@pytest.fixture
async def durable(tmp_path: Path) -> AsyncIterator[DurableRuntime]:
    async with durable_runtime(tmp_path / "home", LocalObjects(tmp_path / "store"), "durable-api") as d:
        yield d


def _records(store: Path) -> list[str]:
    """The sandboxes with records in ``store``."""
    return sorted(p.name for p in (store / "sandboxes").iterdir())


async def test_a_create_with_the_same_event_is_the_same_sandbox(durable: DurableRuntime, tmp_path: Path) -> None:
    """The same event (a new ``EventRef`` with its source, id and fingerprint: a redelivery) gets the
    sandbox it made, not a second one; other events, or none, make new ones."""
    first = await durable.create("python", event=EventRef("trainer-1", "ev-1", "f" * 64))
    again = await durable.create("python", event=EventRef("trainer-1", "ev-1", "f" * 64))
    assert again.sandbox_id == first.sandbox_id == EventRef("trainer-1", "ev-1", "").sandbox_id(0)
    assert durable.rt.live_count() == 0  # committed hibernated: its first step resumes it
    assert (tmp_path / "store" / record_key(first.sandbox_id, 0)).is_file()
    assert not (tmp_path / "store" / record_key(first.sandbox_id, 1)).exists()  # the replay wrote nothing
    assert _records(tmp_path / "store") == [first.sandbox_id], _records(tmp_path / "store")
    other = await durable.create("python", event=EventRef("trainer-1", "ev-2", "f" * 64))
    anon = await durable.create("python")
    assert len({first.sandbox_id, other.sandbox_id, anon.sandbox_id}) == 3
    assert durable.rt.live_count() == 0

    # an exec recorded under its event is answered again, not run twice
    ev = EventRef("trainer-1", "ev-3", "e" * 64)
    code = "import os; print(os.getpid(), open('/tmp/n', 'a').write('x'))"
    one = await durable.exec(first.sandbox_id, ExecRequest(code=code), event=ev)
    two = await durable.exec(first.sandbox_id, ExecRequest(code=code), event=EventRef("trainer-1", "ev-3", "e" * 64))
    assert one.stdout == two.stdout and one.exit_code == two.exit_code == 0, (one, two)
    assert one.resumed and durable.rt.live_count() == 1, one
    count = await durable.exec(first.sandbox_id, ExecRequest(code="print(len(open('/tmp/n').read()))"))
    assert count.stdout == "1\n", count


async def test_the_service_and_the_durable_layer_ask_one_cap(durable: DurableRuntime) -> None:
    """One ``LiveCap``: the service's admission asks the object the durable layer makes room by."""
    service = Service(durable, cap=durable.cap)
    assert service.admission.cap is durable.cap
    plain = Service(InProcess(durable.rt))
    assert plain.admission.cap.max_live == LiveCap().max_live == 256  # the one default


async def test_a_create_asked_for_a_live_copy_restores_its_sandbox_at_once(durable: DurableRuntime) -> None:
    """``live_copy=True``: the sandbox is restored by the create (its reply is the live sandbox's), and
    its first step runs on that copy, not on a resume."""
    info = await durable.create("python", live_copy=True)
    assert (info.hibernated, durable.rt.live_count()) == (None, 1), info
    lazy = await durable.create("python")
    assert (lazy.hibernated, lazy.pooled, durable.rt.live_count()) == (True, False, 1), lazy
    r = await durable.exec(info.sandbox_id, ExecRequest(command="echo live"))
    assert (r.stdout, r.resumed) == ("live\n", None), r
