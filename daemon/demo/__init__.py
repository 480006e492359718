"""`sdcwatch demo`, the command's side: the live display, the report and the fake NVML scenario.

The training ranks are the top-level `demo` package, started as processes (`python -m demo.worker`);
nothing here imports torch.
"""
