"""Reading what was recorded: trajectories (one row per step) and usage (one row per sandbox life).

    rollbox trajectories ls [--experiment E]                     experiments, or one's episodes
    rollbox trajectories show EPISODE [--experiment E]           an episode's steps, in order
    rollbox trajectories export --experiment E [--usage] [--format parquet|jsonl|cloudevents] [--since D] [--out F]

From Python, the same from the local store or S3 alike::

    from rollbox.functions.trajectories import steps, usage
    df = steps("s3://bucket/prefix", experiment="exp-1")        # a pandas DataFrame
    table = read("trajectories", store, experiment="exp-1")      # a pyarrow Table

The files are plain hive-partitioned Parquet (``trajectories/experiment=<e>/date=<d>/*.parquet``):
``pandas.read_parquet(dir)``, ``pyarrow.dataset.dataset(dir, partitioning="hive")`` and duckdb's
``read_parquet('.../**/*.parquet', hive_partitioning=true)`` read them as they are. Reading through
this module also drops the rare duplicate row (an event answered from the store on another replica
after the replica that ran it died between its commit and its spool), keyed by event source and id.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import quote, unquote

import pyarrow as pa
import pyarrow.parquet as pq
from rollbox.functions.records import DEFAULT_EXPERIMENT, STEP_SCHEMA, USAGE_SCHEMA, usage_event
from rollbox.runtime.errors import InvalidRequest, RollboxError
from rollbox.runtime.runtime import default_home
from rollbox.snapshots.state import LocalObjects, Objects
from rollbox.snapshots.store_s3 import S3Objects, S3Store

__all__ = ["add_parser", "add_store_arguments", "open_objects", "read", "steps", "store_of", "usage"]

KINDS = {"trajectories": STEP_SCHEMA, "usage": USAGE_SCHEMA}
Progress = Callable[[int, int], None]


def open_objects(store: str | None = None, *, home: str | None = None, endpoint_url: str | None = None,
                 region: str | None = None, profile: str | None = None) -> Objects:
    """The store's objects: ``s3://bucket/prefix``, a directory, or (None) the local store in ``home``."""
    if store and store.startswith("s3://"):
        return S3Objects(S3Store(store, endpoint_url=endpoint_url or os.environ.get("AWS_ENDPOINT_URL"),
                                 region=region, profile=profile))
    return LocalObjects(store or home or default_home())


def _objects(store: str | Objects | None) -> Objects:
    return store if store is not None and not isinstance(store, str) else open_objects(store)


def _partition(key: str) -> dict[str, str]:
    return {k: unquote(v) for part in key.split("/")[1:-1] if "=" in part for k, v in [part.split("=", 1)]}


def read(kind: str, store: str | Objects | None = None, *, experiment: str | None = None, since: str | None = None,
         episode: str | None = None, progress: Progress | None = None) -> pa.Table:
    """Every row of ``kind`` (``trajectories`` or ``usage``) in the store, with ``experiment`` and ``date``
    columns, duplicates dropped; ``since``: dates from that one (YYYY-MM-DD) on."""
    if kind not in KINDS:
        raise InvalidRequest(f"kind must be one of {sorted(KINDS)}, got {kind!r}")
    objects = _objects(store)
    prefix = f"{kind}/" + (f"experiment={quote(experiment, safe='-_.')}/" if experiment else "")
    keys = [k for k in objects.keys(prefix) if k.endswith(".parquet")
            and (since is None or _partition(k).get("date", "") >= since)]
    tables = []
    for i, key in enumerate(keys):
        data = objects.get(key)
        if data is not None:
            # one thread: Arrow's reader threads can outlive a short CLI run and abort its exit with
            # "terminate called without an active exception" (exit 134; apache/arrow#34314)
            t = pq.read_table(io.BytesIO(data), use_threads=False)
            part = _partition(key)
            t = t.append_column("experiment", pa.array([part.get("experiment", DEFAULT_EXPERIMENT)] * len(t),
                                                       pa.string()))
            t = t.append_column("date", pa.array([part.get("date", "")] * len(t), pa.string()))
            tables.append(t)
        if progress is not None:
            progress(i + 1, len(keys))
    schema = KINDS[kind].append(pa.field("experiment", pa.string())).append(pa.field("date", pa.string()))
    if not tables:
        return schema.empty_table()
    table = pa.concat_tables(tables, promote_options="default")
    if episode is not None:
        table = table.filter(pa.compute.equal(table["episode"], episode))
    return _dedupe(table, ("event_source", "event_id") if kind == "trajectories" else ("usage_id",))


