"""The names a rank puts on its step reports (job id, host, GPU UUID, replica group), and the one rule for
each that both sides apply: the agent refuses a report whose name breaks it (daemon.validation: names from
clients never become paths unchecked), and the rank library refuses the name when it is given
(`Monitor.attach`, through `sdcwatch.arguments.wire_name`), with the same words, instead of training on
with every report refused. Pure."""

from __future__ import annotations

import dataclasses
import re


@dataclasses.dataclass(frozen=True, slots=True)
class Rule:
    """A kind of name: its pattern, and what a name that breaks it is (for the message)."""

    pattern: re.Pattern[str]
    broken: str

    def problem(self, what: str, name: str) -> str | None:
        """None when `name` keeps the rule (or is empty), else `what`, the name and the rule broken."""
        if not name or self.pattern.fullmatch(name):   # fullmatch: '$' would let a final newline in
            return None
        return f"{what} {name[:64]!r} {self.broken}"


# a job id also names the job's checkpoints (checkpoint.names: a store key's first segment, a directory of a
# file tier, a Redis hash tag), so both sides take it by this rule: none of its characters is special in a
# path, a URL path (S3 keys are quoted), a Redis key or a glob
JOB_ID = Rule(re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._:@+=-]{0,127}$"),
              "is invalid: 1-128 characters from A-Z a-z 0-9 . _ : @ + = -, starting with a letter, digit or _")
HOST = Rule(re.compile(r"^[A-Za-z0-9]([A-Za-z0-9.\-_]{0,252})?$"), "is not a hostname")
GPU_UUID = Rule(re.compile(r"^(GPU|MIG)-[0-9A-Za-z\-/]{1,90}$"), "is not a GPU UUID (GPU-... or MIG-...)")
# a replica group: the Monitor names one "world", "ranks:0,2,4,6" (up to 16 ranks), or
# "ranks:0..120#16:<sha1, 12 hex>" (checksums.monitor._group_name); a job may name its own
GROUP = Rule(re.compile(r"^[A-Za-z0-9._:@+=/,#-]{0,128}$"),
             "is invalid: up to 128 characters from A-Z a-z 0-9 . _ : @ + = / , # -")
