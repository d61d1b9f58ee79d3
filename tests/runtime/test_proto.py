"""The control protocol's typed messages (runtime/inside/proto.py) keep the wire as it was: each op is
its old string, a diff entry its compact one-letter form, an exit report one shape; and the modules
that run inside sandbox images (under the image's own python, -I -S) import the standard library only."""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

from rollbox.runtime import jsonio
from rollbox.runtime.inside import proto
from rollbox.runtime.inside.proto import DiffEntry, Kind, Op

INSIDE = Path(proto.__file__).parent


def test_frames_are_the_json_they_were() -> None:
    report = proto.exit_report(Op.EXIT, 9, 0.5, 1024, files={"a": "x"}, alone=True)
    want = {"op": "exit", "status": 9, "cpu_s": 0.5, "maxrss_bytes": 1024, "files": {"a": "x"}, "alone": True}
    for dumps in (lambda o: json.dumps(o).encode(), jsonio.dumps):  # the inside's json, the supervisor's orjson
        assert json.loads(dumps(report)) == want
        assert json.loads(dumps(proto.bare(Op.KILL))) == {"op": "kill"}
    zygote = proto.exit_report(Op.EXITED, 0, pid=7)
    assert proto.init_ended(zygote) and not proto.init_ended(report) and zygote["pid"] == 7
    assert proto.spawn_msg(3, {"layers": ["l"], "disk_bytes": 1}) == {"op": "spawn", "req": 3, "layers": ["l"],
                                                                        "disk_bytes": 1}
    assert proto.op_of({"op": 5}) is None and proto.op_of({}) is None  # (a sandbox's frame is untrusted)


def test_diff_entries_keep_their_compact_form() -> None:
    entries = [
        (DiffEntry("/d", Kind.DIR, 0o755, 1.5), {"p": "/d", "t": "d", "m": 0o755, "mt": 1.5}),
        (DiffEntry("/l", Kind.SYMLINK, link="t"), {"p": "/l", "t": "l", "l": "t"}),
        (DiffEntry("/h", Kind.HARDLINK, link="/f"), {"p": "/h", "t": "h", "l": "/f"}),
        (DiffEntry("/f", Kind.FILE, 0o600, 2.0, size=3, offset=8), {"p": "/f", "t": "f", "m": 0o600, "mt": 2.0,
                                                                     "o": 8, "n": 3}),
        (DiffEntry("/s", Kind.FILE, 0o600, 2.0, size=3, sha="ab", generation=4),
         {"p": "/s", "t": "f", "m": 0o600, "mt": 2.0, "sha": "ab", "n": 3, "g": 4}),
        (DiffEntry("/b", Kind.FILE, 0o600, 2.0, size=3, sha="ab"), {"p": "/b", "t": "f", "m": 0o600, "mt": 2.0,
                                                                     "sha": "ab", "n": 3}),
    ]
    for entry, wire in entries:
        assert json.loads(jsonio.dumps(entry.wire())) == wire
        assert DiffEntry.parse(wire) == entry


def test_fork_ids_are_made_and_parsed_in_one_place() -> None:
    scratch = proto.scratch_layer_id("owner", "00ff")
    assert scratch == "scratch-owner-00ff" and scratch.startswith(proto.SCRATCH_PREFIX)
    view_id = proto.fork_view_id(proto.fork_view_id("base", scratch), "scratch-owner-11")
    assert proto.split_fork_view_id(view_id) == ("base", [scratch, "scratch-owner-11"])
    assert proto.is_view_of_scratch(view_id, "scratch-owner-11") and not proto.is_view_of_scratch(view_id, scratch)


def test_zygote_config_survives_its_trip() -> None:
    cfg = proto.ZygoteConfig(rootless=True, staging="/s", skel="/k", layer_root="/l", warm_layers=["w"],
                             host_binds=[], host_masks=[], sys_path=["/p"], imports=["json"], env={"A": "1"},
                             seccomp="AA==", runtime_dir="/r", reexec="/usr/bin/python3")
    assert proto.ZygoteConfig.parse(json.loads(json.dumps(cfg.wire()))) == cfg


def test_inside_modules_import_the_standard_library_only() -> None:
    allowed_rollbox = ("rollbox.runtime.inside", "rollbox.runtime.isolation")
    isolation = INSIDE.parent / "isolation"
    imported = {isolation / f"{m}.py" for m in ("libc", "mounts", "rlimits", "seccomp", "users")}  # (by the zygote)
    for path in sorted({*INSIDE.glob("*.py"), *imported}):
        for node in ast.parse(path.read_text()).body:  # (module level: a function may import lazily, on the host)
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else []
            for name in names:
                top = name.split(".")[0]
                assert top in sys.stdlib_module_names or top == "__future__" or name.startswith(allowed_rollbox), \
                    f"{path.name} imports {name}: runtime/inside/ runs under a sandbox image's python with the stdlib only"
