"""What a second of a sandbox costs: the prices of usage records, metrics and ``rollbox report``.

Kept apart from the recorder so that reading a flag's default loads no Parquet writer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["Prices", "billed_seconds"]


def billed_seconds(wall_s: float) -> int:
    """A sandbox life's billed seconds: its live time rounded up to the second, at least 1. A durable
    sandbox never made live (created, then destroyed or expired before anything resumed it) ran
    nothing and held nothing: 0 live seconds, 0 billed."""
    return 0 if wall_s <= 0 else max(1, math.ceil(wall_s - 1e-9))


@dataclass(frozen=True)
class Prices:
    """Dollars per vCPU-second and per GiB-second of a sandbox's limits (defaults: E2B's published rates)."""

    vcpu_s: float = 0.000014
    gib_s: float = 0.0000045
