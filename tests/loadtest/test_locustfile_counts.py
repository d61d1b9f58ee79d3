"""The locustfile's count of a worker's users by class: the size of its users' greenlet group, not a walk
over every greenlet (Locust's own, ~28 ms at 50,000 users, made seven times per spawn message). Run in a
child process: importing Locust patches the interpreter for gevent."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("rollbox_locustfile", sys.argv[1])
mod = importlib.util.module_from_spec(spec)
sys.modules["rollbox_locustfile"] = mod  # (its dataclasses look their module up)
spec.loader.exec_module(mod)
import gevent
from locust import User, constant, task
from locust.env import Environment
from locust.runners import Runner

class Player(User):
    wait_time = constant(3600)
    @task
    def think(self):
        pass

class Other(Player):
    pass

walk = mod._walk_user_classes_count.fget
out = {"patched": Runner.user_classes_count.fget is mod._user_classes_count}
runner = Environment(user_classes=[Player]).create_local_runner()
seen = []
for step in ("spawn", "stop", "spawn", "kill"):
    if step == "spawn":
        runner.spawn_users({"Player": 300})
    elif step == "stop":
        runner.stop_users({"Player": 120})
    else:
        for g in list(runner.user_greenlets)[:50]:
            g.kill(block=True)
    gevent.sleep(0.1)  # (a user's greenlet leaves the group in the event loop's next turn)
    seen.append([runner.user_classes_count, walk(runner)])
runner.quit()
two = Environment(user_classes=[Player, Other]).create_local_runner()
two.spawn_users({"Player": 7, "Other": 5})
gevent.sleep(0.1)
out.update(seen=seen, two=[two.user_classes_count, walk(two)])
two.quit()
print(json.dumps(out))
"""


def test_the_count_of_a_workers_users_is_what_the_walk_over_its_greenlets_finds() -> None:
    run = subprocess.run([sys.executable, "-c", SCRIPT, str(ROOT / "loadtest" / "locustfile.py")],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["patched"], "the locustfile did not replace Runner.user_classes_count"
    counts = [fast for fast, _ in out["seen"]]
    assert counts == [{"Player": 300}, {"Player": 180}, {"Player": 480}, {"Player": 430}], out
    assert all(fast == walked for fast, walked in out["seen"]), out
    assert out["two"] == [{"Player": 7, "Other": 5}] * 2, out  # two classes: Locust's own walk
