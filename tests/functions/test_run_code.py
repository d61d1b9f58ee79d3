"""SandboxFusion's ``POST /run_code`` on a real ``rollbox serve``, on language snapshots built from
Debian's packages, and verl 0.9.1's own ``check_correctness`` against it.

The snapshots (python3, cpp, java, nodejs, go) are built into the language test store,
ROLLBOX_TEST_LANGUAGES_HOME (default /var/tmp/rollbox-test-languages, shared with
tests/snapshots/test_languages.py): the first run on a machine builds them (~3 min here), later runs reuse
them from the build records (seconds). The server's own home is a temporary directory whose
layers/manifests/names link to that store, so what it records (trajectories, usage, compile cache) is
this run's alone.
"""

from __future__ import annotations

import asyncio
import base64
import importlib
import json
import os
import shutil
import sys
import time
import types
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from svc_testkit import ServerProc, event, send, start_server

from tests import langhome
from tests.snapshots.s3server import ACCESS_KEY, SECRET_KEY, SeaweedS3, store_factory

LANG_HOME = langhome.LANG_HOME
TEMPLATES = langhome.TEMPLATES
BUILT = ("python3", "cpp", "java", "nodejs", "go")
EXPERIMENT = f"run-code-{uuid.uuid4().hex[:8]}"

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="language snapshots are built as root (mmdebstrap --mode=root)"),
    pytest.mark.slow,
    pytest.mark.timeout(900),  # the first builds the language store (tests/langhome.py), or waits for a build
]


@pytest.fixture(scope="module")
def lang_store() -> Path:
    """The language test store with BUILT in it (built on first use, then reused)."""
    return langhome.built(BUILT)


@pytest.fixture(scope="module")
def srv(lang_store: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    home = tmp_path_factory.mktemp("home")
    for sub in ("layers", "layers-meta", "manifests", "names"):
        (home / sub).symlink_to(lang_store / sub)
    proc = start_server(home / "log", "--home", str(home), "--flush-interval-s", "0.5", "--prewarm", "python3",
                        "--language-builds", "off")
    proc.home = home  # type: ignore[attr-defined]
    yield proc
    assert proc.stop() == 0, proc.log_path.read_text()[-4000:]


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=httpx.Timeout(10.0, read=120.0)) as client:
        yield client


async def run_code(http: httpx.AsyncClient, srv: ServerProc, expect: int = 200, headers: dict[str, str] | None = None,
                   **req: Any) -> Any:
    """POST /run_code; the timeouts are generous unless the request says (the machine may be loaded)."""
    req.setdefault("run_timeout", 30)
    req.setdefault("compile_timeout", 60)
    resp = await http.post(srv.url + "run_code", json=req, headers=headers)
    assert resp.status_code == expect, resp.text
    return resp.json()


def b64(text: str | bytes) -> str:
    return base64.b64encode(text.encode() if isinstance(text, str) else text).decode()


CPP_SUM = "#include <bits/stdc++.h>\nint main(){long a,b;std::cin>>a>>b;std::cout<<a+b<<std::endl;}\n"
JAVA_SUM = ("import java.util.*;\npublic class Main{public static void main(String[] x){Scanner s=new Scanner(System.in);"
            "long a=s.nextLong(),b=s.nextLong();int[] big=new int[100_000_000];big[5]=1;System.out.println(a+b);}}\n")


async def test_python_cpp_java_answer_like_sandboxfusion_at_verls_memory_limit(http: httpx.AsyncClient,
                                                                               srv: ServerProc) -> None:
    r = await run_code(http, srv, code="print(int(input()))", language="python", stdin="65535", memory_limit_MB=1024)
    assert r == {"status": "Success", "message": "", "compile_result": None,
                 "run_result": {**r["run_result"], "status": "Finished", "return_code": 0, "stdout": "65535\n",
                                "stderr": ""}, "executor_pod_name": None, "files": {}}
    assert list(r) == ["status", "message", "compile_result", "run_result", "executor_pod_name", "files"]
    r = await run_code(http, srv, code=CPP_SUM + f"// {uuid.uuid4()}", language="cpp", stdin="2 40",
                       memory_limit_MB=1024)
    assert (r["status"], r["compile_result"]["status"], r["compile_result"]["return_code"]) == ("Success", "Finished", 0)
    assert r["run_result"]["stdout"] == "42\n"
    # a JVM that allocates 400 MB runs under a 1024 MB cgroup limit (SandboxFusion's rlimits stop it starting)
    r = await run_code(http, srv, code=JAVA_SUM, language="java", stdin="40 2", memory_limit_MB=1024)
    assert (r["status"], r["run_result"]["stdout"]) == ("Success", "42\n"), r
    r = await run_code(http, srv, code="console.log(require('os').EOL === '\\n' ? 'ok' : 'no')", language="nodejs",
                       memory_limit_MB=1024)
    assert (r["status"], r["run_result"]["stdout"]) == ("Success", "ok\n"), r


JAVA_MAX_HEAP = ("public class Main{public static void main(String[] x){"
                 "System.out.println(Runtime.getRuntime().maxMemory()>>20);}}\n")
JAVA_2_GIB = ("public class Main{public static void main(String[] x){byte[][] k=new byte[2048*16][];"
              "for(int i=0;i<k.length;i++){k[i]=new byte[1<<16];k[i][7]=1;}System.out.println(k.length);}}\n")


async def test_a_jvms_heap_is_sized_to_the_requests_memory_limit_and_more_is_a_runtime_error(
        http: httpx.AsyncClient, srv: ServerProc) -> None:
    """The JVM's heap is 75% of memory_limit_MB (not a quarter of the host's memory), through /run_code and the
    `run` event; a program wanting 2 GiB at verl's 1024 is the heap's OutOfMemoryError: Failed, a runtime error."""
    for mb in (1024, 512):
        r = await run_code(http, srv, code=JAVA_MAX_HEAP + f"// {uuid.uuid4()}", language="java", memory_limit_MB=mb)
        assert r["status"] == "Success" and 0.68 * mb <= int(r["run_result"]["stdout"]) <= 0.75 * mb, r
    r = await send(http, srv.url, event("dev.rollbox.sandbox.run", {
        "language": "java", "code": JAVA_MAX_HEAP, "limits": {"memory_max_bytes": 256 << 20}, "timeout_s": 30,
        "compile_timeout_s": 60}))
    assert r.status == 200 and r.data["exit_code"] == 0 and 0.68 * 256 <= int(r.data["stdout"]) <= 192, r.data
    r = await run_code(http, srv, code=JAVA_2_GIB, language="java", memory_limit_MB=1024)
    assert (r["status"], r["run_result"]["status"], r["run_result"]["return_code"]) == ("Failed", "Finished", 1), r
    assert "java.lang.OutOfMemoryError: Java heap space" in r["run_result"]["stderr"], r


async def test_wrong_answer_runtime_errors_and_signals_are_failed_runs(http: httpx.AsyncClient,
                                                                      srv: ServerProc) -> None:
    r = await run_code(http, srv, code="print(41)", language="python")
    assert (r["status"], r["run_result"]["stdout"]) == ("Success", "41\n")  # wrong, but ran: the trainer judges
    r = await run_code(http, srv, code="import sys\nprint('x')\nsys.exit(3)", language="python")
    assert (r["status"], r["run_result"]["status"], r["run_result"]["return_code"]) == ("Failed", "Finished", 3)
    r = await run_code(http, srv, code="int a = 1", language="python")  # no compile step: a run failure
    assert (r["status"], r["compile_result"], r["run_result"]["status"]) == ("Failed", None, "Finished")
    assert "SyntaxError" in r["run_result"]["stderr"] and r["run_result"]["return_code"] != 0
    r = await run_code(http, srv, code="#include <cassert>\nint main(){assert(1==2);}\n", language="cpp")
    assert (r["status"], r["run_result"]["return_code"]) == ("Failed", -6), r  # SIGABRT, as asyncio reports it
    assert "Assertion" in r["run_result"]["stderr"]
    r = await run_code(http, srv, code="public class Main{public static void main(String[] a){assert 1 == 2;}}",
                       language="java", memory_limit_MB=1024)
    assert (r["status"], r["run_result"]["status"]) == ("Failed", "Finished"), r  # -ea, as SandboxFusion
    assert "AssertionError" in r["run_result"]["stderr"]


