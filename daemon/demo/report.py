"""The demo's live display, its summary (what was injected, what was detected, when) and its report."""
from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any, Callable

from sdcwatch.extras import available

SEV_STYLE = {"SEVERITY_CRITICAL": "bold red", "SEVERITY_WARNING": "yellow", "SEVERITY_INFO": "dim"}
SHOWN = ("replica.", "gpu.", "loss.", "job.rollback", "checkpoint.", "sdc.", "canary.", "probe.hung",
         "job.reports")
ROUTINE = ("checkpoint.committed", "checkpoint.verified", "checkpoint.evicted", "checkpoint.drained",
           "checkpoint.tier_deleted")  # every few steps: in events.jsonl, not on screen


def _read_new(path: Path, pos: int) -> tuple[list[dict[str, Any]], int]:
    try:
        with open(path) as fh:
            fh.seek(pos)
            data = fh.read()
    except FileNotFoundError:
        return [], pos
    end = data.rfind("\n")
    if end < 0:
        return [], pos
    recs = []
    for line in data[: end + 1].splitlines():
        try:
            recs.append(json.loads(line))
        except ValueError:
            pass
    return recs, pos + len(data[: end + 1].encode())


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return _read_new(path, 0)[0]


class Display:
    def __init__(self, quiet: bool, steps: int) -> None:
        from rich.console import Console

        self.console = Console(stderr=False, highlight=False)
        self.quiet = quiet
        self.steps = steps
        self.t0 = time.time()

    def _stamp(self) -> str:
        return f"[{time.time() - self.t0:6.1f}s]"

    def info(self, text: str) -> None:
        if not self.quiet:
            self.console.print(f"{self._stamp()} {text}")

    def event(self, ev: dict[str, Any]) -> None:
        kind = ev.get("kind", "")
        if self.quiet or not kind.startswith(SHOWN) or kind.startswith(ROUTINE):
            return
        style = SEV_STYLE.get(ev.get("severity", ""), "")
        sev = ev.get("severity", "").removeprefix("SEVERITY_").lower()
        self.console.print(f"{self._stamp()} [{style}]{sev:8} {kind:22}[/] {ev.get('message', '')}",
                           markup=True, soft_wrap=True)

    def follow_training(self, rank0_log: Path, procs: list[subprocess.Popen[bytes]], deadline: float,
                        stopped: Callable[[], int | None] = lambda: None) -> list[int | None]:
        """Show rank 0's progress until every rank exits or `deadline`; `stopped()` returning an exit code (a
        stop signal) ends the demo with it."""
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        logs = {i: (rank0_log.parent / f"rank{i}.jsonl", 0) for i in range(len(procs))}
        progress = Progress(TextColumn("training"), BarColumn(), TextColumn("{task.description}"),
                            TimeElapsedColumn(), console=self.console, disable=self.quiet, transient=True)
        with progress:
            task = progress.add_task("", total=self.steps)
            while True:
                for r, (path, pos) in list(logs.items()):
                    recs, pos = _read_new(path, pos)
                    logs[r] = (path, pos)
                    for rec in recs:
                        if r == 0 and "step" in rec and "event" not in rec:
                            progress.update(task, completed=rec["step"] + 1,
                                            description=f"step {rec['step']:>4}  loss {rec['loss']:.3f}"
                                                        + ("  [bad batch]" if rec.get("bad_batch") else ""))
                        elif rec.get("event") == "injected" and rec.get("kind") == "compute":
                            self.info(f"[magenta]INJECTED[/] a wrong gradient element ({rec['value']:g}) in rank "
                                      f"{rec['rank']}'s backward of step {rec['step']}")
                        elif rec.get("event") == "injected":
                            self.info(f"[magenta]INJECTED[/] bit {rec['bit']} of {rec['param']}[{rec['index']}] "
                                      f"flipped on rank {rec['rank']} after step {rec['step']}")
                        elif rec.get("event") == "rollback" and r == 0:
                            self.info(f"[green]ROLLBACK[/] all ranks restored step {rec['to_step']} "
                                      f"(at step {rec['at_step']}, {rec['reason']}), skipping {rec['skip']} "
                                      f"batches, in {rec['seconds']:.2f}s")
                        elif rec.get("event") == "rollback_impossible" and r == 0:
                            self.info(f"[red]no VERIFIED checkpoint to roll back to at step {rec['at_step']}[/]")
                code = stopped()
                if code is not None:
                    raise SystemExit(code)
                codes = [p.poll() for p in procs]
                if all(c is not None for c in codes) or time.time() > deadline:
                    break
                time.sleep(0.1)
        if any(c is None for c in codes):
            for p in procs:
                if p.poll() is None:
                    p.kill()
            codes = [p.wait() for p in procs]
            self.info("[red]timed out[/]")
        return codes

    def summary(self, s: dict[str, Any], out: Path) -> None:
        from rich.table import Table

        c = self.console
        c.print()
        t = Table(title="sdcwatch demo: injected faults and what caught them")
        for col in ("fault", "at step", "detected by", "detected at", "time to detect", "restore"):
            t.add_column(col)
        for d in s["detections"]:
            t.add_row(d["fault"], str(d.get("step", "-")),
                      d.get("by") or "[red]NOT DETECTED[/]", str(d.get("detected_step", "-")),
                      f"{d['time_to_detect_s']:.2f}s" if d.get("time_to_detect_s") is not None else "-",
                      d.get("restore", "-"))
        if not s["detections"]:
            t.add_row("(none injected)", "-", "-", "-", "-", "-")
        c.print(t)
        c.print(f"training finished: {'yes' if s['finished'] else 'NO'} ({s['iterations']} iterations for "
                f"{s['steps']} steps, {s['wall_s']:.1f}s); critical events: {len(s['critical_events'])}; "
                f"replicas equal at the end: {s['replicas_equal_at_end']}")
        cc = s.get("compute_checks")
        if cc:
            c.print(f"compute checks (rank 0): replays {cc['mode']}; {cc['suspicions']} suspicion(s), "
                    f"{cc['dropped']} update(s) dropped, {cc['audits']} audit(s)")
        for d in s["detections"]:
            if d.get("checkpoint_at_step"):
                c.print(f"checkpoint at step {d['step']} (the bit flip's step): {d['checkpoint_at_step']}")
        for g in s.get("gpus", []):
            c.print(f"  GPU {g['uuid']}: {g['state']}  {g.get('reason', '')}")
        if s["would_page"]:
            c.print("alerts that would page: " + "; ".join(s["would_page"]))
        c.print(f"report: {out}/summary.json, {out}/loss.png, {out}/events.jsonl")
        c.print("[bold green]OK[/]: every injected fault was detected" if s["ok"] else
                "[bold red]FAILED[/]: " + s["why_not_ok"])


