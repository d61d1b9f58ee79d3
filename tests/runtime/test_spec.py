"""The declarative spec refuses what it cannot honour, naming the field."""

from __future__ import annotations

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
