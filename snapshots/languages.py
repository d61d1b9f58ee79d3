"""The runner model: how each of SandboxFusion's languages is compiled and run in a rollbox sandbox.

One row per language SandboxFusion's ``/run_code`` names (sandbox/runners/major.py, minor.py, cuda.py):
the snapshot whose toolchain runs it (built from ``snapshots/templates/<template>``), the file the
code is written to, the compile command (its own step, with the request's ``compile_timeout``;
``artifacts`` are what it leaves for the run, and what a compile cache keeps), and the run command
(the request's ``run_timeout`` and ``stdin``). Commands are ``sh -c`` strings run in the sandbox's home
(``/home/sandbox``), where the source and the request's ``files`` are written; they hold no
user input (only the fixed file names, and the class or object name the code declares, matched to
``\\w+``). The commands follow SandboxFusion's own (same compilers' flags, same test runners), with
Debian 12's toolchains; where Debian has another tool the row says so in ``note``.

Languages Debian 12 does not package have ``snapshot=None`` and ``unsupported`` saying why:
``plan()`` refuses them with an error naming the language.

A JVM sizes its heap from the machine's memory, not the sandbox's, when no cgroup it can read says
otherwise (without a cgroup the limit is RLIMIT_DATA: a JVM whose heap may grow to a quarter of the host's
memory crashes, "committing reserved memory", once it grows past the limit): ``plan(..., memory_max_bytes=)`` gives
the JVM rows' java (and javac, scala, scalac, kotlinc, through ``-J``) ``-XX:MaxRAM`` at the sandbox's
limit, so the heap is 75% of it and a program over it is an OutOfMemoryError (a runtime error).

    plan = languages.plan("cpp", code, memory_max_bytes=1 << 30)
    plan.snapshot, plan.files, plan.compile, plan.run, plan.artifacts
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

from rollbox.runtime.errors import InvalidRequest

WORKDIR = "/home/sandbox"
JAVA = "java -XX:+UseSerialGC{jvm}"  # one GC thread pair instead of one per core: a sandbox has ~1 core
# the share of the sandbox's memory a JVM's heap may take: the rest is the JVM's own (metaspace, code
# cache, thread stacks, GC) and the launcher's
JVM_HEAP_PERCENT = 75
JAVATUPLES = "/usr/share/java/javatuples.jar"
JUNIT = "/usr/share/java/junit-platform-console-standalone.jar"
TestRunner = Literal["pytest", "junit", "go test", "jest", "d unittest"]


@dataclass(frozen=True)
class Language:
    """One row of the table (see the module's docstring)."""

    name: str
    snapshot: str | None
    source: str = ""
    compile: str | None = None
    run: str = ""
    artifacts: tuple[str, ...] = ()
    tests: TestRunner | None = None  # the run step runs the code's tests with this runner: exit 0 = all passed
    template: str | None = None  # snapshots/templates/<template>
    # named transforms of the code, done by plan(): the PHP open tag; the file/class name from the code
    php_tag: bool = False
    name_from: Literal["java_public_class", "scala_object"] | None = None
    extra_files: dict[str, str] = field(default_factory=dict)
    python_inline: bool = False  # the code may run in the warm interpreter itself (a `code` exec)
    jvm: bool = False  # {jvm} in compile and run: the JVM's memory flags (``jvm_flags``), ``-J`` for {jvm_j}
    note: str = ""
    unsupported: str = ""


BABEL_CONFIG = """module.exports = {
  presets: [['@babel/preset-env', {targets: {node: 'current'}}], '@babel/preset-typescript'],
};
"""

# no transform at run time: the compile step made JavaScript (loading babel's presets was most of a jest run)
# kotlin_script: the script compiled once (its class Main, whose constructor runs it), run by this main as
# `kotlinc -script` runs it: an exception as it prints it (the exception and the script's frames, no cause), exit 3
KTS_MAIN = """fun main(args: Array<String>) {
    try {
        Main(args)
    } catch (e: Throwable) {
        System.err.println(e)
        for (frame in e.stackTrace.takeWhile { it.className != "RollboxKtsKt" }) System.err.println("\\tat $frame")
        kotlin.system.exitProcess(3)
    }
}
"""
KOTLIN_CP = ":".join(f"/usr/share/java/kotlin-{jar}.jar" for jar in ("stdlib", "script-runtime", "reflect"))

JEST_PACKAGE = '{"name": "coderunner", "version": "1.0.0", "jest": {"maxWorkers": 1, "transform": {}}}\n'

_ROWS = (
    Language("python", "python3", "main.py", run="python3 main.py", template="python3.yaml", python_inline=True,
             note="Debian's Python 3.11 with numpy (SandboxFusion's image has a conda env with many more)"),
    Language("pytest", "pytest", "test_main.py", run="python3 -m pytest test_main.py", tests="pytest",
             template="pytest.yaml"),
    Language("cpp", "cpp", "main.cpp", compile="g++ -std=c++17 main.cpp -o main -lcrypto -lssl -lpthread",
             run="./main", artifacts=("main",), template="cpp.yaml",
             note="g++ 12; bits/stdc++.h precompiled for these flags (used when it is the first include)"),
    Language("java", "java", "Main.java", compile=f"javac{{jvm_j}} -cp .:{JAVATUPLES} Main.java",
             run=f"{JAVA} -cp .:{JAVATUPLES} -ea Main", artifacts=("*.class",), template="java.yaml", jvm=True,
             note="OpenJDK 17; javatuples on the class path as in SandboxFusion"),
    Language("junit", "junit", "{name}.java", compile=f"javac{{jvm_j}} -cp .:{JUNIT} *.java",
             run=f"{JAVA} -jar {JUNIT} --class-path . --scan-class-path", artifacts=("*.class",), tests="junit",
             template="junit.yaml", name_from="java_public_class", jvm=True,
             note="JUnit 5.9 console launcher (Debian's junit5); SandboxFusion has 1.8.2's"),
    Language("go", "go", "main.go", compile="go build -o main main.go", run="./main", artifacts=("main",),
             template="go.yaml", note="Go 1.19, GOPATH mode with testify (no module downloads at run time)"),
    # the test binary compiled once (go test -c runs go test's vet checks too), run as go test runs it: with
    # -test.paniconexit0 a test calling os.Exit(0) fails, as under go test (else the binary exits 0)
    Language("go_test", "go_test", "main_test.go", compile="go test -c -o main.test main_test.go",
             run="./main.test -test.paniconexit0 -test.timeout=10m0s", artifacts=("main.test",), tests="go test",
             template="go_test.yaml",
             note="Go 1.19, GOPATH mode with testify; the test binary is compiled once (SandboxFusion runs "
                  "go test main_test.go: the same verdict, exit 0 = all passed; its report says PASS, not ok)"),
    Language("nodejs", "nodejs", "main.js", run="node main.js", template="nodejs.yaml", note="Node.js 18"),
    Language("typescript", "typescript", "main.ts",
             compile="esbuild main.ts --outfile=main.js --format=cjs --platform=node --log-level=warning",
             run="node main.js", artifacts=("main.js",), template="typescript.yaml",
             note="esbuild strips the types (no type check, as SandboxFusion's tsx), node 18 runs it"),
    # TypeScript to JavaScript once, as babel-jest would at each run (its preset hoists jest.mock), every .ts and
    # .tsx file of the home, subdirectories included (the test's helpers too); jest runs the JavaScript
    # untransformed; the artifacts are every .js file under the home (word-split: no spaces in their names)
    Language("jest", "jest", "main.test.ts",
             compile="babeljs --presets babel-preset-jest --extensions .ts,.tsx --out-dir . --quiet .",
             run="FORCE_COLOR=0 jest --ci main.test.js", tests="jest", template="jest.yaml",
             artifacts=("$(find . -name '*.js' ! -path './node_modules/*' | cut -c3-)",),
             extra_files={"babel.config.js": BABEL_CONFIG, "package.json": JEST_PACKAGE},
             note="Jest 29 with babel's TypeScript preset, all from Debian; the test transpiled once by babel "
                  "(SandboxFusion's jest transforms it at each run: its report names main.test.js)"),
    Language("rust", "rust", "main.rs", compile="rustc main.rs -o main", run="./main", artifacts=("main",),
             template="rust.yaml", note="rustc 1.63 (no crates)"),
    Language("bash", "bash", "main.sh", run="bash main.sh", template="bash.yaml"),
    Language("php", "php", "main.php", run="php -f main.php", template="php.yaml", php_tag=True, note="PHP 8.2"),
    Language("ruby", "ruby", "main.rb", run="ruby main.rb", template="ruby.yaml", note="Ruby 3.1"),
    Language("lua", "lua", "main.lua", run="lua main.lua", template="lua.yaml", note="Lua 5.4"),
    Language("perl", "perl", "main.pl", run="perl main.pl", template="perl.yaml", note="Perl 5.36"),
    Language("R", "r", "main.R", run="Rscript main.R", template="R.yaml", note="R 4.2 (base packages)"),
    # scala, scalac and kotlinc are Debian's shell launchers: -J flags go to their java after the launchers'
    # default JAVA_OPTS (-Xmx256M -Xms32M), whose -Xmx keeps the heap at 256 MiB; MaxRAM sizes the rest
    Language("scala", "scala", "main.scala", compile="scalac{jvm_j} main.scala", run="scala{jvm_j} {name}",
             artifacts=("*.class",), template="scala.yaml", name_from="scala_object", jvm=True, note="Scala 2.11"),
    # the compiled script runs on java with kotlinc's -Xmx256M -Xms32M: the heap the script had under kotlinc -script
    Language("kotlin_script", "kotlin_script", "main.kts", compile="kotlinc{jvm_j} main.kts RollboxKts.kt -d .",
             run=f"{JAVA} -Xmx256M -Xms32M -cp .:{KOTLIN_CP} RollboxKtsKt", artifacts=("*.class",),
             template="kotlin_script.yaml", extra_files={"RollboxKts.kt": KTS_MAIN}, jvm=True,
             note="Kotlin 1.3 (Debian's kotlin); the script compiled once and run on the JVM with kotlinc's heap "
                  "(SandboxFusion runs kotlinc -script main.kts: the same output and exit status)"),
    Language("csharp", "csharp", "main.cs", compile="mcs -out:main.exe main.cs", run="mono main.exe",
             artifacts=("main.exe",), template="csharp.yaml",
             note="Mono 6.8's mcs (C# 7; SandboxFusion runs .NET, which Debian does not package)"),
    Language("racket", "racket", "main.rkt", run="racket main.rkt", template="racket.yaml", note="Racket 8.7"),
    Language("sql", "sql", "main.sql", run="sqlite3 -batch -bail :memory: < main.sql", template="sql.yaml",
             note="SQLite 3.40 on an in-memory database (SandboxFusion lists sql but has no runner for it)"),
    Language("verilog", "verilog", "main.sv",
             compile="iverilog -Wall -Winfloop -Wno-timescale -g2012 -s tb -o test.vvp main.sv",
             run="vvp -n test.vvp", artifacts=("test.vvp",), template="verilog.yaml", note="Icarus Verilog 11"),
    Language("D_ut", "d_ut", "main.d", compile="ldmd2 main.d -unittest -of=main", run="./main",
             artifacts=("main",), tests="d unittest", template="D_ut.yaml",
             note="LDC 1.30 through ldmd2, which takes dmd's flags (Debian has no dmd)"),
    Language("julia", None, unsupported="Debian 12 does not package Julia (it left Debian after bullseye)"),
    Language("lean", None, unsupported="Debian 12 does not package Lean 4 (SandboxFusion downloads it with elan "
                                       "and its Mathlib with lake)"),
    Language("swift", None, unsupported="Debian 12 does not package the Swift compiler (its 'swift' package is "
                                        "OpenStack's object store)"),
    Language("cuda", None, unsupported="needs NVIDIA's CUDA toolkit (non-free, not in Debian 12's main) and a GPU"),
    Language("python_gpu", None, unsupported="needs a GPU and CUDA builds of PyTorch, which Debian 12 does not "
                                             "package"),
)

LANGUAGES: dict[str, Language] = {row.name: row for row in _ROWS}
SUPPORTED = tuple(name for name, row in LANGUAGES.items() if row.snapshot is not None)


@dataclass(frozen=True)
class Plan:
    """One request's steps: write ``files`` (path under WORKDIR -> text), run ``compile`` (if any),
    then ``run``. ``compile_error``: the code cannot be compiled at all (SandboxFusion answers these
    as a failed compile: return code 1, this message on stderr)."""

    language: str
    snapshot: str
    files: dict[str, str]
    compile: str | None
    run: str
    artifacts: tuple[str, ...]
    tests: TestRunner | None = None
    python_inline: bool = False
    compile_error: str | None = None


class UnsupportedLanguage(InvalidRequest):
    """A language this runner model does not run (unknown, or without a toolchain in Debian 12)."""


def language(name: str) -> Language:
    """The row of a language that runs here; UnsupportedLanguage, naming it and why, otherwise."""
    row = LANGUAGES.get(name)
    if row is None:
        raise UnsupportedLanguage(f"unknown language {name!r}; supported: {', '.join(SUPPORTED)}")
    if row.snapshot is None:
        raise UnsupportedLanguage(f"language {name!r} is not supported: {row.unsupported}")
    return row


def jvm_flags(memory_max_bytes: int | None) -> list[str]:
    """A JVM's flags for a sandbox of ``memory_max_bytes``: its heap sized from that, not the host's memory."""
    if memory_max_bytes is None:
        return []
    return [f"-XX:MaxRAM={memory_max_bytes}", f"-XX:MaxRAMPercentage={JVM_HEAP_PERCENT}"]


def plan(name: str, code: str, memory_max_bytes: int | None = None) -> Plan:
    """What to write and run for ``code`` in language ``name`` (see Plan). ``memory_max_bytes``: the
    sandbox's memory limit, which a JVM language's heap is sized to (None: the JVM sizes it itself)."""
    row = language(name)
    assert row.snapshot is not None
    source, run, compile_, error = row.source, row.run, row.compile, None
    if row.jvm:
        flags = jvm_flags(memory_max_bytes)
        jvm = {"jvm": "".join(f" {f}" for f in flags), "jvm_j": "".join(f" -J{f}" for f in flags)}
        run = run.replace("{jvm}", jvm["jvm"]).replace("{jvm_j}", jvm["jvm_j"])
        if compile_ is not None:
            compile_ = compile_.replace("{jvm}", jvm["jvm"]).replace("{jvm_j}", jvm["jvm_j"])
    if row.php_tag:
        code = php_with_tag(code)
    if row.name_from == "java_public_class":
        source = source.format(name=java_public_class(code) or "Main")
    elif row.name_from == "scala_object":
        obj = scala_object(code)
        if obj is None:
            error = "Object name not found."
        run = run.format(name=obj or "Main")
    files = {**row.extra_files, source: code}
    return Plan(language=name, snapshot=row.snapshot, files=files, compile=compile_, run=run,
                artifacts=row.artifacts, tests=row.tests, python_inline=row.python_inline, compile_error=error)


def missing_snapshot(name: str) -> str:
    """What to say when a language's snapshot is not in the store: the template that builds it."""
    row = language(name)
    return (f"language {name!r} runs in the snapshot {row.snapshot!r}, which is not built: "
            f"rollbox snapshot build snapshots/templates/{row.template} (from Debian's packages)")


def php_with_tag(code: str) -> str:
    """SandboxFusion's ensure_php_tag_in_string: leading whitespace dropped, ``<?php`` added if missing."""
    code = code.lstrip()
    return code if code.startswith("<?php") else "<?php\n" + code


def java_public_class(code: str) -> str | None:
    """SandboxFusion's find_java_public_class_name."""
    m = re.search(r"\bpublic\s+(abstract\s+|final\s+)?class\s+(\w+)", code)
    return m.group(2) if m else None


def scala_object(code: str) -> str | None:
    """SandboxFusion's find_scala_classname (the first ``object NAME``)."""
    m = re.findall(r"object\s+(\w+)(\s*)|(\s+extends\s+\w+\s*){", code, re.DOTALL | re.MULTILINE)
    return m[0][0] or None if m else None


__all__ = ["LANGUAGES", "SUPPORTED", "WORKDIR", "Language", "Plan", "UnsupportedLanguage", "java_public_class",
           "jvm_flags", "language", "missing_snapshot", "php_with_tag", "plan", "scala_object"]
