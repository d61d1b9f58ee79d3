"""Programs in the languages of ``snapshots/languages.py``: compile (once), then run, in a sandbox.

One runner model for both interfaces: SandboxFusion's ``POST /run_code`` (its request and response
models are here, ``RunCodeRequest`` / ``RunCodeResponse``, served by ``functions/service/run_code.py``)
and the ``run`` event's ``language``. Per program:

    plan (languages.plan: snapshot, files, compile and run commands)
    -> compile step, unless the compile cache has this source's outcome (compile_cache.py)
    -> run step (stdin, run_timeout), unless the compile failed
    -> fetch_files read back (base64, so binary files survive)

A program with no compile step (or a cached one) and no files to fetch is one one-shot sandbox
(``Runtime.run``, from the warm pool); otherwise one sandbox takes the steps in turn and is destroyed.
Memory is the sandbox's cgroup limit (no address-space rlimit: JVMs, V8 and linkers reserve freely; without
a cgroup, RLIMIT_DATA: what a program fills, not what it reserves), and a JVM's heap is sized to it (plan());
timeouts, output caps and killing every process of a step are the runtime's (the kernel's).
Binary input files travel as base64 text and are decoded inside the sandbox (``base64`` is in every
Debian snapshot); a cached compile's artifacts are written by the sandbox's agent (``ExecRequest.with_binary``),
with no process in the sandbox to unpack them.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import functools
import io
import logging
import math
import re
import shlex
import signal
import tarfile
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, StrictStr, ValidationError
from rollbox.functions.durable.runtime import DurableRuntime
from rollbox.functions.handlers.compile_cache import MAX_ARTIFACT_BYTES, CompileCache, Compiled, TimedOut, cache_key
from rollbox.functions.handlers.routing import InProcess
from rollbox.runtime.errors import InvalidRequest, Overloaded, RollboxError, SnapshotNotFound
from rollbox.runtime.isolation.cgroupfs import host_cores
from rollbox.runtime.spec import CaseResult, CompileResult, ExecRequest, ExecResult
from rollbox.snapshots import languages
from rollbox.snapshots.language_builds import LanguageBuilds

if TYPE_CHECKING:
    from rollbox.functions.contract.models import RunData

__all__ = ["CommandRunResult", "CommandRunStatus", "Program", "ProgramResult", "RunCodeRequest", "RunCodeResponse",
           "RunStatus", "Runner", "run_event", "runner_for", "sandboxfusion_response"]

log = logging.getLogger("rollbox.run_code")
MiB = 1 << 20
ARTIFACTS = "/tmp/.rollbox-artifacts.b64"  # outside the home: the program does not see it in its directory
STAGE = "/tmp/.rollbox-in"  # binary input files, base64, decoded by the first step
FETCHED = "/tmp/.rollbox-out"
# A batch's cases each run in a fork of the prepared sandbox (its files, copy-on-write; fresh processes,
# /tmp and home): what one case writes anywhere or leaves running, the next neither sees nor is slowed by.
# Forked this many at a time (each a live sandbox until its case is done).
CASE_FORKS = 4
MAX_TIMEOUT_S = 3600.0
MAX_LIFETIME_S = 7 * 24 * 3600.0  # the runtime's largest lifetime_s (runtime/spec.py Limits)
MIN_TIMEOUT_S = 0.001  # SandboxFusion takes 0 and negative timeouts (asyncio answers them as timed out at once)


@dataclass(frozen=True)
class Program:
    """What to run. ``files``: path (under the sandbox home if relative) -> bytes, written before the
    code; ``fetch_files``: read back after the run."""

    language: str
    code: str
    stdin: str | None = None
    files: dict[str, bytes] = field(default_factory=dict)
    fetch_files: tuple[str, ...] = ()
    compile_timeout_s: float = 10.0
    run_timeout_s: float = 10.0
    limits: dict[str, Any] | None = None  # the fields to change from the snapshot's default limits
    metadata: dict[str, str] = field(default_factory=dict)
    cases: tuple[str | None, ...] | None = None  # a batch: one run per stdin, after one compile, in one sandbox
    build_wait_s: float | None = None  # the language's snapshot being built on first use: how long to wait for it
    env: dict[str, str] = field(default_factory=dict)  # the run's (each case's) environment
    plan: languages.Plan | None = None  # what to run, given (a plain `run` with cases); else the language's plan


@dataclass
class ProgramResult:
    """``compile``: None when the language has no compile step; ``compile_cached``: it was not run, its
    outcome came from the cache. ``run``: None when the compile failed. ``files``: fetched path -> bytes
    (missing ones left out)."""

    plan: languages.Plan
    compile: ExecResult | Compiled | None
    compile_cached: bool
    run: ExecResult | None
    files: dict[str, bytes] = field(default_factory=dict)
    cases: list[ExecResult] | None = None

    @property
    def compile_ok(self) -> bool:
        c = self.compile
        if c is None:
            return True
        if isinstance(c, Compiled):
            return c.return_code == 0
        return not c.timed_out and c.exit_code == 0

    def last(self) -> ExecResult | None:
        """The step a `run` reply reports: the run, else the compile that stopped it (if it ran here)."""
        if self.run is not None:
            return self.run
        return self.compile if isinstance(self.compile, ExecResult) else None


class SandboxFault(RollboxError):
    """A step the runner added (not the program) failed: the sandbox's fault, SandboxFusion's SandboxError."""


def _result_json(r: ExecResult) -> Any:
    """A timed-out compile step as JSON, for the replicas waiting for that compile (compile_cache)."""
    return r.model_dump(mode="json")


def _clamp(t: float) -> float:
    return min(max(t, MIN_TIMEOUT_S), MAX_TIMEOUT_S)


def _lifetime_for(p: Program, default_s: float) -> dict[str, Any] | None:
    """``p.limits``, with a lifetime long enough for the compile and every run when its timeouts ask for
    more than the snapshot's default (SandboxFusion has no cap below its timeouts: a run_timeout of 1200 s
    runs for up to 1200 s there, so here too, up to the runtime's largest lifetime)."""
    runs = len(p.cases) if p.cases else 1
    needed = _clamp(p.compile_timeout_s) + _clamp(p.run_timeout_s) * runs + 60.0  # + set-up and fetch
    if needed <= default_s or (p.limits or {}).get("lifetime_s", 0) >= needed:
        return p.limits
    return {**(p.limits or {}), "lifetime_s": min(needed, MAX_LIFETIME_S)}


