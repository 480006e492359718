"""XID catalog: what each XID means for a training fleet, how bad it is, and what to do about it.

Built from NVIDIA's published Xid catalog (docs.nvidia.com/deploy/xid-errors, the Ampere-and-later table
with its "resolution bucket" columns) and the dynamic page retirement / row remapping guides; the text is
ours. Each entry gives:

- `severity`: INFO / WARNING / CRITICAL (the event's severity in the journal);
- `action`: the recommended operator action (`XidAction`);
- `implies`: the GPU state this XID implies on its own (`probes.gpu_state` adds windows and repeats);
- `needs_reset`: True when the condition is cleared only by a GPU reset (then a passing canary), False
  when it ages out of its window.

Application-class XIDs (13, 31, 43, ...) imply HEALTHY: one of them is a bug in the job, not the GPU. They
are still counted, and repeats within a window make the GPU SUSPECT (`probes.gpu_state`).

Unknown XIDs are classified WARNING "unknown XID", action NONE, and still counted.

Solo and non-solo (NVIDIA's catalog distinguishes an XID seen on its own from one logged with, or as a
consequence of, another XID): `solo` is True when the entry's verdict holds for the XID on its own. A
non-solo XID (`solo=False`) reports a consequence or a detail of another error (`follows` names it; empty:
any error): XID 45 is the cleanup after whatever faulted first, XIDs 171/172 add the DRAM/SRAM detail to
XID 48, XID 154 announces the recovery action the driver chose after another XID. A non-solo XID is
counted and keeps its own implied state, but its repeats never escalate on their own (a node that logged
672 XID 45s in three hours had one fault, not 672): the XID it follows carries the escalation.

The GPU recovery action (NVML field NVML_FI_DEV_GET_GPU_RECOVERY_ACTION, announced by XID 154) is mapped
by `recovery_action()`.
"""
from __future__ import annotations

import dataclasses
import enum

from sdcwatch.types import Severity, State


class XidAction(str, enum.Enum):
    """Recommended action, from least to most disruptive (CONTACT_SUPPORT: RMA)."""

    NONE = "NONE"
    RESTART_APP = "RESTART_APP"
    RESET_GPU = "RESET_GPU"
    DRAIN_NODE = "DRAIN_NODE"
    REBOOT = "REBOOT"
    CONTACT_SUPPORT = "CONTACT_SUPPORT"


@dataclasses.dataclass(frozen=True, slots=True)
class XidEntry:
    xid: int
    name: str
    meaning: str
    severity: Severity
    action: XidAction
    implies: State
    needs_reset: bool
    known: bool = True
    solo: bool = True
    follows: tuple[int, ...] = ()


def _e(xid: int, name: str, meaning: str, severity: Severity, action: XidAction, implies: State,
       needs_reset: bool, *, follows: tuple[int, ...] | None = None) -> XidEntry:
    """One entry; `follows` given (empty: any XID) makes it non-solo (see the module docstring)."""
    return XidEntry(xid, name, meaning, severity, action, implies, needs_reset,
                    solo=follows is None, follows=follows or ())


S = Severity
A = XidAction
H, SU, D, F = State.HEALTHY, State.SUSPECT, State.DEGRADED, State.FAILED

