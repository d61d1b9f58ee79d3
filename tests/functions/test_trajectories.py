"""Trajectories and the usage ledger through real `rollbox serve` processes: every answered step is one
Parquet row in the store (real SeaweedFS, or the local store), written once, kept across kill -9;
every sandbox life is a usage record billed per second; replay re-runs an episode and compares."""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import duckdb
import httpx
import pandas as pd
import pytest
from cloudevents.http import from_dict
from prometheus_client.parser import text_string_to_metric_families
from rollbox.functions.analysis.trajectories import read, steps, usage
from rollbox.functions.cli import main as cli
from rollbox.functions.contract.records import SCHEMA_VERSION
from rollbox.functions.contract.tables import STEP_SCHEMA
from rollbox.functions.recording.recorder import Recorder
from rollbox.snapshots.state import LocalObjects, SandboxRecord, record_key
from rollbox.snapshots.store_s3 import S3Objects
from svc_testkit import Reply, ServerProc, event, send, start_server

from tests.snapshots.s3server import ACCESS_KEY, SECRET_KEY, SeaweedS3, store_factory

pytestmark = pytest.mark.slow

CREATE, EXEC, RUN, DESTROY = ("dev.rollbox.sandbox.create", "dev.rollbox.sandbox.exec", "dev.rollbox.sandbox.run",
                              "dev.rollbox.sandbox.destroy")
ANNOTATE = "dev.rollbox.episode.annotate"


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=60) as client:
        yield client


@pytest.fixture
def servers() -> Iterator[list[ServerProc]]:
    started: list[ServerProc] = []
    try:
        yield started
    finally:
        for srv in started:
            srv.stop()


def s3_env(seaweed: SeaweedS3) -> tuple[str, dict[str, str]]:
    url = f"s3://{seaweed.new_bucket()}/rb"
    return url, {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_REGION": "us-east-1",
                 "ROLLBOX_STORE": url, "AWS_ENDPOINT_URL": seaweed.endpoint}


async def ok(http: httpx.AsyncClient, srv: ServerProc, etype: str, data: dict[str, Any], **kw: Any) -> Reply:
    r = await send(http, srv.url, event(etype, data, **kw))
    assert r.status == 200, r.data
    return r


def download(seaweed: SeaweedS3, url: str, prefix: str, to: Path) -> list[str]:
    """The store's Parquet files under ``prefix``, copied as they are (hive paths kept) into ``to``."""
    bucket, _, root = url.removeprefix("s3://").partition("/")
    s3 = seaweed.client()
    keys = [o["Key"] for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=f"{root}/{prefix}")
            for o in page.get("Contents", [])]
    for key in keys:
        dest = to / key.removeprefix(f"{root}/")
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(s3.get_object(Bucket=bucket, Key=key)["Body"].read())
    return keys


