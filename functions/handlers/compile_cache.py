"""Compile once: a content-addressed cache of what a language's compile step made.

The key is the language, the toolchain snapshot's id, the compile command (its flags) and the hash of
every file the compile saw (the source, and the request's files, e.g. jars). The value is the compile's
outcome (return code, output) and, when it succeeded, its artifacts (``languages.Language.artifacts``)
as a tar, base64 text: the bytes a sandbox unpacks instead of compiling. A failed compile is kept
too (the same source fails the same way); a compile that timed out or ran out of memory is not (that
depends on the machine's load).

Two levels: an LRU in this process, bounded in bytes, and the snapshot store's object API
(``rollbox.snapshots.state.Objects``: the local store's directory, or S3 shared by every replica),
under ``compiled/<key>.json``. Concurrent requests for one key wait for the first one's compile (one
compile per key per replica at a time). A compile that timed out is not kept, but it is the verdict of
the requests waiting for it then whose own compile timeout is no longer (verl's ten cases of a program
share one compile timeout): they answer its timeout instead of each compiling again, which on an
overloaded machine would multiply the load that made it time out.

Across replicas sharing the store (S3), a compile is claimed there first: the replica that creates
``compiled/<key>.claim`` (a create-only put) compiles; another replica whose cases of that program
arrive meanwhile polls for the outcome (``compiled/<key>.json``, every 50 ms growing to 0.5 s) instead
of compiling it too; if the claim goes away without one (the compile timed out or failed), the waiters
claim it again and one of them compiles. Its replica beats (rewrites ``compiled/<key>.beat``) every
CLAIM_BEAT_S while it holds it, so a claim with no beat for CLAIM_DEAD_S is a dead replica's (killed
mid-compile): the others take over in seconds, not after its whole compile timeout + 30 s, by claiming
it again (one of them compiles). A compile that timed out leaves its verdict there too
(``compiled/<key>.timedout``, written before its claim goes): the replicas that were waiting for it
answer that timeout, as its own replica's waiters do, when their compile timeout is no longer; a
verdict older than a waiter's wait is not its compile's, and later requests compile again.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import socket
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from typing import Any

from rollbox.runtime.errors import RollboxError
from rollbox.snapshots.state import Objects

__all__ = ["MAX_ARTIFACT_BYTES", "CompileCache", "Compiled", "TimedOut", "cache_key"]

log = logging.getLogger("rollbox.compile_cache")
KEY_PREFIX = "compiled/"
CLAIM_GRACE_S = 30.0  # a waiter waits for another replica's compile at most its compile timeout and this
CLAIM_BEAT_S = 2.0  # how often a replica holding a compile claim says it is alive
CLAIM_DEAD_S = 10.0  # a claim with no beat (nor creation) for this long: its replica died
POLL_FIRST_S, POLL_MAX_S = 0.05, 0.5  # how often a replica looks for another's compile
# Artifacts kept only under this size (their tar): its base64 (4/3 of it, 16 MiB) is what the sandbox's agent
# reads back at most for one file (runtime/inside/agent.py MAX_READ_FILE_BYTES); a bigger one came back cut
# short and every cached run of it failed. A compile whose artifacts are not under it is not kept (each run
# compiles).
MAX_ARTIFACT_BYTES = 12 << 20


@dataclass(frozen=True)
class Compiled:
    """A compile's outcome: ``artifacts_b64`` (a base64 tar of the artifacts) when ``return_code`` is 0."""

    return_code: int
    stdout: str
    stderr: str
    wall_s: float
    artifacts_b64: str = ""

    def size(self) -> int:
        return len(self.artifacts_b64) + len(self.stdout) + len(self.stderr) + 200

    def artifact_bytes(self) -> int:
        """The size of the artifacts tar (decoded from its base64)."""
        b64 = self.artifacts_b64
        return len(b64) // 4 * 3 - (b64[-2:].count("=") if b64 else 0)

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> Compiled:
        d = json.loads(data)
        return cls(return_code=int(d["return_code"]), stdout=str(d["stdout"]), stderr=str(d["stderr"]),
                   wall_s=float(d["wall_s"]), artifacts_b64=str(d.get("artifacts_b64", "")))


