"""sdcwatch's node agent: config, the asyncio main, gRPC API, health, event journal, metrics, alert sinks, CLI.

Never imported by a training rank; never imports torch (see docs/architecture.md)."""
