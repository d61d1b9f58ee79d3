"""Tenants cannot hurt each other, and a timeout holds: the same load at concurrency 32, all
well-behaved vs with 20 % misbehaving code, side by side in one run, on both paths (one-shot ``run``
events and the ``exec`` steps of episodes) and both transports (an in-process Runtime, and real
CloudEvents over HTTP to a real ``rollbox serve``) — issues 9 and 25.

    .venv/bin/python loadtest/bench_fairness.py                   # ~5 minutes: 4 combinations
    .venv/bin/python loadtest/bench_fairness.py --duration-s 6    # a quick check
    .venv/bin/python loadtest/bench_fairness.py --paths run --transports http --kinds 'fork bomb'

The HTTP server is ``rollbox serve`` with its defaults (durability step: every exec step is committed
to its local store before the reply; recording on) but ``--log-level warning``, started by this
script on a free port with a home of its own and stopped by pid; the client sends binary-mode
CloudEvents built by the cloudevents SDK, one keep-alive connection per worker.

For each combination (path x transport):
- alone: each misbehaving kind once, by itself (no other load from this script), and how late its
  reply came;
- then ``--slices`` rounds of two phases of ``--duration-s / --slices`` each, one after the other
  (so drift on a shared machine hits both alike): all ``--concurrency`` workers well-behaved, then
  ``--bad-share`` of them misbehaving. A well-behaved run or step computes for ~20 ms (an ``exec``
  worker plays episodes: create, ``--steps`` steps, destroy). The misbehaving kinds, in turn, each
  with a ``--timeout-s`` timeout: a fork bomb, a memory hog, endless output, a sleep forever, a
  ``while True: pass`` CPU spinner, and a shell command that starts three background
  ``yes > /dev/null`` (and waits for them).

Reported: the well-behaved replies' p50 / p99 / max (as the client waited: through HTTP, reply
included), and for the misbehaving ones how long after its deadline a timed-out reply came (wall -
timeout: p99, max) and how often a sandbox was lost (an exec step: its sandbox gone after the timeout;
a run: an error reply instead of a result). Targets (the exit status is 1 if one is missed, on any
combination): well-behaved p99 with misbehavers <= 2x without, overshoot p99 <= 0.5 s alone and under
load, sandboxes lost < 1 %.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import bench_service
import httpx
from cloudevents.conversion import to_binary
from cloudevents.http import CloudEvent, from_http
from rollbox.runtime.errors import RollboxError
from rollbox.runtime.runtime import Runtime, RuntimeConfig
from rollbox.runtime.spec import ExecRequest, ExecResult

GOOD: dict[str, Any] = {"code": "print(sum(i * i for i in range(200_000)))"}
BAD: dict[str, dict[str, Any]] = {
    "fork bomb": {"code": "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"},
    "memory hog": {"code": "x = []\nwhile True: x.append(bytearray(1 << 20))\n"},
    "endless output": {"code": "import sys\nwhile True: sys.stdout.write('y' * 65536)\n"},
    "sleep": {"code": "import time\ntime.sleep(3600)\n"},
    "cpu spinner": {"code": "while True: pass\n"},
    "background spinners": {"command": "yes > /dev/null & yes > /dev/null & yes > /dev/null & wait"},
}
KINDS = list(BAD)  # the kinds played (--kinds)
GOOD_TIMEOUT_S = 30.0
CE = "dev.rollbox.sandbox."


@dataclass
class Outcome:
    """A reply as the bench judges it: a result (``ok``) with its exit, or an error."""

    ok: bool
    exit_code: int = -1
    timed_out: bool = False
    alive: bool = True  # exec: the sandbox lives on after the step
    error: str = ""

    @classmethod
    def of(cls, r: ExecResult | dict[str, Any], step: bool = True) -> Outcome:
        """``step``: an exec step, whose sandbox should live on (a one-shot run's ends with it)."""
        d = r.model_dump() if isinstance(r, ExecResult) else r
        return cls(True, int(d["exit_code"]), bool(d["timed_out"]), not step or bool(d.get("sandbox_alive")))


class Session:
    """One worker's way to the runtime (an HTTP session has a connection of its own)."""

    async def run(self, body: dict[str, Any]) -> Outcome: ...
    async def create(self) -> str: ...
    async def exec(self, sandbox_id: str, body: dict[str, Any]) -> Outcome: ...
    async def destroy(self, sandbox_id: str) -> None: ...
    async def close(self) -> None: ...


class InProcess(Session):
    def __init__(self, rt: Runtime):
        self.rt = rt

    async def run(self, body: dict[str, Any]) -> Outcome:
        try:
            return Outcome.of(await self.rt.run(ExecRequest(**body)), step=False)
        except RollboxError as exc:
            return Outcome(False, error=f"{type(exc).__name__}: {exc}")

    async def create(self) -> str:
        return (await self.rt.create()).sandbox_id

    async def exec(self, sandbox_id: str, body: dict[str, Any]) -> Outcome:
        try:
            return Outcome.of(await self.rt.exec(sandbox_id, ExecRequest(**body)))
        except RollboxError as exc:
            return Outcome(False, alive=False, error=f"{type(exc).__name__}: {exc}")

    async def destroy(self, sandbox_id: str) -> None:
        await self.rt.destroy(sandbox_id)


class OverHTTP(Session):
    """Binary-mode CloudEvents built by the cloudevents SDK, one keep-alive connection per worker."""

    def __init__(self, url: str):
        self.url = url
        self.http = httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=1))

    async def send(self, kind: str, data: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        ev = CloudEvent({"type": CE + kind, "source": "/loadtest/fairness", "id": uuid.uuid4().hex,
                         "datacontenttype": "application/json"}, data)
        headers, body = to_binary(ev)
        resp = await self.http.post(self.url, headers=dict(headers), content=body)
        reply = from_http(dict(resp.headers), resp.content)
        return resp.status_code, reply.data if isinstance(reply.data, dict) else {"message": str(reply.data)}

    async def run(self, body: dict[str, Any]) -> Outcome:
        status, data = await self.send("run", body)
        return Outcome.of(data, step=False) if status == 200 else Outcome(False, error=f"{status} {data.get('message')}")

    async def create(self) -> str:
        status, data = await self.send("create", {"snapshot": "python"})
        if status != 200:
            raise RuntimeError(f"create: {status} {data.get('message')}")
        return str(data["sandbox_id"])

    async def exec(self, sandbox_id: str, body: dict[str, Any]) -> Outcome:
        status, data = await self.send("exec", {"sandbox_id": sandbox_id, **body})
        if status != 200:
            return Outcome(False, alive=False, error=f"{status} {data.get('message')}")
        return Outcome.of(data)

    async def destroy(self, sandbox_id: str) -> None:
        await self.send("destroy", {"sandbox_id": sandbox_id})

    async def close(self) -> None:
        await self.http.aclose()


@dataclass
class Phase:
    name: str
    good_s: list[float] = field(default_factory=list)
    good_failed: int = 0
    overshoot_s: list[float] = field(default_factory=list)  # timed-out misbehaving replies: wall - timeout
    bad_n: int = 0
    lost: int = 0
    kind_n: dict[str, int] = field(default_factory=dict)
    other_ends: dict[str, list[str]] = field(default_factory=dict)  # kind -> how the not timed-out ones ended
    by_kind: dict[str, list[float]] = field(default_factory=dict)  # kind -> overshoots of the timed-out
    errors: list[str] = field(default_factory=list)

    def bad(self, kind: str, o: Outcome, wall: float, timeout_s: float) -> None:
        self.bad_n += 1
        self.kind_n[kind] = self.kind_n.get(kind, 0) + 1
        self.by_kind.setdefault(kind, [])
        if not o.ok or not o.alive:
            self.lost += 1
            if o.error:
                self.errors.append(f"{kind}: {o.error}")
        if o.ok and o.timed_out:
            self.overshoot_s.append(wall - timeout_s)
            self.by_kind[kind].append(wall - timeout_s)
        else:
            self.other_ends.setdefault(kind, []).append(f"exit {o.exit_code}" if o.ok else "error")

    def good(self, o: Outcome, wall: float) -> None:
        if o.ok and o.exit_code == 0:
            self.good_s.append(wall)
        else:
            self.good_failed += 1
            if o.error:
                self.errors.append(f"well-behaved: {o.error}")

    def merge(self, other: Phase) -> None:
        self.good_s += other.good_s
        self.good_failed += other.good_failed
        self.overshoot_s += other.overshoot_s
        self.bad_n += other.bad_n
        self.lost += other.lost
        self.errors += other.errors
        for k, v in other.by_kind.items():
            self.by_kind.setdefault(k, []).extend(v)
            self.kind_n[k] = self.kind_n.get(k, 0) + other.kind_n[k]
        for k, ends in other.other_ends.items():
            self.other_ends.setdefault(k, []).extend(ends)


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q / 100 * (len(xs) - 1)))]