async def test_timeout_keeps_flushed_output_and_kills_children(http: httpx.AsyncClient, srv: ServerProc) -> None:
    marker = f"{time.time_ns() % 10**6 + 100}.5"
    code = (f"import subprocess, sys, time\nsubprocess.Popen(['sleep', '{marker}'], start_new_session=True)\n"
            "print('partial', flush=True)\nsys.stderr.write('err\\n')\ntime.sleep(30)\n")
    t0 = time.monotonic()
    r = await run_code(http, srv, code=code, language="python", run_timeout=1)
    took = time.monotonic() - t0
    run = r["run_result"]
    assert (r["status"], run["status"], run["return_code"]) == ("Failed", "TimeLimitExceeded", None)
    assert (run["stdout"], run["stderr"]) == ("partial\n", "err\n")
    assert 0.9 <= run["execution_time"] < 3 and took < 10
    await asyncio.sleep(0.5)
    alive = [p for p in os.listdir("/proc") if p.isdigit() and marker.encode() in _cmdline(p)]
    assert alive == [], "the run's child outlived it"
    # a compiled program's timeout, and a compile that times out (run skipped)
    r = await run_code(http, srv, code="#include <unistd.h>\nint main(){sleep(5);}\n" + f"// {uuid.uuid4()}",
                       language="cpp", run_timeout=0.5)
    assert (r["status"], r["compile_result"]["status"], r["run_result"]["status"]) == (
        "Failed", "Finished", "TimeLimitExceeded")
    r = await run_code(http, srv, code=CPP_SUM + f"// {uuid.uuid4()}", language="cpp", compile_timeout=0.01)
    assert (r["status"], r["compile_result"]["status"], r["run_result"]) == ("Failed", "TimeLimitExceeded", None)


async def test_timeouts_longer_than_a_sandboxs_default_lifetime_run(http: httpx.AsyncClient, srv: ServerProc) -> None:
    """SandboxFusion puts no cap below its timeouts: a trainer's generous run_timeout (over the default
    15 min lifetime) runs, the sandbox living as long as the compile and the run may take (was a 422)."""
    r = await run_code(http, srv, code="print(6 * 7)", language="python", run_timeout=1200)
    assert (r["status"], r["run_result"]["stdout"]) == ("Success", "42\n"), r
    r = await run_code(http, srv, code=CPP_SUM + f"// {uuid.uuid4()}", language="cpp", stdin="20 22",
                       compile_timeout=600, run_timeout=900)
    assert (r["status"], r["run_result"]["stdout"]) == ("Success", "42\n"), r


def _cmdline(pid: str) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


async def test_compile_error_skips_the_run(http: httpx.AsyncClient, srv: ServerProc) -> None:
    r = await run_code(http, srv, code="int main(){return x;}", language="cpp")
    c = r["compile_result"]
    assert (r["status"], c["status"], r["run_result"]) == ("Failed", "Finished", None)
    assert c["return_code"] != 0 and "not declared" in c["stderr"]
    r = await run_code(http, srv, code="public class Main{void f(){System.uto();}}", language="java",
                       memory_limit_MB=1024)
    assert (r["status"], r["compile_result"]["status"], r["run_result"]) == ("Failed", "Finished", None)


async def test_memory_over_the_limit_is_a_failed_run_and_output_is_capped(http: httpx.AsyncClient,
                                                                         srv: ServerProc) -> None:
    r = await run_code(http, srv, code="x = bytearray(400 << 20)\nprint(len(x))", language="python",
                       memory_limit_MB=256)
    assert (r["status"], r["run_result"]["status"]) == ("Failed", "Finished"), r
    assert r["run_result"]["return_code"] == -9  # the cgroup's OOM kill
    r = await run_code(http, srv, code="x = bytearray(400 << 20)\nprint(len(x))", language="python",
                       memory_limit_MB=1024)
    assert (r["status"], r["run_result"]["stdout"]) == ("Success", f"{400 << 20}\n")
    r = await run_code(http, srv, code="import sys\nsys.stdout.write('y' * (3 << 20))\nprint('done', file=sys.stderr)",
                       language="python")
    assert (r["status"], r["run_result"]["status"], r["run_result"]["return_code"]) == ("Success", "Finished", 0)
    assert 0 < len(r["run_result"]["stdout"]) <= (1 << 20) and r["run_result"]["stderr"] == "done\n"


async def test_files_in_and_fetch_files_out_binary_safe(http: httpx.AsyncClient, srv: ServerProc) -> None:
    blob = bytes(range(256)) * 3
    code = ("data = open('d1/d2/blob.bin', 'rb').read()\nopen('out.bin', 'wb').write(data[::-1])\n"
            "print(open('/tmp/flag.txt').read())\n")
    r = await run_code(http, srv, code=code, language="python",
                       files={"d1/d2/blob.bin": b64(blob), "/tmp/flag.txt": b64("hello, flag"), "skip": None},
                       fetch_files=["out.bin", "d1/d2/blob.bin", "missing.txt"])
    assert (r["status"], r["run_result"]["stdout"]) == ("Success", "hello, flag\n"), r
    assert set(r["files"]) == {"out.bin", "d1/d2/blob.bin"}
    assert base64.b64decode(r["files"]["out.bin"]) == blob[::-1]
    assert base64.b64decode(r["files"]["d1/d2/blob.bin"]) == blob
    # a compiled language reads a request file too
    r = await run_code(http, srv, language="cpp", files={"in.txt": b64("5 6")},
                       code="#include <fstream>\n#include <iostream>\nint main(){std::ifstream f(\"in.txt\");"
                            f"int a,b;f>>a>>b;std::cout<<a*b;}}// {uuid.uuid4()}")
    assert (r["status"], r["run_result"]["stdout"]) == ("Success", "30"), r


@pytest.mark.parametrize(("body", "needle"), [
    ({"language": "python"}, "missing"),
    ({"code": "print(1)"}, "missing"),
    ({"code": "print(1)", "language": "Python"}, "unknown language 'Python'"),
    ({"code": "print(1)", "language": "julia"}, "language 'julia' is not supported: Debian 12 does not package Julia"),
    ({"code": "print(1)", "language": "cuda"}, "language 'cuda' is not supported"),
    ({"code": 1, "language": "python"}, "string_type"),
    ({"code": "x", "language": "python", "memory_limit_MB": None}, "int_type"),
    ({"code": "x", "language": "python", "memory_limit_MB": 1.5}, "int_from_float"),
    ({"code": "x", "language": "python", "files": None}, "dict_type"),
    ({"code": "x", "language": "python", "fetch_files": "a.txt"}, "list_type"),
    ({"code": "x", "language": "python", "files": {"a.bin": "not base64!"}}, "files['a.bin']: not valid base64"),
    ({"code": "x", "language": "python", "memory_limit_MB": 1}, "memory_max_bytes"),
    ({"code": "int main(){}\ud800", "language": "cpp"}, "code: not valid UTF-8 text"),
    ({"code": "x", "language": "python", "stdin": "\ud800"}, "stdin: not valid UTF-8 text"),
    ({"code": "x", "language": "python", "files": {"../up": "eA=="}}, "'..' components are not allowed"),
])
async def test_bad_requests_are_422_naming_the_problem(http: httpx.AsyncClient, srv: ServerProc,
                                                       body: dict[str, Any], needle: str) -> None:
    resp = await http.post(srv.url + "run_code", content=json.dumps(body).encode(),  # (\ud800 as an escape)
                           headers={"content-type": "application/json"})
    assert resp.status_code == 422 and needle in resp.text, resp.text


