"""``rollbox snapshot ...`` black-box: build, push to S3, list, pull into an empty home, show, rm;
flags mirrored by environment variables; errors exit non-zero with a message that names the problem."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from .s3server import ACCESS_KEY, SECRET_KEY, SeaweedS3, make_wheel

ROLLBOX = Path(sys.executable).with_name("rollbox")


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "ROLLBOX_"))}
    return subprocess.run([str(ROLLBOX), "snapshot", *args], env={**base, **(env or {})},
                          capture_output=True, text=True, timeout=120, check=False)


def test_build_push_list_pull_show_rm(tmp_path: Path, s3_url: str, seaweed: SeaweedS3) -> None:
    make_wheel(tmp_path / "wheels")
    tpl = tmp_path / "t.yaml"
    tpl.write_text("name: demo\npackages: [rbdemo]\nwarm: {imports: [rbdemo]}\n")
    a, b = str(tmp_path / "a"), str(tmp_path / "b")

    built = run("build", str(tpl), "--home", a, "--pip-no-index", "--pip-find-links", str(tmp_path / "wheels"),
                "--json")
    assert built.returncode == 0, built.stderr
    info = json.loads(built.stdout)
    assert info["name"] == "demo" and info["version"]["packages"] == {"rbdemo": "1.0"}
    sid = info["id"]

    aws = {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY}
    pushed = run("push", "demo", "--home", a, "--store", s3_url, "--s3-endpoint-url", seaweed.endpoint, env=aws)
    assert pushed.returncode == 0, pushed.stderr
    assert f"pushed {sid}" in pushed.stdout

    # the same settings from the environment instead of flags
    s3_env = {**aws, "ROLLBOX_STORE": s3_url, "AWS_ENDPOINT_URL": seaweed.endpoint}
    listed = run("list", "--json", env=s3_env)
    assert listed.returncode == 0, listed.stderr
    assert [(r["id"], r["names"]) for r in json.loads(listed.stdout)] == [(sid, ["demo"])]

    pulled = run("pull", "demo", env={**s3_env, "ROLLBOX_HOME": b})
    assert pulled.returncode == 0, pulled.stderr
    shown = run("show", "demo", "--home", b, "--json")
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["id"] == sid
    assert json.loads(shown.stdout)["manifest"]["version"]["packages"] == {"rbdemo": "1.0"}

    removed = run("rm", "demo", "--store", b)
    assert removed.returncode == 0 and f"removed {sid} (1 layers freed)" in removed.stdout
    assert json.loads(run("list", "--json", "--store", b).stdout) == []
    assert not any((tmp_path / "b" / "layers").iterdir())


def test_errors_exit_non_zero_and_say_why(tmp_path: Path) -> None:
    home = str(tmp_path / "home")
    missing = run("show", "nope", "--home", home)
    assert missing.returncode == 1 and "no snapshot named 'nope'" in missing.stderr

    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\npackages: nope\nlimits: {pids_max: 1}\n")
    invalid = run("build", str(bad), "--home", home)
    assert invalid.returncode == 2
    assert "limits.pids_max: Input should be greater than or equal to 4" in invalid.stderr

    ok = tmp_path / "ok.yaml"
    ok.write_text("name: x\n")
    flag = run("build", str(ok), "--home", home, env={"ROLLBOX_PIP_NO_INDEX": "maybe"})
    assert flag.returncode == 2 and "ROLLBOX_PIP_NO_INDEX='maybe': not a valid bool" in flag.stderr

    no_store = run("push", "x", "--home", home)
    assert no_store.returncode == 2 and "--store (or ROLLBOX_STORE) is required" in no_store.stderr


def test_a_build_that_moves_a_shared_name_says_so(tmp_path: Path) -> None:
    """The local store is shared by every command and server using its home (issue 26: building
    python.yaml silently re-pointed the built-in `python` for all of them): a build that moves a name
    says which, old -> new id, and `--name` builds under another name."""
    home = str(tmp_path / "home")
    shipped = Path(__file__).resolve().parents[2] / "snapshots" / "templates" / "python.yaml"
    first = run("build", str(shipped), "--home", home, "--json")
    assert first.returncode == 0, first.stderr
    new = json.loads(first.stdout)
    assert (new["name"], new["previous_id"], new["home"]) == ("python", None, home)
    assert "'python' now names this snapshot instead of the built-in one" in first.stderr, first.stderr
    assert f"every rollbox command and server using {home}" in first.stderr
    again = run("build", str(shipped), "--home", home)
    assert again.returncode == 0 and "note:" not in again.stderr, again.stderr  # the same snapshot: nothing moved
    assert f"built python {new['id']} in {home}" in again.stdout
    other = tmp_path / "python.yaml"
    other.write_text(shipped.read_text().replace("imports: [", "imports: [zlib, "))
    moved = run("build", str(other), "--home", home)
    assert moved.returncode == 0, moved.stderr
    now = json.loads(run("show", "python", "--home", home, "--json").stdout)["id"]
    assert now != new["id"] and f"python: {new['id'][:12]} -> {now[:12]}" in moved.stderr, moved.stderr
    apart = run("build", str(shipped), "--home", home, "--name", "python-mine", "--json")
    assert apart.returncode == 0 and "note:" not in apart.stderr, apart.stderr
    assert json.loads(apart.stdout)["name"] == "python-mine"
    assert json.loads(run("show", "python", "--home", home, "--json").stdout)["id"] == now  # left alone
    bad = run("build", str(shipped), "--home", home, "--name", "no/slash")
    assert bad.returncode == 2 and "--name 'no/slash'" in bad.stderr, bad.stderr
