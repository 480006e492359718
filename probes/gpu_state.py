"""A GPU's state, derived by a pure function from its evidence, by the rule table `RULES`.

Evidence arrives from every source (nvml, canary, replica_vote, operator, ...). Each piece says what it
implies on its own (`Evidence.implies`); the rule table says how long it holds (`Clears`):

- READING: a current reading, replaced by the next poll's reading of the same signal;
- WINDOW: holds while it is recent (`Evidence.expires`, or the XID windows below);
- RESET_AND_CANARY: holds until a GPU reset is seen after it *and* a canary passes after that reset; with
  the reset seen but no pass yet the GPU is SUSPECT ("awaiting a passing canary");
- OPERATOR: holds until replaced by newer evidence of the same key, its `expires`, or an operator clear.

XIDs are counted per XID number in windows and by last-seen time (repeats are never hidden): application
XIDs make the GPU SUSPECT only when they repeat; hardware XIDs imply their catalog state and escalate to
FAILED when they repeat within a day. Nothing latches forever: every row names the evidence that clears it,
and an operator clear (`sdcwatch gpu clear UUID`) drops everything that is not HEALTHY.

The same table is in docs/gpu-state-rules.md; tests/test_gpu_state.py tests it row by row.
Pure: no clock and no I/O; `now` is passed in (the agent's clock, the same one that stamps evidence).
"""
from __future__ import annotations

import bisect
import dataclasses
import enum
from collections import deque
from typing import Iterable

from probes import xid_catalog
from sdcwatch.types import Evidence, State, worst


class Clears(str, enum.Enum):
    READING = "READING"
    WINDOW = "WINDOW"
    RESET_AND_CANARY = "RESET_AND_CANARY"
    OPERATOR = "OPERATOR"


@dataclasses.dataclass(frozen=True, slots=True)
class StateRule:
    """One row of the rule table. `signal` is exact, or a prefix when it ends with '*'."""

    id: str
    source: str
    signal: str
    condition: str
    implies: str
    clears: Clears
    cleared_by: str

    def matches(self, ev: Evidence) -> bool:
        if self.source not in ("*", ev.source):
            return False
        if self.signal.endswith("*"):
            return ev.signal.startswith(self.signal[:-1])
        return ev.signal == self.signal


R = StateRule
RC = "a GPU reset seen after it, then a passing canary after the reset (SUSPECT in between); operator clear"

