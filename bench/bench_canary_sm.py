"""The SM-naming canary on real GPUs: per-SM coverage, a fault placed on a chosen SM located, and its time.

  python bench/bench_canary_sm.py [--gpus 0,1] [--fault-sm 17] [--dtype bf16] [--json OUT]

For each GPU: (1) a clean run of the SM canary (checksums.canary_sm: bf16 4096x4096x512, 64x64 tiles, fp32
accumulation, every tile's SM read from %smid): PASS and coverage (SMs that ran a tile / the GPU's SM
count), with the time; (2) the same with `--fault-sm S`: the programs that run on SM S flip one bit of
their tile, and the check must FAIL naming that SM (and only it) and the tiles it computed. Prints one JSON
line per GPU and exits 1 unless every GPU is fully covered and the fault is located on the chosen SM.
Needs CUDA and Triton (never under TRITON_INTERPRET=1).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from checksums import canary_sm  # noqa: E402
from probes.canary_suite import discover_devices  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", default=None, help="comma-separated indices (default: all)")
    ap.add_argument("--fault-sm", type=int, default=17)
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    gpus = [int(g) for g in args.gpus.split(",")] if args.gpus else None
    devices, note = discover_devices(gpus, "cuda")
    if not devices:
        print(note, file=sys.stderr)
        return 2
    ok, rows = True, []
    spec = canary_sm.sm_spec(args.dtype)
    for dev in devices:
        with torch.cuda.device(torch.device(dev.device)):
            canary_sm.run_sm_canary(spec, dev)          # warm-up: Triton compiles the kernel once
            t0 = time.perf_counter()
            clean = canary_sm.run_sm_canary(spec, dev)
            clean_s = time.perf_counter() - t0
            fault = canary_sm.run_sm_canary(spec, dev, fault_sm=args.fault_sm)
        cov = clean.details.get("coverage", {})
        sms = {int(k): v for k, v in (fault.details.get("suspect_sms") or {}).items()}
        row = {"gpu": dev.label, "name": dev.name, "clean": clean.status.value, "clean_s": round(clean_s, 4),
               "num_sms": cov.get("num_sms"), "covered": cov.get("covered"), "missing": cov.get("missing"),
               "tiles": clean.details.get("tiles"), "fault_sm": args.fault_sm, "fault": fault.status.value,
               "located_sms": sms, "located_tiles": len(fault.details.get("located") or []), "why": fault.why}
        rows.append(row)
        print(json.dumps(row))
        ok &= clean.status.value == "PASS" and fault.status.value == "FAIL" and list(sms) == [args.fault_sm]
    print(json.dumps({"all_covered_and_located": ok}))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