_ENTRIES = [
    _e(8, "GPU stopped processing",
       "A channel stopped making progress (idle timeout); usually the job hung or was killed.",
       S.WARNING, A.RESTART_APP, H, False),
    _e(13, "Graphics engine exception",
       "A kernel hit an illegal instruction, address or out-of-range access; almost always the "
       "application. Repeats across jobs point at the GPU.", S.WARNING, A.RESTART_APP, H, False),
    _e(31, "GPU memory page fault",
       "The MMU refused an access to an unmapped or protected address; usually an application bug.",
       S.WARNING, A.RESTART_APP, H, False),
    _e(32, "Invalid or corrupted push buffer stream",
       "The DMA engine read a corrupt command stream; can come from the driver, the PCIe bus or host "
       "memory corruption.", S.WARNING, A.RESTART_APP, SU, False),
    _e(38, "Driver firmware error",
       "The GPU firmware reported an internal error.", S.CRITICAL, A.RESET_GPU, D, True),
    _e(43, "GPU stopped processing (channel reset)",
       "A channel was torn down after a fault in the application; the GPU itself is normally fine.",
       S.WARNING, A.RESTART_APP, H, False),
    _e(45, "Preemptive cleanup",
       "Channels were cleaned up after an earlier error or because the process was killed; a "
       "consequence, not a cause.", S.INFO, A.NONE, H, False, follows=()),
    _e(48, "Double-bit ECC error",
       "An uncorrectable ECC error in GPU memory; data in flight may be wrong. On Ampere and later it is "
       "followed by XID 63 (row remap recorded) or 64 (remap failed).", S.CRITICAL, A.RESET_GPU, D, True),
    _e(54, "Auxiliary power not connected / power fault",
       "The board reports a problem with its auxiliary power; needs hands on the hardware.",
       S.CRITICAL, A.CONTACT_SUPPORT, D, True),
    _e(61, "Internal micro-controller breakpoint/warning",
       "An internal micro-controller stopped at a breakpoint or raised a warning.",
       S.WARNING, A.RESET_GPU, SU, True),
    _e(62, "Internal micro-controller halt",
       "An internal micro-controller halted; the GPU will not recover without a reset.",
       S.CRITICAL, A.RESET_GPU, D, True),
    _e(63, "ECC page retirement / row remap recorded",
       "A memory row was marked for remapping (a page for retirement on older GPUs); the repair takes "
       "effect at the next GPU reset.", S.WARNING, A.RESET_GPU, D, True),
    _e(64, "ECC page retirement / row remap failure",
       "Recording a row remap or page retirement failed; the bad memory is not repaired. Repeats mean "
       "RMA.", S.CRITICAL, A.RESET_GPU, D, True),
    _e(68, "Video decoder exception",
       "The NVDEC engine raised an exception; an application or media stream problem.",
       S.WARNING, A.RESTART_APP, H, False),
    _e(69, "Graphics engine class error",
       "An engine received an invalid method or class; usually the application.",
       S.WARNING, A.RESTART_APP, H, False),
    _e(74, "NVLink error",
       "An NVLink reported a fatal error (the message names the link and unit); peer traffic through it "
       "is unreliable.", S.CRITICAL, A.RESET_GPU, D, True),
    _e(79, "GPU has fallen off the bus",
       "The GPU stopped answering on PCIe; nothing on it can be trusted or reached until the node is "
       "rebooted (power, thermal, seating or a failing GPU). Repeats mean RMA.",
       S.CRITICAL, A.REBOOT, F, True),
    _e(92, "High single-bit ECC error rate",
       "Corrected memory errors arrive faster than the driver's threshold; an early sign of failing "
       "memory.", S.WARNING, A.NONE, SU, False),
    _e(93, "InfoROM wear limit",
       "A non-fatal violation of the provisioned InfoROM wear limit.", S.WARNING, A.CONTACT_SUPPORT, SU,
       False),
    _e(94, "Contained ECC error",
       "An uncorrectable memory error that the GPU contained to the application that touched it; other "
       "work is unaffected. The row is remapped at the next reset.", S.WARNING, A.RESTART_APP, SU, True),
    _e(95, "Uncontained ECC error",
       "An uncorrectable memory error that could not be contained; every application on the GPU is "
       "affected and results since then are suspect.", S.CRITICAL, A.RESET_GPU, D, True),
    _e(109, "Context switch timeout",
       "A context switch did not complete in time; usually a long-running or hung kernel.",
       S.WARNING, A.RESTART_APP, H, False),
    _e(119, "GSP RPC timeout",
       "The GPU System Processor did not answer the driver in time; the GPU is wedged.",
       S.CRITICAL, A.RESET_GPU, D, True),
    _e(120, "GSP error",
       "The GPU System Processor reported an error.", S.CRITICAL, A.RESET_GPU, D, True),
    _e(121, "C2C link error",
       "The chip-to-chip link (Grace Hopper NVLink-C2C) reported an error.", S.WARNING, A.RESET_GPU, SU,
       True),
    _e(140, "Unrecovered ECC error",
       "An ECC error the GPU could not recover from (outside the contained/uncontained paths).",
       S.CRITICAL, A.RESET_GPU, D, True),
    _e(144, "NVLink SAW error", "An NVLink error in the SAW unit (recent drivers; the message gives the "
       "sub-code).", S.CRITICAL, A.RESET_GPU, D, True),
    _e(145, "NVLink RLW error", "An NVLink error in the RLW unit.", S.CRITICAL, A.RESET_GPU, D, True),
    _e(146, "NVLink TLW error", "An NVLink error in the TLW unit.", S.CRITICAL, A.RESET_GPU, D, True),
    _e(147, "NVLink TREX error", "An NVLink error in the TREX unit.", S.CRITICAL, A.RESET_GPU, D, True),
    _e(148, "NVLink NVLPW control error", "An NVLink power/control error.", S.CRITICAL, A.RESET_GPU, D,
       True),
    _e(149, "NVLink NETIR error", "An NVLink network-interface error.", S.CRITICAL, A.RESET_GPU, D, True),
    _e(150, "NVLink MSE error", "An NVLink management/security engine error.", S.CRITICAL, A.RESET_GPU, D,
       True),
    _e(151, "Key rotation error",
       "Confidential-computing key rotation failed; encrypted traffic to the GPU stops. NVIDIA's bucket is "
       "a VM restart (the application's restart on bare metal).", S.WARNING, A.RESTART_APP, SU, False),
    _e(152, "DLA SMMU error",
       "The deep-learning accelerator's SMMU faulted (DLA-equipped parts only); NVIDIA's bucket is ignore.",
       S.INFO, A.NONE, H, False),
    _e(153, "DLA timeout",
       "A deep-learning accelerator task timed out (DLA-equipped parts only); the application's problem.",
       S.WARNING, A.RESTART_APP, H, False),
    _e(154, "GPU recovery action changed",
       "The driver changed the GPU's recommended recovery action after another XID; read it from the "
       "recovery-action field (GPU reset, node reboot, drain P2P, drain and reset).", S.CRITICAL, A.RESET_GPU,
       D, True, follows=()),
    _e(155, "NVLink software-defined error",
       "The NVLink software stack flagged a link fault it defines itself (recent drivers); peer traffic "
       "through the link is unreliable.", S.CRITICAL, A.RESET_GPU, D, True),
    _e(156, "Resource retirement event",
       "The GPU retired a hardware resource (a memory row or unit) after errors; like a row remap, the "
       "repair takes effect at the next GPU reset.", S.WARNING, A.RESET_GPU, D, True),
    _e(157, "Resource retirement failure",
       "Retiring a failing resource did not succeed: the bad part stays in use and cannot be repaired in "
       "the field.", S.CRITICAL, A.CONTACT_SUPPORT, D, True),
    _e(158, "GPU fatal timeout",
       "A GPU operation timed out fatally; the GPU does not recover without a reset.",
       S.CRITICAL, A.RESET_GPU, D, True),
    _e(159, "CHI non-data error",
       "The coherent hub interface (the CPU-GPU coherent fabric on Grace parts) reported a non-data error.",
       S.CRITICAL, A.RESET_GPU, D, True),
    _e(160, "Channel retirement event",
       "A memory channel was retired after errors; capacity and repair headroom shrink, the retirement "
       "takes effect at the next reset.", S.WARNING, A.RESET_GPU, D, True),
    _e(161, "Channel retirement failure",
       "Retiring a failing memory channel did not succeed; the channel stays in use.",
       S.CRITICAL, A.CONTACT_SUPPORT, D, True),
    _e(162, "Power smoothing re-engaged",
       "The board's power-smoothing circuitry is working again; informational.", S.INFO, A.NONE, H, False),
    _e(163, "Power smoothing disengaged",
       "The board's power-smoothing circuitry switched off; power swings reach the facility undamped. Not a "
       "compute fault.", S.WARNING, A.NONE, H, False),
    _e(164, "Power smoothing low lifetime",
       "The power-smoothing circuitry is close to its wear limit; plan a replacement.",
       S.WARNING, A.CONTACT_SUPPORT, SU, False),
    _e(165, "Power smoothing lifetime exhausted",
       "The power-smoothing circuitry reached its wear limit and stays off; the board needs service.",
       S.WARNING, A.CONTACT_SUPPORT, SU, False),
    _e(166, "Confidential-computing traffic before link encryption",
       "Confidential-computing traffic arrived before the link was configured for encryption; the GPU's "
       "secure state is not trustworthy until reset.", S.CRITICAL, A.RESET_GPU, D, True),
    _e(167, "PCIe fatal timeout",
       "A PCIe transaction to the GPU timed out fatally; like a fall off the bus, nothing on the GPU can be "
       "reached until the node is rebooted.", S.CRITICAL, A.REBOOT, F, True),
    _e(168, "Write-protected region error",
       "Errors were found in the GPU's write-protected region (firmware-owned memory).",
       S.CRITICAL, A.RESET_GPU, D, True),
    _e(169, "Internal micro-controller halt (new style)",
       "An internal micro-controller halted (the newer drivers' code for XID 62); reset needed.",
       S.CRITICAL, A.RESET_GPU, D, True),
    _e(170, "Interrupt in confidential-computing mode",
       "An unexpected interrupt arrived while the GPU was in confidential-computing mode.",
       S.WARNING, A.RESET_GPU, SU, True),
    _e(171, "Uncorrectable ECC error in DRAM",
       "Logged with XID 48 on recent drivers: the uncorrectable error was in device memory (HBM); the row "
       "is remapped at the next reset.", S.CRITICAL, A.RESET_GPU, D, True, follows=(48,)),
    _e(172, "Uncorrectable ECC error in SRAM",
       "Logged with XID 48 on recent drivers: the uncorrectable error was in on-chip SRAM (L2, register "
       "file, shared memory), which cannot be remapped; SRAM errors past the driver's threshold mean RMA.",
       S.CRITICAL, A.RESET_GPU, D, True, follows=(48,)),
    _e(173, "C2C fatal link failure",
       "The chip-to-chip link to the CPU (Grace parts) failed fatally; the node needs a reboot.",
       S.CRITICAL, A.REBOOT, F, True),
    _e(185, "Memory sparing event",
       "The GPU moved data off failing memory onto spare memory online; the repair is done, repeats mean the "
       "memory is wearing out.", S.WARNING, A.NONE, SU, False),
]

