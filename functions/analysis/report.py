"""An HTML cost report of one experiment, from what rollbox recorded (``rollbox report``).

    rollbox report --experiment E [--out DIR] [--store ... | --home ...] [--price-vcpu-s P] [--price-gib-s P]

writes ``DIR/index.html`` (default ``./rollbox-report-<experiment>/``) and its PNG plots, and prints
the path. It reads the experiment's step rows (``trajectories``) and usage rows (one per sandbox life)
and compares what the load cost billed per second with the same load billed per minute, and with an
always-on fleet sized for the peak number of concurrently open sandboxes.

Every number comes from the pure functions here, which take pandas DataFrames (as read by
``rollbox.functions.analysis.trajectories``, or built from model dumps): ``summarize`` (the totals),
``timeline`` (per time bucket), ``sandbox_lives`` (when each sandbox was open). ``render`` writes the
files. All times are on rollbox's own clock: a step ran from ``recorded_at - total_ms`` to
``recorded_at``; a life ended at ``ended_at``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import html
import math
import os
import re
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollbox.functions.analysis.trajectories import add_store_arguments
from rollbox.functions.config.options import ConfigError, Option, add_options, amount, resolve_options
from rollbox.functions.recording.prices import Prices
from rollbox.functions.recording.recorder import GiB

__all__ = ["add_parser", "choose_bucket", "render", "sandbox_lives", "summarize", "timeline"]

STEP_ORDER = ("create", "exec", "run", "snapshot", "fork", "destroy", "annotate")
BUCKETS_S = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600)
MAX_BUCKETS = 240
PLOTS = ("sandboxes", "steps", "latency", "cost")
PRICE_OPTIONS = (
    Option("price_vcpu_s", "--price-vcpu-s", "ROLLBOX_PRICE_VCPU_S", amount, Prices.vcpu_s,
           "dollars per vCPU-second of a sandbox's cpu limit"),
    Option("price_gib_s", "--price-gib-s", "ROLLBOX_PRICE_GIB_S", amount, Prices.gib_s,
           "dollars per GiB-second of a sandbox's memory limit"),
)


# ------------------------------------------------------------------------------------ computation
def choose_bucket(span_s: float) -> int:
    """The time bucket (seconds) of the plots: the smallest of 1 s, 2 s, 5 s ... 1 h giving at most
    ``MAX_BUCKETS`` buckets over ``span_s``."""
    for b in BUCKETS_S:
        if span_s / b <= MAX_BUCKETS:
            return b
    return BUCKETS_S[-1]


def _secs(col: Any) -> Any:
    """A column of times (timestamps, or unix seconds) as a float array of unix seconds (NaN: missing)."""
    import numpy as np
    import pandas as pd

    if pd.api.types.is_datetime64_any_dtype(col):
        ts = col.dt.tz_localize("UTC") if col.dt.tz is None else col.dt.tz_convert("UTC")
        return ((ts - pd.Timestamp(0, tz="UTC")) / pd.Timedelta(seconds=1)).to_numpy(dtype=float, na_value=np.nan)
    return pd.to_numeric(col, errors="coerce").to_numpy(dtype=float, na_value=np.nan)


def _col(df: Any, name: str) -> Any:
    import pandas as pd

    return df[name] if name in df.columns else pd.Series([None] * len(df), index=df.index, dtype=object)


@dataclass(frozen=True)
class _Data:
    steps: Any  # DataFrame: kind, sandbox_id, episode, status, total_ms, exec_ms, resumed, start, end
    usage: Any  # DataFrame: sandbox_id, episode, kind, wall_s, billed_s, cores, gib, vcpu_s, gib_s, cost, start, end
    t0: float
    t1: float


def _prepare(steps: Any, usage: Any) -> _Data:
    import numpy as np
    import pandas as pd

    s = pd.DataFrame({
        "kind": _col(steps, "event_type").astype("string").str.rsplit(".", n=1).str[-1].to_numpy(dtype=object),
        "sandbox_id": _col(steps, "sandbox_id").to_numpy(dtype=object),
        "episode": _col(steps, "episode").to_numpy(dtype=object),
        "status": pd.to_numeric(_col(steps, "status"), errors="coerce").to_numpy(dtype=float, na_value=np.nan),
        "total_ms": pd.to_numeric(_col(steps, "total_ms"), errors="coerce").to_numpy(dtype=float, na_value=np.nan),
        "exec_ms": pd.to_numeric(_col(steps, "exec_ms"), errors="coerce").to_numpy(dtype=float, na_value=np.nan),
        "resumed": _col(steps, "resumed").fillna(False).astype(bool).to_numpy(),
        "end": _secs(_col(steps, "recorded_at")) if len(steps) else np.zeros(0),
    })
    s["start"] = s["end"] - np.nan_to_num(s["total_ms"].to_numpy(), nan=0.0) / 1000.0
    s = s[np.isfinite(s["end"])].reset_index(drop=True)

    num = {c: pd.to_numeric(_col(usage, c), errors="coerce").to_numpy(dtype=float, na_value=np.nan)
           for c in ("wall_s", "billed_s", "cpu_max_cores", "memory_max_bytes", "vcpu_s", "gib_s", "cost_usd")}
    u = pd.DataFrame({
        "sandbox_id": _col(usage, "sandbox_id").to_numpy(dtype=object),
        "episode": _col(usage, "episode").to_numpy(dtype=object),
        "kind": _col(usage, "kind").to_numpy(dtype=object),
        "wall_s": np.nan_to_num(num["wall_s"], nan=0.0),
        "billed_s": np.nan_to_num(num["billed_s"], nan=0.0),
        "cores": num["cpu_max_cores"],
        "gib": num["memory_max_bytes"] / GiB,
        "vcpu_s": np.nan_to_num(num["vcpu_s"], nan=0.0),
        "gib_s": np.nan_to_num(num["gib_s"], nan=0.0),
        "cost": np.nan_to_num(num["cost_usd"], nan=0.0),
        "end": _secs(_col(usage, "ended_at")) if len(usage) else np.zeros(0),
    })
    u["start"] = u["end"] - u["wall_s"]
    u = u[np.isfinite(u["end"])].reset_index(drop=True)

    starts = np.concatenate([s["start"].to_numpy(), u["start"].to_numpy()])
    ends = np.concatenate([s["end"].to_numpy(), u["end"].to_numpy()])
    if not len(starts):
        raise ValueError("no step or usage rows")
    return _Data(s, u, float(starts.min()), float(ends.max()))


def _lives(d: _Data) -> Any:
    import numpy as np
    import pandas as pd

    s = d.steps
    ok = s[(s["status"] == 200) & s["sandbox_id"].notna() & (s["kind"] != "annotate")]
    from_steps = ok.groupby("sandbox_id").agg(start=("start", "min"), end=("end", "max"))
    u = d.usage[d.usage["sandbox_id"].notna()]
    from_usage = u.groupby("sandbox_id").agg(start=("start", "min"), end=("end", "max"))
    both = pd.concat([from_steps, from_usage])
    if not len(both):
        return pd.DataFrame({"start": np.zeros(0), "end": np.zeros(0)},
                            index=pd.Index([], dtype=object, name="sandbox_id"))
    return both.groupby(level=0).agg(start=("start", "min"), end=("end", "max"))


def sandbox_lives(steps: Any, usage: Any) -> Any:
    """When each sandbox was open (created, not yet destroyed), indexed by sandbox id: from its first
    step's start to its last step's end (successful steps), widened by its usage record's life
    ``[ended_at - wall_s, ended_at]`` (a sandbox ended by its lifetime or idle window has no destroy step)."""
    return _lives(_prepare(steps, usage))


def _open_levels(lives: Any) -> tuple[Any, Any]:
    """The number of open sandboxes after each start/end, in time order (an end before a start at the
    same instant: a sandbox destroyed as another is created is not concurrent with it)."""
    import numpy as np

    start = lives["start"].to_numpy(dtype=float)
    end = np.maximum(lives["end"].to_numpy(dtype=float), start + 1e-6)  # a life of an instant is one
    t = np.concatenate([start, end])
    delta = np.concatenate([np.ones(len(lives)), -np.ones(len(lives))])
    order = np.lexsort((delta, t))
    return t[order], np.cumsum(delta[order])


def _typical(values: Any) -> float | None:
    import numpy as np

    v = values[np.isfinite(values)]
    return float(np.median(v)) if len(v) else None


def _per_minute_s(wall_s: Any) -> Any:
    import numpy as np

    return np.where(wall_s > 0, 60.0 * np.maximum(1.0, np.ceil(wall_s / 60.0 - 1e-9)), 0.0)  # (0: never live)


def _pct(series: Any, q: float) -> float | None:
    return float(series.quantile(q)) if len(series) else None


def summarize(steps: Any, usage: Any, prices: Prices, *, bucket_s: float | None = None) -> dict[str, Any]:
    """The report's totals. Costs: ``cost_per_second_recorded_usd`` is the usage rows' ``cost_usd``;
    the comparisons price the same lives at ``prices``: per second (their billed seconds), per minute
    (each life's ``wall_s`` rounded up to a whole minute, at its limits) and an always-on fleet of
    ``peak_open`` sandboxes at the median limits for the whole span."""
    import numpy as np
    import pandas as pd

    d = _prepare(steps, usage)
    s, u = d.steps, d.usage
    span = d.t1 - d.t0
    bucket = float(bucket_s or choose_bucket(span))

    by_type = s["kind"].value_counts().to_dict()
    steps_by_type = {k: int(by_type.pop(k)) for k in STEP_ORDER if k in by_type}
    steps_by_type.update({str(k): int(v) for k, v in sorted(by_type.items())})
    first = math.floor(d.t0 / bucket) * bucket
    per_bucket = np.floor((s["end"].to_numpy() - first) / bucket)
    peak_steps = int(pd.Series(per_bucket).value_counts().max()) if len(s) else 0
    window = (math.floor((d.t1 - first) / bucket) + 1) * bucket  # the plotted buckets: the mean of their rates

    execs = s[(s["kind"] == "exec") & (s["status"] == 200)]
    lives = _lives(d)
    _, levels = _open_levels(lives)
    peak_open = int(levels.max()) if len(levels) else 0

    rate = (u["cores"].fillna(0) * prices.vcpu_s + u["gib"].fillna(0) * prices.gib_s).to_numpy()
    per_second = float(u["vcpu_s"].sum() * prices.vcpu_s + u["gib_s"].sum() * prices.gib_s)
    minute_s = _per_minute_s(u["wall_s"].to_numpy())
    per_minute = float((minute_s * rate).sum())
    cores, gib = _typical(u["cores"].to_numpy()), _typical(u["gib"].to_numpy())
    fleet_rate = None if cores is None or gib is None else peak_open * (cores * prices.vcpu_s + gib * prices.gib_s)
    always_on = None if fleet_rate is None else fleet_rate * span

    def saving(vs: float | None) -> float | None:
        return None if not vs else (1.0 - per_second / vs) * 100.0

    episodes = set(s["episode"].dropna()) | set(u["episode"].dropna())
    sandboxes = set(s["sandbox_id"].dropna()) | set(u["sandbox_id"].dropna())
    return {
        "start": d.t0, "end": d.t1, "span_s": span, "bucket_s": bucket,
        "episodes": len(episodes), "sandboxes": len(sandboxes), "lives": len(u),
        "lives_by_kind": {str(k): int(v) for k, v in sorted(u["kind"].value_counts().items())},
        "steps": len(s), "steps_by_type": steps_by_type, "step_errors": int((s["status"] != 200).sum()),
        "resumed_steps": int(s["resumed"].sum()),
        "steps_per_s_avg": len(s) / window, "window_s": window,
        "steps_per_s_peak": peak_steps / bucket,
        "exec_steps": len(execs),
        "latency_p50_ms": _pct(execs["total_ms"].dropna(), 0.5),
        "latency_p99_ms": _pct(execs["total_ms"].dropna(), 0.99),
        "exec_ms_p50": _pct(execs["exec_ms"].dropna(), 0.5),
        "exec_ms_p99": _pct(execs["exec_ms"].dropna(), 0.99),
        "wall_s": float(u["wall_s"].sum()),
        "billed_s": int(u["billed_s"].sum()),
        "vcpu_s": float(u["vcpu_s"].sum()),
        "gib_s": float(u["gib_s"].sum()),
        "cost_per_second_recorded_usd": float(u["cost"].sum()),
        "cost_per_second_usd": per_second,
        "per_minute_billed_s": int(minute_s.sum()),
        "cost_per_minute_usd": per_minute,
        "peak_open": peak_open,
        "typical_cpu_cores": cores,
        "typical_memory_bytes": None if gib is None else gib * GiB,
        "always_on_rate_usd_s": fleet_rate,
        "cost_always_on_usd": always_on,
        "saving_vs_always_on_pct": saving(always_on),
        "saving_vs_per_minute_pct": saving(per_minute),
        "price_vcpu_s": prices.vcpu_s, "price_gib_s": prices.gib_s,
    }


def _spread(starts: Any, ends: Any, amounts: Any, edges: Any) -> Any:
    """How much of each amount falls in each bucket ``[edges[i], edges[i+1])``, spreading it evenly
    over ``[start, end]`` (a zero-length interval: all of it in the bucket of its end)."""
    import numpy as np

    origin = edges[0]
    out = np.zeros(len(edges) - 1)
    pos = ends > starts
    rate = amounts[pos] / (ends[pos] - starts[pos])
    t = np.concatenate([starts[pos], ends[pos]]) - origin
    r = np.concatenate([rate, -rate])
    order = np.argsort(t, kind="stable")
    t, r = t[order], r[order]
    cum_r, cum_rt = np.cumsum(r), np.cumsum(r * t)
    if len(t):
        x = edges - origin
        i = np.searchsorted(t, x, side="right")
        integral = np.where(i > 0, x * cum_r[np.maximum(i - 1, 0)] - cum_rt[np.maximum(i - 1, 0)], 0.0)
        out += np.diff(integral)
    if (~pos).any():
        idx = np.clip(np.searchsorted(edges, ends[~pos], side="right") - 1, 0, len(out) - 1)
        np.add.at(out, idx, amounts[~pos])
    return out


def timeline(steps: Any, usage: Any, prices: Prices, *, bucket_s: float | None = None) -> Any:
    """One row per time bucket (index: the bucket's start, UTC): ``steps`` and ``steps_per_s`` (steps
    that ended in it), ``work_steps`` (of those, exec and run: the work, without the creates and
    destroys that bunch up when a load starts and stops), ``resumed`` (steps that resumed a hibernated
    sandbox), ``open`` (most sandboxes open at once in it), ``p50_ms``/``p90_ms``/``p99_ms`` (total_ms of
    the successful exec steps that ended in it), ``cost_usd`` (per-second billing at ``prices``, each
    life's cost spread evenly over the time its sandbox was open: from its first step's start, or
    ``ended_at - wall_s`` if earlier, to its end; the records do not tell its live seconds from its
    hibernated ones, and placing them all just before ``ended_at`` piled the lives a load's end destroys
    at once onto the last seconds) and ``cost_usd_per_h`` (that as a rate)."""
    import numpy as np
    import pandas as pd

    d = _prepare(steps, usage)
    bucket = float(bucket_s or choose_bucket(d.t1 - d.t0))
    first = math.floor(d.t0 / bucket) * bucket
    n = math.floor((d.t1 - first) / bucket) + 1
    edges = first + bucket * np.arange(n + 1)
    s, u = d.steps, d.usage

    def bucket_of(t: Any) -> Any:
        return np.clip(np.floor((t - first) / bucket).astype(int), 0, n - 1)

    sb = bucket_of(s["end"].to_numpy())
    count = np.bincount(sb, minlength=n).astype(float)
    work = np.bincount(sb, weights=s["kind"].isin(("exec", "run")).to_numpy(dtype=float), minlength=n)
    resumed = np.bincount(sb, weights=s["resumed"].to_numpy(dtype=float), minlength=n)

    lives = _lives(d)
    t, levels = _open_levels(lives)
    open_now = np.zeros(n)
    if len(t):
        i = np.searchsorted(t, edges[:-1], side="right")
        open_now = np.where(i > 0, levels[np.maximum(i - 1, 0)], 0.0)
        inside = pd.Series(levels).groupby(bucket_of(t)).max()
        open_now[inside.index.to_numpy()] = np.maximum(open_now[inside.index.to_numpy()], inside.to_numpy())

    execs = s[(s["kind"] == "exec") & (s["status"] == 200) & s["total_ms"].notna()]
    pct = pd.DataFrame(index=range(n), columns=["p50_ms", "p90_ms", "p99_ms"], dtype=float)
    if len(execs):
        q = execs["total_ms"].groupby(bucket_of(execs["end"].to_numpy())).quantile([0.5, 0.9, 0.99]).unstack()
        pct.loc[q.index, ["p50_ms", "p90_ms", "p99_ms"]] = q[[0.5, 0.9, 0.99]].to_numpy()

    per_s = (u["vcpu_s"] * prices.vcpu_s + u["gib_s"] * prices.gib_s).to_numpy(dtype=float)
    opened = lives["start"].reindex(u["sandbox_id"]).to_numpy(dtype=float)  # NaN: no id, or no steps
    closed = lives["end"].reindex(u["sandbox_id"]).to_numpy(dtype=float)
    start = np.fmin(u["start"].to_numpy(dtype=float), opened)
    end = np.fmax(u["end"].to_numpy(dtype=float), closed)
    cost = _spread(start, end, per_s, edges)
    out = pd.DataFrame({
        "steps": count, "steps_per_s": count / bucket, "work_steps": work, "resumed": resumed, "open": open_now,
        "p50_ms": pct["p50_ms"].to_numpy(), "p90_ms": pct["p90_ms"].to_numpy(), "p99_ms": pct["p99_ms"].to_numpy(),
        "cost_usd": cost, "cost_usd_per_h": cost / bucket * 3600.0,
    }, index=pd.to_datetime(edges[:-1], unit="s", utc=True))
    out.index.name = "time"
    return out


# ------------------------------------------------------------------------------------ rendering
def _usd(v: float | None) -> str:
    if v is None:
        return "n/a"
    return f"${v:,.2f}" if abs(v) >= 10 else f"${v:.4g}"


def _price(v: float) -> str:
    return "$" + (f"{v:.12f}".rstrip("0").rstrip(".") or "0")


def _num(v: float | None, unit: str = "", digits: int = 4) -> str:
    if v is None:
        return "n/a"
    if float(v).is_integer() and abs(v) < 1e15:
        return f"{int(v):,}{unit}"
    return f"{v:,.{digits}g}{unit}" if abs(v) < 1e4 else f"{v:,.0f}{unit}"


def _duration(s: float) -> str:
    if s < 60:
        return f"{s:.1f} s"
    m, sec = divmod(s, 60)
    if m < 60:
        return f"{int(m)} min {sec:.1f} s"
    h, m = divmod(m, 60)
    return f"{int(h)} h {int(m)} min"


def _when(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _rows(sm: dict[str, Any]) -> list[tuple[str, str, str, Any]]:
    """(id, label, shown, raw value) of the totals table."""
    by_type = ", ".join(f"{k} {v:,}" for k, v in sm["steps_by_type"].items()) or "none"
    kinds = ", ".join(f"{k} {v:,}" for k, v in sm["lives_by_kind"].items())
    cores, mem = sm["typical_cpu_cores"], sm["typical_memory_bytes"]
    limits = "n/a" if cores is None else f"{_num(cores)} vCPU, {_num(mem / GiB, ' GiB')}"
    hourly = None if sm["always_on_rate_usd_s"] is None else sm["always_on_rate_usd_s"] * 3600
    rows: list[tuple[str, str, str, Any]] = [
        ("span", "time span", f"{_when(sm['start'])} .. {_when(sm['end'])} ({_duration(sm['span_s'])})",
         sm["span_s"]),
        ("episodes", "episodes", _num(sm["episodes"]), sm["episodes"]),
        ("sandboxes", "sandboxes", _num(sm["sandboxes"]) + (f" ({sm['lives']:,} lives recorded: {kinds})"
                                                            if sm["lives"] else " (no usage rows)"),
         sm["sandboxes"]),
        ("steps", "steps", f"{sm['steps']:,} ({by_type})" + (f"; {sm['step_errors']:,} answered with an error"
                                                           if sm["step_errors"] else ""), sm["steps"]),
        ("resumed_steps", "steps that resumed a hibernated sandbox", _num(sm["resumed_steps"]), sm["resumed_steps"]),
        ("steps_per_s_avg", f"steps/s, average (over the {_duration(sm['window_s'])} of {_num(sm['bucket_s'])} s "
         "buckets plotted)", _num(sm["steps_per_s_avg"], digits=3), sm["steps_per_s_avg"]),
        ("steps_per_s_peak", f"steps/s, peak ({_num(sm['bucket_s'])} s buckets)",
         _num(sm["steps_per_s_peak"], digits=3), sm["steps_per_s_peak"]),
        ("latency_p50_ms", "exec step latency p50 (total_ms, successful execs)", _num(sm["latency_p50_ms"], " ms"),
         sm["latency_p50_ms"]),
        ("latency_p99_ms", "exec step latency p99 (total_ms, successful execs)", _num(sm["latency_p99_ms"], " ms"),
         sm["latency_p99_ms"]),
        ("exec_ms_p50", "command run time p50 / p99 (exec_ms)",
         f"{_num(sm['exec_ms_p50'], ' ms')} / {_num(sm['exec_ms_p99'], ' ms')}", sm["exec_ms_p50"]),
        ("billed_s", "billed sandbox-seconds (per second)", _num(sm["billed_s"], " s"), sm["billed_s"]),
        ("vcpu_s", "vCPU-seconds", _num(sm["vcpu_s"], digits=6), sm["vcpu_s"]),
        ("gib_s", "GiB-seconds", _num(sm["gib_s"], digits=6), sm["gib_s"]),
        ("cost_per_second_usd", "cost, billed per second", _usd(sm["cost_per_second_usd"]),
         sm["cost_per_second_usd"]),
    ]
    if not math.isclose(sm["cost_per_second_recorded_usd"], sm["cost_per_second_usd"], rel_tol=1e-6,
                        abs_tol=1e-9 * max(1, sm["lives"])):
        rows.append(("cost_per_second_recorded_usd", "cost, billed per second, as recorded (other prices)",
                     _usd(sm["cost_per_second_recorded_usd"]), sm["cost_per_second_recorded_usd"]))
    rows += [
        ("cost_per_minute_usd", "the same load billed per minute",
         f"{_usd(sm['cost_per_minute_usd'])} ({_num(sm['per_minute_billed_s'], ' s')} billed; per-second billing "
         f"saves {_num(sm['saving_vs_per_minute_pct'], ' %', 3)})", sm["cost_per_minute_usd"]),
        ("peak_open", "peak concurrently open sandboxes", _num(sm["peak_open"]), sm["peak_open"]),
        ("typical_limits", "typical limits (median of the lives)", limits, cores),
        ("cost_always_on_usd", "always-on fleet (peak x typical limits x span)",
         f"{_usd(sm['cost_always_on_usd'])} ({_usd(hourly)}/h)", sm["cost_always_on_usd"]),
        ("saving_vs_always_on_pct", "saving of per-second billing vs always-on",
         _num(sm["saving_vs_always_on_pct"], " %", 3), sm["saving_vs_always_on_pct"]),
        ("prices", "prices", f"{_price(sm['price_vcpu_s'])} per vCPU-s, {_price(sm['price_gib_s'])} per GiB-s",
         sm["price_vcpu_s"]),
    ]
    return rows


def _clock(span_s: float) -> Callable[[float, Any], str]:
    """Tick labels of a time axis: wall-clock time (UTC), with the date when the span passes a day and
    tenths of a second when ticks fall between seconds (matplotlib's concise labels showed bare
    seconds, "30", between the minutes)."""
    import matplotlib.dates

    mdates: Any = matplotlib.dates  # partly typed

    def label(x: float, _pos: Any) -> str:
        t: dt.datetime = mdates.num2date(x)
        if span_s >= 86400:
            return t.strftime("%m-%d %H:%M")
        text = t.strftime("%H:%M:%S")
        tenths = round(t.microsecond / 100_000)
        return text + (f".{tenths}" if 0 < tenths < 10 else "")
    return label


def _axes_time(ax: Any, xs: Any, *, integer: bool = False, top: float | None = None) -> None:
    """A time x axis over the whole span (every plot the same), labelled as clock times; a y axis from
    0 (to ``top`` if given): counts (``integer``) get whole-number ticks and at least 0..1, so a
    constant or empty series is drawn as a line on a scale, not as noise around its value."""
    import matplotlib.dates
    import numpy as np
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    mdates: Any = matplotlib.dates  # partly typed: its locators and formatters are not
    ax.xaxis.set_major_locator(mdates.AutoDateLocator(minticks=3, maxticks=9))
    span_s = float((xs[-1] - xs[0]) / np.timedelta64(1, "s"))
    ax.xaxis.set_major_formatter(FuncFormatter(_clock(span_s)))
    ax.set_xlim(xs[0], xs[-1])
    if ax.get_yscale() == "linear":
        hi = ax.get_ylim()[1] if top is None else top
        ax.set_ylim(0, max(hi, 1.0) if integer else (hi if hi > 0 else 1.0))
    if integer:
        ax.yaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=2))
    ax.grid(True, alpha=0.3)


def _headroom(values: Any, floor: float = 0.0) -> float:
    """A y limit above the largest finite value (15 % headroom), at least ``floor``."""
    import numpy as np

    v = np.asarray(values, dtype=float)
    v = v[np.isfinite(v)]
    return max(float(v.max()) * 1.15 if len(v) else 0.0, floor)


def _plots(out: Path, sm: dict[str, Any], tl: Any) -> dict[str, str]:
    """The four plots as PNG files in ``out``; their captions by name."""
    c = _Canvas.of(out, sm, tl)
    return {"sandboxes": _plot_sandboxes(c), "steps": _plot_steps(c), "latency": _plot_latency(c),
            "cost": _plot_cost(c)}


@dataclass
class _Canvas:
    """What every plot shares: where it goes, the summary, the timeline and its time axis."""

    out: Path
    sm: dict[str, Any]
    tl: Any
    x: Any  # each bucket's start
    xs: Any  # step lines: each bucket's value drawn across the bucket (one edge more than ``x``)
    width: Any  # a bucket (numpy timedelta)
    b: str  # a bucket, as text
    xlabel: str

    @classmethod
    def of(cls, out: Path, sm: dict[str, Any], tl: Any) -> _Canvas:
        import numpy as np

        x = tl.index.tz_convert(None).to_numpy()
        width = np.timedelta64(int(sm["bucket_s"] * 1e6), "us")
        day = dt.datetime.fromtimestamp(sm["start"], dt.UTC).strftime("%Y-%m-%d")
        return cls(out, sm, tl, x, np.append(x, x[-1] + width), width, _num(sm["bucket_s"], " s"),
                   f"time (UTC), from {day}")

    def ys(self, col: str) -> Any:
        import numpy as np

        return np.append(self.tl[col].to_numpy(dtype=float), self.tl[col].iloc[-1])

    @staticmethod
    def one_axes() -> tuple[Any, Any]:
        from matplotlib.figure import Figure

        fig = Figure(figsize=(10, 3.5), dpi=100, layout="constrained")
        return fig, fig.subplots()

    def save(self, fig: Any, ax: Any, name: str, ylabel: str, title: str, *, legend: bool = True,
             top: float | None = None) -> None:
        ax.set_ylabel(ylabel)
        ax.set_xlabel(self.xlabel)
        if legend:
            ax.legend(loc="upper right", fontsize=8)
        _axes_time(ax, self.xs, top=top)
        fig.suptitle(title)
        fig.savefig(self.out / f"{name}.png")


def _plot_sandboxes(c: _Canvas) -> str:
    from matplotlib.figure import Figure

    sm, tl, b = c.sm, c.tl, c.b
    fig = Figure(figsize=(10, 5), dpi=100, layout="constrained")
    ax1, ax2 = fig.subplots(2, 1, sharex=True)
    ax1.step(c.xs, c.ys("open"), where="post", color="tab:blue", label="open sandboxes (created, not yet destroyed)")
    ax1.axhline(sm["peak_open"], color="tab:red", ls="--", lw=1, label=f"peak {sm['peak_open']}")
    ax1.set_ylabel("sandboxes")
    ax1.legend(loc="best", fontsize=8)
    ax2.bar(c.x, tl["resumed"], width=c.width, align="edge", color="tab:orange",
            label=f"steps that resumed a hibernated sandbox (per {b})")
    ax2.set_ylabel("steps")
    ax2.legend(loc="upper right", fontsize=8)
    _axes_time(ax1, c.xs, integer=True, top=_headroom([sm["peak_open"]], 1.0))
    _axes_time(ax2, c.xs, integer=True, top=_headroom(tl["resumed"], 1.0))
    ax2.set_xlabel(c.xlabel)
    fig.suptitle("Sandboxes over time (which sandboxes are in memory is not recorded)")
    fig.savefig(c.out / "sandboxes.png")
    return (f"Open sandboxes (most at once in each {b} bucket; from each sandbox's first to its "
            "last step, or its usage record's end), and steps that resumed a hibernated sandbox. "
            "Whether an open sandbox was in memory or hibernated is not recorded.")


def _plot_steps(c: _Canvas) -> str:
    import numpy as np

    sm, tl, b, x, width = c.sm, c.tl, c.b, c.x, c.width
    fig, ax = c.one_axes()
    total, work = tl["steps_per_s"].to_numpy(dtype=float), (tl["work_steps"] / sm["bucket_s"]).to_numpy(dtype=float)
    ax.fill_between(c.xs, c.ys("work_steps") / sm["bucket_s"], step="post", color="tab:green", alpha=0.35,
                    label="exec and run steps/s")
    ax.step(c.xs, c.ys("steps_per_s"), where="post", color="tab:green", lw=1, label=f"all steps/s ({b} buckets)")
    avg = sm["steps_per_s_avg"]
    ax.axhline(avg, color="gray", ls="--", lw=1, label=f"average {avg:.3g} (peak {sm['steps_per_s_peak']:.3g})")
    # the scale follows the work and the bulk of the steps: a burst of creates or destroys (a load starting
    # or stopping) that would flatten the rest is cut at the top and its height written there
    top = _headroom([work.max(), np.percentile(total, 95) if len(total) else 0.0, avg], 1.0 / sm["bucket_s"])
    over = np.flatnonzero(total > top)
    runs = np.split(over, np.flatnonzero(np.diff(over) > 1) + 1) if len(over) else []
    for i in (int(run[np.argmax(total[run])]) for run in runs):  # one label per run of cut buckets
        ax.annotate(f"{total[i]:.3g}/s", (x[i] + width // 2, top), xytext=(0, -2), textcoords="offset points",
                    ha="center", va="top", fontsize=7, color="tab:green")
    c.save(fig, ax, "steps", "steps/s", "Steps per second (every recorded step, by when its reply was made)", top=top)
    return (f"Steps answered per second, in {b} buckets: all of them (line) and the exec and run "
            "steps among them (filled). The scale follows the work; a burst of creates or destroys "
            "above it (a load starting or stopping) is cut at the top, its rate written there.")


def _plot_latency(c: _Canvas) -> str:
    import numpy as np

    tl, b = c.tl, c.b
    fig, ax = c.one_axes()
    execs = bool(tl["p50_ms"].notna().any())
    if execs:
        for col, color in (("p50_ms", "tab:blue"), ("p90_ms", "tab:orange"), ("p99_ms", "tab:red")):
            ax.plot(c.x + c.width // 2, tl[col], marker=".", ms=3, lw=1, color=color, label=col.replace("_ms", ""))
        lo, hi = np.nanmin(tl["p50_ms"]), np.nanmax(tl["p99_ms"])
        if lo > 0 and hi / lo > 50:
            ax.set_yscale("log")
    else:
        ax.text(0.5, 0.5, "no exec steps", ha="center", va="center", transform=ax.transAxes)
    c.save(fig, ax, "latency", "ms", f"Exec step latency (total_ms) percentiles per {b}", legend=execs,
           top=_headroom(tl["p99_ms"], 1.0) if execs else None)
    return f"p50, p90 and p99 of the exec steps' total_ms (event in to reply out) in each {b} bucket."


def _plot_cost(c: _Canvas) -> str:
    sm, tl, b = c.sm, c.tl, c.b
    fig, ax = c.one_axes()
    ax.fill_between(c.xs, c.ys("cost_usd_per_h"), step="post", color="tab:blue", alpha=0.4,
                    label="billed per second ($/h)")
    ax.step(c.xs, c.ys("cost_usd_per_h"), where="post", color="tab:blue", lw=1)
    fleet = None if sm["always_on_rate_usd_s"] is None else sm["always_on_rate_usd_s"] * 3600
    if fleet is not None:
        ax.axhline(fleet, color="tab:red", ls="--", lw=1.5, label=f"always-on fleet of {sm['peak_open']} ($/h)")
    c.save(fig, ax, "cost", "$/h", "Cost rate: per-second billing vs an always-on fleet",
           top=_headroom([*tl["cost_usd_per_h"], fleet or 0.0], 1e-9))
    return ("Per-second billing: each sandbox life's cost spread evenly over the time its sandbox was "
            f"open (the records do not tell its live seconds from its hibernated ones), as a rate per {b} "
            "bucket; against the always-on fleet's rate (peak open sandboxes at the typical limits).")


_CSS = """body{font-family:system-ui,sans-serif;max-width:1060px;margin:2em auto;color:#222}
table{border-collapse:collapse;margin:1em 0}th,td{padding:.3em .8em;border-bottom:1px solid #ddd;text-align:left}
th{font-weight:600;color:#444}td{font-variant-numeric:tabular-nums}figure{margin:2em 0}img{max-width:100%}
figcaption,.note{color:#555;font-size:.9em}"""


def render(out: str | os.PathLike[str], experiment: str, summary: dict[str, Any], tl: Any, *,
           store: str = "") -> Path:
    """Write ``index.html`` and the PNG plots into ``out`` (created); returns the index's path."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    captions = _plots(out, summary, tl)
    e = html.escape
    rows = "\n".join(
        f'<tr id="{e(key)}"><th>{e(label)}</th><td data-value="{e(repr(raw))}">{e(shown)}</td></tr>'
        for key, label, shown, raw in _rows(summary))
    figures = "\n".join(
        f'<figure><img src="{name}.png" alt="{e(name)}"><figcaption>{e(captions[name])}</figcaption></figure>'
        for name in PLOTS)
    doc = f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>rollbox report: {e(experiment)}</title>
<style>{_CSS}</style></head><body>
<h1>rollbox report: {e(experiment)}</h1>
<p class="note">From the step and usage records in {e(store)}; generated {e(_when(time.time()))}.</p>
<table id="totals">
{rows}
</table>
<p class="note">Per-second billing is each sandbox life's live time (hibernated time excluded) rounded up to the
second, at its cpu and memory limits. Per minute: the same lives, each rounded up to a whole minute. Always-on:
a fleet sized for the most sandboxes that were open at once, at the median limits, for the whole span. Steps and
lives are placed on rollbox's clock (a step from <code>recorded_at - total_ms</code> to <code>recorded_at</code>).</p>
{figures}
</body></html>
"""
    index = out / "index.html"
    index.write_text(doc, encoding="utf-8")
    return index


# ------------------------------------------------------------------------------------------- CLI
def add_parser(subparsers: Any, env: Mapping[str, str] = os.environ) -> None:
    p = subparsers.add_parser("report", help="an HTML cost report of one experiment",
                              description=__doc__.splitlines()[0] if __doc__ else None)
    add_store_arguments(p, env, experiment="the experiment to report on")
    p.add_argument("--out", default=None, help="directory to write (default ./rollbox-report-<experiment>/)")
    p.add_argument("--bucket-s", type=float, default=None, help="the plots' time bucket (default: from the span)")
    add_options(p, PRICE_OPTIONS)
    p.set_defaults(func=lambda args: _report(args, env))


@contextmanager
def _progress() -> Iterator[Callable[[str], Callable[[int, int], None]]]:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description:<18}"), BarColumn(), MofNCompleteColumn(), TextColumn("files"),
                  TimeElapsedColumn(), console=Console(stderr=True)) as bar:
        def task(name: str) -> Callable[[int, int], None]:
            tid = bar.add_task(f"reading {name}", total=None)

            def update(done: int, total: int) -> None:
                bar.update(tid, completed=done, total=total)
            return update
        yield task


def _report(args: argparse.Namespace, env: Mapping[str, str]) -> int:
    from rollbox.functions.analysis.trajectories import read, store_of
    from rollbox.runtime.errors import RollboxError

    try:
        values = resolve_options(PRICE_OPTIONS, args, env)
    except ConfigError as exc:
        print(f"rollbox report: {exc}", file=sys.stderr)
        return 2
    if args.bucket_s is not None and not (math.isfinite(args.bucket_s) and args.bucket_s > 0):
        print(f"rollbox report: --bucket-s must be a number > 0, got {args.bucket_s}", file=sys.stderr)
        return 2
    prices = Prices(vcpu_s=values["price_vcpu_s"], gib_s=values["price_gib_s"])
    try:
        objects = store_of(args)
        with _progress() as task:
            steps = read("trajectories", objects, experiment=args.experiment, progress=task("trajectories"))
            usage = read("usage", objects, experiment=args.experiment, progress=task("usage"))
    except RollboxError as exc:
        print(f"rollbox report: {exc.message}", file=sys.stderr)
        return 1
    if len(steps) == 0 and len(usage) == 0:
        print(f"rollbox report: no steps or usage recorded for experiment {args.experiment!r} in the store "
              f"{objects.url}", file=sys.stderr)
        return 2
    steps_df, usage_df = steps.to_pandas(), usage.to_pandas()
    summary = summarize(steps_df, usage_df, prices, bucket_s=args.bucket_s)
    tl = timeline(steps_df, usage_df, prices, bucket_s=summary["bucket_s"])
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", args.experiment)
    index = render(args.out or f"rollbox-report-{safe}", args.experiment, summary, tl, store=objects.url)
    print(index)
    return 0
