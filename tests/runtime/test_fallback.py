"""Without a usable cgroup (rootless, nothing delegated) memory and pids fall back to rlimits, and the
runtime says so. Rootless only: there RLIMIT_NPROC counts the sandbox's own user namespace."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from rollbox.runtime.runtime import Runtime, RuntimeConfig
from rollbox.runtime.spec import ExecRequest, Limits

pytestmark = [
    pytest.mark.asyncio(loop_scope="function"),
    pytest.mark.skipif(os.geteuid() == 0, reason="the fallback is the rootless path: run by test_rootless"),
]
MiB = 1024 * 1024


async def test_rlimits_contain_without_cgroups(tmp_path: Path) -> None:
    async with Runtime(RuntimeConfig(state_dir=tmp_path, cgroup="none")) as rt:
        assert "fall back to rlimits" in rt.isolation_report()["cgroups"]
        lim = Limits(pids_max=16, memory_max_bytes=128 * MiB)
        bomb = await rt.run(ExecRequest(code="import os\nn = 0\nwhile True:\n    try:\n        os.fork()\n"
                                        "    except OSError:\n        print('refused', flush=True)\n        break",
                                        timeout_s=3), limits=lim)
        assert "refused" in bomb.stdout
        hog = await rt.run(ExecRequest(code="a = []\nwhile True:\n    a.append(' ' * 10**7)"), limits=lim)
        assert hog.exit_code == 1 and "MemoryError" in hog.stderr
        ok = await rt.run(ExecRequest(code="print('still fine')"))
        assert ok.stdout == "still fine\n"
