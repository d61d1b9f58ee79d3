from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import httpx
import pytest
from svc_testkit import ServerProc, start_server


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    """One `rollbox serve` for the session, with default caps; stopped by pid, must exit 0."""
    srv = start_server(tmp_path_factory.mktemp("serve"))
    yield srv
    rc = srv.stop()
    assert rc == 0, f"rollbox serve exited with {rc}:\n{srv.log_path.read_text()[-4000:]}"


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=httpx.Timeout(10.0, read=120.0)) as client:
        yield client
