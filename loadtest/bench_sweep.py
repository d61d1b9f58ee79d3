"""What listing the durable store costs, as the sweep lists it: every sandbox record in the store.

A SeaweedFS (`weed mini`, as the fleet runs it) on 127.0.0.1 is filled with --keys small records
(sandboxes/<id>/<generation>.json, 200 bytes), then listed whole --rounds times each way, side by side:
through botocore's paginator (rollbox's S3 client for everything but the hot calls, and the sweep's
listing before) and through obstore (the sweep's listing now, on the event loop). Printed per listing:
wall time, this client's CPU, SeaweedFS's CPU, and both per 1,000 keys.

    .venv/bin/python loadtest/bench_sweep.py                 # 20,000 keys, ~2 min (most of it the puts)
    .venv/bin/python loadtest/bench_sweep.py --keys 5000     # a quick look
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.snapshots.s3server import ACCESS_KEY, SECRET_KEY, SeaweedS3  # noqa: E402


def tree_cpu_s(pid: int) -> float:
    """CPU seconds of ``pid`` and its children (utime + stime, reaped children included)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    pids = [pid]
    try:
        pids += [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        pass
    for p in pids:
        try:
            f = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += sum(int(x) for x in f[11:15]) / tick
    return total


def own_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--keys", type=int, default=20_000)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    import obstore
    from obstore.store import S3Store

    with tempfile.TemporaryDirectory(prefix="rollbox-bench-sweep-") as base:
        s3 = SeaweedS3(Path(base))
        s3.start()
        try:
            bucket = s3.new_bucket()
            client = s3.client()
            t0 = time.monotonic()

            def put(i: int) -> None:
                client.put_object(Bucket=bucket, Key=f"p/sandboxes/sb-{i:020x}/{i % 4:08d}.json", Body=b"x" * 200)

            with concurrent.futures.ThreadPoolExecutor(16) as pool:
                list(pool.map(put, range(args.keys)))
            print(f"{args.keys} records put in {time.monotonic() - t0:.1f} s; each listing lists them all")
            fast = S3Store(bucket, endpoint=s3.endpoint, access_key_id=ACCESS_KEY, secret_access_key=SECRET_KEY,
                           region="us-east-1", client_options={"allow_http": True},
                           virtual_hosted_style_request=False)

            def with_botocore() -> int:
                n = 0
                for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix="p/sandboxes/"):
                    n += sum(1 for o in page.get("Contents", []) if o["LastModified"])
                return n

            def with_obstore() -> int:
                return sum(sum(1 for m in batch if m["last_modified"])
                           for batch in obstore.list(fast, prefix="p/sandboxes/", chunk_size=1000))

            print(f"{'client':10} {'keys':>7} {'wall s':>7} {'client cpu s':>13} {'seaweedfs cpu s':>16} "
                  f"{'all cpu ms / 1000 keys':>23}")
            for _ in range(args.rounds):
                for name, fn in (("botocore", with_botocore), ("obstore", with_obstore)):
                    w0, c0, s0 = time.monotonic(), own_cpu_s(), tree_cpu_s(s3.proc.pid)  # type: ignore[union-attr]
                    n = fn()
                    wall, client_s = time.monotonic() - w0, own_cpu_s() - c0
                    weed_s = tree_cpu_s(s3.proc.pid) - s0  # type: ignore[union-attr]
                    print(f"{name:10} {n:7d} {wall:7.2f} {client_s:13.2f} {weed_s:16.2f} "
                          f"{1000 * 1000 * (client_s + weed_s) / max(n, 1):23.1f}", flush=True)
        finally:
            s3.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
