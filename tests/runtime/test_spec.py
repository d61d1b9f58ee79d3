"""The declarative spec refuses what it cannot honour, naming the field."""

from __future__ import annotations

from pathlib import Path

import pytest
from rollbox.runtime.spec import ExecRequest, Limits


def test_request_validation_names_the_field() -> None:
    with pytest.raises(ValueError, match="exactly one of 'code' or 'command'"):
        ExecRequest()
    with pytest.raises(ValueError, match=r"'\.\.' components"):
        ExecRequest(code="1", files={"../../etc/passwd": "x"})
    with pytest.raises(ValueError, match="read_files"):
        ExecRequest(code="1", read_files=["a\x00b"])
    with pytest.raises(ValueError, match="pids_max"):
        Limits(pids_max=0)
    with pytest.raises(ValueError, match="memory_max_bytes"):
        Limits(memory_max_bytes=-1)
    with pytest.raises(ValueError, match="extra"):
        Limits(memory_mb=5)  # type: ignore[call-arg]


def test_the_python_api_changes_only_the_limits_it_was_given(tmp_path: Path) -> None:
    """``Limits(memory_max_bytes=...)`` keeps every other limit of the snapshot's own (a template with
    a 2-core, 1 GiB default); a ``Limits`` with every field given replaces them all."""
    import dataclasses

    from rollbox.runtime.runtime import effective_limits
    from rollbox.runtime.snapshot import host_python_view
    from rollbox.runtime.spec import Limits

    own = Limits(memory_max_bytes=1 << 30, cpu_max_cores=2.0, lifetime_s=600)
    view = dataclasses.replace(host_python_view(str(tmp_path)), limits=own)
    got = effective_limits(view, Limits(memory_max_bytes=256 << 20))
    assert (got.memory_max_bytes, got.cpu_max_cores, got.lifetime_s) == (256 << 20, 2.0, 600)
    assert effective_limits(view, {"lifetime_s": 60}).memory_max_bytes == 1 << 30
    full = Limits.model_validate(Limits().model_dump())
    assert effective_limits(view, full) == full and effective_limits(view, None) == own