def _exec(**kw: Any) -> ExecRequest:
    try:
        return ExecRequest(**kw)
    except ValidationError as exc:
        e = exc.errors(include_url=False)[0]
        loc = ".".join(str(x) for x in e["loc"])
        raise InvalidRequest(f"{loc}: {e['msg']}" if loc else e["msg"]) from None


class Runner:
    """Runs ``Program``s on a ``rollbox.runtime.runtime.Runtime`` (the plain one: a program's sandbox
    is one life, recorded as a `run`), with an optional compile cache."""

    def __init__(self, rt: Any, cache: CompileCache | None = None, one_shot: Any = None,
                 compile_slots: int | None = None):
        self.rt = rt
        # compiles at once: two per CPU the sandboxes get; the others wait their turn (not counted in their
        # compile_timeout). 16 JVM compiles sharing 2 CPUs all ran past a 60 s compile_timeout (correct
        # programs judged compile timeouts); at 2 or 4 at once they finish (4: g++ keeps its throughput).
        self.compile_slots = compile_slots or 2 * sandbox_cpus(rt)
        self._compiling = asyncio.Semaphore(self.compile_slots)
        self.cache = cache
        self.one_shot = one_shot or rt  # one-shot runs: the durable layer's run makes room (idle sandboxes hibernate)
        self.builds: LanguageBuilds | None = None  # set by the server: the language snapshots' builds and state
        self.build_on_first_use = False  # a missing language snapshot is built (else: 503 with the build command)

    async def run(self, p: Program) -> ProgramResult:
        plan = p.plan or languages.plan(p.language, p.code)  # UnsupportedLanguage (an InvalidRequest) names it
        for what, value in (("code", p.code), ("stdin", p.stdin or ""), *(("files", k) for k in p.files)):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as exc:  # (JSON lets a lone surrogate such as \ud800 through)
                raise InvalidRequest(f"{what}: not valid UTF-8 text: a lone surrogate at {exc.start}") from None
        try:
            view = await self.rt.resolve(plan.snapshot)
        except SnapshotNotFound as exc:
            if p.plan is not None:  # not a language's snapshot: the run's own, named by the request
                raise
            if self.builds is None or not self.build_on_first_use:
                raise SnapshotNotFound(languages.missing_snapshot(p.language), snapshot_id=plan.snapshot) from exc
            await self.builds.ensure(p.language, p.build_wait_s)  # StillBuilding (retry) past the wait
            view = await self.rt.resolve(plan.snapshot)
        limits = _lifetime_for(p, view.limits.lifetime_s)
        unsized = plan  # its compile command is the cache's key: another memory limit is the same compile
        if p.plan is None:  # again, with the sandbox's memory limit (the request's, else the snapshot's): a JVM's heap
            memory = (limits or {}).get("memory_max_bytes") or view.limits.memory_max_bytes
            plan = languages.plan(p.language, p.code, memory_max_bytes=int(memory))
        text, binary = _split(p.files)
        files = {**text, **plan.files}  # the code's file last: as in SandboxFusion, it wins over a request file
        binary = {k: v for k, v in binary.items() if k not in plan.files}
        stage, unpack = _staging(binary)
        files.update(stage)
        if plan.compile_error is not None:  # no compiler could take it (scala without an object)
            failed = Compiled(1, "", plan.compile_error, 0.0)
            return ProgramResult(plan, failed, False, None)
        if plan.compile is None:
            return await self._steps(p, plan, limits, files, unpack, None)
        if self.cache is None:
            return await self._compile_and_run(p, plan, limits, files, unpack, None)
        all_bytes = {k: v.encode() for k, v in {**text, **plan.files}.items()} | binary
        key = cache_key(plan.language, view.id, unsized.compile or plan.compile, all_bytes)
        box: list[ProgramResult] = []

        async def compile_(done: Callable[[Compiled | TimedOut | None], Awaitable[None]]) -> None:
            async def compiled(c: ExecResult) -> ExecResult:
                """Right after the compile step (before the run): what the cache keeps (or, a timeout, what
                the requests waiting for this compile answer), and the compile step without the artifacts
                (they are not the program's output)."""
                keep: Compiled | TimedOut | None = None
                step = c.model_copy(update={"files": {}})
                art = (c.files.get(ARTIFACTS) or "").strip()
                if c.timed_out:
                    keep = TimedOut(step, _clamp(p.compile_timeout_s))
                elif not (c.oom_killed or c.signal is not None or (c.exit_code == 0 and not art)):
                    keep = Compiled(c.exit_code, c.stdout, c.stderr, c.wall_s, art if c.exit_code == 0 else "")
                    if keep.artifact_bytes() >= MAX_ARTIFACT_BYTES:  # (read cut there: the tar may be bigger)
                        log.info("compile cache: a %s compile not kept: its artifacts are not under %d bytes",
                                 plan.language, MAX_ARTIFACT_BYTES)
                        keep = None
                await done(keep)  # (not kept: a timeout or a kill depends on the load, not on the source)
                return step

            box.append(await self._compile_and_run(p, plan, limits, files, unpack, key, compiled))

        found, cached = await self.cache.once(key, compile_, _clamp(p.compile_timeout_s))
        if not cached:
            return box[0] if box else ProgramResult(plan, None, False, None)  # (compile_ raised otherwise)
        if isinstance(found, TimedOut):  # the compile this request waited for timed out: its verdict too
            return ProgramResult(plan, found.result.model_copy(update={"sandbox_id": ""}), True, None)
        assert found is not None
        if found.return_code != 0:
            return ProgramResult(plan, found, True, None)
        members = _members(found.artifacts_b64)
        if members is None:  # not plain files (never from a languages.py compile): unpacked by tar in the sandbox
            files = {**files, ARTIFACTS: found.artifacts_b64}
            unpack = [*unpack, f"base64 -d {ARTIFACTS} | tar -xf -"]
            members = {}
        return await self._steps(p, plan, limits, files, unpack, found, members)

    async def _compile_and_run(self, p: Program, plan: languages.Plan, limits: dict[str, int] | None,
                               files: dict[str, str], unpack: list[str], key: str | None,
                               compiled: Callable[[ExecResult], Awaitable[ExecResult]] | None = None
                               ) -> ProgramResult:
        assert plan.compile is not None
        command = plan.compile
        if key is not None and plan.artifacts:  # keep what the run needs, for the next compile of this source
            # (read up to the bound: a tar that reaches it is not kept, compile_cache.MAX_ARTIFACT_BYTES)
            command = (f"{command} && tar -cf - {' '.join(plan.artifacts)} | head -c {MAX_ARTIFACT_BYTES}"
                       f" | base64 -w0 > {ARTIFACTS}")
        compile_req = _exec(command=_prefixed(unpack, command), files=files, timeout_s=_clamp(p.compile_timeout_s),
                            read_files=[ARTIFACTS] if key is not None else [])
        run, fetched, step, cases = await self._session(p, plan, limits, compile_req, on_compiled=compiled)
        return ProgramResult(plan, step, False, run, fetched, cases)

    async def _steps(self, p: Program, plan: languages.Plan, limits: dict[str, int] | None,
                     files: dict[str, str], unpack: list[str], compiled: Compiled | None,
                     binary: dict[str, tuple[str, int]] | None = None) -> ProgramResult:
        """The run alone (no compile here): a one-shot sandbox, unless files are to be fetched or cases run.
        ``binary``: a cached compile's artifacts (path -> (base64, mode)), written by the sandbox's agent."""
        if p.cases is not None:  # the files (and artifacts) written once, forked for each case
            prep = _exec(command=_prefixed(unpack, "true"), files=files, timeout_s=60.0)
            if binary:
                prep = prep.with_binary(binary)
            run, fetched, _, cases = await self._session(p, plan, limits, None, prep=prep)
            return ProgramResult(plan, compiled, compiled is not None, run, fetched, cases)
        req = self._run_request(p, plan, files, unpack)
        if binary:
            req = req.with_binary(binary)
        if p.fetch_files:
            run, fetched, _, _ = await self._session(p, plan, limits, None, req)
            return ProgramResult(plan, compiled, compiled is not None, run, fetched)
        result: ExecResult = await self.one_shot.run(req, snapshot=plan.snapshot, limits=limits, metadata=p.metadata)
        return ProgramResult(plan, compiled, compiled is not None, result)

    def _run_request(self, p: Program, plan: languages.Plan, files: dict[str, str], unpack: list[str]) -> ExecRequest:
        timeout = _clamp(p.run_timeout_s)
        if plan.python_inline and not unpack:  # the warm interpreter runs the code itself: no python start
            files = dict(files)
            code = files.pop(next(iter(plan.files)))
            return _exec(code=code, files=files, stdin=p.stdin, timeout_s=timeout, env=p.env)
        return _exec(command=_prefixed(unpack, _exec_form(plan.run)), files=files, stdin=p.stdin, timeout_s=timeout,
                     env=p.env)

    async def _session(self, p: Program, plan: languages.Plan, limits: dict[str, int] | None,
                       compile_req: ExecRequest | None, run_req: ExecRequest | None = None,
                       prep: ExecRequest | None = None,
                       on_compiled: Callable[[ExecResult], Awaitable[ExecResult]] | None = None
                       ) -> tuple[ExecResult | None, dict[str, bytes], ExecResult | None, list[ExecResult] | None]:
        """Steps in one sandbox: compile (if given), the run (if the compile succeeded) or each case, the fetch.
        A compile waits for a compile slot first (before its sandbox is taken: its lifetime does not run
        meanwhile), at most its compile_timeout; past it the request is refused as overloaded (504 with
        Retry-After on /run_code, which verl retries), never judged."""
        slot = False
        if compile_req is not None:
            wait = compile_req.timeout_s
            try:
                async with asyncio.timeout(wait):
                    await self._compiling.acquire()
            except TimeoutError:
                raise Overloaded(f"every compile slot ({self.compile_slots}) stayed busy for {wait:g} s "
                                 "(the compile_timeout): retry", retry_after_s=min(wait, 10.0)) from None
            slot = True
        try:
            sb = await self.rt.take(plan.snapshot, limits, p.metadata, step_next=True)
        except BaseException:
            if slot:
                self._compiling.release()
            raise
        sb.metered = "run"  # its life is billed and recorded as a run's (Runtime.on_life_ended)
        compiled: ExecResult | None = None
        run: ExecResult | None = None
        fetched: dict[str, bytes] = {}
        try:
            if compile_req is not None:
                try:
                    compiled = await self.rt.exec(sb.id, compile_req)
                finally:
                    self._compiling.release()
                    slot = False
                if on_compiled is not None:
                    compiled = await on_compiled(compiled)
                if compiled.timed_out or compiled.exit_code != 0:
                    return None, {}, compiled, None
                run_req = self._run_request(p, plan, {}, [])  # (its files are there already)
            cases: list[ExecResult] | None = None
            if p.cases is not None:
                cases = await self._cases(sb.id, p, plan, prep)
                run = next((c for c in cases if c.timed_out or c.exit_code != 0), cases[-1] if cases else None)
            else:
                assert run_req is not None
                run = await self.rt.exec(sb.id, run_req)
            if p.fetch_files:
                fetched = await self._fetch(sb.id, p.fetch_files)
            return run, fetched, compiled, cases
        finally:
            if slot:  # (cancelled before the compile began)
                self._compiling.release()
            await self.rt.destroy(sb.id)

    async def _cases(self, sandbox_id: str, p: Program, plan: languages.Plan,
                     prep: ExecRequest | None) -> list[ExecResult]:
        """Each case in a fork of the prepared sandbox (``Runtime.fork``: its files, copy-on-write; its own
        processes, /tmp and home), destroyed after the case: no case sees what another wrote or left
        running. The forks' lives are billed as the run's."""
        if prep is not None:
            done = await self.rt.exec(sandbox_id, prep)
            if done.timed_out or done.exit_code != 0:
                raise SandboxFault(f"preparing the cases failed (exit {done.exit_code}): {done.stderr[-500:]}",
                                   sandbox_id=sandbox_id)
        stdins = list(p.cases or ())
        out: list[ExecResult] = []
        for at in range(0, len(stdins), CASE_FORKS):
            batch = stdins[at:at + CASE_FORKS]
            kids = [k.sandbox_id for k in await self.rt.fork(sandbox_id, len(batch))]
            for kid in kids:
                self.rt.get(kid).metered = "run"
            try:
                for stdin in batch:
                    out.append(await self.rt.exec(kids[0], _exec(command=_exec_form(plan.run), stdin=stdin,
                                                                 env=p.env, timeout_s=_clamp(p.run_timeout_s))))
                    await self.rt.destroy(kids.pop(0))
            finally:
                for kid in kids:
                    with contextlib.suppress(RollboxError):
                        await self.rt.destroy(kid)
        return out

    async def _fetch(self, sandbox_id: str, paths: tuple[str, ...]) -> dict[str, bytes]:
        """Regular files among ``paths``, read as base64 (binary-safe); missing ones are left out."""
        lines = [f"mkdir -p {FETCHED}"]
        for i, path in enumerate(paths):
            q = shlex.quote(path)
            lines.append(f"if [ -f {q} ]; then base64 -w0 {q} > {FETCHED}/{i}; fi")
        res = await self.rt.exec(sandbox_id, _exec(command="; ".join(lines) + "; true", timeout_s=30.0,
                                                   read_files=[f"{FETCHED}/{i}" for i in range(len(paths))]))
        out: dict[str, bytes] = {}
        for i, path in enumerate(paths):
            b64 = res.files.get(f"{FETCHED}/{i}")
            if b64 is not None:
                out[path] = base64.b64decode(b64)
        return out


