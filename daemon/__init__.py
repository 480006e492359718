"""sdcwatch's node agent: gRPC API, health, event journal, metrics, CLI and the training-side clients."""

__version__ = "0.1.0"
