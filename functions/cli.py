"""The ``rollbox`` command: run, doctor, serve, snapshot, store, trajectories, report, knative.

Every flag is mirrored by an environment variable (``--port`` / ``PORT``), cast strictly.
Subcommands live with the code they drive; this module only wires them up.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rollbox", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    from rollbox.functions import cmd_runtime

    cmd_runtime.add_parsers(sub)
    try:
        from rollbox.functions import server
    except ImportError:  # pragma: no cover - only while the service is being built
        server = None  # type: ignore[assignment]
    if server is not None and hasattr(server, "add_parser"):
        server.add_parser(sub)
    try:
        from rollbox.snapshots import cli as snapshot_cli
    except ImportError:  # pragma: no cover
        snapshot_cli = None  # type: ignore[assignment]
    if snapshot_cli is not None and hasattr(snapshot_cli, "add_parser"):
        snapshot_cli.add_parser(sub)

    from rollbox.functions import replay, trajectories

    trajectories.add_parser(sub)
    replay.add_parser(sub)

    from rollbox.functions import knative, report

    report.add_parser(sub)
    knative.add_parser(sub)

    args = parser.parse_args(argv)
    rc: int = args.func(args)
    return rc


if __name__ == "__main__":
    sys.exit(main())
