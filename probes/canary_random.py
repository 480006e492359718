"""Random-data GEMM canaries: every mantissa bit exercised, checked by cross-GPU vote and a float64 bound.

The same seeded inputs (drawn once on the CPU, so identical everywhere) are multiplied on every GPU of the
node. GPUs of the same model, driver and library versions run the same kernel and give bit-identical
outputs, so their output fingerprints are compared and a strict majority names the odd GPU. That
assumption is checked at start (`determinism_check`: the same GEMM twice on one GPU); if it fails, or
when a group has no strict majority (two GPUs that disagree, or a single GPU), each output is judged
against a float64 reference with a rigorous rounding bound instead (`rounding_bound`):

    |C - C64| <= gamma_K * (|A| |B|) + u_in * 2 * (|A| |B|) + u_out * |C64| (+ a tiny absolute slack),
    gamma_K = K u_acc / (1 - K u_acc), u_acc = 2**-24 (fp32 accumulation),

u_in the input rounding of TF32 (2**-11, inputs held in fp32 and rounded by the tensor cores; 0 for the
others, whose inputs are exact in float64), u_out the output rounding (2**-8 bf16, 2**-11 fp16, 2**-24
fp32). The bound holds for any summation order, so it never fails a healthy GPU; it only catches errors
above the rounding level, which is why the vote (bitwise) comes first.

`vote_outputs` is pure and takes fingerprints; the device work is in `run_random`.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import time
from typing import Any, Callable, Mapping, Sequence

import torch

from checksums.canary_gemm import DtypeInfo, default_matmul, dtype_table, localise
from checksums.fingerprint import fingerprint_tensor
from sdcwatch.canary import CheckResult, DeviceInfo, Status

log = logging.getLogger(__name__)

U_OUT = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}
U_ACC = 2.0 ** -24
U_TF32 = 2.0 ** -11


@dataclasses.dataclass(frozen=True, slots=True)
class RandomSpec:
    """C[M, N] = A[M, K] @ B[K, N], A and B seeded normal values rounded to the input dtype."""

    dtype: str
    m: int
    n: int
    k: int
    seed: int = 0
    out: str = "native"

    def __post_init__(self) -> None:
        if self.dtype not in dtype_table():
            raise ValueError(f"unknown canary dtype {self.dtype!r}; known: {sorted(dtype_table())}")
        if min(self.m, self.n, self.k) < 1:
            raise ValueError(f"RandomSpec dimensions must be >= 1, got {self.m}x{self.n}x{self.k}")
        if self.info.scaled and (self.m % 16 or self.n % 16 or self.k % 16):
            raise ValueError(f"fp8 canaries need M, N, K multiples of 16, got {self.m}x{self.n}x{self.k}")
        if self.out not in ("native", "fp32"):
            raise ValueError(f"RandomSpec.out must be 'native' or 'fp32', got {self.out!r}")

    @property
    def info(self) -> DtypeInfo:
        return dtype_table()[self.dtype]

    @property
    def out_dtype(self) -> torch.dtype:
        return torch.float32 if self.out == "fp32" else self.info.out_dtype

    @property
    def name(self) -> str:
        return f"random/{self.dtype}/{self.m}x{self.n}x{self.k}"

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.n * self.k

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@functools.lru_cache(maxsize=8)
def random_host_inputs(spec: RandomSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """(A [M, K], B^T [N, K]) on the CPU in the input dtypes (values already rounded to them)."""
    gen = torch.Generator().manual_seed(int(spec.seed) & 0x7FFFFFFFFFFFFFFF)
    scale = 2.0 if spec.info.scaled else 1.0
    a = (torch.randn(spec.m, spec.k, generator=gen) * scale).to(spec.info.a_dtype)
    bt = (torch.randn(spec.n, spec.k, generator=gen) * scale).to(spec.info.b_dtype)
    return a, bt


def device_inputs(spec: RandomSpec, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    a, bt = random_host_inputs(spec)
    a = a.to(device)
    bt = bt.to(device)
    b = bt.t() if spec.info.scaled else bt.t().contiguous()
    return a, b


@functools.lru_cache(maxsize=4)
def rounding_bound(spec: RandomSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """(C64, bound) on the CPU in float64 (cached per spec)."""
    a, bt = random_host_inputs(spec)
    a64, b64 = a.double(), bt.double().t()
    ref = a64 @ b64
    absprod = a64.abs() @ b64.abs()
    k = spec.k
    gamma = k * U_ACC / (1 - k * U_ACC)
    u_in = U_TF32 if spec.info.tf32 else 0.0
    bound = (gamma + 2 * u_in) * absprod * (1 + 1e-6) + U_OUT[spec.out_dtype] * ref.abs() * (1 + 1e-6)
    bound += 1e-30
    return ref, bound


def bound_check(spec: RandomSpec, out: torch.Tensor) -> dict[str, Any]:
    """How `out` stands against the float64 bound: ok, number of elements beyond it, worst excess."""
    ref, bound = rounding_bound(spec)
    err = (out.detach().cpu().double() - ref).abs()
    beyond = ~(err <= bound)            # NaN counts as beyond
    n = int(beyond.sum())
    res: dict[str, Any] = {"ok": n == 0, "beyond": n}
    if n:
        ratio = torch.where(beyond, err / bound, torch.zeros_like(err)).nan_to_num(float("inf"))
        idx = int(torch.argmax(ratio))
        r, c = divmod(idx, out.shape[1])
        res.update({"worst": {"row": r, "col": c, "error": float(err[r, c]), "bound": float(bound[r, c])}})
        bad = beyond.nonzero()
        res["rows"] = torch.unique(bad[:, 0])[:64].tolist()
        res["cols"] = torch.unique(bad[:, 1])[:64].tolist()
    return res


# ----------------------------------------------------------------------------- the vote (pure)


@dataclasses.dataclass(frozen=True, slots=True)
class VoteOutcome:
    """Per group of like devices: the majority fingerprint, the odd devices, the undecided ones."""

    majority: dict[str, tuple[int, ...]]          # group -> fingerprint held by a strict majority
    odd: tuple[str, ...]                          # devices outvoted by a strict majority
    agree: tuple[str, ...]                        # devices with the majority
    undecided: tuple[str, ...]                    # no strict majority in their group (or alone)
    reason: str
    split: tuple[str, ...] = ()                   # undecided devices of groups that disagree (no majority)


def vote_outputs(fingerprints: Mapping[str, tuple[int, ...]],
                 groups: Mapping[str, str] | None = None) -> VoteOutcome:
    """Bitwise majority vote of output fingerprints within each group of identical devices.

    A group of >= 3 with a strict majority names the others odd; a group of 2 that disagrees, a group
    with no strict majority, or a device alone, is undecided (judged by the float64 bound instead). In
    `run_random` the devices of a split group (deterministic, yet different) all FAIL unless the bound
    singles out the wrong ones: with two GPUs that disagree, both are suspect."""
    groups = groups or {label: "all" for label in fingerprints}
    missing = set(fingerprints) - set(groups)
    if missing:
        raise ValueError(f"devices without a group: {sorted(missing)}")
    by_group: dict[str, list[str]] = collections.defaultdict(list)
    for label in fingerprints:
        by_group[groups[label]].append(label)
    majority: dict[str, tuple[int, ...]] = {}
    odd: list[str] = []
    agree: list[str] = []
    undecided: list[str] = []
    split: list[str] = []
    notes = []
    for g, labels in sorted(by_group.items()):
        counts = collections.Counter(fingerprints[x] for x in labels)
        fp, n = counts.most_common(1)[0]
        if len(labels) == 1:
            undecided += labels
            notes.append(f"{g}: one device, no vote")
        elif len(counts) == 1:
            majority[g] = fp
            agree += labels
        elif n * 2 > len(labels):
            majority[g] = fp
            agree += [x for x in labels if fingerprints[x] == fp]
            outs = [x for x in labels if fingerprints[x] != fp]
            odd += outs
            notes.append(f"{g}: {', '.join(outs)} outvoted {n} to {len(labels) - n}")
        else:
            undecided += labels
            split += labels
            notes.append(f"{g}: no strict majority among {len(labels)} devices ({len(counts)} distinct outputs)")
    return VoteOutcome(majority, tuple(odd), tuple(agree), tuple(undecided), "; ".join(notes), tuple(split))


def group_key(dev: DeviceInfo, versions: Mapping[str, str] | None = None) -> str:
    """Devices whose outputs must be bit-identical: same model name and the same software stack."""
    v = versions or {}
    return "|".join([dev.name or dev.device.split(":")[0], v.get("driver", ""), v.get("cuda", ""),
                     v.get("torch", "")])


# ----------------------------------------------------------------------------- device work

MatmulFor = Callable[[DeviceInfo], Callable[..., torch.Tensor]]


def _default_matmul_for(dev: DeviceInfo) -> Callable[..., torch.Tensor]:
    return default_matmul


def determinism_check(spec: RandomSpec, dev: DeviceInfo, matmul_for: MatmulFor = _default_matmul_for,
                      runs: int = 2) -> CheckResult:
    """The same GEMM `runs` times on one device: do the outputs agree bit for bit?"""
    t0 = time.perf_counter()
    try:
        a, b = device_inputs(spec, torch.device(dev.device))
        mm = matmul_for(dev)
        fps = [tuple(fingerprint_tensor(mm(a, b, spec))) for _ in range(runs)]
    except Exception as exc:
        return CheckResult("determinism", f"determinism/{spec.dtype}", Status.UNKNOWN, (dev.label,),
                           time.perf_counter() - t0, why=f"{type(exc).__name__}: {exc}"[:500])
    same = len(set(fps)) == 1
    return CheckResult("determinism", f"determinism/{spec.dtype}", Status.PASS if same else Status.UNKNOWN,
                       (dev.label,), time.perf_counter() - t0,
                       why="" if same else "the same GEMM gave different bits on two runs: the vote is off, "
                       "outputs are judged by the float64 bound only",
                       details={"fingerprints": [[hex(v) for v in fp] for fp in fps]})


def run_random(spec: RandomSpec, devices: Sequence[DeviceInfo], *, matmul_for: MatmulFor = _default_matmul_for,
               deterministic: bool = True, groups: Mapping[str, str] | None = None,
               use_bound: bool = True) -> list[CheckResult]:
    """Run the random GEMM on every device; one CheckResult per device (PASS / FAIL / UNKNOWN)."""
    fps: dict[str, tuple[int, ...]] = {}
    outs: dict[str, torch.Tensor] = {}
    times: dict[str, float] = {}
    errors: dict[str, str] = {}
    for dev in devices:
        t0 = time.perf_counter()
        try:
            a, b = device_inputs(spec, torch.device(dev.device))
            out = matmul_for(dev)(a, b, spec)
            fps[dev.label] = tuple(fingerprint_tensor(out))
            outs[dev.label] = out
        except Exception as exc:
            errors[dev.label] = f"{type(exc).__name__}: {exc}"[:500]
        times[dev.label] = time.perf_counter() - t0
    vote = vote_outputs(fps, {k: (groups or {}).get(k, "all") for k in fps}) if deterministic else \
        VoteOutcome({}, (), (), tuple(fps), "outputs not deterministic on this device: no vote")
    results: list[CheckResult] = []
    labels = {d.label: d for d in devices}
    bound_failed: set[str] = set()
    if use_bound:   # decide bound failures first, so a split pair blames only the one beyond the bound
        for label in vote.split:
            if not bound_check(spec, outs[label])["ok"]:
                bound_failed.add(label)
    for label in labels:
        dur = times.get(label, 0.0)
        if label in errors:
            results.append(CheckResult("random", spec.name, Status.UNKNOWN, (label,), dur, why=errors[label],
                                       details={"spec": spec.to_json()}))
            continue
        details: dict[str, Any] = {"spec": spec.to_json(), "fingerprint": [hex(v) for v in fps[label]],
                                   "vote": vote.reason or "unanimous"}
        status, why = Status.PASS, ""
        if label in vote.odd:
            status = Status.FAIL
            group = (groups or {}).get(label, "all")
            maj = vote.majority[group]
            details["majority_fingerprint"] = [hex(v) for v in maj]
            peer = next(x for x in vote.agree if fps[x] == maj)
            mismatch = localise(outs[peer], outs[label])   # both copied to the CPU
            if mismatch is not None:
                details["mismatch"] = mismatch.to_json()
                why = f"outvoted by the other GPUs ({mismatch.summary()}, compared with {peer})"
            else:
                why = "outvoted by the other GPUs"
        if use_bound and (label in vote.undecided or label in vote.odd):
            bc = bound_check(spec, outs[label])
            details["float64_bound"] = bc
            if not bc["ok"]:
                status = Status.FAIL
                why = (why + "; " if why else "") + f"{bc['beyond']} elements beyond the float64 rounding bound"
        elif label in vote.undecided:
            status, why = Status.UNKNOWN, "no vote possible and the float64 check is off"
        if status is Status.PASS and label in vote.split:
            group = (groups or {}).get(label, "all")
            others = [x for x in vote.split if (groups or {}).get(x, "all") == group and fps[x] != fps[label]]
            if not any(x in bound_failed for x in others):
                status = Status.FAIL
                why = (f"differs bit for bit from {', '.join(others)} (same model and software, deterministic) "
                       "with no majority to say which is wrong; both within the float64 bound")
        if status is Status.FAIL and details.get("float64_bound", {}).get("ok") is False:
            bound_failed.add(label)
        results.append(CheckResult("random", spec.name, status, (label,), dur, why=why, details=details))
    return results
