"""The client's CPU per request through its one connection pool, against httpx's own pool.

    .venv/bin/python loadtest/bench_client_pool.py [-c 16 -c 64] [-n 40]

A trivial keep-alive HTTP server (a subprocess, 5 ms per reply) stands in for rollbox serve, so the
figures are the client's own: CPU of this process per request once its connections are open, at each
concurrency, and to make the pool and open its connections (one request per worker), for a Client's
pool (``_Connections``), one httpx.AsyncClient pool, and 16 httpx pools used round-robin (what a
Client did before it had one pool). httpcore's pool rescans its connections on every request's start
and end, which grows with the number of connections in use; an httpx client loads the CA bundle as it
is made.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
from rollbox.functions.client.http import _Connections

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.*
from tests.snapshots.s3server import free_ports

SERVER = r"""
import asyncio, sys
REPLY = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"
async def handle(r, w):
    try:
        while True:
            head = await r.readuntil(b"\r\n\r\n")
            n = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:")), 0)
            await r.readexactly(n)
            await asyncio.sleep(0.005)
            w.write(REPLY)
    except (asyncio.IncompleteReadError, ConnectionError):
        w.close()
async def main():
    s = await asyncio.start_server(handle, "127.0.0.1", int(sys.argv[1]), backlog=1024)
    await s.serve_forever()
asyncio.run(main())
"""



async def measure(url: str, clients: list[httpx.AsyncClient], concurrency: int, n: int) -> tuple[float, float]:
    """(client CPU ms per request, requests/s) for n requests at this concurrency."""
    turn = itertools.count()

    async def worker(k: int) -> None:
        for _ in range(k):
            r = await clients[next(turn) % len(clients)].post(url, content=b'{"a": 1}')
            assert r.status_code == 200, r.status_code

    t0, c0 = time.perf_counter(), time.process_time()
    await asyncio.gather(*(worker(n // concurrency) for _ in range(concurrency)))
    return (time.process_time() - c0) / n * 1000, n / (time.perf_counter() - t0)


LIMITS = httpx.Limits(max_connections=None, max_keepalive_connections=32)
VARIANTS: list[tuple[str, Callable[[], list[httpx.AsyncClient]]]] = [
    ("Client's pool", lambda: [httpx.AsyncClient(timeout=30, transport=_Connections())]),
    ("one httpx pool", lambda: [httpx.AsyncClient(timeout=30, limits=LIMITS)]),
    ("16 httpx pools", lambda: [httpx.AsyncClient(timeout=30, limits=LIMITS) for _ in range(16)]),
]


async def main(levels: list[int], per_worker: int) -> None:
    port = free_ports(1)[0]
    server = subprocess.Popen([sys.executable, "-c", SERVER, str(port)])
    url = f"http://127.0.0.1:{port}/"
    try:
        await asyncio.sleep(0.5)
        print(f"{'pool':16} {'concurrency':>11} {'setup CPU ms':>12} {'requests':>8} {'client CPU ms/req':>17} "
              f"{'req/s':>7}")
        for c in levels:
            for label, make in VARIANTS:
                c0 = time.process_time()
                clients = make()
                await measure(url, clients, c, c)  # one request per worker: its connection opened
                setup_ms = (time.process_time() - c0) * 1000
                await measure(url, clients, c, c * 4)  # warm
                cpu, rate = await measure(url, clients, c, c * per_worker)
                print(f"{label:16} {c:>11} {setup_ms:>12.0f} {c * per_worker:>8} {cpu:>17.2f} {rate:>7.0f}",
                      flush=True)
                for client in clients:
                    await client.aclose()
    finally:
        server.terminate()
        server.wait()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-c", "--concurrency", type=int, action="append", help="levels (default 16 and 64)")
    ap.add_argument("-n", "--per-worker", type=int, default=40, help="requests per concurrent worker")
    args = ap.parse_args()
    asyncio.run(main(args.concurrency or [16, 64], args.per_worker))