async def timed(fn: Callable[[], Awaitable[Outcome]]) -> tuple[Outcome, float]:
    t0 = time.monotonic()
    o = await fn()
    return o, time.monotonic() - t0


async def alone(session: Session, path: str, timeout_s: float) -> Phase:
    """Each misbehaving kind once, by itself."""
    out = Phase("alone")
    for kind in KINDS:
        req = {**BAD[kind], "timeout_s": timeout_s}
        if path == "run":
            o, wall = await timed(lambda req=req: session.run(req))  # type: ignore[misc]
        else:
            sid = await session.create()
            try:
                o, wall = await timed(lambda sid=sid, req=req: session.exec(sid, req))  # type: ignore[misc]
            finally:
                await session.destroy(sid)
        out.bad(kind, o, wall, timeout_s)
        await asyncio.sleep(0.5)  # its teardown is not the next one's
    return out


async def phase(sessions: list[Session], path: str, name: str, duration_s: float, bad_share: float, steps: int,
                timeout_s: float) -> Phase:
    out = Phase(name)
    end = time.monotonic() + duration_s
    kinds = itertools.cycle(KINDS)

    async def one(kind: str | None, call: Callable[[dict[str, Any]], Awaitable[Outcome]]) -> Outcome:
        body = {**(BAD[kind] if kind else GOOD), "timeout_s": timeout_s if kind else GOOD_TIMEOUT_S}
        o, wall = await timed(lambda: call(body))
        if kind is None:
            out.good(o, wall)
        else:
            out.bad(kind, o, wall, timeout_s)
        return o

    async def episode(s: Session, kind: str | None) -> None:
        sid = await s.create()
        try:
            for _ in range(steps):
                if time.monotonic() >= end:
                    return
                o = await one(kind, lambda body: s.exec(sid, body))
                if not o.alive:
                    return
        finally:
            await s.destroy(sid)

    async def worker(s: Session, bad: bool) -> None:
        while time.monotonic() < end:
            kind = next(kinds) if bad else None
            if path == "run":
                await one(kind, s.run)
            else:
                await episode(s, kind)

    n_bad = round(len(sessions) * bad_share)  # these workers misbehave, the rest are well-behaved
    await asyncio.gather(*(worker(s, i < n_bad) for i, s in enumerate(sessions)))
    return out


