"""Restore vs cold start, side by side in one run, on one snapshot with numpy warmed.

    .venv/bin/python loadtest/bench_restore.py [--n 200] [--cold-n 10]

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

import numpy
from rollbox.runtime.restore import Zygote
from rollbox.runtime.runtime import Runtime, RuntimeConfig
from rollbox.runtime.snapshot import BuiltinResolver, WarmRecipe, host_python_view
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
        skel = rt._skel(view)

        cold: list[float] = []
        for _ in range(cold_n):
            t0 = time.perf_counter()
            z = Zygote(view, state_dir=state, skel=skel, seccomp_bpf=rt.seccomp_bpf, rootless=rt.config.rootless)
            await z.start()
            sb = await rt.restore(view, view.limits, zygote=z)
            cold.append((time.perf_counter() - t0) * 1000)
            await sb.close("destroyed")
            await z.close()

        z = await rt.zygote(view)
        unpooled: list[float] = []
        for _ in range(n):
            t0 = time.perf_counter()
            sb = await rt.restore(view, view.limits, zygote=z)
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


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--cold-n", type=int, default=10)
    a = ap.parse_args()
    asyncio.run(main(a.n, a.cold_n))
