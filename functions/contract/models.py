"""The event contract: CloudEvent types and the pydantic models of their data.

Every request is a CloudEvents 1.0 event POSTed to ``/``; every reply (errors included) is a
CloudEvent in the HTTP response. The records the runtime returns (``SandboxInfo``, ``ExecResult``,
``Usage``) and its ``Limits`` / ``ExecRequest`` are reused as they are, so the wire format and the
runtime cannot drift apart.

    request type                    data model       reply type                     reply data
    dev.rollbox.sandbox.create      CreateData       dev.rollbox.sandbox.created    SandboxInfo
    dev.rollbox.sandbox.exec        ExecData         dev.rollbox.sandbox.result     ExecResult
    dev.rollbox.sandbox.run         RunData          dev.rollbox.sandbox.result     ExecResult
    dev.rollbox.sandbox.destroy     DestroyData      dev.rollbox.sandbox.destroyed  Usage
    dev.rollbox.sandbox.snapshot    SnapshotData     dev.rollbox.sandbox.snapshotted SnapshotRecord
    dev.rollbox.sandbox.fork        ForkData         dev.rollbox.sandbox.forked     ForkRecord
    dev.rollbox.episode.annotate    AnnotateData     dev.rollbox.episode.annotated  AnnotateData
    (any, on failure)                                dev.rollbox.error              ErrorData
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Annotated, Any, Final, get_args

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StringConstraints, field_validator, model_validator
from rollbox.runtime.errors import RollboxError
from rollbox.runtime.spec import ExecRequest, ExecResult, Limits, SandboxInfo, Usage

__all__ = [
    "CONTRACT",
    "EPISODE_ANNOTATE",
    "EPISODE_ANNOTATED",
    "ERROR",
    "EVENT_SOURCE",
    "MAX_FORK",
    "PARTITION_KEY",
    "REPLY_CARRIES",
    "SANDBOX_CREATE",
    "SANDBOX_CREATED",
    "SANDBOX_DESTROY",
    "SANDBOX_DESTROYED",
    "SANDBOX_EXEC",
    "SANDBOX_FORK",
    "SANDBOX_FORKED",
    "SANDBOX_ID_PATTERN",
    "SANDBOX_RESULT",
    "SANDBOX_RUN",
    "SANDBOX_SNAPSHOT",
    "SANDBOX_SNAPSHOTTED",
    "AnnotateData",
    "Case",
    "Conflict",
    "CreateData",
    "DestroyData",
    "ErrorCode",
    "ErrorData",
    "EventSpec",
    "ExecData",
    "ExecRequest",
    "ExecResult",
    "ForkData",
    "ForkRecord",
    "Limits",
    "Outcome",
    "RunData",
    "SandboxInfo",
    "SnapshotData",
    "SnapshotRecord",
    "Usage",
]

PREFIX: Final = "dev.rollbox."
SANDBOX_CREATE: Final = "dev.rollbox.sandbox.create"
SANDBOX_CREATED: Final = "dev.rollbox.sandbox.created"
SANDBOX_EXEC: Final = "dev.rollbox.sandbox.exec"
SANDBOX_RUN: Final = "dev.rollbox.sandbox.run"
SANDBOX_RESULT: Final = "dev.rollbox.sandbox.result"
SANDBOX_DESTROY: Final = "dev.rollbox.sandbox.destroy"
SANDBOX_DESTROYED: Final = "dev.rollbox.sandbox.destroyed"
SANDBOX_SNAPSHOT: Final = "dev.rollbox.sandbox.snapshot"
SANDBOX_SNAPSHOTTED: Final = "dev.rollbox.sandbox.snapshotted"
SANDBOX_FORK: Final = "dev.rollbox.sandbox.fork"
SANDBOX_FORKED: Final = "dev.rollbox.sandbox.forked"
EPISODE_ANNOTATE: Final = "dev.rollbox.episode.annotate"
EPISODE_ANNOTATED: Final = "dev.rollbox.episode.annotated"
ERROR: Final = "dev.rollbox.error"

# The `source` attribute of every reply this service sends (a URI-reference, as CloudEvents asks).
EVENT_SOURCE: Final = "/rollbox/functions"

# Extension attributes a reply carries over from its request (Knative Eventing through a Broker):
# the CloudEvents Partitioning extension (the client sets it to the sandbox id: one Kafka partition,
# so ordered delivery, per sandbox) as is, and a RequestReply's correlation id as its reply attribute.
PARTITION_KEY: Final = "partitionkey"
CORRELATION_ID: Final = "correlationid"  # RequestReply spec.correlationAttribute (knative/overlays/kafka)
REPLY_ID: Final = "replyid"  # RequestReply spec.replyAttribute
REPLY_CARRIES: Final = ((PARTITION_KEY, PARTITION_KEY), (CORRELATION_ID, REPLY_ID))

# ASCII letters, digits and _.:- only (no control, DEL or non-ASCII characters: ids travel in headers)
SANDBOX_ID_PATTERN: Final = r"[A-Za-z0-9][A-Za-z0-9_.:-]*"
SandboxId = Annotated[
    str, StringConstraints(min_length=1, max_length=128, pattern=rf"^{SANDBOX_ID_PATTERN}$")
]
SnapshotRef = Annotated[
    str, StringConstraints(min_length=1, max_length=256, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.:@/+-]*$")
]
SnapshotName = Annotated[
    str, StringConstraints(min_length=1, max_length=128, pattern=r"^[a-z0-9][a-z0-9._-]*$")
]
MAX_METADATA_ITEMS: Final = 32
MAX_FORK: Final = 64


def _numeric(annotation: Any) -> bool:
    return annotation in (int, float) or any(_numeric(a) for a in get_args(annotation))


def _textual(annotation: Any) -> bool:
    return annotation is str or any(_textual(a) for a in get_args(annotation))


def _nested_model(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return next((m for a in get_args(annotation) if (m := _nested_model(a)) is not None), None)


def _refuse_bools(model: type[BaseModel], data: Any, prefix: str = "") -> Any:
    """JSON true/false and strings are not numbers (pydantic would take ``timeout_s: true`` as 1 s and
    ``reward: "1"`` as 1.0): refuse a boolean or a string given for any numeric field, nested models
    (``limits``) included, naming the field."""
    if not isinstance(data, dict):
        return data
    for name, field in model.model_fields.items():
        if name not in data:
            continue
        value = data[name]
        if isinstance(value, bool) and _numeric(field.annotation):
            raise ValueError(f"'{prefix}{name}' must be a number, not a boolean ({str(value).lower()})")
        if isinstance(value, str) and _numeric(field.annotation) and not _textual(field.annotation):
            raise ValueError(f"'{prefix}{name}' must be a number, not a string ({value[:40]!r})")
        nested = _nested_model(field.annotation)
        if nested is not None:
            _refuse_bools(nested, value, f"{prefix}{name}.")
    return data


class _StrictNumbers(BaseModel):
    @model_validator(mode="before")
    @classmethod
    def _no_bools(cls, data: Any) -> Any:
        return _refuse_bools(cls, data)


NAME_MAX: Final = 255  # bytes in one path component (Linux NAME_MAX)


def _check_file_names(data: Any) -> Any:
    """A file name (one component of a ``files`` or ``read_files`` path) longer than the kernel takes
    is refused here, naming the file, not when the sandbox tries to write it."""
    if not isinstance(data, dict):
        return data
    for field in ("files", "read_files"):
        paths = data.get(field)
        if not isinstance(paths, dict | list):
            continue
        for path in paths:
            if not isinstance(path, str):
                continue
            for part in path.split("/"):
                size = len(part.encode("utf-8", "surrogatepass"))
                if size > NAME_MAX:
                    raise ValueError(f"{field}: file name {part[:40]!r}... of {path[:80]!r} is {size} bytes; "
                                     f"a file name is at most {NAME_MAX} bytes")
    return data


class _ExecChecks(_StrictNumbers):
    @model_validator(mode="before")
    @classmethod
    def _file_names(cls, data: Any) -> Any:
        return _check_file_names(data)


class _Data(_StrictNumbers):
    model_config = ConfigDict(frozen=True, extra="forbid")


def _check_pairs(what: str) -> Callable[[dict[str, str]], dict[str, str]]:
    """A validator of string labels (``metadata``, an outcome's ``labels``): bounded count and sizes."""
    def check(v: dict[str, str]) -> dict[str, str]:
        if len(v) > MAX_METADATA_ITEMS:
            raise ValueError(f"at most {MAX_METADATA_ITEMS} {what} items, got {len(v)}")
        for k, val in v.items():
            for text in (k, val):
                try:
                    text.encode("utf-8")
                except UnicodeEncodeError as exc:  # a JSON escape such as \ud800: not storable text
                    raise ValueError(f"{what} key {k[:64]!r}: not valid UTF-8: lone surrogate at position "
                                     f"{exc.start} of the {'key' if text is k else 'value'}") from None
            if not 0 < len(k) <= 64 or len(val) > 1024:
                raise ValueError(f"{what} key {k[:64]!r}: keys are 1-64 chars, values at most 1024 chars")
        return v
    return check


_check_metadata = _check_pairs("metadata")
_check_labels = _check_pairs("labels")


class CreateData(_Data):
    """``dev.rollbox.sandbox.create``: a sandbox restored from ``snapshot``. Limits not given take the
    snapshot's defaults; ``timeout_s`` is the sandbox lifetime (shorthand for ``limits.lifetime_s``)."""

    snapshot: SnapshotRef = "python"
    timeout_s: Annotated[float, Field(gt=0, le=7 * 24 * 3600)] | None = None
    limits: Limits | None = None
    metadata: dict[str, str] = Field(
        default_factory=dict, description="free labels: experiment, episode, ... (logged, billed)"
    )
    include_isolation: StrictBool = Field(
        default=False, description="the reply carries the full isolation report (~2.5 KB); by default only its "
                                   "one-line `isolation_summary`")

    _metadata = field_validator("metadata")(_check_metadata)

    @model_validator(mode="after")
    def _timeout(self) -> CreateData:
        if (
            self.timeout_s is not None
            and self.limits is not None
            and "lifetime_s" in self.limits.model_fields_set
        ):
            raise ValueError("give the lifetime once: 'timeout_s' or 'limits.lifetime_s', not both")
        return self

    def effective_limits(self) -> dict[str, Any] | None:
        """The limits given, as changes to the snapshot's defaults (fields not given keep those)."""
        given = self.limits.model_dump(exclude_unset=True) if self.limits is not None else {}
        if self.timeout_s is not None:
            given["lifetime_s"] = self.timeout_s
        return given or None


def _as_exec_request(data: ExecRequest) -> ExecRequest:
    """The ``ExecRequest`` part of an event's data (a subclass): its fields were validated as the
    event's data was, by the same model, so they are copied, not dumped and validated again."""
    names = ExecRequest.model_fields.keys()
    return ExecRequest.model_construct(data.model_fields_set & names, **{k: getattr(data, k) for k in names})


class ExecData(ExecRequest, _ExecChecks):
    """``dev.rollbox.sandbox.exec``: one step in the live sandbox ``sandbox_id``."""

    sandbox_id: SandboxId

    def exec_request(self) -> ExecRequest:
        return _as_exec_request(self)


class Case(_Data):
    """One test case of a run with ``cases``: its stdin and, optionally, the stdout that passes it."""

    stdin: str | None = None
    expected_stdout: str | None = None


class RunData(ExecRequest, _ExecChecks):
    """``dev.rollbox.sandbox.run``: create + exec + destroy in one event. ``timeout_s`` bounds the exec.
    With ``language``, ``code`` is a program in that language (docs/languages.md): compiled (once per
    source: cached) within ``compile_timeout_s``, then run within ``timeout_s``, in the language's snapshot."""

    snapshot: SnapshotRef = "python"
    limits: Limits | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    language: Annotated[str, StringConstraints(min_length=1, max_length=64)] | None = Field(
        default=None, description="a language of SandboxFusion's list (snapshots/languages.py); `code` is its source")
    compile_timeout_s: Annotated[float, Field(gt=0, le=3600)] | None = Field(
        default=None, description="with language: the compile step's timeout (default 10)")
    cases: Annotated[list[Case], Field(min_length=1, max_length=256)] | None = Field(
        default=None, description="run the program once per case (its stdin; timeout_s each) in one sandbox, each "
        "case in a fresh copy of the home; with language, compiled once first; without, `code` (Python) or "
        "`command` in `snapshot`")

    _metadata = field_validator("metadata")(_check_metadata)

    @model_validator(mode="after")
    def _language(self) -> RunData:
        if self.cases is not None and self.stdin is not None:
            raise ValueError("with 'cases' each case has its stdin: give 'stdin' in the cases")
        if self.language is None:  # (cases alone: `code` or `command` runs once per case, as a plain run)
            if self.compile_timeout_s is not None:
                raise ValueError("compile_timeout_s is for a run with 'language' (nothing is compiled otherwise)")
            return self
        from rollbox.snapshots import languages

        try:
            languages.language(self.language)
        except languages.UnsupportedLanguage as exc:
            raise ValueError(exc.message) from None
        if self.code is None:
            raise ValueError("with 'language', 'code' is the program's source ('command' is not used)")
        if "snapshot" in self.model_fields_set:
            raise ValueError("with 'language' the language's snapshot runs it: give 'language' or 'snapshot'")
        return self

    def exec_request(self) -> ExecRequest:
        return _as_exec_request(self)


class Outcome(_Data):
    """What a trainer scored: recorded with the episode's steps (trajectories), never used by rollbox."""

    reward: float | None = Field(default=None, allow_inf_nan=False)
    labels: dict[str, str] = Field(default_factory=dict)

    _labels = field_validator("labels")(_check_labels)


class DestroyData(_Data):
    """``dev.rollbox.sandbox.destroy``: end the sandbox and bill it. Repeating it returns the same usage.
    ``outcome``: the episode's reward and labels, recorded with its steps."""

    sandbox_id: SandboxId
    outcome: Outcome | None = None


class AnnotateData(_Data):
    """``dev.rollbox.episode.annotate``: attach an outcome to an episode at any time (recorded as a row
    of its trajectory; the reply echoes it)."""

    experiment: Annotated[str, StringConstraints(min_length=1, max_length=1024)] | None = None
    episode: Annotated[str, StringConstraints(min_length=1, max_length=1024)]
    reward: float | None = Field(default=None, allow_inf_nan=False)
    labels: dict[str, str] = Field(default_factory=dict)

    _labels = field_validator("labels")(_check_labels)

    @model_validator(mode="after")
    def _something(self) -> AnnotateData:
        if self.reward is None and not self.labels:
            raise ValueError("give a 'reward', 'labels', or both")
        return self


class SnapshotData(_Data):
    """``dev.rollbox.sandbox.snapshot``: checkpoint the live sandbox ``sandbox_id`` (its filesystem diff
    becomes a layer over its snapshot's layers) into the service's store, under ``name`` if given."""

    sandbox_id: SandboxId
    name: SnapshotName | None = Field(
        default=None, description="also point this name at the new snapshot ([a-z0-9._-], not an id)"
    )

    @field_validator("name")
    @classmethod
    def _not_an_id(cls, v: str | None) -> str | None:
        if v is not None and len(v) == 64 and all(c in "0123456789abcdef" for c in v):
            raise ValueError("a name must not be 64 hex digits (that is a snapshot id)")
        return v


class SnapshotRecord(_Data):
    """``dev.rollbox.sandbox.snapshotted``: the new snapshot, a child of ``parent_id`` in the tree."""

    snapshot_id: str = Field(description="sha256 of the new manifest; create or fork from it anywhere")
    parent_id: str | None = Field(description="the snapshot the sandbox was restored from (None: built-in)")
    sandbox_id: str
    name: str | None = None
    layer_id: str = Field(description="sha256 of the layer holding the sandbox's diff")
    layer_bytes: int = Field(description="size of that layer's tar")
    size_bytes: int = Field(description="size of all the snapshot's layers")
    env_version: dict[str, Any] = Field(description="the VERSION block, the parent's")
    store: str = Field(description="where it was stored: the local store, or the S3 URL it was pushed to")
    checkpoint_ms: float = Field(description="time the sandbox was held still while its diff was read")
    total_ms: float


class ForkData(_Data):
    """``dev.rollbox.sandbox.fork``: ``count`` new sandboxes from exactly one of a live sandbox
    (``sandbox_id``: they see its files as they are now and inherit its limits) or a snapshot."""

    sandbox_id: SandboxId | None = None
    snapshot: SnapshotRef | None = None
    count: Annotated[int, Field(ge=1, le=MAX_FORK)] = 1
    limits: Limits | None = Field(default=None, description="only with snapshot; a live fork keeps its parent's")
    metadata: dict[str, str] = Field(default_factory=dict, description="default: the parent's, for a live fork")
    include_isolation: StrictBool = Field(
        default=False, description="each new sandbox's record carries its full isolation report (~2.5 KB); by "
                                   "default only its one-line `isolation_summary`")

    _metadata = field_validator("metadata")(_check_metadata)

    @model_validator(mode="after")
    def _one_source(self) -> ForkData:
        if (self.sandbox_id is None) == (self.snapshot is None):
            raise ValueError("give exactly one of 'sandbox_id' (a live sandbox) or 'snapshot' (a name or id)")
        if self.sandbox_id is not None and self.limits is not None:
            raise ValueError("'limits' apply to a fork from a snapshot; the forks of a live sandbox keep its limits")
        return self


class ForkRecord(_Data):
    """``dev.rollbox.sandbox.forked``: the new sandboxes, in no particular order."""

    sandbox_id: str | None = Field(description="the live sandbox forked, if any")
    snapshot_id: str = Field(description="the snapshot the forks were restored from (a live fork: its parent's)")
    sandboxes: list[SandboxInfo]
    fork_ms: float


class ErrorCode(enum.StrEnum):
    """The ``code`` of an error reply (its value: stable, for programs), and what goes with it: the
    HTTP ``status`` it is sent with, whether a retry of the same event may succeed (``retryable``:
    the client retries it) and the client's exception class (``client_class``, a name in
    ``rollbox.functions.client``). The service's replies (``ERROR_TABLE``, ``ReplyError``), the
    client's ``ERROR_CLASSES`` and README's error table all follow this enum (tests check each)."""

    status: int
    retryable: bool
    client_class: str

    def __new__(cls, code: str, status: int, retryable: bool, client_class: str) -> ErrorCode:
        member = str.__new__(cls, code)
        member._value_ = code
        member.status = status
        member.retryable = retryable
        member.client_class = client_class
        return member

    INVALID_EVENT = ("invalid_event", 400, False, "InvalidEventError")  # not a valid CloudEvent (specversion, id…)
    INVALID_DATA = ("invalid_data", 400, False, "InvalidDataError")  # the data does not match the type's model
    UNKNOWN_TYPE = ("unknown_type", 400, False, "UnknownTypeError")
    SANDBOX_NOT_FOUND = ("sandbox_not_found", 404, False, "SandboxNotFoundError")
    SNAPSHOT_NOT_FOUND = ("snapshot_not_found", 404, False, "SnapshotNotFoundError")
    NOT_FOUND = ("not_found", 404, False, "EndpointNotFoundError")  # no such HTTP path
    METHOD_NOT_ALLOWED = ("method_not_allowed", 405, False, "MethodNotAllowedError")
    # the headers or body stopped arriving; nothing ran
    REQUEST_TIMEOUT = ("request_timeout", 408, True, "RequestTimeoutError")
    # same (source, id), different event
    IDEMPOTENCY_CONFLICT = ("idempotency_conflict", 409, False, "IdempotencyConflictError")
    # with Retry-After: another replica committed a step first
    SANDBOX_BUSY = ("sandbox_busy", 409, True, "SandboxBusyError")
    SANDBOX_GONE = ("sandbox_gone", 410, False, "SandboxGoneError")  # destroyed or expired (lifetime, idle)
    SANDBOX_DIED = ("sandbox_died", 410, False, "SandboxDiedError")  # the sandbox ended while in use
    PAYLOAD_TOO_LARGE = ("payload_too_large", 413, False, "PayloadTooLargeError")
    HEADERS_TOO_LARGE = ("headers_too_large", 431, False, "HeadersTooLargeError")  # the header section over the cap
    # valid, but not servable here (a process-image snapshot)
    UNSUPPORTED = ("unsupported", 422, False, "UnsupportedError")
    UNSUPPORTED_MEDIA_TYPE = ("unsupported_media_type", 415, False, "UnsupportedMediaTypeError")
    OVERLOADED = ("overloaded", 429, True, "OverloadedError")  # with Retry-After
    INTERNAL = ("internal", 500, False, "InternalError")  # no host details
    SHUTTING_DOWN = ("shutting_down", 503, True, "ShuttingDownError")  # with Retry-After
    # with Retry-After: snapshot store outage
    STORE_UNAVAILABLE = ("store_unavailable", 503, True, "StoreUnavailableError")
    # an object failed its sha256 check; it was not used
    STORE_CORRUPT = ("store_corrupt", 502, False, "StoreCorruptError")
    STORE_ERROR = ("store_error", 502, False, "StoreError")  # the store refused (credentials, missing bucket, ...)
    # with Retry-After: a disk of this server is full
    INSUFFICIENT_STORAGE = ("insufficient_storage", 507, True, "InsufficientStorageError")


class Conflict(RollboxError):
    """Same (source, id) as an earlier event, different content (here, or recorded in a sandbox's
    durable state by another replica): ``idempotency_conflict``.

    The functions' exceptions extend the runtime's tree (``rollbox.runtime.errors``), one root:

        RollboxError
        ├── ...                     the runtime's (InvalidRequest, SandboxNotFound, StoreError, ...)
        ├── Conflict                an event id reused for other content (here)
        ├── ReplyError              a request answered with an error event (contract.events)
        ├── ConfigError             a flag or environment variable that cannot be used (config.options)
        ├── InsufficientStorage     a disk of this server is full (service.admission)
        ├── Rejected                admission refused the request (service.admission)
        └── KnativeError            the Kubernetes API (cli.knative)
    """


class ErrorData(_Data):
    """``dev.rollbox.error``: what went wrong, and how to fix it."""

    code: str = Field(description="one of ErrorCode's values; stable, for programs")
    message: str = Field(description="for people: names the field or limit and what to do")
    details: dict[str, Any] = Field(default_factory=dict)


class EventSpec(BaseModel):
    """One request type of the contract: its data model, its reply type and reply data model."""

    model_config = ConfigDict(frozen=True)

    request_type: str
    data: type[BaseModel]
    reply_type: str
    reply: type[BaseModel]


CONTRACT: Final[tuple[EventSpec, ...]] = (
    EventSpec(request_type=SANDBOX_CREATE, data=CreateData, reply_type=SANDBOX_CREATED, reply=SandboxInfo),
    EventSpec(request_type=SANDBOX_EXEC, data=ExecData, reply_type=SANDBOX_RESULT, reply=ExecResult),
    EventSpec(request_type=SANDBOX_RUN, data=RunData, reply_type=SANDBOX_RESULT, reply=ExecResult),
    EventSpec(request_type=SANDBOX_DESTROY, data=DestroyData, reply_type=SANDBOX_DESTROYED, reply=Usage),
    EventSpec(
        request_type=SANDBOX_SNAPSHOT, data=SnapshotData, reply_type=SANDBOX_SNAPSHOTTED, reply=SnapshotRecord
    ),
    EventSpec(request_type=SANDBOX_FORK, data=ForkData, reply_type=SANDBOX_FORKED, reply=ForkRecord),
    EventSpec(request_type=EPISODE_ANNOTATE, data=AnnotateData, reply_type=EPISODE_ANNOTATED, reply=AnnotateData),
)
