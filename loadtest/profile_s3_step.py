"""Where the CPU of a durable step's S3 calls goes: the two calls a step on S3 makes (a GET of the
next generation's record, a 404 when no other replica moved on; the create-only PUT of the record,
If-None-Match: *), through rollbox's own S3Objects, against SeaweedFS on 127.0.0.1, one thread.

Prints the CPU per step of this process (the client: botocore, urllib3, signing) and of SeaweedFS,
for botocore's default configuration, with its flexible checksums asked for only where an
operation requires them (``request_checksum_calculation`` / ``response_checksum_validation`` =
``when_required``), with its parameter validation off too, and through obstore (what S3Objects uses
for these two calls when it is installed: a Rust client, its own threads counted in this process's
CPU); then a cProfile of botocore's client side by package and the top functions.

With --lookups, instead: what each way a replica looks up a sandbox's newest record costs, per lookup
(the client's CPU, SeaweedFS's, the wall time), through the event loop's obstore calls as a replica
makes them, on sandboxes that hold one record (fresh: created, no step yet): a GET that finds the record,
a GET that finds nothing, a listing of the sandbox's records; then the two ways to look up a sandbox
unknown to the replica, a listing and a GET of the newest against GETs of generations 0 and 1 at once.

    .venv/bin/python loadtest/profile_s3_step.py -n 400
    .venv/bin/python loadtest/profile_s3_step.py --lookups -n 1000
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import os
import pstats
import shutil
import sys
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import botocore.config

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rollbox.snapshots.store_s3 import S3Objects  # noqa: E402

from tests.snapshots.s3server import SeaweedS3, store_factory  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")
RECORD = os.urandom(900).hex().encode()  # ~1.8 KB: a step's record with a few small files inline


def proc_cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return sum(int(x) for x in fields[11:15]) / TICK


def steps(objects: S3Objects, n: int) -> None:
    sid = uuid.uuid4().hex[:12]
    for gen in range(n):
        objects.get(f"sandboxes/{sid}/{gen + 1:012d}.json")  # a newer generation? (404)
        assert objects.put_new(f"sandboxes/{sid}/{gen:012d}.json", RECORD)


async def lookups(objects: S3Objects, weed_pid: int, n: int) -> None:
    """Per lookup, each way of looking up a fresh sandbox's newest record (see the module docstring)."""
    sids = [f"sb-{uuid.uuid4().hex[:20]}" for _ in range(n)]
    for sid in sids:
        assert await objects.put_new_async(f"sandboxes/{sid}/{0:010d}.json", RECORD)

    async def listed(sid: str) -> None:
        async for _ in objects.listing_pages(f"sandboxes/{sid}/", 8.0):
            pass

    async def listed_then_read(sid: str) -> None:
        await listed(sid)
        assert await objects.get_async(f"sandboxes/{sid}/{0:010d}.json") is not None

    async def first_two(sid: str) -> None:
        got = await asyncio.gather(*(objects.get_async(f"sandboxes/{sid}/{g:010d}.json") for g in (0, 1)))
        assert got[0] is not None and got[1] is None

    ways = {"GET, found": lambda sid: objects.get_async(f"sandboxes/{sid}/{0:010d}.json"),
            "GET, nothing (404)": lambda sid: objects.get_async(f"sandboxes/{sid}/{1:010d}.json"),
            "LIST its records": listed,
            "unknown: LIST + GET newest": listed_then_read,
            "unknown: GET gen 0 + gen 1": first_two}
    print(f"{'lookup':<28} {'n':>6} {'client ms':>10} {'SeaweedFS ms':>13} {'wall ms':>8}")
    for name, way in ways.items():
        await asyncio.sleep(0.5)
        c0, w0, t0 = time.process_time(), proc_cpu_s(weed_pid), time.perf_counter()
        for sid in sids:
            await way(sid)
        c1, w1, t1 = time.process_time(), proc_cpu_s(weed_pid), time.perf_counter()
        print(f"{name:<28} {n:>6} {(c1 - c0) * 1000 / n:>10.2f} {(w1 - w0) * 1000 / n:>13.2f} {(t1 - t0) * 1000 / n:>8.2f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", type=int, default=400, help="steps per variant (with --lookups: sandboxes, each looked up once per way)")
    ap.add_argument("--lookups", action="store_true", help="measure the ways to look up a sandbox's newest record instead")
    args = ap.parse_args()
    base = Path(tempfile.mkdtemp(prefix="rollbox-profile-s3-"))
    s3 = SeaweedS3(base / "s3")
    s3.start()
    try:
        if args.lookups:
            assert s3.proc is not None
            objects = S3Objects(store_factory(s3)(f"s3://{s3.new_bucket()}/p"))
            assert objects.awaitable, "obstore is not installed"
            asyncio.run(lookups(objects, s3.proc.pid, args.n))
            return 0
        bucket = s3.new_bucket()
        make = store_factory(s3)
        checksums = {"request_checksum_calculation": "when_required", "response_checksum_validation": "when_required"}
        variants: dict[str, dict[str, Any] | None] = {
            "botocore default": {}, "checksums when_required": checksums,
            "+ no parameter validation": {**checksums, "parameter_validation": False},
            "obstore (rollbox's hot path)": None}
        stores = {}
        for name, extra in variants.items():
            store = make(f"s3://{bucket}/p{len(stores)}")
            if extra is not None:  # botocore for these calls too
                store._fast = None
            if extra:  # the same client, with only these settings changed
                store._client = _client_with(store, store._client.meta.config.merge(botocore.config.Config(**extra)))
            elif extra is None:
                assert store._fast is not None, "obstore is not installed"
            stores[name] = S3Objects(store)
            steps(stores[name], 20)  # warm: connections, bucket volumes
        print(f"{'variant':<28} {'steps':>6} {'client ms/step':>15} {'SeaweedFS ms/step':>18} {'wall ms/step':>13}")
        assert s3.proc is not None
        for name, objects in stores.items():
            c0, w0, t0 = time.process_time(), proc_cpu_s(s3.proc.pid), time.perf_counter()
            steps(objects, args.n)
            c1, w1, t1 = time.process_time(), proc_cpu_s(s3.proc.pid), time.perf_counter()
            print(f"{name:<28} {args.n:>6} {(c1 - c0) * 1000 / args.n:>15.2f} {(w1 - w0) * 1000 / args.n:>18.2f}"
                  f" {(t1 - t0) * 1000 / args.n:>13.2f}")
        prof = cProfile.Profile()
        prof.enable()
        steps(stores["botocore default"], args.n)
        prof.disable()
        st = pstats.Stats(prof)
        by_pkg: Counter[str] = Counter()
        for (file, _, _), (_, _, tottime, _, _) in st.stats.items():  # type: ignore[attr-defined]
            parts = Path(file).parts
            pkg = next((p for p in ("botocore", "urllib3", "boto3", "rollbox", "http", "email", "hashlib", "ssl",
                                    "socket", "json", "xml", "dateutil", "re") if p in parts or file.endswith(f"/{p}.py")),
                       "other" if file.startswith("/") else file)
            by_pkg[pkg] += tottime
        total = sum(by_pkg.values())
        print(f"cProfile, botocore default, {args.n} steps: {total * 1000 / args.n:.2f} ms/step profiled (with the "
              "profiler's own overhead); by package, own time:")
        for pkg, t in by_pkg.most_common(10):
            print(f"  {pkg:<28} {t * 1000 / args.n:6.2f} ms/step  {t / total:5.1%}")
        print("top functions by cumulative time:")
        st.sort_stats("cumulative").print_stats(25)
    finally:
        s3.stop()
        shutil.rmtree(base, ignore_errors=True)
    return 0


def _client_with(store: object, cfg: botocore.config.Config) -> object:
    import boto3

    client = store._client  # type: ignore[attr-defined]
    creds = client._request_signer._credentials
    return boto3.session.Session().client(
        "s3", endpoint_url=client.meta.endpoint_url, region_name=client.meta.region_name,
        aws_access_key_id=creds.access_key, aws_secret_access_key=creds.secret_key, config=cfg)


if __name__ == "__main__":
    sys.exit(main())