_RUNNERS: weakref.WeakKeyDictionary[Any, Runner] = weakref.WeakKeyDictionary()


def runner_for(rt: Any, *, compile_slots: int | None = None) -> Runner:
    """The runner of a service's runtime (one per runtime, so /run_code and the `run` event share one compile
    cache): the plain runtime under a durable layer (a program's sandbox is one life, not durable state),
    its compile cache in the durable layer's objects (the store every replica shares) when there are some.
    ``compile_slots`` (the service's ``--compile-slots``) is taken by the call that makes the runner."""
    runner = _RUNNERS.get(rt)
    if runner is None:
        objects = rt.store.objects if isinstance(rt, DurableRuntime) else None
        plain = rt.rt if isinstance(rt, DurableRuntime | InProcess) else rt
        cache = CompileCache(objects, verdicts=(_result_json, ExecResult.model_validate))
        runner = _RUNNERS[rt] = Runner(plain, cache, rt, compile_slots=compile_slots)
    return runner


async def run_event(rt: Any, data: RunData) -> ExecResult:
    """The `run` event with a ``language``, or with ``cases``: the same runner as /run_code; the reply is the
    run step's ExecResult with its ``compile`` step (or the compile's, when it failed and nothing ran).
    Cases without a language run what a plain `run` runs (``code``: Python, in the snapshot's warm
    interpreter; or ``command``) in ``snapshot``, once per case."""
    runner = runner_for(rt)
    plan = None
    if data.language is None:
        assert data.cases is not None
        view = await runner.rt.resolve(data.snapshot)
        if data.code is not None:
            run, plan_files = f"{shlex.quote(view.warm.python)} main.py", {"main.py": data.code}
        else:
            assert data.command is not None
            run, plan_files = data.command, {}
        plan = languages.Plan(language="python" if data.code is not None else "", snapshot=data.snapshot,
                              files=plan_files, compile=None, run=run, artifacts=())
    assert data.code is not None or plan is not None
    program = Program(language=data.language or "", code=data.code or "", stdin=data.stdin, plan=plan,
                      env=dict(data.env),
                      files={k: v.encode() for k, v in data.files.items()}, fetch_files=tuple(data.read_files),
                      compile_timeout_s=data.compile_timeout_s or 10.0, run_timeout_s=data.timeout_s,
                      limits=data.limits.model_dump(exclude_unset=True) if data.limits is not None else None,
                      metadata=dict(data.metadata),
                      cases=tuple(c.stdin for c in data.cases) if data.cases is not None else None)
    res = await runner.run(program)
    c = res.compile
    step: CompileResult | None = None
    if isinstance(c, Compiled):
        step = CompileResult(exit_code=c.return_code, stdout=c.stdout, stderr=c.stderr, wall_s=c.wall_s,
                             cached=res.compile_cached)
    elif c is not None:
        step = CompileResult(exit_code=None if c.timed_out else c.exit_code, stdout=c.stdout, stderr=c.stderr,
                             timed_out=c.timed_out, wall_s=c.wall_s, cached=res.compile_cached)
    base = res.last()
    if base is None:  # a cached failed compile: no sandbox was needed
        assert isinstance(c, Compiled)
        base = ExecResult(sandbox_id="", exit_code=c.return_code, stdout=c.stdout, stderr=c.stderr)
    files: dict[str, str | None] = {p: None for p in data.read_files}
    files.update({p: b.decode("utf-8", "replace") for p, b in res.files.items()})
    cases = None
    if data.cases is not None:
        cases = [_case_result(r, c.expected_stdout) for r, c in zip(res.cases or [], data.cases, strict=False)]
    return base.model_copy(update={"compile": step, "files": files, "cases": cases})


