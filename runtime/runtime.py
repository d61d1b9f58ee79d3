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
import dataclasses
import logging
import os
import resource
import secrets
import shutil
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from rollbox.runtime import owners, report, slots
from rollbox.runtime.errors import (
    InvalidRequest,
    IsolationError,
    Overloaded,
    SandboxDied,
    SandboxNotFound,
    ShuttingDown,
)
from rollbox.runtime.execution import Metered, Sandbox, SandboxState
from rollbox.runtime.inside import probe, proto
from rollbox.runtime.inside.proto import Op
from rollbox.runtime.isolation import cgroups, seccomp, users
from rollbox.runtime.isolation.cgroup_pool import CgroupPool
from rollbox.runtime.isolation.cgroups import Backend
from rollbox.runtime.pool import Pool
from rollbox.runtime.restore import WarmSource
from rollbox.runtime.restorer import Restorer, rlimit_params
from rollbox.runtime.snapshot import BuiltinResolver, SnapshotResolver, SnapshotView
from rollbox.runtime.spec import ExecRequest, ExecResult, Limits, SandboxInfo, Usage
from rollbox.runtime.upper import give_back, pack_upper

log = logging.getLogger("rollbox.runtime")

KILLED_EXIT_WAIT_S = 0.5  # see Runtime._only_init_left
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
        self._views: dict[str, tuple[SnapshotView, float | None]] = {}
        self._resolving: dict[str, asyncio.Future[SnapshotView]] = {}  # one store lookup per name at a time
        self.sweeper = owners.Sweep()  # leftovers of runtimes that died (cgroups, staging dirs, scratch layers)
        self._leftovers = 0
        self._swept = 0.0
        self._scratch: dict[str, set[str]] = {}  # fork scratch layer -> ids of the sandboxes on it
        self._layers_in_use: frozenset[str] = frozenset()
        self.usages: dict[str, Usage] = {}
        self.pools: dict[Any, Pool] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self.cgroups = CgroupPool(keep=self.config.cgroup_pool_max, background=self._background)
        self.restorer = Restorer(state_dir=self.config.state_dir, rootless=self.config.rootless, cgroups=self.cgroups,
                                 background=self._background, before_restore=self._before_restore)
        self.zygotes = self.restorer.zygotes  # the warm source of each snapshot recipe in use
        self.cgroup_reason = ""
        self.seccomp_bpf = b""
        self.host_namespaces: dict[str, int] = {}  # probed at start: what "unshared" is measured against
        self.user_budgets: dict[str, int] = {}
        self._runtime_report: tuple[tuple[Any, ...], dict[str, str]] | None = None  # (its inputs, the report)
        self._reaper: asyncio.Task[None] | None = None
        self._creating = 0
        self.closing = False
        self.started = False
        # Called after the reaper destroyed a sandbox for its lifetime or idle limit (the durable
        # layer records that the sandbox is gone): (sandbox id, reason, usage).
        self.on_reaped: Callable[[str, str, Usage], Awaitable[None]] | None = None
        # Called when a sandbox life that is billed here ends (the usage ledger): (usage, its limits,
        # "sandbox" | "run"). Durable sandboxes are billed by the durable layer, once, at their end.
        self.on_life_ended: Callable[[Usage, Limits, str], None] | None = None

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
        self._leftovers = await asyncio.to_thread(self._sweep)
        self._swept = time.monotonic()
        self._reaper = asyncio.create_task(self._reap_loop())
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
        self.restorer.start(self.seccomp_bpf, self.user_budgets, user_slots)
        self.started = True

    def _sweep(self) -> int:
        """Remove what runtimes that died left behind (``owners``: found by who made them, not by a
        pid that may be a zombie or reused): sandbox cgroups (processes still in one are killed, the
        cgroup goes on a later sweep), zygote staging directories and fork scratch layers. Returns
        how many remain; the reaper sweeps again until none do (and every 30 s anyway)."""
        cgroups = self.cgroups.leftovers()
        staging = self.config.state_dir / "zygotes"
        dirs = list(staging.iterdir()) if staging.is_dir() else []
        trees = list(self.layer_root.glob(proto.SCRATCH_PREFIX + "*"))
        return self.sweeper.run(cgroups, dirs, trees)

    async def close(self) -> None:
        """Destroy every sandbox and stop every zygote; creates still under way finish first (and
        are destroyed), new ones are refused."""
        self.closing = True
        if self._reaper:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
        for pool in list(self.pools.values()):
            await pool.close()
        self.pools.clear()
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
        self.restorer.close_slots()
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
        return {str(k[0]): len(p.ready) for k, p in self.pools.items()}

    def env_version(self, snapshot_id: str) -> dict[str, Any] | None:
        """The VERSION block of a snapshot this runtime has resolved (None if it has not)."""
        hit = self._views.get(snapshot_id)
        return dict(hit[0].version) if hit is not None else None

    def labels(self, sandbox_id: str) -> dict[str, str] | None:
        """The metadata of a sandbox live here, or ended here recently."""
        sb = self.sandboxes.get(sandbox_id)
        if sb is not None:
            return dict(sb.metadata)
        usage = self.usages.get(sandbox_id)
        return dict(usage.metadata) if usage is not None else None

    async def resolve(self, snapshot: str) -> SnapshotView:
        """The snapshot's view; a resolver that may download (S3) is asked off the event loop.
        Views are cached by id (content-addressed, immutable) and by name for a few seconds."""
        now = time.monotonic()
        hit = self._views.get(snapshot)
        if hit is not None and (hit[1] is None or now - hit[1] < 5.0):
            return hit[0]
        resolve_async = getattr(self.resolver, "resolve_async", None)
        if resolve_async is None:
            return self._keep_view(snapshot, self.resolver.resolve(snapshot), now)
        task = self._resolving.get(snapshot)
        if task is None:
            task = self._resolving[snapshot] = asyncio.ensure_future(resolve_async(snapshot))
            task.add_done_callback(lambda t: self._resolved(snapshot, t, now))
        if hit is None:
            view: SnapshotView = await asyncio.shield(task)
            return view
        try:  # a name seen before: its last view serves if the store is slow to say where it points now
            return await asyncio.wait_for(asyncio.shield(task), 0.5)
        except TimeoutError:
            log.warning("the store is slow resolving %r: using its last known snapshot %s", snapshot, hit[0].id)
            return hit[0]

    def _resolved(self, snapshot: str, task: asyncio.Future[SnapshotView], asked: float) -> None:
        self._resolving.pop(snapshot, None)
        if not task.cancelled() and task.exception() is None:
            self._keep_view(snapshot, task.result(), asked)

    def _keep_view(self, snapshot: str, view: SnapshotView, now: float) -> SnapshotView:
        self._views[view.id] = (view, None)
        if snapshot != view.id:
            self._views[snapshot] = (view, now)
        return view

    def forget_names(self) -> None:
        """Resolve every name afresh (its store changed: the server attached S3 to its cache); views
        by id stay (content-addressed)."""
        self._views = {k: v for k, v in self._views.items() if v[1] is None}

    def register_view(self, view: SnapshotView) -> None:
        """Make a snapshot known without the resolver (a fork's scratch layer, say)."""
        self._views[view.id] = (view, None)

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
            if (sb.alone and not sb.owed_exit) or await self._only_init_left(sb):
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

    @staticmethod
    async def _only_init_left(sb: Sandbox) -> bool:
        """Whether the sandbox's cgroup holds its init alone: nothing but the agent can write. After a
        timed-out step, whose processes the host killed, waited for up to KILLED_EXIT_WAIT_S while they
        exit. Then its files are read without a word from its agent, which a busy box may take seconds
        to give (it reaps the killed first, then stops the rest): a durable step's commit after a
        timeout does not wait for that (the agent's report is read before its next frame)."""
        if sb.group is None:
            return False
        deadline = time.monotonic() + (KILLED_EXIT_WAIT_S if sb.killed_step else 0.0)
        while True:
            if set(sb.group.pids()) <= {sb.pid}:
                return True
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.01)

    async def fork(self, sandbox_id: str, count: int, metadata: dict[str, str] | None = None,
                   sandbox_ids: Sequence[str] | None = None) -> list[SandboxInfo]:
        """``count`` new sandboxes that see exactly the files of a live sandbox, isolated from it and
        from each other afterwards.

        A small diff (up to ``fork_inject_max_bytes``) is read once and applied inside sandboxes of
        the parent's snapshot — taken from the warm pool, so a fork costs no restore on its path. A
        larger one is copied once into a scratch layer stacked under fresh children (same zygote);
        that layer goes with the last child."""
        if not 1 <= count <= 1024:
            raise InvalidRequest(f"count must be between 1 and 1024, got {count}", sandbox_id=sandbox_id)
        if sandbox_ids is not None and len(sandbox_ids) != count:
            raise InvalidRequest(f"{len(sandbox_ids)} sandbox ids for {count} children", sandbox_id=sandbox_id)
        parent = self.get(sandbox_id)
        ids = iter(sandbox_ids or ())
        scratch = proto.scratch_layer_id(owners.tag(), secrets.token_hex(8))
        dst = self.layer_root / scratch
        async with self.frozen(sandbox_id) as sb:
            diff = await asyncio.to_thread(pack_upper, sb.upper_path, self.config.fork_inject_max_bytes)
            if diff is None:
                proc = await asyncio.create_subprocess_exec(
                    "cp", "-a", f"{sb.upper_path}/.", str(dst), stderr=asyncio.subprocess.PIPE)
                _, err = await proc.communicate()
                if proc.returncode != 0:
                    shutil.rmtree(dst, ignore_errors=True)
                    raise IsolationError(f"copying the sandbox's files failed: {err.decode(errors='replace')[-300:]}",
                                         sandbox_id=sandbox_id)
                if sb.owner_shift is not None:  # its children run as other uids: the layer's files are 1000's
                    await asyncio.to_thread(give_back, str(dst), sb.owner_shift)
        meta = metadata if metadata is not None else parent.metadata
        if diff is not None:
            view = parent.view
        else:
            view = dataclasses.replace(parent.view, id=proto.fork_view_id(parent.view.id, scratch),
                                       layers=(scratch, *parent.view.layers))
            self.register_view(view)
            self._scratch[scratch] = set()

        if diff is not None and parent.limits == view.limits:
            self._pool_for(view, view.limits).note_burst(count)

        async def child() -> Sandbox:
            sb = await self._acquire(view.id, parent.limits, meta, pooled=diff is not None,
                                     sandbox_id=next(ids, None), forked_from=sandbox_id)
            if diff is not None:
                await sb.inject(diff)
            return sb  # no spare worker asked for: its first exec forks one (a fork stays ~1 ms per child)

        try:
            results = await asyncio.gather(*(child() for _ in range(count)), return_exceptions=True)
        finally:
            if diff is not None:
                os.close(diff.fd)
        made = [r for r in results if isinstance(r, Sandbox)]
        if diff is None:
            self._scratch[scratch].update(sb.id for sb in made)
        if len(made) < count:
            for sb in made:
                await self.destroy(sb.id)
            if diff is None:
                self._drop_scratch(scratch)
            raise next(r for r in results if isinstance(r, BaseException))
        return [self._info(sb) for sb in made]

    def _drop_scratch(self, scratch: str) -> None:
        self._scratch.pop(scratch, None)
        for view_id in [k for k in self._views if proto.is_view_of_scratch(k, scratch)]:  # the fork's view
            del self._views[view_id]
        asyncio.get_running_loop().run_in_executor(None, shutil.rmtree, self.layer_root / scratch, True)

    def _before_restore(self, view: SnapshotView) -> None:
        if not set(view.layers) <= self._layers_in_use:
            self._note_layers(view)

    async def restore(self, view: SnapshotView, limits: Limits, zygote: WarmSource | None = None) -> Sandbox:
        """Fork one sandbox from the snapshot's zygote and contain it (no pool)."""
        return await self.restorer.restore(view, limits, zygote)

    async def zygote(self, view: SnapshotView) -> WarmSource:
        """The running source of ``view``'s sandboxes, started (the cold path) if needed."""
        return await self.restorer.zygote(view)

    @property
    def user_slots(self) -> slots.UserSlots | None:
        """As root: the user namespaces sandboxes get, one each (None: they share the host's)."""
        return self.restorer.user_slots

    def layers_in_use(self) -> frozenset[str]:
        """Layer ids that a zygote or a sandbox of this runtime has mounted (or is about to): never
        evict these. Safe to call from any thread: it reads a set the event loop replaces whole."""
        return self._layers_in_use

    def _note_layers(self, view: SnapshotView | None = None) -> None:
        """On the event loop: recompute the layers in use (plus ``view``'s, about to be mounted)."""
        used = {layer for z in self.zygotes.values() for layer in z.view.layers}
        used |= {layer for sb in self.sandboxes.values() for layer in sb.view.layers}
        used |= {layer for pool in self.pools.values() for sb in pool.ready for layer in sb.view.layers}
        if view is not None:
            used |= set(view.layers)
        self._layers_in_use = frozenset(used)

    def held_cgroups(self) -> set[str]:
        """Every cgroup directory this runtime holds: lent to sandboxes, being emptied, reusable."""
        return self.cgroups.held()

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
            return self._report(self.get(sandbox_id))
        facts = next(reversed(list(self.restorer.probed.values())), None)
        inputs = (facts, self.cgroup_backend, getattr(self.cgroup_backend, "cpu", None), self.cgroup_reason,
                  self.seccomp_bpf, self.host_namespaces)
        cached = self._runtime_report  # (a create committed hibernated replies with it: rendered once)
        if cached is None or any(a is not b for a, b in zip(cached[0], inputs, strict=True)):
            cached = self._runtime_report = (inputs, self._render(facts))
        return dict(cached[1])

    def _report(self, sb: Sandbox) -> dict[str, str]:
        facts = self.restorer.probed.get(sb.source) if sb.source is not None else None
        return self._render(facts, limits=sb.limits, group=sb.group, pid=sb.pid,
                            rlimit_params=rlimit_params(sb.limits, sb.group is not None, sb.nproc_first))

    def _render(self, facts: dict[str, Any] | None, **sandbox: Any) -> dict[str, str]:
        """``report.render`` with this runtime's side of it; ``sandbox``: one sandbox's own."""
        return report.render(rootless=self.config.rootless, uid=os.geteuid(), host_ns=self.host_namespaces,
                             backend=self.cgroup_backend, backend_reason=self.cgroup_reason, bpf=self.seccomp_bpf,
                             facts=facts, **sandbox)

    # ----------------------------------------------------------------- restore
    def _pool_for(self, view: SnapshotView, limits: Limits) -> Pool:
        key = (view.id, limits)
        pool = self.pools.get(key)
        if pool is None:
            async def make() -> Sandbox:
                return await self.restorer.restore(view, limits)

            pool = Pool(key, make, min_size=self.config.pool_min, max_size=self.config.pool_max,
                        window_s=self.config.pool_window_s, idle_s=self.config.pool_idle_s)
            pool.start()
            self.pools[key] = pool
        return pool

    async def prewarm(self, snapshot: str = "python", count: int = 1, timeout_s: float = 60.0) -> None:
        """Keep at least ``count`` ready sandboxes of a snapshot (its default limits) in the pool."""
        view = await self.resolve(snapshot)
        pool = self._pool_for(view, view.limits)
        pool.min_size = max(pool.min_size, count)
        await self.restorer.zygote(view)
        await pool.wait_ready(count, timeout_s)

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
        sb = await self._acquire(snapshot, limits, metadata, sandbox_id=sandbox_id, forked_from=forked_from)
        if step_next:
            await sb.want_spare()
        return sb

    async def inject(self, sandbox_id: str, diff: proto.Diff) -> None:
        """Apply a filesystem diff (entries, whiteouts, opaque, and an fd of the contents) inside a
        live sandbox: how a sandbox resumes its files from durable state."""
        await self.get(sandbox_id).inject(diff)

    async def _acquire(self, snapshot: str, limits: LimitsArg, metadata: dict[str, str] | None,
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
            pool = self._pool_for(view, lim) if pooled and lim == view.limits and not self.closing else None
            sb = pool.take() if pool else None
            pooled = sb is not None
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
            isolation=self._report(sb),
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
        for scratch in sb.view.layers:
            users = self._scratch.get(scratch)
            if users is not None:
                users.discard(sandbox_id)
                if not users:
                    self._drop_scratch(scratch)
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
            sb = await self._acquire(snapshot, limits, metadata, metered="run")
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
                    self._destroy_later(sb.id)  # reply now, reap and bill in the background
        raise AssertionError("unreachable")

    def _destroy_later(self, sandbox_id: str) -> None:
        async def end() -> None:
            try:
                await self.destroy(sandbox_id)
            except SandboxNotFound:
                pass  # destroyed meanwhile (shutdown)

        self._background(end())

    def _background(self, work: Coroutine[Any, Any, None]) -> None:
        """Run ``work`` on its own; ``close`` waits for it."""
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ----------------------------------------------------------------- lifetimes
    async def _reap_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.reaper_interval_s)
            self._note_layers()
            now = time.monotonic()
            # what dead runtimes left: again soon while some of it stays, at once when a runtime whose
            # things the last sweep left alone has died since, else every 30 s
            if now - self._swept >= (1.0 if self._leftovers else 30.0) or self.sweeper.owner_died():
                self._swept = now
                try:
                    self._leftovers = await asyncio.to_thread(self._sweep)
                except Exception:
                    log.exception("sweeping leftovers failed")
            for sid, sb in list(self.sandboxes.items()):
                reason = None
                if now - sb.created_at > sb.limits.lifetime_s:
                    reason = "lifetime"
                elif not sb.busy and now - sb.last_used > sb.limits.idle_s:
                    reason = "idle"
                elif sb.state is SandboxState.DIED and not sb.busy:
                    reason = "died"
                if reason and self.sandboxes.get(sid) is sb:  # (not a copy resumed under its id meanwhile)
                    with contextlib.suppress(Exception):
                        usage = await self.destroy(sid, reason=reason)
                        if self.on_reaped is not None and reason in ("lifetime", "idle"):
                            await self.on_reaped(sid, reason, usage)