def _num(d: dict[str, Any], key: str, default: Any = None) -> Any:
    v = d.get(key, default)
    return int(v) if isinstance(v, float) and v.is_integer() else v


def build_summary(out: Path, plan: dict[str, Any], events: list[dict[str, Any]], codes: list[int | None],
                  status: dict[str, Any], started: float, uuids: list[str]) -> dict[str, Any]:
    logs = {int(p.stem[4:]): read_jsonl(p) for p in out.glob("rank*.jsonl")}
    rank0 = logs.get(0, [])
    steps_log = [r for r in rank0 if "event" not in r and "step" in r]
    finished = all(c == 0 for c in codes) and all(any(r.get("event") == "finished" for r in recs)
                                                  for recs in logs.values()) and len(logs) == len(codes)
    injected = [r for recs in logs.values() for r in recs if r.get("event") == "injected"]
    rollbacks = [r for r in rank0 if r.get("event") == "rollback"]
    by_step_time = {r["step"]: r["t"] for r in steps_log}
    detections = []
    for inj in [i for i in injected if i.get("kind") == "bitflip"]:
        hit = next((e for e in events if e.get("kind") == "replica.mismatch"
                    and _num(e.get("details", {}), "step", -1) >= inj["step"]
                    and any(_num(s, "rank") == inj["rank"] for s in e.get("details", {}).get("suspects", []))), None)
        rb = next((r for r in rollbacks if r["reason"] == "vote" and r["at_step"] >= inj["step"]), None)
        # verified before the job rolled back from the flip (after it, the step is trained again, cleanly)
        verified_steps = {_num(e.get("details", {}), "step") for e in events if e.get("kind") == "checkpoint.verified"
                          and (rb is None or e.get("time", 0) < rb.get("t", float("inf")))}
        saved_steps = {_num(e.get("details", {}), "step") for e in events if e.get("kind") == "checkpoint.committed"}
        ckpt_note = ("VERIFIED (wrong!)" if inj["step"] in verified_steps else
                     "committed, never VERIFIED" if inj["step"] in saved_steps else "no checkpoint at that step")
        detections.append({
            "checkpoint_at_step": ckpt_note,
            "fault": f"bit flip on rank {inj['rank']}", "step": inj["step"], "by": "replica vote" if hit else None,
            "detected_step": _num(hit["details"], "step") if hit else None,
            "time_to_detect_s": (hit["time"] - inj["t"]) if hit else None,
            "restore": f"step {rb['to_step']} in {rb['seconds']:.2f}s" if rb else "-",
            "suspect_gpu": next((s.get("gpu_uuid") for s in hit["details"]["suspects"]), "") if hit else ""})
    for inj in [i for i in injected if i.get("kind") == "compute"]:
        hit = next((e for e in events if e.get("kind") == "compute.fault"
                    and _num(e.get("details", {}), "step", -1) >= inj["step"]
                    and any(_num(f, "rank") == inj["rank"] for f in e.get("details", {}).get("faulty", []))), None)
        d = hit.get("details", {}) if hit else {}
        detections.append({
            "fault": f"compute fault in rank {inj['rank']}'s backward", "step": inj["step"],
            "by": f"compute check ({d.get('detector')}, {d.get('cause')})" if hit else None,
            "detected_step": _num(d, "step") if hit else None,
            "time_to_detect_s": (hit["time"] - inj["t"]) if hit else None,
            "restore": ("update dropped" if d.get("dropped") else "update applied") if hit else "-",
            "suspect_gpu": next((f.get("gpu_uuid") for f in d.get("faulty", [])), "") if hit else ""})
    for bad in plan.get("bad_data", []):
        first = next((r for r in steps_log if r.get("bad_batch")), None)
        hit = next((e for e in events if e.get("kind", "").startswith("loss.")
                    and e.get("severity") == "SEVERITY_CRITICAL" and e.get("kind") != "loss.nonfinite"
                    and first is not None and e["time"] >= first["t"] - 1), None)
        rb = next((r for r in rollbacks if r["reason"] == "directive"), None)
        detections.append({
            "fault": f"corrupted data, batches {bad['start']}-{bad['start'] + bad['length'] - 1}",
            "step": first["step"] if first else None, "by": hit["kind"] if hit else None,
            "detected_step": _num(hit.get("details", {}), "step") if hit else None,
            "time_to_detect_s": (hit["time"] - first["t"]) if hit and first else None,
            "restore": f"step {rb['to_step']} (+{rb['skip']} batches skipped) in {rb['seconds']:.2f}s" if rb else "-"})
    if plan.get("xid"):
        x = plan["xid"]
        hit = next((e for e in events if e.get("kind") == "gpu.xid"
                    and e.get("details", {}).get("uuid") == x["gpu_uuid"]), None)
        detections.append({"fault": f"XID {x['xid']} on {x['gpu_uuid']}", "step": None,
                           "by": "NVML XID event" if hit else None, "detected_step": None,
                           "time_to_detect_s": None, "restore": "-"})
    critical = [e for e in events if e.get("severity") == "SEVERITY_CRITICAL"]
    last_votes = [r.get("agreed") for r in steps_log[-5:] if r.get("agreed") is not None]
    gpus = [{"uuid": g.get("uuid"), "state": g.get("state", "").removeprefix("STATE_"), "reason": g.get("reason", "")}
            for g in status.get("gpus", [])]
    all_detected = all(d["by"] for d in detections)
    ok = finished and all_detected and (bool(detections) or not critical)
    why = [] if finished else ["training did not finish"]
    why += [f"not detected: {d['fault']}" for d in detections if not d["by"]]
    if not detections and critical:
        why.append(f"{len(critical)} critical event(s) in a run without faults")
    return {
        "ok": ok, "why_not_ok": "; ".join(why), "finished": finished, "exit_codes": codes,
        "steps": max((r["step"] for r in steps_log), default=-1) + 1, "iterations": len(steps_log),
        "wall_s": time.time() - started, "plan": plan, "injected": injected, "detections": detections,
        "rollbacks": rollbacks, "critical_events": [{"kind": e["kind"], "message": e.get("message", "")}
                                                    for e in critical],
        "would_page": sorted({e["kind"] for e in critical}), "replicas_equal_at_end": bool(last_votes) and all(last_votes),
        "gpus": gpus, "first_step_time": by_step_time.get(0),
        "compute_checks": next((r.get("compute") for r in rank0 if r.get("event") == "finished"), None)}


