"""``rollbox snapshot build | list | show | rm | push | pull`` and ``rollbox store init | show``.

The local store (``--home`` / ROLLBOX_HOME) is where snapshots are built and where pulled ones are
cached; ``--store`` / ROLLBOX_STORE names the store ``list``, ``show``, ``rm``, ``push`` and ``pull``
talk to (a directory or ``s3://bucket/prefix``; default: the local store). S3 settings:
``--s3-endpoint-url`` / AWS_ENDPOINT_URL, ``--s3-region`` / AWS_REGION, ``--aws-profile`` /
AWS_PROFILE; credentials come from the usual AWS variables or profile.

``snapshot build`` names the snapshot after its template (``--name`` to choose another) in the local
store, which every command and server using that home shares: when that moves a name (the built-in
``python`` included) it says so, with the old and the new id.

``rollbox store init`` sets an S3 store's retention tiers as bucket lifecycle rules (``--state-days`` /
ROLLBOX_STATE_DAYS, ``--cold-days`` / ROLLBOX_COLD_DAYS, ``--cold-class`` / ROLLBOX_COLD_CLASS,
``--no-transition`` / ROLLBOX_NO_TRANSITION); ``rollbox store show`` prints the bucket's rules.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    SpinnerColumn,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TransferSpeedColumn,
)
from rich.table import Table
from rollbox.runtime.errors import InvalidRequest, RollboxError
from rollbox.runtime.runtime import default_home
from rollbox.snapshots.build import build
from rollbox.snapshots.resolver import BUILTIN
from rollbox.snapshots.store import ByteCallback, Store, copy_snapshot
from rollbox.snapshots.store_local import LocalStore
from rollbox.snapshots.store_s3 import (
    COLD_CLASS,
    COLD_CLASSES,
    COLD_DAYS,
    STATE_DAYS,
    LifecycleRule,
    S3Store,
    is_own_rule,
)
from rollbox.snapshots.template import PipOptions, Template, load_template

if TYPE_CHECKING:
    from rollbox.snapshots.language_builds import LanguageBuilds


def _env_bool(name: str, env: Mapping[str, str]) -> bool:
    raw = env.get(name, "").strip().lower()
    if raw in ("", "0", "false", "no", "off"):
        return False
    if raw in ("1", "true", "yes", "on"):
        return True
    raise InvalidRequest(f"{name}={env[name]!r}: not a valid bool (use 1/0, true/false, yes/no, on/off)")


def _env_int(name: str, env: Mapping[str, str], default: int) -> int:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        return int(raw)
    except ValueError:
        raise InvalidRequest(f"{name}={env[name]!r}: not a whole number of days") from None


def add_parser(subparsers: Any) -> None:
    env = os.environ
    remote = argparse.ArgumentParser(add_help=False)
    remote.add_argument("--store", default=env.get("ROLLBOX_STORE") or None,
                        help="store to talk to: a directory or s3://bucket/prefix (ROLLBOX_STORE)")
    remote.add_argument("--s3-endpoint-url", default=env.get("AWS_ENDPOINT_URL") or None,
                        help="S3 endpoint, e.g. http://127.0.0.1:8333 (AWS_ENDPOINT_URL)")
    remote.add_argument("--s3-region", default=env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or None,
                        help="S3 region (AWS_REGION)")
    remote.add_argument("--aws-profile", default=env.get("AWS_PROFILE") or None,
                        help="credentials profile (AWS_PROFILE)")
    remote.add_argument("--json", action="store_true", default=False, help="machine-readable output")
    common = argparse.ArgumentParser(add_help=False, parents=[remote])
    common.add_argument("--home", default=env.get("ROLLBOX_HOME") or None,
                        help=f"local store and cache directory (ROLLBOX_HOME; default: {default_home()})")

    snap = subparsers.add_parser("snapshot", help="build, list, show, remove, push and pull snapshots",
                                 description=__doc__.splitlines()[0] if __doc__ else None)
    sub = snap.add_subparsers(dest="snapshot_command", required=True)

    p = sub.add_parser("build", parents=[common], help="build a template into a snapshot")
    p.add_argument("template", help="template YAML file")
    p.add_argument("--name", default=None,
                   help="the name to give the snapshot in the local store (default: the template's own)")
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

    langs = subparsers.add_parser("languages", help="the language snapshots: their state; building them ahead of use",
                                  description="The language snapshots /run_code and the run event's language run in "
                                  "(snapshots/templates/<language>.yaml, built from Debian's packages: as root, or as "
                                  "a user with subordinate ids in a user namespace): "
                                  "`list` shows each one's state in the local store; `build` builds those missing, "
                                  "with each build's steps (a server building one on first use is waited for, "
                                  "not repeated). With --store (the store the servers share), both also look "
                                  "there: what it holds is ready for every server, and a build is pushed to it.")
    lsub = langs.add_subparsers(dest="languages_command", required=True)
    p = lsub.add_parser("list", parents=[common],
                        help="each language and its snapshot's state in the local store (and in --store)")
    p.set_defaults(func=_guard(_languages_list))
    p = lsub.add_parser("build", parents=[common],
                        help="build the language snapshots the local store (or --store) lacks; pushed to --store")
    p.add_argument("language", nargs="*", help="languages to build (default: every supported one)")
    p.set_defaults(func=_guard(_languages_build))

    store = subparsers.add_parser("store", help="retention tiers of an S3 store (bucket lifecycle rules)",
                                  description="Set or show an S3 store's retention tiers (bucket lifecycle rules).")
    sub = store.add_subparsers(dest="store_command", required=True)
    p = sub.add_parser("init", parents=[remote], help="set the store's lifecycle rules (keeps other rules)")
    p.add_argument("--state-days", type=int, default=None,
                   help=f"expire sandbox step state after N days; blobs a sandbox lifetime later (ROLLBOX_STATE_DAYS; "
                        f"default {STATE_DAYS}, more than the longest sandbox lifetime)")
    p.add_argument("--cold-days", type=int, default=None,
                   help=f"move trajectories to --cold-class after M days (ROLLBOX_COLD_DAYS; default {COLD_DAYS})")
    p.add_argument("--cold-class", choices=COLD_CLASSES, default=None, metavar="CLASS",
                   help=f"storage class for cold trajectories: {', '.join(COLD_CLASSES)} (ROLLBOX_COLD_CLASS; "
                        f"default {COLD_CLASS})")
    p.add_argument("--no-transition", action="store_true", default=None,
                   help="no transition rule for trajectories, for servers without storage classes such as "
                        "SeaweedFS (ROLLBOX_NO_TRANSITION)")
    p.set_defaults(func=_guard(_store_init))
    p = sub.add_parser("show", parents=[remote], help="show the bucket's lifecycle rules")
    p.set_defaults(func=_guard(_store_show))


def _guard(fn: Callable[[argparse.Namespace, Console], int]) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        err = Console(stderr=True, soft_wrap=True)
        try:
            return fn(args, Console(soft_wrap=True))
        except RollboxError as exc:
            err.print(f"[bold red]error:[/] {escape(exc.message)}", highlight=False, markup=True)
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
    if args.name is not None:
        try:
            template = Template.model_validate({**template.model_dump(), "name": args.name})
        except ValueError as exc:
            raise InvalidRequest(f"--name {args.name!r}: {exc}") from None
    no_index = args.pip_no_index
    if no_index is None:
        no_index = _env_bool("ROLLBOX_PIP_NO_INDEX", os.environ)
    extra = PipOptions(find_links=tuple(os.path.abspath(p) for p in args.pip_find_links), no_index=no_index)
    local = _local(args)
    before = local.names().get(template.name)
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                  console=console, transient=True) as progress:
        task = progress.add_task(f"building {template.name}")
        manifest = build(template, where, local, pip_extra=extra,
                         on_step=lambda msg: progress.update(task, description=f"{template.name}: {msg}"))
    if args.store:
        remote = _remote(args)
        with _bars(console) as on_layer:
            copy_snapshot(local, remote, template.name, tmp_dir=str(local.root / "tmp"), on_layer=on_layer)
    moved = _moved_name(template.name, before, manifest.id, local)
    if moved:
        Console(stderr=True, soft_wrap=True).print(f"[bold yellow]note:[/] {escape(moved)}", highlight=False)
    if args.json:
        version = manifest.version.model_dump()
        print(json.dumps({"id": manifest.id, "name": template.name, "previous_id": before, "home": str(local.root),
                          "version": version}))
    else:
        console.print(f"built [bold]{escape(template.name)}[/] {manifest.id} in {escape(str(local.root))}  "
                      f"({len(manifest.layers)} layers, {manifest.size_bytes / 1e6:.1f} MB)", highlight=False)
        if manifest.version.packages:
            console.print("packages: " + ", ".join(f"{k}=={v}" for k, v in manifest.version.packages.items()),
                          highlight=False)
    return 0


def _moved_name(name: str, before: str | None, now: str, local: LocalStore) -> str | None:
    """What a build did to a name that every user of this home shares, if it moved one."""
    if before == now:
        return None
    users = (f"every rollbox command and server using {local.root} (--home / ROLLBOX_HOME) now restores "
             f"{now[:12]} for {name!r}")
    if before is not None:
        return f"{name}: {before[:12]} -> {now[:12]}; {users} (`rollbox snapshot build --name` keeps a name apart)"
    if name == BUILTIN:
        return (f"{name!r} now names this snapshot instead of the built-in one; {users}; `rollbox snapshot rm "
                f"{now[:12]} --home {local.root}` goes back to the built-in")
    return None


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


def _languages_list(args: argparse.Namespace, console: Console) -> int:
    rows = _language_builds(args).statuses()
    if args.json:
        print(json.dumps([r.as_json() for r in rows]))
        return 0
    table = Table("language", "snapshot", "state", "id / step", title=str(_local(args).root))
    for r in rows:
        what = r.describe() if r.state not in ("ready", "missing") else ""
        if r.state == "ready":
            what = (r.snapshot_id or "")[:12] + (" (in --store)" if r.where == "store" else "")
        table.add_row(r.language, r.snapshot, r.state, escape(what))
    console.print(table)
    return 0


def _language_builds(args: argparse.Namespace) -> LanguageBuilds:
    """The language builds of the home, shared through --store when one is given."""
    from rollbox.snapshots.language_builds import LanguageBuilds
    from rollbox.snapshots.state import LocalObjects, Objects
    from rollbox.snapshots.store_s3 import S3Objects

    if not args.store:
        return LanguageBuilds(_local(args))
    remote = _remote(args)
    claims: Objects = S3Objects(remote) if isinstance(remote, S3Store) else LocalObjects(args.store)
    return LanguageBuilds(_local(args), remote=remote, claims=claims)


def _languages_build(args: argparse.Namespace, console: Console) -> int:
    from rollbox.snapshots import languages
    from rollbox.snapshots.language_builds import BuildProgress

    names = list(dict.fromkeys(args.language)) or list(languages.SUPPORTED)
    for name in names:
        languages.language(name)  # an unknown or unsupported one: refused before anything is built
    builds = _language_builds(args)
    failed: list[str] = []
    results: list[dict[str, Any]] = []
    for i, name in enumerate(names, 1):
        before = builds.status(name)
        if before.state == "ready" and builds.remote is None:  # (with --store: built here, maybe not pushed yet)
            console.print(f"[{i}/{len(names)}] {name}: ready ({(before.snapshot_id or '')[:12]})", highlight=False)
            results.append(before.as_json())
            continue
        with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=console,
                      transient=True) as progress:
            task = progress.add_task(f"[{i}/{len(names)}] building {name}")
            started = builds.started
            try:
                def show(p: BuildProgress, head: str = f"[{i}/{len(names)}]", task: TaskID = task) -> None:
                    progress.update(task, description=escape(f"{head} {p.describe()}"))

                manifest = builds.build(name, on_progress=show)
            except RollboxError as exc:
                failed.append(name)
                console.print(f"[{i}/{len(names)}] [bold red]{escape(name)} failed:[/] {escape(exc.message)}",
                              highlight=False)
                results.append(builds.status(name).as_json())
                continue
        now = builds.status(name, builds.shared_state())
        if builds.started > started:
            console.print(f"[{i}/{len(names)}] {name}: built {manifest.id[:12]} ({manifest.size_bytes / 1e6:.0f} MB)"
                          + (f", in {builds.remote.url}" if builds.remote is not None and now.where else ""),
                          highlight=False)
        else:
            console.print(f"[{i}/{len(names)}] {name}: ready ({manifest.id[:12]}"
                          + (f", in {builds.remote.url})" if builds.remote is not None else ")"), highlight=False)
        results.append(now.as_json())
    if args.json:
        print(json.dumps(results))
    if failed:
        console.print(f"not built: {', '.join(failed)}", highlight=False)
        return 1
    return 0


def _s3(args: argparse.Namespace) -> S3Store:
    store = _remote(args, required=True)
    if not isinstance(store, S3Store):
        raise InvalidRequest(f"retention tiers are S3 bucket lifecycle rules, and --store {store.url} is a "
                             "directory: give --store s3://bucket[/prefix] (or ROLLBOX_STORE)")
    return store


def _store_init(args: argparse.Namespace, console: Console) -> int:
    env = os.environ
    no_transition = args.no_transition
    if no_transition is None:
        no_transition = _env_bool("ROLLBOX_NO_TRANSITION", env)
    elif args.cold_class:
        raise InvalidRequest(f"--cold-class {args.cold_class} and --no-transition contradict each other: give one")
    cold_class = args.cold_class or env.get("ROLLBOX_COLD_CLASS", "").strip() or COLD_CLASS
    store = _s3(args)
    rules = store.set_lifecycle(
        state_days=args.state_days if args.state_days is not None else _env_int("ROLLBOX_STATE_DAYS", env, STATE_DAYS),
        cold_days=args.cold_days if args.cold_days is not None else _env_int("ROLLBOX_COLD_DAYS", env, COLD_DAYS),
        cold_class=None if no_transition else cold_class)
    _print_rules(args, console, store, rules)
    return 0


def _store_show(args: argparse.Namespace, console: Console) -> int:
    store = _s3(args)
    _print_rules(args, console, store, store.lifecycle())
    return 0


def _print_rules(args: argparse.Namespace, console: Console, store: S3Store, rules: list[LifecycleRule]) -> None:
    if args.json:
        print(json.dumps({"store": store.url, "bucket": store.bucket, "rules": rules}, default=str))
        return
    if not rules:
        console.print(f"no lifecycle rules on bucket {store.bucket!r}: nothing in {store.url} expires",
                      highlight=False)
        return
    table = Table(title=f"lifecycle rules of bucket {store.bucket!r}")
    for column in ("id", "prefix", "status", "action", "owner"):
        table.add_column(column, overflow="fold")
    for r in rules:
        table.add_row(str(r.get("ID", "")), repr(_rule_prefix(r)), str(r.get("Status", "")), _rule_action(r),
                      "this store" if is_own_rule(r, store.prefix) else "other")
    console.print(table)
    base = f"{store.prefix}/" if store.prefix else ""
    console.print(f"no rule for {base}usage/ (the bill), {base}layers/, {base}manifests/, {base}names/ "
                  "(snapshots) unless another rule covers them", highlight=False)


def _rule_prefix(rule: LifecycleRule) -> str:
    filt = rule.get("Filter") or {}
    return str(filt.get("Prefix", (filt.get("And") or {}).get("Prefix", rule.get("Prefix", ""))))


def _rule_action(rule: LifecycleRule) -> str:
    parts = []
    exp = rule.get("Expiration") or {}
    if "Days" in exp:
        parts.append(f"expire after {_days(exp['Days'])}")
    elif "Date" in exp:
        parts.append(f"expire on {exp['Date']}")
    elif exp:
        parts.append(f"Expiration: {exp}")
    for t in rule.get("Transitions") or []:
        when = f"after {_days(t['Days'])}" if "Days" in t else f"on {t.get('Date')}"
        parts.append(f"to {t.get('StorageClass')} {when}")
    if "AbortIncompleteMultipartUpload" in rule:
        days = rule["AbortIncompleteMultipartUpload"].get("DaysAfterInitiation")
        parts.append(f"abort incomplete uploads after {_days(days)}")
    other = sorted(set(rule) - {"ID", "Filter", "Prefix", "Status", "Expiration", "Transitions",
                                "AbortIncompleteMultipartUpload"})
    parts.extend(f"{k}: {rule[k]}" for k in other)
    return "; ".join(parts)


def _days(n: Any) -> str:
    return f"{n} day" if n == 1 else f"{n} days"


def main(argv: list[str] | None = None) -> int:
    """``python -m rollbox.snapshots.cli ...`` without the rest of the rollbox CLI."""
    parser = argparse.ArgumentParser(prog="rollbox")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    rc: int = args.func(args)
    return rc


if __name__ == "__main__":
    sys.exit(main())
