"""The language test store: ``ROLLBOX_TEST_LANGUAGES_HOME`` (default /var/tmp/rollbox-test-languages), built
on first use from Debian's packages and kept across runs (its cached Debian layers serve every later run).
Test files in several folders build into it, on parallel workers: one builds at a time (``building``), so
a fresh machine makes its Debian base layer once, and the others then find what they need built."""

from __future__ import annotations

import fcntl
import os
import shutil
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

LANG_HOME = Path(os.environ.get("ROLLBOX_TEST_LANGUAGES_HOME", "/var/tmp/rollbox-test-languages"))
TEMPLATES = Path(__file__).resolve().parents[1] / "snapshots" / "templates"


@contextmanager
def building() -> Iterator[Path]:
    """Hold the store's build lock (a file beside it) while this process, or a script it runs, builds
    into it; Debian layers of any age are taken from its cache meanwhile. Yields the store's path."""
    LANG_HOME.mkdir(parents=True, exist_ok=True)
    fd = os.open(LANG_HOME.parent / f"{LANG_HOME.name}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        with pytest.MonkeyPatch.context() as env:
            env.setenv("ROLLBOX_DEBIAN_MAX_AGE_DAYS", "3650")
            yield LANG_HOME
    finally:
        os.close(fd)  # (releases the lock)


def built(snapshots: Iterable[str]) -> Path:
    """The store with each of ``snapshots`` (template names under snapshots/templates) built in it (as
    their templates say now: a template changed since is built again). Skips without mmdebstrap, unless
    every one is there already."""
    from rollbox.snapshots.build import build
    from rollbox.snapshots.store_local import LocalStore
    from rollbox.snapshots.template import load_template

    snapshots = list(snapshots)
    if shutil.which("mmdebstrap") is None:
        if all((LANG_HOME / "names" / name).exists() for name in snapshots):
            return LANG_HOME
        pytest.skip("mmdebstrap is not installed (scripts/bootstrap installs it as root)")
    with building() as home:
        store = LocalStore(home)
        for name in snapshots:
            tpl, where = load_template(TEMPLATES / f"{name}.yaml")
            build(tpl, where, store)
    return LANG_HOME
