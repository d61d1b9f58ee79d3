"""What a second of a sandbox costs: the prices of usage records, metrics and ``rollbox report``.

Kept apart from the recorder so that reading a flag's default loads no Parquet writer.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Prices"]


@dataclass(frozen=True)
class Prices:
    """Dollars per vCPU-second and per GiB-second of a sandbox's limits (defaults: E2B's published rates)."""

    vcpu_s: float = 0.000014
    gib_s: float = 0.0000045