#: The rule table (first match wins). Mirrored in docs/gpu-state-rules.md.
RULES: tuple[StateRule, ...] = (
    R("no_evidence", "", "", "no evidence from any source", "UNKNOWN", Clears.READING, "any evidence"),
    R("unreadable", "nvml", "readable", "the probe could read no field of this GPU (NVML unavailable, "
      "every field failed or unsupported)", "UNKNOWN", Clears.READING, "a poll that reads a field"),
    R("hung", "nvml", "hung", "an NVML call for this GPU has not returned, or the agent's nvml loop stopped "
      "(put by the agent's runner and watchdog)", "UNKNOWN", Clears.READING, "the call returning, the loop "
      "beating again"),
    R("gpu_lost", "nvml", "gpu_lost", "NVML says the GPU is lost (fell off the bus)", "FAILED",
      Clears.RESET_AND_CANARY, RC),
    R("xid_app", "nvml", "xid.*", "an application-class or unknown solo XID repeated >= app_xid_repeat "
      "times within app_xid_window_s (fewer, or a non-solo XID such as 45: counted, HEALTHY)", "SUSPECT", Clears.WINDOW,
      "the window passing without repeats; operator clear"),
    R("xid_hw", "nvml", "xid.*", "a hardware-class XID (catalog implies SUSPECT/DEGRADED/FAILED)",
      "the catalog's state", Clears.RESET_AND_CANARY,
      "needs_reset XIDs: " + RC + "; others: xid_hold_s after the last one"),
    R("xid_repeat", "nvml", "xid.*", "a solo hardware-class XID seen >= hw_xid_escalate times within "
      "hw_xid_window_s (non-solo XIDs never escalate on their own)", "FAILED", Clears.RESET_AND_CANARY, RC),
    R("ecc_uncorrected", "nvml", "ecc.uncorrected", "the volatile uncorrected ECC count increased",
      "DEGRADED", Clears.RESET_AND_CANARY, RC),
    R("sbe_storm", "nvml", "ecc.sbe_storm", "corrected ECC errors >= sbe_storm_count within sbe_window_s",
      "SUSPECT", Clears.WINDOW, "sbe_window_s without a storm"),
    R("remap_failure", "nvml", "remap.failure", "row remapping failed (no spare rows left)", "FAILED",
      Clears.READING, "the field reading 0 (a replaced GPU); operator clear lasts until the next poll"),
    R("remap_pending", "nvml", "remap.pending", "a row remap is pending (takes effect at the next reset)",
      "DEGRADED", Clears.READING, "the field reading 0 (after a GPU reset)"),
    R("retired_pending", "nvml", "retired_pages.pending", "a page retirement is pending (pre-Ampere)",
      "DEGRADED", Clears.READING, "the field reading 0 (after a reset or driver reload)"),
    R("recovery_action", "nvml", "recovery_action", "the driver's recovery action is not NONE: GPU_RESET, "
      "DRAIN_P2P, DRAIN_AND_RESET -> DEGRADED; NODE_REBOOT -> FAILED", "DEGRADED or FAILED",
      Clears.READING, "the field reading NONE"),
    R("pcie_replay", "nvml", "pcie.replay_rate", "PCIe replays within pcie_window_s above the threshold "
      "for the link's generation and width", "SUSPECT", Clears.WINDOW, "pcie_window_s below threshold"),
    R("pcie_width", "nvml", "pcie.link_width", "the PCIe link trained narrower than its maximum width",
      "SUSPECT", Clears.READING, "the link at full width"),
    R("nvlink_errors", "nvml", "nvlink.errors", "NVLink CRC/replay/recovery errors within nvlink_window_s "
      "above their thresholds on any link", "SUSPECT", Clears.WINDOW, "nvlink_window_s below thresholds"),
    R("nvlink_down", "nvml", "nvlink.down", "a link that was up at the first reading is down", "DEGRADED",
      Clears.READING, "the link up again"),
    R("thermal", "nvml", "thermal", "a thermal or power-brake slowdown (clock event reasons, or slowdown "
      "time >= throttle_fraction of the interval)", "SUSPECT", Clears.WINDOW, "throttle_hold_s without one"),
    R("gpu_reset", "nvml", "gpu_reset", "a GPU reset was seen (volatile counters went back down)",
      "HEALTHY (marks the reset time)", Clears.OPERATOR, "newer reset"),
    R("canary_pass", "canary", "pass", "a canary passed", "HEALTHY (clears RESET_AND_CANARY evidence "
      "with a reset between it and the pass)", Clears.OPERATOR, "newer pass"),
    R("canary_other", "canary", "*", "any other canary evidence (e.g. a failure)", "as the evidence says",
      Clears.RESET_AND_CANARY, RC),
    R("other_source", "*", "*", "evidence from any other source (replica vote, loss detector, nvml "
      "signals without a row)", "as the evidence says", Clears.OPERATOR,
      "newer evidence of the same key, its expiry, or operator clear"),
)


def rule_for(ev: Evidence) -> StateRule:
    """The first row that matches this evidence (XID rows are chosen in `GpuEvidenceStore._xid_state`)."""
    for rule in RULES[1:]:
        if rule.matches(ev):
            return rule
    return RULES[-1]


