"""Restore vs cold start, side by side in one run, on one snapshot with numpy warmed.

    .venv/bin/python loadtest/bench_restore.py [--n 200] [--cold-n 10]

As root it adds, side by side, a user namespace per sandbox (``--uid-range``) against none: unpooled
restore latency and one-shot runs/s at concurrency 16, in alternating rounds.

The snapshot is built ad hoc: a layer holding this environment's numpy under /opt/rollbox/site-packages,
and a warm recipe that imports numpy. Three ways to get a ready, fully contained sandbox:

- cold start: a fresh interpreter, its imports, the snapshot's mount view, then containment
  (what every sandbox would cost without zygotes);
- unpooled restore: fork of the warm zygote + containment (namespaces, overlay root, cgroup, seccomp);
- pooled acquire: take a sandbox the warm pool restored ahead of demand.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy
from rollbox.runtime import slots
from rollbox.runtime.restore import Zygote
from rollbox.runtime.runtime import Runtime, RuntimeConfig
from rollbox.runtime.snapshot import BuiltinResolver, SnapshotView, WarmRecipe, host_python_view
from rollbox.runtime.spec import ExecRequest

SITE = "/opt/rollbox/site-packages"


def numpy_layer(layer_root: Path) -> str:
    """Copy this environment's numpy into a content-named layer directory (once)."""
    src = Path(numpy.__file__).parent
    libs = src.parent / "numpy.libs"
    key = hashlib.sha256(f"{src}:{numpy.__version__}".encode()).hexdigest()[:16]
    name = f"bench-numpy-{key}"
    dst = layer_root / name
    if not dst.exists():
        tmp = layer_root / f".{name}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        site = tmp / SITE.lstrip("/")
        site.mkdir(parents=True)
        shutil.copytree(src, site / "numpy", ignore=shutil.ignore_patterns("tests", "__pycache__"))
        if libs.is_dir():
            shutil.copytree(libs, site / "numpy.libs")
        for p in tmp.rglob("*"):
            os.chmod(p, 0o755 if p.is_dir() else 0o644 | (p.stat().st_mode & 0o111))
        os.chmod(tmp, 0o755)
        tmp.rename(dst)
    return name


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q / 100 * (len(xs) - 1)))]


async def main(n: int, cold_n: int) -> None:
    state = Path(tempfile.mkdtemp(prefix="rollbox-bench-"))
    layer_root = state / "layers"
    layer_root.mkdir(parents=True)
    resolver = BuiltinResolver(str(layer_root))
    base = host_python_view(str(layer_root))
    view = replace(base, id="bench-numpy", layers=(numpy_layer(layer_root),), warm_layers=1,
                   warm=WarmRecipe(python=base.warm.python, sys_path=(SITE,), imports=("numpy",)))
    resolver.register(view)
    rt = Runtime(RuntimeConfig(state_dir=state, pool_max=4, cgroup_parent=f"rollbox-bench-{os.getpid()}"),
                 resolver=resolver)
    await rt.start()
    try:
        check = await rt.run(ExecRequest(code="import sys\nprint('numpy' in sys.modules, sys.modules['numpy'].__version__)"),
                             snapshot=view.id)
        assert check.stdout.split() == ["True", numpy.__version__], check
        skel = rt.restorer.skel(view)

        cold: list[float] = []
        for _ in range(cold_n):
            t0 = time.perf_counter()
            z = Zygote(view, state_dir=state, skel=skel, seccomp_bpf=rt.seccomp_bpf, rootless=rt.config.rootless,
                       user_budgets=rt.user_budgets)
            await z.start()
            sb = await rt.restorer.restore(view, view.limits, zygote=z)
            cold.append((time.perf_counter() - t0) * 1000)
            await sb.close("destroyed")
            await z.close()

        z = await rt.restorer.zygote(view)
        unpooled: list[float] = []
        for _ in range(n):
            t0 = time.perf_counter()
            sb = await rt.restorer.restore(view, view.limits, zygote=z)
            unpooled.append((time.perf_counter() - t0) * 1000)
            await sb.close("destroyed")

        await rt.prewarm(view.id, count=2)
        pool = rt.pools[(view.id, view.limits)]
        pooled: list[float] = []
        hits = 0
        for _ in range(n):
            await pool.wait_ready(1)
            t0 = time.perf_counter()
            info = await rt.create(view.id)
            pooled.append((time.perf_counter() - t0) * 1000)
            hits += info.pooled
            await rt.destroy(info.sandbox_id)
        own = await tenants_ab(view, resolver, state, n)
    finally:
        await rt.close()
        shutil.rmtree(state, ignore_errors=True)

    rows = [("cold start", cold), ("unpooled restore", unpooled), ("pooled acquire", pooled)]
    print(f"snapshot: host python {sys.version.split()[0]} + numpy {numpy.__version__} layer, warm recipe `import numpy`")
    print(f"isolation: {rt.isolation_report()['cgroups']}; {os.cpu_count()} cores; pool hits {hits}/{n}")
    print(f"{'path':<18}{'n':>6}{'p50 ms':>10}{'p99 ms':>10}")
    for name, xs in rows:
        print(f"{name:<18}{len(xs):>6}{statistics.median(xs):>10.2f}{pct(xs, 99):>10.2f}")
    c50, u50, p50 = (statistics.median(x) for _, x in rows)
    print(f"cold / unpooled p50: {c50 / u50:.0f}x   cold / pooled p50: {c50 / p50:.0f}x")
    if own is not None:
        print("\na user namespace per sandbox (--uid-range) vs none, alternating rounds in one run:" if os.geteuid() == 0
              else "\nrootless: each sandbox capped at 1/8 of the caller's budgets (--rootless-budget-share) vs "
                   "no caps, alternating rounds in one run:")
        print(f"{'variant':<22}{'restores':>9}{'p50 ms':>9}{'p99 ms':>9}{'runs':>7}{'runs/s c16':>12}")
        for name, (lat, rates) in own.items():
            print(f"{name:<22}{len(lat):>9}{statistics.median(lat):>9.2f}{pct(lat, 99):>9.2f}"
                  f"{len(rates) * RUNS:>7}{statistics.median(rates):>12.1f}   (rounds: "
                  + " ".join(f"{x:.0f}" for x in rates) + ")")
        (on_lat, on_rate), (off_lat, off_rate) = own.values()
        print(f"unpooled restore p50 {100 * (statistics.median(on_lat) / statistics.median(off_lat) - 1):+.1f} %, "
              f"runs/s {100 * (statistics.median(on_rate) / statistics.median(off_rate) - 1):+.1f} % "
              f"(target: within 5 %)")


