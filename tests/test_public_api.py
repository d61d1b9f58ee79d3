"""The public faces are small and pinned: a change to one is a deliberate change to this test.

Modelled on httpx's tests/test_exported_members.py: for each public package (rollbox.runtime,
rollbox.snapshots, the client rollbox.functions.client, and rollbox.functions, which exports nothing),
``__all__`` equals a pinned list; every name in it imports (``from package import name``, in a fresh
interpreter, so a lazy export that points at a moved name fails) and is documented (named in the
package's docstring, or its defining module's); and nothing public-looking in the package's namespace
is left out of ``__all__`` (subpackages and modules of the package aside: they are where the names
live, not names).
"""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
import types

import pytest

PINNED: dict[str, list[str]] = {
    "rollbox.runtime": [
        "DEFAULT_LIMITS", "ExecRequest", "ExecResult", "IntegrityError", "InvalidRequest", "IsolationError",
        "Limits", "Overloaded", "RollboxError", "Runtime", "RuntimeConfig", "SandboxBusy", "SandboxDied",
        "SandboxGone", "SandboxInfo", "SandboxNotFound", "ShuttingDown", "SnapshotNotFound", "SnapshotResolver",
        "SnapshotView", "StoreError", "StoreUnavailable", "Unsupported", "Usage",
    ],
    "rollbox.snapshots": [
        "LayerCache", "LocalStore", "Manifest", "S3Store", "Store", "StoreResolver", "Template", "build",
        "checkpoint", "copy_snapshot", "load_template",
    ],
    "rollbox.functions.client": [
        "ERROR_CLASSES", "Client", "ClientError", "CommandExitError", "EndpointNotFoundError", "ExecResult",
        "HeadersTooLargeError", "IdempotencyConflictError", "InsufficientStorageError", "InternalError",
        "InvalidDataError", "InvalidEventError", "InvalidRequestError", "Limits", "MethodNotAllowedError",
        "NotFoundError", "OverloadedError", "PayloadTooLargeError", "RequestTimeoutError", "Sandbox",
        "SandboxBusyError", "SandboxDiedError", "SandboxGoneError", "SandboxInfo", "SandboxNotFoundError",
        "ServiceError", "ShuttingDownError", "SnapshotNotFoundError", "SnapshotRecord", "StoreCorruptError",
        "StoreError", "StoreUnavailableError", "TransportError", "UnknownTypeError", "UnsupportedError",
        "UnsupportedMediaTypeError", "Usage",
    ],
    "rollbox.functions": [],
}
FACES = sorted(PINNED)


@pytest.mark.parametrize("package", FACES)
def test_all_is_the_pinned_list(package: str) -> None:
    module = importlib.import_module(package)
    assert sorted(module.__all__) == sorted(PINNED[package]), (
        f"{package}.__all__ changed: + {sorted(set(module.__all__) - set(PINNED[package]))}, "
        f"- {sorted(set(PINNED[package]) - set(module.__all__))}; pin the new list here if that was meant"
    )
    assert len(set(module.__all__)) == len(module.__all__), "a name listed twice"


@pytest.mark.parametrize("package", FACES)
def test_every_name_imports_in_a_fresh_interpreter(package: str) -> None:
    names = PINNED[package]
    if not names:
        return
    code = f"from {package} import {', '.join(names)}\nprint(len([{', '.join(names)}]))"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert (p.returncode, p.stdout) == (0, f"{len(names)}\n"), p.stderr[-3000:]


@pytest.mark.parametrize("package", FACES)
def test_every_name_is_documented(package: str) -> None:
    module = importlib.import_module(package)
    undocumented = []
    for name in module.__all__:
        obj = getattr(module, name)
        where = sys.modules.get(getattr(obj, "__module__", "") or "")
        docs = (module.__doc__ or "") + ((where.__doc__ or "") if where is not None else "")
        if not re.search(rf"(?<![\w.]){re.escape(name)}\b", docs):
            undocumented.append(name)
    assert not undocumented, f"{package}: not named in its docstring nor its module's: {undocumented}"
    assert module.__doc__ and len(module.__doc__.strip().splitlines()) >= 3, f"{package} says what it is"


@pytest.mark.parametrize("package", FACES)
def test_nothing_public_looking_is_left_out(package: str) -> None:
    module = importlib.import_module(package)
    for name in module.__all__:  # lazy exports: loaded, as a user's code would
        getattr(module, name)
    public = {
        name for name, value in vars(module).items()
        if not name.startswith("_")
        and not (isinstance(value, types.ModuleType) and value.__name__ == f"{package}.{name}")
    }
    assert public <= set(module.__all__), f"{package}: public-looking but not in __all__: {public - set(module.__all__)}"
    assert set(module.__all__) <= set(dir(module))


def test_the_client_reexports_every_name_of_its_module() -> None:
    """What http.py exports, the client package exports (a new error class is not left behind)."""
    import rollbox.functions.client as client
    from rollbox.functions.client import http

    assert set(http.__all__) <= set(client.__all__)
    for name in http.__all__:
        assert getattr(client, name) is getattr(http, name)


def test_a_snapshots_export_named_like_its_module_stays_the_function() -> None:
    """``build`` and ``checkpoint`` share their module's name: importing the module must not turn the
    package's export into the module (it would, exported lazily)."""
    code = ("import rollbox.snapshots.build, rollbox.snapshots.checkpoint\n"
            "import rollbox.snapshots as s\nfrom rollbox.snapshots import build, checkpoint\n"
            "print(callable(build), callable(checkpoint), s.build is build, type(s.checkpoint).__name__)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert (p.returncode, p.stdout) == (0, "True True True function\n"), p.stderr[-3000:]


def test_importing_a_snapshots_module_loads_no_s3_client() -> None:
    """The package exports lazily: the durable layer's import of rollbox.snapshots.state, or the server's
    of rollbox.snapshots.calls, does not pay for boto3 (the Knative replica's cold start)."""
    code = "import sys, rollbox.snapshots.state, rollbox.snapshots.calls\nprint('boto3' in sys.modules)"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert (p.returncode, p.stdout) == (0, "False\n"), p.stderr[-3000:]


def test_runtime_package_imports_without_third_party_modules() -> None:
    # Zygotes load rollbox.runtime with the standard library only (python -I -S).
    from rollbox.runtime.restore import _BOOT, RUNTIME_DIR

    # the helpers it boots (zygote, userns), imported instead of run
    head = _BOOT.split("from importlib import import_module")[0]
    assert head != _BOOT
    probe = head + "import rollbox.runtime.inside.zygote, rollbox.runtime.inside.userns\nprint('pydantic' in sys.modules)"
    p = subprocess.run([sys.executable, "-I", "-S", "-c", probe, "0", RUNTIME_DIR], capture_output=True, text=True)
    assert p.returncode == 0 and p.stdout.strip() == "False", p.stderr
