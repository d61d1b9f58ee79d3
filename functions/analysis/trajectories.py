"""Reading what was recorded: trajectories (one row per step) and usage (one row per sandbox life).

    rollbox trajectories ls [--experiment E]                     experiments, or one's episodes
    rollbox trajectories show EPISODE [--experiment E]           an episode's steps, in order
    rollbox trajectories export --experiment E [--usage] [--format parquet|jsonl|cloudevents] [--since D] [--out F]

An episode name is an experiment's own: ``show`` and ``replay`` refuse a name that more than one
experiment uses unless ``--experiment`` says which (exit 2, naming them). Steps reach the store when
a server flushes its spool (every ``--flush-interval-s``, 10 s by default, and when it stops); the
commands say how many recorded steps are still in the spool of ``--home`` when they find fewer.
In ``--format jsonl`` and ``show --json`` the columns that hold JSON text in Parquet (``limits``,
``env_version``, ``env``, ``labels``, ``files_in_text``, ``files_out_text``) are JSON objects.

From Python, the same from the local store or S3 alike::

    from rollbox.functions.analysis.trajectories import steps, usage
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
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote

import pyarrow as pa
import pyarrow.parquet as pq
from rollbox.functions.contract.records import DEFAULT_EXPERIMENT, usage_event
from rollbox.functions.contract.tables import STEP_SCHEMA, USAGE_SCHEMA
from rollbox.runtime.errors import InvalidRequest, RollboxError
from rollbox.runtime.runtime import default_home
from rollbox.snapshots.state import LocalObjects, Objects
from rollbox.snapshots.store_s3 import S3Objects, S3Store

__all__ = ["JSON_COLUMNS", "add_parser", "add_store_arguments", "as_objects", "episode_rows", "open_objects", "read",
           "steps", "store_of", "unflushed", "usage"]

KINDS = {"trajectories": STEP_SCHEMA, "usage": USAGE_SCHEMA}
SPOOL_KINDS = {"trajectories": "step", "usage": "usage"}  # the kind of a spool line (recorder.KINDS)
Progress = Callable[[int, int], None]
# step columns that hold JSON text in Parquet (StepRecord: "JSON of ..."): objects in JSON output
JSON_COLUMNS = ("files_in_text", "env", "limits", "files_out_text", "env_version", "labels")


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


def as_objects(row: Mapping[str, Any]) -> dict[str, Any]:
    """A step row for JSON output: its JSON-text columns decoded into objects (text that is not valid
    JSON stays as it is)."""
    out = dict(row)
    for col in JSON_COLUMNS:
        value = out.get(col)
        if isinstance(value, str):
            try:
                out[col] = json.loads(value)
            except ValueError:
                pass
    return out


def unflushed(home: str | os.PathLike[str] | None, kind: str = "trajectories", *, experiment: str | None = None,
              episode: str | None = None) -> int:
    """Rows of ``kind`` recorded but not yet in the store: in the spool of ``home`` (default: the
    default home), which a server flushes every ``--flush-interval-s`` and when it stops. 0 when there
    is no spool or it cannot be read (another user's home)."""
    prefix = b'{"k":"%s"' % SPOOL_KINDS[kind].encode()
    n = 0
    try:
        segments = sorted((Path(home) if home else default_home()).joinpath("spool").glob("*.jsonl"))
    except OSError:
        return 0
    for path in segments:
        try:
            data = path.read_bytes()
        except OSError:
            continue
        for line in data.splitlines():
            if not line.startswith(prefix):
                continue
            try:
                row = json.loads(line)["r"]
            except (ValueError, KeyError, TypeError):  # a line being written
                continue
            if experiment is not None and (row.get("experiment") or DEFAULT_EXPERIMENT) != experiment:
                continue
            if episode is not None and row.get("episode") != episode:
                continue
            n += 1
    return n


def _spool_note(n: int, home: str | None, noun: str = "step") -> str:
    where = Path(home) if home else default_home()
    what = noun if n == 1 else noun + "s"
    return (f"{n} more recorded {what} {'is' if n == 1 else 'are'} not in the store yet: in the spool of {where}, "
            "which a running `rollbox serve` flushes to the store every --flush-interval-s (10 s by default) and "
            "when it stops")


def experiments(store: str | Objects | None = None, kind: str = "trajectories") -> list[str]:
    """The experiments the store holds rows of ``kind`` for (from the partition paths alone)."""
    objects = _objects(store)
    return sorted({unquote(k.split("/")[1].removeprefix("experiment=")) for k in objects.keys(f"{kind}/")
                   if k.endswith(".parquet") and k.count("/") >= 2 and k.split("/")[1].startswith("experiment=")})


def episode_rows(objects: Objects, episode: str, experiment: str | None, *, home: str | None = None) -> pa.Table:
    """The steps of ``episode`` (of ``experiment``, or of the one experiment that has an episode of
    that name). Raises ``InvalidRequest`` (exit 2) when there are none, or when experiments share
    the name and none was given: the message names them, and how many rows are still unflushed."""
    table = read("trajectories", objects, experiment=experiment, episode=episode)
    where = f" in experiment {experiment!r}" if experiment else ""
    if len(table) == 0:
        waiting = unflushed(home, experiment=experiment, episode=episode)
        known = ""
        if experiment and experiment not in experiments(objects):
            known = f"; no experiment {experiment!r} in {objects.url} ({_known(objects)})"
        raise InvalidRequest(f"no steps of episode {episode!r}{where} in {objects.url}{known}"
                             + (f"; {_spool_note(waiting, home)}" if waiting else ""))
    found = sorted(set(table["experiment"].to_pylist()))
    if experiment is None and len(found) > 1:
        raise InvalidRequest(f"episode {episode!r} is in {len(found)} experiments: {', '.join(found)}; "
                             "give --experiment to say which")
    return table


def _known(objects: Objects) -> str:
    names = experiments(objects)
    return f"experiments there: {', '.join(names)}" if names else "it holds no recorded steps"


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
    objects = store_of(args)
    table = read("trajectories", objects, experiment=args.experiment)
    waiting = unflushed(args.home, experiment=args.experiment)
    if args.experiment and len(table) == 0:
        raise InvalidRequest(f"no steps of experiment {args.experiment!r} in {objects.url} ({_known(objects)})"
                             + (f"; {_spool_note(waiting, args.home)}" if waiting else ""))
    if waiting:
        print(f"rollbox trajectories: {_spool_note(waiting, args.home)}",
              file=sys.stderr)
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
    table = episode_rows(store_of(args), args.episode, args.experiment, home=args.home)
    experiment = table["experiment"][0].as_py()
    rows = sorted(table.to_pylist(), key=lambda r: r["event_time"])
    for r in rows:
        if args.json:
            print(json.dumps(as_objects(r), default=str))
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
    waiting = unflushed(args.home, experiment=experiment, episode=args.episode)
    if waiting:
        print(f"rollbox trajectories: {_spool_note(waiting, args.home)} "
              "(not shown)", file=sys.stderr)
    return 0


def _export(args: argparse.Namespace) -> int:
    if not args.experiment:
        raise InvalidRequest("export needs --experiment")
    if args.format == "cloudevents" and not args.usage:
        raise InvalidRequest("--format cloudevents is for usage records: add --usage")
    kind = "usage" if args.usage else "trajectories"
    objects = store_of(args)
    if args.experiment not in experiments(objects, kind):
        waiting = unflushed(args.home, kind, experiment=args.experiment)
        raise InvalidRequest(f"no {'usage records' if args.usage else 'steps'} of experiment {args.experiment!r} "
                             f"in {objects.url} ({_known(objects)}); nothing written"
                             + (f"; {_spool_note(waiting, args.home, 'row')}" if waiting else ""))
    table = read(kind, objects, experiment=args.experiment, since=args.since)
    out = sys.stdout.buffer if args.out == "-" else open(args.out, "wb")  # noqa: SIM115
    try:
        if args.format == "parquet":
            pq.write_table(table, out)
        elif args.format == "cloudevents":
            for r in table.to_pylist():
                out.write(json.dumps(usage_event(r), default=str).encode() + b"\n")
        else:
            for r in table.to_pylist():
                out.write(json.dumps(as_objects(r) if kind == "trajectories" else r, default=str).encode() + b"\n")
    finally:
        if out is not sys.stdout.buffer:
            out.close()
    if args.out != "-":
        print(f"{len(table)} rows -> {args.out}", file=sys.stderr)
    return 0
