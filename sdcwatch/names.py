"""The names a rank puts on its step reports (job id, host, GPU UUID, replica group), and the one rule for
each that both sides apply: the agent refuses a report whose name breaks it (daemon.validation: names from
clients never become paths unchecked), and the rank library refuses the name when it is given
(`Monitor.attach`), with the same words, instead of training on with every report refused. Pure."""

from __future__ import annotations

import re

JOB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@+=-]{0,127}$")
HOST = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9.\-_]{0,252})?$")
GPU_UUID = re.compile(r"^(GPU|MIG)-[0-9A-Za-z\-/]{1,90}$")
# a replica group: the Monitor names one "world", "ranks:0,2,4,6" (up to 16 ranks), or
# "ranks:0..120#16:<sha1, 12 hex>" (checksums.monitor._group_name); a job may name its own
GROUP = re.compile(r"^[A-Za-z0-9._:@+=/,#-]{0,128}$")

JOB_ID_RULE = "is invalid: 1-128 characters from A-Z a-z 0-9 . _ : @ + = -, starting with a letter or digit"
HOST_RULE = "is not a hostname"
GPU_UUID_RULE = "is not a GPU UUID (GPU-... or MIG-...)"
GROUP_RULE = "is invalid: up to 128 characters from A-Z a-z 0-9 . _ : @ + = / , # -"


def problem(what: str, name: str, pattern: re.Pattern[str], rule: str) -> str | None:
    """None when `name` keeps `pattern` (or is empty), else `what`, the name and the rule broken."""
    if not name or pattern.match(name):
        return None
    return f"{what} {name[:64]!r} {rule}"
