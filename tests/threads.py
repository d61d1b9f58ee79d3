"""Run one function in several threads released at the same moment (races are found this way)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def at_once(fn: Callable[[], T], n: int) -> tuple[list[T], list[BaseException]]:
    """Call ``fn`` in ``n`` threads that start together; returns what the calls returned and what they
    raised (each list in completion order)."""
    results: list[T] = []
    errors: list[BaseException] = []
    start = threading.Barrier(n)

    def run() -> None:
        start.wait()
        try:
            results.append(fn())
        except BaseException as exc:  # the caller reports what any thread raised
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, errors
