"""Settings shared by the commands and the service: options mirrored by environment variables, and
which snapshot store to open."""
