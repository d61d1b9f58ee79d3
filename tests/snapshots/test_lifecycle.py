"""Retention tiers: the lifecycle rule builder, and ``rollbox store init | show`` against a real S3 server
(SeaweedFS), read back with boto3. SeaweedFS 4 implements expiration and multipart-abort rules but
answers 501 NotImplemented to any storage-class transition; the tests pin that, so a SeaweedFS that
learns transitions makes them fail and the --no-transition workaround can go."""

from __future__ import annotations

import json
from typing import Any

import pytest
from rollbox.functions.cli.main import main
from rollbox.runtime.errors import InvalidRequest, StoreError, StoreUnavailable
from rollbox.snapshots.store_s3 import MAX_LIFETIME_DAYS, is_own_rule, lifecycle_rules

from .s3server import ACCESS_KEY, SECRET_KEY, S3Factory, SeaweedS3

FOREIGN = {"ID": "keep-logs", "Filter": {"Prefix": "logs/"}, "Status": "Enabled", "Expiration": {"Days": 90}}


def by_id(rules: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {r["ID"]: r for r in rules}


def prefixes(rules: list[dict[str, Any]]) -> dict[str, str]:
    return {r["ID"]: r["Filter"]["Prefix"] for r in rules}


# ------------------------------------------------------------------------------- the pure builder
def test_every_rule_is_under_the_store_prefix_and_usage_and_snapshots_have_none() -> None:
    rules = lifecycle_rules("team/run1", state_days=10, cold_days=45, cold_class="DEEP_ARCHIVE")
    assert prefixes(rules) == {
        "rollbox-sandboxes:team/run1": "team/run1/sandboxes/",
        "rollbox-blobs:team/run1": "team/run1/blobs/",
        "rollbox-compiled:team/run1": "team/run1/compiled/",
        "rollbox-trajectories:team/run1": "team/run1/trajectories/",
        "rollbox-multipart:team/run1": "team/run1/",
    }
    rules_ = by_id(rules)
    assert rules_["rollbox-sandboxes:team/run1"]["Expiration"] == {"Days": 10}
    assert rules_["rollbox-blobs:team/run1"]["Expiration"] == {"Days": 10 + MAX_LIFETIME_DAYS + 1} == {"Days": 18}
    assert rules_["rollbox-compiled:team/run1"]["Expiration"] == {"Days": 10}  # (a compile cache: made again)
    assert rules_["rollbox-trajectories:team/run1"]["Transitions"] == [{"Days": 45, "StorageClass": "DEEP_ARCHIVE"}]
    assert "Expiration" not in rules_["rollbox-trajectories:team/run1"]
    assert rules_["rollbox-multipart:team/run1"]["AbortIncompleteMultipartUpload"] == {"DaysAfterInitiation": 1}
    assert set(rules_["rollbox-multipart:team/run1"]) == {"ID", "Filter", "Status", "AbortIncompleteMultipartUpload"}
    assert all(r["Status"] == "Enabled" for r in rules)
    # the only rule that reaches usage/ and the snapshot keys is the multipart abort, which deletes nothing stored
    for kept in ("usage/", "layers/", "manifests/", "names/"):
        covering = [r["ID"] for r in rules if f"team/run1/{kept}x".startswith(r["Filter"]["Prefix"])]
        assert covering == ["rollbox-multipart:team/run1"], kept


def test_defaults_and_a_store_at_the_bucket_root() -> None:
    rules = by_id(lifecycle_rules(""))
    assert prefixes(list(rules.values())) == {"rollbox-sandboxes": "sandboxes/", "rollbox-blobs": "blobs/",
                                              "rollbox-compiled": "compiled/", "rollbox-trajectories": "trajectories/",
                                              "rollbox-multipart": ""}
    assert rules["rollbox-sandboxes"]["Expiration"] == {"Days": 8}
    assert rules["rollbox-blobs"]["Expiration"] == {"Days": 16}
    assert rules["rollbox-trajectories"]["Transitions"] == [{"Days": 30, "StorageClass": "GLACIER_IR"}]
    assert "rollbox-trajectories" not in by_id(lifecycle_rules("", cold_class=None))


@pytest.mark.parametrize(("kw", "message"), [
    ({"state_days": 7}, "state_days 7 is too short: a sandbox lives up to 7 days .* use at least 8"),
    ({"state_days": 0}, "state_days 0 is too short"),
    ({"cold_days": 0}, "cold_days 0: must be at least 1"),
    ({"cold_class": "COLD"}, "cold_class 'COLD' is not an S3 transition storage class; use one of GLACIER"),
    ({"cold_class": "STANDARD_IA", "cold_days": 10}, "S3 moves objects to STANDARD_IA after 30 days at the earliest"),
])
def test_bad_values_are_refused_naming_the_field(kw: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidRequest, match=message):
        lifecycle_rules("p", **kw)


def test_own_rules_are_told_apart_from_other_stores_in_the_same_bucket() -> None:
    a, root = lifecycle_rules("a"), lifecycle_rules("")
    assert all(is_own_rule(r, "a") and not is_own_rule(r, "") and not is_own_rule(r, "a/b") for r in a)
    assert all(is_own_rule(r, "") and not is_own_rule(r, "a") for r in root)
    assert not is_own_rule(FOREIGN, "") and not is_own_rule({"Status": "Enabled"}, "")


# ------------------------------------------------------------------------ against SeaweedFS
@pytest.fixture
def cli(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], seaweed: SeaweedS3) -> Any:
    """``rollbox store ...`` in-process: (exit status, stdout, stderr), with the test server's credentials."""
    for name in ("ROLLBOX_STORE", "ROLLBOX_STATE_DAYS", "ROLLBOX_COLD_DAYS", "ROLLBOX_COLD_CLASS",
                 "ROLLBOX_NO_TRANSITION", "AWS_PROFILE", "AWS_REGION", "AWS_DEFAULT_REGION"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    monkeypatch.setenv("AWS_ENDPOINT_URL", seaweed.endpoint)
    monkeypatch.setenv("COLUMNS", "200")

    def run(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
        with monkeypatch.context() as m:
            for k, v in (env or {}).items():
                m.setenv(k, v)
            capsys.readouterr()
            rc = main(["store", *args])
        out, err = capsys.readouterr()
        return rc, out, err
    return run


def bucket_rules(seaweed: SeaweedS3, bucket: str) -> list[dict[str, Any]]:
    return list(seaweed.client().get_bucket_lifecycle_configuration(Bucket=bucket).get("Rules") or [])


def test_seaweedfs_refuses_transitions_and_init_says_so_changing_nothing(
        cli: Any, s3_url: str, seaweed: SeaweedS3) -> None:
    bucket = s3_url.removeprefix("s3://").split("/")[0]
    seaweed.client().put_bucket_lifecycle_configuration(Bucket=bucket, LifecycleConfiguration={"Rules": [FOREIGN]})

    rc, out, err = cli("init", "--store", s3_url)
    assert rc == 1, (out, err)
    assert "does not implement storage-class transitions (NotImplemented, HTTP 501: 'A header you provided " \
           "implies functionality that is not implemented'), which rule rollbox-trajectories:snapshots needs " \
           "to move trajectories/ to GLACIER_IR; nothing was changed" in err
    assert "--no-transition" in err
    assert bucket_rules(seaweed, bucket) == [FOREIGN]


def test_the_refusal_is_a_store_error_not_an_outage(make_s3: S3Factory, s3_url: str) -> None:
    store = make_s3(s3_url)
    with pytest.raises(StoreError, match="does not implement storage-class transitions") as info:
        store.set_lifecycle(cold_class="STANDARD_IA", cold_days=30)
    assert not isinstance(info.value, StoreUnavailable)
    assert store.lifecycle() == []


def test_init_sets_the_rules_then_show_reads_them_back(cli: Any, s3_url: str, seaweed: SeaweedS3) -> None:
    bucket = s3_url.removeprefix("s3://").split("/")[0]
    rc, out, err = cli("init", "--store", s3_url, "--no-transition", "--state-days", "9", "--json")
    assert rc == 0, err
    expected = lifecycle_rules("snapshots", state_days=9, cold_class=None)
    assert bucket_rules(seaweed, bucket) == expected
    assert json.loads(out) == {"store": s3_url, "bucket": bucket, "rules": expected}

    rc, out, err = cli("show", "--store", s3_url)
    assert rc == 0, err
    for rule_id, prefix, action in (
            ("rollbox-sandboxes:snapshots", "snapshots/sandboxes/", "expire after 9 days"),
            ("rollbox-blobs:snapshots", "snapshots/blobs/", "expire after 17 days"),
            ("rollbox-compiled:snapshots", "snapshots/compiled/", "expire after 9 days"),
            ("rollbox-multipart:snapshots", "snapshots/", "abort incomplete uploads after 1 day")):
        line = next(x for x in out.splitlines() if rule_id in x)
        assert f"'{prefix}'" in line and action in line and "this store" in line, line
    assert "no rule for snapshots/usage/ (the bill)" in out


def test_init_keeps_foreign_rules_and_running_it_twice_changes_nothing(
        cli: Any, s3_url: str, seaweed: SeaweedS3) -> None:
    bucket = s3_url.removeprefix("s3://").split("/")[0]
    other_store = lifecycle_rules("elsewhere", cold_class=None)
    seaweed.client().put_bucket_lifecycle_configuration(
        Bucket=bucket, LifecycleConfiguration={"Rules": [FOREIGN, *other_store]})

    # flags from the environment this time
    env = {"ROLLBOX_STORE": s3_url, "ROLLBOX_NO_TRANSITION": "1"}
    assert cli("init", env=env)[0] == 0
    first = bucket_rules(seaweed, bucket)
    assert first == [FOREIGN, *other_store, *lifecycle_rules("snapshots", cold_class=None)]
    assert cli("init", env=env)[0] == 0
    assert bucket_rules(seaweed, bucket) == first

    # new values replace this store's rules, never add a second copy
    assert cli("init", env={**env, "ROLLBOX_STATE_DAYS": "12"})[0] == 0
    again = bucket_rules(seaweed, bucket)
    assert again == [FOREIGN, *other_store, *lifecycle_rules("snapshots", state_days=12, cold_class=None)]

    rc, out, _ = cli("show", "--store", s3_url, "--json")
    assert rc == 0 and json.loads(out)["rules"] == again


def test_bad_settings_and_local_stores_exit_2_naming_the_problem(cli: Any, s3_url: str, tmp_path: Any) -> None:
    rc, _, err = cli("init", "--store", s3_url, "--no-transition", "--state-days", "7")
    assert rc == 2 and "state_days 7 is too short" in err
    rc, _, err = cli("init", "--store", s3_url, env={"ROLLBOX_STATE_DAYS": "a week"})
    assert rc == 2 and "ROLLBOX_STATE_DAYS='a week': not a whole number of days" in err
    rc, _, err = cli("init", "--store", s3_url, env={"ROLLBOX_NO_TRANSITION": "maybe"})
    assert rc == 2 and "ROLLBOX_NO_TRANSITION='maybe': not a valid bool" in err
    rc, _, err = cli("init", "--store", s3_url, env={"ROLLBOX_COLD_CLASS": "FRIDGE"})
    assert rc == 2 and "cold_class 'FRIDGE' is not an S3 transition storage class" in err
    rc, _, err = cli("init", "--store", s3_url, "--cold-class", "GLACIER", "--no-transition")
    assert rc == 2 and "--cold-class GLACIER and --no-transition contradict each other" in err
    for command in ("init", "show"):
        rc, _, err = cli(command, "--store", str(tmp_path))
        assert rc == 2, command
        assert f"retention tiers are S3 bucket lifecycle rules, and --store {tmp_path} is a directory" in err
        rc, _, err = cli(command)
        assert rc == 2 and "--store (or ROLLBOX_STORE) is required" in err
    rc, _, err = cli("show", "--store", "s3://")  # a message with [brackets] is printed, not parsed as markup
    assert rc == 1 and "invalid S3 store URL 's3://': expected s3://bucket[/prefix]" in err


def test_a_missing_bucket_is_named(cli: Any, seaweed: SeaweedS3) -> None:
    rc, _, err = cli("show", "--store", "s3://rb-no-such-bucket/p")
    assert rc == 1 and "bucket 'rb-no-such-bucket' does not exist" in err and "create the bucket first" in err


def test_a_reused_blob_is_rewritten_so_its_expiry_restarts(make_s3: S3Factory, s3_url: str,
                                                           seaweed: SeaweedS3) -> None:
    """blobs/ expire a lifetime after they were written; a blob written long ago that a new sandbox
    references again must not expire under it: an old one is rewritten in place (same bytes), a
    fresh one is left alone. (Real SeaweedFS; "old" is a threshold of 0 s, as time cannot be faked.)"""
    import time

    from rollbox.snapshots.store_s3 import S3Objects

    s3 = make_s3(s3_url)
    objects = S3Objects(s3)
    client, key = seaweed.client(), f"{s3.prefix}/blobs/ab/abcd"

    def written() -> float:
        return float(client.head_object(Bucket=s3.bucket, Key=key)["LastModified"].timestamp())

    objects.put_content("blobs/ab/abcd", b"same bytes")
    first = written()
    time.sleep(1.1)  # LastModified has one-second resolution
    objects.put_content("blobs/ab/abcd", b"same bytes")  # young: left alone
    assert written() == first and s3.stats["refreshes"] == 0
    objects.put_content("blobs/ab/abcd", b"same bytes", refresh_after_s=0.0)  # old: rewritten
    assert written() > first and s3.stats["refreshes"] == 1
    assert objects.get("blobs/ab/abcd") == b"same bytes"
