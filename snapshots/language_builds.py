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

With a shared store (``remote``: the S3 store every replica uses) a language is built once for all of
them: a snapshot the shared store names is used from there (the resolver pulls it; nothing is built),
one built here is pushed to it (layers, manifest, name), and the replica that builds says so first
with a create-only object in the shared store's ``claims``:

    language-builds/<snapshot>.claim    created (If-None-Match) by the replica that builds it; the others
                                        wait for the name to appear in the shared store, then use it
    language-builds/<snapshot>.beat     the builder's progress, rewritten every BEAT_S: a claim whose
                                        beat is older than CLAIM_STALE_S (its builder was killed) is
                                        taken over
    language-builds/<snapshot>.failed   why the last build failed: the waiters get that failure, and
                                        nobody builds it again for ``retry_failed_after_s``

A home that holds a language snapshot the shared store does not name (a baked image's) offers it with
``push_built`` (``rollbox serve`` runs it on a thread at start): under the same claim, the layers and
manifest copied, the name created only if absent.

The claim and the beat are released only by their owner (``Objects.delete_own``: only while they hold
the bytes this replica wrote), so a replica whose claim was taken over leaves the new owner's alone.

A build is reproducible (its layers are content-addressed), so two builds racing past a claim only cost
time, never a wrong snapshot. When the shared store cannot be reached the build is made here alone.

    builds = LanguageBuilds(LocalStore(home))
    builds.build("lua", on_progress=print)          # blocking (the CLI); returns the manifest
    await builds.ensure("lua", wait_s=20)            # the server: one build per snapshot; StillBuilding
                                                     # (an Overloaded: retry) if not done within wait_s
    builds.statuses()                                # every language: ready / building / failed / missing
    LanguageBuilds(local, remote=s3, claims=S3Objects(s3))   # shared: built once, pushed, used by every replica
    builds.push_built()                              # what this home holds, offered to the shared store
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Literal

from rollbox.runtime.errors import Overloaded, RollboxError, SnapshotNotFound, StoreError
from rollbox.snapshots import languages
from rollbox.snapshots.manifest import Manifest
from rollbox.snapshots.state import Objects
from rollbox.snapshots.store import Store, copy_snapshot
from rollbox.snapshots.store_local import LocalStore
from rollbox.snapshots.template import DebianBase, Template, load_template

__all__ = ["TEMPLATES", "BuildProgress", "LanguageBuilds", "SharedState", "StillBuilding", "steps_of"]

TEMPLATES = Path(__file__).resolve().parent / "templates"
log = logging.getLogger(__name__)
State = Literal["ready", "building", "failed", "missing"]
RETRY_FAILED_AFTER_S = 60.0  # a failed build is not started again for this long (each request would)
CLAIMS = "language-builds"  # the claims' key prefix in the shared store's objects
BEAT_S = 10.0  # how often a replica building a language rewrites its beat
CLAIM_STALE_S = 90.0  # a claim whose beat is older than this: its builder is gone
POLL_S = 2.0  # how often a replica waiting for another's build looks at the shared store


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
    where: str | None = None  # ready: "here" (the local store) or "store" (the shared store: pulled on first use)
    replica: str | None = None  # building or failed on another replica: which (host:pid)

    def describe(self) -> str:
        on = f" on replica {self.replica}" if self.replica else ""
        if self.state == "building":
            return f"building {self.language}{on}, step {self.step}/{self.steps}: {self.doing}"
        if self.state == "failed":
            return f"building {self.language}{on} failed: {self.error}"
        return f"{self.language}: {self.state}"

    def as_json(self) -> dict[str, object]:
        return asdict(self)


@dataclass(frozen=True)
class SharedState:
    """What the shared store says: its names (name -> snapshot id) and the builds on other replicas."""

    names: dict[str, str]
    elsewhere: dict[str, BuildProgress]


@dataclass(frozen=True)
class _Claim:
    """A claim this replica holds in the shared store: the snapshot and the exact bytes it wrote (it is
    released only while the store still holds them)."""

    snapshot: str
    body: bytes


@dataclass(frozen=True)
class _Seen:
    """Another replica's build as the shared store shows it: its progress, when it last beat (unix time),
    and its claim's bytes (None for a failure)."""

    progress: BuildProgress
    beat_at: float
    claim: bytes | None


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

    def __init__(self, store: LocalStore, templates: Path = TEMPLATES, *, remote: Store | None = None,
                 claims: Objects | None = None, retry_failed_after_s: float = RETRY_FAILED_AFTER_S):
        self.store = store
        self.remote = remote  # the store the replicas share (S3): built once for all, pushed there
        self.claims = claims  # objects in the shared store: who builds what (the module's docstring)
        self.me = f"{os.uname().nodename}:{os.getpid()}"
        self.templates = templates
        self.retry_failed_after_s = retry_failed_after_s
        self.dir = store.root / "builds"
        self._tasks: dict[str, asyncio.Future[Manifest]] = {}  # this process's builds, by snapshot
        self._failed: dict[str, tuple[float, str]] = {}  # snapshot -> (when, why)
        self.started = 0  # builds this process started (the ones it ran, not the ones it waited for)

    # ------------------------------------------------------------------------------ status
    def status(self, language: str, shared: SharedState | None = None) -> BuildProgress:
        """``language``'s state here; with ``shared`` (``shared_state()``) also what the shared store has:
        ready there (``where`` "store"), building or failed on another replica."""
        row = languages.language(language)
        assert row.snapshot is not None
        sid = self.store.names().get(row.snapshot)
        if sid is not None and self.store.has_manifest(sid):
            return BuildProgress(language, row.snapshot, "ready", snapshot_id=sid, where="here")
        rec = self._record(row.snapshot)
        if rec is not None and rec.state == "building" and not self._held(row.snapshot):
            rec = None  # its builder is gone (killed): nothing is building it now
        if rec is not None and rec.state == "building":
            return replace(rec, language=language)
        if shared is not None:
            sid = shared.names.get(row.snapshot)
            if sid is not None:
                return BuildProgress(language, row.snapshot, "ready", snapshot_id=sid, where="store")
            other = shared.elsewhere.get(row.snapshot)
            if other is not None and (rec is None or other.state == "building"):
                return replace(other, language=language)
        if rec is not None:
            return replace(rec, language=language)
        return BuildProgress(language, row.snapshot, "missing")

    def statuses(self) -> list[BuildProgress]:
        """Every supported language's state: here, and in the shared store when there is one (unreachable:
        this store's alone, logged)."""
        shared = self.shared_state()
        return [self.status(name, shared) for name in languages.SUPPORTED]

    def shared_state(self) -> SharedState | None:
        """The shared store's names, and the languages being built (or failed) on other replicas."""
        if self.remote is None:
            return None
        try:
            names = self._shared_names()
            elsewhere: dict[str, BuildProgress] = {}
            if self.claims is not None:
                keys = self.claims.keys(f"{CLAIMS}/")
                for snapshot in sorted({k.rsplit("/", 1)[-1].rsplit(".", 1)[0] for k in keys}):
                    found = self._elsewhere(snapshot)
                    if found is not None:
                        elsewhere[snapshot] = found.progress
        except StoreError as exc:
            log.warning(f"the language snapshots in the shared store {self.remote.url} are not known: {exc.message}")
            return None
        return SharedState(names, elsewhere)

    def _shared_names(self) -> dict[str, str]:
        """The shared store's names of language snapshots (-> id). With ``claims`` (objects under the same
        prefix as the store's ``names/``) one listing and a read per language snapshot there, not a read
        of every name the store holds (a fleet's checkpoints may have thousands)."""
        assert self.remote is not None
        wanted = {languages.language(name).snapshot for name in languages.SUPPORTED}
        if self.claims is None:
            return {k: v for k, v in self.remote.names().items() if k in wanted}
        present = {k.rsplit("/", 1)[-1] for k in self.claims.keys("names/")} & wanted
        out: dict[str, str] = {}
        for name in sorted(n for n in present if n is not None):
            with contextlib.suppress(SnapshotNotFound):  # (removed meanwhile)
                out[name] = self.remote.resolve_id(name)
        return out

    def _elsewhere(self, snapshot: str) -> _Seen | None:
        """A build of ``snapshot`` claimed in the shared store (its progress, when it last beat, the claim's
        bytes), or its failure there (younger than ``retry_failed_after_s``); raises StoreError."""
        assert self.claims is not None
        raw, claim = self._get_raw(f"{CLAIMS}/{snapshot}.claim")
        if claim is not None:
            beat = self._get_raw(f"{CLAIMS}/{snapshot}.beat")[1] or claim
            p = BuildProgress(str(beat.get("language", snapshot)), snapshot, "building",
                              step=int(beat.get("step", 0)), steps=int(beat.get("steps", 0)),
                              doing=str(beat.get("doing", "")), since=float(claim.get("since", 0.0)),
                              replica=str(claim.get("replica", "")))
            return _Seen(p, max(float(beat.get("beat", 0.0)), float(claim.get("since", 0.0))), raw)
        failed = self._failed_elsewhere(snapshot)
        return _Seen(failed, failed.since or 0.0, None) if failed is not None else None

    def _failed_elsewhere(self, snapshot: str) -> BuildProgress | None:
        """The failure of ``snapshot``'s build recorded in the shared store, if younger than
        ``retry_failed_after_s``; raises StoreError."""
        failed = self._get_raw(f"{CLAIMS}/{snapshot}.failed")[1]
        if failed is None or time.time() - float(failed.get("since", 0.0)) >= self.retry_failed_after_s:
            return None
        return BuildProgress(str(failed.get("language", snapshot)), snapshot, "failed", error=str(failed.get("error")),
                             since=float(failed.get("since", 0.0)), replica=str(failed.get("replica", "")))

    def _get_raw(self, key: str) -> tuple[bytes | None, dict[str, Any] | None]:
        """The object's bytes and their JSON (None if absent; the JSON None if not an object)."""
        assert self.claims is not None
        raw = self.claims.get(key)
        try:
            out = json.loads(raw) if raw is not None else None
        except ValueError:
            return raw, None
        return raw, out if isinstance(out, dict) else None

    def _put_json(self, key: str, value: dict[str, object], *, replace_it: bool = False) -> bool:
        """Create ``key`` (create-only); ``replace_it``: delete it first (the failure: only the claim's
        creation decides anything)."""
        assert self.claims is not None
        if replace_it:
            self.claims.delete([key])
        return self.claims.put_new(key, json.dumps(value).encode())

    def _claim(self, language: str, snapshot: str) -> _Claim | None:
        """Claim ``snapshot``'s build in the shared store (create-only); None if another replica holds it."""
        assert self.claims is not None
        body = json.dumps({"language": language, "snapshot": snapshot, "replica": self.me,
                           "since": time.time()}).encode()
        return _Claim(snapshot, body) if self.claims.put_new(f"{CLAIMS}/{snapshot}.claim", body) else None

    def _release(self, claim: _Claim, beat: bytes | None = None) -> None:
        """Remove this replica's claim and its last beat, each only if the shared store still holds what this
        replica wrote there: a claim taken over meanwhile (this replica gave no news for CLAIM_STALE_S) is
        the new owner's and stays. A store error is logged (the claim goes stale, and is taken over)."""
        assert self.claims is not None
        try:
            if beat is not None:
                self.claims.delete_own(f"{CLAIMS}/{claim.snapshot}.beat", beat)
            if not self.claims.delete_own(f"{CLAIMS}/{claim.snapshot}.claim", claim.body):
                log.warning(f"the claim on {claim.snapshot} was no longer this replica's (taken over after "
                            f"{CLAIM_STALE_S:.0f} s without news): left to its owner")
        except StoreError as exc:
            log.warning(f"the claim on {claim.snapshot} was not released ({exc.message}); it is taken over once "
                        f"stale ({CLAIM_STALE_S:.0f} s)")

    @contextlib.contextmanager
    def _holding(self, claim: _Claim, latest: list[BuildProgress]) -> Iterator[None]:
        """While the body runs: ``latest[-1]`` (its progress) beaten into the shared store every BEAT_S, as
        long as the claim is still this replica's; then the claim and the beat released."""
        assert self.claims is not None
        claims = self.claims
        beat_key, claim_key = f"{CLAIMS}/{claim.snapshot}.beat", f"{CLAIMS}/{claim.snapshot}.claim"
        last: list[bytes] = []  # the beat in the store, as this replica wrote it
        stop = threading.Event()

        def beat() -> None:
            while True:
                if latest:
                    try:
                        if claims.get(claim_key) != claim.body:
                            log.warning(f"the claim on {claim.snapshot} was taken over by another replica: "
                                        "its progress is no longer reported from here")
                            return
                        body = json.dumps({**latest[-1].as_json(), "beat": time.time()}).encode()
                        if last:
                            claims.delete_own(beat_key, last.pop())
                        else:  # a leftover of the claim's previous owner (the claim is ours)
                            claims.delete([beat_key])
                        if claims.put_new(beat_key, body):
                            last.append(body)
                    except StoreError as exc:
                        log.debug(f"the beat of {claim.snapshot}'s build: {exc.message}")
                if stop.wait(BEAT_S):
                    return

        beater = threading.Thread(target=beat, name=f"rollbox-build-beat-{claim.snapshot}", daemon=True)
        beater.start()
        try:
            yield
        finally:
            stop.set()
            beater.join()
            self._release(claim, last[-1] if last else None)

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
                if self.remote is not None:  # (built before the store was shared: the others get it now)
                    self._publish_logged(language, row.snapshot, done)
                return done
            if self.remote is None:
                return self._build_locked(language, row.snapshot, row.template, on_progress)
            return self._build_shared(language, row.snapshot, row.template, on_progress)
        finally:
            os.close(fd)  # (releases the lock)

    def _build_shared(self, language: str, snapshot: str, template_file: str,
                      on_progress: Callable[[BuildProgress], None] | None) -> Manifest:
        """With a shared store: its snapshot if it names one; else the build this replica claims, or the
        wait for the one another replica claimed (then its snapshot, or its failure)."""
        assert self.remote is not None
        stale_seen = 0
        waiting: str | None = None
        while True:
            try:
                found = self._in_store(snapshot)
                if found is not None:
                    (self.dir / f"{snapshot}.json").unlink(missing_ok=True)
                    log.info(f"{language}: snapshot {snapshot} = {found.id} is in {self.remote.url} (built by "
                             f"{waiting or 'another replica'}): used from there, not built here",
                             extra={"fields": {"language": language}})
                    return found
                if self.claims is None:
                    return self._build_locked(language, snapshot, template_file, on_progress)
                other = self._elsewhere(snapshot)
                if other is not None and other.progress.state == "failed":
                    (self.dir / f"{snapshot}.json").unlink(missing_ok=True)
                    raise SnapshotNotFound(other.progress.describe(), snapshot_id=snapshot)
                mine = self._claim(language, snapshot) if other is None else None
                if mine is not None:
                    found = self._in_store(snapshot)  # (built, pushed and unclaimed since the look above,
                    failed = None if found is not None else self._failed_elsewhere(snapshot)  # or failed)
                    if found is None and failed is None:
                        return self._build_claimed(language, mine, template_file, on_progress)
                    self._release(mine)
                    if failed is not None:
                        (self.dir / f"{snapshot}.json").unlink(missing_ok=True)
                        raise SnapshotNotFound(failed.describe(), snapshot_id=snapshot)
                    assert found is not None
                    return found
            except StoreError as exc:
                log.warning(f"the shared store {self.remote.url} cannot be used ({exc.message}): building "
                            f"{language} on this replica alone", extra={"fields": {"language": language}})
                return self._build_locked(language, snapshot, template_file, on_progress, push=False)
            if other is None:
                time.sleep(0.1)
                continue  # another replica claimed it between the look and the claim: look again
            p, beat = other.progress, other.beat_at
            if waiting is None:
                waiting = p.replica or "another replica"
                log.info(f"waiting for the build of {language} on replica {waiting}",
                         extra={"fields": {"language": language}})
            stale_seen = stale_seen + 1 if time.time() - beat > CLAIM_STALE_S else 0
            if stale_seen >= 2:  # (twice: a beat being rewritten is absent for a moment)
                log.warning(f"the build of {language} on replica {p.replica} gave no news for "
                            f"{time.time() - beat:.0f} s: building it here", extra={"fields": {"language": language}})
                with contextlib.suppress(StoreError):  # that claim, not one another replica took over meanwhile
                    if other.claim is not None and self.claims.delete_own(f"{CLAIMS}/{snapshot}.claim", other.claim):
                        self.claims.delete([f"{CLAIMS}/{snapshot}.beat"])
                stale_seen = 0
                continue
            theirs = replace(p, language=language, pid=os.getpid())
            self._write(theirs)  # this store's status: building (elsewhere) while this process waits
            if on_progress is not None:
                on_progress(theirs)
            time.sleep(POLL_S)

    def _in_store(self, snapshot: str) -> Manifest | None:
        """The shared store's snapshot of that name, if it has one."""
        assert self.remote is not None
        try:
            sid = self.remote.resolve_id(snapshot)
        except SnapshotNotFound:
            return None
        return self.remote.get_manifest(sid)

    def _build_claimed(self, language: str, claim: _Claim, template_file: str,
                       on_progress: Callable[[BuildProgress], None] | None) -> Manifest:
        """The build this replica claimed: its progress beaten into the shared store meanwhile, its failure
        left there for the others, the claim released at the end (after the push)."""
        assert self.claims is not None
        snapshot = claim.snapshot
        failed_key = f"{CLAIMS}/{snapshot}.failed"
        latest: list[BuildProgress] = []
        with self._holding(claim, latest):
            try:
                manifest = self._build_locked(language, snapshot, template_file, on_progress, tap=latest.append)
            except Exception as exc:
                why = exc.message if isinstance(exc, RollboxError) else f"{type(exc).__name__}: {exc}"
                with contextlib.suppress(StoreError):
                    self._put_json(failed_key, {"language": language, "snapshot": snapshot, "replica": self.me,
                                                "since": time.time(), "error": why[-2000:]}, replace_it=True)
                raise
            with contextlib.suppress(StoreError):
                self.claims.delete([failed_key])
        return manifest

    def _push(self, language: str, manifest: Manifest) -> None:
        """Copy the snapshot (its layers the shared store lacks, manifest, name) to the shared store, unless
        it names that snapshot already; a failure is logged (the snapshot is here; the next build pushes)."""
        row = languages.language(language)
        if self.remote is None or row.snapshot is None:
            return
        try:
            if self.remote.names().get(row.snapshot) == manifest.id:
                return
            started = time.time()
            copy_snapshot(self.store, self.remote, row.snapshot, tmp_dir=str(self.store.root / "tmp"))
        except StoreError as exc:
            log.warning(f"{language}: snapshot {manifest.id} was built here but not pushed to {self.remote.url}: "
                        f"{exc.message}", extra={"fields": {"language": language}})
            return
        log.info(f"pushed {language}: snapshot {row.snapshot} = {manifest.id} to {self.remote.url} in "
                 f"{time.time() - started:.0f} s", extra={"fields": {"language": language}})

    # ------------------------------------------------------------------------------ built here, pushed
    def push_built(self, stop: threading.Event | None = None) -> dict[str, str]:
        """With a shared store: every language snapshot this home holds that the store does not name, pushed
        there for the other replicas (a baked image's home has them; replicas started with empty homes then
        pull instead of building). Per snapshot: skipped while a process here builds it (its build pushes),
        else ``_publish``. Returns snapshot -> outcome (``_publish``'s, or "failed": a store error, logged);
        never raises for the store. ``stop`` set: no further snapshot is started."""
        if self.remote is None:
            return {}
        t0 = time.monotonic()
        firsts: dict[str, str] = {}  # snapshot -> the first language that uses it (bash = debian, go = go_test)
        for name in languages.SUPPORTED:
            snapshot = languages.language(name).snapshot
            if snapshot is not None:
                firsts.setdefault(snapshot, name)
        out: dict[str, str] = {}
        for snapshot, language in sorted(firsts.items()):
            if stop is not None and stop.is_set():
                break
            manifest = self._built(snapshot)
            if manifest is None:
                continue
            self.dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.dir / f"{snapshot}.lock", os.O_RDWR | os.O_CREAT, 0o644)
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    out[snapshot] = "building here"
                    continue
                out[snapshot] = self._publish_logged(language, snapshot, manifest)
            finally:
                os.close(fd)  # (releases the lock)
        pushed = sorted(k for k, v in out.items() if v == "pushed")
        log.info(f"language snapshots built here and pushed to {self.remote.url}: {', '.join(pushed) or 'none'} "
                 f"({len(out)} here; {time.monotonic() - t0:.1f} s)",
                 extra={"fields": {"outcomes": out, "store": self.remote.url}})
        return out

    def _publish_logged(self, language: str, snapshot: str, manifest: Manifest) -> str:
        """``_publish``, its store errors logged ("failed"): the snapshot is here, the others build it."""
        assert self.remote is not None
        try:
            return self._publish(language, snapshot, manifest)
        except (RollboxError, OSError) as exc:
            why = exc.message if isinstance(exc, RollboxError) else str(exc)
            log.warning(f"{language}: snapshot {snapshot} = {manifest.id} is here but was not pushed to "
                        f"{self.remote.url}: {why}", extra={"fields": {"language": language}})
            return "failed"

    def _publish(self, language: str, snapshot: str, manifest: Manifest) -> str:
        """Push ``snapshot`` (this home's ``manifest``) to the shared store under a build claim, unless the
        store names it already. Layers the store lacks and the manifest are copied, then the name created
        only if absent (a name another replica made first is left). Returns "there" (the store names this
        id), "named other" (another id: left), "claimed" (another replica builds or pushes it), "pushed".
        The caller holds the snapshot's local lock; raises StoreError."""
        assert self.remote is not None
        remote = self.remote
        named = self._named_there(snapshot)
        if named is not None:
            return "there" if named == manifest.id else "named other"
        claim = self._claim(language, snapshot) if self.claims is not None else None
        if self.claims is not None and claim is None:
            log.info(f"{language}: another replica builds or pushes snapshot {snapshot}: not pushed from here",
                     extra={"fields": {"language": language}})
            return "claimed"
        doing = f"pushing the snapshot built on {self.me} to {remote.url}"
        latest = [BuildProgress(language, snapshot, "building", doing=doing, since=time.time(), pid=os.getpid())]
        with self._holding(claim, latest) if claim is not None else contextlib.nullcontext():
            named = self._named_there(snapshot)  # (landed between the look and the claim)
            if named is not None:
                return "there" if named == manifest.id else "named other"
            started = time.monotonic()
            missing = [ref for ref in manifest.layers if not remote.has_layer(ref.id)]
            log.info(f"pushing {language}: snapshot {snapshot} = {manifest.id} ({len(missing)} of "
                     f"{len(manifest.layers)} layers, {sum(r.size_bytes for r in missing) / 1e6:.0f} MB) to "
                     f"{remote.url}", extra={"fields": {"language": language}})
            copy_snapshot(self.store, remote, manifest.id, tmp_dir=str(self.store.root / "tmp"))
            named = remote.create_name(snapshot, manifest.id)
        if named != manifest.id:
            log.info(f"{language}: snapshot {snapshot} was named {named} in {remote.url} meanwhile: left so "
                     f"({manifest.id} is there unnamed)", extra={"fields": {"language": language}})
            return "named other"
        log.info(f"pushed {language}: snapshot {snapshot} = {manifest.id} to {remote.url} in "
                 f"{time.monotonic() - started:.1f} s", extra={"fields": {"language": language}})
        return "pushed"

    def _named_there(self, snapshot: str) -> str | None:
        """The id the shared store names ``snapshot``, if it names it (one read, not a listing)."""
        assert self.remote is not None
        try:
            return self.remote.resolve_id(snapshot)
        except SnapshotNotFound:
            return None

    def _built(self, snapshot: str) -> Manifest | None:
        sid = self.store.names().get(snapshot)
        if sid is None or not self.store.has_manifest(sid):
            return None
        return self.store.get_manifest(sid)

    def _build_locked(self, language: str, snapshot: str, template_file: str,
                      on_progress: Callable[[BuildProgress], None] | None, *, push: bool = True,
                      tap: Callable[[BuildProgress], None] | None = None) -> Manifest:
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
            if tap is not None:
                tap(p)

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
            if push and self.remote is not None:
                report(replace(p, doing=f"pushing the snapshot to {self.remote.url}"), force_log=True)
                self._push(language, manifest)
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
