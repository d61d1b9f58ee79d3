"""Recording: each handled step and sandbox life spooled locally and flushed to the store as Parquet
(steps: rows from events; recorder: spool and flush; prices: what a second costs)."""