@dataclass
class Combo:
    path: str
    transport: str
    alone: Phase
    clean: Phase
    mixed: Phase
    note: str = ""
    pairs: list[float] = field(default_factory=list)  # each slice's mixed p99 / the clean slice's before it

    @property
    def name(self) -> str:
        return f"{self.path} {self.transport}"

    def checks(self) -> list[tuple[str, bool]]:
        ratio = pct(self.mixed.good_s, 99) / pct(self.clean.good_s, 99)
        alone = pct(self.alone.overshoot_s, 99) if self.alone.overshoot_s else 0.0
        loaded = pct(self.mixed.overshoot_s, 99) if self.mixed.overshoot_s else 0.0
        bad_n = self.alone.bad_n + self.mixed.bad_n
        lost = (self.alone.lost + self.mixed.lost) / bad_n if bad_n else 0.0
        fails = self.clean.good_failed + self.mixed.good_failed
        return [(f"{self.name}: well-behaved p99 with / without misbehavers {ratio:.2f}x", ratio <= 2.0),
                (f"{self.name}: timeout overshoot p99 alone {alone:.3f} s", alone <= 0.5),
                (f"{self.name}: timeout overshoot p99 under load {loaded:.3f} s", loaded <= 0.5),
                (f"{self.name}: sandboxes lost {100 * lost:.2f} %", lost < 0.01),
                (f"{self.name}: well-behaved failures {fails}", fails == 0)]