async def test_not_json_and_wrong_method_and_ping(http: httpx.AsyncClient, srv: ServerProc) -> None:
    resp = await http.post(srv.url + "run_code", content=b"{nope", headers={"content-type": "application/json"})
    assert resp.status_code == 422 and "json_invalid" in resp.text
    resp = await http.get(srv.url + "run_code")
    assert resp.status_code == 405
    resp = await http.get(srv.url + "v1/ping")
    assert (resp.status_code, resp.json()) == (200, "pong")
    # SandboxFusion takes 0 (a run that ends within the 1 ms it stands for, as print(1) from a warm sandbox can, finished)
    r = await run_code(http, srv, code="import time; time.sleep(0.5)", language="python", run_timeout=0)
    assert r["run_result"]["status"] == "TimeLimitExceeded"


async def test_same_program_compiles_once_and_concurrent_cases_share_the_compile(http: httpx.AsyncClient,
                                                                               srv: ServerProc) -> None:
    code = CPP_SUM + f"// {uuid.uuid4()}"
    rs = await asyncio.gather(*(run_code(http, srv, code=code, language="cpp", stdin=f"{i} 1") for i in range(4)))
    assert [r["run_result"]["stdout"] for r in rs] == [f"{i + 1}\n" for i in range(4)]
    assert sorted(bool(r["compile_result"].get("cached")) for r in rs) == [False, True, True, True]
    r = await run_code(http, srv, code=code, language="cpp", stdin="1 1")
    assert r["compile_result"] == {"status": "Finished", "execution_time": 0.0, "return_code": 0, "stdout": "",
                                   "stderr": "", "cached": True}
    bad = "int main(){return y;}" + f"// {uuid.uuid4()}"
    first = await run_code(http, srv, code=bad, language="cpp")
    again = await run_code(http, srv, code=bad, language="cpp")
    assert again["compile_result"]["cached"] is True and again["run_result"] is None
    assert again["compile_result"]["stderr"] == first["compile_result"]["stderr"] != ""
    # another memory limit or stdin is the same compile; other flags (another language) are not
    r = await run_code(http, srv, code=JAVA_SUM.replace("Main{", f"Main{{// {uuid.uuid4()}\n"), language="java",
                       stdin="1 2", memory_limit_MB=1024)
    assert (r["run_result"]["stdout"], r["compile_result"].get("cached")) == ("3\n", None)
    cached = list((Path(srv.home) / "compiled").glob("*.json"))  # type: ignore[attr-defined]
    assert len(cached) >= 3  # kept in the store the replicas share


async def test_a_compile_whose_artifacts_are_over_the_bound_is_not_kept_and_each_run_still_succeeds(
        http: httpx.AsyncClient, srv: ServerProc) -> None:
    """A binary of 20 MiB (an initialized array): its base64 is over what a sandbox reads back for one file, so it
    was kept cut short and the next run of the program failed unpacking it. Over MAX_ARTIFACT_BYTES the compile
    is not kept: each run compiles, and succeeds."""
    from rollbox.functions.handlers.compile_cache import MAX_ARTIFACT_BYTES

    big = 20 << 20
    assert big > MAX_ARTIFACT_BYTES
    code = (f"#include <cstdio>\nchar big[{big}] = {{1}};\nint main(){{big[{big} - 1] = 2; "
            f"std::printf(\"%d\\n\", big[0] + big[{big} - 1]);}}\n// {uuid.uuid4()}\n")
    for attempt in range(2):
        r = await run_code(http, srv, code=code, language="cpp")
        assert (r["status"], r["run_result"]["stdout"]) == ("Success", "3\n"), (attempt, r)
        assert r["compile_result"].get("cached") is None, (attempt, r)  # compiled each time
    assert "compile not kept: its artifacts are not under" in srv.log_path.read_text()


async def test_cases_waiting_for_a_compile_that_timed_out_get_its_timeout_without_compiling_again(
        http: httpx.AsyncClient, srv: ServerProc) -> None:
    """verl's pattern on an overloaded machine: four cases of one program, whose one compile runs out of its
    2 s (a constexpr loop of 4e10 steps: g++ needs minutes). The three that waited for it answer its timeout (cached:
    not compiled again); they used to compile one each, multiplying the load that made it time out."""
    slow = ("constexpr long f(){long s=0; for(long i=0;i<200000;i++) for(long j=0;j<200000;j++) s+=(i^j)%7;"
            " return s;}\n"
            f"static_assert(f() > 0);\nint main(){{}}\n// {uuid.uuid4()}\n")
    rs = await asyncio.gather(*(run_code(http, srv, code=slow, language="cpp", compile_timeout=2, stdin=str(i))
                                for i in range(4)))
    assert [(r["status"], r["compile_result"]["status"], r["run_result"]) for r in rs] == [
        ("Failed", "TimeLimitExceeded", None)] * 4
    assert sorted(bool(r["compile_result"].get("cached")) for r in rs) == [False, True, True, True]
    r = await run_code(http, srv, code=slow, language="cpp", compile_timeout=2)  # not kept: compiled again
    assert (r["compile_result"]["status"], r["compile_result"].get("cached")) == ("TimeLimitExceeded", None)


async def test_replicas_sharing_a_store_answer_the_timeout_of_the_one_compile_of_a_program(
        http: httpx.AsyncClient, srv: ServerProc, tmp_path: Path) -> None:
    """Two replicas on one store (two processes on one host, the same home) each get two cases of a program
    whose compile runs out of its 2 s: the program is compiled once; the cases that waited for it, here and on
    the other replica, answer its timeout (cached) instead of compiling it again."""
    slow = ("constexpr long f(){long s=0; for(long i=0;i<200000;i++) for(long j=0;j<200000;j++) s+=(i^j)%7;"
            " return s;}\n"
            f"static_assert(f() > 0);\nint main(){{}}\n// {uuid.uuid4()}\n")
    other = start_server(tmp_path / "log", "--home", str(srv.home), "--prewarm", "",  # type: ignore[attr-defined]
                         "--language-builds", "off")
    try:
        rs = await asyncio.gather(*(run_code(http, replica, code=slow, language="cpp", compile_timeout=2, stdin=str(i))
                                    for i, replica in enumerate((srv, other, srv, other))))
        assert [(r["status"], r["compile_result"]["status"], r["run_result"]) for r in rs] == [
            ("Failed", "TimeLimitExceeded", None)] * 4
        assert sorted(bool(r["compile_result"].get("cached")) for r in rs) == [False, True, True, True], rs
    finally:
        assert other.stop() == 0, other.log_path.read_text()[-4000:]


async def test_runs_are_steps_of_the_experiment_and_lives_are_billed(http: httpx.AsyncClient, srv: ServerProc) -> None:
    from rollbox.functions.analysis.trajectories import steps, usage

    h = {"X-Rollbox-Experiment": EXPERIMENT}
    await run_code(http, srv, headers=h, code="print('row')", language="python")
    await run_code(http, srv, headers=h, code=CPP_SUM + f"// {uuid.uuid4()}", language="cpp", stdin="1 2")
    await run_code(http, srv, headers=h, code="print(1)", language="julia", expect=422)
    deadline = time.monotonic() + 20
    while True:
        try:
            rows = steps(str(srv.home), experiment=EXPERIMENT)  # type: ignore[attr-defined]
        except Exception:
            rows = None
        if (rows is not None and len(rows) >= 3) or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.5)
    assert rows is not None and len(rows) == 3, rows
    assert set(rows["event_type"]) == {"dev.rollbox.sandbox.run"} and set(rows["event_source"]) == {"/run_code"}
    ok = rows[rows["status"] == 200]
    assert sorted(ok["stdout"]) == ["3\n", "row\n"]
    assert list(rows[rows["status"] == 422]["error"]) == [
        "language 'julia' is not supported: Debian 12 does not package Julia (it left Debian after bullseye)"]
    u = usage(str(srv.home), experiment=EXPERIMENT)  # type: ignore[attr-defined]
    assert len(u) == 2 and (u["cpu_s"] > 0).all()


