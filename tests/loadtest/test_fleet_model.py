"""loadtest/fleet.py, the fleet model: Knative's KPA rules over a replica's capacity curve. A pure
function of its inputs, so its properties are checked directly: each can fail on a wrong rule."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


def load_fleet() -> ModuleType:
    spec = importlib.util.spec_from_file_location("fleet_model", ROOT / "loadtest" / "fleet.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["fleet_model"] = mod
    spec.loader.exec_module(mod)
    return mod


fm = load_fleet()


def flat_capacity(rate: float = 100.0, p50_s: float = 1.0, p99_s: float = 2.0) -> Any:
    """A replica serving up to ``rate`` steps/s, each step p50_s (so steps/s x p50 is its concurrency)."""
    return fm.Capacity(rate=(1.0, rate), p50_s=(p50_s, p50_s), p99_s=(p99_s, p99_s), s3_requests_per_step=3.0)


def kpa(**kw: Any) -> Any:
    return fm.Kpa.from_service(**kw)


def open_load(*segments: tuple[int, int]) -> list[int]:
    """Arrivals per second: (requests/s, seconds) segments."""
    return [r for rate, secs in segments for r in [rate] * secs]


def test_the_service_yaml_is_read_not_restated(tmp_path: Path) -> None:
    k = kpa()
    doc = yaml.safe_load((ROOT / "knative" / "base" / "service.yaml").read_text())
    ann = doc["spec"]["template"]["metadata"]["annotations"]
    assert k.target == float(ann["autoscaling.knative.dev/target"])
    assert k.max_scale == int(ann["autoscaling.knative.dev/max-scale"])
    # an edited Service changes the model: target 10 at 50 % -> 5 concurrent per pod, window 2m
    ann.update({"autoscaling.knative.dev/target": "10", "autoscaling.knative.dev/target-utilization-percentage": "50",
                "autoscaling.knative.dev/window": "2m", "autoscaling.knative.dev/max-scale": "7"})
    doc["spec"]["template"]["spec"]["containers"][0]["resources"]["requests"]["cpu"] = "500m"
    edited = tmp_path / "service.yaml"
    edited.write_text(yaml.safe_dump(doc))
    e = fm.Kpa.from_service(edited)
    assert (e.target_value, e.stable_window_s, e.panic_window_s, e.max_scale, e.cpu_request) == (5.0, 120.0, 12, 7, 0.5)
    # containerConcurrency caps the target (ResolveMetricTarget): target 100 with cc 64 -> 64 x utilization
    ann["autoscaling.knative.dev/target"] = "100"
    edited.write_text(yaml.safe_dump(doc))
    assert fm.Kpa.from_service(edited).target_value == pytest.approx(64 * 0.5)


def test_replicas_never_exceed_max_scale() -> None:
    k = kpa()
    tr = fm.simulate(fm.Burst(), k, flat_capacity(rate=20), load=open_load((0, 10), (20_000, 120), (0, 60)))
    pods = [r + p for r, p in zip(tr.ready, tr.pending, strict=True)]
    assert max(pods) == k.max_scale  # the load wants far more: the cap is what holds it
    assert max(want for _, _, want in tr.decisions) == k.max_scale


def test_scale_up_per_tick_is_bounded_by_max_scale_up_rate() -> None:
    k = kpa(max_scale_up_rate=2.0)
    tr = fm.simulate(fm.Burst(), k, flat_capacity(), load=open_load((0, 4), (3000, 200)))
    bounded = 0
    for _, ready, want in tr.decisions:
        limit = math.ceil(2.0 * max(1, ready))
        assert want <= limit, (ready, want)
        bounded += want == limit and want < k.max_scale
    assert bounded >= 2  # the load wanted more than the rate allowed, more than once
    # Knative's default (1000) lets the same load jump straight to what it needs
    fast = fm.simulate(fm.Burst(), kpa(), flat_capacity(), load=open_load((0, 4), (3000, 200)))
    assert max(w for _, _, w in fast.decisions[:4]) > 2


def test_zero_replicas_after_the_grace_period_when_no_load() -> None:
    k = kpa(scale_down_delay_s=0.0)
    load = open_load((0, 5), (30, 100), (0, 400))
    tr = fm.simulate(fm.Burst(), k, flat_capacity(), load=load)
    last = max(i for i, a in enumerate(tr.arrived) if a)
    zero_at = next(t for t in range(last, len(tr.t)) if tr.ready[t] + tr.pending[t] == 0)
    # not before the stable window has seen no traffic and the grace has passed ...
    assert zero_at >= last + k.stable_window_s + k.scale_to_zero_grace_s
    # ... and soon after (one tick of slack on each)
    assert zero_at <= last + k.stable_window_s + k.scale_to_zero_grace_s + 2 * k.tick_s + 1
    assert all(tr.ready[t] + tr.pending[t] == 0 for t in range(zero_at, len(tr.t)))
    # the Service's scale-down-delay holds the last replica longer
    held = fm.simulate(fm.Burst(), kpa(), flat_capacity(), load=load)
    held_zero = next(t for t in range(last, len(held.t)) if held.ready[t] + held.pending[t] == 0)
    assert held_zero >= zero_at + kpa().scale_down_delay_s - k.tick_s


def test_a_buffered_request_wakes_the_fleet_from_zero() -> None:
    tr = fm.simulate(fm.Burst(), kpa(), flat_capacity(), pod_start_s=3.0, load=open_load((0, 10), (1, 1), (0, 50)))
    assert tr.cold_starts[10] == 1  # the activator's poke: the pod is asked for in the second it arrived
    assert tr.queued[10:13] == [1, 1, 1] and tr.served[13] == 1  # buffered until the pod has started
    assert tr.totals["step_p50_s"] == pytest.approx(3.0 + 1.0)


@pytest.mark.parametrize(("factor", "panics"), [(2.0, True), (1.5, False)])
def test_panic_is_entered_when_load_jumps_to_twice_the_target(factor: float, panics: bool) -> None:
    k = kpa(scale_down_delay_s=0.0)
    # concurrency = steps/s x 1 s: 2 pods' worth of target, held long enough to leave the start's panic
    base = int(2 * k.target_value)
    jump_at = 200
    load = open_load((base, jump_at), (int(base * factor), 40))
    tr = fm.simulate(fm.Burst(), k, flat_capacity(rate=1000), load=load)
    assert tr.ready[jump_at - 1] == 2 and not any(tr.panic[jump_at - 20:jump_at])
    entered = any(tr.panic[jump_at:jump_at + k.panic_window_s + k.tick_s + 1])
    assert entered is panics


@pytest.mark.parametrize("seed", [0, 1])
def test_requests_are_conserved(seed: int) -> None:
    burst = fm.Burst(users=8000, think_min_s=5, think_max_s=20, ramp_s=30, hold_s=60, gap_s=300, bursts=2, tail_s=200)
    # a replica too small for the burst and a short timeout: requests queue and some are dropped
    k = kpa(max_scale=3, timeout_s=20.0)
    tr = fm.simulate(burst, k, flat_capacity(rate=40, p50_s=0.2), seed=seed)
    t = tr.totals
    assert t["arrived"] == t["served"] + t["queued"] + t["dropped"]
    assert t["dropped"] > 0 and t["served"] > 0
    assert sum(tr.arrived) == t["arrived"] and sum(tr.served) == t["served"] and sum(tr.dropped) == t["dropped"]
    for i in range(len(tr.t)):  # and second by second
        assert sum(tr.arrived[: i + 1]) == sum(tr.served[: i + 1]) + tr.queued[i] + sum(tr.dropped[: i + 1])


def test_the_model_is_a_function_of_its_inputs_and_seed() -> None:
    burst = fm.Burst(users=2000, think_min_s=5, think_max_s=30, ramp_s=20, hold_s=60, bursts=1, tail_s=100)
    a = fm.simulate(burst, kpa(), flat_capacity(rate=30, p50_s=0.1), seed=3)
    b = fm.simulate(burst, kpa(), flat_capacity(rate=30, p50_s=0.1), seed=3)
    c = fm.simulate(burst, kpa(), flat_capacity(rate=30, p50_s=0.1), seed=4)
    assert a.arrived == b.arrived and a.ready == b.ready and a.totals == b.totals
    assert a.arrived != c.arrived


def test_an_always_on_fleet_costs_more_for_a_bursty_load() -> None:
    burst = fm.Burst(users=20_000, think_min_s=30, think_max_s=90, ramp_s=60, hold_s=240, gap_s=1200, bursts=2)
    k = kpa()
    cap = flat_capacity(rate=50, p50_s=0.5)
    auto = fm.simulate(burst, k, cap, seed=0)
    n = fm.always_on_replicas(burst, k, cap)
    fixed = fm.simulate(burst, k, cap, seed=0, fixed_replicas=n)
    assert n == math.ceil(burst.peak_rate / (50 * k.utilization))
    assert fixed.totals["replica_seconds"] == n * burst.duration_s
    assert fixed.totals["cost"] >= auto.totals["cost"]
    assert fixed.totals["replica_cost"] >= 1.5 * auto.totals["replica_cost"]  # S3's share is the same for both
    assert auto.totals["served"] > 0.95 * auto.totals["arrived"]  # cheaper, not by serving less
    assert min(auto.ready[burst.windows()[0][1] + 1000:burst.windows()[1][0]]) == 0  # zero between bursts


def test_the_checked_in_capacity_curve_parses() -> None:
    cap = fm.Capacity.from_csv(fm.DEFAULT_CAPACITY)
    assert "bench_capacity.py" in cap.source  # labelled with the command that measured it
    assert list(cap.rate) == sorted(cap.rate) and cap.max_rate > 0
    assert all(b >= a > 0 for a, b in zip(cap.p50_s, cap.p99_s, strict=True))
    assert cap.s3_requests_per_step > 0


def test_the_script_prints_totals_and_writes_the_plot(tmp_path: Path) -> None:
    png, out_csv = tmp_path / "fleet.png", tmp_path / "fleet.csv"
    rc = fm.main(["--users", "5000", "--ramp-s", "30", "--hold-s", "60", "--gap-s", "400", "--tail-s", "300",
                  "--png", str(png), "--csv", str(out_csv)])
    assert rc == 0 and png.stat().st_size > 10_000
    rows = out_csv.read_text().splitlines()
    assert rows[0].startswith("t_s,users,arrived,served") and len(rows) == 1 + fm.Burst(
        ramp_s=30, hold_s=60, gap_s=400, tail_s=300).duration_s


def test_a_curve_that_never_saturated_says_so(tmp_path: Path) -> None:
    head = "offered_steps_per_s,steps_per_s,step_p50_ms,step_p99_ms,live_sandboxes,hibernated_episodes\n"
    path = tmp_path / "c.csv"
    path.write_text("# bench_capacity.py --sweep (test)\n" + head + "5,5,20,80,0,50\n10,9.9,30,90,0,100\n20,19.5,40,150,0,200\n"
                    "4,4,10,20,4,0\n")
    cap = fm.Capacity.from_csv(path)
    assert cap.rate == (5.0, 9.9, 19.5) and not cap.saturated  # the durable points only; top served ~ offered
    path.write_text(path.read_text() + "40,24,900,3000,0,400\n")  # 24 of 40 offered: saturated
    cap = fm.Capacity.from_csv(path)
    assert cap.saturated and cap.max_rate == 24.0
    assert fm.Capacity.from_csv(path, "live").rate == (4.0,)