RUNS = 200  # one-shot runs of print(1) per throughput round, 16 at a time


async def tenants_ab(view: SnapshotView, resolver: BuiltinResolver, base: Path, n: int,
                     rounds: int = 8) -> dict[str, tuple[list[float], list[float]]]:
    """Unpooled restore latency and one-shot runs/s at c16 with and without per-sandbox budgets, in
    alternating rounds (ABBA, so drift hits both alike): as root a user namespace per sandbox vs none,
    rootless a share of the caller's budgets per sandbox vs no caps. No warm pool: an idle runtime's
    pool refilling during the other's round would be measured as the other's cost."""
    variants: dict[str, dict[str, Any]] = (
        {"own uid (--uid-range)": {"uid_range": slots.DEFAULT_RANGE}, "none": {"uid_range": "none"}}
        if os.geteuid() == 0 else
        {"share 1/8": {"rootless_budget_share": 8}, "no caps": {"rootless_budget_share": 1}})
    out: dict[str, tuple[list[float], list[float]]] = {}
    runtimes = {}
    for name, overrides in variants.items():
        state = Path(tempfile.mkdtemp(prefix="ab-", dir=base))
        rt = Runtime(RuntimeConfig(state_dir=state, layer_root=Path(view.layer_root), pool_max=0, **overrides,
                                   cgroup_parent=f"rollbox-bench-{os.getpid()}-{len(runtimes)}"), resolver=resolver)
        await rt.start()
        await rt.run(ExecRequest(code="pass"), snapshot=view.id)
        runtimes[name] = rt
        out[name] = ([], [])
    try:
        for i in range(rounds):
            for name, rt in (list(runtimes.items()) if i % 2 == 0 else reversed(runtimes.items())):  # ABBA
                lat, rates = out[name]
                z = await rt.restorer.zygote(view)
                for _ in range(n // rounds):
                    t0 = time.perf_counter()
                    sb = await rt.restorer.restore(view, view.limits, zygote=z)
                    lat.append((time.perf_counter() - t0) * 1000)
                    await sb.close("destroyed")
                sem = asyncio.Semaphore(16)

                async def one(rt: Runtime = rt, sem: asyncio.Semaphore = sem) -> None:
                    async with sem:
                        r = await rt.run(ExecRequest(code="print(1)"), snapshot=view.id)
                        assert r.stdout == "1\n", r
                t0 = time.perf_counter()
                await asyncio.gather(*(one() for _ in range(RUNS)))
                rates.append(RUNS / (time.perf_counter() - t0))
    finally:
        for rt in runtimes.values():
            await rt.close()
    return {f"{k}": v for k, v in out.items()}


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--cold-n", type=int, default=10)
    a = ap.parse_args()
    asyncio.run(main(a.n, a.cold_n))
