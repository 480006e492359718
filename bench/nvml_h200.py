"""NVML probe cost on a real machine (the H200 host): which fields the GPU supports, and what a poll costs.

    python bench/nvml_h200.py [--seconds 60] [--interval 1.0] [--json out.json]

1. discovers GPUs and reads every field once, one field at a time, printing supported / NotSupported /
   error (with the error) and the time of each read;
2. polls with the production probe (NvmlProbe.poll) every --interval seconds for --seconds, with the XID
   listener running on its own thread as in the agent; reports the full poll cost per GPU (median, p99),
   the cost of the whole poll, and the process CPU time per minute of polling (and as % of one core);
3. prints a short table last; --json writes everything.

Every exception is caught and reported per field or per step: the script never stops half way.
Target (issue 3): under 2 ms per GPU per poll, under 1% of one core at a 1 s interval. Each poll reads the
fast fields and one rotated unit (probes/nvml_probe.py); the rotation column is how many polls (seconds at a
1 s interval) it takes to read every rotated unit once.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from probes.nvml_backend import FieldNotSupported, NvmlError, open_backend  # noqa: E402
from probes.nvml_fields import field_specs  # noqa: E402
from probes.nvml_probe import NvmlProbe, NvmlProbeConfig, poll_class  # noqa: E402
from sdcwatch.extras import available, needs  # noqa: E402


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def call_group_costs(backend: Any, index: int, links: int, reps: int = 20) -> dict[str, float]:
    """Median milliseconds of one read of each call group (fields read by the same NVML call)."""
    import statistics

    groups: dict[str, list[str]] = {}
    for name, spec in field_specs(links).items():
        key = spec.call if spec.call == "nvmlDeviceGetFieldValues" else f"{spec.call}{tuple(spec.args)}"
        groups.setdefault(key, []).append(name)
    out: dict[str, float] = {}
    for key, names in groups.items():
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            try:
                backend.read_fields(index, names)
            except Exception:  # noqa: BLE001 - a failing group is timed like the others
                pass
            times.append(time.perf_counter() - t0)
        out[key] = round(statistics.median(times) * 1e3, 4)
    return out


def read_every_field(backend: Any, index: int) -> dict[str, Any]:
    out: dict[str, Any] = {"fields": {}}
    try:
        ident = backend.identity(index)
        out["identity"] = {"uuid": ident.uuid, "pci_bus_id": ident.pci_bus_id, "name": ident.name,
                           "serial": ident.serial, "driver_version": ident.driver_version}
    except Exception as exc:  # noqa: BLE001
        out["identity_error"] = repr(exc)
    links = 0
    try:
        v = backend.read_fields(index, ["nvlink.count"]).get("nvlink.count")
        links = int(v) if isinstance(v, (int, float)) else 0
    except Exception as exc:  # noqa: BLE001
        out["nvlink_count_error"] = repr(exc)
    out["nvlink_links"] = links
    for name, spec in field_specs(links).items():
        t0 = time.perf_counter()
        try:
            v = backend.read_fields(index, [name])[name]
            dt = time.perf_counter() - t0
            if isinstance(v, FieldNotSupported):
                rec = {"status": "unsupported", "detail": str(v)}
            elif isinstance(v, NvmlError):
                rec = {"status": "error", "detail": f"{type(v).__name__}: {v}"}
            else:
                rec = {"status": "ok", "value": v}
        except Exception as exc:  # noqa: BLE001
            dt = time.perf_counter() - t0
            rec = {"status": "error", "detail": f"{type(exc).__name__}: {exc}"}
        rec["call"] = spec.call
        rec["ms"] = round(dt * 1e3, 4)
        out["fields"][name] = rec
    return out


def _cpu_with_children() -> float:
    """CPU seconds of this process and its live children (the NVML child processes)."""
    import psutil  # the bench extra: main checks for it

    me = psutil.Process()
    total = sum(me.cpu_times()[:2])
    for child in me.children(recursive=True):
        try:
            total += sum(child.cpu_times()[:2])
        except psutil.Error:
            pass
    return total


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--interval", type=float, default=1.0)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--sweep-s", type=float, default=NvmlProbeConfig().sweep_s)
    ap.add_argument("--scenario", help="a fake-NVML scenario file instead of the GPUs (checks this script)")
    args = ap.parse_args(argv)
    if not available("psutil"):
        sys.exit(f"nvml_h200: {needs('psutil')}")
    report: dict[str, Any] = {"host": os.uname().nodename, "seconds": args.seconds, "interval": args.interval}
    os.environ["SDCWATCH_NVML_TIMING"] = "1"  # the NVML child times each call group
    try:
        backend = open_backend(args.scenario)  # what the agent uses: NVML in child processes (probes/nvml_isolated.py)
    except Exception as exc:  # noqa: BLE001
        print(f"NVML unavailable: {exc}")
        report["error"] = repr(exc)
        if args.json:
            args.json.write_text(json.dumps(report, indent=2, default=str))
        return 1
    try:
        n = backend.device_count()
    except Exception as exc:  # noqa: BLE001
        print(f"nvmlDeviceGetCount failed: {exc}")
        return 1
    print(f"== {n} GPU(s); reading every field once")
    report["gpus"] = []
    for i in range(n):
        g = read_every_field(backend, i)
        report["gpus"].append(g)
        ident = g.get("identity", {})
        print(f"-- GPU {i}: {ident.get('name')} {ident.get('uuid')} {ident.get('pci_bus_id')} "
              f"driver {ident.get('driver_version')} nvlink links {g['nvlink_links']}")
        for status in ("ok", "unsupported", "error"):
            names = [k for k, r in g["fields"].items() if r["status"] == status]
            print(f"   {status:11s} {len(names):3d}: " + ", ".join(
                (f"{k}={g['fields'][k].get('value')}" if status == "ok" and not k.startswith("nvlink.") else k)
                for k in names))
        for k, r in g["fields"].items():
            if r["status"] == "error":
                print(f"   error {k}: {r['detail']}")
        slow = sorted(g["fields"].items(), key=lambda kv: -kv[1]["ms"])[:5]
        print("   slowest single reads: " + ", ".join(f"{k} {r['ms']:.3f} ms" for k, r in slow))

    print("== cost of each NVML call group (median of 20 reads of GPU 0; the probe makes one call per group)")
    report["call_groups"] = call_group_costs(backend, 0, report["gpus"][0]["nvlink_links"] if n else 0)
    for call, ms in sorted(report["call_groups"].items(), key=lambda kv: -kv[1]):
        print(f"   {call:48s} {ms:8.3f} ms")
    read_s: list[float] = []  # time inside backend.read_fields (NVML in the child + the pipe), per GPU poll
    real_read = backend.read_fields

    def timed_read(index: int, names: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return real_read(index, names)
        finally:
            if not all(poll_class(n) == "sweep" for n in names):  # sweeps are timed by the probe
                read_s.append(time.perf_counter() - t0)

    backend.read_fields = timed_read  # type: ignore[method-assign]
    real_many = getattr(backend, "read_many", None)

    def timed_many(requests: Any) -> Any:  # a poll's one round trip for every GPU: each GPU's share
        t0 = time.perf_counter()
        try:
            return real_many(requests)
        finally:
            read_s.extend([(time.perf_counter() - t0) / max(1, len(requests))] * len(requests))

    if real_many is not None:
        backend.read_many = timed_many  # type: ignore[attr-defined]
    probe = NvmlProbe(backend, NvmlProbeConfig(sweep_s=args.sweep_s))
    try:
        probe.discover()
    except Exception:  # noqa: BLE001
        traceback.print_exc()
        return 1
    xids: list[Any] = []
    stop = threading.Event()
    listener = threading.Thread(target=probe.run_xid_listener, args=(xids.append, stop), daemon=True)
    listener.start()
    per_gpu: dict[str, list[float]] = {}
    sweeps: dict[str, list[float]] = {}
    trace: dict[str, list[tuple[float, int, str, bool]]] = {}  # per GPU: (ms, poll number, unit, after a sweep)
    swept_last: set[str] = set()
    whole: list[float] = []
    errors: list[str] = []
    print(f"== polling every {args.interval:g}s for {args.seconds:g}s (XID listener running)")
    try:
        backend._poll.call("call_times")  # clears the warm reads above: count the polls' reads only
    except Exception:  # noqa: BLE001
        pass
    cpu0, wall0 = _cpu_with_children(), time.monotonic()
    next_t = wall0
    polls = 0
    while time.monotonic() - wall0 < args.seconds:
        units_now = {u: (sl.units[sl.rotation % len(sl.units)][0] if sl.units and sl.full_read else "every field")
                     for u, sl in probe._slots.items()}
        t0 = time.perf_counter()
        try:
            res = probe.poll(now=time.time())
            polls += 1
            for uuid, s in res.poll_seconds.items():
                per_gpu.setdefault(uuid, []).append(s)
                trace.setdefault(uuid, []).append((s * 1e3, polls, units_now.get(uuid, "?"), uuid in swept_last))
            for uuid, s in res.sweep_seconds.items():
                sweeps.setdefault(uuid, []).append(s)
            swept_last = set(res.sweep_seconds)
            for uuid, errs in res.errors.items():
                for k, e in errs.items():
                    if len(errors) < 50:
                        errors.append(f"{uuid} {k}: {e}")
        except Exception as exc:  # noqa: BLE001
            errors.append(repr(exc))
        whole.append(time.perf_counter() - t0)
        next_t += args.interval
        time.sleep(max(0.0, next_t - time.monotonic()))
    wall = time.monotonic() - wall0
    cpu = _cpu_with_children() - cpu0
    try:  # per NVML call group, as the polls saw them (SDCWATCH_NVML_TIMING=1 in the child)
        report["poll_call_ms"] = backend._poll.call("call_times")
    except Exception as exc:  # noqa: BLE001
        report["poll_call_ms"] = {"error": repr(exc)}
    stop.set()
    listener.join(5)
    try:
        probe.close()
    except Exception as exc:  # noqa: BLE001
        errors.append(f"close: {exc!r}")
    cpu_per_min = cpu / wall * 60
    report["poll"] = {
        "polls": polls, "wall_s": wall, "cpu_s": cpu, "cpu_s_per_min": cpu_per_min,
        "cpu_pct_one_core": 100 * cpu / wall, "xid_events": [repr(x) for x in xids], "errors": errors,
        "whole_ms": {"median": statistics.median(whole) * 1e3 if whole else None, "p99": pct(whole, 0.99) * 1e3},
        "per_gpu_ms": {u: {"median": statistics.median(v) * 1e3, "p99": pct(v, 0.99) * 1e3, "n": len(v)}
                       for u, v in per_gpu.items()},
    }
    for u, v in per_gpu.items():
        r = report["poll"]["per_gpu_ms"][u]
        r["first"], r["max"] = v[0] * 1e3, max(v) * 1e3
        r["p99_after_first"] = pct(v[1:], 0.99) * 1e3 if len(v) > 1 else None
        sw = sweeps.get(u, [])
        r["sweeps"] = len(sw)
        r["sweep_median"] = statistics.median(sw) * 1e3 if sw else None
        r["sweep_max"] = max(sw) * 1e3 if sw else None
        # every cost of this GPU's NVML reads and rules after the first poll, NVLink sweeps included, per poll
        r["amortized"] = (sum(v[1:]) + sum(sw)) / max(1, len(v) - 1) * 1e3
    units = {s.identity.uuid: len(s.units) for s in probe._slots.values()}
    report["poll"]["rotation_units"] = units
    print("== NVML call groups during the polls (median ms, count; cold reads, 1 s apart)")
    for k, v in sorted(report["poll_call_ms"].items(), key=lambda kv: -kv[1][0] if isinstance(kv[1], list) else 0):
        print(f"   {k:60s} {v}")
    print("== results (each poll: the fast fields + one rotated unit; the first poll reads every field; every"
          f" {probe.config.sweep_s:g} s a sweep after the poll reads the costly fields: NVLink, 3 throttle counters)")
    print(f"{'GPU':40s} {'median ms':>10s} {'p99 ms':>10s} {'max ms':>8s} {'first ms':>9s} {'polls':>6s} "
          f"{'rotation':>9s} {'sweeps':>6s} {'sweep ms':>9s} {'all/poll':>9s}")
    for u, r in report["poll"]["per_gpu_ms"].items():
        sweep_ms = f"{r['sweep_median']:9.3f}" if r["sweep_median"] is not None else f"{'-':>9s}"
        print(f"{u:40s} {r['median']:10.3f} {r['p99']:10.3f} {r['max']:8.3f} {r['first']:9.3f} {r['n']:6d} "
              f"{units.get(u, 0):7d} s {r['sweeps']:6d} {sweep_ms} {r['amortized']:9.3f}")
    print("  (all/poll: every poll after the first plus every sweep of that GPU, divided by the polls)")
    report["poll"]["slowest"] = {}
    for u, rows in trace.items():
        slow = sorted(rows[1:], reverse=True)[:5]
        report["poll"]["slowest"][u] = slow
        print(f"   slowest polls of {u[:12]}..: " + "; ".join(
            f"#{n} {ms:.2f} ms ({unit}{', after a sweep' if after else ''})" for ms, n, unit, after in slow))
    w = report["poll"]["whole_ms"]
    print(f"{'whole poll (all GPUs)':40s} {w['median']:10.3f} {w['p99']:10.3f} {polls:6d}")
    reads = read_s[-polls * max(1, len(per_gpu)):]
    report["poll"]["read_ms"] = {"median": statistics.median(reads) * 1e3, "p99": pct(reads, 0.99) * 1e3}
    print(f"of which NVML reads (child process + pipe; one round trip per poll, each GPU's share), per GPU: median {statistics.median(reads) * 1e3:.3f} ms, "
          f"p99 {pct(reads, 0.99) * 1e3:.3f} ms; the rest is rule evaluation in the agent's process")
    print(f"process CPU: {cpu:.3f} s over {wall:.1f} s = {cpu_per_min:.3f} CPU-s per minute "
          f"= {100 * cpu / wall:.3f}% of one core (target < 1%)")
    print(f"XID events seen: {len(xids)}; poll errors: {len(errors)}")
    for e in errors[:10]:
        print("  ", e)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2, default=str))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
