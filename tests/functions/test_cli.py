"""The ``rollbox`` command's own behaviour, run as a real process: missing extras, bad flags, pipes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

# runs the console script with some top-level modules made unimportable (as in an install without that extra)
_WRAPPER = """
import sys
BLOCKED = set(sys.argv[1].split(",")) if sys.argv[1] else set()

class _Blocker:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, _Blocker())
sys.argv = ["rollbox", *sys.argv[2:]]
from rollbox.functions.cli import script
script()
"""


def rollbox(*args: str, blocked: str = "", env: dict[str, str] | None = None,
            timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", _WRAPPER, blocked, *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


@pytest.mark.parametrize("blocked", ["pandas", "matplotlib"])
def test_report_without_the_report_extra_names_the_extra(tmp_path: Path, blocked: str) -> None:
    out = tmp_path / "r.html"
    r = rollbox("report", "--experiment", "e", "--home", str(tmp_path), "--out", str(out), blocked=blocked)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip() == "rollbox report needs the 'report' extra: pip install 'rollbox[report]'"
    assert "Traceback" not in r.stderr
    assert not out.exists()


def test_knative_without_the_knative_extra_names_the_extra(tmp_path: Path) -> None:
    r = rollbox("knative", "status", "--namespace", "ns", blocked="kubernetes")
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip() == "rollbox knative needs the 'knative' extra: pip install 'rollbox[knative]'"


def test_help_of_a_command_needs_no_extra() -> None:
    r = rollbox("report", "--help", blocked="pandas,matplotlib")
    assert r.returncode == 0, r.stderr
    assert "usage: rollbox report" in r.stdout