def _case_result(r: ExecResult, expected: str | None) -> CaseResult:
    passed = None
    if expected is not None:  # verl's rule: only trailing newlines are ignored, on both sides
        passed = not r.timed_out and r.exit_code == 0 and r.stdout.rstrip("\n") == expected.rstrip("\n")
    return CaseResult(exit_code=r.exit_code, stdout=r.stdout, stderr=r.stderr, timed_out=r.timed_out,
                      oom_killed=r.oom_killed, signal=r.signal, wall_s=r.wall_s, passed=passed)


def sandbox_cpus(rt: Any) -> int:
    """The CPUs sandboxes run on, rounded up: the cap on all of them (the host's or the container's CPUs
    less the supervisor's reserve) where the runtime has a cgroup backend, else this process's CPUs."""
    cpu = getattr(getattr(getattr(rt, "rt", rt), "cgroup_backend", None), "cpu", None)
    cores = getattr(cpu, "cap_cores", None) or getattr(cpu, "available_cores", None)
    return max(1, math.ceil(cores)) if cores else host_cores()


@functools.lru_cache(maxsize=256)
def _members(artifacts_b64: str) -> dict[str, tuple[str, int]] | None:
    """A cached compile's artifacts (a tar, base64) as the files to write: path under the home -> (base64 of
    the bytes, mode); None when the tar holds anything but plain files at plain relative paths (then the
    sandbox unpacks it with tar). Kept for the 256 latest artifacts (a program's cases share one)."""
    try:
        with tarfile.open(fileobj=io.BytesIO(base64.b64decode(artifacts_b64, validate=True)), mode="r:") as tar:
            out: dict[str, tuple[str, int]] = {}
            for m in tar:
                name = m.name
                if not m.isreg() or name.startswith("/") or ".." in name.split("/") or "\0" in name:
                    return None
                data = tar.extractfile(m)
                if data is None:
                    return None
                out[name] = (base64.b64encode(data.read()).decode(), m.mode & 0o777)
            return out
    except (tarfile.TarError, binascii.Error, ValueError, OSError):
        return None


