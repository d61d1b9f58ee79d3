"""The runtime's declarative spec: limits, exec requests and the records it returns.

Frozen pydantic models with explicit defaults and units in the names. Secure by default: every
limit is finite, a request must say exactly one of ``code`` / ``command``.
"""

from __future__ import annotations

import posixpath
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

MiB = 1024 * 1024

# Paths in ``files`` / ``read_files`` are relative to the sandbox working directory (/home/sandbox)
# or absolute inside the sandbox; ``..`` components and NUL bytes are refused.
MAX_PATH_CHARS = 4096


def check_sandbox_path(path: str) -> str:
    """Validate a path that names a file inside the sandbox; returns it normalised."""
    if not path or "\x00" in path or len(path) > MAX_PATH_CHARS:
        raise ValueError(f"invalid file path {path!r}: must be non-empty, without NUL, <= 4096 chars")
    if ".." in path.split("/"):
        raise ValueError(f"invalid file path {path!r}: '..' components are not allowed")
    norm = posixpath.normpath(path)
    if norm in (".", "/"):
        raise ValueError(f"invalid file path {path!r}: names a directory, not a file")
    return norm


def check_utf8(text: str) -> str:
    """Text that can be written as UTF-8 (JSON lets a lone surrogate such as \\ud800 through)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"not valid UTF-8 text: a lone surrogate at position {exc.start}") from None
    return text


def check_env(env: dict[str, str]) -> dict[str, str]:
    """Environment variables a process can actually receive: a name without '=' or NUL, a value without NUL."""
    for k, val in env.items():
        if not k or "=" in k or "\x00" in k or "\x00" in val:
            raise ValueError(f"invalid environment variable name or value: {k!r}")
        check_utf8(k)
        check_utf8(val)
    return env


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Limits(_Frozen):
    """Resource limits of one sandbox. Enforced by the kernel (cgroups, rlimits, tmpfs size) and the
    supervisor (timeouts, output caps), never by code inside the sandbox."""

    memory_max_bytes: Annotated[int, Field(ge=16 * MiB, le=64 * 1024 * MiB)] = 512 * MiB
    pids_max: Annotated[int, Field(ge=4, le=32768)] = 128
    cpu_max_cores: Annotated[float, Field(gt=0, le=256)] = 1.0
    disk_max_bytes: Annotated[int, Field(ge=1 * MiB, le=64 * 1024 * MiB)] = 256 * MiB
    nofile_max: Annotated[int, Field(ge=16, le=65536)] = 1024
    file_size_max_bytes: Annotated[int, Field(ge=1024, le=64 * 1024 * MiB)] = 128 * MiB
    output_max_bytes: Annotated[int, Field(ge=1024, le=64 * MiB)] = 1 * MiB
    lifetime_s: Annotated[float, Field(gt=0, le=7 * 24 * 3600)] = 900.0
    idle_s: Annotated[float, Field(gt=0, le=24 * 3600)] = 300.0


DEFAULT_LIMITS = Limits()


class ExecRequest(_Frozen):
    """One step in a sandbox: Python ``code`` (run as ``__main__`` in the warm interpreter) or a
    shell ``command``; optional stdin; files written before and read after; a wall-clock timeout."""

    code: str | None = None
    command: str | None = None
    stdin: str | None = None
    files: dict[str, str] = Field(default_factory=dict, description="path -> UTF-8 text, written before")
    read_files: list[str] = Field(default_factory=list, description="paths read back after the run")
    env: dict[str, str] = Field(default_factory=dict)
    timeout_s: Annotated[float, Field(gt=0, le=24 * 3600)] = 30.0
    # Files as bytes (path -> (base64, mode)), written after ``files``: not part of the API (no event
    # carries them); the language runner's compile-cache artifacts (``with_binary``).
    _binary: dict[str, tuple[str, int]] = PrivateAttr(default_factory=dict)

    def with_binary(self, files: dict[str, tuple[str, int]]) -> ExecRequest:
        """This request, also writing ``files`` (path under the home -> (base64 of the bytes, mode))
        after its text files: a binary written as it is, with no process in the sandbox to decode it."""
        req = self.model_copy()
        req._binary = dict(files)
        return req

    @property
    def binary_files(self) -> dict[str, tuple[str, int]]:
        return self._binary

    @model_validator(mode="after")
    def _one_of(self) -> ExecRequest:
        if (self.code is None) == (self.command is None):
            raise ValueError("exactly one of 'code' or 'command' must be given")
        return self

    @field_validator("code", "command", "stdin")
    @classmethod
    def _utf8(cls, v: str | None) -> str | None:
        return None if v is None else check_utf8(v)

    @field_validator("files")
    @classmethod
    def _files(cls, v: dict[str, str]) -> dict[str, str]:
        return {check_utf8(check_sandbox_path(k)): check_utf8(c) for k, c in v.items()}

    @field_validator("read_files")
    @classmethod
    def _read_files(cls, v: list[str]) -> list[str]:
        return [check_utf8(check_sandbox_path(p)) for p in v]

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, str]) -> dict[str, str]:
        return check_env(v)


class CompileResult(BaseModel):
    """A run with a ``language``: its compile step (``cached``: not run, the outcome of an earlier compile
    of the same source with the same toolchain and flags; timed out: of the one this run waited for)."""

    model_config = ConfigDict(extra="forbid")

    exit_code: int | None = None
    stdout: str = ""
    stderr: str = ""
    timed_out: bool = False
    wall_s: float = 0.0
    cached: bool = False


class CaseResult(BaseModel):
    """A run with ``cases``: one case's run (``passed``: its stdout matched ``expected_stdout`` and it
    exited 0; None when no expected output was given)."""

    model_config = ConfigDict(extra="forbid")

    exit_code: int
    stdout: str = ""
    stderr: str = ""
    timed_out: bool = False
    oom_killed: bool = False
    signal: str | None = None
    wall_s: float = 0.0
    passed: bool | None = None


class ExecResult(BaseModel):
    """What one exec did. ``exit_code`` follows the shell: killed by signal N = 128 + N
    (a timeout kill is 137). ``snapshot_id`` is the snapshot the sandbox was restored from, so
    a trajectory step can be replayed."""

    model_config = ConfigDict(extra="forbid")

    sandbox_id: str
    snapshot_id: str = ""
    forked_from: str | None = Field(default=None, description="the live sandbox this one was forked from")
    exit_code: int
    stdout: str = ""
    stderr: str = ""
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    timed_out: bool = False
    oom_killed: bool = False
    pids_limit_hit: bool = False
    signal: str | None = None
    wall_s: float = 0.0
    cpu_s: float = 0.0
    peak_memory_bytes: int = 0
    files: dict[str, str | None] = Field(default_factory=dict, description="read_files: text, or None if absent")
    sandbox_alive: bool = True
    pooled: bool | None = Field(default=None, description="one-shot runs: the sandbox came ready from the warm pool")
    create_ms: float | None = Field(default=None, description="one-shot runs: how long getting the sandbox took")
    resumed: bool | None = Field(default=None, description="durable sandboxes: this step first resumed the "
                                 "sandbox from its durable state (its files; processes of earlier steps are gone)")
    resume_ms: float | None = Field(default=None, description="durable sandboxes: how long resuming took")
    compile: CompileResult | None = Field(default=None, description="runs with a language that compiles: its "
                                          "compile step; when it failed the program did not run and the fields "
                                          "above are the compile's")
    cases: list[CaseResult] | None = Field(default=None, description="runs with cases: each case's run, in order; "
                                           "the fields above are the first failed case's, else the last's")
    hibernated: bool | None = Field(default=None, description="durable sandboxes: the sandbox hibernated as this "
                                    "step ended (it had been idle longer than a live copy lasts on the replica, "
                                    "so this step ran as its init); processes the step left behind ended with it")


class SandboxInfo(BaseModel):
    """A live sandbox as returned by create."""

    model_config = ConfigDict(extra="forbid")

    sandbox_id: str
    snapshot_id: str
    env_version: dict[str, Any]
    limits: Limits
    metadata: dict[str, str] = Field(default_factory=dict)
    forked_from: str | None = Field(default=None, description="the live sandbox this one was forked from")
    pooled: bool
    create_ms: float
    isolation: dict[str, str] | None = Field(
        default=None,
        description="layer (mode, namespaces, user, filesystem, cgroups, cpu, rlimits, seccomp, limits) -> what is in "
                    "force for this sandbox, as probed and read back, or what fell back and why (~2.5 KB). In a "
                    "create or fork reply only when the event asks for it (`include_isolation: true`); "
                    "`rollbox doctor` prints it for this host")
    isolation_summary: str = Field(
        default="",
        description="the isolation report in one line: mode, namespaces, user, cgroups, seccomp, and the layers "
                    "that fell back or could not be read back, if any")
    hibernated: bool | None = Field(default=None, description="durable sandboxes: created hibernated, no live copy "
                                    "made (a create runs nothing in it); its first step resumes it. Then `pooled` is "
                                    "false and `create_ms` is the time to resolve its snapshot and check its limits")

    @model_validator(mode="after")
    def _summarize(self) -> SandboxInfo:
        if self.isolation and not self.isolation_summary:
            from rollbox.runtime.report import summary

            self.isolation_summary = summary(self.isolation)
        return self

    def brief(self) -> SandboxInfo:
        """This record without its full isolation report (its one-line summary stays)."""
        return self if self.isolation is None else self.model_copy(update={"isolation": None})


class Usage(BaseModel):
    """The metered life of one sandbox: what it is billed for."""

    model_config = ConfigDict(extra="forbid")

    sandbox_id: str
    snapshot_id: str
    metadata: dict[str, str] = Field(default_factory=dict)
    wall_s: float
    cpu_s: float
    peak_memory_bytes: int
    billed_s: int
    execs: int
    reason: str = Field(description="destroyed | lifetime | idle | died | shutdown")
