"""rollbox's exception tree (one root, context on every error).

    RollboxError
    ├── InvalidRequest          a spec or request that cannot be honoured (names the field)
    ├── SandboxNotFound         no live sandbox has that id (carries sandbox_id)
    │   └── SandboxGone         it existed and was destroyed or expired (durable state says so)
    ├── SandboxBusy             another replica committed a step of it first; retry
    ├── SandboxDied             the sandbox ended while in use (carries sandbox_id, reason)
    ├── SnapshotNotFound        no snapshot by that name or id (carries snapshot_id)
    ├── Overloaded              admission control refused the work (carries retry_after_s)
    ├── ShuttingDown            the runtime or server is closing (or not started): retry elsewhere
    ├── Unsupported             a valid request this runtime cannot serve (a process-image snapshot)
    ├── IsolationError          a required isolation layer could not be applied (names the syscall)
    └── StoreError              a snapshot store failed (carries snapshot_id, layer_id)
        ├── StoreUnavailable    the store cannot be reached now (outage); retrying later may succeed
        └── IntegrityError      content does not match its sha256 or is unsafe; it was never used

(functions/cli/knative.py adds KnativeError(RollboxError) for the Kubernetes API, converted there;
functions/service/idempotency.py adds Conflict(RollboxError): an event id reused for other content.
functions/service/app.py's ERROR_TABLE answers each of them with one HTTP status and code.)

Third-party errors are converted once, at the boundary that calls them (``raise ... from exc``).
"""

from __future__ import annotations


class RollboxError(Exception):
    """Root of every error rollbox raises on purpose."""

    def __init__(self, message: str, *, sandbox_id: str | None = None, snapshot_id: str | None = None):
        super().__init__(message)
        self.message = message
        self.sandbox_id = sandbox_id
        self.snapshot_id = snapshot_id


class InvalidRequest(RollboxError):
    """The request or spec is invalid; the message names the field."""


class SandboxNotFound(RollboxError):
    """No live sandbox has this id (never existed, destroyed, or expired)."""


class SandboxGone(SandboxNotFound):
    """The sandbox was destroyed or expired (lifetime, idle); its durable state says so."""

    def __init__(self, message: str, *, reason: str = "destroyed", **kw: str | None):
        super().__init__(message, **kw)
        self.reason = reason


class SandboxBusy(RollboxError):
    """Another replica committed a step of this sandbox first (or holds it mid-step): nothing of this
    request was kept; retrying it runs it on the sandbox's newest state."""


class SandboxDied(RollboxError):
    """The sandbox ended while it was being used (killed, lifetime over, supervisor lost it).
    ``ran`` is False when the request never reached it (so retrying elsewhere cannot run it twice)."""

    def __init__(self, message: str, *, ran: bool = True, **kw: str | None):
        super().__init__(message, **kw)
        self.ran = ran


class SnapshotNotFound(RollboxError):
    """No snapshot is known by this name or id."""


class Overloaded(RollboxError):
    """Admission control refused the work; retry after ``retry_after_s``."""

    def __init__(self, message: str, *, retry_after_s: float = 1.0, **kw: str | None):
        super().__init__(message, **kw)
        self.retry_after_s = retry_after_s


class ShuttingDown(RollboxError):
    """The runtime or the server is closing (or not started yet): nothing was done; retry on another
    replica, after ``retry_after_s`` if given."""

    def __init__(self, message: str, *, retry_after_s: float | None = None, **kw: str | None):
        super().__init__(message, **kw)
        self.retry_after_s = retry_after_s


class Unsupported(RollboxError):
    """A valid request this runtime cannot serve here (a snapshot kind it cannot restore)."""


class IsolationError(RollboxError):
    """A required isolation layer failed; the message names the syscall or file."""


class StoreError(RollboxError):
    """A snapshot store (local directory or S3) failed; the message names the object and the cause."""

    def __init__(self, message: str, *, layer_id: str | None = None, **kw: str | None):
        super().__init__(message, **kw)
        self.layer_id = layer_id


class StoreUnavailable(StoreError):
    """The store could not be reached (connection refused, timeout, 5xx after retries)."""


class IntegrityError(StoreError):
    """A layer or manifest did not match its sha256, was truncated, or held an unsafe entry."""