def _split(files: dict[str, bytes]) -> tuple[dict[str, str], dict[str, bytes]]:
    """UTF-8 files travel as text; others as base64, decoded in the sandbox."""
    text: dict[str, str] = {}
    binary: dict[str, bytes] = {}
    for path, data in files.items():
        try:
            text[path] = data.decode("utf-8")
        except UnicodeDecodeError:
            binary[path] = data
    return text, binary


def _staging(binary: dict[str, bytes]) -> tuple[dict[str, str], list[str]]:
    files: dict[str, str] = {}
    cmds: list[str] = []
    for i, (path, data) in enumerate(binary.items()):
        stage, q = f"{STAGE}/{i}", shlex.quote(path)
        files[stage] = base64.b64encode(data).decode()
        cmds.append(f"mkdir -p \"$(dirname {q})\" && base64 -d {stage} > {q}")
    if cmds:
        cmds.append(f"rm -rf {STAGE}")
    return files, cmds


def _exec_form(command: str) -> str:
    """A simple command as ``exec``: the program replaces the shell, so a death by signal is reported as
    the signal (SandboxFusion's -N), not as the shell's exit status 128 + N."""
    if any(op in command for op in (";", "&", "|", "\n")):
        return command
    words = command.split(" ")
    n = 0
    while n < len(words) and re.fullmatch(r"[A-Za-z_]\w*=\S*", words[n]):  # assignments: through env
        n += 1
    return " ".join(["exec", *(["env", *words[:n]] if n else []), *words[n:]])


