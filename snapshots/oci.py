"""OCI image layouts as a snapshot base: ``index.json`` -> image manifest -> layer blobs.

Each image layer becomes one rollbox layer (whiteouts converted to overlay form, see
``layers.unpack_oci``), so images that share layers share them in the store too. Every blob read
is checked against its digest. The image config gives the default environment (``Env``).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollbox.runtime.errors import IntegrityError, InvalidRequest

_INDEX_TYPES = ("application/vnd.oci.image.index.v1+json",
                "application/vnd.docker.distribution.manifest.list.v2+json")
_LAYER_TYPES = ("application/vnd.oci.image.layer.v1.tar", "application/vnd.oci.image.layer.v1.tar+gzip",
                "application/vnd.docker.image.rootfs.diff.tar.gzip",
                "application/vnd.oci.image.layer.nondistributable.v1.tar+gzip")
_ARCH = {"x86_64": "amd64", "aarch64": "arm64"}.get(platform.machine(), platform.machine())


@dataclass(frozen=True)
class OciImage:
    layout: Path
    manifest_digest: str
    layers: tuple[str, ...]  # blob digests, bottom to top
    env: dict[str, str]

    def open_layer(self, digest: str) -> VerifiedBlob:
        return VerifiedBlob(self.layout, digest)


def blob_path(layout: Path, digest: str) -> Path:
    algo, _, hexdigest = digest.partition(":")
    if algo != "sha256" or len(hexdigest) != 64 or not all(c in "0123456789abcdef" for c in hexdigest):
        raise InvalidRequest(f"OCI layout {layout}: unsupported or malformed digest {digest!r}")
    return layout / "blobs" / "sha256" / hexdigest


def _read_json(layout: Path, digest: str) -> Any:
    path = blob_path(layout, digest)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise InvalidRequest(f"OCI layout {layout} lacks blob {digest}") from None
    if "sha256:" + hashlib.sha256(data).hexdigest() != digest:
        raise IntegrityError(f"OCI layout {layout}: blob {digest} does not match its digest")
    return json.loads(data)


def read_image(layout: str | os.PathLike[str], image: str | None = None) -> OciImage:
    """Find the image manifest in a layout (by ref name, else the only one, else this platform's)."""
    root = Path(layout)
    try:
        index = json.loads((root / "index.json").read_text())
    except FileNotFoundError:
        raise InvalidRequest(f"{root} is not an OCI image layout: no index.json") from None
    except ValueError as exc:
        raise InvalidRequest(f"{root}/index.json is not valid JSON: {exc}") from None
    desc = _pick(root, index.get("manifests", []), image)
    while desc.get("mediaType") in _INDEX_TYPES:
        desc = _pick(root, _read_json(root, desc["digest"]).get("manifests", []), None)
    manifest = _read_json(root, desc["digest"])
    layers = []
    for layer in manifest.get("layers", []):
        if layer.get("mediaType") not in _LAYER_TYPES:
            raise InvalidRequest(f"OCI layout {root}: layer {layer.get('digest')} has media type "
                                 f"{layer.get('mediaType')!r}; supported: {', '.join(_LAYER_TYPES)}")
        layers.append(layer["digest"])
    config = _read_json(root, manifest["config"]["digest"]) if "config" in manifest else {}
    env = {}
    for item in (config.get("config") or {}).get("Env") or []:
        key, _, value = item.partition("=")
        env[key] = value
    return OciImage(root, desc["digest"], tuple(layers), env)


def _pick(root: Path, manifests: list[dict[str, Any]], image: str | None) -> dict[str, Any]:
    if image is not None:
        for m in manifests:
            if (m.get("annotations") or {}).get("org.opencontainers.image.ref.name") == image:
                return m
        names = [(m.get("annotations") or {}).get("org.opencontainers.image.ref.name") for m in manifests]
        raise InvalidRequest(f"OCI layout {root} has no image {image!r}; it has {names}")
    if len(manifests) == 1:
        return manifests[0]
    for m in manifests:
        plat = m.get("platform") or {}
        if plat.get("os") == "linux" and plat.get("architecture") == _ARCH:
            return m
    raise InvalidRequest(f"OCI layout {root} holds {len(manifests)} images: name one with 'image:'")


class VerifiedBlob:
    """A blob opened for reading; ``verify()`` raises IntegrityError if it does not match its digest."""

    def __init__(self, layout: Path, digest: str):
        self.digest = digest
        self.f = open(blob_path(layout, digest), "rb")  # noqa: SIM115 - closed at EOF / close()
        self.sha = hashlib.sha256()

    def read(self, n: int = -1) -> bytes:
        data = self.f.read(n)
        self.sha.update(data)
        return data

    def verify(self) -> None:
        """Read what is left and check the digest (call after extracting)."""
        while chunk := self.f.read(1 << 20):
            self.sha.update(chunk)
        if "sha256:" + self.sha.hexdigest() != self.digest:
            raise IntegrityError(f"OCI layer blob {self.digest} does not match its digest")

    def close(self) -> None:
        self.f.close()

    def __enter__(self) -> VerifiedBlob:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
