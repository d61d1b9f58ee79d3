"""rollbox.functions: the CloudEvent functions over the runtime, one subpackage per concern.

Nothing is exported here; a trainer imports the client (``rollbox.functions.client``), the command is
``python -m rollbox.functions.cli`` (``rollbox``). The subpackages, lowest layer first (none imports
one after it, except that the client uses only the contract):

    config      options mirrored by environment variables; which snapshot store to open
    contract    the wire contract: event types, data models, recorded rows, JSON Schemas
    recording   each step and sandbox life spooled, then flushed to the store as Parquet
    durable     durable sandboxes: the store is the truth, live sandboxes a cache of it
    handlers    the event families (sandbox, snapshot, episode) and their routing
    service     the HTTP service: the CloudEvent function, `rollbox serve`, admission, idempotency
    cli         the `rollbox` command and its subcommands
    analysis    offline reading of what was recorded: trajectories, cost report, replay
    client      the async client a trainer imports (speaks the contract only)
"""

__all__: list[str] = []
