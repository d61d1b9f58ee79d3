"""`rollbox report`: totals, timeline and the HTML/PNG files, from Parquet written by the recorder's own
code path (usage_row, StepRecord, Recorder._upload on a local store), with known numbers.

The experiment: three sandboxes (T = a whole second, unix time).

    sb-a  1 vCPU, 512 MiB  steps T+0 .. T+10.1    usage: ended T+10.05, wall 10.0 s -> billed 10 s, 1 min
    sb-b  2 vCPU, 1 GiB    steps T+5 .. T+75.5    usage: ended T+75.4,  wall 70.2 s -> billed 71 s, 2 min
    sb-c  1 vCPU, 512 MiB  steps T+8 .. T+20.1    usage: ended T+20.05, wall 4.5 s (hibernated) -> 5 s, 1 min

so 3 are open at once at T+8 .. T+10.1, the span is T .. T+75.5, and the median limits are 1 vCPU, 0.5 GiB.
A failed exec (404) on sb-a at T+12 must not keep sb-a open; an `other` experiment must not be counted.
"""

from __future__ import annotations

import html
import re
import uuid
from pathlib import Path
from typing import Any

import matplotlib.image as mpimg
import pandas as pd
import pytest
from rollbox.functions.analysis import report
from rollbox.functions.analysis.trajectories import read
from rollbox.functions.cli import main as cli
from rollbox.functions.contract.records import StepRecord
from rollbox.functions.recording.recorder import Prices, Recorder, usage_row
from rollbox.runtime.spec import Limits, Usage
from rollbox.snapshots.state import LocalObjects

E = "exp-report"
T = 1_750_000_000.0
MiB = 1024**2
CREATE, EXEC, DESTROY, ANNOTATE = ("dev.rollbox.sandbox.create", "dev.rollbox.sandbox.exec",
                                   "dev.rollbox.sandbox.destroy", "dev.rollbox.episode.annotate")
PV, PG = Prices().vcpu_s, Prices().gib_s
# (vCPU, GiB) rate of each life, and its billed seconds / per-minute seconds
A, B, C = (1 * PV + 0.5 * PG), (2 * PV + 1 * PG), (1 * PV + 0.5 * PG)
PER_SECOND = 10 * A + 71 * B + 5 * C
PER_MINUTE = 60 * A + 120 * B + 60 * C
ALWAYS_ON = 3 * (1 * PV + 0.5 * PG) * 75.5


def step(sid: str | None, etype: str, recorded: float, total_ms: float, *, episode: str, status: int = 200,
         experiment: str = E, **kw: Any) -> tuple[str, dict[str, Any]]:
    rec = StepRecord(experiment=experiment, episode=episode, sandbox_id=sid, event_source="/test",
                     event_id=str(uuid.uuid4()), event_type=etype, event_time=T + recorded - total_ms / 1000,
                     recorded_at=T + recorded, status=status, replica="r1", total_ms=total_ms, **kw)
    return "step", rec.model_dump()


def life(sid: str, episode: str, cores: float, mem: int, wall: float, ended: float, *, prices: Prices,
         experiment: str = E) -> tuple[str, dict[str, Any]]:
    usage = Usage(sandbox_id=sid, snapshot_id="python", metadata={"experiment": experiment, "episode": episode},
                  wall_s=wall, cpu_s=wall / 2, peak_memory_bytes=64 * MiB, billed_s=0, execs=2, reason="destroyed")
    return "usage", usage_row(usage, Limits(cpu_max_cores=cores, memory_max_bytes=mem), kind="sandbox",
                              replica="r1", prices=prices, usage_id=sid, ended_at=T + ended)


