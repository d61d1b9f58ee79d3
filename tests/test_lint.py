"""ruff and strict mypy stay clean: the lint is part of the test command, so CI runs it."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_and_mypy_are_clean() -> None:
    p = subprocess.run(["bash", str(ROOT / "scripts" / "lint")], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-2000:]
