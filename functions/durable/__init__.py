"""Durable sandboxes: the store is the truth, a replica's live sandboxes are a cache of it.

runtime.py (DurableRuntime: the API, a step on a sandbox's newest state), store.py (StateStore:
records, blobs), residency.py (Residency: live copies, make-room, hibernate, sweep), generations.py
(Generations: commit a step, resume a generation), capacity.py (LiveCap: the replica's one live cap),
metrics.py."""