async def test_an_episode_mix_is_parquet_in_s3_every_step_once_rewards_attached(
        seaweed: SeaweedS3, servers: list[ServerProc], http: httpx.AsyncClient, tmp_path: Path) -> None:
    url, env = s3_env(seaweed)
    a = start_server(tmp_path / "a", "--home", str(tmp_path / "ha"), env=env)
    b = start_server(tmp_path / "b", "--home", str(tmp_path / "hb"), env=env)
    servers += [a, b]
    exp = f"exp-{uuid.uuid4().hex[:6]}"
    answered: list[str] = []  # event ids answered 200

    async def episode(n: int) -> None:
        meta = {"experiment": exp, "episode": f"ep{n}", "task": "sum"}
        r = await ok(http, a, CREATE, {"metadata": meta}, id=f"c{n}")
        sid = r.data["sandbox_id"]
        answered.append(f"c{n}")
        for i in range(3):
            srv = (a, b)[i % 2]  # steps alternate between the replicas
            await ok(http, srv, EXEC, {"sandbox_id": sid, "code": f"print({i} + {n})"}, id=f"x{n}-{i}")
            answered.append(f"x{n}-{i}")
        # retries: the same event again on the same replica (its cache) and on the other (the store)
        again = await ok(http, b, EXEC, {"sandbox_id": sid, "code": f"print({2} + {n})"}, id=f"x{n}-2")
        assert again.data["stdout"] == f"{2 + n}\n"
        await ok(http, a, EXEC, {"sandbox_id": sid, "code": f"print({2} + {n})"}, id=f"x{n}-2")
        await ok(http, b, ANNOTATE, {"experiment": exp, "episode": f"ep{n}", "reward": n / 10,
                                     "labels": {"judge": "unit"}}, id=f"a{n}")
        await ok(http, a, DESTROY, {"sandbox_id": sid, "outcome": {"reward": float(n)}}, id=f"d{n}")
        answered.extend([f"a{n}", f"d{n}"])

    await asyncio.gather(*(episode(n) for n in range(3)))
    await ok(http, b, RUN, {"code": "print('one shot')", "metadata": {"experiment": exp, "episode": "ep-run"}},
             id="r0")
    answered.append("r0")
    # a final error is a step too (the sandbox is gone); a malformed event is not
    gone = await send(http, a.url, event(EXEC, {"sandbox_id": "sb-never-made", "code": "1"}, id="missing"))
    assert gone.status == 404
    bad = await send(http, a.url, event(EXEC, {"code": "no sandbox id"}, id="bad"))
    assert bad.status == 400
    assert a.stop() == 0 and b.stop() == 0  # drain flushes the spool

    keys = download(seaweed, url, "trajectories/", tmp_path / "dl")
    assert keys and all(f"trajectories/experiment={exp}/date=" in k or "experiment=default/" in k for k in keys)
    raw = pd.read_parquet(tmp_path / "dl" / "trajectories" / f"experiment={exp}")
    counts = raw["event_id"].value_counts()
    assert sorted(counts.index) == sorted(answered) and set(counts) == {1}, counts[counts > 1]
    assert set(raw["schema_version"]) == {SCHEMA_VERSION}
    ex = raw[raw.event_type == EXEC].sort_values(["episode", "step"])
    assert list(ex[ex.episode == "ep1"]["stdout"]) == ["1\n", "2\n", "3\n"]
    assert list(ex[ex.episode == "ep1"]["step"]) == [1, 2, 3]
    assert set(ex["replica"]) == {a_replica for a_replica in set(raw["replica"])} and len(set(ex["replica"])) == 2
    assert ex["snapshot_id"].notna().all() and ex["env_version"].notna().all()
    destroys = raw[raw.event_type == DESTROY].set_index("episode")
    assert destroys.loc["ep2", "reward"] == 2.0
    notes = raw[raw.event_type == ANNOTATE].set_index("episode")
    assert notes.loc["ep1", "reward"] == 0.1 and json.loads(notes.loc["ep1", "labels"]) == {"judge": "unit"}
    # the documented schema, as duckdb sees it through hive partitioning
    db = duckdb.sql(f"select experiment, count(*) n from read_parquet('{tmp_path}/dl/trajectories/**/*.parquet', "
                    "hive_partitioning=true) group by experiment").fetchall()
    assert (exp, len(answered)) in db
    assert set(STEP_SCHEMA.names) <= set(raw.columns)
    # the reading API: the same rows, from S3
    df = steps(S3Objects(store_factory(seaweed)(url)), experiment=exp)
    assert sorted(df["event_id"]) == sorted(answered)
    missing = steps(S3Objects(store_factory(seaweed)(url)))
    assert "missing" in set(missing["event_id"]) and "bad" not in set(missing["event_id"])
    # usage: one record per sandbox life (3 sandboxes + 1 run), each billed at least a second
    u = usage(S3Objects(store_factory(seaweed)(url)), experiment=exp)
    assert sorted(u["kind"]) == ["run", "sandbox", "sandbox", "sandbox"]
    assert (u["billed_s"] >= 1).all() and (u["vcpu_s"] == u["billed_s"] * u["cpu_max_cores"]).all()


