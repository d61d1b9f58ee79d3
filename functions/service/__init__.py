"""The HTTP service: the CloudEvent function (app), `rollbox serve` (server), admission,
idempotency, metrics and logs."""
