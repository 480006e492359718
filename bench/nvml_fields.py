"""What each NVML read costs on this machine: one field id at a time, batched, and each function call.

    python bench/nvml_fields.py [--reps 15] [--gpu 0] [--json out.json]

In-process nvidia-ml-py (no child process), so the numbers are NVML's own cost. Prints, for GPU --gpu:
1. every candidate field id of nvmlDeviceGetFieldValues alone: return code, value, median/max ms;
2. the same ids in one batched call, and the NVLink per-link fields of every link in one call;
3. each NVML function the probe calls outside the field-values call (median ms);
4. one round trip to the NVML child process (probes/nvml_isolated.py) with nothing to read;
5. with --cold-rounds N: the NVLink reads "cold", as a 1 s poll meets them (each read --cold-gap s after any
   other NVLink read, candidates taken round-robin): per-link DL fields, nvmlDeviceGetNvLinkErrorCounter, the
   all-link TOTAL fields, link state; wall and CPU time of each, so a slow read can be told from a busy one.
The probe's choice of which fields go in the per-poll batch (probes/nvml_backend.py) is made from this table.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# (id, name): the ids of nvml.h that can replace a function call, plus the ones already read as fields.
CANDIDATES = [
    (1, "ECC_CURRENT"), (3, "ECC_SBE_VOL_TOTAL"), (4, "ECC_DBE_VOL_TOTAL"), (5, "ECC_SBE_AGG_TOTAL"),
    (6, "ECC_DBE_AGG_TOTAL"), (11, "ECC_SBE_VOL_DEV"), (12, "ECC_DBE_VOL_DEV"), (22, "ECC_SBE_AGG_DEV"),
    (23, "ECC_DBE_AGG_DEV"), (7, "ECC_SBE_VOL_L1"), (9, "ECC_SBE_VOL_L2"), (13, "ECC_SBE_VOL_REG"),
    (29, "RETIRED_SBE"), (30, "RETIRED_DBE"), (31, "RETIRED_PENDING"),
    (74, "THROTTLE_POWER"), (75, "THROTTLE_THERMAL"), (76, "THROTTLE_SYNC_BOOST"), (77, "THROTTLE_BOARD"),
    (78, "THROTTLE_LOW_UTIL"), (79, "THROTTLE_RELIABILITY"), (269, "THROTTLE_SW_THERM"),
    (270, "THROTTLE_HW_THERM"), (271, "THROTTLE_HW_POWER_BRAKE"),
    (82, "MEMORY_TEMP"), (83, "TOTAL_ENERGY"), (91, "NVLINK_LINK_COUNT"), (94, "PCIE_REPLAY_COUNTER"),
    (95, "PCIE_REPLAY_ROLLOVER"), (142, "REMAPPED_COR"), (143, "REMAPPED_UNC"), (144, "REMAPPED_PENDING"),
    (145, "REMAPPED_FAILURE"), (169, "PCIE_L0_TO_RECOVERY"), (173, "PCIE_CORRECTABLE_ERRORS"),
    (185, "POWER_AVERAGE"), (186, "POWER_INSTANT"), (190, "POWER_CURRENT_LIMIT"), (230, "GPU_RECOVERY_ACTION"),
    (38, "NVLINK_CRC_FLIT_TOTAL"), (52, "NVLINK_REPLAY_TOTAL"), (59, "NVLINK_RECOVERY_TOTAL"),
]
NVLINK_IDS = [(161, "DL_REPLAY"), (162, "DL_RECOVERY"), (163, "DL_CRC"), (165, "STATE")]


def timed(fn: Callable[[], Any], reps: int) -> tuple[float, float, Any]:
    times, result = [], None
    for _ in range(reps):
        t0 = time.perf_counter()
        try:
            result = fn()
        except Exception as exc:  # noqa: BLE001 - a failing call is timed and reported like the others
            result = exc
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3, max(times) * 1e3, result


def cold_nvlink(nv: Any, h: Any, links: int, rounds: int, gap: float) -> dict[str, Any]:
    """Each NVLink read candidate timed cold: round-robin, `gap` seconds after the previous NVLink read."""
    from probes.nvml_backend import _field_value

    def fields(ids: list[tuple[int, int]]) -> Callable[[], Any]:
        def read() -> Any:
            res = nv.nvmlDeviceGetFieldValues(h, ids)
            return [(int(r.nvmlReturn), _field_value(r) if int(r.nvmlReturn) == 0 else None) for r in res]
        return read

    last = links - 1
    cands: list[tuple[str, Callable[[], Any]]] = [
        ("fast field 142 (remapped cor), baseline", fields([(142, 0)])),
        ("link 5 DL replay+recovery+crc (161-163)", fields([(161, 5), (162, 5), (163, 5)])),
        ("link 5 DL replay (161) alone", fields([(161, 5)])),
        (f"link {last} DL replay+recovery+crc", fields([(161, last), (162, last), (163, last)])),
        ("ErrorCounter link 5 replay", lambda: nv.nvmlDeviceGetNvLinkErrorCounter(h, 5, 0)),
        ("ErrorCounter link 5 x4 counters", lambda: [nv.nvmlDeviceGetNvLinkErrorCounter(h, 5, c) for c in range(4)]),
        ("TOTAL crc flit (38)", fields([(38, 0)])),
        ("TOTAL crc data (45)", fields([(45, 0)])),
        ("TOTAL replay (52)", fields([(52, 0)])),
        ("TOTAL recovery (59)", fields([(59, 0)])),
        ("TOTAL ecc data (160)", fields([(160, 0)])),
        ("TOTALs 38+45+52+59+160 in one call", fields([(38, 0), (45, 0), (52, 0), (59, 0), (160, 0)])),
        ("legacy L0 crc flit (32)", fields([(32, 0)])),
        ("link 5 recovery events (213-215)", fields([(213, 5), (214, 5), (215, 5)])),
        ("link 5 state (165)", fields([(165, 5)])),
        ("nvmlDeviceGetNvLinkState link 5", lambda: nv.nvmlDeviceGetNvLinkState(h, 5)),
        (f"links 0-{last} DL 161-163 in one call", fields([(f, k) for k in range(links) for f in (161, 162, 163)])),
    ]
    out: dict[str, Any] = {}
    samples: dict[str, list[tuple[float, float]]] = {n: [] for n, _ in cands}
    results: dict[str, Any] = {}
    for _ in range(rounds):
        for name, fn in cands:
            time.sleep(gap)
            c0, t0 = time.process_time(), time.perf_counter()
            try:
                res = fn()
            except Exception as exc:  # noqa: BLE001 - reported
                res = repr(exc)
            samples[name].append(((time.perf_counter() - t0) * 1e3, (time.process_time() - c0) * 1e3))
            results[name] = res
    print(f"== NVLink reads cold ({rounds} rounds, {gap}s after any other read): wall and CPU ms")
    print(f"{'read':44s} {'wall med':>8} {'wall max':>8} {'cpu med':>8}  result")
    for name, _ in cands:
        walls = [w for w, _c in samples[name]]
        cpus = [c for _w, c in samples[name]]
        out[name] = {"wall_median_ms": statistics.median(walls), "wall_max_ms": max(walls),
                     "cpu_median_ms": statistics.median(cpus), "result": repr(results[name])[:200]}
        print(f"{name:44s} {statistics.median(walls):8.3f} {max(walls):8.3f} {statistics.median(cpus):8.3f}"
              f"  {repr(results[name])[:70]}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--gpu", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--cold-rounds", type=int, default=0)
    ap.add_argument("--cold-gap", type=float, default=0.6)
    args = ap.parse_args(argv)
    import pynvml as nv

    from probes.nvml_backend import _field_value

    nv.nvmlInit()
    h = nv.nvmlDeviceGetHandleByIndex(args.gpu)
    report: dict[str, Any] = {"gpu": nv.nvmlDeviceGetName(h), "fields": {}, "calls": {}}
    print(f"== GPU {args.gpu}: {report['gpu']}, {args.reps} reps each")
    ok_ids: list[int] = []
    print(f"{'field id':>8} {'name':28s} {'ret':>4} {'value':>22} {'med ms':>8} {'max ms':>8}")
    for fid, name in CANDIDATES:
        med, mx, res = timed(lambda fid=fid: nv.nvmlDeviceGetFieldValues(h, [(fid, 0)]), args.reps)
        if isinstance(res, Exception):
            ret, val = -1, repr(res)[:22]
        else:
            ret = int(res[0].nvmlReturn)
            val = _field_value(res[0]) if ret == 0 else ""
        if ret == 0:
            ok_ids.append(fid)
        report["fields"][f"{fid}:{name}"] = {"ret": ret, "value": val, "median_ms": med, "max_ms": mx}
        print(f"{fid:8d} {name:28s} {ret:4d} {str(val):>22} {med:8.3f} {mx:8.3f}")
    med, mx, _ = timed(lambda: nv.nvmlDeviceGetFieldValues(h, [(f, 0) for f in ok_ids]), args.reps)
    report["batch_ok_ids"] = {"n": len(ok_ids), "median_ms": med, "max_ms": mx}
    print(f"batch of the {len(ok_ids)} supported ids in one call: median {med:.3f} ms, max {mx:.3f} ms")
    try:
        links = int(_field_value(nv.nvmlDeviceGetFieldValues(h, [(91, 0)])[0]))
    except Exception:  # noqa: BLE001
        links = 0
    nvl = [(fid, link) for link in range(links) for fid, _ in NVLINK_IDS]
    if nvl:
        med, mx, res = timed(lambda: nv.nvmlDeviceGetFieldValues(h, nvl), args.reps)
        rets = sorted({int(r.nvmlReturn) for r in res}) if not isinstance(res, Exception) else [repr(res)]
        report["batch_nvlink"] = {"links": links, "n": len(nvl), "median_ms": med, "max_ms": mx, "rets": rets}
        print(f"NVLink: {links} links x {len(NVLINK_IDS)} fields in one call: median {med:.3f} ms, max {mx:.3f} ms,"
              f" return codes {rets}")
        for fid, name in NVLINK_IDS:
            med, mx, _ = timed(lambda fid=fid: nv.nvmlDeviceGetFieldValues(h, [(fid, 0)]), args.reps)
            print(f"   {name:12s} link 0 alone: {med:.3f} ms")
        # how NVLink reads group: one link's counters together, one counter across links, states together
        groups = {
            "link 0: replay+recovery+crc": [(161, 0), (162, 0), (163, 0)],
            "link 5: replay+recovery+crc": [(161, 5), (162, 5), (163, 5)],
            "link 5: replay alone": [(161, 5)],
            "link 5: state alone": [(165, 5)],
            "links 0-17: replay": [(161, k) for k in range(links)],
            "links 0-17: crc": [(163, k) for k in range(links)],
            "links 0-17: state": [(165, k) for k in range(links)],
            "links 0-5: replay+recovery+crc": [(f, k) for k in range(min(6, links)) for f in (161, 162, 163)],
            "links 0-17: replay+recovery+crc": [(f, k) for k in range(links) for f in (161, 162, 163)],
        }
        for gname, ids in groups.items():
            med, mx, _ = timed(lambda ids=ids: nv.nvmlDeviceGetFieldValues(h, ids), args.reps)
            report.setdefault("nvlink_groups", {})[gname] = med
            print(f"   {gname:36s} ({len(ids):2d} values): median {med:.3f} ms, max {mx:.3f} ms")
        med, mx, _ = timed(lambda: nv.nvmlDeviceGetFieldValues(h, [(f, 0) for f in ok_ids] + nvl), args.reps)
        report["batch_all"] = {"n": len(ok_ids) + len(nvl), "median_ms": med, "max_ms": mx}
        print(f"everything above in one call ({len(ok_ids) + len(nvl)} values): median {med:.3f} ms, max {mx:.3f} ms")

    calls: list[tuple[str, Callable[[], Any]]] = [
        ("nvmlDeviceGetTemperature(GPU)", lambda: nv.nvmlDeviceGetTemperature(h, 0)),
        ("nvmlDeviceGetPowerUsage", lambda: nv.nvmlDeviceGetPowerUsage(h)),
        ("nvmlDeviceGetEnforcedPowerLimit", lambda: nv.nvmlDeviceGetEnforcedPowerLimit(h)),
        ("nvmlDeviceGetClockInfo(SM)", lambda: nv.nvmlDeviceGetClockInfo(h, 1)),
        ("nvmlDeviceGetClockInfo(MEM)", lambda: nv.nvmlDeviceGetClockInfo(h, 2)),
        ("nvmlDeviceGetMaxClockInfo(SM)", lambda: nv.nvmlDeviceGetMaxClockInfo(h, 1)),
        ("nvmlDeviceGetCurrentClocksEventReasons", lambda: nv.nvmlDeviceGetCurrentClocksEventReasons(h)),
        ("nvmlDeviceGetTotalEccErrors(corr,vol)", lambda: nv.nvmlDeviceGetTotalEccErrors(h, 0, 0)),
        ("nvmlDeviceGetMemoryErrorCounter(corr,vol,dram)", lambda: nv.nvmlDeviceGetMemoryErrorCounter(h, 0, 0, 2)),
        ("nvmlDeviceGetMemoryErrorCounter(corr,vol,sram)", lambda: nv.nvmlDeviceGetMemoryErrorCounter(h, 0, 0, 7)),
        ("nvmlDeviceGetRemappedRows", lambda: nv.nvmlDeviceGetRemappedRows(h)),
        ("nvmlDeviceGetRowRemapperHistogram", lambda: nv.nvmlDeviceGetRowRemapperHistogram(h)),
        ("nvmlDeviceGetPcieReplayCounter", lambda: nv.nvmlDeviceGetPcieReplayCounter(h)),
        ("nvmlDeviceGetCurrPcieLinkGeneration", lambda: nv.nvmlDeviceGetCurrPcieLinkGeneration(h)),
        ("nvmlDeviceGetCurrPcieLinkWidth", lambda: nv.nvmlDeviceGetCurrPcieLinkWidth(h)),
        ("nvmlDeviceGetEccMode", lambda: nv.nvmlDeviceGetEccMode(h)),
    ]
    print(f"{'function':48s} {'med ms':>8} {'max ms':>8}  result")
    for name, fn in calls:
        med, mx, res = timed(fn, args.reps)
        report["calls"][name] = {"median_ms": med, "max_ms": mx, "result": repr(res)[:60]}
        print(f"{name:48s} {med:8.3f} {mx:8.3f}  {repr(res)[:40]}")
    if links and args.cold_rounds:
        report["nvlink_cold"] = cold_nvlink(nv, h, links, args.cold_rounds, args.cold_gap)
    nv.nvmlShutdown()
    try:
        from probes.nvml_isolated import IsolatedBackend

        b = IsolatedBackend()
        med, mx, _ = timed(lambda: b._poll.call("ping"), args.reps * 4)
        report["child_round_trip_ms"] = med
        print(f"child process round trip (ping): median {med:.3f} ms, max {mx:.3f} ms")
        b.close()
    except Exception as exc:  # noqa: BLE001
        print(f"child process: {exc!r}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
