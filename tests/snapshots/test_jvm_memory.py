"""A JVM in a sandbox of verl's memory_limit_mb=1024: it starts, a program using 400 MB of arrays runs,
and one using 2 GiB is a runtime error (the heap's OutOfMemoryError, or the kernel's kill), with the
sandbox's cgroup and without one (the RLIMIT_DATA fallback). Without the -XX:MaxRAM that
``languages.plan`` gives, the JVM sizes its heap from the host's memory and, under the fallback, a
program that outgrows the limit crashes the JVM ("committing reserved memory", an hs_err file) instead of
an OutOfMemoryError (with G1, javac's collector, a 400 MB program already did on a 24 GiB host).

The java snapshot comes from the language test store (tests/langhome.py), built there on first use.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

import pytest
from rollbox.runtime.runtime import Runtime, RuntimeConfig
from rollbox.runtime.spec import ExecRequest, ExecResult, Limits
from rollbox.snapshots import languages
from rollbox.snapshots.resolver import StoreResolver
from rollbox.snapshots.store_local import LocalStore

from tests import langhome

GIB = 1 << 30
# n MiB in 64 KiB arrays (not humongous objects: the heap holds what it is asked for), every one written
FILL = ("public class Main{{public static void main(String[] a){{byte[][] k=new byte[{n}*16][];"
        "for(int i=0;i<k.length;i++){{k[i]=new byte[1<<16];k[i][4096]=1;}}"
        "System.out.println(\"kept {n} of max \"+(Runtime.getRuntime().maxMemory()>>20));}}}}")

pytestmark = [
    pytest.mark.asyncio(loop_scope="function"),
    pytest.mark.timeout(900),  # the first may build java (tests/langhome.py), or wait for another build
    pytest.mark.skipif(os.geteuid() != 0, reason="the language test store is built as root"),
]


@pytest.fixture
def store() -> LocalStore:
    return LocalStore(langhome.built(["java"]))


async def _java(rt: Runtime, code: str, memory: int, sized: bool = True) -> tuple[ExecResult, ExecResult]:
    """Compile and run ``code`` as the java language does, in a sandbox of ``memory`` bytes."""
    plan = languages.plan("java", code, memory_max_bytes=memory if sized else None)
    assert plan.compile is not None
    info = await rt.create(snapshot=plan.snapshot, limits=Limits(memory_max_bytes=memory))
    try:
        compiled = await rt.exec(info.sandbox_id, ExecRequest(command=plan.compile, files=plan.files, timeout_s=120))
        assert compiled.exit_code == 0, compiled
        ran = await rt.exec(info.sandbox_id, ExecRequest(command=plan.run, timeout_s=120))
        return compiled, ran
    finally:
        await rt.destroy(info.sandbox_id)


@pytest.mark.parametrize("cgroup", ["auto", "none"])
async def test_java_runs_at_1024_mb_and_2_gib_of_arrays_is_a_runtime_error(store: LocalStore, tmp_path: Path,
                                                                           cgroup: Literal["auto", "none"]) -> None:
    async with Runtime(RuntimeConfig(state_dir=tmp_path, layer_root=Path(store.layer_root), cgroup=cgroup),
                       resolver=StoreResolver(store)) as rt:
        if cgroup == "none":
            assert rt.cgroup_backend is None
        _, ok = await _java(rt, FILL.format(n=400), GIB)
        assert ok.exit_code == 0 and ok.stdout.startswith("kept 400 of max "), ok
        assert 700 <= int(ok.stdout.split()[-1]) <= 768, ok.stdout  # the heap: 75% of the limit (less a survivor space)
        _, over = await _java(rt, FILL.format(n=2048), GIB)
        assert over.exit_code != 0 and "kept" not in over.stdout, over
        assert "java.lang.OutOfMemoryError: Java heap space" in over.stderr, over  # not a crash, nor a kill
        # a smaller sandbox, a smaller heap
        _, small = await _java(rt, FILL.format(n=100), 256 << 20)
        assert small.exit_code == 0 and small.stdout.startswith("kept 100 of max "), small
        assert 170 <= int(small.stdout.split()[-1]) <= 192, small.stdout


async def test_without_maxram_a_jvm_under_the_rlimit_fallback_crashes_growing_its_heap(store: LocalStore,
                                                                                       tmp_path: Path) -> None:
    """Why plan() sizes the heap: with the JVM's own sizing (from the host's memory) a heap that outgrows
    RLIMIT_DATA is a crash of the JVM, not the program's OutOfMemoryError."""
    if os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") < 8 * GIB:
        pytest.skip("on a host under 8 GiB the JVM's own heap (a quarter of it) fits in 1 GiB")
    async with Runtime(RuntimeConfig(state_dir=tmp_path, layer_root=Path(store.layer_root), cgroup="none"),
                       resolver=StoreResolver(store)) as rt:
        _, ran = await _java(rt, FILL.format(n=2048), GIB, sized=False)
        assert ran.exit_code != 0 and "kept" not in ran.stdout, ran
        out = ran.stdout + ran.stderr
        assert "insufficient memory for the Java Runtime Environment" in out and "OutOfMemoryError" not in out, ran
