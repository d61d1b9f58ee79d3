"""``rollbox replay EPISODE [--experiment E] [--from STEP]``: re-run an episode's recorded actions and compare.

Each sandbox of the episode is made again the way it was made: one ``create``d is restored from the
snapshot its first step ran on, with its recorded limits; a fork's children are forked again from
the replayed parent at the same point of its steps (a fork of a snapshot: created from it), in the
embedded runtime on this machine (the snapshot comes from the store, as for ``rollbox run``); a
one-shot ``run`` is a sandbox of one step. Its exec steps run again in order, each with its recorded
code or command, stdin, files, environment and timeout; per step the report says whether the exit
code, stdout and the files read back are identical to the recorded ones, and shows the first
difference. ``--from N`` reports from step N on (the steps before it still run, silently: they make
the state step N ran on). A recorded step that cannot be replayed — its sandbox's create or fork is
not among the episode's steps (made under other labels, or before recording), or the fork failed
now — is listed as not replayed, with the reason.

Exit status: 0 every step replayed and identical, 1 some differ or were not replayed, 2 nothing to
replay or an error. Processes do not carry over between durable steps that resumed on another
replica; a step whose recorded reply says ``resumed`` is replayed on a sandbox whose earlier
processes are still running, which matters only for programs that left background processes behind.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollbox.functions.analysis.trajectories import add_store_arguments, episode_rows, store_of
from rollbox.functions.contract.models import SANDBOX_CREATE, SANDBOX_EXEC, SANDBOX_FORK, SANDBOX_RUN
from rollbox.runtime.errors import InvalidRequest, RollboxError
from rollbox.runtime.spec import ExecRequest, ExecResult

__all__ = ["Plan", "StepReplay", "add_parser", "plan", "replay"]


@dataclass
class StepReplay:
    sandbox: str
    step: int | None
    event_id: str
    same: bool
    differences: list[str] = field(default_factory=list)
    replayed: bool = True  # False: not run again (``differences`` says why)


@dataclass
class Plan:
    """An episode's acknowledged steps (status 200), arranged for replay: ``roots`` are the rows that
    made a sandbox from a snapshot (create, run, a fork of a snapshot) in time order; ``steps`` the
    exec and fork rows of each recorded sandbox id in the order they ran; ``orphans`` exec rows whose
    sandbox was made by no row here."""

    roots: list[dict[str, Any]]
    steps: dict[str, list[dict[str, Any]]]
    orphans: list[dict[str, Any]]


def children(fork_row: dict[str, Any]) -> list[str]:
    """The sandbox ids a recorded fork made (its row's ``labels``)."""
    try:
        made = json.loads(fork_row["labels"] or "{}").get("children") or []
    except (ValueError, AttributeError):
        return []
    return [c for c in made if isinstance(c, str)]


def plan(rows: Iterable[dict[str, Any]]) -> Plan:
    ok = sorted((r for r in rows if r["status"] == 200), key=lambda r: (r["event_time"], r["step"] or 0))
    roots: list[dict[str, Any]] = []
    steps: dict[str, list[dict[str, Any]]] = {}
    for r in ok:
        kind, sid = r["event_type"], r["sandbox_id"]
        if kind in (SANDBOX_CREATE, SANDBOX_RUN) or (kind == SANDBOX_FORK and sid is None):
            roots.append(r)
        elif kind in (SANDBOX_EXEC, SANDBOX_FORK) and sid is not None:
            steps.setdefault(sid, []).append(r)
    # the sandboxes replay makes: the roots' own, and the children of their forks (and theirs)
    todo = [c for r in roots for c in (children(r) if r["event_type"] == SANDBOX_FORK else [r["sandbox_id"]])]
    made: set[str] = set()
    while todo:
        sid = todo.pop()
        if sid not in made:
            made.add(sid)
            todo += [c for r in steps.get(sid, []) if r["event_type"] == SANDBOX_FORK for c in children(r)]
    orphans = [r for sid, rs in steps.items() if sid not in made for r in rs if r["event_type"] == SANDBOX_EXEC]
    return Plan(roots, steps, orphans)


def _request(r: dict[str, Any]) -> ExecRequest:
    return ExecRequest(code=r["code"], command=r["command"], stdin=r["stdin"],
                       files=json.loads(r["files_in_text"]) if r["files_in_text"] else {},
                       read_files=list(r["read_files"] or []), env=json.loads(r["env"]) if r["env"] else {},
                       timeout_s=r["timeout_s"] or 30.0)


def compare(recorded: dict[str, Any], now: ExecResult) -> list[str]:
    diffs = []
    if recorded["exit_code"] != now.exit_code:
        diffs.append(f"exit code: recorded {recorded['exit_code']}, now {now.exit_code}")
    if (recorded["stdout"] or "") != now.stdout:
        diffs.append("stdout: " + _first_difference(recorded["stdout"] or "", now.stdout))
    files_then = json.loads(recorded["files_out_text"]) if recorded["files_out_text"] else {}
    if files_then != (now.files or {}):
        for path in sorted(set(files_then) | set(now.files)):
            a, b = files_then.get(path), now.files.get(path)
            if a != b:
                diffs.append(f"file {path}: " + ("absent now" if b is None else "absent then" if a is None
                                                 else _first_difference(a, b)))
    return diffs


def _first_difference(a: str, b: str) -> str:
    la, lb = a.splitlines(), b.splitlines()
    for i in range(max(len(la), len(lb))):
        x = la[i] if i < len(la) else "<end>"
        y = lb[i] if i < len(lb) else "<end>"
        if x != y:
            return f"line {i + 1}: recorded {x[:200]!r}, now {y[:200]!r}"
    return "differs in line endings"


def not_made(row: dict[str, Any]) -> str:
    """Why an exec row of the episode is not replayed: nothing in the episode made its sandbox."""
    parent = f" (it was forked from {row['forked_from']}, whose steps are not replayed here)" \
        if row["forked_from"] else ""
    return ("not replayed: its sandbox's create or fork is not among this episode's recorded steps (made under "
            f"another experiment or episode label, or before recording){parent}")


async def replay(rows: list[dict[str, Any]], rt: Any, from_step: int = 0) -> list[StepReplay]:
    """Replay ``plan(rows)`` on the runtime ``rt`` (``rollbox.runtime.runtime.Runtime``)."""
    p = plan(rows)
    results: list[StepReplay] = []

    def skipped(sid: str, why: str) -> None:
        """Every exec step of ``sid`` and of the sandboxes it forked, as not replayed."""
        for r in p.steps.get(sid, []):
            if r["event_type"] == SANDBOX_EXEC:
                results.append(StepReplay(sid, r["step"], r["event_id"], False, [why], replayed=False))
            else:
                for child in children(r):
                    skipped(child, why)

    async def sandbox(recorded: str, live: str) -> None:
        """Run the recorded steps of ``recorded`` in the replayed sandbox ``live``, then destroy it."""
        try:
            for r in p.steps.get(recorded, []):
                if r["event_type"] == SANDBOX_EXEC:
                    try:
                        now = await rt.exec(live, _request(r))
                    except RollboxError as exc:
                        diffs = [f"failed now: {exc.message}"]
                    else:
                        diffs = compare(r, now)
                    if (r["step"] or 0) >= from_step:
                        results.append(StepReplay(recorded, r["step"], r["event_id"], not diffs, diffs))
                    continue
                made = children(r)  # a fork of this sandbox, at this point of its steps
                try:
                    infos = await rt.fork(live, len(made)) if made else []
                except RollboxError as exc:
                    for child in made:
                        skipped(child, f"not replayed: forking {recorded} failed now: {exc.message}")
                    continue
                for child, info in zip(made, infos, strict=True):
                    await sandbox(child, info.sandbox_id)
        finally:
            with contextlib.suppress(RollboxError):  # (it may have died or expired meanwhile)
                await rt.destroy(live)

    for origin in p.roots:
        limits = json.loads(origin["limits"]) if origin["limits"] else None
        snapshot = origin["snapshot_id"]
        if origin["event_type"] == SANDBOX_RUN:
            try:
                now = await rt.run(_request(origin), snapshot=snapshot, limits=limits)
            except RollboxError as exc:
                diffs = [f"failed now: {exc.message}"]
            else:
                diffs = compare(origin, now)
            results.append(StepReplay(origin["sandbox_id"], None, origin["event_id"], not diffs, diffs))
        elif origin["event_type"] == SANDBOX_CREATE:
            info = await rt.create(snapshot, limits)
            await sandbox(origin["sandbox_id"], info.sandbox_id)
        else:  # a fork of a snapshot: each child created from it (the fork's limits are not recorded)
            for child in children(origin):
                info = await rt.create(snapshot, None)
                await sandbox(child, info.sandbox_id)
    for r in p.orphans:
        results.append(StepReplay(r["sandbox_id"], r["step"], r["event_id"], False, [not_made(r)], replayed=False))
    return results


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("replay", help="re-run an episode's recorded steps and report what differs",
                              description=__doc__.splitlines()[0] if __doc__ else None)
    add_store_arguments(p)
    p.add_argument("episode")
    p.add_argument("--from", dest="from_step", type=int, default=0, metavar="STEP",
                   help="report from this step (the sandbox's generation) on; earlier ones still run")
    p.add_argument("--json", action="store_true", help="one JSON object per step")
    p.set_defaults(func=cmd_replay)


def cmd_replay(args: argparse.Namespace) -> int:
    from rollbox.functions.config.stores import StoreConfig, open_store
    from rollbox.runtime.runtime import Runtime, RuntimeConfig

    try:
        rows = episode_rows(store_of(args), args.episode, args.experiment, home=args.home).to_pylist()
        planned = plan(rows)
        if not planned.roots and not planned.orphans:
            raise InvalidRequest(f"no replayable steps of episode {args.episode!r} (a create, run or fork with "
                                 "status 200, or an exec)")

        async def go() -> list[StepReplay]:
            cfg = StoreConfig(home=Path(args.home) if args.home else None, store=args.store,
                              s3_endpoint_url=args.s3_endpoint_url, s3_region=args.s3_region,
                              aws_profile=args.aws_profile)
            resolver = open_store(cfg)
            async with Runtime(RuntimeConfig(layer_root=Path(resolver.layer_root)), resolver=resolver) as rt:
                return await replay(rows, rt, args.from_step)

        results = asyncio.run(go())
    except RollboxError as exc:
        print(f"rollbox replay: {exc.message}", file=sys.stderr)
        return 2
    for res in results:
        if args.json:
            print(json.dumps(res.__dict__))
            continue
        where = f"{res.sandbox} step {res.step}" if res.step is not None else f"{res.sandbox} (run)"
        verdict = "same        " if res.same else "DIFFERENT   " if res.replayed else "NOT REPLAYED"
        print(f"{verdict}  {where}  event {res.event_id}")
        for d in res.differences:
            print(f"    {d}")
    differ = sum(not r.same and r.replayed for r in results)
    missed = sum(not r.replayed for r in results)
    if not args.json:
        print(f"{len(results) - differ - missed} of {len(results)} steps identical"
              + (f", {differ} different" if differ else "") + (f", {missed} not replayed" if missed else ""))
    return 1 if differ or missed else 0
