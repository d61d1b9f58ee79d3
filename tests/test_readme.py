"""The README's examples, run as written against a real `rollbox serve` on the embedded default.

Every fenced block of README.md is read from the file: each shell command (continuation lines
joined) and each Python block is either run, and what it prints checked against what the README
says it prints, or not run for a reason named in NOT_RUN. An example this test does not know fails
it, so the test breaks when the README drifts from what runs.

"As written", on a shared machine:
- `rollbox serve` is started from the README's own command (the part after `scripts/bootstrap &&`:
  bootstrap installs Debian packages and makes the venv, which tests/test_fresh_debian.py does on a
  fresh system), with ROLLBOX_HOME in a scratch directory and on a free port given through its PORT
  variable; every `127.0.0.1:8080` of the examples is replaced by that address (the default port
  itself is pinned in tests/functions/test_service_units.py).
- Commands run from a scratch directory with links to the checkout's .venv, snapshots/ and
  loadtest/, so that `task.py` (which `rollbox run --json task.py` reads; the README does not give
  it) is written there, not into the checkout.
- The S3 example runs against the suite's SeaweedFS: its endpoint replaces 127.0.0.1:8333, and the
  bucket is the one the example names.
- Python blocks with top-level `await` run the way the asyncio REPL (`python -m asyncio`) runs them.
- Placeholders of the trajectory commands (EPISODE, E, [--from STEP]) are filled with an episode
  the trainer-loop example recorded.

Not run: the Knative examples (prose, not blocks: `kubectl apply -k knative/overlays/s3`,
`knative.prewarm(...)`) need a Kubernetes cluster (tests/knative validates the manifests and drives
prewarm against a fake API server); benchmarks and load tests of minutes, listed in NOT_RUN.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.functions.svc_testkit import ServerProc
from tests.snapshots.s3server import ACCESS_KEY, SECRET_KEY, SeaweedS3

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DEFAULT_ADDRESS = "127.0.0.1:8080"
README_S3 = "http://127.0.0.1:8333"

pytestmark = pytest.mark.slow


@dataclass(frozen=True)
class Block:
    lang: str
    line: int  # where its first line is in README.md
    text: str


def readme_blocks() -> list[Block]:
    text = README.read_text()
    return [Block(m.group(1), text[: m.start()].count("\n") + 2, m.group(2))
            for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.S | re.M)]


def shell_commands(text: str) -> list[str]:
    """One entry per command line, continuation lines (`\\` at the end) joined."""
    joined = re.sub(r"\\\n\s*", "", text)
    return [line.strip() for line in joined.splitlines() if line.strip() and not line.strip().startswith("#")]


def bare(command: str) -> str:
    """The command without its trailing comment (`   # ...`)."""
    return re.sub(r"\s+#\s.*$", "", command)


# -- what is not run, and why ------------------------------------------------------------------------

BENCH = "a benchmark: minutes of load on the machine (tests/functions/test_loadtest_smoke.py runs short ones)"
LOAD = "a load test of minutes with hundreds or thousands of users (test_loadtest_smoke.py runs a short one)"
NOT_RUN: tuple[tuple[str, str], ...] = (
    (r"^scripts/bootstrap && \.venv/bin/python -m pytest$", "the test suite this test is part of"),
    (r"^\.venv/bin/rollbox snapshot list \| show ID \| rm ID \| push ID \| pull ID$",
     "a synopsis of five subcommands, not one command (tests/snapshots/test_cli.py runs each)"),
    (r"^\.venv/bin/python loadtest/bench_\w+\.py", BENCH),
    (r"\.venv/bin/locust -f loadtest/locustfile\.py --headless", LOAD),
    (r"^\.venv/bin/rollbox serve --home /tmp/rl --port 18096 ", "the server of the 3-minute load test below it"),
    (r"^\.venv/bin/rollbox serve --port 18090 ", "the server of the 5-minute load test below it"),
    (r"^kill \$SERVER_PID; wait \$SERVER_PID$", "stops the load test's server"),
    (r"^\.venv/bin/rollbox report --experiment rl-demo ", "reports on the load test's records (rl-demo)"),
    (r"^scripts/image$", "builds the image (~2 min, as root): tests/knative/test_pod.py builds and runs it"),
    (r"^podman load -i dist/rollbox-", "loads the image into podman: tests/knative/podkit.py does"),
    (r"^kubectl apply -k knative/overlays/s3$", "needs a Kubernetes cluster with Knative (none runs here)"),
)

# -- what is run, and what it must print ----------------------------------------------------------------

Check = Callable[[subprocess.CompletedProcess[str]], None]


def exits(rc: int, *, stdout: str | None = None, has: str = "", err_has: str = "") -> Check:
    def check(p: subprocess.CompletedProcess[str]) -> None:
        assert p.returncode == rc, (p.returncode, p.stdout[-2000:], p.stderr[-3000:])
        if stdout is not None:
            assert p.stdout == stdout, (p.stdout, p.stderr[-2000:])
        assert has in p.stdout, (has, p.stdout[-2000:])
        assert err_has in p.stderr, (err_has, p.stderr[-2000:])
    return check


def replies_42(p: subprocess.CompletedProcess[str]) -> None:  # curl prints the reply event's data
    assert p.returncode == 0 and json.loads(p.stdout)["stdout"] == "42\n", (p.stdout, p.stderr)


def result_of_task(p: subprocess.CompletedProcess[str]) -> None:
    assert p.returncode == 0, p.stderr
    rec = json.loads(p.stdout)
    assert (rec["exit_code"], rec["stdout"], rec["timed_out"]) == (0, "task\n", False), rec


# (regex over the command without its comment, phase, check). Phase 1 runs while the server is up;
# phase 2 after it stopped (its drain flushes the recorded steps to the store, which they read).
COMMANDS: tuple[tuple[str, int, Check], ...] = (
    (r"^\.venv/bin/rollbox run --code 'print\(6 \* 7\)'$", 1, exits(0, stdout="42\n")),
    (r"^\.venv/bin/rollbox run --timeout-s 2 --command 'sleep 9'$", 1, exits(137, err_has="timed out")),
    (r"^\.venv/bin/rollbox run --json task\.py$", 1, result_of_task),
    (r"^\.venv/bin/rollbox doctor$", 1, exits(0, has="ok")),
    (r"^curl -s http://127\.0\.0\.1:8080/ ", 1, replies_42),
    (r"^\.venv/bin/rollbox snapshot build snapshots/templates/python\.yaml$", 1, exits(0, has="built python")),
    (r"^\.venv/bin/python loadtest/locustfile\.py --host http://127\.0\.0\.1:8080 --think-min-s 0 --think-max-s 0$", 1,
     exits(0)),
    (r"^\.venv/bin/rollbox trajectories ls$", 2, exits(0, has="demo")),
    (r"^\.venv/bin/rollbox trajectories show EPISODE$", 2, exits(0, has="assert f(2) == 4")),
    (r"^\.venv/bin/rollbox trajectories export --experiment E --format jsonl --since 2026-12-01 --out e\.jsonl$",
     2, exits(0)),
    (r"^\.venv/bin/rollbox replay EPISODE \[--from STEP\]$", 2, exits(0)),
)
SERVE = r"^(?:scripts/bootstrap && )?(\.venv/bin/rollbox serve)(?: & SERVER_PID=\$!)?$"
SERVE_S3 = r"^\.venv/bin/rollbox serve --store s3://bucket/prefix --s3-endpoint-url http://127\.0\.0\.1:8333$"


def python_check(name: str) -> tuple[list[str], Callable[[dict[str, Any], str], None]]:
    """The names a Python block leaves to check, and the check (over those names and its stdout)."""
    def runtime_api(ns: dict[str, Any], out: str) -> None:
        assert (ns["r"]["stdout"], ns["r"]["files"]) == ("hi", {"a.txt": "hi"}), ns
        assert ns["usage"]["execs"] == 2 and ns["usage"]["billed_s"] >= 1, ns

    def client(ns: dict[str, Any], out: str) -> None:
        assert (ns["r"]["exit_code"], ns["r"]["stdout"]) == (0, "1\n"), ns

    def trainer_loop(ns: dict[str, Any], out: str) -> None:
        assert out == "mean reward 0.312\n", out  # as its comment says: 10 of 32 solutions are right

    return {"runtime": (["r", "usage"], runtime_api), "client": (["r"], client),
            "trainer": ([], trainer_loop)}[name]


PYTHON_BLOCKS = (  # (a line that tells the block, its check)
    ("async with Runtime() as rt:", "runtime"),
    ('async with await Sandbox.create("http://127.0.0.1:8080"', "client"),
    ("async def episode(client: Client, sem: asyncio.Semaphore, i: int) -> float:", "trainer"),
)

# Runs a block with top-level `await` as the asyncio REPL does; prints the names asked for as JSON.
HARNESS = """
import ast, asyncio, json, sys
src = sys.stdin.read()
code = compile(src, "README.md", "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
ns = {"__name__": "__main__"}
async def main():
    result = eval(code, ns)
    if asyncio.iscoroutine(result):
        await result
asyncio.run(main())
dump = lambda v: v.model_dump(mode="json") if hasattr(v, "model_dump") else repr(v)
print(json.dumps({name: dump(ns[name]) for name in sys.argv[1:]}))
"""


def classify_command(command: str) -> tuple[str, Any]:
    """("serve" | "serve_s3" | "run" | "not_run", detail); AssertionError for an unknown command."""
    cmd = bare(command)
    if re.match(SERVE, cmd):
        return "serve", re.match(SERVE, cmd).group(1)  # type: ignore[union-attr]
    if re.match(SERVE_S3, cmd):
        return "serve_s3", cmd
    for pattern, phase, check in COMMANDS:
        if re.search(pattern, cmd):
            return "run", (phase, check)
    for pattern, reason in NOT_RUN:
        if re.search(pattern, cmd):
            return "not_run", reason
    raise AssertionError(f"README.md has an example this test does not know: {command!r}; run it here "
                         "(COMMANDS) or say why not (NOT_RUN)")


def classify_python(block: Block) -> str:
    known = [name for line, name in PYTHON_BLOCKS if line in block.text]
    assert len(known) == 1, f"README.md line {block.line}: a Python example this test does not know"
    return known[0]


def test_every_example_is_known() -> None:
    """Pure: each block of the README is classified (a new or changed example fails here first)."""
    seen_python: set[str] = set()
    serve = 0
    for block in readme_blocks():
        if block.lang == "":
            continue  # no language: printed output (bench tables), not something to run
        assert block.lang in ("sh", "python"), f"README.md line {block.line}: a ```{block.lang} block"
        if block.lang == "python":
            seen_python.add(classify_python(block))
            continue
        for command in shell_commands(block.text):
            kind, _ = classify_command(command)
            serve += kind == "serve"
    assert seen_python == {name for _, name in PYTHON_BLOCKS}, seen_python  # none went missing either
    assert serve >= 1
    for pattern, _, _ in COMMANDS:  # every command checked here is still in the README
        assert any(re.search(pattern, bare(c)) for b in readme_blocks() if b.lang == "sh"
                   for c in shell_commands(b.text)), f"{pattern} is no longer in README.md"


# -- running them ---------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Scratch:
    dir: Path
    env: dict[str, str]
    address: str = DEFAULT_ADDRESS

    def here(self, text: str) -> str:
        return text.replace(DEFAULT_ADDRESS, self.address)

    def sh(self, command: str, timeout_s: float = 180.0) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["bash", "-c", self.here(command)], cwd=self.dir, env=self.env, capture_output=True,
                              text=True, timeout=timeout_s)

    def serve(self, command: str, log: Path, **env: str) -> ServerProc:
        port = free_port()
        with open(log, "wb") as out:
            proc = subprocess.Popen(shlex.split(command), cwd=self.dir, env={**self.env, "PORT": str(port), **env},
                                    stdout=out, stderr=subprocess.STDOUT)
        srv = ServerProc(proc, log, url=f"http://127.0.0.1:{port}/", port=port)
        deadline = time.monotonic() + 90
        while not any(r.get("msg") == "listening" for r in srv.log_records()):
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.05)
        return srv


@pytest.fixture
def scratch(tmp_path: Path) -> Iterator[Scratch]:
    work = tmp_path / "work"
    work.mkdir()
    for name in (".venv", "snapshots", "loadtest"):
        (work / name).symlink_to(REPO / name)
    (work / "task.py").write_text("print('task')\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ROLLBOX_", "AWS_")) and k not in ("PORT", "HOST")}
    env["ROLLBOX_HOME"] = str(tmp_path / "home")
    yield Scratch(work, env)


def run_python(scratch: Scratch, block: Block) -> None:
    names, check = python_check(classify_python(block))
    src = scratch.here(block.text)
    python = str(scratch.dir / ".venv" / "bin" / "python")
    try:
        compile(src, "README.md", "exec")
    except SyntaxError:  # top-level await: as in the asyncio REPL
        p = subprocess.run([python, "-c", HARNESS, *names], input=src, cwd=scratch.dir, env=scratch.env,
                           capture_output=True, text=True, timeout=180)
        assert p.returncode == 0, (block.line, p.stderr[-3000:])
        check(json.loads(p.stdout.splitlines()[-1]), "")
        return
    assert not names
    p = subprocess.run([python, "-c", src], cwd=scratch.dir, env=scratch.env, capture_output=True, text=True,
                       timeout=180)
    assert p.returncode == 0, (block.line, p.stderr[-3000:])
    check({}, p.stdout)


def fill_placeholders(command: str) -> str:
    """The trajectory commands' placeholders, as a reader fills them: an episode of the experiment
    `demo` that the trainer-loop example recorded, its step 1."""
    command = command.replace("[--from STEP]", "--from 1")
    return re.sub(r"\bEPISODE\b", "2", re.sub(r"--experiment E\b", "--experiment demo", command))


def run_s3_example(scratch: Scratch, command: str, seaweed: SeaweedS3, log: Path) -> None:
    bucket = re.search(r"s3://([^/\s]+)", command).group(1)  # type: ignore[union-attr]
    s3 = seaweed.client()
    with contextlib.suppress(s3.exceptions.BucketAlreadyOwnedByYou, s3.exceptions.BucketAlreadyExists):
        s3.create_bucket(Bucket=bucket)
    srv = scratch.serve(command.replace(README_S3, seaweed.endpoint), log, AWS_ACCESS_KEY_ID=ACCESS_KEY,
                        AWS_SECRET_ACCESS_KEY=SECRET_KEY, AWS_REGION="us-east-1")
    try:
        ready = httpx.get(srv.url + "readyz", timeout=10)
        assert (ready.status_code, ready.json()["store_ok"]) == (200, True), ready.text
        r = httpx.post(srv.url, headers={"ce-specversion": "1.0", "ce-type": "dev.rollbox.sandbox.run",
                                         "ce-source": "/readme", "ce-id": "s3-1", "content-type": "application/json"},
                       content=b'{"code": "print(6 * 7)"}', timeout=60)
        assert (r.status_code, r.json()["stdout"]) == (200, "42\n"), r.text
    finally:
        assert srv.stop() == 0, log.read_text()[-3000:]


def test_the_examples_run_as_written(scratch: Scratch, seaweed: SeaweedS3, tmp_path: Path) -> None:
    blocks = readme_blocks()
    serve_cmd = next(detail for b in blocks if b.lang == "sh" for c in shell_commands(b.text)
                     for kind, detail in [classify_command(c)] if kind == "serve")
    server = scratch.serve(serve_cmd, tmp_path / "serve.log")
    scratch.address = f"127.0.0.1:{server.port}"
    ran: list[str] = []
    later: list[tuple[str, Check]] = []
    try:
        for block in blocks:
            if block.lang == "python":
                run_python(scratch, block)
                ran.append(f"python block at line {block.line}")
                continue
            if block.lang != "sh":
                continue
            for command in shell_commands(block.text):
                kind, detail = classify_command(command)
                if kind == "serve_s3":
                    run_s3_example(scratch, detail, seaweed, tmp_path / "serve-s3.log")
                    ran.append(command)
                elif kind == "run":
                    phase, check = detail
                    if phase == 2:
                        later.append((command, check))
                        continue
                    check(scratch.sh(command))
                    ran.append(command)
        records = [r for r in server.log_records() if r.get("msg") == "event"]
        assert records and all(r["status"] < 500 for r in records), [r for r in records if r["status"] >= 500]
    finally:
        os.kill(server.pid, signal.SIGTERM)  # a drain: the recorded steps are flushed to the store
        rc = server.proc.wait(60)
    assert rc == 0, server.log_path.read_text()[-3000:]
    for command, check in later:
        check(scratch.sh(fill_placeholders(command)))
        ran.append(command)
    assert len(ran) == len(COMMANDS) + len(PYTHON_BLOCKS) + 1  # each known example ran (+ the S3 one)
