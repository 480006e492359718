"""The training side of `sdcwatch demo`: the small GPT, its corpus, the fault injector and one
data-parallel rank (`python -m demo.worker SPEC.json`).

Torch code, started as processes by the `sdcwatch demo` command (daemon/cli_demo.py): the agent and its
CLI never import this package, and this package never imports the agent (`daemon`); it trains through the
training-side library (checksums.monitor, checkpoint.client) like any user job.
"""
