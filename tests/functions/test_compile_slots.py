"""Compiles take turns: at most ``compile_slots`` at once (two per CPU by default), the others wait
before their sandbox is taken, and their compile_timeout counts their compile, not the wait. A wait
longer than the compile_timeout is refused as overloaded (504 + Retry-After on /run_code), never judged.
Real sandboxes (the in-process Runtime, the default snapshot); the "compile" is a 2 s sleep, so the
turns are what the timings show."""

from __future__ import annotations

import argparse
import asyncio
import math
import os
from pathlib import Path

import pytest
from rollbox.functions.config.options import ConfigError
from rollbox.functions.handlers.routing import InProcess
from rollbox.functions.handlers.run_code import Program, Runner, runner_for
from rollbox.functions.service import server
from rollbox.functions.service.app import Service
from rollbox.runtime.errors import Overloaded
from rollbox.runtime.runtime import Runtime, RuntimeConfig
from rollbox.snapshots.languages import Plan

SLEEP_COMPILE = Plan(language="python", snapshot="python", files={}, compile="sleep 2 && echo built",
                     run="echo ran", artifacts=())


def program(compile_timeout_s: float) -> Program:
    return Program(language="python", code="", compile_timeout_s=compile_timeout_s, run_timeout_s=10,
                   plan=SLEEP_COMPILE)


async def test_compiles_take_turns_and_a_wait_past_the_compile_timeout_is_overloaded(tmp_path: Path) -> None:
    async with Runtime(RuntimeConfig(state_dir=tmp_path)) as rt:
        # by default two slots per CPU the sandboxes get (the cap less the supervisor's reserve, rounded up)
        cpu = rt.cgroup_backend.cpu if rt.cgroup_backend is not None else None
        want = math.ceil(cpu.cap_cores) if cpu is not None and cpu.cap_cores else len(os.sched_getaffinity(0))
        assert Runner(rt).compile_slots == 2 * want >= 2
        runner = Runner(rt, compile_slots=1)
        # three 2 s compiles, one slot, 3 s each to compile: the first compiles at once, the second
        # after ~2 s of waiting (its own compile still ~2 s: within 3), the third would wait ~4 s
        outcomes = await asyncio.gather(*(runner.run(program(3)) for _ in range(3)), return_exceptions=True)
        done = [o for o in outcomes if not isinstance(o, BaseException)]
        refused = [o for o in outcomes if isinstance(o, BaseException)]
        assert len(done) == 2 and len(refused) == 1, outcomes
        assert isinstance(refused[0], Overloaded) and refused[0].retry_after_s > 0, refused
        assert "compile slot" in refused[0].message
        for r in done:
            assert r.compile is not None and not r.compile.timed_out and r.compile.exit_code == 0, r  # type: ignore[union-attr]
            assert 1.9 <= r.compile.wall_s < 2.9, r.compile  # type: ignore[union-attr]  # its compile alone
            assert r.run is not None and r.run.stdout == "ran\n", r
        # the same three with two slots and room to wait: all compile, none times out
        runner = Runner(rt, compile_slots=2)
        outcomes = await asyncio.gather(*(runner.run(program(8)) for _ in range(3)), return_exceptions=True)
        assert all(not isinstance(o, BaseException) and o.run is not None and o.run.stdout == "ran\n"
                   for o in outcomes), outcomes
        assert not rt.sandboxes, rt.sandboxes  # each program's sandbox destroyed


async def test_a_request_cancelled_while_waiting_for_a_slot_gives_back_nothing_it_did_not_take(tmp_path: Path) -> None:
    async with Runtime(RuntimeConfig(state_dir=tmp_path)) as rt:
        runner = Runner(rt, compile_slots=1)
        first = asyncio.create_task(runner.run(program(10)))
        await asyncio.sleep(0.3)  # the first holds the slot
        waiting = asyncio.create_task(runner.run(program(10)))
        await asyncio.sleep(0.2)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        r = await first
        assert r.run is not None and r.run.stdout == "ran\n"
        # one slot, free again, once: two more compiles take turns (a slot released twice would let
        # them run at once, one never released would block them both)
        t0 = asyncio.get_running_loop().time()
        a, b = await asyncio.gather(runner.run(program(10)), runner.run(program(10)))
        took = asyncio.get_running_loop().time() - t0
        assert all(1.9 <= c.compile.wall_s < 2.9 for c in (a, b)), (a, b)  # type: ignore[union-attr]
        assert took >= 4.0, took  # one after the other
        assert not rt.sandboxes, rt.sandboxes


def test_compile_slots_is_a_serve_flag_and_its_variable_and_the_service_runner_takes_it(tmp_path: Path) -> None:
    """`rollbox serve --compile-slots N` (or ROLLBOX_COMPILE_SLOTS) sets the turns of the service's runner, the one
    /run_code and run events share; 0 (the default) leaves the runner's two per CPU; a negative count is refused."""
    parser = argparse.ArgumentParser()
    server.add_parser(parser.add_subparsers())
    assert server.resolve(parser.parse_args(["serve", "--compile-slots", "3"]), {}).service.compile_slots == 3
    assert server.resolve(parser.parse_args(["serve"]), {"ROLLBOX_COMPILE_SLOTS": "5"}).service.compile_slots == 5
    assert server.resolve(parser.parse_args(["serve"]), {}).service.compile_slots == 0
    with pytest.raises(ConfigError, match=r"compile-slots|COMPILE_SLOTS"):
        server.resolve(parser.parse_args(["serve"]), {"ROLLBOX_COMPILE_SLOTS": "-1"})
    rt = Runtime(RuntimeConfig(state_dir=tmp_path))  # (not started: a runner only reads its CPU cap)
    chosen, default = InProcess(rt), InProcess(rt)
    Service(chosen, config=server.resolve(parser.parse_args(["serve", "--compile-slots", "3"]), {}).service)
    Service(default, config=server.resolve(parser.parse_args(["serve"]), {}).service)
    assert runner_for(chosen).compile_slots == 3
    assert runner_for(default).compile_slots == Runner(rt).compile_slots >= 2