@dataclasses.dataclass(kw_only=True, slots=True)
class GpuStateConfig:
    app_xid_window_s: float = 3600.0
    app_xid_repeat: int = 3
    xid_hold_s: float = 3600.0
    hw_xid_window_s: float = 86400.0
    hw_xid_escalate: int = 3
    history_max: int = 256

    def __post_init__(self) -> None:
        for name in ("app_xid_window_s", "xid_hold_s", "hw_xid_window_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"GpuStateConfig.{name} must be > 0, got {getattr(self, name)}")
        for name in ("app_xid_repeat", "hw_xid_escalate", "history_max"):
            if getattr(self, name) < 1:
                raise ValueError(f"GpuStateConfig.{name} must be >= 1, got {getattr(self, name)}")


@dataclasses.dataclass(frozen=True, slots=True)
class Verdict:
    """What one piece of evidence contributes now: its effective state, why, and the rule used."""

    evidence: Evidence
    state: State
    reason: str
    rule: str


def _ago(now: float, t: float) -> str:
    s = max(0.0, now - t)
    return f"{s:.0f}s ago" if s < 120 else (f"{s / 60:.0f}m ago" if s < 7200 else f"{s / 3600:.1f}h ago")


def _span(seconds: float) -> str:
    return f"{seconds:.0f}s" if seconds < 120 else (f"{seconds / 60:.0f}m" if seconds < 7200
                                                     else f"{seconds / 3600:.0f}h")


class GpuEvidenceStore:
    """All current evidence about one GPU, from every source, plus XID, reset and canary-pass history.

    Pure: no clock, no I/O; `now` is passed in. Memory is bounded: one evidence per key, and histories
    capped at `config.history_max` entries."""

    def __init__(self, config: GpuStateConfig | None = None) -> None:
        self.config = config or GpuStateConfig()
        self._evidence: dict[tuple[str, str], Evidence] = {}
        self._xids: dict[int, deque[float]] = {}
        self._resets: list[float] = []
        self._passes: list[float] = []
        self._cleared_at: float | None = None

    # -- input ----------------------------------------------------------------------------------------------

    def put(self, ev: Evidence) -> None:
        if ev.source == "nvml" and ev.signal.startswith("xid."):
            try:
                xid = int(ev.signal[4:])
            except ValueError as exc:
                raise ValueError(f"XID evidence signal must be 'xid.<number>', got {ev.signal!r}") from exc
            hist = self._xids.setdefault(xid, deque(maxlen=self.config.history_max))
            for _ in range(min(max(1, ev.count), self.config.history_max)):   # a batch of 800,000: 256 kept
                hist.append(ev.time)
        elif ev.key == ("nvml", "gpu_reset"):
            self._remember(self._resets, ev.time)
        elif ev.key == ("canary", "pass"):
            self._remember(self._passes, ev.time)
        self._evidence[ev.key] = ev

    def put_all(self, source: str, evidence: Iterable[Evidence]) -> None:
        """Put a poll's evidence from `source`; READING evidence of that source absent from it is dropped
        (its field became unsupported or unreadable), so a stale reading never lingers."""
        evs = list(evidence)
        keys = {e.key for e in evs}
        for key, old in list(self._evidence.items()):
            if old.source == source and key not in keys and rule_for(old).clears is Clears.READING:
                del self._evidence[key]
        for e in evs:
            self.put(e)

    def _remember(self, times: list[float], t: float) -> None:
        bisect.insort(times, t)
        if len(times) > self.config.history_max:
            del times[0]

    # -- queries --------------------------------------------------------------------------------------------

    def current(self, now: float) -> list[Evidence]:
        return [e for e in self._evidence.values() if e.expires is None or e.expires > now]

    def xid_counts(self, now: float, window_s: float) -> dict[int, tuple[int, float]]:
        """Per XID: (occurrences within window_s before now, last seen); since the last operator clear."""
        out: dict[int, tuple[int, float]] = {}
        for xid, times in self._xids.items():
            ts = self._live(times)
            if ts:
                out[xid] = (sum(1 for t in ts if t > now - window_s), max(ts))
        return out

    def last_reset(self) -> float | None:
        return self._resets[-1] if self._resets else None

    def clear(self, now: float, by: str = "", why: str = "") -> list[Evidence]:
        """Operator clear: drop every piece of evidence that is not HEALTHY and forget XIDs seen up to now.

        The agent journals it (who and why); the next readings re-establish anything still true."""
        removed = [e for e in self._evidence.values()
                   if e.implies is not State.HEALTHY or (e.source == "nvml" and e.signal.startswith("xid."))]
        for e in removed:
            del self._evidence[e.key]
        self._cleared_at = now
        self._xids.clear()
        if by or why:
            self._evidence[("operator", "clear")] = Evidence(
                "operator", "clear", "cleared", State.HEALTHY, f"cleared by {by or 'operator'}: {why}".rstrip(": "),
                now)
        return removed

    def verdicts(self, now: float) -> list[Verdict]:
        """Each current piece of evidence with the state it contributes now (HEALTHY ones included)."""
        out: list[Verdict] = []
        for ev in self.current(now):
            if ev.source == "nvml" and ev.signal.startswith("xid."):
                v = self._xid_state(ev, now)
            else:
                v = self._plain_state(ev, now)
            if v is not None:
                out.append(v)
        return out

    def derive(self, now: float) -> tuple[State, str]:
        verdicts = self.verdicts(now)
        if not verdicts:
            return State.UNKNOWN, "no evidence yet"
        bad = [v for v in verdicts if v.state is not State.HEALTHY]
        if not bad:
            return State.HEALTHY, "all signals normal"
        state = worst([v.state for v in bad])
        return state, "; ".join(sorted({v.reason for v in bad if v.state is state}))

    # -- rules ----------------------------------------------------------------------------------------------

    def _live(self, times: Iterable[float]) -> list[float]:
        c = self._cleared_at
        return [t for t in times if c is None or t > c]

    def _reset_then_pass(self, since: float, now: float) -> tuple[float | None, bool]:
        """(first reset after `since`, whether a canary passed after that reset)."""
        i = bisect.bisect_right(self._resets, since)
        if i == len(self._resets):
            return None, False
        reset = self._resets[i]
        j = bisect.bisect_right(self._passes, reset)
        return reset, j < len(self._passes) and self._passes[j] <= now

    def _after_reset_rule(self, ev: Evidence, state: State, reason: str, since: float, now: float,
                          rule: str) -> Verdict | None:
        reset, passed = self._reset_then_pass(since, now)
        if reset is None:
            return Verdict(ev, state, reason, rule)
        if passed:
            return None
        if state.badness > State.SUSPECT.badness:
            return Verdict(ev, State.SUSPECT, f"{reason} (GPU reset seen {_ago(now, reset)}; awaiting a "
                           "passing canary)", rule)
        return Verdict(ev, state, reason, rule)

    def _plain_state(self, ev: Evidence, now: float) -> Verdict | None:
        rule = rule_for(ev)
        if ev.implies is State.HEALTHY:
            return Verdict(ev, State.HEALTHY, ev.reason, rule.id)
        if rule.clears is Clears.RESET_AND_CANARY:
            return self._after_reset_rule(ev, ev.implies, ev.reason, ev.time, now, rule.id)
        return Verdict(ev, ev.implies, ev.reason, rule.id)

    def _xid_state(self, ev: Evidence, now: float) -> Verdict | None:
        xid = int(ev.signal[4:])
        times = self._live(self._xids.get(xid, ()))
        if not times:
            return None
        last = max(times)
        cfg = self.config
        entry = xid_catalog.classify(xid)
        label = f"XID {xid} ({entry.name})"
        if entry.implies is State.HEALTHY:
            n = sum(1 for t in times if t > now - cfg.app_xid_window_s)
            if n >= cfg.app_xid_repeat and entry.solo:
                return Verdict(ev, State.SUSPECT, f"{label} x{n} in the last {_span(cfg.app_xid_window_s)}, "
                               f"last {_ago(now, last)}", "xid_app")
            return Verdict(ev, State.HEALTHY, f"{label} x{n}, last {_ago(now, last)}", "xid_app")
        n_hw = sum(1 for t in times if t > now - cfg.hw_xid_window_s)
        state, rule = entry.implies, "xid_hw"
        reason = f"{label}: {entry.action.value}, x{n_hw} in {_span(cfg.hw_xid_window_s)}, last {_ago(now, last)}"
        if n_hw >= cfg.hw_xid_escalate and state is not State.FAILED and entry.solo:
            state, rule = State.FAILED, "xid_repeat"
            reason = f"{label} repeated x{n_hw} in {_span(cfg.hw_xid_window_s)}, last {_ago(now, last)}"
        if entry.needs_reset or rule == "xid_repeat":
            return self._after_reset_rule(ev, state, reason, last, now, rule)
        if now - last >= cfg.xid_hold_s:
            return None
        return Verdict(ev, state, reason, rule)


def derive_state(evidence: Iterable[Evidence], now: float,
                 config: GpuStateConfig | None = None) -> tuple[State, str]:
    store = GpuEvidenceStore(config)
    for e in sorted(evidence, key=lambda e: e.time):
        store.put(e)
    return store.derive(now)