def write_experiment(home: Path, prices: Prices | None = None) -> None:
    prices = prices or Prices()
    first = [
        step("sb-a", CREATE, 0.5, 500, episode="e1"),
        step("sb-a", EXEC, 1.2, 10, episode="e1", exec_ms=8),
        step("sb-a", EXEC, 2.5, 20, episode="e1", exec_ms=15),
        step("sb-b", CREATE, 5.1, 100, episode="e2"),
        step("sb-b", EXEC, 6.3, 30, episode="e2", exec_ms=25),
        step("sb-c", CREATE, 8.1, 100, episode="e3"),
        step("sb-c", EXEC, 9.5, 100, episode="e3", exec_ms=90),
        step("sb-a", DESTROY, 10.1, 100, episode="e1"),
        life("sb-a", "e1", 1.0, 512 * MiB, 10.0, 10.05, prices=prices),
        step("sb-a", EXEC, 12.0, 5, episode="e1", status=404),
        # another experiment, same store: not in this report
        step("sb-x", CREATE, 3.0, 100, episode="x", experiment="other"),
        life("sb-x", "x", 8.0, 8192 * MiB, 500.0, 600.0, prices=prices, experiment="other"),
    ]
    second = [
        step("sb-c", EXEC, 19.5, 1000, episode="e3", exec_ms=600, resumed=True, resume_ms=300),
        step("sb-c", DESTROY, 20.1, 100, episode="e3"),
        life("sb-c", "e3", 1.0, 512 * MiB, 4.5, 20.05, prices=prices),
        step(None, ANNOTATE, 40.7, 1, episode="e1", reward=1.0),
        step("sb-b", EXEC, 40.5, 40, episode="e2", exec_ms=35),
        step("sb-b", DESTROY, 75.5, 100, episode="e2"),
        life("sb-b", "e2", 2.0, 1024 * MiB, 70.2, 75.4, prices=prices),
    ]
    recorder = Recorder(home / "spool", LocalObjects(home), "r1")
    recorder._upload(first, "r1.0000000000001.000001")
    recorder._upload(second, "r1.0000000000001.000002")


def frames(home: Path) -> tuple[pd.DataFrame, pd.DataFrame]:
    objects = LocalObjects(home)
    return (read("trajectories", objects, experiment=E).to_pandas(), read("usage", objects, experiment=E).to_pandas())


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("ROLLBOX_STORE", "ROLLBOX_HOME", "ROLLBOX_PRICE_VCPU_S", "ROLLBOX_PRICE_GIB_S"):
        monkeypatch.delenv(var, raising=False)


def test_summarize_totals(tmp_path: Path) -> None:
    write_experiment(tmp_path)
    steps, usage = frames(tmp_path)
    sm = report.summarize(steps, usage, Prices())

    assert sm["start"] == pytest.approx(T, abs=1e-6) and sm["span_s"] == pytest.approx(75.5, abs=1e-6)
    assert sm["bucket_s"] == 1
    assert (sm["episodes"], sm["sandboxes"], sm["lives"]) == (3, 3, 3)
    assert sm["steps"] == 14 and sm["step_errors"] == 1 and sm["resumed_steps"] == 1
    assert sm["steps_by_type"] == {"create": 3, "exec": 7, "destroy": 3, "annotate": 1}
    assert sm["steps_per_s_avg"] == pytest.approx(14 / 76)  # over the 76 one-second buckets plotted
    assert sm["steps_per_s_peak"] == 2  # T+40.5 and T+40.7
    # successful execs: 10, 20, 30, 100, 1000, 40 ms (the 404's 5 ms is not a latency)
    assert sm["latency_p50_ms"] == pytest.approx(35.0)
    assert sm["latency_p99_ms"] == pytest.approx(100 + 0.95 * 900)
    assert sm["exec_ms_p50"] == pytest.approx(30.0)

    assert sm["billed_s"] == 10 + 71 + 5
    assert sm["wall_s"] == pytest.approx(84.7)
    assert sm["vcpu_s"] == pytest.approx(10 + 142 + 5)
    assert sm["gib_s"] == pytest.approx(5 + 71 + 2.5)
    assert sm["cost_per_second_usd"] == pytest.approx(PER_SECOND, rel=1e-12)
    assert sm["cost_per_second_recorded_usd"] == pytest.approx(PER_SECOND, rel=1e-6)
    assert sm["per_minute_billed_s"] == 240
    assert sm["cost_per_minute_usd"] == pytest.approx(PER_MINUTE, rel=1e-12)
    assert sm["peak_open"] == 3
    assert sm["typical_cpu_cores"] == 1.0 and sm["typical_memory_bytes"] == 512 * MiB
    assert sm["cost_always_on_usd"] == pytest.approx(ALWAYS_ON, rel=1e-9)
    assert sm["saving_vs_always_on_pct"] == pytest.approx((1 - PER_SECOND / ALWAYS_ON) * 100, rel=1e-9)
    assert sm["saving_vs_per_minute_pct"] == pytest.approx((1 - PER_SECOND / PER_MINUTE) * 100, rel=1e-12)


