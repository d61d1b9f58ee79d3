"""The ``rollbox`` command's own behaviour, run as a real process: missing extras, bad flags, pipes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

# runs the console script with some top-level modules made unimportable (as in an install without that extra)
_WRAPPER = """
import sys
BLOCKED = set(sys.argv[1].split(",")) if sys.argv[1] else set()

class _Blocker:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, _Blocker())
sys.argv = ["rollbox", *sys.argv[2:]]
from rollbox.functions.cli.main import script
script()
"""


def rollbox(*args: str, blocked: str = "", env: dict[str, str] | None = None,
            timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", _WRAPPER, blocked, *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


@pytest.mark.parametrize("blocked", ["pandas", "matplotlib"])
def test_report_without_the_report_extra_names_the_extra(tmp_path: Path, blocked: str) -> None:
    out = tmp_path / "r.html"
    r = rollbox("report", "--experiment", "e", "--home", str(tmp_path), "--out", str(out), blocked=blocked)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip() == "rollbox report needs the 'report' extra: pip install 'rollbox[report]'"
    assert "Traceback" not in r.stderr
    assert not out.exists()


def test_knative_without_the_knative_extra_names_the_extra(tmp_path: Path) -> None:
    r = rollbox("knative", "status", "--namespace", "ns", blocked="kubernetes")
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip() == "rollbox knative needs the 'knative' extra: pip install 'rollbox[knative]'"


def test_help_of_a_command_needs_no_extra() -> None:
    r = rollbox("report", "--help", blocked="pandas,matplotlib")
    assert r.returncode == 0, r.stderr
    assert "usage: rollbox report" in r.stdout


def test_help_lists_every_command_in_plain_text() -> None:
    """`rollbox --help` names every command (replay was missing from its description) and shows no
    reStructuredText marks (``double backticks``), nor does the help of a command or subcommand."""
    from rollbox.functions.cli.main import COMMANDS

    top = rollbox("--help")
    assert top.returncode == 0, top.stderr
    for command in COMMANDS:
        assert f"\n    {command} " in top.stdout or f"\n    {command}\n" in top.stdout, (command, top.stdout)
    assert "ROLLBOX_HOME" in top.stdout  # where the state lives, shared by every checkout
    for args in (("snapshot", "--help"), ("replay", "--help"), ("trajectories", "show", "--help"),
                 ("knative", "--help"), ("serve", "--help")):
        r = rollbox(*args)
        assert r.returncode == 0 and r.stdout.startswith("usage: rollbox"), (args, r.stderr)
        assert "``" not in r.stdout, (args, r.stdout)


@pytest.mark.parametrize(("args", "env", "named"), [
    (("--port", "99999"), {}, "--port: not a TCP port (0-65535; 0: any free port): 99999"),
    ((), {"PORT": "65536"}, "PORT: not a TCP port (0-65535; 0: any free port): 65536"),
])
def test_serve_with_a_port_out_of_range_names_the_flag(tmp_path: Path, args: tuple[str, ...], env: dict[str, str],
                                                       named: str) -> None:
    """(issue 26: an OverflowError traceback from bind)"""
    r = rollbox("serve", "--home", str(tmp_path), *args, env=env)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip() == f"rollbox serve: {named}"
    assert not (tmp_path / "spool").exists()  # refused before anything started


def test_a_reader_that_goes_away_ends_the_command_quietly(tmp_path: Path) -> None:
    """`rollbox trajectories show E | head` (issue 26: a BrokenPipeError traceback): the command ends
    with 141, as one killed by SIGPIPE does, and prints nothing on stderr. The episode's 400 steps
    print ~400 KB, far more than the pipe holds when `head` exits after its first line."""
    import shlex
    import uuid

    from rollbox.functions.contract.records import StepRecord
    from rollbox.functions.recording.recorder import Recorder
    from rollbox.snapshots.state import LocalObjects

    home = tmp_path / "home"
    rows = [("step", StepRecord(experiment="pipe", episode="e", sandbox_id="sb-1", step=i, event_source="/t",
                                event_id=uuid.uuid4().hex, event_type="dev.rollbox.sandbox.exec", event_time=i,
                                recorded_at=i, status=200, replica="r", total_ms=1.0, command=f"echo {i}",
                                exit_code=0, stdout="x" * 1000).model_dump()) for i in range(400)]
    Recorder(home / "spool", LocalObjects(home), "r")._upload(rows, "r.0000000000001.000001")
    wrapper = shlex.join([sys.executable, "-c", _WRAPPER, "", "trajectories", "show", "e", "--home", str(home)])
    for reader in ("head -1", "true"):
        p = subprocess.run(["bash", "-c", f'{wrapper} | {reader} >/dev/null; echo "rc=${{PIPESTATUS[0]}}" >&2'],
                           capture_output=True, text=True, timeout=60)
        assert p.stderr.strip() == "rc=141", p.stderr[-3000:]


def test_serve_takes_the_aws_profile_its_credentials_message_recommends(seaweed: Any, tmp_path: Path) -> None:
    """Without credentials `rollbox serve` says to set them or use --aws-profile / AWS_PROFILE (issue 26:
    serve rejected --aws-profile); doing so starts it on the S3 store, ready. Real SeaweedFS. The start
    line names the home directory in use."""
    import httpx
    from svc_testkit import start_server

    from tests.snapshots.s3server import ACCESS_KEY, SECRET_KEY

    bucket = seaweed.new_bucket()
    store = ["--store", f"s3://{bucket}/p", "--s3-endpoint-url", seaweed.endpoint, "--home", str(tmp_path / "home")]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "ROLLBOX_"))}
    env.update(HOME=str(tmp_path), AWS_CONFIG_FILE=str(tmp_path / "config"), AWS_REGION="us-east-1",
               AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "credentials"), ROLLBOX_S3_MAX_ATTEMPTS="1")
    p = subprocess.run([sys.executable, "-m", "rollbox.functions.cli", "serve", "--port", "0", *store], env=env,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 1, p.stderr[-2000:]
    assert "or --aws-profile / AWS_PROFILE" in p.stdout + p.stderr, (p.stdout + p.stderr)[-2000:]
    (tmp_path / "credentials").write_text(f"[rb]\naws_access_key_id = {ACCESS_KEY}\n"
                                          f"aws_secret_access_key = {SECRET_KEY}\n")
    srv = start_server(tmp_path / "log", *store, "--aws-profile", "rb", env=env)
    try:
        ready = httpx.get(srv.url + "readyz", timeout=10)
        assert (ready.status_code, ready.json()["store_ok"]) == (200, True), ready.text
        listening = next(r for r in srv.log_records() if r.get("msg") == "listening")
        assert listening["home"] == str(tmp_path / "home"), listening
    finally:
        assert srv.stop() == 0


def test_doctor_and_run_say_and_take_the_home_in_use(tmp_path: Path) -> None:
    """The state directory is shared by every command and checkout that sets none (issue 26: not
    documented, nowhere shown): doctor prints the one in use and what `python` names there; run takes
    --home, and restores the `python` built into that home."""
    import json

    home = tmp_path / "home"
    doctor = rollbox("doctor", env={"ROLLBOX_HOME": str(home)})
    assert doctor.returncode == 0, doctor.stdout + doctor.stderr
    assert doctor.stdout.splitlines()[1] == (f"  info home: {home} (from ROLLBOX_HOME); `python` is the built-in "
                                             "snapshot (the host's Python)"), doctor.stdout
    shipped = Path(__file__).resolve().parents[2] / "snapshots" / "templates" / "python.yaml"
    built = rollbox("snapshot", "build", str(shipped), "--home", str(home), "--json")
    assert built.returncode == 0, built.stderr
    sid = json.loads(built.stdout)["id"]
    doctor = rollbox("doctor", env={"ROLLBOX_HOME": str(home)})
    assert f"`python` is snapshot {sid[:12]} built into it" in doctor.stdout.splitlines()[1], doctor.stdout
    ran = rollbox("run", "--home", str(home), "--json", "--code", "print(6 * 7)")
    assert ran.returncode == 0, ran.stderr
    assert json.loads(ran.stdout)["snapshot_id"] == sid  # the home's python, not the built-in
    default = rollbox("run", "--code", "print(1)", env={"ROLLBOX_HOME": str(tmp_path / "other")})
    assert default.returncode == 0 and (tmp_path / "other" / "layers").is_dir(), default.stderr
