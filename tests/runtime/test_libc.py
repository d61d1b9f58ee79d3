"""runtime/isolation/libc.py loads glibc without ctypes.util.find_library: that runs ldconfig (stdin
/dev/null) or else gcc (a temporary file), and a rootless zygote's read-only view has no /dev/null and
no writable /tmp, so in a snapshot with gcc (cpp's) the zygote died importing this module."""

from __future__ import annotations

import subprocess
import sys


def test_libc_loads_without_find_library() -> None:
    code = ("import ctypes.util\n"
            "def refuse(name):\n"
            "    raise AssertionError(f'find_library({name!r}) called')\n"
            "ctypes.util.find_library = refuse\n"
            "from rollbox.runtime.isolation import libc\n"
            "print(libc.prctl(3))\n")  # PR_GET_DUMPABLE: 1, a call through the loaded libc
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "1"
