"""The event families (sandbox, snapshot, episode) and the seam they plug into (routing)."""