def test_summarize_reprices_the_comparisons(tmp_path: Path) -> None:
    write_experiment(tmp_path)  # recorded at the default prices
    steps, usage = frames(tmp_path)
    sm = report.summarize(steps, usage, Prices(vcpu_s=0.01, gib_s=0.002))
    assert sm["cost_per_second_recorded_usd"] == pytest.approx(PER_SECOND, rel=1e-6)
    assert sm["cost_per_second_usd"] == pytest.approx(157 * 0.01 + 78.5 * 0.002)
    assert sm["cost_per_minute_usd"] == pytest.approx(360 * 0.01 + 180 * 0.002)
    assert sm["cost_always_on_usd"] == pytest.approx(3 * (0.01 + 0.5 * 0.002) * 75.5)


def test_sandbox_lives_and_timeline(tmp_path: Path) -> None:
    write_experiment(tmp_path)
    steps, usage = frames(tmp_path)
    lives = report.sandbox_lives(steps, usage)
    assert sorted(lives.index) == ["sb-a", "sb-b", "sb-c"]
    assert lives.loc["sb-a", "end"] - T == pytest.approx(10.1)  # not the 404 at T+12
    assert lives.loc["sb-c", "start"] - T == pytest.approx(8.0)

    tl = report.timeline(steps, usage, Prices())
    assert len(tl) == 76 and tl.index[0] == pd.Timestamp(T, unit="s", tz="UTC")
    at = {round(ts.timestamp() - T): row for ts, row in tl.iterrows()}
    assert [at[i]["open"] for i in (0, 5, 8, 9, 10, 11, 20, 21, 30, 75)] == [1, 2, 3, 3, 3, 2, 2, 1, 1, 1]
    assert tl["steps"].sum() == 14 and at[40]["steps"] == 2 and at[40]["steps_per_s"] == 2
    assert tl["resumed"].sum() == 1 and at[19]["resumed"] == 1
    assert at[19]["p50_ms"] == at[19]["p99_ms"] == 1000
    assert at[1]["p50_ms"] == 10 and pd.isna(at[12]["p50_ms"])  # the 404 is no latency sample
    # per-second cost spread over the time each sandbox was open (first step's start .. its end), conserved:
    # sb-a T+0 .. T+10.1, sb-b T+5.0 .. T+75.5, sb-c T+8.0 .. T+20.1 (hibernated most of it: not piled at its end)
    assert tl["cost_usd"].sum() == pytest.approx(PER_SECOND, rel=1e-9)
    assert at[0]["cost_usd"] == pytest.approx(10 * A / 10.1, rel=1e-6)
    assert at[5]["cost_usd"] == pytest.approx(10 * A / 10.1 + 71 * B / 70.5, rel=1e-6)
    assert at[5]["cost_usd_per_h"] == pytest.approx(at[5]["cost_usd"] * 3600)
    assert at[19]["cost_usd"] == pytest.approx(71 * B / 70.5 + 5 * C / 12.1, rel=1e-6)
    assert at[30]["cost_usd"] == pytest.approx(71 * B / 70.5, rel=1e-6)
    assert tl["work_steps"].sum() == 7 and at[40]["work_steps"] == 1  # the execs (the 404 too), not the annotate

    assert report.choose_bucket(75.5) == 1 and report.choose_bucket(3600) == 15
    assert report.choose_bucket(6 * 3600) == 120


def test_back_to_back_sandboxes_are_not_concurrent() -> None:
    # rows straight from the model dumps (unix seconds, not timestamps): sb-q is created at T+5.0, the
    # instant sb-p's destroy replied; a fleet of one would have served both
    steps = pd.DataFrame([r for _, r in (
        step("sb-p", CREATE, 1.0, 1000, episode="p"), step("sb-p", DESTROY, 5.0, 0, episode="p"),
        step("sb-q", CREATE, 5.5, 500, episode="q"), step("sb-q", DESTROY, 9.0, 100, episode="q"))])
    usage = pd.DataFrame([life("sb-p", "p", 1.0, 512 * MiB, 5.0, 5.0, prices=Prices())[1]])
    sm = report.summarize(steps, usage, Prices())
    assert sm["peak_open"] == 1 and sm["span_s"] == pytest.approx(9.0)
    assert sm["cost_always_on_usd"] == pytest.approx(1 * (PV + 0.5 * PG) * 9.0)
    tl = report.timeline(steps, usage, Prices())
    assert tl["open"].tolist() == [1] * 9 + [0]  # [T+9, T+10): sb-q ended at T+9.0


def cells(index: Path) -> dict[str, tuple[str, str]]:
    """Totals table: row id -> (data-value, shown text)."""
    doc = index.read_text()
    return {m[1]: (html.unescape(m[2]), html.unescape(m[3])) for m in
            re.finditer(r'<tr id="([^"]+)"><th>[^<]*</th><td data-value="([^"]*)">([^<]*)</td></tr>', doc)}