def _dedupe(table: pa.Table, cols: tuple[str, ...]) -> pa.Table:
    seen: set[tuple[Any, ...]] = set()
    keep = []
    for i, key in enumerate(zip(*(table[c].to_pylist() for c in cols), strict=True)):
        if key not in seen:
            seen.add(key)
            keep.append(i)
    return table if len(keep) == len(table) else table.take(keep)


def steps(store: str | Objects | None = None, **kw: Any) -> Any:
    """The trajectories as a pandas DataFrame, ordered by event time (needs pandas)."""
    return read("trajectories", store, **kw).to_pandas().sort_values("event_time", kind="stable",
                                                                     ignore_index=True)


def usage(store: str | Objects | None = None, **kw: Any) -> Any:
    """The usage records as a pandas DataFrame (needs pandas)."""
    return read("usage", store, **kw).to_pandas().sort_values("ended_at", kind="stable", ignore_index=True)


# ---------------------------------------------------------------------------------------------- CLI
def add_store_arguments(p: argparse.ArgumentParser, env: Mapping[str, str] = os.environ, *,
                        experiment: str | None = None) -> None:
    """The flags naming the store to read, and ``--experiment`` (required when ``experiment`` gives its
    help), shared by trajectories, report and replay."""
    p.add_argument("--store", default=env.get("ROLLBOX_STORE") or None,
                   help="a directory or s3://bucket/prefix (ROLLBOX_STORE; default: the local store in --home)")
    p.add_argument("--home", default=env.get("ROLLBOX_HOME") or None, help="the local store (ROLLBOX_HOME)")
    p.add_argument("--s3-endpoint-url", default=env.get("AWS_ENDPOINT_URL") or None,
                   help="S3 endpoint (AWS_ENDPOINT_URL)")
    p.add_argument("--s3-region", default=env.get("AWS_REGION") or None, help="S3 region (AWS_REGION)")
    p.add_argument("--aws-profile", default=env.get("AWS_PROFILE") or None, help="AWS_PROFILE")
    p.add_argument("--experiment", default=None, required=experiment is not None,
                   help=experiment or "only this experiment")


def store_of(args: argparse.Namespace) -> Objects:
    """The store the flags of ``add_store_arguments`` name."""
    return open_objects(args.store, home=args.home, endpoint_url=args.s3_endpoint_url, region=args.s3_region,
                        profile=args.aws_profile)


def add_parser(subparsers: Any, env: Mapping[str, str] = os.environ) -> None:
    common = argparse.ArgumentParser(add_help=False)
    add_store_arguments(common, env)
    p = subparsers.add_parser("trajectories", help="list, show and export recorded steps",
                              description=__doc__.splitlines()[0] if __doc__ else None)
    sub = p.add_subparsers(dest="trajectories_command", required=True)
    q = sub.add_parser("ls", parents=[common], help="experiments (steps, episodes), or one experiment's episodes")
    q.add_argument("--json", action="store_true")
    q.set_defaults(func=_guard(_ls))
    q = sub.add_parser("show", parents=[common], help="one episode's steps, in order")
    q.add_argument("episode")
    q.add_argument("--json", action="store_true", help="one JSON object per step")
    q.set_defaults(func=_guard(_show))
    q = sub.add_parser("export", parents=[common], help="write an experiment's steps (or usage) to a file")
    q.add_argument("--format", choices=("parquet", "jsonl", "cloudevents"), default="parquet",
                   help="cloudevents (with --usage): one structured dev.rollbox.usage CloudEvent per line")
    q.add_argument("--since", default=None, help="dates from this one on (YYYY-MM-DD)")
    q.add_argument("--usage", action="store_true", help="the usage records instead of the steps")
    q.add_argument("--out", default="-", help="file to write (default: stdout)")
    q.set_defaults(func=_guard(_export))


