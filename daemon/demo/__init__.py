"""`sdcwatch demo`: a real small training run with the agent, injected faults, detection and rollback."""
