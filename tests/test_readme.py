"""The README's examples, run as written against a real `rollbox serve` on the embedded default.

Every fenced block of README.md and of docs/benchmarks.md (where the benchmarks' commands live) is
read from the file: each shell command (continuation lines joined) and each Python block is run, and
what it prints checked against what the README says it prints; or, for the commands of minutes
(benchmarks, load tests, the image build), checked in a quick form named in CHECKED; or not run for a
reason named in NOT_RUN. An example this test does not know fails it, so the test breaks when the
README drifts from what runs. Every path of the repository they name (`examples/task.py`,
`loadtest/bench_restore.py`, `docs/design.md`, ...) must exist; every command of the README's table
of figures must be one of docs/benchmarks.md's; the README's Layout table must name every folder.

"As written", on a shared machine:
- Python blocks are complete programs, run as they are (`python -c BLOCK`); `examples/runtime_demo.py`
  is the README's Runtime block, character for character.
- Commands run from a scratch directory with links to the checkout's .venv, examples/, snapshots/ and
  loadtest/ (the files the commands name), so that what they write (e.jsonl) is not written into the
  checkout.
- `rollbox serve` is started from the README's own command (the part after `scripts/bootstrap &&`:
  bootstrap installs Debian packages and makes the venv, which tests/test_fresh_debian.py does on a
  fresh system), with ROLLBOX_HOME in a scratch directory (the home the README tells a user to set to
  keep state apart) and on a free port given through its PORT variable; every `127.0.0.1:8080` of the
  examples is replaced by that address (the default port itself is pinned in
  tests/functions/test_service_units.py).
- The S3 examples (snapshot push and pull, serve on S3) run against the suite's SeaweedFS: its endpoint
  replaces 127.0.0.1:8333, its credentials are in the AWS variables, and the bucket is the one the
  examples name.
- Placeholders of the trajectory commands (EPISODE, E, [--from STEP]) are filled with an episode the
  trainer-loop example recorded (experiment `demo`, episode 2, step 1). `rollbox report` runs on that
  experiment and the scratch home instead of the load test's `rl-demo` in /tmp/rl, which it needs a
  3-minute load to fill.

Checked, not run (CHECKED): benchmarks and load tests of minutes are run with `--help` (benchmarks:
every flag of the README's command is one the script takes) or, for Locust, with the README's exact
arguments plus `--list` (Locust loads the locustfile, parses every flag, lists the users and exits);
their servers' commands are parsed by the CLI's own parser and option checks; `scripts/image` is
syntax-checked and asked for its usage. Not run (NOT_RUN): the test suite itself, podman and kubectl
(tests/knative builds and runs the image under podman; no Kubernetes cluster runs here). The quick
forms are independent of each other and of the examples run (they start no server and write nothing):
they run two at a time beside the examples, each distinct one once (three benchmark commands of
bench_service.py are checked against one `--help`), and each example is checked against its output.
The commands run after the server stopped (trajectories, replay, report: each reads the store, writes
its own output) run two at a time too.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.functions.svc_testkit import ServerProc
from tests.snapshots.s3server import ACCESS_KEY, SECRET_KEY, SeaweedS3, free_ports

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
BENCHMARKS = REPO / "docs" / "benchmarks.md"
DOCS = (README, BENCHMARKS)  # the documents whose fenced blocks are examples
DEFAULT_ADDRESS = "127.0.0.1:8080"
README_S3 = "http://127.0.0.1:8333"
LINKED = (".venv", "examples", "snapshots", "loadtest")  # what the commands name, linked into the scratch dir

pytestmark = pytest.mark.slow


@dataclass(frozen=True)
class Block:
    lang: str
    line: int  # where its first line is in its document
    text: str
    doc: str = "README.md"


def readme_blocks() -> list[Block]:
    """The fenced blocks of README.md, then of docs/benchmarks.md."""
    blocks = []
    for doc in DOCS:
        text = doc.read_text()
        blocks += [Block(m.group(1), text[: m.start()].count("\n") + 2, m.group(2), str(doc.relative_to(REPO)))
                   for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.S | re.M)]
    return blocks


def shell_commands(text: str) -> list[str]:
    """One entry per command line, continuation lines (`\\` at the end) joined."""
    joined = re.sub(r"\\\n\s*", "", text)
    return [line.strip() for line in joined.splitlines() if line.strip() and not line.strip().startswith("#")]


def bare(command: str) -> str:
    """The command without its trailing comment (`   # ...`)."""
    return re.sub(r"\s+#\s.*$", "", command)


# -- checked in a quick form, and not run ----------------------------------------------------------------

Quick = Callable[[str], tuple[str, Callable[[subprocess.CompletedProcess[str], str], None]]]


def _flags_of(command: str) -> list[str]:
    return sorted({w.split("=", 1)[0] for w in shlex.split(command) if w.startswith("--")})


def bench_help(command: str) -> tuple[str, Callable[[subprocess.CompletedProcess[str], str], None]]:
    """A benchmark: `python loadtest/bench_x.py --help`, which must list every flag the README gives it."""
    script = re.search(r"loadtest/\w+\.py", command).group(0)  # type: ignore[union-attr]

    def check(p: subprocess.CompletedProcess[str], cmd: str) -> None:
        assert p.returncode == 0 and p.stdout.startswith("usage:"), (cmd, p.stdout[-1000:], p.stderr[-2000:])
        missing = [f for f in _flags_of(bare(command)) if f not in p.stdout]
        assert not missing, f"{command}: {missing} not in {script} --help"
    return f".venv/bin/python {script} --help", check


def rootless_bench(command: str) -> tuple[str, Callable[[subprocess.CompletedProcess[str], str], None]]:
    """A benchmark run as an unprivileged user (`su USER -s /bin/sh -c 'BENCH'`): the benchmark's --help."""
    return bench_help(shlex.split(bare(command))[-1])


