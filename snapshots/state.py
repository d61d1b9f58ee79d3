"""Durable sandbox state: what a sandbox is between two steps, kept in the snapshot store.

A sandbox's state after each acknowledged step is one record, written once and never changed::

    sandboxes/<sandbox id>/<generation, 10 digits>.json    one per acknowledged step
    blobs/<sha256>                                          file contents over INLINE_MAX_BYTES

A record holds the sandbox's files as a diff over its snapshot (the overlay upper directory: entries
with modes and mtimes, whiteouts, opaque directories; each file's content by sha256), its limits and
metadata, its usage so far, the events it has acknowledged (event key -> the generation whose record
holds that event's reply) and the reply of the step that made it. Small file contents travel inline,
in the record of the generation that first wrote them (``g`` in the file's entry says which); larger
ones are content-addressed blobs, uploaded once.

Generation n is created with a create-only write (S3 ``If-None-Match: *``; locally a hard link,
which fails if the name exists), so two replicas never both commit step n: the loser learns it and
changes nothing. A replica that holds a sandbox live checks that generation n+1 does not exist before
it runs a step on generation n (another replica may have moved it on).

Two backends with the same four calls: ``LocalObjects`` (a directory; the embedded default) and
``rollbox.snapshots.store_s3.S3Objects`` (any S3-compatible store).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import time
from collections.abc import Awaitable, Callable, Generator
from pathlib import Path
from typing import Annotated, Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, PlainSerializer, PlainValidator
from rollbox.runtime import jsonio
from rollbox.runtime.errors import IntegrityError, StoreError
from rollbox.runtime.inside.proto import Diff, DiffEntry, Kind
from rollbox.runtime.spec import Limits
from rollbox.runtime.upper import UpperTooLarge, upper_diff, walk_upper

__all__ = [
    "INLINE_MAX_BYTES",
    "SMALL_SCAN",
    "FileHashes",
    "Files",
    "LocalObjects",
    "Objects",
    "SandboxRecord",
    "StepUsage",
    "UpperTooLarge",
    "blob_key",
    "check_content",
    "diff_of",
    "generation_of",
    "place_contents",
    "prefill_hashes",
    "record_key",
    "scan_upper",
]

INLINE_MAX_BYTES = 64 * 1024  # a file up to this size travels inside the record that changed it
MAX_INLINE_GENERATIONS = 8  # past this many older records holding inline contents, re-inline them
RECORD_VERSION = 1
REFRESH_AFTER_S = 86400.0  # a reused blob older than this is rewritten (the blobs/ expiry has a day to spare)


class Objects(Protocol):
    """Where durable state lives: a directory or an S3 prefix."""

    url: str

    def put_new(self, key: str, data: bytes) -> bool:
        """Create ``key`` with ``data`` unless it exists; False if it does (another writer was first)."""

    def get(self, key: str) -> bytes | None: ...

    def put_content(self, key: str, data: bytes, *, refresh_after_s: float = REFRESH_AFTER_S) -> None:
        """A content-addressed object (its key names its content): create it if absent; if present and
        written more than ``refresh_after_s`` ago, rewrite it in place, so that an expiry rule counts
        its age from this new reference and not from the first one."""

    def keys(self, prefix: str) -> list[str]:
        """Keys under ``prefix``, sorted."""

    def listing(self, prefix: str, after: str | None = None, before: str | None = None) -> list[tuple[str, float]]:
        """Keys under ``prefix``, sorted, each with when it was last written (Unix time); only those
        after ``after`` and before ``before`` when given (a range of them: what the sweep lists a round)."""

    def delete(self, keys: list[str]) -> None: ...

    def delete_own(self, key: str, body: bytes) -> bool:
        """Delete ``key`` only if it still holds ``body`` (what this writer put there: a claim another
        writer took over since is theirs, and stays); True if it was deleted, False if it held something
        else or was absent."""

    def requests_sent(self) -> dict[str, int]:
        """Requests sent to a remote store so far, by operation (S3's: GetObject, PutObject, ...); none
        for a directory."""


def in_key_range(key: str, after: str | None, before: str | None) -> bool:
    """Whether ``key`` is in the range (after, before) an ``Objects.listing`` is asked for (None: no bound)."""
    return (after is None or key > after) and (before is None or key < before)


def _may_hold(under: str, after: str | None, before: str | None) -> bool:
    """Whether keys starting with ``under`` may fall in the range (after, before)."""
    if before is not None and under >= before:
        return False
    # every key under it is below after when after neither starts with it nor sorts before it
    return after is None or after.startswith(under) or under > after


class LocalObjects:
    """``Objects`` in a local directory. A create-only write is a fsync'd temporary file hard-linked
    to its name (link fails if the name exists), then the directory fsync'd: after the call returns
    the object survives a crash of the process and of the machine."""

    def __init__(self, root: str | os.PathLike[str]):
        self.root = Path(root)
        self.url = str(self.root)
        self.root.mkdir(parents=True, exist_ok=True)

    def _path(self, key: str) -> Path:
        return Path(self._file(key))

    def _file(self, key: str) -> str:
        """The key's file, as a string (the commit and read of every step: no Path objects)."""
        if not key or key.startswith("/") or ".." in key.split("/"):
            raise StoreError(f"invalid state key {key!r}")
        return f"{self.url}/{key}"

    def put_new(self, key: str, data: bytes) -> bool:
        steps = self._put_new(key, data)
        try:
            fd = next(steps)
            while True:
                try:
                    os.fsync(fd)
                except OSError as exc:
                    steps.throw(exc)  # its clean-up runs, then the exception comes back here
                    raise
                fd = steps.send(None)
        except StopIteration as done:
            return bool(done.value)
        except OSError as exc:
            raise StoreError(f"cannot write {self._file(key)}: {exc}") from exc

    async def put_new_synced(self, key: str, data: bytes, synced: Callable[[int], Awaitable[None]]) -> bool:
        """``put_new`` with its two disk syncs awaited through ``synced`` instead of made in this
        thread (the event loop, which syncs through Linux AIO: no thread hand-off per commit). The same
        writes in the same order; a caller that stops waiting leaves no temporary file behind."""
        steps = self._put_new(key, data)
        try:
            fd = next(steps)
            while True:
                try:
                    await synced(fd)
                except BaseException as exc:
                    steps.throw(exc)  # its clean-up runs, then the exception comes back here
                    raise
                fd = steps.send(None)
        except StopIteration as done:
            return bool(done.value)
        except OSError as exc:
            raise StoreError(f"cannot write {self._file(key)}: {exc}") from exc

    def _put_new(self, key: str, data: bytes) -> Generator[int, None, bool]:
        """The create-only write, yielding each fd that must reach the disk before it goes on: the
        temporary file's (before it is linked to its name), then the directory's (the link)."""
        path = self._file(key)
        parent, name = path.rsplit("/", 1)
        try:
            os.mkdir(parent)
        except FileExistsError:
            pass
        except FileNotFoundError:
            os.makedirs(parent, exist_ok=True)
        tmp = f"{parent}/.{name}.{os.getpid()}.{time.monotonic_ns()}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            try:
                os.write(fd, data)
                yield fd
            finally:
                os.close(fd)
        except BaseException:
            os.unlink(tmp)
            raise
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
        finally:
            os.unlink(tmp)
        dfd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            yield dfd
        finally:
            os.close(dfd)
        return True

    def put_content(self, key: str, data: bytes, *, refresh_after_s: float = REFRESH_AFTER_S) -> None:
        self.put_new(key, data)  # a local directory has no expiry rules

    def get(self, key: str) -> bytes | None:
        path = self._file(key)
        try:
            with open(path, "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise StoreError(f"cannot read {path}: {exc}") from exc

    def keys(self, prefix: str, after: str | None = None, before: str | None = None) -> list[str]:
        base = self._path(prefix.rstrip("/") or ".") if prefix.strip("/") else self.root
        if not base.is_dir():
            return []
        out: list[str] = []
        for dirpath, dirs, files in os.walk(base):
            rel = os.path.relpath(dirpath, self.root)
            under = f"{rel}/" if rel != "." else ""
            if after is not None or before is not None:  # a range: only the directories that may hold some
                dirs[:] = [d for d in dirs if _may_hold(f"{under}{d}/", after, before)]
                keys = (f"{under}{f}" for f in files if not f.startswith("."))
                out.extend(k for k in keys if in_key_range(k, after, before))
            else:
                out.extend(f"{under}{f}" for f in files if not f.startswith("."))
        return sorted(out)

    def listing(self, prefix: str, after: str | None = None, before: str | None = None) -> list[tuple[str, float]]:
        out: list[tuple[str, float]] = []
        for key in self.keys(prefix, after, before):
            with contextlib.suppress(FileNotFoundError):  # (removed since: not listed)
                out.append((key, os.stat(self._file(key)).st_mtime))
        return out

    def delete(self, keys: list[str]) -> None:
        parents = set()
        for key in keys:
            path = self._path(key)
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            parents.add(path.parent)
        for d in parents:  # a sandbox's directory goes with its last record
            with contextlib.suppress(OSError):
                if d != self.root:
                    d.rmdir()

    def delete_own(self, key: str, body: bytes) -> bool:
        """Read, compare, unlink. Not atomic: a writer that replaces the file between the read and the
        unlink loses its object (the claims that use it are created only while the key is absent, so
        that needs a takeover in that window)."""
        path = self._file(key)
        try:
            with open(path, "rb") as f:
                if f.read() != body:
                    return False
            os.unlink(path)
        except FileNotFoundError:
            return False
        except OSError as exc:
            raise StoreError(f"cannot delete {path}: {exc}") from exc
        return True

    def requests_sent(self) -> dict[str, int]:
        return {}  # files, not requests


def record_key(sandbox_id: str, generation: int) -> str:
    return f"sandboxes/{sandbox_id}/{generation:010d}.json"


def generation_of(key: str) -> int | None:
    """The generation a ``record_key`` names (``sandboxes/<id>/<n>.json``); None for another key."""
    parts = key.split("/")
    if len(parts) != 3 or parts[0] != "sandboxes" or not parts[2].endswith(".json"):
        return None
    digits = parts[2].removesuffix(".json")
    return int(digits) if digits.isdigit() else None


def blob_key(sha: str) -> str:
    return f"blobs/{sha}"


def _parse_entries(value: Any) -> list[DiffEntry]:
    if not isinstance(value, list):
        raise ValueError("entries must be a list")
    return [e if isinstance(e, DiffEntry) else DiffEntry.parse(e) for e in value]


Entries = Annotated[list[DiffEntry], PlainValidator(_parse_entries),
                    PlainSerializer(lambda entries: [e.wire() for e in entries])]


class Files(BaseModel):
    """A sandbox's files as a diff over its snapshot (``upper_diff``'s entries), each file's content
    by sha256 (``DiffEntry.sha``; ``generation``: the generation whose record holds it inline, None:
    a blob). Stored in the entries' compact wire form (``DiffEntry.wire``)."""

    model_config = ConfigDict(extra="forbid")

    entries: Entries = Field(default_factory=list)
    whiteouts: list[str] = Field(default_factory=list)
    opaque: list[str] = Field(default_factory=list)


class StepUsage(BaseModel):
    """What the sandbox used so far, over all its lives on any replica (hibernated time excluded)."""

    model_config = ConfigDict(extra="forbid")

    live_s: float = 0.0
    cpu_s: float = 0.0
    peak_memory_bytes: int = 0
    execs: int = 0


class SandboxRecord(BaseModel):
    """One acknowledged generation of a sandbox (see the module docstring)."""

    model_config = ConfigDict(extra="forbid")

    version: int = RECORD_VERSION
    sandbox_id: str
    generation: int
    state: Literal["live", "destroyed"] = "live"
    reason: str | None = Field(default=None, description="why it was destroyed: destroyed, idle, lifetime")
    snapshot: str
    limits: Limits
    metadata: dict[str, str] = Field(default_factory=dict)
    forked_from: str | None = None
    created_at: float = Field(description="Unix time the sandbox was created")
    last_used: float = Field(description="Unix time of its last step")
    usage: StepUsage = Field(default_factory=StepUsage)
    files: Files = Field(default_factory=Files)
    inline: dict[str, bytes] = Field(default_factory=dict, exclude=True,
                                     description="sha256 -> content new here (stored raw after the JSON)")
    events: dict[str, list[Any]] = Field(default_factory=dict,
                                         description="event key -> [generation holding its reply, fingerprint]")
    reply: dict[str, Any] | None = Field(default=None, description="the reply of the event that made it")
    writer: str = Field(default="", description="the replica that committed it")

    def to_bytes(self) -> bytes:
        """The record as stored: its JSON, a newline, then the inline contents raw, one after another
        (the JSON's ``inline_index`` gives each one's sha256, offset and length)."""
        index, offset = [], 0
        for sha, data in self.inline.items():
            index.append([sha, offset, len(data)])
            offset += len(data)
        head = self.model_dump(mode="json")
        head["inline_index"] = index
        return jsonio.dumps(head) + b"\n" + b"".join(self.inline.values())

    @classmethod
    def from_bytes(cls, data: bytes, key: str) -> SandboxRecord:
        try:
            cut = data.index(b"\n")
            head = jsonio.loads(data[:cut])
            raw = memoryview(data)[cut + 1:]
            index = head.pop("inline_index", [])
            record = cls.model_validate(head)
            record.inline = {sha: check_content(sha, bytes(raw[o:o + n]), key) for sha, o, n in index}
            return record
        except (ValueError, TypeError) as exc:
            raise IntegrityError(f"sandbox state {key} is not a valid record: {str(exc)[:300]}") from None

    def expired(self, now: float) -> str | None:
        """Why this sandbox may not run another step at Unix time ``now``: lifetime, idle, or None."""
        if now - self.created_at > self.limits.lifetime_s:
            return "lifetime"
        if now - self.last_used > self.limits.idle_s:
            return "idle"
        return None


FileHashes = dict[tuple[str, int, int, int, int], str]
"""(path, inode, size, mtime ns, ctime ns) -> sha256: files unchanged since the last scan are not read."""


SMALL_SCAN = (256, 256 * 1024)
"""(entries, bytes to read) that ``scan_upper(..., small=True)`` takes on: a scan that small costs the
event loop less than its round trip through a thread (whose hand-offs of the GIL the loop pays)."""


def scan_upper(upper: str, hashes: FileHashes, small: bool = False) -> tuple[Files, dict[str, str]]:
    """The files of a sandbox's upper directory (``upper_diff``, each content by sha256), and the host
    path of each content (sha256 -> path). ``hashes`` is updated in place (files unchanged since the
    last scan are not read again). ``small``: UpperTooLarge, with ``hashes`` untouched, if it holds
    more than ``SMALL_SCAN`` allows (entries, or bytes of contents to read)."""
    paths: dict[str, str] = {}
    fresh: FileHashes = {}
    to_read = SMALL_SCAN[1] if small else -1

    def hashed(entry: DiffEntry, st: os.stat_result, host_path: str) -> bool:
        nonlocal to_read
        ident = (entry.path, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        sha = hashes.get(ident)
        if sha is None:
            if to_read >= 0:
                to_read -= st.st_size
                if to_read < 0:
                    raise UpperTooLarge(f"{upper} holds more than {SMALL_SCAN[1]} bytes of new contents")
            sha = _sha256_file(host_path)
        fresh[ident] = sha
        paths.setdefault(sha, host_path)
        entry.sha, entry.size = sha, st.st_size
        return True

    diff = upper_diff(upper, hashed, SMALL_SCAN[0] if small else None)
    assert diff is not None  # ``hashed`` never gives up
    hashes.clear()
    hashes.update(fresh)
    return Files(entries=diff.entries, whiteouts=diff.whiteouts, opaque=diff.opaque), paths


def prefill_hashes(upper: str, files: Files, hashes: FileHashes, limit: int | None = None) -> None:
    """After ``files`` were injected into ``upper``: know their hashes without reading them (a file
    whose size matches the record is the one injected; nothing else ran in the sandbox yet). It reads
    no contents: one stat per entry. ``limit``: UpperTooLarge, ``hashes`` untouched, past that many."""
    want = {e.path: e for e in files.entries if e.kind == Kind.FILE}
    found = {}
    for path, kind, st, _host in walk_upper(upper, limit):
        e = want.get(path)
        if kind == "f" and e is not None and e.size == st.st_size:
            found[(path, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)] = e.sha
    hashes.update(found)


def place_contents(files: Files, previous: SandboxRecord | None, generation: int,
                   paths: dict[str, str]) -> tuple[dict[str, bytes], dict[str, str]]:
    """Decide where each file content of a new generation lives and set each file entry's ``g``.
    Contents the previous generation already placed keep their place (inline in an older record, or
    a blob); new small ones go inline in this record; new large ones are blobs. If the inline
    contents would be spread over more than MAX_INLINE_GENERATIONS older records, they are all
    re-inlined here (so a resume reads few records). Returns (inline: sha -> content for this record,
    blobs to upload: sha -> host path)."""
    where: dict[str, int | None] = {}
    if previous is not None:
        where = {e.sha: e.generation for e in previous.files.entries if e.kind == Kind.FILE}
    older = {where[e.sha] for e in files.entries if e.kind == Kind.FILE and where.get(e.sha) is not None}
    reinline = len(older) > MAX_INLINE_GENERATIONS
    inline: dict[str, bytes] = {}
    blobs: dict[str, str] = {}
    for e in files.entries:
        if e.kind != Kind.FILE:
            continue
        sha = e.sha
        e.generation = None
        if sha in inline:
            e.generation = generation
        elif sha in where and not (reinline and where[sha] is not None):
            if where[sha] is not None:
                e.generation = where[sha]
        elif e.size <= INLINE_MAX_BYTES:
            inline[sha] = _read(paths[sha], sha)
            e.generation = generation
        else:
            blobs[sha] = paths[sha]
    return inline, blobs


def diff_of(files: Files, contents: dict[str, bytes]) -> Diff:
    """The diff a sandbox's agent applies (``Runtime.inject``): the entries with offsets into a memfd
    that holds every file's content (``contents``: sha256 -> bytes). The caller closes ``fd``."""
    fd = os.memfd_create("rollbox-resume", os.MFD_CLOEXEC)
    entries: list[DiffEntry] = []
    offsets: dict[str, tuple[int, int]] = {}
    offset = 0
    try:
        for e in files.entries:
            if e.kind != Kind.FILE:
                entries.append(DiffEntry(e.path, e.kind, e.mode, e.mtime, link=e.link))
                continue
            sha = e.sha
            if sha not in offsets:
                data = contents[sha]
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
                offsets[sha] = (offset, len(data))
                offset += len(data)
            o, n = offsets[sha]
            entries.append(DiffEntry(e.path, Kind.FILE, e.mode, e.mtime, size=n, offset=o))
    except BaseException:
        os.close(fd)
        raise
    return Diff(entries, list(files.whiteouts), list(files.opaque), fd)


def check_content(sha: str, data: bytes, where: str) -> bytes:
    got = hashlib.sha256(data).hexdigest()
    if got != sha:
        raise IntegrityError(f"{where}: content hashes to {got}, expected {sha}; it was not used")
    return data


def _read(path: str, sha: str) -> bytes:
    with open(path, "rb") as f:
        data = f.read()
    if hashlib.sha256(data).hexdigest() != sha:  # changed since the scan (a writer outside the freeze)
        raise OSError(errno.EAGAIN, f"{path} changed while it was read")
    return data


def _sha256_file(path: str) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            sha.update(chunk)
    return sha.hexdigest()