def test_cli_writes_the_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    home = tmp_path / "home"
    write_experiment(home)
    out = tmp_path / "out"
    assert cli.main(["report", "--experiment", E, "--home", str(home), "--out", str(out)]) == 0
    printed, err = capsys.readouterr()
    assert printed.strip() == str(out / "index.html")
    assert "reading trajectories" in err and "reading usage" in err and "2/2" in err  # the progress bars

    doc = (out / "index.html").read_text()
    assert f"rollbox report: {E}" in doc and str(home) in doc
    c = cells(out / "index.html")
    assert c["billed_s"] == ("86", "86 s")
    assert c["peak_open"] == ("3", "3")
    assert c["episodes"][0] == "3" and c["sandboxes"][0] == "3"
    assert c["steps"][1].startswith("14 (create 3, exec 7, destroy 3, annotate 1)")
    assert float(c["cost_per_second_usd"][0]) == pytest.approx(PER_SECOND, rel=1e-12)
    assert c["cost_per_second_usd"][1] == f"${PER_SECOND:.4g}"
    assert float(c["cost_per_minute_usd"][0]) == pytest.approx(PER_MINUTE, rel=1e-12)
    assert c["cost_per_minute_usd"][1].startswith(f"${PER_MINUTE:.4g} (240 s billed")
    assert float(c["cost_always_on_usd"][0]) == pytest.approx(ALWAYS_ON, rel=1e-9)
    saving = (1 - PER_SECOND / ALWAYS_ON) * 100
    assert float(c["saving_vs_always_on_pct"][0]) == pytest.approx(saving, rel=1e-9)
    assert c["saving_vs_always_on_pct"][1] == f"{saving:.3g} %"
    assert float(c["latency_p99_ms"][0]) == pytest.approx(955.0)
    assert "cost_per_second_recorded_usd" not in c  # the same prices: nothing to flag

    images = re.findall(r'<img src="([^"]+)"', doc)
    assert images == ["sandboxes.png", "steps.png", "latency.png", "cost.png"]
    for name in images:
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000, name
        pixels = mpimg.imread(out / name)
        assert pixels.shape[1] == 1000 and pixels[..., :3].std() > 0.05, name  # drawn on, not blank


