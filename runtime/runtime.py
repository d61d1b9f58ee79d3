"""The Runtime: create, exec, destroy and run sandboxes restored from snapshots (one async core).

    rt = Runtime(RuntimeConfig())
    await rt.start()
    info = await rt.create("python")
    result = await rt.exec(info.sandbox_id, ExecRequest(code="print(1)"))
    usage = await rt.destroy(info.sandbox_id)
    await rt.close()
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import resource
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from rollbox.runtime import report, slots
from rollbox.runtime.errors import (
    InvalidRequest,
    Overloaded,
    SandboxDied,
    SandboxNotFound,
    ShuttingDown,
)
from rollbox.runtime.execution import Metered, Sandbox, SandboxState
from rollbox.runtime.forks import Forks
from rollbox.runtime.inside import probe, proto
from rollbox.runtime.inside.proto import Op
from rollbox.runtime.isolation import cgroups, seccomp, users
from rollbox.runtime.isolation.cgroup_pool import CgroupPool
from rollbox.runtime.isolation.cgroups import Backend
from rollbox.runtime.netns import NetNamespaces
from rollbox.runtime.reaper import Reaper
from rollbox.runtime.residency import Residency
from rollbox.runtime.restorer import Restorer
from rollbox.runtime.snapshot import BuiltinResolver, SnapshotResolver, SnapshotView
from rollbox.runtime.spec import ExecRequest, ExecResult, Limits, SandboxInfo, Usage
from rollbox.runtime.views import Views

log = logging.getLogger("rollbox.runtime")

MiB = 1024 * 1024


def default_home() -> Path:
    """Where rollbox keeps its state and the local snapshot store: ``$ROLLBOX_HOME``, else
    /var/lib/rollbox as root, else ~/.local/share/rollbox (the same default as the local store)."""
    if env := os.environ.get("ROLLBOX_HOME"):
        return Path(env)
    if os.geteuid() == 0:
        return Path("/var/lib/rollbox")
    return Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share") / "rollbox"


LimitsArg = Limits | Mapping[str, Any] | None


def _timers(limits: Limits) -> dict[str, float]:
    """A sandbox's lifetime and idle limits: enforced by the supervisor's reaper, nothing inside sees them."""
    return {"lifetime_s": limits.lifetime_s, "idle_s": limits.idle_s}


def effective_limits(view: SnapshotView, limits: LimitsArg) -> Limits:
    """The limits a sandbox gets: the snapshot's defaults, or those with the given fields changed (a
    ``Limits`` counts only the fields it was given: ``Limits(memory_max_bytes=...)`` keeps the rest
    of the snapshot's own)."""
    if limits is None:
        return view.limits
    if isinstance(limits, Limits):
        if limits.model_fields_set >= set(Limits.model_fields):
            return limits
        limits = limits.model_dump(exclude_unset=True)
    try:
        return Limits.model_validate({**view.limits.model_dump(), **limits})
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(x) for x in first["loc"])
        raise InvalidRequest(f"limits.{where}: {first['msg']}", snapshot_id=view.id) from None


