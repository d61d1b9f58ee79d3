"""The durable semantics' model-based test (tests/functions/test_durable_model.py), run long: many
random sequences over three real `rollbox serve` replicas on a SeaweedFS of its own (issue 25.1).

    .venv/bin/python loadtest/durable_model_long.py --minutes 30
    .venv/bin/python loadtest/durable_model_long.py --minutes 5 --steps 40 --expensive 3 --outages

CI runs the same state machine derandomized, ~15 sequences of up to 20 rules. Here every round draws
``--examples`` new random sequences of up to ``--steps`` rules, with up to
``--expensive`` costly rules per sequence (kill -9, drain, idling past hibernation; with
``--outages`` also store pauses past the store deadline, 8 s each). A failure is printed with the
sequence as it ran (and shrunk by Hypothesis with ``--shrink``: slow, real replicas), and the run goes
on with new replicas. At the end (or on Ctrl-C): sequences and rules checked, failures.
Exit status 1 if any sequence failed.
"""

from __future__ import annotations

import argparse
import shutil
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "functions")]

from hypothesis.stateful import run_state_machine_as_test  # noqa: E402

import tests.functions.test_durable_model as m  # noqa: E402
from tests.snapshots.s3server import SeaweedS3  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=30.0, help="stop starting rounds after this long")
    ap.add_argument("--examples", type=int, default=25, help="sequences per round")
    ap.add_argument("--steps", type=int, default=30, help="rules per sequence, at most")
    ap.add_argument("--expensive", type=int, default=2, help="restarts/drains/idling per sequence, at most")
    ap.add_argument("--outages", action="store_true", help="also pause the store past its deadline (503)")
    ap.add_argument("--shrink", action="store_true",
                    help="let Hypothesis shrink a failure (slow, and timing may make its replays take other paths; "
                         "without it the failing sequence is printed as it ran)")
    ap.add_argument("--keep", action="store_true", help="keep the work directory (replica logs) at the end")
    args = ap.parse_args()
    m.EXPENSIVE_PER_SEQUENCE = args.expensive
    m.OUTAGES = args.outages

    stopping = False

    def interrupted(_sig: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True  # (Hypothesis may report the interrupt as the sequence's failure: not counted)
        raise KeyboardInterrupt  # SIGTERM too: the replicas and SeaweedFS are stopped on the way out

    signal.signal(signal.SIGTERM, interrupted)
    work = Path(tempfile.mkdtemp(prefix="rollbox-durable-model-"))
    weed = SeaweedS3(work / "weed")
    failures: list[str] = []
    rounds = 0
    t0 = time.monotonic()
    cluster: m.Cluster | None = None
    rcs: list[int | None] = []
    try:
        weed.start()
        cluster = m.Cluster(weed, work / "cluster-0")
        m.DurableModel.cluster = cluster
        while time.monotonic() - t0 < args.minutes * 60 and not stopping:
            rounds += 1
            settings = m.model_settings(args.examples, args.steps, derandomize=False, shrink=args.shrink)
            before = m.DurableModel.sequences, m.DurableModel.rules_run
            try:  # not derandomized, no example database: new random sequences every round
                run_state_machine_as_test(m.DurableModel, settings=settings)
            except Exception as exc:
                if stopping:
                    break
                text = "".join(traceback.format_exception(exc))
                failures.append(text)
                print(f"\n=== round {rounds} FAILED:\n{text[-20000:]}\n", flush=True)
                cluster.close()  # its replicas may be in any state: new ones
                cluster = m.Cluster(weed, work / f"cluster-{rounds}")
                m.DurableModel.cluster = cluster
            seqs = m.DurableModel.sequences - before[0]
            rules = m.DurableModel.rules_run - before[1]
            print(f"round {rounds}: {seqs} sequences, {rules} rules; total {m.DurableModel.sequences} sequences, "
                  f"{m.DurableModel.rules_run} rules, {len(failures)} failed rounds, "
                  f"{(time.monotonic() - t0) / 60:.1f} min", flush=True)
    except KeyboardInterrupt:
        print("interrupted", flush=True)
    finally:
        if cluster is not None:
            rcs = cluster.close()
        weed.stop()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(f"\ndurable model, long run: {m.DurableModel.sequences} sequences, {m.DurableModel.rules_run} rules "
          f"in {(time.monotonic() - t0) / 60:.1f} min ({rounds} rounds of up to {args.examples} sequences of "
          f"up to {args.steps} rules, {args.expensive} expensive each, outages {'on' if args.outages else 'off'}); "
          f"{len(failures)} failed rounds; replicas' exit codes at the end {rcs}", flush=True)
    if args.keep:
        print(f"work directory (replica logs): {work}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