async def test_the_run_event_takes_a_language_and_shares_the_compile_cache(http: httpx.AsyncClient,
                                                                          srv: ServerProc) -> None:
    run = "dev.rollbox.sandbox.run"
    code = CPP_SUM + f"// {uuid.uuid4()}"
    r = await send(http, srv.url, event(run, {"language": "cpp", "code": code, "stdin": "40 2", "timeout_s": 5,
                                              "compile_timeout_s": 20}))
    assert (r.status, r.data["exit_code"], r.data["stdout"]) == (200, 0, "42\n"), r.data
    assert r.data["compile"]["cached"] is False and r.data["compile"]["exit_code"] == 0
    sf = await run_code(http, srv, code=code, language="cpp", stdin="1 1")  # the same cache as /run_code
    assert (sf["compile_result"]["cached"], sf["run_result"]["stdout"]) == (True, "2\n")
    r = await send(http, srv.url, event(run, {"language": "cpp", "code": code, "stdin": "1 2", "read_files": ["x"]}))
    assert (r.data["stdout"], r.data["compile"]["cached"], r.data["files"]) == ("3\n", True, {"x": None})
    r = await send(http, srv.url, event(run, {"language": "cpp", "code": "int main(){return z;}"}))
    assert r.status == 200 and r.data["exit_code"] != 0 and r.data["compile"]["exit_code"] == r.data["exit_code"]
    assert "not declared" in r.data["stderr"]
    r = await send(http, srv.url, event(run, {"language": "python", "code": "import sys; print(sys.stdin.read()[::-1])",
                                              "stdin": "abc"}))
    assert (r.data["stdout"], r.data["compile"]) == ("cba\n", None)
    for data, needle in (({"language": "swift", "code": "x"}, "language 'swift' is not supported"),
                         ({"language": "cobol", "code": "x"}, "unknown language 'cobol'"),
                         ({"language": "cpp", "command": "ls"}, "'code' is the program's source"),
                         ({"language": "cpp", "code": "x", "snapshot": "python"}, "give 'language' or 'snapshot'"),
                         ({"command": "ls", "compile_timeout_s": 3}, "compile_timeout_s is for a run with 'language'")):
        r = await send(http, srv.url, event(run, data))
        assert r.status == 400 and needle in r.data["message"], r.data


async def test_a_batch_of_cases_compiles_once_and_keeps_each_cases_files_apart(http: httpx.AsyncClient,
                                                                              srv: ServerProc) -> None:
    run = "dev.rollbox.sandbox.run"
    code = ("#include <bits/stdc++.h>\nint main(){std::ifstream seen(\"state.txt\"); if(seen) {std::cout<<\"seen\";"
            "return 0;} std::ofstream(\"state.txt\")<<1; long a,b; std::cin>>a>>b; std::cout<<a+b<<std::endl;}\n"
            f"// {uuid.uuid4()}")
    cases = [{"stdin": "1 2", "expected_stdout": "3"}, {"stdin": "20 22\n", "expected_stdout": "42\n"},
             {"stdin": "1 1", "expected_stdout": "3"}, {"stdin": "5 5"}]
    r = await send(http, srv.url, event(run, {"language": "cpp", "code": code, "cases": cases, "timeout_s": 20,
                                              "compile_timeout_s": 60}))
    assert r.status == 200, r.data
    got = [(c["stdout"], c["passed"]) for c in r.data["cases"]]
    assert got == [("3\n", True), ("42\n", True), ("2\n", False), ("10\n", None)]  # no case saw another's file
    assert r.data["compile"]["cached"] is False and r.data["stdout"] == "10\n"  # no case failed: the last one's
    r = await send(http, srv.url, event(run, {"language": "cpp", "code": code, "cases": cases[:1]}))
    assert (r.data["compile"]["cached"], r.data["cases"][0]["passed"]) == (True, True)
    r = await send(http, srv.url, event(run, {"language": "python", "code": "import sys; n = int(input()); sys.exit(n)",
                                              "cases": [{"stdin": "0"}, {"stdin": "3"}, {"stdin": "0"}]}))
    assert [c["exit_code"] for c in r.data["cases"]] == [0, 3, 0] and r.data["exit_code"] == 3  # the first failed
    r = await send(http, srv.url, event(run, {"language": "python", "code": "x", "cases": [{}], "stdin": "1"}))
    assert r.status == 400 and "each case has its stdin" in r.data["message"]


async def test_cases_without_a_language_run_the_runs_code_or_command_once_per_case(http: httpx.AsyncClient,
                                                                                   srv: ServerProc) -> None:
    """A trainer's Python solution with its cases and no `language`: `code` means what it means in any `run`
    (Python, in the snapshot's warm interpreter; the built-in `python` snapshot by default: nothing to
    build), run once per case; a `command` likewise. It used to be refused ("cases are for a run with
    'language'")."""
    run = "dev.rollbox.sandbox.run"
    code = ("import os, sys\nif os.path.exists('seen'): print('seen'); sys.exit(0)\nopen('seen', 'w').close()\n"
            "a, b = map(int, sys.stdin.read().split()); print(a + b, os.environ.get('TAG', ''), sys.version_info[0])")
    cases = [{"stdin": "1 2", "expected_stdout": "3 x 3"}, {"stdin": "20 22", "expected_stdout": "42 x 3\n"},
             {"stdin": "1 1", "expected_stdout": "3 x 3"}]
    r = await send(http, srv.url, event(run, {"code": code, "cases": cases, "env": {"TAG": "x"}, "timeout_s": 20}))
    assert r.status == 200, r.data
    assert [(c["stdout"], c["passed"]) for c in r.data["cases"]] == [("3 x 3\n", True), ("42 x 3\n", True),
                                                                      ("2 x 3\n", False)]
    assert r.data["compile"] is None and r.data["stdout"] == "2 x 3\n"  # no case failed: the last one's
    r = await send(http, srv.url, event(run, {"command": "read a b; echo $((a * b)); test $a -lt 9", "timeout_s": 20,
                                              "cases": [{"stdin": "6 7", "expected_stdout": "42"}, {"stdin": "9 9"}]}))
    assert r.status == 200 and [(c["stdout"], c["exit_code"]) for c in r.data["cases"]] == [("42\n", 0), ("81\n", 1)]
    assert r.data["cases"][0]["passed"] is True and r.data["exit_code"] == 1  # the first failed case's
    r = await send(http, srv.url, event(run, {"code": "print(1)", "cases": [{"stdin": "1"}], "snapshot": "nowhere"}))
    assert r.status == 404 and "nowhere" in r.data["message"], r.data



async def test_what_a_case_leaves_running_is_gone_before_the_next_case(http: httpx.AsyncClient,
                                                                       srv: ServerProc) -> None:
    """A case that leaves a process behind (a background sleep; a fork bomb, whose leftovers made the next
    cases fail with 'Cannot fork') does not reach the cases after it: each starts with only the sandbox's
    agent running (the bomb's processes killed and reaped). The sleep is looked for in /proc (neither the
    pattern nor the shell's command line matches it)."""
    look = "for f in /proc/[0-9]*/cmdline; do tr '\\0' ' ' < $f; echo; done | grep -c 'sleep 31[7]'"
    cmd = (f"read m; case $m in bg) n=317; sleep $n >/dev/null 2>&1 </dev/null & echo bg;; look) {look};; "
           "bomb) f() { f | f & }; f;; *) echo $m;; esac")
    cases = [{"stdin": "bg"}, {"stdin": "look"}, {"stdin": "look"}, {"stdin": "bomb"}, {"stdin": "ok"},
             {"stdin": "ok"}]
    r = await send(http, srv.url, event("dev.rollbox.sandbox.run", {"command": cmd, "cases": cases, "timeout_s": 20}))
    assert r.status == 200, r.data
    got = [(c["stdout"], c["exit_code"]) for c in r.data["cases"]]
    assert got[:3] + got[4:] == [("bg\n", 0), ("0\n", 1), ("0\n", 1), ("ok\n", 0), ("ok\n", 0)], r.data["cases"]