CATALOG: dict[int, XidEntry] = {e.xid: e for e in _ENTRIES}

#: The XIDs the issue requires the catalog to cover.
REQUIRED_XIDS = (13, 31, 32, 38, 43, 45, 48, 54, 61, 62, 63, 64, 68, 69, 74, 79, 92, 94, 95, 109, 119, 120,
                 121, 140, *range(144, 154), *range(154, 173), 185)


def lookup(xid: int) -> XidEntry | None:
    """The catalog entry, or None for an XID we do not know."""
    return CATALOG.get(int(xid))


def classify(xid: int) -> XidEntry:
    """The catalog entry; unknown XIDs get a WARNING 'unknown XID' entry (still counted)."""
    entry = lookup(xid)
    if entry is not None:
        return entry
    return XidEntry(int(xid), "unknown XID", f"XID {xid} is not in sdcwatch's catalog; see NVIDIA's Xid "
                    "catalog for this driver.", Severity.WARNING, XidAction.NONE, State.HEALTHY, False,
                    known=False)


# ----------------------------------------------------------------------------------------------------------
# GPU recovery action (NVML_FI_DEV_GET_GPU_RECOVERY_ACTION, nvmlDeviceGpuRecoveryAction_t)
# ----------------------------------------------------------------------------------------------------------


