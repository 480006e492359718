"""GPU and training signals: NVML probe, XID catalog, GPU state rules, canaries, loss detector.

Everything here is importable without a GPU, without NVML and without the agent. Detectors and
rules are pure: they take samples and the current time and return verdicts.
"""