async def measure(sessions: list[Session], path: str, transport: str, args: argparse.Namespace,
                  settle: Callable[[], Awaitable[None]]) -> Combo:
    print(f"... {path} {transport}", file=sys.stderr, flush=True)
    solo = await alone(sessions[0], path, args.timeout_s) if args.alone else Phase("alone")
    await settle()
    clean, mixed = Phase("well-behaved"), Phase(f"{args.bad_share:.0%} misbehaving")
    part = args.duration_s / args.slices
    pairs = []
    for _ in range(args.slices):
        a = await phase(sessions, path, clean.name, part, 0.0, args.steps, args.timeout_s)
        b = await phase(sessions, path, mixed.name, part, args.bad_share, args.steps, args.timeout_s)
        await settle()  # the last misbehavers' teardown is not the next clean slice's
        clean.merge(a)
        mixed.merge(b)
        if a.good_s and b.good_s:
            pairs.append(pct(b.good_s, 99) / pct(a.good_s, 99))
    return Combo(path, transport, solo, clean, mixed, pairs=pairs)


async def in_process(args: argparse.Namespace) -> list[Combo]:
    state = Path(tempfile.mkdtemp(prefix="rollbox-bench-fairness-"))
    rt = Runtime(RuntimeConfig(state_dir=state, cgroup_parent=f"rollbox-bench-{os.getpid()}"))
    await rt.start()
    combos = []
    try:
        await rt.prewarm(count=4)

        async def settle() -> None:
            for _ in range(100):  # until the killed sandboxes are gone (at most 5 s)
                if not rt.sandboxes and not rt.cgroups.releasing:
                    break
                await asyncio.sleep(0.05)

        sessions: list[Session] = [InProcess(rt) for _ in range(args.concurrency)]
        for path in args.paths:
            combos.append(await measure(sessions, path, "in-process", args, settle))
        report = rt.isolation_report()
        for c in combos:
            c.note = f"cgroups: {report['cgroups']}; cpu: {report['cpu']}"
    finally:
        await rt.close()
        shutil.rmtree(state, ignore_errors=True)
    return combos


async def over_http(args: argparse.Namespace) -> list[Combo]:
    tmp = Path(tempfile.mkdtemp(prefix="rollbox-bench-fairness-http-"))
    proc, url = bench_service.start(tmp / "serve.log", ["--home", str(tmp / "home"), "--log-level", "warning",
                                                        *args.serve_arg])
    combos = []
    sessions: list[Session] = [OverHTTP(url) for _ in range(args.concurrency)]
    try:
        await asyncio.gather(*(s.run({"code": "print(1)"}) for s in sessions[:8]))  # warm: zygote, pool

        async def settle() -> None:
            await asyncio.sleep(2.0)

        for path in args.paths:
            combos.append(await measure(sessions, path, "http", args, settle))
    finally:
        for s in sessions:
            await s.close()
        rc = bench_service.stop(proc)
        tail = (tmp / "serve.log").read_text(errors="replace").splitlines()
        shutil.rmtree(tmp, ignore_errors=True)
    for c in combos:
        c.note = f"rollbox serve --log-level warning {' '.join(args.serve_arg)} (exit status {rc})"
    if rc != 0:
        print("server log (last lines):", *tail[-20:], sep="\n", file=sys.stderr)
    return combos


def _ends(ends: list[str]) -> str:
    return f" ({', '.join(f'{e} x{ends.count(e)}' for e in dict.fromkeys(ends))})" if ends else ""


