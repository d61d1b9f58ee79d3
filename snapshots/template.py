"""Templates: the YAML a user writes to describe a snapshot, validated by pydantic.

    name: python-sci                  # [a-z0-9._-], the name the snapshot gets in the store
    base: host                        # host | {dir: ./rootfs} | {oci: ./image-layout, image: ref}
                                      # | {debian: {suite: bookworm, packages: [g++], run: [...], over: base.yaml}}
    python: /usr/local/bin/python3    # the interpreter inside a dir/oci base (debian: /usr/bin/python3)
    packages: [numpy==2.4.6]          # pip requirements, installed into a layer of their own
    pip: {find_links: [./wheels], no_index: true}
    files:                            # absolute paths inside the sandbox
      /etc/motd: {content: "hello\\n"}
      /srv/task.py: {source: ./task.py, mode: 0o755}
    env: {OMP_NUM_THREADS: "1"}
    warm: {imports: [numpy]}          # imported by the zygote before any sandbox forks
                                      # (also sys_path: [dirs], preload: [files read once, globs])
    limits: {memory_max_bytes: 1073741824}

Relative paths are relative to the template file. Errors name the file and the field.
"""

from __future__ import annotations

import os
import posixpath
import re
from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    field_validator,
    model_validator,
)
from rollbox.runtime.errors import InvalidRequest
from rollbox.runtime.spec import Limits, check_env
from rollbox.snapshots.manifest import check_name

PACKAGES_PREFIX = "/opt/rollbox/site-packages"


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class DirBase(_Frozen):
    """A root filesystem in a local directory."""

    dir: str


class OciBase(_Frozen):
    """An unpacked OCI image layout (``index.json`` + ``blobs/``), e.g. from ``skopeo copy
    docker://python:3.11-slim oci:./py``; ``image`` picks a ``org.opencontainers.image.ref.name``."""

    oci: str
    image: str | None = None