def write_report(out: Path, summary: dict[str, Any], events: list[dict[str, Any]]) -> None:
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
    with open(out / "events.jsonl", "w") as fh:
        for e in events:
            fh.write(json.dumps(e, default=str) + "\n")
    if available("matplotlib"):  # the plot extra; without it the command says so
        plot(out, summary, events)


def plot(out: Path, summary: dict[str, Any], events: list[dict[str, Any]]) -> None:
    import matplotlib  # an optional extra (plot): write_report checks for it first

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rank0 = [r for r in read_jsonl(out / "rank0.jsonl") if "event" not in r and "step" in r]
    if not rank0:
        return
    fig, ax = plt.subplots(figsize=(11, 5), dpi=110)
    it = [r["i"] for r in rank0]
    ax.plot(it, [r["loss"] for r in rank0], lw=1.0, color="#1f77b4", label="loss (rank 0)")
    bad = [r["i"] for r in rank0 if r.get("bad_batch")]
    if bad:
        ax.axvspan(min(bad), max(bad), color="orange", alpha=0.15, label="corrupted batches")
    t_to_i = [(r["t"], r["i"]) for r in rank0]

    def at(t: float) -> int:
        return min(t_to_i, key=lambda p: abs(p[0] - t))[1]

    for inj in summary["injected"]:
        ax.axvline(at(inj["t"]), color="purple", ls="--", lw=1, label=f"bit flip injected (rank {inj['rank']})")
    for e in events:
        if e.get("kind") == "replica.mismatch":
            ax.axvline(at(e["time"]), color="red", lw=1.2, label="replica vote: mismatch")
        elif e.get("kind", "").startswith("loss.") and e.get("severity") == "SEVERITY_CRITICAL":
            ax.axvline(at(e["time"]), color="darkred", ls=":", lw=1.5, label=e["kind"])
    for r in summary["rollbacks"]:
        ax.axvline(at(r["t"]), color="green", lw=1.5, label=f"rollback to step {r['to_step']}")
    handles, labels = ax.get_legend_handles_labels()
    uniq = dict(zip(labels, handles))
    ax.legend(uniq.values(), uniq.keys(), loc="upper right", fontsize=8)
    ax.set_xlabel("iteration (steps run, including re-run steps after a rollback)")
    ax.set_ylabel("cross-entropy loss")
    ranks = len(list(out.glob("rank*.jsonl")))
    ax.set_title(f"sdcwatch demo: small GPT on {ranks} data-parallel ranks, with injected faults")
    fig.tight_layout()
    fig.savefig(out / "loss.png")
    plt.close(fig)
