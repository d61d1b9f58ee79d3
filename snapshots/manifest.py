"""Manifests: what a snapshot is, and its id (the sha256 of the manifest's canonical JSON).

A manifest lists the snapshot's layers bottom to top (each by its sha256 and tar size), the base it
was built on, how to warm its zygote, its environment and default limits, a VERSION block (base,
Python, every package with its version, rollbox) and, for a checkpoint, the parent snapshot's id:
snapshots form a tree. Nothing time- or host-dependent is in it, so the same template and inputs
give the same id on any machine.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from rollbox.runtime.errors import IntegrityError
from rollbox.runtime.spec import Limits
from rollbox.snapshots.layers import check_layer_id

SNAPSHOT_ID_RE = re.compile(r"^[0-9a-f]{64}$")
NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,127}$")
MANIFEST_SCHEMA = 1


def check_snapshot_id(snapshot_id: str) -> str:
    if not SNAPSHOT_ID_RE.match(snapshot_id):
        raise IntegrityError(f"invalid snapshot id {snapshot_id!r}: expected 64 lowercase hex digits",
                             snapshot_id=snapshot_id)
    return snapshot_id


def check_name(name: str) -> str:
    """Snapshot names: lowercase letters, digits, ``.``, ``_``, ``-``; never 64 hex digits (an id)."""
    if not NAME_RE.match(name) or SNAPSHOT_ID_RE.match(name):
        raise ValueError(
            f"invalid snapshot name {name!r}: use 1-128 of [a-z0-9._-], starting with a letter or "
            "digit, and not 64 hex digits (that is an id)")
    return name


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class LayerRef(_Frozen):
    id: str
    size_bytes: Annotated[int, Field(ge=0)]

    @field_validator("id")
    @classmethod
    def _id(cls, v: str) -> str:
        return check_layer_id(v)


class Warm(_Frozen):
    """The zygote recipe: interpreter (a path inside the sandbox root), extra sys.path, imports."""

    python: str | None = Field(default=None, description="None: the host's Python (base 'host')")
    sys_path: tuple[str, ...] = ()
    imports: tuple[str, ...] = ()


class Version(_Frozen):
    """The VERSION block every trajectory step records."""

    base: str
    python: str
    packages: dict[str, str] = Field(default_factory=dict)
    rollbox: str


class Manifest(_Frozen):
    schema_version: Literal[1] = 1
    base: str = Field(description="'host', 'dir:<sha256 of the base layer>' or 'oci:<manifest digest>'")
    layers: tuple[LayerRef, ...] = Field(description="bottom to top")
    warm_layers: Annotated[int, Field(ge=0)] = Field(
        description="how many bottom layers the zygote warms on (the rest are per-sandbox diffs)")
    warm: Warm
    env: dict[str, str] = Field(default_factory=dict)
    limits: Limits = Field(default_factory=Limits)
    version: Version
    parent: str | None = Field(default=None, description="the snapshot this one was checkpointed from")

    @field_validator("parent")
    @classmethod
    def _parent(cls, v: str | None) -> str | None:
        return None if v is None else check_snapshot_id(v)

    def canonical_json(self) -> bytes:
        return canonical(self.model_dump(mode="json"))

    @property
    def id(self) -> str:
        return hashlib.sha256(self.canonical_json()).hexdigest()

    @property
    def size_bytes(self) -> int:
        return sum(layer.size_bytes for layer in self.layers)

    @classmethod
    def from_bytes(cls, data: bytes, *, expected_id: str | None = None) -> Manifest:
        """Parse a stored manifest, verifying that it hashes to ``expected_id``."""
        got = hashlib.sha256(data).hexdigest()
        if expected_id is not None and got != expected_id:
            raise IntegrityError(
                f"manifest of snapshot {expected_id} is corrupt: it hashes to {got}; it was not used",
                snapshot_id=expected_id)
        try:
            manifest = cls.model_validate_json(data)
        except ValidationError as exc:
            raise IntegrityError(f"manifest {got} is not a valid rollbox manifest: {exc}",
                                 snapshot_id=expected_id or got) from exc
        if manifest.canonical_json() != data:
            raise IntegrityError(f"manifest {got} is not in canonical form; it was not used",
                                 snapshot_id=expected_id or got)
        return manifest


def canonical(obj: Any) -> bytes:
    """Canonical JSON: sorted keys, no spaces, UTF-8."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
