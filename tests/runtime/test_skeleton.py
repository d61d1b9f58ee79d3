"""The skeleton (the bottom layer of every sandbox root) is built once per recipe, also when several
snapshots' zygotes start at once in one process (a server prewarming two snapshots)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

from rollbox.runtime import skeleton


def test_concurrent_builds_in_one_process_agree(tmp_path: Path) -> None:
    rootless = os.geteuid() != 0
    results: list[Path] = []
    errors: list[BaseException] = []
    start = threading.Barrier(8)

    def build() -> None:
        start.wait()
        try:
            results.append(skeleton.build(tmp_path, ("/usr",), rootless))
        except BaseException as exc:  # the test reports what any thread raised
            errors.append(exc)

    threads = [threading.Thread(target=build) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert len(results) == 8 and len(set(results)) == 1, results
    skel = results[0]
    assert (skel / "home" / "sandbox").is_dir() and (skel / "etc" / "passwd").read_text() == skeleton.PASSWD
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".skel-")] == []  # nothing left aside