async def test_what_a_case_writes_anywhere_the_next_case_does_not_see(http: httpx.AsyncClient,
                                                                       srv: ServerProc) -> None:
    """Not only its home: a case's files in /tmp, in the prepared program's own directory (its compiled
    program overwritten: a reward hack), stay with that case; each later case finds the prepared sandbox
    as it was (/tmp was shared by the cases, and the prepared copy sat in it, writable)."""
    cmd = ("read m; case $m in write) echo x > /tmp/leak; echo y > $HOME/leak; echo 'echo hacked' > prog.sh; "
           "echo wrote;; *) ls /tmp/leak $HOME/leak 2>/dev/null | wc -l; sh prog.sh;; esac")
    r = await send(http, srv.url, event("dev.rollbox.sandbox.run", {
        "command": cmd, "files": {"prog.sh": "echo clean"}, "timeout_s": 20,
        "cases": [{"stdin": "look"}, {"stdin": "write"}, {"stdin": "look"}, {"stdin": "look"}]}))
    assert r.status == 200, r.data
    got = [c["stdout"] for c in r.data["cases"]]
    assert got == ["0\nclean\n", "wrote\n", "0\nclean\n", "0\nclean\n"], r.data["cases"]


HELLO: dict[str, str] = {
    "python": "print(123)",
    "pytest": "def test_sum():\n    assert 1 + 1 == 2\n",
    "cpp": "#include <iostream>\nint main(){std::cout<<123<<std::endl;}",
    "java": "public class Main{public static void main(String[] a){System.out.println(123);}}",
    "junit": ("import org.junit.jupiter.api.Test;\nimport static org.junit.jupiter.api.Assertions.*;\n"
              "public class SumTest { @Test void sum() { assertEquals(2, 1 + 1); } }"),
    "go": "package main\nimport \"fmt\"\nfunc main(){fmt.Println(123)}\n",
    "go_test": "package main\nimport \"testing\"\nfunc TestSum(t *testing.T){ if 1+1 != 2 { t.Fatal(\"no\") } }\n",
    "nodejs": "console.log(123)",
    "typescript": "const x: number = 123;\nconsole.log(x);",
    "jest": "test('sums', () => { expect(1 + 2).toBe(3); });",
    "rust": "fn main() { println!(\"123\"); }",
    "bash": "echo 123",
    "php": "echo 123;",
    "ruby": "puts 123",
    "lua": "print(123)",
    "perl": "print \"123\\n\";",
    "R": "cat('123\\n')",
    "scala": "object Main extends App { println(123) }",
    "kotlin_script": "println(123)",
    "csharp": "using System;\nclass P { static void Main() { Console.WriteLine(123); } }",
    "racket": "#lang racket\n(displayln 123)",
    "sql": "SELECT 123;",
    "verilog": "module tb; initial begin $display(\"123\"); $finish; end endmodule",
    "D_ut": "import std.stdio;\nunittest { assert(1 + 1 == 2); }\nvoid main() { writeln(123); }",
}
COMMENT = {"python": "#", "pytest": "#", "bash": "#", "ruby": "#", "perl": "#", "R": "#", "lua": "--", "sql": "--",
           "racket": ";"}
TEST_RUNNERS = ("pytest", "junit", "go_test", "jest", "D_ut")  # (D: -unittest runs the tests, not main)


@pytest.mark.parametrize("language", list(HELLO))
async def test_every_language_whose_snapshot_is_built_runs(http: httpx.AsyncClient, srv: ServerProc,
                                                           language: str) -> None:
    """Optional beyond BUILT: the languages whose snapshots the test store holds (all of them when
    ROLLBOX_TEST_LANGUAGES_HOME points at a store built from every template). Twice: the second run of a
    compiled language takes its artifacts from the compile cache (written into the sandbox as files)."""
    from rollbox.snapshots import languages

    if not (LANG_HOME / "names" / languages.language(language).snapshot).exists():  # type: ignore[operator]
        pytest.skip(f"the {language} snapshot is not in {LANG_HOME}")
    code = f"{HELLO[language]}\n{COMMENT.get(language, '//')} {uuid.uuid4()}\n"  # a new program: compiled first
    for attempt in range(2):
        r = await run_code(http, srv, code=code, language=language, memory_limit_MB=1024, run_timeout=60,
                           compile_timeout=120)
        assert r["status"] == "Success", (attempt, r)
        if language not in TEST_RUNNERS:
            assert "123" in r["run_result"]["stdout"], (attempt, r)
        if attempt and r["compile_result"] is not None:
            assert r["compile_result"].get("cached") is True, r


GO_TESTS = 'package main\nimport (\n"os"\n"testing"\n"github.com/stretchr/testify/assert"\n)\nvar _, _ = os.Exit, assert.Equal\n'


@pytest.mark.parametrize(("body", "status", "says"), [
    ("func TestSum(t *testing.T){ assert.Equal(t, 2, 1+1) }", "Success", "PASS"),
    ("func TestSum(t *testing.T){ assert.Equal(t, 3, 1+1) }", "Failed", "--- FAIL: TestSum"),
    ("func TestExit(t *testing.T){ os.Exit(0) }", "Failed", "os.Exit(0) during test"),  # as under go test
    ("func TestPanic(t *testing.T){ var m map[int]int; m[1] = 1 }", "Failed", "panic"),
])
async def test_go_test_compiles_the_test_binary_once_with_go_tests_verdicts(http: httpx.AsyncClient, srv: ServerProc,
                                                                            body: str, status: str, says: str) -> None:
    """verl sends a go_test program once per case: its test binary is compiled once (go test -c), and each run
    runs it, with the verdict go test gives (exit 0 = every test passed), the second time from the cache."""
    if not (LANG_HOME / "names" / "go_test").exists():
        pytest.skip(f"the go_test snapshot is not in {LANG_HOME}")
    code = f"{GO_TESTS}{body}\n// {uuid.uuid4()}\n"
    for attempt in range(2):
        r = await run_code(http, srv, code=code, language="go_test")
        assert (r["status"], r["compile_result"]["return_code"]) == (status, 0), (attempt, r)
        assert r["compile_result"].get("cached") is (True if attempt else None), (attempt, r)
        assert says in r["run_result"]["stdout"] + r["run_result"]["stderr"], (attempt, r)


async def test_go_tests_vet_checks_fail_the_compile_twice(http: httpx.AsyncClient, srv: ServerProc) -> None:
    """go test's vet checks fail the compile, as they fail go test (kept: the same source fails the same way).
    (Once, not in each verdict's case above: every case compiled the same failing program again.)"""
    if not (LANG_HOME / "names" / "go_test").exists():
        pytest.skip(f"the go_test snapshot is not in {LANG_HOME}")
    bad = f'{GO_TESTS}func TestF(t *testing.T){{ t.Logf("%d", "x") }}\n// {uuid.uuid4()}\n'
    for attempt in range(2):
        r = await run_code(http, srv, code=bad, language="go_test")
        assert (r["status"], r["run_result"]) == ("Failed", None), (attempt, r)
        assert "wrong type string" in r["compile_result"]["stderr"] + r["compile_result"]["stdout"], r


JEST_TESTS = ("import { add } from './lib/helper';\nimport { unit } from './unit';\nimport * as os from 'os';\n"
              "jest.mock('os', () => ({ EOL: 'mocked' }));\ninterface P { x: number }\n")