class RuntimeConfig(BaseModel):
    """Supervisor settings. The defaults are the embedded single-box setup."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    state_dir: Path = Field(default_factory=default_home)
    layer_root: Path | None = Field(default=None, description="directory of snapshot layers (default state_dir/layers)")
    cgroup: Literal["auto", "v1", "v2", "none"] = "auto"
    cgroup_parent: str = Field(default_factory=cgroups.default_parent)
    cpu_reserved_cores: Annotated[float, Field(ge=0, le=256)] = Field(
        default=0.25, description="CPU kept from the sandboxes for the supervisor: the cgroup parent of every "
        "sandbox is capped at the host's cores less this")
    rootless: bool = Field(default_factory=lambda: os.geteuid() != 0)
    max_live: Annotated[int, Field(ge=1)] = 4096
    cgroup_pool_max: Annotated[int, Field(ge=0)] = Field(
        default=64, description="emptied sandbox cgroups kept for reuse (each saves a mkdir and an rmdir)")
    pool_min: Annotated[int, Field(ge=0)] = 0
    pool_max: Annotated[int, Field(ge=0)] = 16
    pool_window_s: Annotated[float, Field(gt=0)] = 10.0
    pool_idle_s: Annotated[float, Field(gt=0)] = 30.0
    reaper_interval_s: Annotated[float, Field(gt=0)] = 0.5
    fork_inject_max_bytes: Annotated[int, Field(ge=0)] = Field(
        default=8 * 1024 * 1024, description="fork diffs up to this size are applied inside pooled sandboxes")
    uid_range: str = Field(
        default=slots.DEFAULT_RANGE, description="as root: host uids (START:COUNT) owning one user namespace per "
        "live sandbox (and running its processes where layers take idmapped mounts), so per-user kernel "
        "budgets are per sandbox; 'none': every sandbox in the host's")

    rootless_budget_share: Annotated[int, Field(ge=1)] = Field(
        default=8, description="rootless: each sandbox may take at most 1/N of the caller's per-user kernel "
        "budgets that its own user namespace can cap (inotify, fanotify; message queues and pending signals "
        "through rlimits); 1: no caps")

    @field_validator("uid_range")
    @classmethod
    def _uid_range(cls, v: str) -> str:
        slots.parse_range(v)
        return v


class Runtime:
    def __init__(self, config: RuntimeConfig | None = None, resolver: SnapshotResolver | None = None):
        self.config = config or RuntimeConfig()
        self.layer_root = self.config.layer_root or self.config.state_dir / "layers"
        self.resolver: SnapshotResolver = resolver or BuiltinResolver(str(self.layer_root))
        self.sandboxes: dict[str, Sandbox] = {}
        self.views = Views(self.resolver)
        self.forks = Forks(self)
        self.usages: dict[str, Usage] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self.cgroups = CgroupPool(keep=self.config.cgroup_pool_max, background=self._background)
        self.residency = Residency(self)  # warm pools, and the layers in use
        self.pools = self.residency.pools
        self.restorer = Restorer(state_dir=self.config.state_dir, rootless=self.config.rootless, cgroups=self.cgroups,
                                 background=self._background, before_restore=self.residency.before_restore)
        self.zygotes = self.restorer.zygotes  # the warm source of each snapshot recipe in use
        self.cgroup_reason = ""
        self.seccomp_bpf = b""
        self.host_namespaces: dict[str, int] = {}  # probed at start: what "unshared" is measured against
        self.user_budgets: dict[str, int] = {}
        self.reports = report.RuntimeReports(self)
        self.reaper = Reaper(self)  # lifetimes, and what runtimes that died left behind
        self.sweeper = self.reaper.sweeper
        self._creating = 0
        self.closing = False
        self.started = False
        # Called after the reaper destroyed a sandbox for its lifetime or idle limit (the durable
        # layer records that the sandbox is gone): (sandbox id, reason, usage).
        self.on_reaped: Callable[[str, str, Usage], Awaitable[None]] | None = None
        # Called when a sandbox life that is billed here ends (the usage ledger): (usage, its limits,
        # "sandbox" | "run"). Durable sandboxes are billed by the durable layer, once, at their end.
        self.on_life_ended: Callable[[Usage, Limits, str], None] | None = None

    @property
    def creating(self) -> int:
        """Sandboxes being made now (not yet in ``sandboxes``): what a capacity check adds to them."""
        return self._creating

    # ----------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        cfg = self.config
        # Each live or reusable cgroup keeps its cgroup.procs files open and every sandbox holds a few
        # fds here: the usual soft limit of 1,024 would cap the service well below its max_live.
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        want = 1 << 20 if hard == resource.RLIM_INFINITY else hard
        if soft != resource.RLIM_INFINITY and soft < want:
            with contextlib.suppress(ValueError, OSError):
                resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        cfg.state_dir.mkdir(parents=True, exist_ok=True)
        self.layer_root.mkdir(parents=True, exist_ok=True)
        self.seccomp_bpf = await asyncio.to_thread(seccomp.build_filter)
        backend, self.cgroup_reason = cgroups.select(cfg.cgroup_parent, cfg.cgroup, cfg.cpu_reserved_cores)
        self.cgroups.open(backend)
        self.host_namespaces = probe.namespaces()
        # rootless, every sandbox's user namespace hangs off the caller's: each is capped at a share
        self.user_budgets = users.shared_budgets(cfg.rootless_budget_share) if cfg.rootless else {}
        await self.reaper.start()
        uid_range = slots.parse_range(cfg.uid_range)
        user_slots = None
        if uid_range and not cfg.rootless:
            # a scratch directory (a tmpfs goes over it in the probe's own mount namespace), then the
            # lower layers as sandboxes stack them: the layer store itself and, beside the skeletons, an
            # empty directory (nothing is written into the layer store: every entry there is a layer)
            probe_dirs = [cfg.state_dir / "idmap-probe" / "scratch", cfg.state_dir / "idmap-probe" / "lower"]
            for d in probe_dirs:
                d.mkdir(parents=True, exist_ok=True)
            user_slots = slots.UserSlots(*uid_range, probe=[str(probe_dirs[0]), str(self.layer_root),
                                                            str(probe_dirs[1])])
        self.restorer.start(self.seccomp_bpf, self.user_budgets, user_slots,
                            None if cfg.rootless or os.geteuid() != 0 else NetNamespaces())
        self.started = True

    async def close(self) -> None:
        """Destroy every sandbox and stop every zygote; creates still under way finish first (and
        are destroyed), new ones are refused."""
        self.closing = True
        await self.reaper.stop()
        await self.residency.close()
        for _ in range(3000):  # creates in flight land in the tables before they are torn down
            if not self._creating and not self.cgroups.restoring:
                break
            await asyncio.sleep(0.01)
        await asyncio.gather(*(self.destroy(sid, reason="shutdown") for sid in list(self.sandboxes)),
                             return_exceptions=True)
        await self.restorer.stop_zygotes()
        self.started = False
        self.cgroups.stop_reuse()
        awaited: set[asyncio.Task[None]] = set()
        while left := self._tasks - awaited:  # (and what they start: a sandbox ended releases its cgroup)
            for task in left:
                awaited.add(task)
                await task
        self.restorer.close_unmounter()  # (its closes were awaited above, as tasks)
        await self.cgroups.close()
        await self.restorer.close_slots()
        self.started = False

    async def __aenter__(self) -> Runtime:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ----------------------------------------------------------------- reporting
    def live_count(self) -> int:
        return len(self.sandboxes)

    def pool_sizes(self) -> dict[str, int]:
        return self.residency.sizes()

    def env_version(self, snapshot_id: str) -> dict[str, Any] | None:
        """The VERSION block of a snapshot this runtime has resolved (None if it has not)."""
        return self.views.env_version(snapshot_id)

    async def resolve(self, snapshot: str) -> SnapshotView:
        """The snapshot's view (``Views.resolve``)."""
        return await self.views.resolve(snapshot)

    def forget_names(self) -> None:
        """Resolve every name afresh (its store changed: the server attached S3 to its cache)."""
        self.views.forget_names()

    def register_view(self, view: SnapshotView) -> None:
        """Make a snapshot known without the resolver (a fork's scratch layer, say)."""
        self.views.register(view)

    def labels(self, sandbox_id: str) -> dict[str, str] | None:
        """The metadata of a sandbox live here, or ended here recently."""
        sb = self.sandboxes.get(sandbox_id)
        if sb is not None:
            return dict(sb.metadata)
        usage = self.usages.get(sandbox_id)
        return dict(usage.metadata) if usage is not None else None

    @contextlib.asynccontextmanager
    async def frozen(self, sandbox_id: str) -> AsyncIterator[Sandbox]:
        """Hold a sandbox still (no exec in flight, every process but its init stopped) while its
        upper directory — its filesystem diff, ``sandbox.upper_path`` — is read. When its agent said
        that nothing outlived its last step, or its cgroup holds its init alone, nothing can write
        while the lock is held: no signal is sent."""
        sb = self.get(sandbox_id)
        async with sb.lock:
            if sb.state is not SandboxState.LIVE:
                raise sb.gone()
            if (sb.alone and not sb.owed_exit) or await sb.only_init_left():
                yield sb
                sb.touch()
                return
            try:
                await sb.settle()
                await sb.chan.send(proto.bare(Op.FREEZE))
                if await sb.expect(Op.FROZEN) is None:
                    raise SandboxDied(f"sandbox {sandbox_id} died while freezing", sandbox_id=sandbox_id)
            except asyncio.CancelledError:
                sb.abandon("cancelled while freezing")
                raise
            try:
                yield sb
            finally:
                if sb.state is SandboxState.LIVE:
                    try:
                        await sb.chan.send(proto.bare(Op.THAW))  # no reply: the next frame is served after it
                    except OSError:
                        sb.abandon("lost while thawing")
                sb.touch()

    async def fork(self, sandbox_id: str, count: int, metadata: dict[str, str] | None = None,
                   sandbox_ids: Sequence[str] | None = None) -> list[SandboxInfo]:
        """``count`` new sandboxes that see exactly the files of a live sandbox, isolated from it and
        from each other afterwards (``Forks.fork``)."""
        return [self._info(sb) for sb in await self.forks.fork(sandbox_id, count, metadata, sandbox_ids)]

    def layers_in_use(self) -> frozenset[str]:
        """Layer ids that a zygote or a sandbox of this runtime has mounted (or is about to): never
        evict these. Safe to call from any thread (``Residency.layers_in_use``)."""
        return self.residency.layers_in_use()

    @property
    def cgroup_backend(self) -> Backend | None:
        return self.cgroups.backend

    @property
    def cleanup_failures(self) -> collections.Counter[str]:
        """Clean-up that failed, by what (each logged once): exported as rollbox_cleanup_failures_total."""
        return collections.Counter({"cgroup": self.cgroups.failures})

    def isolation_report(self, sandbox_id: str | None = None) -> dict[str, str]:
        """What is in force, per layer (runtime/report.py): for the live sandbox ``sandbox_id``, or
        for this runtime (its start-up probes and the latest sandbox read-back)."""
        if sandbox_id is not None:
            return self.reports.sandbox(self.get(sandbox_id))
        return self.reports.runtime()

    async def prewarm(self, snapshot: str = "python", count: int = 1, timeout_s: float = 60.0) -> None:
        """Keep at least ``count`` ready sandboxes of a snapshot (its default limits) in the pool."""
        await self.residency.prewarm(await self.resolve(snapshot), count, timeout_s)

    # ----------------------------------------------------------------- the API
    async def create(self, snapshot: str = "python", limits: LimitsArg = None,
                     metadata: dict[str, str] | None = None, sandbox_id: str | None = None,
                     forked_from: str | None = None, step_next: bool = False) -> SandboxInfo:
        """A sandbox restored from ``snapshot``. ``limits``: the fields to change from the snapshot's
        default limits (a ``Limits`` with only those fields given, or a mapping), or None for those defaults.
        ``sandbox_id``: the id to give it (the durable layer resumes sandboxes under their own id).
        ``step_next``: a step follows at once (a resume), so its worker is forked now."""
        return self._info(await self.take(snapshot, limits, metadata, sandbox_id, forked_from, step_next))

    async def take(self, snapshot: str = "python", limits: LimitsArg = None, metadata: dict[str, str] | None = None,
                   sandbox_id: str | None = None, forked_from: str | None = None,
                   step_next: bool = False) -> Sandbox:
        """``create`` without its reply (whose isolation report reads the sandbox's cgroup membership):
        the durable layer's resume, which replies with the step's result instead."""
        sb = await self.acquire(snapshot, limits, metadata, sandbox_id=sandbox_id, forked_from=forked_from)
        if step_next:
            await sb.want_spare()
        return sb

    async def inject(self, sandbox_id: str, diff: proto.Diff) -> None:
        """Apply a filesystem diff (entries, whiteouts, opaque, and an fd of the contents) inside a
        live sandbox: how a sandbox resumes its files from durable state."""
        await self.get(sandbox_id).inject(diff)

    async def acquire(self, snapshot: str, limits: LimitsArg, metadata: dict[str, str] | None,
                       pooled: bool = True, sandbox_id: str | None = None, forked_from: str | None = None,
                       metered: Metered = "sandbox") -> Sandbox:
        if sandbox_id is not None and sandbox_id in self.sandboxes:
            raise InvalidRequest(f"sandbox {sandbox_id!r} is live already", sandbox_id=sandbox_id)
        if not self.started or self.closing:
            raise ShuttingDown("runtime is not started" if not self.started else "runtime is shutting down")
        if len(self.sandboxes) + self._creating >= self.config.max_live:
            raise Overloaded(f"{len(self.sandboxes)} sandboxes are live (cap {self.config.max_live})",
                             retry_after_s=1.0)
        view = await self.resolve(snapshot)
        lim = effective_limits(view, limits)
        t0 = time.perf_counter()
        self._creating += 1
        try:
            # the timers are the supervisor's (its reaper's), not seen inside: a sandbox asking only for
            # other ones comes from the pool of the snapshot's defaults, and gets them when taken
            pool = (self.residency.pool_for(view, view.limits)
                    if pooled and lim.model_copy(update=_timers(view.limits)) == view.limits and not self.closing
                    else None)
            sb = pool.take() if pool else None
            pooled = sb is not None
            if sb is not None:
                sb.limits = lim
            if sb is None:
                sb = await self.restorer.restore(view, lim)
                if pool:
                    pool.observe_restore(time.perf_counter() - t0)
        finally:
            self._creating -= 1
        if sandbox_id is not None:
            self.usages.pop(sandbox_id, None)  # a resumed sandbox's earlier life on this replica
        sb.take_up(sandbox_id, metadata, forked_from=forked_from, pooled=pooled,
                   create_ms=(time.perf_counter() - t0) * 1000, metered=metered)
        self.sandboxes[sb.id] = sb
        return sb

    def _info(self, sb: Sandbox) -> SandboxInfo:
        return SandboxInfo(
            sandbox_id=sb.id, snapshot_id=sb.view.id, env_version=dict(sb.view.version), limits=sb.limits,
            metadata=sb.metadata, forked_from=sb.forked_from, pooled=sb.pooled, create_ms=round(sb.create_ms, 3),
            isolation=self.reports.sandbox(sb),
        )

    def get(self, sandbox_id: str) -> Sandbox:
        sb = self.sandboxes.get(sandbox_id)
        if sb is None:
            raise SandboxNotFound(f"no live sandbox {sandbox_id!r}", sandbox_id=sandbox_id)
        return sb

    async def exec(self, sandbox_id: str, request: ExecRequest, *, last: bool = False,
                   since: float | None = None) -> ExecResult:
        """One step in a live sandbox; ``since``: when its ``timeout_s`` started (``Sandbox.exec``)."""
        sb = self.get(sandbox_id)
        if request.timeout_s > sb.limits.lifetime_s:
            raise InvalidRequest(f"timeout_s {request.timeout_s} exceeds the sandbox lifetime_s {sb.limits.lifetime_s}",
                                 sandbox_id=sandbox_id)
        return await sb.exec(request, last=last, since=since)

    async def destroy(self, sandbox_id: str, reason: str = "destroyed") -> Usage:
        if sandbox_id in self.usages:
            return self.usages[sandbox_id]
        sb = self.get(sandbox_id)
        usage = await sb.close(reason)
        if self.sandboxes.get(sandbox_id) is sb:
            self.sandboxes.pop(sandbox_id, None)
        return self._ended(sb, usage)

    def discard(self, sandbox_id: str, reason: str) -> None:
        """Forget a live sandbox now and end it in the background: its id is free at once (the
        durable layer drops a stale copy and resumes the same sandbox in one step)."""
        sb = self.sandboxes.pop(sandbox_id, None)
        if sb is None:
            return

        async def end() -> None:
            self._ended(sb, await sb.close(reason), keep_usage=False)  # the id may be live again

        self._background(end())

    def _ended(self, sb: Sandbox, usage: Usage, keep_usage: bool = True) -> Usage:
        sandbox_id = sb.id
        self.forks.sandbox_ended(sb)
        if keep_usage:
            self.usages[sandbox_id] = usage
            if self.on_life_ended is not None and sb.metered is not None:
                try:
                    self.on_life_ended(usage, sb.limits, sb.metered)
                except Exception:
                    log.exception("recording the usage of %s failed", sandbox_id)
        while len(self.usages) > 100_000:
            self.usages.pop(next(iter(self.usages)))
        return usage

    async def run(self, request: ExecRequest, snapshot: str = "python", limits: LimitsArg = None,
                  metadata: dict[str, str] | None = None) -> ExecResult:
        """create + exec + destroy. Its ``timeout_s`` counts from now: getting the sandbox is part of
        the run, and the reply comes at the deadline however long that took."""
        since = time.monotonic()
        for attempt in range(3):
            sb = await self.acquire(snapshot, limits, metadata, metered="run")
            try:
                result = await self.exec(sb.id, request, last=True, since=since)
                return result.model_copy(update={"pooled": sb.pooled, "create_ms": round(sb.create_ms, 3)})
            except SandboxDied as exc:
                # a pooled sandbox that died before the request reached it (its zygote crashed): take
                # another; nothing ran, so this cannot run the request twice
                if exc.ran or attempt == 2:
                    raise
            finally:
                if sb.exited.is_set():
                    await self.destroy(sb.id)
                else:  # killed at its deadline and still tearing down (a fork bomb's pid namespace):
                    self._background(self._destroy_quietly(sb.id))  # reply now, reap and bill in the background
        raise AssertionError("unreachable")

    async def _destroy_quietly(self, sandbox_id: str) -> None:
        with contextlib.suppress(SandboxNotFound):  # destroyed meanwhile (shutdown)
            await self.destroy(sandbox_id)

    def _background(self, work: Coroutine[Any, Any, None]) -> None:
        """Run ``work`` on its own; ``close`` waits for it."""
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
