"""The training side's checks: exact tensor fingerprints, the Monitor and its step reporter, the replica
vote, the known-answer GEMM canaries.

Import the modules by name (`from checksums.fingerprint import fingerprint_tensor`,
`from checksums.monitor import Monitor`): this package's `__init__` imports nothing, so the agent can use
the torch-free modules (`checksums.fingerprint_host`, the spec and its numpy path) without loading torch.
"""
