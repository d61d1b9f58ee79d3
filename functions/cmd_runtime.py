"""``rollbox run`` and ``rollbox doctor``: the runtime from the command line."""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

from rollbox.functions.envflags import env_default, env_float, env_int

MiB = 1024 * 1024


def add_parsers(sub: Any) -> None:
    p = sub.add_parser("run", help="run code or a command in one fresh sandbox and pass its output through")
    p.add_argument("--snapshot", default=env_default("ROLLBOX_SNAPSHOT", "python"),
                   help="snapshot name or id (env ROLLBOX_SNAPSHOT; default python)")
    p.add_argument("--timeout-s", type=float, default=env_float("ROLLBOX_TIMEOUT_S", 30.0),
                   help="wall-clock limit for the run (env ROLLBOX_TIMEOUT_S; default 30)")
    p.add_argument("--memory-mb", type=int, default=env_int("ROLLBOX_MEMORY_MB", 512),
                   help="memory limit in MiB (env ROLLBOX_MEMORY_MB; default 512)")
    p.add_argument("--json", action="store_true", help="print the whole result record as JSON")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--code", help="Python source, run as __main__ in the warm interpreter")
    what.add_argument("--command", help="a shell command")
    what.add_argument("file", nargs="?", help="a Python file to run ('-' for standard input)")
    p.set_defaults(func=cmd_run)

    d = sub.add_parser("doctor", help="show which isolation layers are active on this host, and why not")
    d.set_defaults(func=cmd_doctor)


def cmd_run(args: argparse.Namespace) -> int:
    from rollbox.runtime.errors import RollboxError
    from rollbox.runtime.runtime import Runtime
    from rollbox.runtime.spec import ExecRequest, ExecResult, Limits

    if args.file is not None:
        with sys.stdin if args.file == "-" else open(args.file) as f:
            code: str | None = f.read()
    else:
        code = args.code
    try:
        req = ExecRequest(code=code, command=args.command if code is None else None, timeout_s=args.timeout_s)
        limits = Limits(memory_max_bytes=args.memory_mb * MiB, lifetime_s=max(900.0, args.timeout_s + 60))
    except ValueError as exc:
        print(f"rollbox run: {exc}", file=sys.stderr)
        return 2

    async def go() -> ExecResult:
        async with Runtime() as rt:
            return await rt.run(req, snapshot=args.snapshot, limits=limits)

    try:
        res = asyncio.run(go())
    except RollboxError as exc:
        print(f"rollbox run: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(res.model_dump_json(indent=2))
    else:
        sys.stdout.write(res.stdout)
        sys.stdout.flush()
        sys.stderr.write(res.stderr)
        notes = []
        if res.timed_out:
            notes.append(f"timed out after {args.timeout_s} s")
        if res.oom_killed:
            notes.append("killed: out of memory")
        if res.pids_limit_hit:
            notes.append("hit the process limit")
        if res.stdout_truncated or res.stderr_truncated:
            notes.append("output truncated")
        if notes:
            print(f"rollbox: {', '.join(notes)} (exit {res.exit_code})", file=sys.stderr)
    return res.exit_code


def cmd_doctor(args: argparse.Namespace) -> int:
    from rollbox.runtime.doctor import diagnose

    ok, lines = asyncio.run(diagnose())
    for line in lines:
        print(line)
    return 0 if ok else 1


__all__ = ["add_parsers"]
