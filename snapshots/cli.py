"""``rollbox snapshot build | list | show | rm | push | pull``.

The local store (``--home`` / ROLLBOX_HOME) is where snapshots are built and where pulled ones are
cached; ``--store`` / ROLLBOX_STORE names the store ``list``, ``show``, ``rm``, ``push`` and ``pull``
talk to (a directory or ``s3://bucket/prefix``; default: the local store). S3 settings:
``--s3-endpoint-url`` / AWS_ENDPOINT_URL, ``--s3-region`` / AWS_REGION, ``--aws-profile`` /
AWS_PROFILE; credentials come from the usual AWS variables or profile.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
    TransferSpeedColumn,
)
from rich.table import Table
from rollbox.runtime.errors import InvalidRequest, RollboxError
from rollbox.runtime.runtime import default_home
from rollbox.snapshots.build import build
from rollbox.snapshots.store import ByteCallback, Store, copy_snapshot
from rollbox.snapshots.store_local import LocalStore
from rollbox.snapshots.store_s3 import S3Store
from rollbox.snapshots.template import PipOptions, load_template


def _env_bool(name: str, env: Mapping[str, str]) -> bool:
    raw = env.get(name, "").strip().lower()
    if raw in ("", "0", "false", "no", "off"):
        return False
    if raw in ("1", "true", "yes", "on"):
        return True
    raise InvalidRequest(f"{name}={env[name]!r}: not a valid bool (use 1/0, true/false, yes/no, on/off)")


def add_parser(subparsers: Any) -> None:
    env = os.environ
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--home", default=env.get("ROLLBOX_HOME") or None,
                        help=f"local store and cache directory (ROLLBOX_HOME; default: {default_home()})")
    common.add_argument("--store", default=env.get("ROLLBOX_STORE") or None,
                        help="store to talk to: a directory or s3://bucket/prefix (ROLLBOX_STORE)")
    common.add_argument("--s3-endpoint-url", default=env.get("AWS_ENDPOINT_URL") or None,
                        help="S3 endpoint, e.g. http://127.0.0.1:8333 (AWS_ENDPOINT_URL)")
    common.add_argument("--s3-region", default=env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or None,
                        help="S3 region (AWS_REGION)")
    common.add_argument("--aws-profile", default=env.get("AWS_PROFILE") or None,
                        help="credentials profile (AWS_PROFILE)")
    common.add_argument("--json", action="store_true", default=False, help="machine-readable output")

    snap = subparsers.add_parser("snapshot", help="build, list, show, remove, push and pull snapshots",
                                 description=__doc__.splitlines()[0] if __doc__ else None)
    sub = snap.add_subparsers(dest="snapshot_command", required=True)

    p = sub.add_parser("build", parents=[common], help="build a template into a snapshot")
    p.add_argument("template", help="template YAML file")
    p.add_argument("--pip-find-links", action="append",
                   default=[x for x in env.get("ROLLBOX_PIP_FIND_LINKS", "").split(os.pathsep) if x],
                   help=f"extra wheel directory for pip (ROLLBOX_PIP_FIND_LINKS, {os.pathsep}-separated)")
    p.add_argument("--pip-no-index", action="store_true", default=None,
                   help="pip may not use an index (ROLLBOX_PIP_NO_INDEX)")
    p.set_defaults(func=_guard(_build))

    p = sub.add_parser("list", parents=[common], help="list snapshots in the store")
    p.set_defaults(func=_guard(_list))
    p = sub.add_parser("show", parents=[common], help="show a snapshot's manifest")
    p.add_argument("snapshot", help="name or id")
    p.set_defaults(func=_guard(_show))
    p = sub.add_parser("rm", parents=[common], help="remove a snapshot (and layers nothing else uses)")
    p.add_argument("snapshot", help="name or id")
    p.set_defaults(func=_guard(_rm))
    p = sub.add_parser("push", parents=[common], help="copy a snapshot from the local store to --store")
    p.add_argument("snapshot", help="name or id")
    p.set_defaults(func=_guard(_push))
    p = sub.add_parser("pull", parents=[common], help="copy a snapshot from --store to the local store")
    p.add_argument("snapshot", help="name or id")
    p.set_defaults(func=_guard(_pull))


def _guard(fn: Callable[[argparse.Namespace, Console], int]) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        err = Console(stderr=True, soft_wrap=True)
        try:
            return fn(args, Console(soft_wrap=True))
        except RollboxError as exc:
            err.print(f"[bold red]error:[/] {exc.message}", highlight=False, markup=True)
            return 2 if isinstance(exc, InvalidRequest) else 1
    return run


def _local(args: argparse.Namespace) -> LocalStore:
    return LocalStore(args.home)


def _remote(args: argparse.Namespace, *, required: bool = False) -> Store:
    url = args.store
    if not url:
        if required:
            raise InvalidRequest("--store (or ROLLBOX_STORE) is required: s3://bucket/prefix or a directory")
        return _local(args)
    if url.startswith("s3://"):
        return S3Store(url, endpoint_url=args.s3_endpoint_url, region=args.s3_region,
                       profile=args.aws_profile)
    return LocalStore(url)


@contextmanager
def _bars(console: Console) -> Iterator[Callable[[str, int], ByteCallback]]:
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                  TransferSpeedColumn(), TimeElapsedColumn(), console=console, transient=False) as progress:
        def on_layer(layer_id: str, size: int) -> ByteCallback:
            task = progress.add_task(f"layer {layer_id[:12]}", total=size or None)
            return lambda n: progress.advance(task, n)
        yield on_layer


def _build(args: argparse.Namespace, console: Console) -> int:
    template, where = load_template(args.template)
    no_index = args.pip_no_index
    if no_index is None:
        no_index = _env_bool("ROLLBOX_PIP_NO_INDEX", os.environ)
    extra = PipOptions(find_links=tuple(os.path.abspath(p) for p in args.pip_find_links), no_index=no_index)
    local = _local(args)
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                  console=console, transient=True) as progress:
        task = progress.add_task(f"building {template.name}")
        manifest = build(template, where, local, pip_extra=extra,
                         on_step=lambda msg: progress.update(task, description=f"{template.name}: {msg}"))
    if args.store:
        remote = _remote(args)
        with _bars(console) as on_layer:
            copy_snapshot(local, remote, template.name, tmp_dir=str(local.root / "tmp"), on_layer=on_layer)
    if args.json:
        version = manifest.version.model_dump()
        print(json.dumps({"id": manifest.id, "name": template.name, "version": version}))
    else:
        console.print(f"built [bold]{template.name}[/] {manifest.id}  "
                      f"({len(manifest.layers)} layers, {manifest.size_bytes / 1e6:.1f} MB)", highlight=False)
        if manifest.version.packages:
            console.print("packages: " + ", ".join(f"{k}=={v}" for k, v in manifest.version.packages.items()),
                          highlight=False)
    return 0


def _list(args: argparse.Namespace, console: Console) -> int:
    store = _remote(args)
    names: dict[str, list[str]] = {}
    for name, sid in store.names().items():
        names.setdefault(sid, []).append(name)
    rows: list[dict[str, Any]] = []
    for sid in store.list_ids():
        m = store.get_manifest(sid)
        rows.append({"id": sid, "names": names.get(sid, []), "base": m.base, "layers": len(m.layers),
                     "size_bytes": m.size_bytes, "parent": m.parent})
    if args.json:
        print(json.dumps(rows))
        return 0
    table = Table("id", "names", "base", "layers", "size", "parent", title=str(store.url))
    for r in rows:
        table.add_row(r["id"][:12], ", ".join(r["names"]), r["base"][:24], str(r["layers"]),
                      f"{r['size_bytes'] / 1e6:.1f} MB", (r["parent"] or "")[:12])
    console.print(table)
    return 0


def _show(args: argparse.Namespace, console: Console) -> int:
    store = _remote(args)
    sid = store.resolve_id(args.snapshot)
    m = store.get_manifest(sid)
    print(json.dumps({"id": sid, "manifest": m.model_dump(mode="json")}, indent=None if args.json else 2))
    return 0


def _rm(args: argparse.Namespace, console: Console) -> int:
    store = _remote(args)
    sid = store.resolve_id(args.snapshot)
    removed = store.delete(sid)
    console.print(f"removed {sid} ({len(removed)} layers freed)", highlight=False)
    return 0


def _push(args: argparse.Namespace, console: Console) -> int:
    local, remote = _local(args), _remote(args, required=True)
    with _bars(console) as on_layer:
        m = copy_snapshot(local, remote, args.snapshot, tmp_dir=str(local.root / "tmp"), on_layer=on_layer)
    console.print(f"pushed {m.id} to {remote.url}", highlight=False)
    return 0


def _pull(args: argparse.Namespace, console: Console) -> int:
    local, remote = _local(args), _remote(args, required=True)
    with _bars(console) as on_layer:
        m = copy_snapshot(remote, local, args.snapshot, tmp_dir=str(local.root / "tmp"), on_layer=on_layer)
    console.print(f"pulled {m.id} into {local.root}", highlight=False)
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m rollbox.snapshots.cli ...`` without the rest of the rollbox CLI."""
    parser = argparse.ArgumentParser(prog="rollbox")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    rc: int = args.func(args)
    return rc


if __name__ == "__main__":
    sys.exit(main())