class RecoveryAction(enum.IntEnum):
    NONE = 0
    GPU_RESET = 1
    NODE_REBOOT = 2
    DRAIN_P2P = 3
    DRAIN_AND_RESET = 4
    RECOVER_IMEX_DOMAIN = 5  # newer drivers
    BUS_RESET = 6
    SYSTEM_REBOOT = 7


_RECOVERY = {
    RecoveryAction.NONE: (XidAction.NONE, State.HEALTHY),
    RecoveryAction.GPU_RESET: (XidAction.RESET_GPU, State.DEGRADED),
    RecoveryAction.NODE_REBOOT: (XidAction.REBOOT, State.FAILED),
    RecoveryAction.DRAIN_P2P: (XidAction.DRAIN_NODE, State.DEGRADED),
    RecoveryAction.DRAIN_AND_RESET: (XidAction.RESET_GPU, State.DEGRADED),
    RecoveryAction.RECOVER_IMEX_DOMAIN: (XidAction.DRAIN_NODE, State.DEGRADED),
    RecoveryAction.BUS_RESET: (XidAction.RESET_GPU, State.DEGRADED),
    RecoveryAction.SYSTEM_REBOOT: (XidAction.REBOOT, State.FAILED),
}


def recovery_action(value: int) -> tuple[str, XidAction, State]:
    """(name, our action, implied state) for a recovery-action field value; unknown values are SUSPECT."""
    try:
        ra = RecoveryAction(int(value))
    except ValueError:
        return f"UNKNOWN({value})", XidAction.CONTACT_SUPPORT, State.SUSPECT
    action, state = _RECOVERY[ra]
    return ra.name, action, state
