"""How the sweep walks the store (``Residency.sweep`` does the work on what a round lists).

A whole listing of the store's sandbox records costs the store ~150 ms of CPU per 1,000 keys, whoever
lists: at 150,000 keys ~20 s of its CPU, in one burst, from every replica. So:

    whole       while a whole listing is short (under ``SPLIT_S``), a round lists it all, every
                ``interval_s`` at least (and at least ``rest`` times as long as the last took)
    ranges      past that, the keys are split into ``SHARDS`` ranges of sandbox ids (ids are
                ``sb-`` and hex: the ranges hold about as many each), one per round, in turn, paced so
                a whole pass takes as long as before: the same work, in bursts 1/``SHARDS`` as long
    claims      in ranges, the replicas share the work: before it lists a range, a replica creates
                (create-only) the range's claim for this period, ``sweeps/<period s>/<range>/<n>``; the
                one that created it sweeps the range, the others skip it until the next period. The
                period is the pass's, rounded up to a power of two seconds (replicas pacing alike agree
                on it; two that do not both sweep, which is only work twice). A claimant deletes the
                claim of two periods back, not the period before's: a replica whose claim of the period
                before comes late (a busy host) still finds that claim there, and skips the range. Once a
                pass (at range 0) a replica lists ``sweeps/`` and deletes every claim two or more of its
                own periods old (``stale_claims``): those a skipped period (replicas stopped, a busy host)
                or a change of period left behind, which no later claimant names.

A sandbox due is then found within two periods of a whole pass at most, as by one replica sweeping
alone; a step on it finds it due at once anyway (an expiry is decided on the record a step reads).
"""

from __future__ import annotations

import math
import random

__all__ = ["CLAIMS", "SHARDS", "SPLIT_S", "SweepPlan", "key_range", "stale_claims"]

SHARDS = 16
SPLIT_S = 1.0  # a whole listing that took this long or longer is listed a range per round from then on
PREFIX = "sandboxes/"
CLAIMS = "sweeps/"  # the ranges' claims: sweeps/<period s>/<range>/<n>


def key_range(shard: int) -> tuple[str | None, str | None]:
    """The keys of range ``shard`` (0..SHARDS-1): after the first bound, before the second (None: no
    bound). Together they hold every key under ``sandboxes/``, each once."""
    digits = "0123456789abcdef"
    step = len(digits) // SHARDS
    lo = None if shard == 0 else f"{PREFIX}sb-{digits[shard * step]}"
    hi = None if shard == SHARDS - 1 else f"{PREFIX}sb-{digits[(shard + 1) * step]}"
    return lo, hi


def stale_claims(keys: list[str], now: float) -> list[str]:
    """The claims (``sweeps/<period>/<range>/<n>``) among ``keys`` two or more of their own periods old at
    ``now``: no replica skips a range for them any more. Keys of any other shape are left alone."""
    stale = []
    for key in keys:
        parts = key.removeprefix(CLAIMS).split("/")
        if key.startswith(CLAIMS) and len(parts) == 3 and parts[0].isdigit() and parts[2].isdigit():
            period = int(parts[0])
            if period > 0 and int(parts[2]) <= int(now // period) - 2:
                stale.append(key)
    return stale


class SweepPlan:
    """Where the sweep's next round lists (``key_range`` or the whole store), when (``wait_s``), and the
    claim a range's round must create first (``claim``)."""

    def __init__(self, interval_s: float, rest: float, rng: random.Random | None = None):
        self.interval_s = interval_s
        self.rest = rest
        self.pass_s = 0.0  # how long a whole listing takes: measured, or a range's times SHARDS
        self.shard = (rng or random.Random()).randrange(SHARDS)  # (replicas start at different ranges)
        self.wait_s = interval_s

    @property
    def split(self) -> bool:
        return self.pass_s >= SPLIT_S

    def bounds(self) -> tuple[str | None, str | None] | None:
        """The range the next round lists; None: the whole store."""
        return key_range(self.shard) if self.split else None

    def claim(self, now: float) -> tuple[str, str]:
        """The claim of this round's range for the present period, and the one of two periods back. The period
        is a whole pass's, as paced (``interval_s``, or ``rest`` times a whole listing's time), in whole
        seconds rounded up to a power of two."""
        period = 2 ** max(0, math.ceil(math.log2(max(1.0, self.interval_s, self.rest * self.pass_s))))
        n = int(now // period)
        return (f"{CLAIMS}{period}/{self.shard:02d}/{n}", f"{CLAIMS}{period}/{self.shard:02d}/{n - 2}")

    def done(self, took_s: float, listed: bool) -> None:
        """A round ended: it listed (its range, or the whole store) in ``took_s``, or (``listed`` False)
        it skipped a range another replica had claimed."""
        if not self.split:
            if listed:
                self.pass_s = took_s
            self.wait_s = max(self.interval_s, self.rest * took_s)
            if self.split:  # too long now: from the next round on, a range at a time
                self.wait_s /= SHARDS
            return
        if listed:
            self.pass_s += 0.25 * (took_s * SHARDS - self.pass_s)
            self.wait_s = max(self.interval_s / SHARDS, self.rest * took_s)
        self.shard = (self.shard + 1) % SHARDS
        if not self.split:  # short again: the whole store in one listing
            self.wait_s = self.interval_s