async def test_kill_9_mid_experiment_and_a_restart_lose_no_acknowledged_step(
        servers: list[ServerProc], http: httpx.AsyncClient, tmp_path: Path) -> None:
    home = tmp_path / "home"
    args = ("--home", str(home), "--flush-interval-s", "3600")  # rows stay in the spool until the crash
    a = start_server(tmp_path / "a", *args)
    servers.append(a)
    r = await ok(http, a, CREATE, {"metadata": {"experiment": "crash", "episode": "e"}}, id="c")
    sid = r.data["sandbox_id"]
    acked = ["c"]
    for i in range(20):
        await ok(http, a, EXEC, {"sandbox_id": sid, "command": f"echo {i} >> f; wc -l < f"}, id=f"x{i}")
        acked.append(f"x{i}")
    await ok(http, a, RUN, {"code": "print(1)", "metadata": {"experiment": "crash"}}, id="r")
    acked.append("r")
    os.kill(a.pid, signal.SIGKILL)
    a.proc.wait(10)
    assert list((home / "spool").glob("*.jsonl")), "the rows were in the spool when the server died"
    assert not list(home.glob("trajectories/**/*.parquet"))
    b = start_server(tmp_path / "b", *args)  # flushes what the dead one left, at start
    servers.append(b)
    await ok(http, b, EXEC, {"sandbox_id": sid, "command": "wc -l < f"}, id="after")
    assert b.stop() == 0
    df = steps(str(home), experiment="crash")
    assert sorted(df["event_id"]) == sorted([*acked, "after"])
    assert df[df.event_id == "after"]["stdout"].iloc[0] == "20\n"
    assert not list((home / "spool").glob("*.jsonl"))


async def test_a_sandbox_that_lived_2_3_s_is_3_billed_seconds_at_its_limits(
        servers: list[ServerProc], http: httpx.AsyncClient, tmp_path: Path) -> None:
    srv = start_server(tmp_path / "s", "--home", str(tmp_path / "home"))
    servers.append(srv)
    limits = {"cpu_max_cores": 2.0, "memory_max_bytes": 1024**3}
    r = await ok(http, srv, CREATE, {"metadata": {"experiment": "bill"}, "limits": limits})
    sid = r.data["sandbox_id"]
    await ok(http, srv, EXEC, {"sandbox_id": sid, "command": "sleep 2.3"})
    d = await ok(http, srv, DESTROY, {"sandbox_id": sid})
    # whole seconds, rounded up: 3 (on a loaded box its create and destroy may add past 3.0 s: then 4)
    billed = d.data["billed_s"]
    assert 2.3 <= d.data["wall_s"] < 4.0 and billed == math.ceil(d.data["wall_s"]), d.data
    text = (await http.get(srv.url.rstrip("/") + "/metrics")).text
    vcpu = [s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name == "rollbox_billed_vcpu_seconds_total" and s.labels.get("experiment") == "bill"]
    assert vcpu == [2.0 * billed]
    assert srv.stop() == 0
    row = usage(str(tmp_path / "home"), experiment="bill").iloc[0]
    assert (row.billed_s, row.vcpu_s, row.gib_s, row.kind, row.sandbox_id) == (billed, 2.0 * billed, 1.0 * billed,
                                                                             "sandbox", sid)
    assert row.cost_usd == pytest.approx(2 * billed * 0.000014 + billed * 0.0000045)
    # the same record as the CloudEvent a metering system ingests (OpenMeter takes these)
    out = tmp_path / "usage.jsonl"
    assert cli.main(["trajectories", "export", "--home", str(tmp_path / "home"), "--experiment", "bill", "--usage",
                     "--format", "cloudevents", "--out", str(out)]) == 0
    [ce] = [from_dict(json.loads(line)) for line in out.read_text().splitlines()]
    assert (ce["type"], ce["subject"], ce["id"], ce.data["billed_s"], ce.data["vcpu_s"]) == (
        "dev.rollbox.usage", sid, sid, billed, 2.0 * billed)
    assert cli.main(["trajectories", "export", "--home", str(tmp_path / "home"), "--experiment", "bill",
                     "--format", "cloudevents"]) == 2  # steps are not usage events


