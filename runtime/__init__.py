"""rollbox.runtime: isolated sandboxes restored from warm snapshots, in-process (one async object).

    async with Runtime() as rt:
        sb = await rt.create("python")
        r = await rt.exec(sb.sandbox_id, ExecRequest(code="print(1)"))
        usage = await rt.destroy(sb.sandbox_id)

The runtime:
    Runtime            create, exec, destroy, run and fork sandboxes (``async with`` starts and closes it)
    RuntimeConfig      its settings (state directory, cgroups, uid range, reserved cores, ...)
    SnapshotResolver   what ``Runtime(resolver=...)`` asks for a snapshot by name or id
                       (``rollbox.snapshots.StoreResolver`` over a store; the default knows ``python``)
    SnapshotView       what a resolver answers: the layers, the warm recipe, env and limits of a snapshot
Requests and records (frozen pydantic models, units in the names):
    Limits             memory, pids, CPU, disk, output and time limits of a sandbox
    DEFAULT_LIMITS     the limits a snapshot declares none of
    ExecRequest        one step: ``code`` or ``command``, stdin, files in and out, env, ``timeout_s``
    ExecResult         its result: ``exit_code``, ``stdout``, ``stderr``, ``timed_out``, ``files``, ...
    SandboxInfo        a created sandbox: id, snapshot, limits, isolation report
    Usage              a destroyed sandbox's bill: wall and CPU seconds, peak memory, execs
Errors (one tree, each carrying ``sandbox_id`` / ``snapshot_id`` where there is one):
    RollboxError       the root
    InvalidRequest     a spec or request that cannot be honoured (the message names the field)
    SandboxNotFound    no live sandbox has that id; SandboxGone: it was destroyed or expired
    SandboxBusy        another replica committed a step of it first: retry
    SandboxDied        the sandbox ended while in use
    SnapshotNotFound   no snapshot by that name or id
    Overloaded         admission refused the work (``retry_after_s``)
    ShuttingDown       the runtime is closing, or not started
    Unsupported        valid, but not servable here (a process-image snapshot)
    IsolationError     a required isolation layer could not be applied (names the syscall)
    StoreError         a snapshot store failed; StoreUnavailable: it cannot be reached now;
                       IntegrityError: its content failed its sha256 (never used)

This package is also loaded inside zygotes with the standard library only, so it exports lazily.
"""

import importlib as _importlib
import typing as _typing

if _typing.TYPE_CHECKING:
    from rollbox.runtime.errors import (
        IntegrityError,
        InvalidRequest,
        IsolationError,
        Overloaded,
        RollboxError,
        SandboxBusy,
        SandboxDied,
        SandboxGone,
        SandboxNotFound,
        ShuttingDown,
        SnapshotNotFound,
        StoreError,
        StoreUnavailable,
        Unsupported,
    )
    from rollbox.runtime.runtime import Runtime, RuntimeConfig
    from rollbox.runtime.snapshot import SnapshotResolver, SnapshotView
    from rollbox.runtime.spec import DEFAULT_LIMITS, ExecRequest, ExecResult, Limits, SandboxInfo, Usage

__all__ = [
    "DEFAULT_LIMITS",
    "ExecRequest",
    "ExecResult",
    "IntegrityError",
    "InvalidRequest",
    "IsolationError",
    "Limits",
    "Overloaded",
    "RollboxError",
    "Runtime",
    "RuntimeConfig",
    "SandboxBusy",
    "SandboxDied",
    "SandboxGone",
    "SandboxInfo",
    "SandboxNotFound",
    "ShuttingDown",
    "SnapshotNotFound",
    "SnapshotResolver",
    "SnapshotView",
    "StoreError",
    "StoreUnavailable",
    "Unsupported",
    "Usage",
]

_ERRORS = ("IntegrityError", "InvalidRequest", "IsolationError", "Overloaded", "RollboxError", "SandboxBusy",
           "SandboxDied", "SandboxGone", "SandboxNotFound", "ShuttingDown", "SnapshotNotFound", "StoreError",
           "StoreUnavailable", "Unsupported")
_WHERE = {
    **dict.fromkeys(_ERRORS, "rollbox.runtime.errors"),
    "Runtime": "rollbox.runtime.runtime",
    "RuntimeConfig": "rollbox.runtime.runtime",
    "SnapshotResolver": "rollbox.runtime.snapshot",
    "SnapshotView": "rollbox.runtime.snapshot",
    "DEFAULT_LIMITS": "rollbox.runtime.spec",
    "ExecRequest": "rollbox.runtime.spec",
    "ExecResult": "rollbox.runtime.spec",
    "Limits": "rollbox.runtime.spec",
    "SandboxInfo": "rollbox.runtime.spec",
    "Usage": "rollbox.runtime.spec",
}


def __getattr__(name: str) -> _typing.Any:
    if name in _WHERE:
        return getattr(_importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'rollbox.runtime' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
