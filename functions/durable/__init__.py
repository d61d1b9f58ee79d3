"""Durable sandboxes: the store is the truth, a replica's live sandboxes are a cache of it."""
