"""Language snapshots built on first use (and ahead of time), once per language per local store.

A request for a language whose snapshot the store lacks starts the build of its template
(``snapshots/templates/<template>``: Debian's packages through mmdebstrap, as ``rollbox snapshot
build`` does; never the host's toolchains); requests for it meanwhile wait for that one build. Per
snapshot, in ``<store>/builds/``:

    <snapshot>.lock   flock'd by the process that builds it: another process sharing the store (a
                      second ``rollbox serve`` on the same ROLLBOX_HOME, ``rollbox languages build``)
                      waits on the lock, then finds the snapshot built and builds nothing
    <snapshot>.json   the build's progress, rewritten at each step: {language, snapshot, state
                      (building | failed), step, steps, doing, pid, since, error}; any process reads
                      it (``status``); "building" only while the lock is held

Steps: one per Debian layer of the template (the shared base, then the toolchain), one each for the
template's pip packages and files, and the manifest; ``describe()`` says "building lua, step 2/3:
toolchain: mmdebstrap ...". The server logs each step (``rollbox.snapshots.language_builds``).

    builds = LanguageBuilds(LocalStore(home))
    builds.build("lua", on_progress=print)          # blocking (the CLI); returns the manifest
    await builds.ensure("lua", wait_s=20)            # the server: one build per snapshot; StillBuilding
                                                     # (an Overloaded: retry) if not done within wait_s
    builds.statuses()                                # every language: ready / building / failed / missing
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Literal

from rollbox.runtime.errors import Overloaded, RollboxError, SnapshotNotFound
from rollbox.snapshots import languages
from rollbox.snapshots.manifest import Manifest
from rollbox.snapshots.store_local import LocalStore
from rollbox.snapshots.template import DebianBase, Template, load_template

__all__ = ["TEMPLATES", "BuildProgress", "LanguageBuilds", "StillBuilding", "steps_of"]

TEMPLATES = Path(__file__).resolve().parent / "templates"
log = logging.getLogger(__name__)
State = Literal["ready", "building", "failed", "missing"]
RETRY_FAILED_AFTER_S = 60.0  # a failed build is not started again for this long (each request would)


@dataclass(frozen=True)
class BuildProgress:
    """Where a language's snapshot is: ``ready`` (built: ``snapshot_id``), ``building`` (step of
    steps, doing), ``failed`` (error) or ``missing``."""

    language: str
    snapshot: str
    state: State
    step: int = 0
    steps: int = 0
    doing: str = ""
    error: str = ""
    since: float | None = None  # unix time the build started (building) or failed
    pid: int | None = None
    snapshot_id: str | None = None

    def describe(self) -> str:
        if self.state == "building":
            return f"building {self.language}, step {self.step}/{self.steps}: {self.doing}"
        if self.state == "failed":
            return f"building {self.language} failed: {self.error}"
        return f"{self.language}: {self.state}"

    def as_json(self) -> dict[str, object]:
        return asdict(self)


class StillBuilding(Overloaded):
    """The language's snapshot is being built and was not ready within the request's wait: retry."""


def steps_of(template: Template, template_dir: Path) -> int:
    """How many steps building ``template`` reports: its Debian layers (the chain of ``over``), its
    packages and files layers, the manifest."""
    n = 1 + bool(template.packages) + bool(template.files or template.warm.preload)
    base = template.base
    if not isinstance(base, DebianBase):
        return n + (base != "host")
    where, spec = template_dir, base.debian
    while True:
        n += 1
        if spec.over is None:
            return n
        tpl, where = load_template((where / spec.over).resolve())
        if not isinstance(tpl.base, DebianBase) or n > 10:
            return n
        spec = tpl.base.debian


class LanguageBuilds:
    """Builds the language snapshots a local store lacks (see the module's docstring)."""

    def __init__(self, store: LocalStore, templates: Path = TEMPLATES, *,
                 retry_failed_after_s: float = RETRY_FAILED_AFTER_S):
        self.store = store
        self.templates = templates
        self.retry_failed_after_s = retry_failed_after_s
        self.dir = store.root / "builds"
        self._tasks: dict[str, asyncio.Future[Manifest]] = {}  # this process's builds, by snapshot
        self._failed: dict[str, tuple[float, str]] = {}  # snapshot -> (when, why)
        self.started = 0  # builds this process started (the ones it ran, not the ones it waited for)

    # ------------------------------------------------------------------------------ status
    def status(self, language: str) -> BuildProgress:
        row = languages.language(language)
        assert row.snapshot is not None
        sid = self.store.names().get(row.snapshot)
        if sid is not None and self.store.has_manifest(sid):
            return BuildProgress(language, row.snapshot, "ready", snapshot_id=sid)
        rec = self._record(row.snapshot)
        if rec is not None and rec.state == "building" and not self._held(row.snapshot):
            rec = None  # its builder is gone (killed): nothing is building it now
        if rec is not None:
            return replace(rec, language=language)
        return BuildProgress(language, row.snapshot, "missing")

    def statuses(self) -> list[BuildProgress]:
        return [self.status(name) for name in languages.SUPPORTED]

    def _record(self, snapshot: str) -> BuildProgress | None:
        try:
            raw = json.loads((self.dir / f"{snapshot}.json").read_text())
            return BuildProgress(**raw)
        except (OSError, ValueError, TypeError):
            return None

    def _held(self, snapshot: str) -> bool:
        """Whether some process holds the snapshot's build lock (is building it)."""
        try:
            fd = os.open(self.dir / f"{snapshot}.lock", os.O_RDONLY)
        except FileNotFoundError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return False
        except BlockingIOError:
            return True
        finally:
            os.close(fd)

    def _write(self, p: BuildProgress) -> None:
        path = self.dir / f"{p.snapshot}.json"
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")
        tmp.write_text(json.dumps(p.as_json()))
        os.replace(tmp, path)

    # ------------------------------------------------------------------------------ build
    def build(self, language: str, on_progress: Callable[[BuildProgress], None] | None = None) -> Manifest:
        """Build ``language``'s snapshot unless the store has it (blocking). Holds the snapshot's lock:
        a build of it elsewhere (another process on this store) is waited for, not repeated."""
        row = languages.language(language)
        assert row.snapshot is not None and row.template is not None
        self.dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.dir / f"{row.snapshot}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            if self._held(row.snapshot):
                log.info(f"waiting for another process's build of {language}", extra={"fields": {"language": language}})
            fcntl.flock(fd, fcntl.LOCK_EX)
            done = self._built(row.snapshot)
            if done is not None:
                return done
            return self._build_locked(language, row.snapshot, row.template, on_progress)
        finally:
            os.close(fd)  # (releases the lock)

    def _built(self, snapshot: str) -> Manifest | None:
        sid = self.store.names().get(snapshot)
        if sid is None or not self.store.has_manifest(sid):
            return None
        return self.store.get_manifest(sid)

    def _build_locked(self, language: str, snapshot: str, template_file: str,
                      on_progress: Callable[[BuildProgress], None] | None) -> Manifest:
        from rollbox.snapshots.build import build

        self.started += 1
        started = time.time()
        p = BuildProgress(language, snapshot, "building", doing=f"starting (snapshots/templates/{template_file})",
                          since=started, pid=os.getpid())
        phase = [""]
        last_log = [0.0]

        def report(new: BuildProgress, *, force_log: bool) -> None:
            nonlocal p
            p = new
            self._write(p)
            now = time.monotonic()
            if force_log or now - last_log[0] >= 5.0:
                last_log[0] = now
                log.info(p.describe(), extra={"fields": {"language": language, "step": p.step, "steps": p.steps}})
            if on_progress is not None:
                on_progress(p)

        try:
            template, where = load_template(self.templates / template_file)
            steps = steps_of(template, where)
            report(replace(p, steps=steps), force_log=True)

            def on_step(msg: str) -> None:
                head = msg.split(":", 1)[0] if ":" in msg else "manifest"
                new_phase = head != phase[0]
                if new_phase:
                    phase[0] = head
                step = min(p.step + 1, steps) if new_phase else p.step
                report(replace(p, step=step, steps=steps, doing=msg[:300]), force_log=new_phase)

            manifest = build(template, where, self.store, on_step=on_step)
        except Exception as exc:
            why = exc.message if isinstance(exc, RollboxError) else f"{type(exc).__name__}: {exc}"
            failed = replace(p, state="failed", error=why[-2000:], since=time.time())
            self._write(failed)
            log.warning(failed.describe(), extra={"fields": {"language": language}})
            if on_progress is not None:
                on_progress(failed)
            raise
        (self.dir / f"{snapshot}.json").unlink(missing_ok=True)
        log.info(f"built {language}: snapshot {snapshot} = {manifest.id} in {time.time() - started:.0f} s "
                 f"({manifest.size_bytes / 1e6:.0f} MB)", extra={"fields": {"language": language}})
        return manifest

    # ------------------------------------------------------------------------------ the server's side
    async def ensure(self, language: str, wait_s: float | None = None) -> None:
        """Return once ``language``'s snapshot is in the store, building it (one build per snapshot in
        this process; the lock makes it one per store). ``wait_s``: how long to wait for a build;
        past it, StillBuilding (the build goes on). A failed build: SnapshotNotFound saying why (a new
        build is tried after ``retry_failed_after_s``)."""
        row = languages.language(language)
        assert row.snapshot is not None
        snapshot = row.snapshot
        task = self._tasks.get(snapshot)
        if task is None:
            failed = self._failed.get(snapshot)
            if failed is not None and time.monotonic() - failed[0] < self.retry_failed_after_s:
                raise SnapshotNotFound(self._failure(language, failed[1]), snapshot_id=snapshot)
            task = self._tasks[snapshot] = self._start(language, snapshot)
        try:
            await asyncio.wait_for(asyncio.shield(task), wait_s)
        except TimeoutError:
            p = self.status(language)
            if p.state == "ready":
                return
            what = p.describe() if p.state == "building" else f"building {language}"
            raise StillBuilding(f"{what}; the snapshot is not ready yet: retry", retry_after_s=5.0,
                                snapshot_id=snapshot) from None
        except RollboxError as exc:
            raise SnapshotNotFound(self._failure(language, exc.message), snapshot_id=snapshot) from None
        except Exception as exc:
            raise SnapshotNotFound(self._failure(language, f"{type(exc).__name__}: {exc}"),
                                   snapshot_id=snapshot) from None

    def _failure(self, language: str, why: str) -> str:
        return f"building the snapshot of language {language!r} failed: {why}. {languages.missing_snapshot(language)}"

    def _start(self, language: str, snapshot: str) -> asyncio.Future[Manifest]:
        """The build on its own (daemon) thread: a server stopping does not wait for it; a build killed
        half way leaves its temporary directory to the store's clean-up and its lock to the kernel."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Manifest] = loop.create_future()

        def settle(result: Manifest | None, exc: BaseException | None) -> None:
            self._tasks.pop(snapshot, None)
            if exc is not None:
                self._failed[snapshot] = (time.monotonic(), exc.message if isinstance(exc, RollboxError) else str(exc))
                if not fut.done():
                    fut.set_exception(exc)
            else:
                self._failed.pop(snapshot, None)
                if not fut.done():
                    fut.set_result(result)  # type: ignore[arg-type]

        def run() -> None:
            try:
                manifest = self.build(language)
            except BaseException as exc:  # delivered to the waiters
                loop.call_soon_threadsafe(settle, None, exc)
                return
            loop.call_soon_threadsafe(settle, manifest, None)

        threading.Thread(target=run, name=f"rollbox-build-{snapshot}", daemon=True).start()
        fut.add_done_callback(lambda f: f.exception() if not f.cancelled() else None)  # (no "never retrieved")
        return fut
