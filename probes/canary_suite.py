"""The canary suite: known-answer GEMMs, random-data GEMMs with a cross-GPU vote, data movement.

Levels: `quick` (a preflight: a few seconds per GPU), `full` (larger shapes, fp32-output variants, more
bytes moved), `tiny` (the same checks at toy sizes, for tests). Every check reports PASS, FAIL with
evidence, or UNKNOWN with why, its duration and (GEMMs) the achieved TFLOP/s; a GPU far below its peers'
throughput on the same check is reported slow. Each FAIL's evidence is saved as a JSON file (never pickle)
in the evidence dir; `replay` reruns one on any device and says whether it reproduces.

Lifecycle: `discover_devices` -> `run_suite(devices, SuiteConfig)` -> `SuiteReport` (-> `evidence_by_device`
for the agent, `exit_code` for the CLI).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import platform
import re
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch

from checksums.fingerprint import fingerprint_tensor, triton_available
from checksums import canary_gemm
from checksums.canary_gemm import KnownAnswerSpec, Matmul
from probes import canary_copy, canary_random
from sdcwatch import __version__ as sdcwatch_version
from sdcwatch.canary import SDC_CHECKS, CheckResult, DeviceInfo, Status, SuiteConfig, SuiteReport

log = logging.getLogger(__name__)

EVIDENCE_VERSION = 1
RANDOM_DTYPES = ("fp32", "tf32", "bf16", "fp16", "fp8_e4m3")
RANDOM_SHAPES = {"tiny": (32, 32, 64), "quick": (1024, 1024, 2048), "full": (2048, 2048, 4096)}
TIMED_REPEATS = {"tiny": 1, "quick": 3, "full": 5}


# ----------------------------------------------------------------------------- devices and versions


def discover_devices(gpus: Sequence[int] | None = None, device: str = "auto") -> tuple[list[DeviceInfo], str]:
    """The CUDA devices to check (all, or the given indices), labelled by UUID; the CPU only for `device`
    "cpu" (or "auto", the agent's rounds, when CUDA is absent).

    Returns (devices, note); an empty list with the reason when a requested GPU does not exist or `device`
    "cuda" finds no CUDA GPU."""
    if device == "cpu":
        return [DeviceInfo(label="cpu", device="cpu", name=platform.processor() or "cpu")], \
            "--device cpu: ran on the CPU (fp32 known-answer GEMMs and host copies only)"
    if torch.cuda.is_available():
        n = torch.cuda.device_count()
        idx = list(range(n)) if not gpus else list(gpus)
        bad = [i for i in idx if not 0 <= i < n]
        if bad:
            return [], f"no GPU with index {bad} (this node has {n})"
        devs = []
        for i in idx:
            props = torch.cuda.get_device_properties(i)
            uuid = str(getattr(props, "uuid", "") or "")
            uuid = uuid if uuid.startswith("GPU-") or not uuid else f"GPU-{uuid}"
            devs.append(DeviceInfo(label=uuid or f"cuda:{i}", device=f"cuda:{i}", index=i, uuid=uuid, name=props.name))
        return devs, ""
    if gpus or device == "cuda":
        return [], f"no CUDA GPU is visible: {cuda_unavailable_reason()}"
    return [DeviceInfo(label="cpu", device="cpu", name=platform.processor() or "cpu")], \
        "no CUDA GPU visible: ran on the CPU (fp32 known-answer GEMMs and host copies only)"


def cuda_unavailable_reason() -> str:
    """Why torch cannot use CUDA, in the driver's or torch's words (first line); "" when it can."""
    if torch.cuda.is_available():
        return ""
    try:
        torch.cuda.init()
    except Exception as exc:  # torch raises RuntimeError / AssertionError with the driver's message
        return (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return "torch.cuda.is_available() is False"


def cuda_uuids() -> list[str]:
    """The UUIDs of the GPUs CUDA can use here (after CUDA_VISIBLE_DEVICES); [] without CUDA."""
    if not torch.cuda.is_available():
        return []
    out = []
    for i in range(torch.cuda.device_count()):
        uuid = str(getattr(torch.cuda.get_device_properties(i), "uuid", "") or "")
        out.append(uuid if uuid.startswith("GPU-") or not uuid else f"GPU-{uuid}")
    return out


def versions() -> dict[str, str]:
    v = {"torch": torch.__version__, "cuda": str(torch.version.cuda or ""), "python": platform.python_version(),
         "sdcwatch": sdcwatch_version}
    if torch.cuda.is_available():
        try:
            v["cudnn"] = str(torch.backends.cudnn.version())
            import torch.cuda.nccl as nccl

            v["nccl"] = ".".join(map(str, nccl.version())) if isinstance(nccl.version(), tuple) else str(nccl.version())
        except Exception:
            pass
        try:
            import pynvml

            pynvml.nvmlInit()
            drv = pynvml.nvmlSystemGetDriverVersion()
            v["driver"] = drv.decode() if isinstance(drv, bytes) else str(drv)
        except Exception:
            pass
    return v


# ----------------------------------------------------------------------------- the suite


MatmulFor = Callable[[DeviceInfo], Matmul]


def _default_matmul_for(dev: DeviceInfo) -> Matmul:
    return canary_gemm.default_matmul


def _on_device(dev: DeviceInfo) -> Any:
    """Make `dev` the current CUDA device (streams, events, library handles follow it); no-op on CPU."""
    import contextlib

    return torch.cuda.device(torch.device(dev.device)) if torch.device(dev.device).type == "cuda" else contextlib.nullcontext()


def run_suite(devices: Sequence[DeviceInfo], config: SuiteConfig | None = None, *,
              matmul_for: MatmulFor = _default_matmul_for, copier: canary_copy.Copier | None = None,
              allreduce: canary_copy.AllReduce | None = None) -> SuiteReport:
    cfg = config or SuiteConfig()
    if not devices:
        raise ValueError("run_suite needs at least one device")
    t0 = time.perf_counter()
    vers = versions()
    results: list[CheckResult] = []
    skipped: dict[str, dict[str, str]] = {}
    dev_type = torch.device(devices[0].device).type
    dtypes_of: dict[str, list[str]] = {}
    for dev in devices:
        ok, why = canary_gemm.supported_dtypes(torch.device(dev.device))
        if cfg.dtypes is not None:
            why = {d: w for d, w in why.items() if d in cfg.dtypes}
            ok = [d for d in ok if d in cfg.dtypes]
        dtypes_of[dev.label] = ok
        if why:
            skipped[dev.label] = why
        specs = canary_gemm.known_answer_specs(cfg.level, ok, torch.device(dev.device).type, cfg.seed)
        mm = matmul_for(dev)
        with _on_device(dev):
            for spec in specs:
                reps = TIMED_REPEATS[cfg.level] if spec.shape_name == "large" else 0
                results.append(canary_gemm.run_known_answer(spec, dev, matmul=mm, repeats=reps))
            if torch.device(dev.device).type == "cuda" and cfg.level != "tiny" and triton_available():
                results.append(_sm_check(dev, cfg.seed))
    if cfg.random:
        results += _random_checks(devices, dtypes_of, cfg, matmul_for, vers)
    if cfg.copies:
        sizes = canary_copy.COPY_SIZES["tiny" if dev_type != "cuda" else cfg.level]
        for dev in devices:
            results.append(canary_copy.check_h2d(dev, sizes.h2d_bytes, copier, cfg.seed))
        if len(devices) > 1:
            results += canary_copy.check_p2p_all(devices, sizes.p2p_bytes, copier, cfg.seed)
            results.append(canary_copy.check_allreduce(devices, sizes.allreduce_elems, allreduce))
    results += slow_checks(results, cfg.slow_fraction, cfg.fail_on_slow)
    report = SuiteReport(cfg.level, list(devices), results, skipped, dev_type != "cuda",
                         time.perf_counter() - t0, vers)
    if cfg.evidence_dir is not None:
        for r in results:
            if r.status is Status.FAIL and r.check in SDC_CHECKS:
                r.evidence_path = str(write_evidence(r, report, Path(cfg.evidence_dir)))
    return report


def _sm_check(dev: DeviceInfo, seed: int) -> CheckResult:
    """The SM-naming known-answer GEMM (checksums.canary_sm): a FAIL names the SM and the tile, a PASS proves
    every SM of the GPU computed at least one tile."""
    from checksums import canary_sm  # Triton, an optional extra: imported only where a GPU and Triton are

    return canary_sm.run_sm_canary(canary_sm.sm_spec("bf16", seed=seed), dev)


def _random_checks(devices: Sequence[DeviceInfo], dtypes_of: Mapping[str, list[str]], cfg: SuiteConfig,
                   matmul_for: MatmulFor, vers: Mapping[str, str]) -> list[CheckResult]:
    out: list[CheckResult] = []
    m, n, k = RANDOM_SHAPES["tiny" if torch.device(devices[0].device).type != "cuda" else cfg.level]
    groups = {d.label: canary_random.group_key(d, vers) for d in devices}
    common = [d for d in RANDOM_DTYPES if all(d in dtypes_of[x.label] for x in devices)]
    for i, dt in enumerate(common):
        spec = canary_random.RandomSpec(dt, m, n, k, seed=cfg.seed + 1000 + i)
        det = canary_random.determinism_check(spec, devices[0], matmul_for)
        out.append(det)
        out += canary_random.run_random(spec, devices, matmul_for=matmul_for, groups=groups,
                                        deterministic=det.status is Status.PASS)
    return out


def slow_devices(rates: Mapping[str, float], fraction: float) -> dict[str, float]:
    """Devices whose rate is below `fraction` of the others' median: {label: rate / median of others}."""
    out: dict[str, float] = {}
    for label, rate in rates.items():
        others = [r for x, r in rates.items() if x != label and r > 0]
        if not others:
            continue
        ref = statistics.median(others)
        if ref > 0 and rate < fraction * ref:
            out[label] = rate / ref
    return out


def slow_checks(results: Sequence[CheckResult], fraction: float, fail: bool = True) -> list[CheckResult]:
    """One 'slow' result per device whose throughput, compared with its peers on the same timed GEMMs, is
    below `fraction` in the MEDIAN over those GEMMs. One slow check alone (a one-time library load or a
    clock ramp landing in a short timed loop) does not make a slow GPU; a GPU at a third of its peers' speed
    is slow on every check, so the median catches it."""
    by_check: dict[str, dict[str, float]] = {}
    for r in results:
        if r.check == "gemm" and r.tflops and len(r.devices) == 1:
            by_check.setdefault(r.name, {})[r.devices[0]] = r.tflops
    ratios: dict[str, list[dict[str, Any]]] = {}
    for name, rates in by_check.items():
        for label, rate in rates.items():
            others = [v for x, v in rates.items() if x != label and v > 0]
            if others and statistics.median(others) > 0:
                ratios.setdefault(label, []).append(
                    {"check": name, "tflops": rate, "ratio_to_peers": rate / statistics.median(others)})
    out = []
    for label, items in ratios.items():
        med = statistics.median(x["ratio_to_peers"] for x in items)
        if med < fraction:
            out.append(CheckResult("slow", f"slow/{label}", Status.FAIL if fail else Status.PASS, (label,),
                                   why=f"{med:.0%} of its peers' GEMM throughput (median over {len(items)} GEMMs)",
                                   details={"slow": items, "median_ratio": med}))
    return out


# ----------------------------------------------------------------------------- evidence files and replay


def _safe(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", s)[:120]


def evidence_record(result: CheckResult, report: SuiteReport | None = None) -> dict[str, Any]:
    devs = {d.label: d for d in (report.devices if report else [])}
    return {"sdcwatch_canary_evidence": EVIDENCE_VERSION, "time": time.time(), "check": result.check,
            "name": result.name, "status": result.status.value, "why": result.why,
            "devices": [dataclasses.asdict(devs[x]) if x in devs else {"label": x} for x in result.devices],
            "versions": report.versions if report else versions(), "duration_s": result.duration_s,
            "details": result.details}


def write_evidence(result: CheckResult, report: SuiteReport | None, directory: Path) -> Path:
    """Write one evidence file atomically (tmp, fsync, rename); returns its path."""
    directory.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%S")
    path = directory / f"canary-{stamp}-{_safe('-'.join(result.devices))}-{_safe(result.name)}.json"
    n = 1
    while path.exists():
        path = path.with_name(f"{path.stem.rsplit('~', 1)[0]}~{n}.json")
        n += 1
    tmp = path.with_suffix(".json.tmp")
    with open(tmp, "w") as fh:
        json.dump(evidence_record(result, report), fh, indent=1, sort_keys=True, default=str)
        fh.write("\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    return path


def load_evidence(path: Path | str) -> dict[str, Any]:
    try:
        with open(path) as fh:
            rec = json.load(fh)
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read evidence file {path}: {exc}") from exc
    if not isinstance(rec, dict) or rec.get("sdcwatch_canary_evidence") != EVIDENCE_VERSION:
        raise ValueError(f"{path} is not an sdcwatch canary evidence file (version {EVIDENCE_VERSION})")
    return rec


@dataclasses.dataclass(slots=True)
class ReplayOutcome:
    reproduces: bool              # the replay fails too
    same_output: bool | None      # the replay's output has the recorded wrong fingerprint (None: n/a)
    result: CheckResult
    recorded: dict[str, Any]

    def summary(self) -> str:
        if not self.reproduces:
            return f"does not reproduce on {', '.join(self.result.devices)}: {self.result.status.value}"
        same = " with the same wrong output" if self.same_output else ""
        return f"reproduces on {', '.join(self.result.devices)}{same}: {self.result.why}"


def replay(path: Path | str, dev: DeviceInfo, *, matmul: Matmul | None = None,
           copier: canary_copy.Copier | None = None) -> ReplayOutcome:
    """Rerun an evidence file's check on `dev`; say whether it fails again."""
    rec = load_evidence(path)
    check, details = rec.get("check"), rec.get("details") or {}
    mm = matmul or canary_gemm.default_matmul
    if check == "gemm":
        spec = KnownAnswerSpec.from_json(details["spec"])
        res = canary_gemm.run_known_answer(spec, dev, matmul=mm)
        same = res.details.get("actual_fingerprint") == details.get("actual_fingerprint") \
            if res.status is Status.FAIL else False
        return ReplayOutcome(res.status is Status.FAIL, same, res, rec)
    if check == "random":
        spec_d = dict(details["spec"])
        spec = canary_random.RandomSpec(**spec_d)
        a, b = canary_random.device_inputs(spec, torch.device(dev.device))
        t0 = time.perf_counter()
        out = mm(a, b, spec)
        fp = [hex(v) for v in fingerprint_tensor(out)]
        want = details.get("majority_fingerprint")
        bc = canary_random.bound_check(spec, out)
        bad = (want is not None and fp != want) or not bc["ok"]
        res = CheckResult("random", spec.name, Status.FAIL if bad else Status.PASS, (dev.label,),
                          time.perf_counter() - t0,
                          why=("differs from the recorded majority output" if want and fp != want else "")
                          + ("" if bc["ok"] else f"; {bc['beyond']} elements beyond the float64 bound"),
                          details={"spec": spec.to_json(), "fingerprint": fp, "float64_bound": bc})
        return ReplayOutcome(bad, fp == details.get("fingerprint"), res, rec)
    if check == "gemm_sm":
        from checksums import canary_sm  # Triton, an optional extra (see _sm_check)

        res = canary_sm.run_sm_canary(KnownAnswerSpec.from_json(details["spec"]), dev)
        sms = res.details.get("suspect_sms")
        same_sm = sms == details.get("suspect_sms") if sms else False
        return ReplayOutcome(res.status is Status.FAIL, same_sm, res, rec)
    if check == "h2d":
        res = canary_copy.check_h2d(dev, int(details.get("bytes", 1 << 20)), copier, int(details.get("seed", 0)))
        return ReplayOutcome(res.status is Status.FAIL, None, res, rec)
    raise ValueError(f"cannot replay a {check!r} check on one device (replay supports gemm, gemm_sm, random, "
                     "h2d; rerun the suite with --gpus for pair checks)")
