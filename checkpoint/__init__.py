"""Verified in-memory checkpoints coordinated in Redis (see docs/checkpoints.md)."""
