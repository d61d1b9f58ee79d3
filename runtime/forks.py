"""Forks: new sandboxes that see exactly the files of a live sandbox, isolated from it and from each
other afterwards.

A small diff (up to ``fork_inject_max_bytes``) is read once and applied inside sandboxes of the
parent's snapshot — taken from the warm pool, so a fork costs no restore on its path. A larger one is
copied once into a scratch layer stacked under fresh children (same zygote); that layer goes with
the last child.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import secrets
import shutil
from collections.abc import Sequence
from typing import TYPE_CHECKING

from rollbox.runtime import owners
from rollbox.runtime.errors import InvalidRequest, IsolationError
from rollbox.runtime.execution import Sandbox
from rollbox.runtime.inside import proto
from rollbox.runtime.inside.proto import Diff
from rollbox.runtime.upper import give_back, pack_upper

if TYPE_CHECKING:
    from rollbox.runtime.runtime import Runtime

__all__ = ["Forks"]


class Forks:
    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self._scratch: dict[str, set[str]] = {}  # fork scratch layer -> ids of the sandboxes on it

    async def fork(self, sandbox_id: str, count: int, metadata: dict[str, str] | None = None,
                   sandbox_ids: Sequence[str] | None = None) -> list[Sandbox]:
        """``count`` children of the live sandbox ``sandbox_id`` (with these ids, if given)."""
        rt = self.rt
        if not 1 <= count <= 1024:
            raise InvalidRequest(f"count must be between 1 and 1024, got {count}", sandbox_id=sandbox_id)
        if sandbox_ids is not None and len(sandbox_ids) != count:
            raise InvalidRequest(f"{len(sandbox_ids)} sandbox ids for {count} children", sandbox_id=sandbox_id)
        parent = rt.get(sandbox_id)
        ids = iter(sandbox_ids or ())
        scratch = proto.scratch_layer_id(owners.tag(), secrets.token_hex(8))
        diff = await self._read_parent(sandbox_id, scratch)
        meta = metadata if metadata is not None else parent.metadata
        if diff is not None:
            view = parent.view
        else:
            view = dataclasses.replace(parent.view, id=proto.fork_view_id(parent.view.id, scratch),
                                       layers=(scratch, *parent.view.layers))
            rt.views.register(view)
            self._scratch[scratch] = set()

        if diff is not None and parent.limits == view.limits:
            rt.residency.pool_for(view, view.limits).note_burst(count)

        async def child() -> Sandbox:
            sb = await rt.acquire(view.id, parent.limits, meta, pooled=diff is not None,
                                  sandbox_id=next(ids, None), forked_from=sandbox_id)
            if diff is not None:
                await sb.inject(diff)
            return sb  # no spare worker asked for: its first exec forks one (a fork stays ~1 ms per child)

        try:
            results = await asyncio.gather(*(child() for _ in range(count)), return_exceptions=True)
        finally:
            if diff is not None:
                os.close(diff.fd)
        return await self._settle(scratch if diff is None else None, count, results)

    async def _read_parent(self, sandbox_id: str, scratch: str) -> Diff | None:
        """The parent's files, held still while they are read: a diff (its contents in a memfd) if
        small enough, else None, having copied them into the scratch layer ``scratch``."""
        rt = self.rt
        dst = rt.layer_root / scratch
        async with rt.frozen(sandbox_id) as sb:
            diff = await asyncio.to_thread(pack_upper, sb.upper_path, rt.config.fork_inject_max_bytes)
            if diff is None:
                proc = await asyncio.create_subprocess_exec(
                    "cp", "-a", f"{sb.upper_path}/.", str(dst), stderr=asyncio.subprocess.PIPE)
                _, err = await proc.communicate()
                if proc.returncode != 0:
                    shutil.rmtree(dst, ignore_errors=True)
                    raise IsolationError(f"copying the sandbox's files failed: {err.decode(errors='replace')[-300:]}",
                                         sandbox_id=sandbox_id)
                if sb.owner_shift is not None:  # its children run as other uids: the layer's files are 1000's
                    await asyncio.to_thread(give_back, str(dst), sb.owner_shift)
        return diff

    async def _settle(self, scratch: str | None, count: int, results: list[Sandbox | BaseException]) -> list[Sandbox]:
        """All children made, or none: those made are destroyed (and the scratch layer goes) if any failed."""
        made = [r for r in results if isinstance(r, Sandbox)]
        if scratch is not None:
            self._scratch[scratch].update(sb.id for sb in made)
        if len(made) < count:
            for sb in made:
                await self.rt.destroy(sb.id)
            if scratch is not None:
                self._drop(scratch)
            raise next(r for r in results if isinstance(r, BaseException))
        return made

    def sandbox_ended(self, sb: Sandbox) -> None:
        """A sandbox ended: a scratch layer it was the last child on goes."""
        for scratch in sb.view.layers:
            users = self._scratch.get(scratch)
            if users is not None:
                users.discard(sb.id)
                if not users:
                    self._drop(scratch)

    def _drop(self, scratch: str) -> None:
        self._scratch.pop(scratch, None)
        self.rt.views.forget_fork(scratch)
        asyncio.get_running_loop().run_in_executor(None, shutil.rmtree, self.rt.layer_root / scratch, True)