@pytest.mark.parametrize(("body", "status", "says"), [
    ("test('sums', () => { const p: P = {x: unit}; expect(add(p.x, 2)).toBe(3); });\n"
     "test('jest.mock is hoisted over the imports', () => { expect(os.EOL).toBe('mocked'); });", "Success",
     "Tests:       2 passed, 2 total"),
    ("test('sums', () => { expect(add(1, 1)).toBe(3); });", "Failed", "Tests:       1 failed, 1 total"),
])
async def test_jest_transpiles_typescript_once_with_jests_verdicts(http: httpx.AsyncClient, srv: ServerProc,
                                                                   body: str, status: str, says: str) -> None:
    """A jest program's TypeScript (the test and the request's files: a helper in a subdirectory importing another
    there, a .tsx) is made JavaScript once, by babel with babel-jest's preset (jest.mock hoisted); each run runs jest
    on it untransformed, the second from the compile cache (every .js made, subdirectories too), with jest's
    verdict."""
    if not (LANG_HOME / "names" / "jest").exists():
        pytest.skip(f"the jest snapshot is not in {LANG_HOME}")
    code = f"{JEST_TESTS}{body}\n// {uuid.uuid4()}\n"
    files = {"lib/helper.ts": b64("export { add } from './sum';\n"),
             "lib/sum.ts": b64("export const add = (a: number, b: number): number => a + b;\n"),
             "unit.tsx": b64("export const unit: number = 1;\n")}
    for attempt in range(2):
        r = await run_code(http, srv, code=code, language="jest", files=files, memory_limit_MB=1024)
        assert (r["status"], r["compile_result"]["return_code"]) == (status, 0), (attempt, r)
        assert r["compile_result"].get("cached") is (True if attempt else None), (attempt, r)
        assert says in r["run_result"]["stderr"], (attempt, r)


async def test_jest_a_syntax_error_fails_the_compile(http: httpx.AsyncClient, srv: ServerProc) -> None:
    """(Once, not in each verdict's case above: every case compiled the same failing program again.)"""
    if not (LANG_HOME / "names" / "jest").exists():
        pytest.skip(f"the jest snapshot is not in {LANG_HOME}")
    bad = f"test('x', () => {{ const y: number = ; }});\n// {uuid.uuid4()}\n"  # a syntax error fails the compile
    r = await run_code(http, srv, code=bad, language="jest", memory_limit_MB=1024)
    assert (r["status"], r["run_result"]) == ("Failed", None) and "SyntaxError" in r["compile_result"]["stderr"], r


KTS_SUM = 'val (a, b) = readLine()!!.trim().split(" ").map { it.toLong() }\nclass Sum(val v: Long)\n'


@pytest.mark.parametrize(("body", "stdin", "status", "code", "out", "err"), [
    ("println(listOf(a, b).map { Sum(it).v }.sum())", "40 2", "Success", 0, "42\n", ""),
    ('if (a > b) throw IllegalStateException("boom")\nprintln(a)', "3 2", "Failed", 3, "",
     "java.lang.IllegalStateException: boom\n\tat Main.<init>(main.kts:3)\n"),  # as kotlinc -script prints it
    ("kotlin.system.exitProcess(7)", "1 2", "Failed", 7, "", ""),
])
async def test_kotlin_script_compiles_once_with_kotlinc_scripts_output(http: httpx.AsyncClient, srv: ServerProc,
                                                                        body: str, stdin: str, status: str, code: int,
                                                                        out: str, err: str) -> None:
    """A kotlin_script program is compiled once (its class and a main that runs it); each run runs it on the JVM
    with what `kotlinc -script` gives: its output, exit status, an exception's report (status 3); the second run
    from the compile cache."""
    if not (LANG_HOME / "names" / "kotlin_script").exists():
        pytest.skip(f"the kotlin_script snapshot is not in {LANG_HOME}")
    program = f"{KTS_SUM}{body}\n// {uuid.uuid4()}\n"
    for attempt in range(2):
        r = await run_code(http, srv, code=program, language="kotlin_script", stdin=stdin, memory_limit_MB=1024,
                           compile_timeout=120)
        assert (r["status"], r["compile_result"]["return_code"]) == (status, 0), (attempt, r)
        assert r["compile_result"].get("cached") is (True if attempt else None), (attempt, r)
        run = r["run_result"]
        assert (run["return_code"], run["stdout"], run["stderr"]) == (code, out, err), (attempt, r)


async def test_kotlin_script_a_type_error_fails_the_compile(http: httpx.AsyncClient, srv: ServerProc) -> None:
    """(Once, not in each output's case above: every case compiled the same failing program again, ~4 s of
    kotlinc each.)"""
    if not (LANG_HOME / "names" / "kotlin_script").exists():
        pytest.skip(f"the kotlin_script snapshot is not in {LANG_HOME}")
    r = await run_code(http, srv, code=f"val x: Int = \"no\"\n// {uuid.uuid4()}\n", language="kotlin_script",
                       memory_limit_MB=1024, compile_timeout=120)
    assert (r["status"], r["run_result"]) == ("Failed", None) and "type mismatch" in r["compile_result"]["stderr"], r


