"""Orchestration: the controller's bookkeeping for rollout work (leases, retries, checkpointable queues)."""
