"""The runtime restores sandboxes from what the snapshot side gives it: a snapshot built here, pushed
to S3, and run by another process with an empty cache sees the packages, files, env and VERSION."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from rollbox.snapshots.build import build
from rollbox.snapshots.store import copy_snapshot
from rollbox.snapshots.store_local import LocalStore
from rollbox.snapshots.template import load_template

from .s3server import ACCESS_KEY, SECRET_KEY, S3Factory, SeaweedS3, make_wheel

SERVER_B = textwrap.dedent("""
    import asyncio, json, sys
    from pathlib import Path
    from rollbox.runtime.runtime import Runtime, RuntimeConfig
    from rollbox.runtime.spec import ExecRequest
    from rollbox.snapshots.cache import LayerCache
    from rollbox.snapshots.resolver import StoreResolver
    from rollbox.snapshots.store_local import LocalStore
    from rollbox.snapshots.store_s3 import S3Store

    home, url, endpoint, key, secret = sys.argv[1:]
    s3 = S3Store(url, endpoint_url=endpoint, access_key_id=key, secret_access_key=secret)
    local = LocalStore(Path(home) / "store")
    resolver = StoreResolver(LayerCache(local, s3))
    code = ("import rbdemo, os, sys; print(rbdemo.VALUE, os.environ['TAG'], open('/etc/motd').read(), "
            "'rbdemo' in sys.modules)")

    async def main():
        config = RuntimeConfig(state_dir=Path(home) / "state", layer_root=Path(local.layer_root))
        async with Runtime(config, resolver=resolver) as rt:
            info = await rt.create("demo")
            result = await rt.exec(info.sandbox_id, ExecRequest(code=code))
            await rt.destroy(info.sandbox_id)
        print(json.dumps({"snapshot_id": info.snapshot_id, "version": info.env_version,
                          "exit_code": result.exit_code, "stdout": result.stdout, "stderr": result.stderr,
                          "downloads": s3.stats["layer_downloads"]}))

    asyncio.run(main())
""")


def test_a_snapshot_pushed_to_s3_restores_in_another_process_with_an_empty_cache(
        tmp_path: Path, s3_url: str, make_s3: S3Factory, seaweed: SeaweedS3) -> None:
    make_wheel(tmp_path / "wheels")
    (tmp_path / "t.yaml").write_text(
        "name: demo\npackages: [rbdemo]\npip: {find_links: [./wheels], no_index: true}\n"
        "files: {/etc/motd: {content: from-the-files-layer}}\nenv: {TAG: tagged}\nwarm: {imports: [rbdemo]}\n")
    template, where = load_template(tmp_path / "t.yaml")
    a = LocalStore(tmp_path / "a")
    manifest = build(template, where, a)
    copy_snapshot(a, make_s3(s3_url), "demo")

    b = tmp_path / "b"
    proc = subprocess.run([sys.executable, "-c", SERVER_B, str(b), s3_url, seaweed.endpoint, ACCESS_KEY,
                           SECRET_KEY], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["exit_code"] == 0, out["stderr"]
    assert out["stdout"].split() == ["42", "tagged", "from-the-files-layer", "True"]
    assert out["snapshot_id"] == manifest.id
    assert out["version"] == manifest.version.model_dump(mode="json")
    assert out["downloads"] == len(manifest.layers)