def table(combos: list[Combo]) -> list[str]:
    head = ["path", "transport", "phase", "good n", "failed", "good p50 s", "good p99 s", "good max s", "bad n",
            "overshoot p99 s", "overshoot max s", "lost"]
    rows = [head]
    for c in combos:
        for p in (c.alone, c.clean, c.mixed):
            good = p.good_s
            over = p.overshoot_s
            rows.append([c.path, c.transport, p.name, str(len(good)) if p is not c.alone else "-",
                         str(p.good_failed) if p is not c.alone else "-",
                         f"{statistics.median(good):.3f}" if good else "-", f"{pct(good, 99):.3f}" if good else "-",
                         f"{max(good):.3f}" if good else "-", str(p.bad_n) if p.bad_n else "-",
                         f"{pct(over, 99):.3f}" if over else "-", f"{max(over):.3f}" if over else "-",
                         f"{p.lost}/{p.bad_n}" if p.bad_n else "-"])
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    return ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]


async def main(args: argparse.Namespace) -> int:
    t0 = time.monotonic()
    load0 = os.getloadavg()[0]
    combos: list[Combo] = []
    if "in-process" in args.transports:
        combos += await in_process(args)
    if "http" in args.transports:
        combos += await over_http(args)

    print(f"concurrency {args.concurrency}, {args.duration_s:g} s per phase in {args.slices} slices, "
          f"{args.bad_share:.0%} misbehaving, {args.steps} steps per episode, misbehaving timeout "
          f"{args.timeout_s:g} s, {os.cpu_count()} cores; load average {load0:.1f} at the start, "
          f"{os.getloadavg()[0]:.1f} at the end; {time.monotonic() - t0:.0f} s in all")
    for note in dict.fromkeys(c.note for c in combos):
        print(note)
    print(*table(combos), sep="\n")
    for c in combos:
        for p in (c.alone, c.mixed):
            print(f"{c.name}, {p.name}: by kind (timed out/n, overshoot max s; how the others ended): " + ", ".join(
                f"{k} {len(v)}/{p.kind_n[k]} {max(v, default=0.0):.3f}" + _ends(p.other_ends.get(k, []))
                for k, v in p.by_kind.items()))
        if c.pairs:
            print(f"{c.name}: well-behaved p99 with / without misbehavers, slice by slice: "
                  + " ".join(f"{r:.2f}x" for r in c.pairs) + f" (median {statistics.median(c.pairs):.2f}x)")
        errors = c.alone.errors + c.clean.errors + c.mixed.errors
        for e in dict.fromkeys(errors):
            print(f"{c.name}: error x{errors.count(e)}: {e[:200]}")
    checks = [chk for c in combos for chk in c.checks()]
    for text, ok in checks:
        print(f"{'met    ' if ok else 'NOT met'} {text}")
    return 0 if all(ok for _, ok in checks) else 1


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration-s", type=float, default=20.0, help="length of each phase (default 20)")
    ap.add_argument("--slices", type=int, default=4, help="each phase in this many alternating slices (default 4)")
    ap.add_argument("-c", "--concurrency", type=int, default=32, help="workers at once (default 32)")
    ap.add_argument("--bad-share", type=float, default=0.2, help="share of workers misbehaving (default 0.2)")
    ap.add_argument("--steps", type=int, default=3, help="exec path: steps per episode (default 3)")
    ap.add_argument("--timeout-s", type=float, default=3.0, help="misbehaving requests' timeout (default 3)")
    ap.add_argument("--paths", nargs="+", choices=("run", "exec"), default=["run", "exec"])
    ap.add_argument("--transports", nargs="+", choices=("in-process", "http"), default=["in-process", "http"])
    ap.add_argument("--kinds", nargs="+", choices=list(BAD), default=list(BAD), metavar="KIND",
                    help=f"misbehaving kinds played (default all: {', '.join(repr(k) for k in BAD)})")
    ap.add_argument("--alone", action=argparse.BooleanOptionalAction, default=True,
                    help="measure each kind alone first (default on)")
    ap.add_argument("--serve-arg", action="append", default=[], help="an extra argument for rollbox serve")
    parsed = ap.parse_args()
    KINDS[:] = parsed.kinds
    sys.exit(asyncio.run(main(parsed)))