def _prefixed(unpack: list[str], command: str) -> str:
    if not unpack:
        return command
    return " && ".join(f"{{ {c}; }}" for c in unpack) + f" && {{ {command}\n}}"


# --------------------------------------------------------------------------- SandboxFusion's models


class RunStatus(StrEnum):
    Success = "Success"
    Failed = "Failed"
    SandboxError = "SandboxError"


class CommandRunStatus(StrEnum):
    Finished = "Finished"
    Error = "Error"
    TimeLimitExceeded = "TimeLimitExceeded"


class RunCodeRequest(BaseModel):
    """SandboxFusion's ``RunCodeRequest`` (sandbox/server/sandbox_api.py): the same names, defaults and
    types; unknown fields are ignored, as there. ``language`` is checked against the runner table
    (``snapshots/languages.py``) so the refusal names it."""

    compile_timeout: float = 10
    run_timeout: float = 10
    memory_limit_MB: int = -1
    code: StrictStr
    stdin: StrictStr | None = None
    language: StrictStr
    files: dict[str, StrictStr | None] = Field(default_factory=dict)
    fetch_files: list[StrictStr] = Field(default_factory=list)

    def program(self, metadata: dict[str, str] | None = None) -> Program:
        files: dict[str, bytes] = {}
        for path, content in self.files.items():
            if content is None or "IGNORE_THIS_FILE" in path:  # SandboxFusion skips these
                continue
            try:
                files[path] = base64.b64decode(content, validate=True)
            except (binascii.Error, ValueError):
                raise InvalidRequest(f"files[{path!r}]: not valid base64") from None
        limits = {"memory_max_bytes": self.memory_limit_MB * MiB} if self.memory_limit_MB > 0 else None
        # a snapshot built on first use: wait 3/4 of the time the request may take anyway (verl gives up
        # at compile + run + 10 s, and retries a 504), then 504 "building <lang>, step k/n" (StillBuilding)
        wait = min(max(0.75 * (_clamp(self.compile_timeout) + _clamp(self.run_timeout)), 1.0), 600.0)
        return Program(language=self.language, code=self.code, stdin=self.stdin, files=files,
                       fetch_files=tuple(self.fetch_files), compile_timeout_s=self.compile_timeout,
                       run_timeout_s=self.run_timeout, limits=limits, metadata=dict(metadata or {}),
                       build_wait_s=wait)


