"""The wire contract: event types and data models (models), CloudEvents over HTTP (events), the
recorded rows (records) and their published JSON Schemas (schemas, schemas/*.json). Imports nothing
else of rollbox.functions."""