def _guard(fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        try:
            return fn(args)
        except RollboxError as exc:
            print(f"rollbox trajectories: {exc.message}", file=sys.stderr)
            return 2 if isinstance(exc, InvalidRequest) else 1
    return run


def _ls(args: argparse.Namespace) -> int:
    table = read("trajectories", store_of(args), experiment=args.experiment)
    rows: dict[str, dict[str, Any]] = {}
    group = "episode" if args.experiment else "experiment"
    for rec in table.select([group, "episode", "reward", "event_time"]).to_pylist():
        key = rec[group] or "-"
        r = rows.setdefault(key, {group: key, "steps": 0, "episodes": set(), "reward": None, "last": None})
        r["steps"] += 1
        r["episodes"].add(rec["episode"])
        if rec["reward"] is not None:
            r["reward"] = rec["reward"]
        r["last"] = max(filter(None, (r["last"], rec["event_time"])), default=None)
    out = [{**r, "episodes": len(r["episodes"]), "last": r["last"].isoformat() if r["last"] else None}
           for r in sorted(rows.values(), key=lambda r: str(r[group]))]
    if args.json:
        print(json.dumps(out))
        return 0
    if group == "episode":
        print(f"{'episode':<32} {'steps':>6} {'reward':>10}  last step")
        for r in out:
            reward = "" if r["reward"] is None else f"{r['reward']:.4g}"
            print(f"{r['episode']:<32} {r['steps']:>6} {reward:>10}  {r['last']}")
    else:
        print(f"{'experiment':<32} {'steps':>8} {'episodes':>9}  last step")
        for r in out:
            print(f"{r['experiment']:<32} {r['steps']:>8} {r['episodes']:>9}  {r['last']}")
    return 0


def _show(args: argparse.Namespace) -> int:
    table = read("trajectories", store_of(args), experiment=args.experiment, episode=args.episode)
    if len(table) == 0:
        raise InvalidRequest(f"no steps of episode {args.episode!r}"
                             + (f" in experiment {args.experiment!r}" if args.experiment else ""))
    rows = sorted(table.to_pylist(), key=lambda r: r["event_time"])
    for r in rows:
        if args.json:
            print(json.dumps(r, default=str))
            continue
        kind = r["event_type"].rsplit(".", 1)[-1]
        head = f"{r['event_time']:%H:%M:%S.%f}"[:-3] + f"  {kind:<9} {r['status']}"
        if r["sandbox_id"]:
            head += f"  {r['sandbox_id']}" + (f" step {r['step']}" if r["step"] is not None else "")
        print(head)
        action = r["code"] if r["code"] is not None else r["command"]
        if action is not None:
            print("  $ " + action.replace("\n", "\n    "))
        if r["exit_code"] is not None:
            print(f"  exit {r['exit_code']}  {r['exec_ms']} ms" + ("  timed out" if r["timed_out"] else "")
                  + ("  OOM" if r["oom_killed"] else ""))
            for stream in ("stdout", "stderr"):
                if r[stream]:
                    print(f"  {stream}: " + r[stream].rstrip("\n").replace("\n", "\n          "))
        if r["error_code"]:
            print(f"  error {r['error_code']}: {r['error']}")
        if r["reward"] is not None or r["labels"]:
            print(f"  reward {r['reward']}  labels {r['labels'] or '{}'}")
    return 0


def _export(args: argparse.Namespace) -> int:
    if not args.experiment:
        raise InvalidRequest("export needs --experiment")
    if args.format == "cloudevents" and not args.usage:
        raise InvalidRequest("--format cloudevents is for usage records: add --usage")
    table = read("usage" if args.usage else "trajectories", store_of(args), experiment=args.experiment,
                 since=args.since)
    out = sys.stdout.buffer if args.out == "-" else open(args.out, "wb")  # noqa: SIM115
    try:
        if args.format == "parquet":
            pq.write_table(table, out)
        elif args.format == "cloudevents":
            for r in table.to_pylist():
                out.write(json.dumps(usage_event(r), default=str).encode() + b"\n")
        else:
            for r in table.to_pylist():
                out.write(json.dumps(r, default=str).encode() + b"\n")
    finally:
        if out is not sys.stdout.buffer:
            out.close()
    if args.out != "-":
        print(f"{len(table)} rows -> {args.out}", file=sys.stderr)
    return 0