class DebianSpec(_Frozen):
    """A root filesystem built from Debian's packages (snapshots/debian.py)."""

    suite: str = Field(default="bookworm", pattern=r"^[a-z][a-z0-9-]*$")
    packages: tuple[str, ...] = ()
    run: tuple[str, ...] = Field(default=(), description="shell commands run as root inside the root after the "
                                 "packages are in (package registries are reachable then; nothing is at run time)")
    over: str | None = Field(default=None, description="a template (a path) whose Debian base this one is built "
                           "over: its layer is shared, this one's layer holds only what these packages changed")

    @field_validator("packages")
    @classmethod
    def _packages(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for pkg in v:
            if not re.fullmatch(r"[a-z0-9][a-z0-9+.-]*(:[a-z0-9]+)?(=[A-Za-z0-9.+~:-]+)?", pkg):
                raise ValueError(f"{pkg!r} is not a Debian package name (name, name:arch or name=version)")
        return v


class DebianBase(_Frozen):
    """``base: {debian: {suite, packages, run, over}}`` (``on`` would be a YAML boolean)."""

    debian: DebianSpec


class PipOptions(_Frozen):
    find_links: tuple[str, ...] = ()
    no_index: bool = False
    index_url: str | None = None
    only_binary: bool = Field(default=True, description="wheels only: no sdist is built (reproducible)")
    extra_args: tuple[str, ...] = ()


class FileSpec(_Frozen):
    content: str | None = None
    source: str | None = None
    mode: Annotated[int, Field(ge=0, le=0o7777)] = 0o644

    @field_validator("mode", mode="before")
    @classmethod
    def _mode(cls, v: object) -> object:
        """Octal as YAML writes it: ``0755`` (an int already), or a string ``"0o755"``/``"755"``."""
        if isinstance(v, str):
            try:
                return int(v.lower().removeprefix("0o"), 8)
            except ValueError:
                raise ValueError(f"{v!r} is not an octal file mode like 0o644") from None
        return v

    @model_validator(mode="after")
    def _one_of(self) -> FileSpec:
        if (self.content is None) == (self.source is None):
            raise ValueError("exactly one of 'content' or 'source' must be given")
        return self


class WarmSpec(_Frozen):
    imports: tuple[str, ...] = ()
    sys_path: tuple[str, ...] = Field(default=(), description="directories the zygote adds to sys.path")
    preload: tuple[str, ...] = Field(default=(), description="files (globs) the zygote reads once when it starts, "
                                     "so the first run does not wait for the disk (a compiler, a JDK's modules)")

    @field_validator("sys_path", "preload")
    @classmethod
    def _absolute(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for path in v:
            if not path.startswith("/") or ".." in path.split("/"):
                raise ValueError(f"{path!r} must be an absolute path inside the sandbox, without '..'")
        return v

    @field_validator("imports")
    @classmethod
    def _imports(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for mod in v:
            if not all(part.isidentifier() for part in mod.split(".")):
                raise ValueError(f"{mod!r} is not a module name")
        return v


def _base_kind(v: object) -> str:
    """Which kind of base ``v`` is, so a bad one is reported against that kind alone."""
    if isinstance(v, BaseModel):
        return type(v).__name__
    if isinstance(v, dict):
        return "DebianBase" if "debian" in v else "OciBase" if "oci" in v else "DirBase"
    return "literal['host']"


class Template(_Frozen):
    name: str
    base: Annotated[
        Annotated[Literal["host"], Tag("literal['host']")] | Annotated[DirBase, Tag("DirBase")]
        | Annotated[OciBase, Tag("OciBase")] | Annotated[DebianBase, Tag("DebianBase")],
        Discriminator(_base_kind),
    ] = "host"
    python: str | None = None
    packages: tuple[str, ...] = ()
    pip: PipOptions = PipOptions()
    files: dict[str, FileSpec] = Field(default_factory=dict)
    env: dict[str, str] = Field(default_factory=dict)
    warm: WarmSpec = WarmSpec()
    limits: Limits = Limits()

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        return check_name(v)

    @field_validator("base", mode="before")
    @classmethod
    def _base(cls, v: object) -> object:
        if v == "host" or isinstance(v, DirBase | OciBase | DebianBase):
            return v
        if isinstance(v, dict) and set(v) in ({"dir"}, {"oci"}, {"oci", "image"}, {"debian"}):
            return v
        raise ValueError(f"{v!r}: expected 'host', {{dir: PATH}}, {{oci: PATH, image: REF}} or "
                         "{debian: {suite: bookworm, packages: [...]}}")

    @field_validator("python")
    @classmethod
    def _python(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith("/"):
            raise ValueError(f"{v!r} must be an absolute path inside the sandbox")
        return v

    @field_validator("packages")
    @classmethod
    def _packages(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for req in v:
            if not req.strip() or req.strip().startswith("-"):
                raise ValueError(f"{req!r} is not a requirement (pip options go under 'pip')")
        return v

    @field_validator("files")
    @classmethod
    def _files(cls, v: dict[str, FileSpec]) -> dict[str, FileSpec]:
        for path in v:
            if not path.startswith("/") or "\x00" in path or ".." in path.split("/"):
                raise ValueError(f"{path!r} must be an absolute path inside the sandbox, without '..'")
            if posixpath.normpath(path) == "/":
                raise ValueError(f"{path!r} names the root directory, not a file")
        return v

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, str]) -> dict[str, str]:
        return check_env(v)

    @model_validator(mode="after")
    def _python_for_base(self) -> Template:
        if self.base == "host" and self.python is not None:
            raise ValueError("'python' is only for dir/oci bases (and debian ones): base 'host' uses the host's Python")
        if isinstance(self.base, DirBase | OciBase) and self.python is None:
            raise ValueError("a dir/oci base needs 'python': the interpreter's path inside the image")
        return self


def load_template(path: str | os.PathLike[str]) -> tuple[Template, Path]:
    """Parse and validate a template file; returns it with the directory relative paths start from."""
    p = Path(path)
    try:
        raw = yaml.safe_load(p.read_text())
    except OSError as exc:
        raise InvalidRequest(f"cannot read template {p}: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", exc)
        raise InvalidRequest(f"template {p} is not valid YAML{where}: {problem}") from exc
    if not isinstance(raw, dict):
        raise InvalidRequest(f"template {p} must be a YAML mapping (name:, base:, packages: ...), "
                             f"found {type(raw).__name__}")
    try:
        return Template.model_validate(raw), p.resolve().parent
    except ValidationError as exc:
        raise InvalidRequest(f"template {p} is invalid:\n{describe(exc)}") from None


_UNION_TAGS = ("DirBase", "OciBase", "DebianBase", "literal['host']")


def describe(exc: ValidationError) -> str:
    """One line per problem, each naming the field: ``packages.1: Value error, ...``."""
    lines = []
    for err in exc.errors():
        loc = ".".join(str(part) for part in err["loc"]
                       if not (isinstance(part, str) and part in _UNION_TAGS))
        lines.append(f"  {loc or '(top level)'}: {err['msg']}")
    return "\n".join(dict.fromkeys(lines))