def locust_list(command: str) -> tuple[str, Callable[[subprocess.CompletedProcess[str], str], None]]:
    """A Locust run: the README's arguments plus --list (the locustfile is loaded and every flag parsed,
    then it lists the users and exits); $SERVER_PID is this test's own pid."""
    def check(p: subprocess.CompletedProcess[str], cmd: str) -> None:
        assert p.returncode == 0 and "EpisodeUser" in p.stdout, (cmd, p.stdout[-1000:], p.stderr[-2000:])
    return bare(command).replace("$SERVER_PID", str(os.getpid())) + " --list", check


def serve_parses(command: str) -> tuple[str, Callable[[subprocess.CompletedProcess[str], str], None]]:
    """A load test's server: its flags parsed and resolved by `rollbox serve`'s own parser and checks."""
    argv = shlex.split(re.sub(r"\s*& SERVER_PID=\$!$", "", bare(command)))[2:]  # after `.venv/bin/rollbox serve`
    code = ("import os, sys\nfrom rollbox.functions.cli.main import Parser\nfrom rollbox.functions.service import server\n"
            "p = Parser(prog='rollbox'); sub = p.add_subparsers(dest='command'); server.add_parser(sub)\n"
            "args = p.parse_args(['serve', *sys.argv[1:]]); print(server.resolve(args, {}))")

    def check(p: subprocess.CompletedProcess[str], cmd: str) -> None:
        assert p.returncode == 0 and "ServeConfig(" in p.stdout, (cmd, p.stdout[-1000:], p.stderr[-2000:])
    return shlex.join([".venv/bin/python", "-c", code, *argv]), check


def image_usage(command: str) -> tuple[str, Callable[[subprocess.CompletedProcess[str], str], None]]:
    """The image build (~2 min, as root; tests/knative/test_pod.py builds and runs it): its syntax, and its usage."""
    def check(p: subprocess.CompletedProcess[str], cmd: str) -> None:
        assert "usage: scripts/image" in p.stdout + p.stderr, (cmd, p.stdout, p.stderr)
    return f"bash -n {REPO}/scripts/image && {{ {REPO}/scripts/image --help || true; }}", check


