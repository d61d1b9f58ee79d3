"""Scale from zero, measured: a replica's first seconds, side by side in one run.

For each image (scripts/image; built and loaded into podman when missing or stale):
  - layers baked in: the python and python-sci snapshot layers are in the image;
  - no layers: the same image without them, so the first python-sci run pulls its layer from S3;
the time from `podman run` (rootful, runc, the manifest's securityContext and env, as the pod tests
run it) to /readyz answering 200, and to the reply of the first `run` (python-sci, `import pandas`),
which is sent as soon as /readyz answers (as Knative's activator holds a request until a replica is
ready). Beside them, a warm replica's `run` reply. The store is a SeaweedFS on 127.0.0.1 into which
the python-sci snapshot was pushed from the image. Every reply is checked.

    .venv/bin/python loadtest/bench_coldstart.py [--repeat 3]     # as root; needs podman, buildah, mmdebstrap

On a cluster the container's start also includes pulling the image (once per node) and booting its
Kata VM (templating clones it); neither is in these figures.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.knative import podkit
from tests.snapshots.s3server import ACCESS_KEY, SECRET_KEY, SeaweedS3

FIRST = {"snapshot": "python-sci", "code": "import pandas; print('ok')"}


def run_event(url: str, n: int) -> float:
    """POST one `run` (binary CloudEvent); the reply must be its output. Returns the seconds it took."""
    headers = {"ce-specversion": "1.0", "ce-type": "dev.rollbox.sandbox.run", "ce-source": "/bench/coldstart",
               "ce-id": f"{time.time_ns()}-{n}", "content-type": "application/json"}
    t0 = time.monotonic()
    r = httpx.post(url, headers=headers, json=FIRST, timeout=300)
    took = time.monotonic() - t0
    if r.status_code != 200 or r.json().get("stdout") != "ok\n":
        raise SystemExit(f"run failed: HTTP {r.status_code} {r.text[:500]}")
    return took


def cold(tag: str, env: dict[str, str]) -> tuple[float, float, float]:
    """(start -> ready, start -> first reply, the first reply itself), seconds."""
    pod = podkit.Pod(tag, env=env)
    try:
        pod.start()
        ready = pod.wait_ready()
        first = run_event(pod.url, 0)
        return ready, time.monotonic() - pod.started_at, first
    finally:
        pod.stop(timeout_s=30)
        pod.remove()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3, help="cold starts per image")
    ap.add_argument("--warm-runs", type=int, default=20)
    args = ap.parse_args()
    if why := podkit.can_run():
        raise SystemExit(f"bench_coldstart: {why}")
    baked, bare = podkit.image(layers=True), podkit.image(layers=False)
    base = Path(tempfile.mkdtemp(prefix="rollbox-coldstart."))
    s3 = SeaweedS3(base)
    s3.start()
    try:
        env = podkit.s3_env(s3.endpoint, s3.new_bucket(), ACCESS_KEY, SECRET_KEY)
        push = podkit.Pod(baked, env=env, args=["snapshot", "push", "python-sci"]).run_once()
        if push.returncode != 0:
            raise SystemExit(f"pushing python-sci failed:\n{push.stdout[-2000:]}{push.stderr[-2000:]}")
        rows: dict[str, list[tuple[float, float, float]]] = {"layers baked in": [], "no layers (pulled from S3)": []}
        for _ in range(args.repeat):  # alternating, so drift hits both alike
            rows["layers baked in"].append(cold(baked, env))
            rows["no layers (pulled from S3)"].append(cold(bare, env))
        warm_pod = podkit.Pod(baked, env=env).start()
        try:
            warm_pod.wait_ready()
            run_event(warm_pod.url, -1)
            warm = [run_event(warm_pod.url, i) for i in range(args.warm_runs)]
        finally:
            warm_pod.stop(timeout_s=30)
            warm_pod.remove()
    finally:
        s3.stop()
        shutil.rmtree(base, ignore_errors=True)

    med = statistics.median
    print(f"{'replica':<28} {'n':>3} {'start->ready s':>15} {'start->first reply s':>21} {'first reply s':>14}")
    for name, xs in rows.items():
        print(f"{name:<28} {len(xs):>3} {med(x[0] for x in xs):>15.2f} {med(x[1] for x in xs):>21.2f} "
              f"{med(x[2] for x in xs):>14.3f}   (max {max(x[1] for x in xs):.2f} s to first reply)")
    print(f"{'warm replica':<28} {len(warm):>3} {'-':>15} {'-':>21} {med(warm):>14.3f}   "
          f"(p90 {sorted(warm)[int(0.9 * len(warm))]:.3f} s)")
    sizes = {t: podkit.REPO / "dist" / f"rollbox-{podkit.version()}{s}.oci.tar" for t, s in ((baked, ""), (bare, "-nolayers"))}
    print("(medians; start = `podman run` of the image with the manifest's securityContext; first run: python-sci, "
          "`import pandas`; images: " + ", ".join(f"{t} {p.stat().st_size / 2**20:.0f} MiB" for t, p in sizes.items())
          + f"; {os.cpu_count()} cores)")
    target = med(x[1] for x in rows["layers baked in"])
    print(f"target: first reply <= 1.5 s after podman run with layers baked in: {'met' if target <= 1.5 else 'NOT met'} "
          f"({target:.2f} s)")


if __name__ == "__main__":
    main()
