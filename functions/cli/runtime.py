"""``rollbox run`` and ``rollbox doctor``: the runtime from the command line.

Both use the home directory ``--home`` / ROLLBOX_HOME (default /var/lib/rollbox as root, else
~/.local/share/rollbox): its local store resolves the snapshot names, so a ``python`` built into it
(``rollbox snapshot build``) is what ``run`` restores; ``doctor`` prints which home is in use, and what
``python`` names there.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rollbox.functions.config.options import (
    ConfigError,
    Option,
    add_options,
    integer,
    path,
    resolve_options,
    seconds,
    text,
)
from rollbox.runtime.errors import RollboxError

MiB = 1024 * 1024
RUN_OPTIONS: tuple[Option, ...] = (
    Option("snapshot", "--snapshot", "ROLLBOX_SNAPSHOT", text, "python", "snapshot name or id"),
    Option("timeout_s", "--timeout-s", "ROLLBOX_TIMEOUT_S", seconds, 30.0, "wall-clock limit for the run"),
    Option("memory_mb", "--memory-mb", "ROLLBOX_MEMORY_MB", integer(16), None,
           "memory limit in MiB (unset: the snapshot's own)"),
    Option("home", "--home", "ROLLBOX_HOME", path, None,
           "state directory and local snapshot store (unset: /var/lib/rollbox as root, else ~/.local/share/rollbox)"),
)


def limit_overrides(opts: dict[str, Any], snapshot_lifetime_s: float) -> dict[str, Any]:
    """Only the limits the user asked for, to merge over the snapshot's own defaults (a snapshot that
    declares 1 GiB keeps it unless --memory-mb says otherwise); the lifetime grows only if the
    run's timeout would not fit in it."""
    out: dict[str, Any] = {}
    if opts.get("memory_mb") is not None:
        out["memory_max_bytes"] = opts["memory_mb"] * MiB
    if opts["timeout_s"] > snapshot_lifetime_s:
        out["lifetime_s"] = opts["timeout_s"] + 60
    return out


def add_parser(sub: Any) -> None:
    p = sub.add_parser("run", help="run code or a command in one fresh sandbox and pass its output through")
    add_options(p, RUN_OPTIONS)
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
    from rollbox.runtime.spec import ExecRequest, ExecResult

    try:
        opts = resolve_options(RUN_OPTIONS, args, os.environ)
    except ConfigError as exc:
        print(f"rollbox run: {exc}", file=sys.stderr)
        return 2
    if args.file is not None:
        try:
            with sys.stdin if args.file == "-" else open(args.file) as f:
                code: str | None = f.read()
        except (OSError, UnicodeDecodeError) as exc:
            print(f"rollbox run: cannot read {args.file}: {getattr(exc, 'strerror', None) or exc}", file=sys.stderr)
            return 2
    else:
        code = args.code
    try:
        req = ExecRequest(code=code, command=args.command if code is None else None, timeout_s=opts['timeout_s'])
    except ValueError as exc:
        print(f"rollbox run: {exc}", file=sys.stderr)
        return 2

    from rollbox.functions.config.stores import StoreConfig, open_store
    from rollbox.runtime.runtime import RuntimeConfig, default_home

    home = opts["home"] or default_home()

    async def go() -> ExecResult:
        resolver = open_store(StoreConfig(home=home))
        async with Runtime(RuntimeConfig(state_dir=home, layer_root=Path(resolver.layer_root)),
                           resolver=resolver) as rt:
            view = await rt.resolve(opts['snapshot'])
            return await rt.run(req, snapshot=view.id, limits=limit_overrides(opts, view.limits.lifetime_s))

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
            notes.append(f"timed out after {opts['timeout_s']} s")
        if res.oom_killed:
            notes.append("killed: out of memory")
        if res.pids_limit_hit:
            notes.append("hit the process limit")
        if res.stdout_truncated or res.stderr_truncated:
            notes.append("output truncated")
        if notes:
            print(f"rollbox: {', '.join(notes)} (exit {res.exit_code})", file=sys.stderr)
    return res.exit_code


def home_line(environ: Mapping[str, str] = os.environ) -> str:
    """Which home is in use, where that choice came from, and what ``python`` names in its store."""
    from rollbox.runtime.runtime import default_home
    from rollbox.snapshots.store_local import LocalStore

    home = default_home()
    origin = ("from ROLLBOX_HOME" if environ.get("ROLLBOX_HOME") else
              "the default: shared by every rollbox command, server and checkout on this machine that sets no "
              "--home / ROLLBOX_HOME")
    try:
        built = LocalStore(home).names().get("python") if (home / "names").is_dir() else None
    except (OSError, RollboxError):
        built = None
    python = (f"`python` is snapshot {built[:12]} built into it (`rollbox snapshot rm {built[:12]}` goes back to "
              "the built-in)") if built else "`python` is the built-in snapshot (the host's Python)"
    return f"home: {home} ({origin}); {python}"


def cmd_doctor(args: argparse.Namespace) -> int:
    from rollbox.runtime.doctor import diagnose

    ok, lines = asyncio.run(diagnose())
    lines.insert(1, f"  info {home_line()}")
    for line in lines:
        print(line)
    return 0 if ok else 1


__all__ = ["add_parser"]