def test_spool_left_by_a_dead_process_keeps_only_committed_pending_rows(tmp_path: Path) -> None:
    """A durable step's row is spooled before its commit: after a crash, a row whose generation was
    committed by that process is kept, one whose commit never happened (or was another's) is not."""
    objects = LocalObjects(tmp_path / "store")

    def commit(sid: str, gen: int, writer: str) -> None:
        rec = SandboxRecord(sandbox_id=sid, generation=gen, snapshot="python", limits={}, created_at=1.0,
                            last_used=1.0, writer=writer)
        assert objects.put_new(record_key(sid, gen), rec.to_bytes())

    commit("sb-a", 0, "dead-1")
    commit("sb-b", 0, "other-2")  # another replica won generation 0 of sb-b
    spool = tmp_path / "spool"
    spool.mkdir()

    def line(eid: str, pending: list[Any] | None) -> str:
        row = {"experiment": "x", "event_source": "/t", "event_id": eid, "event_type": EXEC, "event_time": 1.0,
               "recorded_at": 1.0, "status": 200, "replica": "dead-1", "total_ms": 1.0}
        return json.dumps({"k": "step", "r": row, **({"p": pending} if pending else {})})

    (spool / "dead-1.1.000001.jsonl").write_text("\n".join([
        line("committed", ["sb-a", 0, "dead-1"]), line("lost-race", ["sb-b", 0, "dead-1"]),
        line("never", ["sb-c", 0, "dead-1"]), line("plain", None)]) + '\n{"k": "step", "r": {tor')

    async def go() -> None:
        rec = Recorder(spool, objects, "new-3")
        await rec.start()
        await rec.close()

    asyncio.run(go())
    assert sorted(read("trajectories", objects)["event_id"].to_pylist()) == ["committed", "plain"]
    assert not list(spool.glob("*.jsonl"))


