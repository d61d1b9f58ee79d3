"""The client a trainer imports: ``from rollbox.functions.client import Client, Sandbox``.

    Client          a connection to one rollbox service, with one connection pool: ``run`` (one-shot),
                    ``create``, ``fork``, ``snapshot``; share one between concurrent episodes
    Sandbox         a live sandbox (E2B-shaped): ``Sandbox.create(url | client)``, ``exec``, ``snapshot``,
                    ``fork``, ``kill``; ``async with`` kills it on exit; it sends through its client's pool
The records it takes and returns (the runtime's and the contract's models):
    Limits          the limits asked for a sandbox (only those given replace the snapshot's own)
    ExecResult      a step's result: ``exit_code``, ``stdout``, ``stderr``, ``timed_out``, ``files``, ...
    SandboxInfo     ``Sandbox.info``: id, snapshot, limits, isolation summary
    Usage           what ``kill()`` returns: the sandbox's bill
    SnapshotRecord  what ``snapshot()`` returns: ``snapshot_id``, ``parent_id``, ``layer_id``, ...
The errors: ``ClientError`` and its tree, one class per error code (``ERROR_CLASSES``), drawn in http.py.
Speaks the wire contract (rollbox.functions.contract) and nothing else of the server.
"""

from rollbox.functions.client.http import (
    ERROR_CLASSES,
    Client,
    ClientError,
    CommandExitError,
    EndpointNotFoundError,
    HeadersTooLargeError,
    IdempotencyConflictError,
    InsufficientStorageError,
    InternalError,
    InvalidDataError,
    InvalidEventError,
    InvalidRequestError,
    MethodNotAllowedError,
    NotFoundError,
    OverloadedError,
    PayloadTooLargeError,
    RequestTimeoutError,
    Sandbox,
    SandboxBusyError,
    SandboxDiedError,
    SandboxGoneError,
    SandboxNotFoundError,
    ServiceError,
    ShuttingDownError,
    SnapshotNotFoundError,
    StoreCorruptError,
    StoreError,
    StoreUnavailableError,
    TransportError,
    UnknownTypeError,
    UnsupportedError,
    UnsupportedMediaTypeError,
)
from rollbox.functions.contract.models import SnapshotRecord
from rollbox.runtime.spec import ExecResult, Limits, SandboxInfo, Usage

__all__ = [
    "ERROR_CLASSES",
    "Client",
    "ClientError",
    "CommandExitError",
    "EndpointNotFoundError",
    "ExecResult",
    "HeadersTooLargeError",
    "IdempotencyConflictError",
    "InsufficientStorageError",
    "InternalError",
    "InvalidDataError",
    "InvalidEventError",
    "InvalidRequestError",
    "Limits",
    "MethodNotAllowedError",
    "NotFoundError",
    "OverloadedError",
    "PayloadTooLargeError",
    "RequestTimeoutError",
    "Sandbox",
    "SandboxBusyError",
    "SandboxDiedError",
    "SandboxGoneError",
    "SandboxInfo",
    "SandboxNotFoundError",
    "ServiceError",
    "ShuttingDownError",
    "SnapshotNotFoundError",
    "SnapshotRecord",
    "StoreCorruptError",
    "StoreError",
    "StoreUnavailableError",
    "TransportError",
    "UnknownTypeError",
    "UnsupportedError",
    "UnsupportedMediaTypeError",
    "Usage",
]
