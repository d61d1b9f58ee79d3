"""``rollbox replay EPISODE [--from STEP]``: re-run an episode's recorded actions and compare.

Each sandbox of the episode (in the order it was created; a one-shot ``run`` is a sandbox of one step)
is restored again from the snapshot its first step ran on, with its recorded limits, in the embedded
runtime on this machine (the snapshot comes from the store, as for ``rollbox run``). Its exec steps
run again in order, each with its recorded code or command, stdin, files, environment and timeout;
per step the report says whether the exit code, stdout and the files read back are identical to the
recorded ones, and shows the first difference. ``--from N`` reports from step N on (the steps
before it still run, silently: they make the state step N ran on).

Exit status: 0 every compared step identical, 1 some differ, 2 nothing to replay or an error.
Processes do not carry over between durable steps that resumed on another replica; a step whose
recorded reply says ``resumed`` is replayed on a sandbox whose earlier processes are still running,
which matters only for programs that left background processes behind.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollbox.functions.contract import SANDBOX_CREATE, SANDBOX_EXEC, SANDBOX_RUN
from rollbox.functions.trajectories import add_store_arguments, read, store_of
from rollbox.runtime.errors import InvalidRequest, RollboxError
from rollbox.runtime.spec import ExecRequest, ExecResult

__all__ = ["StepReplay", "add_parser", "plan", "replay"]


@dataclass
class StepReplay:
    sandbox: str
    step: int | None
    event_id: str
    same: bool
    differences: list[str] = field(default_factory=list)


def plan(rows: list[dict[str, Any]]) -> list[tuple[dict[str, Any], list[dict[str, Any]]]]:
    """The episode's sandboxes in order: (the row that made it, its exec rows in step order). Only
    acknowledged steps (status 200) are replayed."""
    rows = sorted((r for r in rows if r["status"] == 200), key=lambda r: (r["event_time"], r["step"] or 0))
    out: list[tuple[dict[str, Any], list[dict[str, Any]]]] = []
    by_sid: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        if r["event_type"] == SANDBOX_CREATE:
            execs: list[dict[str, Any]] = []
            by_sid[r["sandbox_id"]] = execs
            out.append((r, execs))
        elif r["event_type"] == SANDBOX_RUN:
            out.append((r, [r]))
        elif r["event_type"] == SANDBOX_EXEC and r["sandbox_id"] in by_sid:
            by_sid[r["sandbox_id"]].append(r)
    for _, execs in out:
        execs.sort(key=lambda r: (r["step"] or 0, r["event_time"]))
    return out


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


async def replay(rows: list[dict[str, Any]], rt: Any, from_step: int = 0) -> list[StepReplay]:
    """Replay ``plan(rows)`` on the runtime ``rt`` (``rollbox.runtime.runtime.Runtime``)."""
    results: list[StepReplay] = []
    for origin, execs in plan(rows):
        limits = json.loads(origin["limits"]) if origin["limits"] else None
        snapshot = origin["snapshot_id"]
        if origin["event_type"] == SANDBOX_RUN:
            r = origin
            now = await rt.run(_request(r), snapshot=snapshot, limits=limits)
            diffs = compare(r, now)
            results.append(StepReplay(r["sandbox_id"], None, r["event_id"], not diffs, diffs))
            continue
        info = await rt.create(snapshot, limits)
        try:
            for r in execs:
                now = await rt.exec(info.sandbox_id, _request(r))
                if (r["step"] or 0) >= from_step:
                    diffs = compare(r, now)
                    results.append(StepReplay(origin["sandbox_id"], r["step"], r["event_id"], not diffs, diffs))
        finally:
            await rt.destroy(info.sandbox_id)
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
    from rollbox.functions.stores import StoreConfig, open_store
    from rollbox.runtime.runtime import Runtime, RuntimeConfig

    try:
        table = read("trajectories", store_of(args), experiment=args.experiment, episode=args.episode)
        rows = table.to_pylist()
        if not plan(rows):
            raise InvalidRequest(f"no replayable steps of episode {args.episode!r} (a create or run with status 200)")

        async def go() -> list[StepReplay]:
            cfg = StoreConfig(home=Path(args.home) if args.home else None, store=args.store,
                              s3_endpoint_url=args.s3_endpoint_url, s3_region=args.s3_region)
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
        print(f"{'same     ' if res.same else 'DIFFERENT'}  {where}  event {res.event_id}")
        for d in res.differences:
            print(f"    {d}")
    differ = sum(not r.same for r in results)
    if not args.json:
        print(f"{len(results) - differ} of {len(results)} steps identical")
    return 1 if differ else 0
