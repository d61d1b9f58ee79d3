"""Scanning a sandbox's upper directory for a commit, on the event loop when it is small, and the
record and frame encodings (orjson, with json for what orjson refuses). Real files, no sandbox."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
from rollbox.runtime.channel import encode
from rollbox.runtime.inside import proto
from rollbox.runtime.jsonio import loads as decode
from rollbox.runtime.spec import Limits
from rollbox.snapshots.state import SMALL_SCAN, FileHashes, SandboxRecord, UpperTooLarge, scan_upper


def _tree(root: Path, files: int, big_bytes: int = 0) -> None:
    (root / "home" / "sandbox").mkdir(parents=True)
    for i in range(files):
        (root / "home" / "sandbox" / f"f{i:04d}.txt").write_text(f"{i}\n")
    if big_bytes:
        (root / "home" / "sandbox" / "big.bin").write_bytes(os.urandom(big_bytes))


def test_a_small_upper_scans_the_same_either_way(tmp_path: Path) -> None:
    _tree(tmp_path, 20, 1000)
    hashes_small: FileHashes = {}
    hashes_full: FileHashes = {}
    small = scan_upper(str(tmp_path), hashes_small, small=True)
    full = scan_upper(str(tmp_path), hashes_full)
    assert small == full
    assert hashes_small == hashes_full and len(hashes_small) == 21


@pytest.mark.parametrize(("files", "big"), [(SMALL_SCAN[0] + 10, 0), (3, SMALL_SCAN[1] + 1)])
def test_an_upper_too_large_for_the_loop_is_refused_and_leaves_the_hashes_alone(
        tmp_path: Path, files: int, big: int) -> None:
    _tree(tmp_path, files, big)
    hashes: FileHashes = {("/old", 1, 2, 3, 4): "x" * 64}
    with pytest.raises(UpperTooLarge):
        scan_upper(str(tmp_path), hashes, small=True)
    assert hashes == {("/old", 1, 2, 3, 4): "x" * 64}
    files_seen, _ = scan_upper(str(tmp_path), hashes)  # (the thread's scan: no budget)
    assert len([e for e in files_seen.entries if e.kind == "f"]) == files + (1 if big else 0)


def test_files_known_already_cost_the_small_scan_nothing(tmp_path: Path) -> None:
    _tree(tmp_path, 2, SMALL_SCAN[1] + 1)
    hashes: FileHashes = {}
    scan_upper(str(tmp_path), hashes)  # the big file is hashed once
    again = scan_upper(str(tmp_path), hashes, small=True)  # unchanged since: not read, within budget
    assert len(again[0].entries) == 5


def test_a_record_round_trips_and_a_lone_surrogate_falls_back_to_json() -> None:
    for meta in ({"episode": "é-1"}, {"episode": "\ud800 lone"}):
        content = b"contents\n"
        rec = SandboxRecord(sandbox_id="sb-1", generation=3, snapshot="snap", limits=Limits(), metadata=meta,
                            created_at=1.5, last_used=2.25, inline={hashlib.sha256(content).hexdigest(): content})
        back = SandboxRecord.from_bytes(rec.to_bytes(), "k")
        assert (back.metadata, back.generation, back.last_used, back.inline) == (meta, 3, 2.25, rec.inline)


def test_frames_encode_as_the_sandbox_side_reads_them() -> None:
    for msg in ({"op": "exec", "code": "print('é')", "n": 1, "t": 0.5}, {"op": "exec", "code": "\udcff"}):
        frame = encode(msg)
        reader = proto.Reader()  # the agent's (stdlib json)
        reader.feed(frame, [])
        assert reader.next() == msg
        assert decode(frame[4:]) == msg  # the supervisor's
    assert decode(b'{"error":"bad \\udcff name"}') == {"error": "bad \udcff name"}
    with pytest.raises(ValueError):
        decode(b"{not json")