async def test_trajectories_cli_and_replay_of_a_deterministic_and_a_random_episode(
        servers: list[ServerProc], http: httpx.AsyncClient, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    home = tmp_path / "home"
    srv = start_server(tmp_path / "s", "--home", str(home))
    servers.append(srv)
    for episode, code in (("det", "import hashlib; print(hashlib.sha256(open('n').read().encode()).hexdigest())"),
                          ("rnd", "import random; print(random.random())")):
        r = await ok(http, srv, CREATE, {"metadata": {"experiment": "rp", "episode": episode}})
        sid = r.data["sandbox_id"]
        await ok(http, srv, EXEC, {"sandbox_id": sid, "command": "echo 7 > n", "files": {"in.txt": "hi"}})
        await ok(http, srv, EXEC, {"sandbox_id": sid, "code": code, "read_files": ["n", "in.txt", "none"]})
        await ok(http, srv, DESTROY, {"sandbox_id": sid})
    assert srv.stop() == 0

    assert cli.main(["trajectories", "ls", "--home", str(home), "--experiment", "rp"]) == 0
    out = capsys.readouterr().out
    assert "det" in out and "rnd" in out and out.count(" 4 ") >= 2  # create, 2 execs, destroy each
    assert cli.main(["trajectories", "show", "det", "--home", str(home)]) == 0
    assert "$ echo 7 > n" in capsys.readouterr().out
    target = tmp_path / "rp.parquet"
    assert cli.main(["trajectories", "export", "--home", str(home), "--experiment", "rp", "--out", str(target)]) == 0
    assert len(pd.read_parquet(target)) == 8
    assert cli.main(["trajectories", "show", "nope", "--home", str(home)]) == 2

    assert await asyncio.to_thread(cli.main, ["replay", "det", "--home", str(home)]) == 0
    out = capsys.readouterr().out
    assert "2 of 2 steps identical" in out and "DIFFERENT" not in out
    assert await asyncio.to_thread(cli.main, ["replay", "rnd", "--home", str(home)]) == 1
    out = capsys.readouterr().out
    assert "1 of 2 steps identical" in out and "DIFFERENT" in out and "stdout: line 1: recorded '0." in out
    assert await asyncio.to_thread(cli.main, ["replay", "det", "--home", str(home), "--from", "2", "--json"]) == 0
    rows = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [(r["step"], r["same"]) for r in rows] == [(2, True)]


def test_rows_are_exactly_the_documented_models(tmp_path: Path) -> None:
    """Rows are built as plain dicts on the hot path: they must validate against StepRecord and
    UsageRecord, carry no other field, and reach Parquet as exactly the documented columns, a field a
    row left out holding the model's default."""
    from rollbox.functions.contract.models import ExecData
    from rollbox.functions.contract.records import StepRecord, UsageRecord
    from rollbox.functions.recording.recorder import Prices, usage_row
    from rollbox.functions.recording.steps import StepContext, StepLog
    from rollbox.runtime.spec import ExecResult, Limits, Usage

    log = StepLog(Recorder(tmp_path, LocalObjects(tmp_path / "s"), "r"), env_version=lambda _s: {"python": "3"},
                  labels=lambda _s: {"experiment": "x", "episode": "e"})
    data = ExecData(sandbox_id="sb-1", code="print(1)", files={"a.txt": "hé"}, read_files=["b"], env={"K": "v"})
    ctx = StepContext(EXEC, "/src", "id-1", 1.0, data)
    reply = ExecResult(sandbox_id="sb-1", snapshot_id="snap", exit_code=0, stdout="1\n", files={"b": None})
    row = log.row(ctx, 200, reply, None)
    assert set(row) <= set(StepRecord.model_fields)
    rec = StepRecord.model_validate(row)
    assert (rec.experiment, rec.episode, rec.env_version, rec.files_in[0].bytes, rec.files_out[0].bytes) == (
        "x", "e", '{"python":"3"}', 3, None)
    u = usage_row(Usage(sandbox_id="sb-1", snapshot_id="snap", metadata={"experiment": "x"}, wall_s=0.2, cpu_s=0.1,
                        peak_memory_bytes=1, billed_s=1, execs=1, reason="destroyed"),
                  Limits(cpu_max_cores=0.5), kind="sandbox", replica="r", prices=Prices(), usage_id="u")
    assert set(u) == set(UsageRecord.model_fields) and UsageRecord.model_validate(u).billed_s == 1

    bare = {"experiment": "x", "event_source": "/src", "event_id": "id-2", "event_type": EXEC, "event_time": 2.0,
            "recorded_at": 2.0, "status": 200, "replica": "r", "total_ms": 1.0}  # only the required fields
    log.recorder._upload([("step", row), ("step", bare), ("usage", u)], "r.1.000001")
    steps = read("trajectories", log.recorder.objects)
    assert sorted(steps.column_names) == sorted([*StepRecord.model_fields, "date"])
    by_id = {r["event_id"]: r for r in steps.to_pylist()}
    assert by_id["id-2"]["schema_version"] == 1 and by_id["id-2"]["files_in"] == [] == by_id["id-2"]["read_files"]
    assert by_id["id-1"]["files_in"] == [{"path": "a.txt", "bytes": 3}] and by_id["id-1"]["stdout"] == "1\n"
    StepRecord.model_validate({k: v for k, v in by_id["id-1"].items() if k != "date"} | {
        "event_time": 1.0, "recorded_at": row["recorded_at"]})
    assert read("usage", log.recorder.objects).to_pylist()[0]["usage_id"] == "u"


FORK = "dev.rollbox.sandbox.fork"


async def test_replay_forks_the_children_again_and_names_what_it_cannot_replay(
        servers: list[ServerProc], http: httpx.AsyncClient, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An episode that forks (issue 26: "3 of 4 steps identical" for 6 execs, the children's steps
    silently left out): the children are forked again at the same point of the parent's steps and
    their steps replayed; children labelled with another episode are that episode's, where their
    steps are listed as not replayed, with the reason, and the exit status is 1."""
    home = tmp_path / "home"
    srv = start_server(tmp_path / "s", "--home", str(home))
    servers.append(srv)
    meta = {"experiment": "fk", "episode": "tree"}
    sid = (await ok(http, srv, CREATE, {"metadata": meta})).data["sandbox_id"]
    await ok(http, srv, EXEC, {"sandbox_id": sid, "command": "echo base > f"})
    kids = [c["sandbox_id"] for c in (await ok(http, srv, FORK, {"sandbox_id": sid, "count": 2})).data["sandboxes"]]
    for i, kid in enumerate(kids):
        await ok(http, srv, EXEC, {"sandbox_id": kid, "command": f"echo child{i} >> f; cat f"})
    await ok(http, srv, EXEC, {"sandbox_id": sid, "command": "echo parent >> f; cat f"})
    grandkid = (await ok(http, srv, FORK, {"sandbox_id": kids[0], "count": 1})).data["sandboxes"][0]["sandbox_id"]
    await ok(http, srv, EXEC, {"sandbox_id": grandkid, "command": "cat f"})
    away = (await ok(http, srv, FORK, {"sandbox_id": sid, "count": 1, "metadata": {"experiment": "fk",
                                                                                   "episode": "away"}}))
    await ok(http, srv, EXEC, {"sandbox_id": away.data["sandboxes"][0]["sandbox_id"], "command": "cat f"})
    for s in (sid, *kids, grandkid):
        await ok(http, srv, DESTROY, {"sandbox_id": s})
    assert srv.stop() == 0

    assert await asyncio.to_thread(cli.main, ["replay", "tree", "--home", str(home)]) == 0
    out = capsys.readouterr().out
    assert "5 of 5 steps identical" in out, out  # 2 of the parent, 1 of each child, 1 of the grandchild
    for s in (sid, *kids, grandkid):
        assert s in out, (s, out)
    assert await asyncio.to_thread(cli.main, ["replay", "away", "--home", str(home), "--experiment", "fk"]) == 1
    out = capsys.readouterr().out
    assert "NOT REPLAYED" in out and "its sandbox's create or fork is not among this episode's" in out, out
    assert "0 of 1 steps identical, 1 not replayed" in out, out


def _store_rows(home: Path, rows: list[dict[str, Any]], segment: str = "r1.0000000000001.000001") -> None:
    """Rows written to the local store of ``home`` by the recorder's own upload (as a flush does)."""
    from rollbox.functions.contract.records import StepRecord

    lines = [("step", StepRecord(**{"event_source": "/t", "event_id": uuid.uuid4().hex, "event_type": EXEC,
                                    "event_time": 1.0, "recorded_at": 1.0, "status": 200, "replica": "r1",
                                    "total_ms": 1.0, **r}).model_dump()) for r in rows]
    Recorder(home / "spool", LocalObjects(home), "r1")._upload(lines, segment)


def test_an_episode_name_two_experiments_use_is_refused_without_experiment(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The README's trainer names its episodes 0..31, as every other experiment may (issue 26: show and
    replay mixed them): without --experiment, a name in two experiments is refused (exit 2) naming them."""
    home = tmp_path / "home"
    _store_rows(home, [{"experiment": "a", "episode": "0", "sandbox_id": "sb-a", "command": "echo a"},
                       {"experiment": "b", "episode": "0", "sandbox_id": "sb-b", "command": "echo b"},
                       {"experiment": "b", "episode": "1", "sandbox_id": "sb-c", "command": "echo c"}])
    for command in (["trajectories", "show", "0"], ["replay", "0"]):
        assert cli.main([*command, "--home", str(home)]) == 2
        err = capsys.readouterr().err
        assert "episode '0' is in 2 experiments: a, b; give --experiment to say which" in err, err
    assert cli.main(["trajectories", "show", "0", "--home", str(home), "--experiment", "b"]) == 0
    out = capsys.readouterr().out
    assert "$ echo b" in out and "echo a" not in out
    assert cli.main(["trajectories", "show", "1", "--home", str(home)]) == 0  # one experiment has it: no doubt
    assert "$ echo c" in capsys.readouterr().out


def test_export_of_an_unknown_experiment_writes_nothing_and_names_the_known_ones(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """(issue 26: an empty file and exit 0)"""
    home = tmp_path / "home"
    _store_rows(home, [{"experiment": "known-1", "episode": "e"}, {"experiment": "known-2", "episode": "e"}])
    target = tmp_path / "out.jsonl"
    for extra in ([], ["--usage"], ["--format", "jsonl"]):
        assert cli.main(["trajectories", "export", "--home", str(home), "--experiment", "nope", "--out",
                         str(target), *extra]) == 2
        err = capsys.readouterr().err
        assert "of experiment 'nope'" in err and "known-1, known-2" in err and "nothing written" in err, err
        assert not target.exists()
    assert cli.main(["trajectories", "ls", "--home", str(home), "--experiment", "nope"]) == 2
    assert "known-1, known-2" in capsys.readouterr().err


def test_jsonl_export_and_show_json_give_json_columns_as_objects(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """(issue 26: `limits` and `env_version` were JSON strings inside the JSON line)"""
    from rollbox.functions.analysis.trajectories import JSON_COLUMNS
    from rollbox.functions.contract.records import StepRecord

    # every column the schema documents as JSON text is decoded
    assert set(JSON_COLUMNS) == {n for n, f in StepRecord.model_fields.items() if "JSON" in (f.description or "")}
    home = tmp_path / "home"
    _store_rows(home, [{"experiment": "j", "episode": "e", "sandbox_id": "sb-j", "event_type": CREATE,
                        "limits": '{"cpu_max_cores":1.0}', "env_version": '{"python":"3.11"}',
                        "labels": '{"k":"v"}'},
                       {"experiment": "j", "episode": "e", "sandbox_id": "sb-j", "env": '{"A":"1"}',
                        "files_in_text": '{"a.txt":"hi"}', "files_out_text": '{"b":null}', "event_time": 2.0}])
    target = tmp_path / "j.jsonl"
    assert cli.main(["trajectories", "export", "--home", str(home), "--experiment", "j", "--format", "jsonl",
                     "--out", str(target)]) == 0
    exported = [json.loads(line) for line in target.read_text().splitlines()]
    assert cli.main(["trajectories", "show", "e", "--home", str(home), "--json"]) == 0
    shown = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    for rows in (sorted(exported, key=lambda r: r["event_time"]), shown):
        assert rows[0]["limits"] == {"cpu_max_cores": 1.0} and rows[0]["env_version"] == {"python": "3.11"}
        assert rows[0]["labels"] == {"k": "v"}
        assert (rows[1]["env"], rows[1]["files_in_text"], rows[1]["files_out_text"]) == (
            {"A": "1"}, {"a.txt": "hi"}, {"b": None})
    # Parquet keeps the documented string columns
    assert cli.main(["trajectories", "export", "--home", str(home), "--experiment", "j", "--out",
                     str(tmp_path / "j.parquet")]) == 0
    assert pd.read_parquet(tmp_path / "j.parquet")["limits"].dropna().tolist() == ['{"cpu_max_cores":1.0}']


def test_steps_still_in_the_spool_are_named_when_the_store_has_fewer(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Steps reach the store when a server flushes its spool (every 10 s by default; issue 26: nothing
    said so): show and ls say how many of the steps asked for are still in the spool of --home."""
    from rollbox.functions.recording.recorder import spool_line

    home = tmp_path / "home"
    _store_rows(home, [{"experiment": "sp", "episode": "e", "sandbox_id": "sb-1", "command": "echo flushed"}])
    (home / "spool").mkdir(parents=True, exist_ok=True)
    pending = [{"experiment": "sp", "episode": "e", "sandbox_id": "sb-1"},
               {"experiment": "sp", "episode": "e", "sandbox_id": "sb-1"},
               {"experiment": "sp", "episode": "later"}, {"experiment": "other", "episode": "e"}]
    (home / "spool" / "r9.0000000000001.000001.jsonl").write_bytes(
        b"".join(spool_line("step", r) for r in pending) + b'{"k":"step","r":{"exper')  # a line being written

    assert cli.main(["trajectories", "show", "e", "--home", str(home), "--experiment", "sp"]) == 0
    captured = capsys.readouterr()
    assert "$ echo flushed" in captured.out
    assert f"2 more recorded steps are not in the store yet: in the spool of {home}" in captured.err, captured.err
    assert "every --flush-interval-s (10 s by default)" in captured.err
    assert cli.main(["trajectories", "show", "later", "--home", str(home)]) == 2
    err = capsys.readouterr().err
    assert "no steps of episode 'later'" in err and "1 more recorded step is not in the store yet" in err, err
    assert cli.main(["trajectories", "ls", "--home", str(home)]) == 0
    assert "4 more recorded steps are not in the store yet" in capsys.readouterr().err
