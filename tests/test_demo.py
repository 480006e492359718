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
    flip, bad = s["detections"]
    assert flip["by"] == "replica vote" and flip["detected_step"] == 20
    assert flip["suspect_gpu"].startswith("GPU-")
    assert flip["checkpoint_at_step"] == "committed, never VERIFIED"
    assert bad["by"].startswith("loss.") and bad["detected_step"] <= 60 + 50
    reasons = [r["reason"] for r in s["rollbacks"]]
    assert reasons == ["vote", "directive"]
    assert s["rollbacks"][0]["to_step"] < 20 and s["rollbacks"][1]["to_step"] < 60
    assert s["replicas_equal_at_end"]
    suspect = [g for g in s["gpus"] if g["state"] == "SUSPECT"]
    assert [g["uuid"] for g in suspect] == [flip["suspect_gpu"]]
    assert (out / "loss.png").stat().st_size > 10_000
    kinds = [json.loads(line)["kind"] for line in (out / "events.jsonl").read_text().splitlines()]
    assert "replica.mismatch" in kinds and "job.rollback_directive" in kinds


def test_demo_without_faults_detects_nothing(short_tmp):
    out = short_tmp / "clean"
    res = cli("demo", "--steps", "80", "--no-faults", "--quiet", "--out", str(out), timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    s = json.loads((out / "summary.json").read_text())
    assert s["detections"] == [] and s["critical_events"] == [] and s["rollbacks"] == []
    assert s["finished"] and s["steps"] == 80


def test_demo_bad_arguments_exit_2(short_tmp):
    assert cli("demo", "--ranks", "1", "--out", str(short_tmp / "x")).returncode == 2
    assert cli("demo", "--steps", "3", "--out", str(short_tmp / "x")).returncode == 2