CHECKED: tuple[tuple[str, str, Quick], ...] = (
    (r"^\.venv/bin/python loadtest/(bench|profile)_\w+\.py", "a benchmark of minutes: --help lists its flags",
     bench_help),
    (r"^su rollbox-rootless -s /bin/sh -c '\.venv/bin/python loadtest/bench_\w+\.py",
     "a benchmark of minutes as an unprivileged user: --help lists its flags", rootless_bench),
    (r"^\.venv/bin/python loadtest/fleet_local\.py", "a fleet that runs until stopped: --help lists its flags",
     bench_help),
    (r"^\.venv/bin/python loadtest/fleet\.py --check-run ", "the model against a measured replica, minutes: --help "
     "lists its flags (its --quick form has its own test)", bench_help),
    (r"\.venv/bin/locust -f loadtest/locustfile\.py --headless", "a load test of minutes: its flags, with --list",
     locust_list),
    (r"^\.venv/bin/rollbox serve --home /tmp/rl --port 18096 ", "the server of the 3-minute load test", serve_parses),
    (r"^\.venv/bin/rollbox serve --port 18090 ", "the server of the 5-minute load test", serve_parses),
    (r"^\.venv/bin/rollbox serve & SERVER_PID=\$!$", "the server of the Locust examples below it", serve_parses),
    (r"^scripts/image$", "builds the image (~2 min, as root)", image_usage),
)
NOT_RUN: tuple[tuple[str, str], ...] = (
    (r"^scripts/bootstrap && \.venv/bin/python -m pytest$", "the test suite this test is part of"),
    (r"^kill \$SERVER_PID; wait \$SERVER_PID$", "stops the load test's server (not started here)"),
    (r"^podman load -i dist/rollbox-", "loads the image scripts/image builds: tests/knative/podkit.py does"),
    (r"^kubectl apply -k knative/overlays/s3$", "needs a Kubernetes cluster with Knative (none runs here; "
     "tests/knative/test_manifests.py validates the overlays)"),
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
    assert (rec["exit_code"], rec["timed_out"]) == (0, False), rec
    assert rec["stdout"] == "sum of the squares below 10: 285\nuid 1000 on host 'sandbox'\n", rec


def doctor_names_the_home(p: subprocess.CompletedProcess[str]) -> None:
    assert p.returncode == 0, (p.stdout, p.stderr)
    assert re.match(r"  info home: /\S+/home \(from ROLLBOX_HOME\)", p.stdout.splitlines()[1]), p.stdout


def exported(p: subprocess.CompletedProcess[str]) -> None:
    assert p.returncode == 0, p.stderr
    assert re.fullmatch(r"\d+ rows -> e\.jsonl\n", p.stderr), p.stderr


def replayed(p: subprocess.CompletedProcess[str]) -> None:
    assert p.returncode == 0, (p.stdout, p.stderr)
    assert p.stdout.endswith("2 of 2 steps identical\n"), p.stdout  # episode 2's two execs (steps 1, 2)


# (regex over the command without its comment, phase, check). Phase 1 runs while the server is up;
# phase 2 after it stopped (its drain flushes the recorded steps to the store, which they read).
COMMANDS: tuple[tuple[str, int, Check], ...] = (
    (r"^\.venv/bin/rollbox run --code 'print\(6 \* 7\)'$", 1, exits(0, stdout="42\n")),
    (r"^\.venv/bin/rollbox run --timeout-s 2 --command 'sleep 9'$", 1, exits(137, err_has="timed out")),
    (r"^\.venv/bin/rollbox run --json examples/task\.py$", 1, result_of_task),
    (r"^\.venv/bin/rollbox doctor$", 1, doctor_names_the_home),
    (r"^curl -s http://127\.0\.0\.1:8080/ ", 1, replies_42),
    (r"^\.venv/bin/rollbox snapshot build snapshots/templates/python\.yaml --name python-tpl$", 1,
     exits(0, has="built python-tpl")),
    (r"^\.venv/bin/rollbox snapshot list$", 1, exits(0, has="python-tpl")),
    (r"^\.venv/bin/rollbox snapshot push python-tpl --store s3://bucket/prefix ", 1,
     exits(0, has="pushed ")),
    (r"^\.venv/bin/rollbox snapshot pull python-tpl --store s3://bucket/prefix ", 1,
     exits(0, has="pulled ")),
    (r"^\.venv/bin/python loadtest/locustfile\.py --host http://127\.0\.0\.1:8080 --think-min-s 0 --think-max-s 0$", 1,
     exits(0)),
    (r"^\.venv/bin/python loadtest/fleet\.py(?!\s+--check-run)(\s|$)", 1,
     exits(0, has="always-on (")),  # the model: ~1 s
    (r"^\.venv/bin/rollbox trajectories ls$", 2, exits(0, has="demo")),
    (r"^\.venv/bin/rollbox trajectories show EPISODE --experiment E$", 2, exits(0, has="assert f(2) == 4")),
    (r"^\.venv/bin/rollbox trajectories export --experiment E --format jsonl --since 2026-12-01 --out e\.jsonl$",
     2, exported),
    (r"^\.venv/bin/rollbox replay EPISODE --experiment E \[--from STEP\]$", 2, replayed),
    (r"^\.venv/bin/rollbox report --experiment rl-demo --home /tmp/rl --out /tmp/rl/report$", 2,
     exits(0, has="index.html")),
)
SERVE = r"^(?:scripts/bootstrap && )?(\.venv/bin/rollbox serve)$"
SERVE_S3 = r"^\.venv/bin/rollbox serve --store s3://bucket/prefix --s3-endpoint-url http://127\.0\.0\.1:8333$"


def python_check(name: str) -> Callable[[str], None]:
    """The check of a Python block's stdout (what its comments say it prints)."""
    def runtime_api(out: str) -> None:
        assert out == "hi {'a.txt': 'hi'} 2\n", out

    def client(out: str) -> None:
        assert out == "hi\n0 1\n", out

    def trainer_loop(out: str) -> None:
        assert out == "mean reward 0.312\n", out  # as its comment says: 10 of 32 solutions are right

    return {"runtime": runtime_api, "client": client, "trainer": trainer_loop}[name]


PYTHON_BLOCKS = (  # (a line that tells the block, its check)
    ("    async with Runtime() as rt:", "runtime"),
    ('    async with await Sandbox.create("http://127.0.0.1:8080"', "client"),
    ("async def episode(client: Client, sem: asyncio.Semaphore, i: int) -> float:", "trainer"),
)


def classify_command(command: str) -> tuple[str, Any]:
    """("serve" | "serve_s3" | "run" | "checked" | "not_run", detail); AssertionError for an unknown command."""
    cmd = bare(command)
    if re.match(SERVE, cmd):
        return "serve", re.match(SERVE, cmd).group(1)  # type: ignore[union-attr]
    if re.match(SERVE_S3, cmd):
        return "serve_s3", cmd
    for pattern, phase, check in COMMANDS:
        if re.search(pattern, cmd):
            return "run", (phase, check)
    for pattern, reason, quick in CHECKED:
        if re.search(pattern, cmd):
            return "checked", (reason, quick)
    for pattern, reason in NOT_RUN:
        if re.search(pattern, cmd):
            return "not_run", reason
    raise AssertionError(f"README.md or docs/benchmarks.md has an example this test does not know: {command!r}; run it here "
                         "(COMMANDS), check it (CHECKED) or say why not (NOT_RUN)")


def classify_python(block: Block) -> str:
    known = [name for line, name in PYTHON_BLOCKS if line in block.text]
    assert len(known) == 1, f"{block.doc} line {block.line}: a Python example this test does not know"
    return known[0]


def test_every_example_is_known() -> None:
    """Pure: each block of the README is classified (a new or changed example fails here first)."""
    seen_python: set[str] = set()
    serve = 0
    for block in readme_blocks():
        if block.lang == "":
            continue  # no language: printed output (bench tables), not something to run
        assert block.lang in ("sh", "python"), f"{block.doc} line {block.line}: a ```{block.lang} block"
        if block.lang == "python":
            seen_python.add(classify_python(block))
            compile(block.text, f"{block.doc}:{block.line}", "exec")  # a program as written: no top-level await
            continue
        for command in shell_commands(block.text):
            kind, _ = classify_command(command)
            serve += kind == "serve"
    assert seen_python == {name for _, name in PYTHON_BLOCKS}, seen_python  # none went missing either
    assert serve >= 1
    for pattern, _, _ in COMMANDS:  # every command checked here is still in the README (or the benchmarks)
        assert any(re.search(pattern, bare(c)) for b in readme_blocks() if b.lang == "sh"
                   for c in shell_commands(b.text)), f"{pattern} is no longer in README.md nor docs/benchmarks.md"


REPO_PATH = re.compile(r"(?<![\w./~-])((?:examples|loadtest|docs|tests|functions|runtime|snapshots|knative|scripts)"
                       r"/[\w./-]*[\w/])")


def test_the_files_the_readme_names_exist() -> None:
    """Pure: every path of the repository the README (and docs/benchmarks.md) names is there (issue 26:
    `rollbox run --json task.py`, with no task.py), and the Runtime block is examples/runtime_demo.py."""
    named = sorted({p for doc in DOCS for p in REPO_PATH.findall(doc.read_text())})
    assert "examples/task.py" in named and "loadtest/bench_restore.py" in named, named
    missing = [p for p in named if not (REPO / p).exists()]
    assert not missing, f"README.md or docs/benchmarks.md names files that are not in the repository: {missing}"
    runtime = next(b for b in readme_blocks() if b.lang == "python" and classify_python(b) == "runtime")
    demo = (REPO / "examples" / "runtime_demo.py").read_text()
    assert demo.endswith(runtime.text) and demo[: -len(runtime.text)].strip().startswith('"""'), \
        "examples/runtime_demo.py is not the README's Runtime block (after its docstring)"


def table_rows(text: str, heading: str) -> list[list[str]]:
    """The cells of the first table under ``## heading`` (header and separator rows left out)."""
    section = text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")]
    return [[cell.strip() for cell in row.strip("|").split("|")] for row in rows[2:]]


def test_every_headline_figure_has_a_command_of_the_benchmarks() -> None:
    """Pure: each row of the README's figures table names its command, and each command there is one
    of docs/benchmarks.md's (which shows its full table and is checked above), or points to it."""
    rows = table_rows(README.read_text(), "Figures")
    assert len(rows) >= 3, rows
    bench_commands = {bare(c) for b in readme_blocks() if b.doc == "docs/benchmarks.md" and b.lang == "sh"
                      for c in shell_commands(b.text)}
    for row in rows:
        command = row[-1]
        if command.startswith("`"):
            assert command.strip("`") in bench_commands, f"{command} is not a command of docs/benchmarks.md"
        else:
            assert "docs/benchmarks.md" in command, row


def tracked_folders() -> set[str]:
    """The folders a newcomer meets: each top-level folder of the repository, and each folder of the
    three source packages (runtime/, snapshots/, functions/ and the folders in them)."""
    p = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True)
    if p.returncode != 0:
        pytest.skip(f"not a git checkout: {p.stderr.strip()}")
    folders = set()
    for path in p.stdout.splitlines():
        parts = path.split("/")[:-1]
        if parts and not parts[0].startswith("."):
            folders.add(parts[0])
            if parts[0] in ("runtime", "snapshots", "functions") and len(parts) > 1:
                folders.add("/".join(parts[:2]))
    return folders


