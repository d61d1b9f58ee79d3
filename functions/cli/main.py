"""The ``rollbox`` command: run, doctor, serve, snapshot, store, trajectories, replay, report, knative.

Every flag is mirrored by an environment variable (``--port`` / ``PORT``), cast strictly.
Subcommands live with the code they drive; this module only wires them up, and imports only the
module of the command being run (``rollbox serve`` starting from zero pays no import it does not use).
Help texts are shown as plain text (the modules' docstrings mark code with double backticks). A
command whose reader goes away (``rollbox trajectories show E | head``) ends quietly with exit
status 141 (128 + SIGPIPE), as a command killed by SIGPIPE does, not with a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import signal
import sys
from collections.abc import Sequence
from typing import Any

# command -> the module whose ``add_parser(sub)`` registers it (in the order ``--help`` lists them)
COMMANDS: dict[str, str] = {
    "run": "rollbox.functions.cli.runtime",
    "doctor": "rollbox.functions.cli.runtime",
    "serve": "rollbox.functions.service.server",
    "snapshot": "rollbox.snapshots.cli",
    "store": "rollbox.snapshots.cli",
    "languages": "rollbox.snapshots.cli",
    "trajectories": "rollbox.functions.analysis.trajectories",
    "replay": "rollbox.functions.analysis.replay",
    "report": "rollbox.functions.analysis.report",
    "knative": "rollbox.functions.cli.knative",
}

# command -> (the extra it needs, the top-level modules that extra installs); checked before the command runs
EXTRAS: dict[str, tuple[str, tuple[str, ...]]] = {
    "report": ("report", ("pandas", "matplotlib")),
    "knative": ("knative", ("kubernetes",)),
}


def _missing_extra(command: str) -> str | None:
    """The error for a command whose optional extra is not installed (None if it is, or it needs none)."""
    if command not in EXTRAS:
        return None
    extra, modules = EXTRAS[command]
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError:
            return f"rollbox {command} needs the {extra!r} extra: pip install 'rollbox[{extra}]'"
    return None


DESCRIPTION = "rollbox: serverless sandboxes for agent reinforcement learning."
EPILOG = ("State (snapshots built or pulled, durable sandboxes, the recording spool and, without --store, "
          "trajectories) lives in --home / ROLLBOX_HOME: by default /var/lib/rollbox as root, else "
          "~/.local/share/rollbox, shared by every rollbox command and checkout on this machine that does not "
          "set it. `rollbox doctor` prints the one in use.")


def plain(text: str) -> str:
    """Help text without reStructuredText's code marks: ``x`` -> x."""
    return re.sub(r"``(.+?)``", r"\1", text, flags=re.S)


class PlainFormatter(argparse.HelpFormatter):
    """argparse's formatter, showing docstring-derived texts without their double backticks."""

    def _format_text(self, text: str) -> str:
        return super()._format_text(plain(text))

    def _expand_help(self, action: argparse.Action) -> str:
        return plain(super()._expand_help(action))


class Parser(argparse.ArgumentParser):
    """The parser of ``rollbox`` and of each subcommand (argparse makes subparsers of the parent's class)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", PlainFormatter)
        super().__init__(*args, **kwargs)


def _command(argv: Sequence[str]) -> str | None:
    """The subcommand named on the command line (its first word that is not an option), if known."""
    for arg in argv:
        if not arg.startswith("-"):
            return arg if arg in COMMANDS else None
    return None


def main(argv: Sequence[str] | None = None) -> int:
    args_in = list(sys.argv[1:] if argv is None else argv)
    parser = Parser(prog="rollbox", description=DESCRIPTION, epilog=EPILOG)
    sub = parser.add_subparsers(dest="command", required=True, metavar="command")
    command = _command(args_in)
    modules = [COMMANDS[command]] if command else list(dict.fromkeys(COMMANDS.values()))
    for name in modules:
        importlib.import_module(name).add_parser(sub)
    args = parser.parse_args(args_in)
    missing = _missing_extra(args.command)
    if missing:
        print(missing, file=sys.stderr)
        return 2
    rc: int = args.func(args)
    return rc


# commands that end with os._exit once their output is flushed, skipping the interpreter's teardown.
# Those that read Parquet through Arrow: its thread pools can abort a normal exit with "terminate called
# without an active exception" (rc -6; apache/arrow#34314) after the output is written. And serve: it
# has closed all it owns when it returns (logged "stopped": steps committed, sandboxes hibernated, rows
# flushed, threads joined); what a normal exit adds is freeing its heap object by object, which took
# 3.4 s of a replica's 4.7 s drain after it had held 100,000 episodes on a busy box.
EXIT_NOW_COMMANDS = frozenset({"trajectories", "replay", "report", "serve"})


SIGPIPE_EXIT = 128 + signal.SIGPIPE


def _reader_gone() -> None:
    """Standard output's reader went away: point stdout at /dev/null so that nothing flushed later
    (at exit) raises again, as Python's documentation advises for SIGPIPE."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def script() -> None:
    """The ``rollbox`` console script: ``main``, then exit. After a command that read through Arrow, and
    after serve, the exit skips the interpreter's teardown (``os._exit`` once the output is flushed):
    nothing of theirs is left to clean up by then (they write their files before returning). A closed
    pipe on stdout ends the command with status 141 and no traceback; Ctrl-C with 130."""
    try:
        rc = main()
        sys.stdout.flush()
    except BrokenPipeError:
        _reader_gone()
        rc = SIGPIPE_EXIT
    except KeyboardInterrupt:
        rc = 128 + signal.SIGINT
    if _command(sys.argv[1:]) in EXIT_NOW_COMMANDS:
        sys.stderr.flush()
        os._exit(rc)
    sys.exit(rc)


if __name__ == "__main__":
    script()