async def test_full_is_504_with_retry_after_which_verl_retries(lang_store: Path, tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    for sub in ("layers", "layers-meta", "manifests", "names"):
        (home / sub).symlink_to(lang_store / sub)
    small = start_server(tmp_path / "log", "--home", str(home), "--max-queued", "1", "--prewarm", "python3",
                         "--durability", "off", "--record", "off")
    try:
        async with httpx.AsyncClient(timeout=60) as http:
            body = {"code": "import time; time.sleep(1.5); print('slept')", "language": "python", "run_timeout": 30}
            replies = await asyncio.gather(*(http.post(small.url + "run_code", json=body) for _ in range(3)))
        codes = sorted(r.status_code for r in replies)
        assert codes[0] == 200 and 504 in codes, [r.text for r in replies]
        full = next(r for r in replies if r.status_code == 504)
        assert "cap 1" in full.json()["detail"] and int(full.headers["retry-after"]) >= 1
    finally:
        assert small.stop() == 0


async def test_with_builds_off_a_language_whose_snapshot_is_not_built_is_503_with_the_command_that_builds_it(
        http: httpx.AsyncClient, srv: ServerProc) -> None:
    from rollbox.snapshots import languages

    missing = [n for n in languages.SUPPORTED if not (LANG_HOME / "names" / languages.LANGUAGES[n].snapshot).exists()]
    if not missing:
        pytest.skip(f"{LANG_HOME} holds every language's snapshot")
    resp = await http.post(srv.url + "run_code", json={"code": "x", "language": missing[0]})
    assert resp.status_code == 503, resp.text
    assert f"language {missing[0]!r} runs in the snapshot" in resp.json()["detail"]
    assert "rollbox snapshot build snapshots/templates/" in resp.json()["detail"]


async def test_a_missing_language_snapshot_is_built_on_first_use_once_with_its_steps_shown(
        lang_store: Path, tmp_path: Path) -> None:
    """A store without bash's snapshot (its layers and Debian build records are the language test store's,
    so the Debian layer is reused; the build's own steps, manifest and name all run here). The test holds
    the snapshot's build lock first, as a second process on the same home would: the server waits on it,
    shows that build's step (GET /languages, a 504 past the request's wait), then builds once for every
    waiting request when the lock is let go."""
    import fcntl

    home = tmp_path / "home"
    home.mkdir()
    for sub in ("layers", "layers-meta", "debian"):
        (home / sub).symlink_to(lang_store / sub)
    builds = home / "builds"
    builds.mkdir()
    lock = os.open(builds / "bash.lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(lock, fcntl.LOCK_EX)
    (builds / "bash.json").write_text(json.dumps({
        "language": "bash", "snapshot": "bash", "state": "building", "step": 1, "steps": 2,
        "doing": "base: mmdebstrap bookworm python3 ca-certificates", "since": time.time(), "pid": os.getpid()}))
    srv = start_server(tmp_path / "log", "--home", str(home), "--prewarm", "", "--durability", "off",
                       env={"ROLLBOX_DEBIAN_MAX_AGE_DAYS": "3650"})
    try:
        async with httpx.AsyncClient(timeout=httpx.Timeout(10.0, read=120.0)) as http:
            langs = {r["language"]: r for r in (await http.get(srv.url + "languages")).json()}
            assert (langs["bash"]["state"], langs["bash"]["step"], langs["bash"]["steps"]) == ("building", 1, 2)
            assert langs["julia"]["state"] == "unsupported" and "Debian 12" in langs["julia"]["error"]
            assert langs["lua"]["state"] == "missing" and langs["lua"]["built_on_first_use"] is True
            body = {"code": "read a b; echo $((a + b))", "language": "bash", "stdin": "40 2"}
            # verl's request: compile 1 s + run 1 s; the wait is 3/4 of that, then a 504 (which verl retries)
            resp = await http.post(srv.url + "run_code", json={**body, "compile_timeout": 1, "run_timeout": 1})
            assert resp.status_code == 504, resp.text
            assert "building bash, step 1/2: base: mmdebstrap" in resp.json()["detail"]
            assert int(resp.headers["retry-after"]) >= 1
            waiting = [asyncio.ensure_future(http.post(srv.url + "run_code", json={**body, "run_timeout": 30}))
                       for _ in range(3)]
            await asyncio.sleep(0.5)
            assert not any(w.done() for w in waiting)
            os.close(lock)  # the other process stopped without building it: this server builds it, once
            replies = await asyncio.gather(*waiting)
            for r in replies:
                assert r.status_code == 200, r.text
                assert (r.json()["status"], r.json()["run_result"]["stdout"]) == ("Success", "42\n")
            langs = {r["language"]: r for r in (await http.get(srv.url + "languages")).json()}
            assert langs["bash"]["state"] == "ready" and langs["bash"]["snapshot_id"]
        msgs = [str(r.get("msg", "")) for r in srv.log_records()]
        assert sum(m.startswith("built bash: snapshot bash = ") for m in msgs) == 1, msgs
        assert sum(m.startswith("building bash, step 0/2: starting (snapshots/templates/bash.yaml)")
                   for m in msgs) == 1, msgs
        assert any(m.startswith("building bash, step 1/2: base: reusing layer") for m in msgs), msgs
        assert any(m.startswith("building bash, step 2/2: snapshot bash = ") for m in msgs), msgs
        assert (home / "names" / "bash").read_text().strip() == langs["bash"]["snapshot_id"]
    finally:
        assert srv.stop() == 0, srv.log_path.read_text()[-4000:]


async def test_a_language_built_by_one_replica_is_pushed_to_s3_and_another_replica_runs_it_without_building(
        lang_store: Path, tmp_path: Path, seaweed: SeaweedS3) -> None:
    """Replica A: ``rollbox languages build bash --store s3://...`` on a home whose layers and Debian build
    records are the language test store's (bash's Debian layer is reused; the manifest, name and push run
    here). Replica B: ``rollbox serve`` on an empty home with that store: GET /languages says bash is ready
    in the store, and the first /run_code runs it from the pulled snapshot; B builds nothing (its home has
    no Debian records: a build would run mmdebstrap for minutes)."""
    import subprocess

    from rollbox.snapshots.store_s3 import S3Objects

    aws = {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_REGION": "us-east-1",
           "AWS_ENDPOINT_URL": seaweed.endpoint}
    store = f"s3://{seaweed.new_bucket()}/p"
    a = tmp_path / "a"
    a.mkdir()
    for sub in ("layers", "layers-meta", "debian"):
        (a / sub).symlink_to(lang_store / sub)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "ROLLBOX_"))}
    done = subprocess.run([sys.executable, "-m", "rollbox.functions.cli", "languages", "build", "bash", "--home", str(a),
                           "--store", store, "--json"], env={**env, **aws, "ROLLBOX_DEBIAN_MAX_AGE_DAYS": "3650"},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    (built,) = json.loads(done.stdout.strip().splitlines()[-1])
    s3 = store_factory(seaweed)(store)
    assert s3.names()["bash"] == built["snapshot_id"] and S3Objects(s3).keys("language-builds/") == []
    srv = start_server(tmp_path / "log", "--home", str(tmp_path / "b"), "--store", store, "--prewarm", "",
                       "--durability", "off", "--record", "off", env=aws)
    try:
        async with httpx.AsyncClient(timeout=httpx.Timeout(10.0, read=120.0)) as http:
            langs = {r["language"]: r for r in (await http.get(srv.url + "languages")).json()}
            assert (langs["bash"]["state"], langs["bash"]["where"]) == ("ready", "store"), langs["bash"]
            assert langs["bash"]["snapshot_id"] == built["snapshot_id"] and langs["lua"]["state"] == "missing"
            body = {"code": "read a b; echo $((a + b))", "language": "bash", "stdin": "40 2", "run_timeout": 30}
            r = await http.post(srv.url + "run_code", json=body)
            assert r.status_code == 200 and r.json()["run_result"]["stdout"] == "42\n", r.text
            langs = {r["language"]: r for r in (await http.get(srv.url + "languages")).json()}
            assert (langs["bash"]["state"], langs["bash"]["where"]) == ("ready", "here")  # pulled
        msgs = [str(r.get("msg", "")) for r in srv.log_records()]
        assert not any(m.startswith(("building bash", "built bash")) for m in msgs), msgs
        assert not (tmp_path / "b" / "builds" / "bash.json").exists()
    finally:
        assert srv.stop() == 0, srv.log_path.read_text()[-4000:]


async def test_a_replica_whose_home_holds_a_language_pushes_it_to_s3_at_start_and_an_empty_replica_runs_it(
        tmp_path: Path, seaweed: SeaweedS3) -> None:
    """Replica A: ``rollbox serve --store s3://...`` on a home that holds lua (a baked image's: its manifest and
    name here, its layers the language test store's, linked, not built): it listens at once and pushes lua
    to the store on a thread (under a claim, the name create-only), logging each step. Replica B, on an
    empty home with builds off, lists lua ready in the store and runs it from the pulled snapshot."""
    from rollbox.snapshots.store_s3 import S3Objects

    if not (LANG_HOME / "names" / "lua").is_file():
        pytest.skip(f"lua is not built in {LANG_HOME} (rollbox languages build lua --home {LANG_HOME})")
    sid = (LANG_HOME / "names" / "lua").read_text().strip()
    aws = {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_REGION": "us-east-1",
           "AWS_ENDPOINT_URL": seaweed.endpoint}
    store = f"s3://{seaweed.new_bucket()}/p"
    a = tmp_path / "a"
    for sub in ("manifests", "names"):
        (a / sub).mkdir(parents=True)
    for sub in ("layers", "layers-meta"):
        (a / sub).symlink_to(LANG_HOME / sub)
    shutil.copyfile(LANG_HOME / "manifests" / f"{sid}.json", a / "manifests" / f"{sid}.json")
    (a / "names" / "lua").write_text(sid)
    args = ("--store", store, "--prewarm", "", "--durability", "off", "--record", "off")
    srv_a = start_server(tmp_path / "log-a", "--home", str(a), *args, env=aws)
    srv_b = None
    try:
        deadline = time.monotonic() + 120
        while not any(str(r.get("msg", "")).startswith("language snapshots built here and pushed")
                      for r in srv_a.log_records()):
            assert time.monotonic() < deadline and srv_a.proc.poll() is None, srv_a.log_path.read_text()[-4000:]
            await asyncio.sleep(0.2)
        msgs = [str(r.get("msg", "")) for r in srv_a.log_records()]
        pushing = next(i for i, m in enumerate(msgs) if m.startswith("pushing lua: snapshot lua = " + sid))
        pushed = next(i for i, m in enumerate(msgs) if m.startswith(f"pushed lua: snapshot lua = {sid} to {store}"))
        assert msgs.index("listening") < pushed and pushing < pushed, msgs  # (startup did not wait for it)
        assert msgs[-1].startswith(f"language snapshots built here and pushed to {store}: lua (1 here;"), msgs
        s3 = store_factory(seaweed)(store)
        assert s3.names() == {"lua": sid} and S3Objects(s3).keys("language-builds/") == []

        srv_b = start_server(tmp_path / "log-b", "--home", str(tmp_path / "b"), *args, "--language-builds", "off",
                             env=aws)
        async with httpx.AsyncClient(timeout=httpx.Timeout(10.0, read=120.0)) as http:
            langs = {r["language"]: r for r in (await http.get(srv_b.url + "languages")).json()}
            assert (langs["lua"]["state"], langs["lua"]["where"], langs["lua"]["snapshot_id"]) == ("ready", "store", sid)
            body = {"code": "print(40 + 2)", "language": "lua", "run_timeout": 30}
            r = await http.post(srv_b.url + "run_code", json=body)
            assert r.status_code == 200 and r.json()["run_result"]["stdout"] == "42\n", r.text
            langs = {r["language"]: r for r in (await http.get(srv_b.url + "languages")).json()}
            assert (langs["lua"]["state"], langs["lua"]["where"]) == ("ready", "here")  # pulled
        msgs_b = [str(r.get("msg", "")) for r in srv_b.log_records()]
        assert "language snapshots built here and pushed to " + store + ": none (0 here; " in " ".join(msgs_b)
    finally:
        if srv_b is not None:
            assert srv_b.stop() == 0, srv_b.log_path.read_text()[-4000:]
        assert srv_a.stop() == 0, srv_a.log_path.read_text()[-4000:]


async def test_the_python_client_runs_a_language_with_cases(srv: ServerProc) -> None:
    from rollbox.functions.client import Client

    async with Client(srv.url) as client:
        res = await client.run(CPP_SUM + f"// {uuid.uuid4()}", language="cpp", compile_timeout_s=60, timeout_s=20,
                               cases=[{"stdin": "1 2", "expected_stdout": "3"}, {"stdin": "2 2", "expected_stdout": "5"}])
    assert res.compile is not None and res.compile.exit_code == 0
    assert res.cases is not None and [c.passed for c in res.cases] == [True, False]
    async with Client(srv.url) as client:  # no language: the code is Python, run per case (it used to run once)
        res = await client.run("print(sum(map(int, input().split())))", timeout_s=20,
                               cases=[{"stdin": "1 2", "expected_stdout": "3"}, {"stdin": "2 2", "expected_stdout": "5"}])
    assert res.cases is not None and [c.passed for c in res.cases] == [True, False] and res.compile is None


# ----------------------------------------------------------------------- verl's own client, unchanged


def _verl() -> types.ModuleType:
    """verl 0.9.1's sandbox_fusion module alone (it needs only requests): installed without its
    dependencies by scripts/bootstrap; its parent packages (which import torch) are stubbed."""
    try:
        spec = importlib.util.find_spec("verl")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("verl is not installed (scripts/bootstrap: pip install --no-deps verl==0.9.1)")
    root = Path(next(iter(spec.submodule_search_locations)))
    saved = {k: v for k, v in sys.modules.items() if k == "verl" or k.startswith("verl.")}
    for name, sub in (("verl", ""), ("verl.utils", "utils"), ("verl.utils.reward_score", "utils/reward_score")):
        m = types.ModuleType(name)
        m.__path__ = [str(root / sub)]
        sys.modules[name] = m
    try:
        return importlib.import_module("verl.utils.reward_score.sandbox_fusion")
    finally:
        for k in [k for k in sys.modules if k == "verl" or k.startswith("verl.")]:
            if k not in ("verl.utils.reward_score.sandbox_fusion", "verl.utils.reward_score.sandbox_fusion.utils"):
                sys.modules.pop(k, None)
        sys.modules.update(saved)


PROGRAMS: dict[str, dict[str, str]] = {
    "python": {
        "ok": "a, b = map(int, input().split())\nprint(a + b)",
        "wa": "a, b = map(int, input().split())\nprint(a - b)",
        "re": "a, b = map(int, input().split())\nprint(a // 0)",
        "tle": "while True:\n    pass",
        "ce": "",  # python has no compile step: a syntax error is a runtime error (-2), as in SandboxFusion
    },
    "cpp": {
        "ok": CPP_SUM,
        "wa": CPP_SUM.replace("a+b", "a-b"),
        "re": "#include <bits/stdc++.h>\nint main(){std::vector<int> v; return v.at(3);}\n",
        "tle": "int main(){volatile long i=0; for(;;) i++;}\n",
        "ce": "int main(){ return undefined_name; }\n",
    },
    "java": {
        "ok": JAVA_SUM,
        "wa": JAVA_SUM.replace("a+b", "a*b"),
        "re": "public class Main{public static void main(String[] x){throw new RuntimeException(\"boom\");}}",
        "tle": "public class Main{public static void main(String[] x){while(true){}}}",
        "ce": "public class Main{public static void main(String[] x){System.uto.println(1);}}",
    },
    "go": {
        "ok": "package main\nimport \"fmt\"\nfunc main(){var a,b int\nfmt.Scan(&a,&b)\nfmt.Println(a+b)}\n",
        "wa": "package main\nimport \"fmt\"\nfunc main(){var a,b int\nfmt.Scan(&a,&b)\nfmt.Println(a*b)}\n",
        "re": "package main\nfunc main(){var m map[string]int\nm[\"a\"]=1}\n",
        "tle": "package main\nfunc main(){for{}}\n",
        "ce": "package main\nfunc main(){undefined()}\n",
    },
    "nodejs": {
        "ok": "const [a,b]=require('fs').readFileSync(0,'utf8').trim().split(/\\s+/).map(Number);console.log(a+b);",
        "wa": "const [a,b]=require('fs').readFileSync(0,'utf8').trim().split(/\\s+/).map(Number);console.log(a-b);",
        "re": "null.x;",
        "tle": "for(;;){}",
        "ce": "",  # no compile step in node: a syntax error is a runtime error
    },
}
EXPECTED = {"ok": True, "wa": False, "re": -2, "tle": -3, "ce": -4, "mle": -2}
# over verl's memory_limit_mb=1024 (every page written): a runtime error, as verl scores it
OVER_1_GIB = {
    "python": "x = bytearray(2 << 30)\nx[::4096] = b'x' * len(x[::4096])\nprint(len(x))",
    "cpp": "#include <bits/stdc++.h>\nint main(){std::vector<char> v(2ul<<30, 1); std::cout << int(v[7]) << std::endl;}\n",
    "java": JAVA_2_GIB,
    "go": "package main\nimport \"fmt\"\nfunc main(){b:=make([]byte,2<<30)\nfor i:=range b{b[i]=1}\nfmt.Println(b[7])}\n",
    "nodejs": "const b = Buffer.alloc(2 ** 31, 1); console.log(b[7]);",
}
for _lang, _code in OVER_1_GIB.items():
    PROGRAMS[_lang]["mle"] = _code


@pytest.mark.parametrize("language", list(PROGRAMS))
def test_verls_check_correctness_gives_the_right_verdicts(srv: ServerProc, language: str) -> None:
    sf = _verl()
    url = srv.url + "run_code"
    tests = {"inputs": ["1 2\n", "20 22\n"], "outputs": ["3", "42"]}
    for kind, code in PROGRAMS[language].items():
        if not code:
            code, want = ("def f(:\n" if language == "python" else "function (") + f"  // {kind}", -2
        else:
            want = EXPECTED[kind]
        nonce = "#" if language == "python" else "//"
        code = f"{code}\n{nonce} {uuid.uuid4()}"
        # (verl's default: one value for the compile and for the run; a JVM or node writing 1 GiB on a
        # loaded box once took over 10 s, a timeout then and not the memory verdict)
        timeout = 2 if kind == "tle" else 30 if kind == "mle" else 10
        if kind == "tle" and language in ("cpp", "java", "go"):  # compiled first (cached: the request's compile
            # timeout is then moot), so a loaded machine's slow javac cannot make the 2 s a compile timeout
            first = httpx.post(url, json={"code": code + "\n\n", "language": language, "compile_timeout": 60,
                                          "run_timeout": 0.1, "memory_limit_MB": 1024}, timeout=120)
            assert first.json()["compile_result"]["return_code"] == 0, first.text
        results, meta = sf.utils.check_correctness(url, tests, code, timeout=timeout,
                                                   memory_limit_mb=1024, language=language)
        assert results == [want, want], (language, kind, meta)
    # the score verl computes from a model's completion (python only in verl's default path)
    score, _ = sf.compute_score(url, None, 1024, "```python\n" + PROGRAMS["python"]["ok"] + "\n```", tests,
                                continuous=True) if language == "python" else (1.0, None)
    assert score == 1.0