def test_the_layout_table_names_every_folder() -> None:
    """Pure: the README's Layout table has one row per folder (issue 27: a newcomer finds each
    concern's room from it; `functions/` was "contract, handlers, serve, client and CLI" long after it
    was seven concerns), none that is gone, and says how `rollbox.X` maps to `X/`."""
    text = README.read_text()
    named = [row[0].strip("`").rstrip("/") for row in table_rows(text, "Layout")]
    assert len(named) == len(set(named)), named
    folders = tracked_folders()
    assert not folders - set(named), f"folders the Layout table does not name: {sorted(folders - set(named))}"
    assert not set(named) - folders, f"the Layout table names folders that are not there: {sorted(set(named) - folders)}"
    layout = text.split("\n## Layout\n", 1)[1]
    assert "package-dir" in layout and "`rollbox.runtime` to `runtime/`" in layout


# -- running them ---------------------------------------------------------------------------------------



@dataclass
class Scratch:
    dir: Path
    home: Path
    env: dict[str, str]
    address: str = DEFAULT_ADDRESS
    s3: SeaweedS3 | None = None

    def here(self, text: str) -> str:
        text = text.replace(DEFAULT_ADDRESS, self.address)
        return text.replace(README_S3, self.s3.endpoint) if self.s3 is not None else text

    def sh(self, command: str, timeout_s: float = 180.0) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["bash", "-c", self.here(command)], cwd=self.dir, env=self.env, capture_output=True,
                              text=True, timeout=timeout_s)

    def serve(self, command: str, log: Path, **env: str) -> ServerProc:
        port = free_ports(1)[0]
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
def scratch(tmp_path: Path, seaweed: SeaweedS3) -> Iterator[Scratch]:
    work = tmp_path / "work"
    work.mkdir()
    for name in LINKED:
        (work / name).symlink_to(REPO / name)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ROLLBOX_", "AWS_")) and k not in ("PORT", "HOST")}
    home = tmp_path / "home"
    env.update(ROLLBOX_HOME=str(home), AWS_ACCESS_KEY_ID=ACCESS_KEY,
               AWS_SECRET_ACCESS_KEY=SECRET_KEY, AWS_REGION="us-east-1")
    s3 = seaweed.client()
    with contextlib.suppress(s3.exceptions.BucketAlreadyOwnedByYou, s3.exceptions.BucketAlreadyExists):
        s3.create_bucket(Bucket="bucket")  # the bucket the examples name
    yield Scratch(work, home, env, s3=seaweed)


