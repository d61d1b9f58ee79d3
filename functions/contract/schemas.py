"""JSON Schema files of the event contract, generated from the pydantic models.

    python -m rollbox.functions.contract.schemas          # rewrite functions/contract/schemas/*.json
    python -m rollbox.functions.contract.schemas --check  # exit 1 if any file is missing or stale

One file per data model, named after the event type that carries it: ``<type>.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pydantic import BaseModel
from rollbox.functions.contract.models import CONTRACT, ERROR, ErrorData
from rollbox.functions.contract.records import USAGE_TYPE, StepRecord, UsageRecord

__all__ = ["SCHEMA_DIR", "render", "stale"]

SCHEMA_DIR = Path(__file__).resolve().parent / "schemas"


def _document(event_type: str, model: type[BaseModel], role: str) -> str:
    schema = model.model_json_schema(mode="validation" if role == "request" else "serialization")
    schema = {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": f"https://rollbox.dev/schemas/{event_type}.json",
        "description": f"data of a CloudEvent of type {event_type} ({role})",
        **schema,
    }
    return json.dumps(schema, indent=2, sort_keys=True) + "\n"


def render() -> dict[str, str]:
    """File name -> content, for every type of the contract."""
    out: dict[str, str] = {}
    for spec in CONTRACT:
        out[f"{spec.request_type}.json"] = _document(spec.request_type, spec.data, "request")
        out.setdefault(f"{spec.reply_type}.json", _document(spec.reply_type, spec.reply, "reply"))
    out[f"{ERROR}.json"] = _document(ERROR, ErrorData, "reply")
    # what is recorded (functions/contract/records.py): a usage record is the data of a dev.rollbox.usage event;
    # a trajectory step is a row of trajectories/*.parquet
    out[f"{USAGE_TYPE}.json"] = _document(USAGE_TYPE, UsageRecord, "record")
    out["trajectory-step.json"] = _document("trajectory-step", StepRecord, "record")
    return out


def stale(directory: Path = SCHEMA_DIR) -> list[str]:
    """Names of files that are missing, different from the models, or no longer generated."""
    want = render()
    bad = [
        n for n, text in want.items() if not (directory / n).is_file() or (directory / n).read_text() != text
    ]
    bad += sorted(p.name for p in directory.glob("*.json") if p.name not in want)
    return bad


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m rollbox.functions.contract.schemas", description=__doc__.splitlines()[0]
    )
    p.add_argument("--check", action="store_true", help="report stale files instead of writing them")
    args = p.parse_args(argv)
    if args.check:
        bad = stale()
        for name in bad:
            print(f"stale: {SCHEMA_DIR / name}", file=sys.stderr)
        if bad:
            print("regenerate with: python -m rollbox.functions.contract.schemas", file=sys.stderr)
        return 1 if bad else 0
    SCHEMA_DIR.mkdir(exist_ok=True)
    want = render()
    for old in SCHEMA_DIR.glob("*.json"):
        if old.name not in want:
            old.unlink()
    for name, text in want.items():
        (SCHEMA_DIR / name).write_text(text)
    print(f"wrote {len(want)} schemas to {SCHEMA_DIR}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
