"""One row per language through POST /run_code: a hello world and a typical solution (read two numbers,
print their sum; 10 test cases of one program, as verl sends them), compile cache off and on. The test
runners' languages (pytest, junit, go_test, jest, D_ut) run a test file (one test; ten tests of a sum),
sql and verilog a program that prints a fixed sum (no stdin for them here).

    .venv/bin/python loadtest/bench_language_rows.py                          # every language below
    .venv/bin/python loadtest/bench_language_rows.py --languages cpp,go,lua -n 20 -c 16

Per language and program, ``-n`` requests at most ``-c`` in flight: "on" sends one source (the compile
cache compiles it once; languages without a compile step have nothing to cache), "off" makes every
source differ by a comment (every request compiles, as SandboxFusion). Every reply is checked (status
Success, the right stdout). Prints runs/s and the p50/p99 of a request per row. Starts its own `rollbox
serve` on --home (a store with the languages' snapshots, e.g. /var/tmp/rbx-langs) and stops it by pid.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path

import bench_languages
import bench_service
import httpx

# language -> (comment prefix, hello world, a + b from stdin)
PROGRAMS: dict[str, tuple[str, str, str]] = {
    "python": ("#", "print('hello')", "a, b = map(int, input().split())\nprint(a + b)"),
    "cpp": ("//", '#include <cstdio>\nint main(){puts("hello");}',
            "#include <bits/stdc++.h>\nint main(){long a,b;std::cin>>a>>b;std::cout<<a+b<<'\\n';}"),
    "java": ("//", 'public class Main{public static void main(String[] a){System.out.println("hello");}}',
             "import java.util.*;\npublic class Main{public static void main(String[] x){Scanner s=new Scanner(System.in);"
             "long a=s.nextLong(),b=s.nextLong();System.out.println(a+b);}}"),
    "go": ("//", 'package main\nimport "fmt"\nfunc main(){fmt.Println("hello")}',
           'package main\nimport "fmt"\nfunc main(){var a,b int64;fmt.Scan(&a,&b);fmt.Println(a+b)}'),
    "nodejs": ("//", "console.log('hello')",
               "const [a,b]=require('fs').readFileSync(0,'utf8').trim().split(/\\s+/).map(Number);console.log(a+b)"),
    "typescript": ("//", "const s: string = 'hello'; console.log(s)",
                   "const [a,b]: number[]=require('fs').readFileSync(0,'utf8').trim().split(/\\s+/).map(Number);"
                   "console.log(a+b)"),
    "rust": ("//", 'fn main(){println!("hello");}',
             "use std::io::Read;\nfn main(){let mut s=String::new();std::io::stdin().read_to_string(&mut s).unwrap();"
             "let v:Vec<i64>=s.split_whitespace().map(|x|x.parse().unwrap()).collect();println!(\"{}\",v[0]+v[1]);}"),
    "bash": ("#", "echo hello", "read a b; echo $((a + b))"),
    "php": ("//", "<?php echo \"hello\\n\";", "<?php fscanf(STDIN, \"%d %d\", $a, $b); echo ($a + $b), \"\\n\";"),
    "ruby": ("#", "puts 'hello'", "a, b = gets.split.map(&:to_i); puts a + b"),
    "lua": ("--", "print('hello')", "local a, b = io.read('n', 'n'); print(math.tointeger(a + b))"),
    "perl": ("#", "print \"hello\\n\";", "my ($a, $b) = split ' ', <STDIN>; print $a + $b, \"\\n\";"),
    "csharp": ("//", 'class P{static void Main(){System.Console.WriteLine("hello");}}',
               "class P{static void Main(){var s=System.Console.ReadLine().Split(' ');"
               "System.Console.WriteLine(long.Parse(s[0])+long.Parse(s[1]));}}"),
    "R": ("#", "cat('hello\\n')", "x <- scan(file('stdin'), quiet=TRUE); cat(x[1] + x[2], '\\n', sep='')"),
    "racket": (";", "#lang racket\n(displayln \"hello\")", "#lang racket\n(displayln (+ (read) (read)))"),
    "D_ut": ("//", "unittest { assert(1 + 1 == 2); }\nvoid main() {}",
             "long sum(long a, long b) { return a + b; }\n"
             + "".join(f"unittest {{ assert(sum({i}, {i * 7}) == {i * 8}); }}\n" for i in range(1, 11))
             + "void main() {}"),
    "scala": ("//", 'object Main extends App { println("hello") }',
              "object Main extends App { val Array(a, b) = scala.io.StdIn.readLine().split(' ').map(_.toLong); "
              "println(a + b) }"),
    "kotlin_script": ("//", 'println("hello")',
                      'val (a, b) = readLine()!!.trim().split(" ").map { it.toLong() }\nprintln(a + b)'),
    # sqlite3 reads the program from its stdin and Icarus has no handy stdin: both print a fixed sum
    "sql": ("--", "SELECT 'hello';", "SELECT 20 + 22;"),
    "verilog": ("//", 'module tb; initial begin $display("hello"); $finish; end endmodule',
                'module tb; integer a = 20, b = 22; initial begin $display("%0d", a + b); $finish; end endmodule'),
    # test runners: a test file whose tests pass (status Success); their report's wording is not compared
    "pytest": ("#", "def test_hello():\n    assert 'hello'\n",
               "def add(a, b):\n    return a + b\n\n"
               + "".join(f"def test_{i}():\n    assert add({i}, {i * 7}) == {i * 8}\n" for i in range(1, 11))),
    "junit": ("//", "import org.junit.jupiter.api.Test;\nimport static org.junit.jupiter.api.Assertions.*;\n"
                    "public class HelloTest { @Test void hello() { assertEquals(2, 1 + 1); } }",
              "import org.junit.jupiter.api.Test;\nimport static org.junit.jupiter.api.Assertions.*;\n"
              "public class SumTest { static long add(long a, long b) { return a + b; }\n"
              + "".join(f"  @Test void t{i}() {{ assertEquals({i * 8}, add({i}, {i * 7})); }}\n" for i in range(1, 11))
              + "}"),
    "go_test": ("//", 'package main\nimport "testing"\nfunc TestHello(t *testing.T){ if 1+1 != 2 { t.Fatal("no") } }\n',
                'package main\nimport "testing"\nfunc add(a, b int) int { return a + b }\n'
                + "".join(f'func Test{i}(t *testing.T){{ if add({i}, {i * 7}) != {i * 8} {{ t.Fatal("no") }} }}\n'
                          for i in range(1, 11))),
    "jest": ("//", "test('hello', () => { expect(1 + 1).toBe(2); });",
             "const add = (a: number, b: number): number => a + b;\n"
             + "".join(f"test('{i}', () => {{ expect(add({i}, {i * 7})).toBe({i * 8}); }});\n" for i in range(1, 11))),
}
# languages whose programs are test files (verdict: the tests pass) or print a fixed sum
TEST_FILES = ("pytest", "junit", "go_test", "jest", "D_ut")
FIXED_SUM = ("sql", "verilog")
SUM_CASES = [(f"{i} {i * 7}\n", f"{i * 8}\n") for i in range(1, 11)]


async def rows_for(http: httpx.AsyncClient, url: str, lang: str, n: int, c: int) -> list[tuple[str, bench_languages.Stats]]:
    comment, hello, solution = PROGRAMS[lang]
    out = []
    hello_out: str | None = "hello\n"
    sum_cases: list[tuple[str, str | None]] = list(SUM_CASES)
    if lang in TEST_FILES:  # one test file of ten tests; each request runs it
        hello_out, sum_cases = None, [("", None)]
    elif lang in FIXED_SUM:
        sum_cases = [("", "42\n")]
    for kind, code, cases in (("hello", hello, [("", hello_out)]), ("a+b x10", solution, sum_cases)):
        for cache in ("off", "on"):
            st = bench_languages.Stats()
            sem = asyncio.Semaphore(c)
            program = f"{code}\n{comment} {uuid.uuid4()}\n"
            t0 = time.perf_counter()
            jobs = []
            for i in range(n):
                stdin, want = cases[i % len(cases)]
                src = program if cache == "on" else f"{program}{comment} request {i}\n"
                jobs.append(bench_languages.post(http, sem, url, st, want, {
                    "code": src, "language": lang, "stdin": stdin, "memory_limit_MB": 1024,
                    "compile_timeout": 60, "run_timeout": 30}))
            await asyncio.gather(*jobs)
            st.wall = time.perf_counter() - t0
            st.units = n
            out.append((f"{kind}, cache {cache}", st))
    return out


async def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--home", default=os.environ.get("ROLLBOX_HOME", "/var/tmp/rbx-langs"))
    p.add_argument("--languages", default=",".join(PROGRAMS))
    p.add_argument("-n", "--requests", type=int, default=20, help="requests per row")
    p.add_argument("-c", "--concurrency", type=int, default=16)
    args = p.parse_args()
    langs = [x for x in args.languages.split(",") if x]
    unknown = [x for x in langs if x not in PROGRAMS]
    if unknown:
        raise SystemExit(f"no programs for {unknown}; known: {', '.join(PROGRAMS)}")
    print("| language | program | runs/s | p50 ms | p99 ms | errors |")
    print("|---|---|---|---|---|---|")
    bad = 0
    with tempfile.TemporaryDirectory(prefix="bench-language-rows-") as tmp:
        proc, url = bench_service.start(Path(tmp) / "serve.log", [
            "--home", args.home, "--prewarm", "", "--log-level", "warning", "--max-queued", "4096",
            "--language-builds", "off"], timeout_s=120)
        try:
            async with httpx.AsyncClient(timeout=httpx.Timeout(10.0, read=300.0),
                                         limits=httpx.Limits(max_connections=args.concurrency + 4)) as http:
                for lang in langs:
                    warm = bench_languages.Stats()  # the language's zygote, not measured
                    await bench_languages.post(http, asyncio.Semaphore(1), url, warm,
                                               None if lang in TEST_FILES else "hello\n",
                                               {"code": PROGRAMS[lang][1], "language": lang, "compile_timeout": 60,
                                                "run_timeout": 30})
                    for name, st in await rows_for(http, url, lang, args.requests, args.concurrency):
                        r = st.row()
                        bad += len(st.errors)
                        print(f"| {lang} | {name} | {r['per_s']:.2f} | {r['p50_ms']:.0f} | {r['p99_ms']:.0f} | "
                              f"{len(st.errors)} |", flush=True)
                        for e in st.errors[:1]:
                            print(f"<!-- error: {e[:200]} -->", flush=True)
        finally:
            bench_service.stop(proc)
    print(f"\nbench_language_rows: c{args.concurrency}, {args.requests} requests per row, home {args.home}, "
          f"{os.cpu_count()} CPUs (load average at the end: {os.getloadavg()[0]:.1f})")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
