"""The public surface is small and pinned: a change to it is a deliberate change to this test."""

from __future__ import annotations

import rollbox.runtime


def test_runtime_exports() -> None:
    assert sorted(rollbox.runtime.__all__) == [
        "DEFAULT_LIMITS", "ExecRequest", "ExecResult", "Limits", "Runtime", "RuntimeConfig", "SandboxInfo", "Usage",
    ]
    for name in rollbox.runtime.__all__:
        assert getattr(rollbox.runtime, name) is not None


def test_runtime_package_imports_without_third_party_modules() -> None:
    # Zygotes load rollbox.runtime with the standard library only (python -I -S).
    import subprocess
    import sys

    from rollbox.runtime.restore import _BOOT, RUNTIME_DIR

    # the helpers it boots (zygote, userns), imported instead of run
    head = _BOOT.split("from importlib import import_module")[0]
    assert head != _BOOT
    probe = head + "import rollbox.runtime.inside.zygote, rollbox.runtime.inside.userns\nprint('pydantic' in sys.modules)"
    p = subprocess.run([sys.executable, "-I", "-S", "-c", probe, "0", RUNTIME_DIR], capture_output=True, text=True)
    assert p.returncode == 0 and p.stdout.strip() == "False", p.stderr