@dataclass(frozen=True)
class TimedOut:
    """A compile that ran out of its ``timeout_s``: never kept, only handed to the requests waiting for it
    (``CompileCache.once``). ``result``: the compile step as the caller reports it."""

    result: Any
    timeout_s: float


def cache_key(language: str, snapshot_id: str, command: str, files: dict[str, bytes]) -> str:
    """sha256 of the language, the toolchain snapshot id, the compile command and each file's path and hash."""
    h = hashlib.sha256()
    for part in ("rollbox-compile-v2", language, snapshot_id, command):
        h.update(part.encode() + b"\0")
    for path in sorted(files):
        h.update(path.encode() + b"\0" + hashlib.sha256(files[path]).digest())
    return h.hexdigest()


class CompileCache:
    """See the module docstring. ``objects``: the shared store (None: this process only)."""

    def __init__(self, objects: Objects | None = None, max_bytes: int = 256 << 20, *,
                 verdicts: tuple[Callable[[Any], Any], Callable[[Any], Any]] = (lambda r: r, lambda r: r)):
        self.objects = objects
        # a TimedOut's result to JSON and back (the verdict other replicas' waiters answer)
        self.encode_result, self.decode_result = verdicts
        self.max_bytes = max_bytes
        self._lru: OrderedDict[str, Compiled] = OrderedDict()
        self._bytes = 0
        self._inflight: dict[str, asyncio.Future[Compiled | TimedOut | None]] = {}
        self.hits = 0
        self.misses = 0
        self.shared_timeouts = 0  # waiters answered with the timeout of the compile they waited for
        self.from_replicas = 0  # compiles another replica made while this one waited for them
        self.replica = f"{socket.gethostname()}:{os.getpid()}"

    async def get(self, key: str) -> Compiled | None:
        hit = self._lru.get(key)
        if hit is not None:
            self._lru.move_to_end(key)
            return hit
        if self.objects is None:
            return None
        try:
            data = await asyncio.to_thread(self.objects.get, KEY_PREFIX + key + ".json")
            found = Compiled.from_bytes(data) if data is not None else None
        except (RollboxError, ValueError, KeyError, OSError) as exc:  # the store is optional: compile instead
            log.warning("compile cache: reading %s failed: %s", key, exc)
            return None
        if found is not None:
            self._remember(key, found)
        return found

    async def put(self, key: str, value: Compiled) -> None:
        if value.artifact_bytes() >= MAX_ARTIFACT_BYTES:  # (run_code never hands one over: it caps what it reads)
            log.info("compile cache: %s not kept: its artifacts are %d bytes, not under %d", key,
                     value.artifact_bytes(), MAX_ARTIFACT_BYTES)
            return
        self._remember(key, value)
        if self.objects is not None:
            try:
                await asyncio.to_thread(self.objects.put_content, KEY_PREFIX + key + ".json", value.to_bytes())
            except (RollboxError, OSError) as exc:
                log.warning("compile cache: writing %s failed: %s", key, exc)

    def _remember(self, key: str, value: Compiled) -> None:
        if value.size() > self.max_bytes:
            return
        old = self._lru.pop(key, None)
        if old is not None:
            self._bytes -= old.size()
        self._lru[key] = value
        self._bytes += value.size()
        while self._bytes > self.max_bytes and self._lru:
            _, gone = self._lru.popitem(last=False)
            self._bytes -= gone.size()

    async def once(self, key: str,
                   compile_: Callable[[Callable[[Compiled | TimedOut | None], Awaitable[None]]], Awaitable[None]],
                   timeout_s: float = float("inf")) -> tuple[Compiled | TimedOut | None, bool]:
        """The cached outcome for ``key`` and True; else ``compile_(done)`` runs and False is returned
        with what it passed to ``done`` (which keeps a ``Compiled``). ``done`` may be called as soon as
        the compile is over (before the program runs): callers waiting for this key go on from then.
        While one compile of a key runs, other callers wait for it and share it. If it timed out (``done``
        got a ``TimedOut``), the callers waiting then whose ``timeout_s`` (their compile timeout) is at
        most its own get that TimedOut and True; the others, and every caller when it kept nothing (a
        sandbox fault), compile on their own."""
        while True:
            hit = await self.get(key)
            if hit is not None:
                self.hits += 1
                return hit, True
            running = self._inflight.get(key)
            if running is None:
                break
            shared = await asyncio.shield(running)
            if isinstance(shared, TimedOut) and timeout_s <= shared.timeout_s:
                self.shared_timeouts += 1
                return shared, True  # the same source, no more time: it would time out again
            if shared is None or isinstance(shared, TimedOut):
                break  # that compile kept nothing: compile this one (not waiting in turn for a twin)
        fut: asyncio.Future[Compiled | TimedOut | None] = asyncio.get_running_loop().create_future()
        mine = key not in self._inflight
        if mine:
            self._inflight[key] = fut
        claim: tuple[str, bytes] | None = None  # (its key, the bytes this replica wrote there)
        if mine and self.objects is not None:  # another replica's compile of it, or the claim to make it here
            try:
                other = await self._claim_or_wait(key, timeout_s)
            except BaseException:  # cancelled (the server's grace period over): its waiters here are let go
                self._inflight.pop(key, None)
                fut.set_result(None)
                raise
            if isinstance(other, Compiled | TimedOut):
                self._inflight.pop(key, None)
                fut.set_result(other)  # (this replica's waiters judge a timeout by their own compile timeout)
                self.from_replicas += 1
                if isinstance(other, TimedOut):
                    self.shared_timeouts += 1
                else:
                    self.hits += 1
                return other, True
            claim = other
        beat: tuple[asyncio.Event, asyncio.Task[None], list[bytes]] | None = None
        if claim is not None:
            stop, last = asyncio.Event(), list[bytes]()
            beat = stop, asyncio.create_task(self._beat(claim[0], stop, last)), last
        self.misses += 1
        got: list[Compiled | TimedOut | None] = []

        async def done(value: Compiled | TimedOut | None) -> None:
            if got:
                return
            got.append(value)
            if isinstance(value, Compiled):
                await self.put(key, value)
            elif isinstance(value, TimedOut) and claim is not None:  # (before the claim goes, as an outcome)
                await self._put_verdict(key, value)
            if beat is not None:  # (its last write over before the claim goes: no beat outlives it)
                beat[0].set()
                await beat[1]
            if claim is not None and self.objects is not None:  # (after the put: a waiter sees the outcome first)
                try:  # each only if still this replica's: a claim taken over meanwhile is the new owner's
                    if beat is not None and beat[2]:
                        await asyncio.to_thread(self.objects.delete_own, _beat_key(claim[0]), beat[2][-1])
                    await asyncio.to_thread(self.objects.delete_own, *claim)
                except (RollboxError, OSError) as exc:
                    log.warning("compile cache: removing the claim %s failed: %s", claim[0], exc)
            if mine:
                self._inflight.pop(key, None)
                if not fut.done():
                    fut.set_result(value)

        try:
            await compile_(done)
        finally:
            if not got:
                await done(None)
        return got[0], False

    async def _beat(self, claim: str, stop: asyncio.Event, last: list[bytes]) -> None:
        """While this replica holds ``claim``: its beat rewritten every CLAIM_BEAT_S (a failed write is
        retried at the next); ``last`` ends with the beat as this replica last wrote it."""
        assert self.objects is not None
        objects, key = self.objects, _beat_key(claim)
        while True:
            try:
                await asyncio.wait_for(stop.wait(), CLAIM_BEAT_S)
                return
            except TimeoutError:
                pass
            body = json.dumps({"replica": self.replica, "beat": time.time()}).encode()
            try:
                if last:
                    await asyncio.to_thread(objects.delete_own, key, last[-1])
                else:  # (a dead holder's, left when its claim was taken over)
                    await asyncio.to_thread(objects.delete, [key])
                if await asyncio.to_thread(objects.put_new, key, body):
                    last[:] = [body]
            except (RollboxError, OSError) as exc:
                log.debug("compile cache: the beat of %s: %s", claim, exc)

    async def _put_verdict(self, key: str, value: TimedOut) -> None:
        """The timeout of this replica's claimed compile, for the other replicas waiting for it."""
        assert self.objects is not None
        try:
            body = json.dumps({"replica": self.replica, "at": time.time(), "timeout_s": value.timeout_s,
                               "result": self.encode_result(value.result)}).encode()
            await asyncio.to_thread(self.objects.put_content, KEY_PREFIX + key + ".timedout", body)
        except (RollboxError, OSError, TypeError, ValueError) as exc:  # its waiters then compile, as before
            log.warning("compile cache: writing the timeout of %s failed: %s", key, exc)

    async def _verdict(self, key: str, since: float) -> TimedOut | None:
        """The timeout verdict of ``key``'s compile, if one ended after ``since`` (time.time())."""
        assert self.objects is not None
        raw = await asyncio.to_thread(self.objects.get, KEY_PREFIX + key + ".timedout")
        if raw is None:
            return None
        d = json.loads(raw)
        if float(d["at"]) < since:
            return None
        return TimedOut(self.decode_result(d["result"]), float(d["timeout_s"]))

    async def _claim_or_wait(self, key: str, timeout_s: float) -> Compiled | TimedOut | tuple[str, bytes] | None:
        """Claim ``key``'s compile in the shared store (returns the claim's key and bytes: compile it here), or wait
        for the replica that claimed it: its outcome (a Compiled, or a TimedOut when that compile timed out and
        ``timeout_s`` is no longer than its own: it would time out again); when that replica died or its claim went
        without an outcome (a timeout, a fault, or another waiter taking a dead replica's claim over), claim
        it again (one of the replicas waiting for it compiles, the others wait for that one). None: compile
        here, unclaimed (waited too long; a store that fails: the store is optional)."""
        assert self.objects is not None
        objects = self.objects
        claim = KEY_PREFIX + key + ".claim"
        limit = min(timeout_s, 3600.0)
        t0 = time.monotonic()
        waiting_since = time.time()
        try:
            while True:
                body = json.dumps({"replica": self.replica, "token": uuid.uuid4().hex, "since": time.time(),
                                   "timeout_s": limit}).encode()
                if await asyncio.to_thread(objects.put_new, claim, body):
                    found = await self.get(key)  # (made and unclaimed since this replica last looked)
                    if found is None:
                        return claim, body
                    await asyncio.to_thread(objects.delete_own, claim, body)
                    return found
                outcome = await self._wait_for_claim(key, claim, t0, limit, waiting_since)
                if isinstance(outcome, TimedOut):
                    if timeout_s <= outcome.timeout_s:
                        return outcome
                    continue  # more time than that compile had: claim it, compile here
                if outcome not in ("dead", "gone") or time.monotonic() - t0 > limit + CLAIM_GRACE_S:
                    return outcome if isinstance(outcome, Compiled) else None
        except (RollboxError, OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("compile cache: claiming %s failed: %s", key, exc)
            return None

    async def _wait_for_claim(self, key: str, claim: str, t0: float, limit: float,
                              since: float) -> Compiled | TimedOut | str | None:
        """Poll another replica's ``claim``: its outcome (its timeout, when it timed out after ``since``);
        "dead" once its replica stopped beating (the claim removed then); "gone" once the claim went without
        an outcome (it may be claimed again at once: a waiter that took a dead replica's claim over deletes
        it, then claims); None once this replica waited its ``limit`` + grace."""
        assert self.objects is not None
        objects = self.objects
        pause = POLL_FIRST_S
        newest = 0.0  # the latest beat seen (a beat being rewritten is absent for a moment)
        while True:
            raw = await asyncio.to_thread(objects.get, claim)  # (the claim first: its outcome is put before
            found = await self.get(key)                       # it goes)
            if found is not None:
                return found
            if raw is None:
                return await self._verdict(key, since) or "gone"
            other = json.loads(raw)
            beat_raw = await asyncio.to_thread(objects.get, _beat_key(claim))
            newest = max(newest, float(json.loads(beat_raw)["beat"]) if beat_raw else 0.0)
            last = max(float(other["since"]), newest)
            if time.time() - last > CLAIM_DEAD_S:
                log.warning("compile cache: the claim of %s by %s has no beat for %.0f s: claiming it here", key,
                            other["replica"], time.time() - last)
                # that claim only, not one made since by another waiter
                if await asyncio.to_thread(objects.delete_own, claim, raw):
                    await asyncio.to_thread(objects.delete, [_beat_key(claim)])
                return "dead"
            if time.monotonic() - t0 > limit + CLAIM_GRACE_S:
                return None
            await asyncio.sleep(pause)
            pause = min(pause * 1.5, POLL_MAX_S)

def _beat_key(claim: str) -> str:
    return claim.removesuffix(".claim") + ".beat"
