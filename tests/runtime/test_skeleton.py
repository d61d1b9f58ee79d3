"""The skeleton (the bottom layer of every sandbox root) is built once per recipe, also when several
snapshots' zygotes start at once in one process (a server prewarming two snapshots)."""

from __future__ import annotations

import os
from pathlib import Path

from rollbox.runtime import skeleton

from tests.threads import at_once


def test_concurrent_builds_in_one_process_agree(tmp_path: Path) -> None:
    rootless = os.geteuid() != 0
    results, errors = at_once(lambda: skeleton.build(tmp_path, ("/usr",), rootless), 8)
    assert not errors, errors
    assert len(results) == 8 and len(set(results)) == 1, results
    skel = results[0]
    assert (skel / "home" / "sandbox").is_dir() and (skel / "etc" / "passwd").read_text() == skeleton.PASSWD
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".skel-")] == []  # nothing left aside