def test_cli_prices_default_dir_and_bucket(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    write_experiment(tmp_path / "home")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("ROLLBOX_PRICE_GIB_S", "0.002")
    argv = ["report", "--experiment", E, "--home", str(tmp_path / "home"), "--price-vcpu-s", "0.01",
            "--bucket-s", "5"]
    assert cli.main(argv) == 0
    index = tmp_path / f"rollbox-report-{E}" / "index.html"
    assert capsys.readouterr().out.strip() == f"rollbox-report-{E}/index.html" and index.is_file()
    c = cells(index)
    assert float(c["cost_per_second_usd"][0]) == pytest.approx(157 * 0.01 + 78.5 * 0.002)
    assert float(c["cost_per_second_recorded_usd"][0]) == pytest.approx(PER_SECOND, rel=1e-6)  # flagged
    assert float(c["steps_per_s_peak"][0]) == pytest.approx(4 / 5)  # T+5.1, 6.3, 8.1, 9.5: one 5 s bucket

    assert cli.main([*argv, "--price-vcpu-s", "-1"]) == 2
    assert "--price-vcpu-s: must be a finite number >= 0" in capsys.readouterr().err


def test_cli_no_rows_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_experiment(tmp_path)  # experiments exp-report and other, not this one
    out = tmp_path / "out"
    rc = cli.main(["report", "--experiment", "nothing-here", "--home", str(tmp_path), "--out", str(out)])
    assert rc == 2
    err = capsys.readouterr().err
    assert "no steps or usage recorded for experiment 'nothing-here'" in err and str(tmp_path) in err
    assert not out.exists()


def _figures(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """The report's figures by file name, as they were saved (drawn: tick labels are final)."""
    from matplotlib.figure import Figure

    saved: dict[str, Any] = {}
    original = Figure.savefig

    def keep(self: Any, fname: Any, *args: Any, **kw: Any) -> Any:
        saved[Path(fname).stem] = self
        return original(self, fname, *args, **kw)

    monkeypatch.setattr(Figure, "savefig", keep)
    return saved


CLOCK = re.compile(r"^\d\d:\d\d:\d\d(\.\d)?$")


def test_a_short_steady_experiment_draws_sensible_axes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """(issue 26) 8 sandboxes open the whole time, nothing resumed, 90 steps in under a second: the
    sandbox axis was 7.6-8.4, the resumes axis -0.045..0.045, "average 180" was drawn above "peak 91",
    and the x ticks were bare seconds. Now counts start at 0 on whole numbers, the average is the mean
    of the plotted buckets (never above the peak), and ticks are clock times."""
    rows = [step(f"sb-{i}", CREATE, 0.01 * i, 5, episode=str(i)) for i in range(8)]
    rows += [step(f"sb-{i % 8}", EXEC, 0.1 + 0.005 * i, 2, episode=str(i % 8), exec_ms=1) for i in range(82)]
    steps = pd.DataFrame([r for _, r in rows])
    usage = pd.DataFrame([life(f"sb-{i}", str(i), 1.0, 512 * MiB, 0.5, 0.6, prices=Prices())[1] for i in range(8)])
    sm = report.summarize(steps, usage, Prices())
    assert sm["steps"] == 90 and sm["steps_per_s_avg"] <= sm["steps_per_s_peak"], sm
    figs = _figures(monkeypatch)
    report.render(tmp_path / "out", E, sm, report.timeline(steps, usage, Prices(), bucket_s=sm["bucket_s"]))
    open_ax, resumed_ax = figs["sandboxes"].axes
    assert open_ax.get_ylim()[0] == 0 and open_ax.get_ylim()[1] >= 8, open_ax.get_ylim()
    assert resumed_ax.get_ylim() == (0, 1.0), resumed_ax.get_ylim()
    for ax in (open_ax, resumed_ax):
        assert all(float(t).is_integer() for t in ax.get_yticks()), ax.get_yticks()
    steps_ax = figs["steps"].axes[0]
    assert steps_ax.get_ylim()[0] == 0 and steps_ax.get_ylim()[1] >= sm["steps_per_s_peak"]
    average = next(t.get_text() for t in steps_ax.get_legend().get_texts() if t.get_text().startswith("average"))
    assert average == f"average {sm['steps_per_s_avg']:.3g} (peak {sm['steps_per_s_peak']:.3g})"
    for name, fig in figs.items():
        for ax in fig.axes:
            labels = [t.get_text() for t in ax.get_xticklabels() if t.get_text()]
            assert all(CLOCK.match(label) for label in labels), (name, labels)
        assert fig.axes[-1].get_xlabel().startswith("time (UTC), from 20"), fig.axes[-1].get_xlabel()


def test_a_load_that_stops_at_once_does_not_dominate_the_plots(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """(issue 26) 20 sandboxes, 2 execs/s for a minute, then all destroyed in the same second (a load
    test stopping), each live 5 s of its 60 (hibernated the rest): the destroy burst set the steps
    plot's scale (20/s against 2/s of work; the creates at the start: 10/s) and the cost of every life was drawn in its last 5 s, a
    cliff at the right edge. Now the steps scale follows the work (the burst cut, its rate written at
    the top) and each life's cost is spread over the time it was open."""
    rows = [step(f"sb-{i}", CREATE, 0.1 * i, 50, episode=str(i)) for i in range(20)]
    rows += [step(f"sb-{i % 20}", EXEC, 2.0 + 0.5 * i, 20, episode=str(i % 20), exec_ms=10) for i in range(116)]
    rows += [step(f"sb-{i}", DESTROY, 60.2 + 0.01 * i, 30, episode=str(i)) for i in range(20)]
    steps = pd.DataFrame([r for _, r in rows])
    usage = pd.DataFrame([life(f"sb-{i}", str(i), 1.0, 512 * MiB, 5.0, 60.2 + 0.01 * i, prices=Prices())[1]
                          for i in range(20)])
    sm = report.summarize(steps, usage, Prices())
    tl = report.timeline(steps, usage, Prices(), bucket_s=sm["bucket_s"])
    rate = tl["cost_usd_per_h"].to_numpy()
    assert rate[-5:].max() < 2 * float(pd.Series(rate[5:-5]).median()), rate  # no cliff at the end
    assert tl["cost_usd"].sum() == pytest.approx(sm["cost_per_second_usd"], rel=1e-9)  # the total is kept
    figs = _figures(monkeypatch)
    report.render(tmp_path / "out", E, sm, tl)
    steps_ax = figs["steps"].axes[0]
    assert 2 <= steps_ax.get_ylim()[1] < 5, steps_ax.get_ylim()  # the work's scale, not the burst's 20/s
    cut = [t.get_text() for t in steps_ax.texts]
    assert cut == ["10/s", "20/s"], cut  # the creates' two seconds at the start (one label), the destroys' end