class CommandRunResult(BaseModel):
    status: CommandRunStatus
    execution_time: float | None = None
    return_code: int | None = None
    stdout: str | None = None
    stderr: str | None = None
    cached: bool | None = None  # rollbox: the compile was not run, its cached outcome is reported


class RunCodeResponse(BaseModel):
    model_config = ConfigDict(use_enum_values=True)

    status: RunStatus
    message: str
    compile_result: CommandRunResult | None = None
    run_result: CommandRunResult | None = None
    executor_pod_name: str | None = None
    files: dict[str, str] = Field(default_factory=dict)


def _command_result(r: ExecResult | Compiled, cached: bool = False) -> CommandRunResult:
    if isinstance(r, Compiled):
        return CommandRunResult(status=CommandRunStatus.Finished, execution_time=0.0 if cached else r.wall_s,
                                return_code=r.return_code, stdout=r.stdout, stderr=r.stderr,
                                cached=True if cached else None)
    if r.timed_out:  # (cached: another request's compile of this source, which this one waited for)
        return CommandRunResult(status=CommandRunStatus.TimeLimitExceeded, execution_time=r.wall_s,
                                return_code=None, stdout=r.stdout, stderr=r.stderr, cached=True if cached else None)
    code = r.exit_code
    if r.signal is not None:  # SandboxFusion (asyncio) reports a death by signal N as -N
        try:
            code = -signal.Signals[r.signal].value
        except KeyError:
            pass
    return CommandRunResult(status=CommandRunStatus.Finished, execution_time=r.wall_s, return_code=code,
                            stdout=r.stdout, stderr=r.stderr)


def sandboxfusion_response(res: ProgramResult, pod: str | None = None) -> RunCodeResponse:
    """SandboxFusion's status rules (parse_run_status): a step that timed out or exited non-zero is
    Failed; otherwise Success. (SandboxError is for a sandbox fault, answered by the caller.)"""
    compile_result = _command_result(res.compile, res.compile_cached) if res.compile is not None else None
    run_result = _command_result(res.run) if res.run is not None else None
    steps = [r for r in (compile_result, run_result) if r is not None]
    failed = any(r.status == CommandRunStatus.TimeLimitExceeded or (r.return_code not in (None, 0)) for r in steps)
    files = {path: base64.b64encode(data).decode() for path, data in res.files.items()}
    return RunCodeResponse(status=RunStatus.Failed if failed else RunStatus.Success, message="",
                           compile_result=compile_result, run_result=run_result, executor_pod_name=pod, files=files)