def run_python(scratch: Scratch, block: Block) -> None:
    check = python_check(classify_python(block))
    p = subprocess.run([str(scratch.dir / ".venv" / "bin" / "python"), "-c", scratch.here(block.text)],
                       cwd=scratch.dir, env=scratch.env, capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, (block.line, p.stderr[-3000:])
    check(p.stdout)


def fill_placeholders(command: str, home: Path) -> str:
    """The placeholders, as a reader fills them: an episode of the experiment `demo` that the
    trainer-loop example recorded, its step 1; the report of that experiment in this home."""
    command = command.replace("[--from STEP]", "--from 1")
    command = re.sub(r"--experiment E\b", "--experiment demo", command)
    command = command.replace("--experiment rl-demo --home /tmp/rl --out /tmp/rl/report",
                              f"--experiment demo --home {home} --out report")
    return re.sub(r"\bEPISODE\b", "2", command)


def run_s3_serve(scratch: Scratch, command: str, log: Path) -> None:
    srv = scratch.serve(scratch.here(command), log)
    try:
        ready = httpx.get(srv.url + "readyz", timeout=10)
        assert (ready.status_code, ready.json()["store_ok"]) == (200, True), ready.text
        r = httpx.post(srv.url, headers={"ce-specversion": "1.0", "ce-type": "dev.rollbox.sandbox.run",
                                         "ce-source": "/readme", "ce-id": "s3-1", "content-type": "application/json"},
                       content=b'{"snapshot": "python-tpl", "code": "print(6 * 7)"}', timeout=60)
        assert (r.status_code, r.json()["stdout"]) == (200, "42\n"), r.text  # the snapshot pushed above
    finally:
        assert srv.stop() == 0, log.read_text()[-3000:]


def test_the_examples_run_as_written(scratch: Scratch, tmp_path: Path) -> None:
    blocks = readme_blocks()
    serve_cmd = next(detail for b in blocks if b.lang == "sh" for c in shell_commands(b.text)
                     for kind, detail in [classify_command(c)] if kind == "serve")
    server = scratch.serve(serve_cmd, tmp_path / "serve.log")
    scratch.address = f"127.0.0.1:{server.port}"
    ran: list[str] = []
    checked: list[str] = []
    later: list[tuple[str, Check]] = []
    quick = ThreadPoolExecutor(max_workers=2)  # the quick forms (CHECKED), beside the examples run
    quick_runs: dict[str, Future[subprocess.CompletedProcess[str]]] = {}
    quick_checks: list[tuple[str, str, Callable[[subprocess.CompletedProcess[str], str], None]]] = []
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
                    run_s3_serve(scratch, detail, tmp_path / "serve-s3.log")
                    ran.append(command)
                elif kind == "run":
                    phase, check = detail
                    if phase == 2:
                        later.append((command, check))
                        continue
                    check(scratch.sh(command))
                    ran.append(command)
                elif kind == "checked":
                    quick_cmd, quick_check = detail[1](command)
                    if quick_cmd not in quick_runs:
                        quick_runs[quick_cmd] = quick.submit(scratch.sh, quick_cmd, 120)
                    quick_checks.append((command, quick_cmd, quick_check))
        for command, quick_cmd, quick_check in quick_checks:
            quick_check(quick_runs[quick_cmd].result(), quick_cmd)
            checked.append(command)
        records = [r for r in server.log_records() if r.get("msg") == "event"]
        assert records and all(r["status"] < 500 for r in records), [r for r in records if r["status"] >= 500]
    finally:
        quick.shutdown(cancel_futures=True)
        os.kill(server.pid, signal.SIGTERM)  # a drain: the recorded steps are flushed to the store
        rc = server.proc.wait(60)
    assert rc == 0, server.log_path.read_text()[-3000:]
    with ThreadPoolExecutor(max_workers=2) as pool:  # each reads the store; replay alone starts a runtime
        runs = [(command, check, pool.submit(scratch.sh, fill_placeholders(command, scratch.home)))
                for command, check in later]
    for command, check, run in runs:
        check(run.result())
        ran.append(command)
    assert len(ran) == len(COMMANDS) + len(PYTHON_BLOCKS) + 1, ran  # each known example ran (+ the S3 serve)
    assert len(checked) >= len(CHECKED), checked


def test_a_snippet_run_as_written_needs_no_harness() -> None:
    """Pure: the Python blocks are programs (issue 26: the Runtime block was `async with` at top level,
    a SyntaxError as written); compile() is what `python -c` does first."""
    for block in readme_blocks():
        if block.lang == "python":
            try:
                compile(block.text, "README.md", "exec")
            except SyntaxError as exc:
                pytest.fail(f"README.md line {block.line + (exc.lineno or 1) - 1}: {exc.msg}")

