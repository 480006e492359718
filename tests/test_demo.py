"""`sdcwatch demo` end to end (shortened): every injected fault detected, rollbacks, report written;
a clean run detects nothing."""
from __future__ import annotations

import json

from agent_harness import cli


def test_demo_detects_and_recovers(short_tmp):
    out = short_tmp / "report"
    res = cli("demo", "--steps", "130", "--flip-step", "20", "--bad-data-start", "60", "--bad-data-length", "60",
              "--quiet", "--out", str(out), timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    s = json.loads((out / "summary.json").read_text())
    assert s["ok"] and s["finished"]
    flip, compute, bad = s["detections"]
    assert flip["by"] == "replica vote" and flip["detected_step"] == 20
    # a wrong gradient element in rank 0's backward at step 100 (the demo's default): the vote cannot see it
    # (the all-reduce would average it into every replica); the compute checks name rank 0's GPU on its step
    # and hold the update back
    assert compute["by"] == "compute check (stats, transient)" and compute["detected_step"] == 100, compute
    assert compute["restore"] == "update dropped" and compute["suspect_gpu"].startswith("GPU-"), compute
    assert s["compute_checks"]["mode"] == "exact" and s["compute_checks"]["dropped"] >= 1, s["compute_checks"]
    assert flip["suspect_gpu"].startswith("GPU-")
    assert flip["checkpoint_at_step"] == "committed, never VERIFIED"
    assert bad["by"].startswith("loss.") and bad["detected_step"] <= 60 + 50
    reasons = [r["reason"] for r in s["rollbacks"]]
    assert reasons == ["vote", "directive"]
    assert s["rollbacks"][0]["to_step"] < 20 and s["rollbacks"][1]["to_step"] < 60
    assert s["replicas_equal_at_end"]
    suspect = [g for g in s["gpus"] if g["state"] == "SUSPECT"]
    assert sorted(g["uuid"] for g in suspect) == sorted([flip["suspect_gpu"], compute["suspect_gpu"]])
    assert (out / "loss.png").stat().st_size > 10_000
    kinds = [json.loads(line)["kind"] for line in (out / "events.jsonl").read_text().splitlines()]
    assert "replica.mismatch" in kinds and "job.rollback_directive" in kinds


def test_demo_without_faults_detects_nothing(short_tmp):
    out = short_tmp / "clean"
    res = cli("demo", "--steps", "80", "--no-faults", "--quiet", "--out", str(out), timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    s = json.loads((out / "summary.json").read_text())
    assert s["detections"] == [] and s["critical_events"] == [] and s["rollbacks"] == []
    assert s["compute_checks"]["mode"] == "exact" and s["compute_checks"]["suspicions"] == 0, s["compute_checks"]
    assert s["finished"] and s["steps"] == 80


def test_demo_bad_arguments_exit_2(short_tmp):
    assert cli("demo", "--ranks", "1", "--out", str(short_tmp / "x")).returncode == 2
    bad = cli("demo", "--compute-rank", "3", "--out", str(short_tmp / "x"))
    assert bad.returncode == 2 and "--compute-rank 3 is not a rank of 3" in bad.stderr, bad.stderr
    assert cli("demo", "--steps", "3", "--out", str(short_tmp / "x")).returncode == 2
