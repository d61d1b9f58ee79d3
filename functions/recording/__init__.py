"""Recording: each handled step and sandbox life spooled locally and flushed to the store as Parquet
(steps: rows from events; recorder: the spool and its flush together; spool: rows appended and synced;
flush: segments to Parquet in the store; prices: what a second costs)."""
