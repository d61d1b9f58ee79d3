"""Without a cgroup (forced off here, as on a host without the memory controller or rootless without
delegation) memory falls back to RLIMIT_DATA at the sandbox's limit: what a program fills counts, what it
only reserves does not. So a program over the limit fails, one under it runs, and a large reservation
(as a JVM, V8 or lld makes at start) is not refused as it was under RLIMIT_AS. Root and rootless (test_rootless).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from rollbox.runtime.runtime import Runtime, RuntimeConfig
from rollbox.runtime.spec import ExecRequest, Limits

pytestmark = pytest.mark.asyncio(loop_scope="function")
MiB = 1024 * 1024
LIMIT = 128 * MiB

# fills n MiB (every page written) with the interpreter's own allocator (brk and anonymous mmap), in
# several blocks as a program grows
FILL = ("import sys\nblocks = []\nfor _ in range({n} // 16):\n    b = bytearray(16 << 20)\n    b[::4096] = b'x' * len(b[::4096])\n"
        "    blocks.append(b)\nprint('filled', len(blocks) * 16, flush=True)")
# what a JVM does at start: reserve a large range (PROT_NONE, private), then commit part of it
# (flags 0x22: MAP_PRIVATE | MAP_ANONYMOUS; 0x21: MAP_SHARED | MAP_ANONYMOUS, which RLIMIT_DATA does not count)
RESERVE = ("import ctypes, sys\nlibc = ctypes.CDLL(None, use_errno=True)\nlibc.mmap.restype = ctypes.c_void_p\n"
           "libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]\n"
           "gib, flags = int(sys.argv[1]), int(sys.argv[2], 16)\n"
           "p = libc.mmap(None, gib << 30, 0, flags, -1, 0)  # PROT_NONE: reserved, never filled\n"
           "print('reserved' if p != ctypes.c_void_p(-1).value else f'refused errno {ctypes.get_errno()}', gib, 'GiB')")


async def test_without_a_cgroup_memory_is_rlimit_data_at_the_limit(tmp_path: Path) -> None:
    async with Runtime(RuntimeConfig(state_dir=tmp_path, cgroup="none")) as rt:
        assert rt.cgroup_backend is None
        lim = Limits(memory_max_bytes=LIMIT)
        info = await rt.create(limits=lim)
        try:
            assert f"fell back to rlimits: RLIMIT_DATA {LIMIT // MiB} MiB" in info.isolation["cgroups"]
            r = await rt.exec(info.sandbox_id, ExecRequest(command="grep -E '^Max (data size|address space)' "
                                                           "/proc/self/limits"))
            got = dict(re.findall(r"^(Max [a-z ]+?)\s+(\d+|unlimited)\s+(?:\d+|unlimited)", r.stdout, re.M))
            # the address space only as a backstop, 4 GiB above: for shared mappings RLIMIT_DATA does not count
            assert got == {"Max data size": str(LIMIT), "Max address space": str(LIMIT + (4 << 30))}, r.stdout
            # half the limit: runs (the interpreter's own ~10-20 MiB count too)
            half = await rt.exec(info.sandbox_id, ExecRequest(command="python3 -c \"$P\"",
                                                              env={"P": FILL.format(n=LIMIT // MiB // 2)}))
            assert (half.exit_code, half.stdout) == (0, f"filled {LIMIT // MiB // 2}\n"), half
            # twice the limit: the allocation past it fails (MemoryError), the program dies non-zero
            over = await rt.exec(info.sandbox_id, ExecRequest(command="python3 -c \"$P\"",
                                                              env={"P": FILL.format(n=2 * LIMIT // MiB)}))
            assert over.exit_code != 0 and "filled" not in over.stdout and "MemoryError" in over.stderr, over
            # 3 GiB reserved, never filled, as a JVM at 1 GiB reserves: not memory use (an RLIMIT_AS of
            # limit + 256 MiB refused it)
            big = await rt.exec(info.sandbox_id, ExecRequest(command="python3 -c \"$P\" 3 22", env={"P": RESERVE}))
            assert (big.exit_code, big.stdout) == (0, "reserved 3 GiB\n"), big
            # shared memory, which RLIMIT_DATA does not count, is bounded by the backstop: 8 GiB refused
            shared = await rt.exec(info.sandbox_id, ExecRequest(command="python3 -c \"$P\" 8 21", env={"P": RESERVE}))
            assert (shared.exit_code, shared.stdout) == (0, "refused errno 12 8 GiB\n"), shared
        finally:
            await rt.destroy(info.sandbox_id)
        # the same through the warm interpreter (a `code` run): the fork counts what it fills, not the parent's
        ok = await rt.run(ExecRequest(code=FILL.format(n=LIMIT // MiB // 2)), limits=lim)
        assert (ok.exit_code, ok.stdout) == (0, f"filled {LIMIT // MiB // 2}\n"), ok
        hog = await rt.run(ExecRequest(code=FILL.format(n=2 * LIMIT // MiB)), limits=lim)
        assert hog.exit_code != 0 and "MemoryError" in hog.stderr, hog
