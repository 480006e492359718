"""`sdcwatch spikes replay`: the shared real excerpts, JSON output, exit codes, bad logs, the plot."""
from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from probes.spikes_replay import main
from loss_curves import bigscience, nanogpt

ROOT = Path(__file__).resolve().parents[1]


def run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    rc = main(argv, stdout=out, stderr=err)
    return rc, out.getvalue(), err.getvalue()


def events(stdout: str) -> list[dict]:
    return [json.loads(ln) for ln in stdout.splitlines() if ln.strip()]


def test_nanogpt_fp16_nan_at_3010() -> None:
    rc, out, _ = run([str(nanogpt()), "--json"])
    assert rc == 1
    evs = events(out)
    assert [(e["step"], e["kind"], e["severity"]) for e in evs] == [(3010, "nonfinite", "critical")]
    assert evs[0]["value"] is None and evs[0]["baseline"] == pytest.approx(3.99, abs=0.1)


def test_bigscience_excerpts() -> None:
    rc, out, err = run([str(bigscience()), "--allow-restarts", "--json"])
    assert rc == 1, err
    evs = events(out)
    for e in evs:
        assert {"step", "kind", "severity", "value", "baseline"} <= e.keys()
        assert e["severity"] in ("info", "warning", "critical")
    got = {(e["run"], e["step"], e["signal"], e["kind"], e["severity"]) for e in evs}
    # BLOOM-176B: the grad norm warns 2 steps before the loss spike, which recovers on its own: no page (its
    # 10x sample at 31216 is confirmed by the next, 66x: a lone sample under 100x is not reported)
    assert ("tr11-176B-ml", 31217, "grad_norm", "spike", "warning") in got
    assert any(e["run"] == "tr11-176B-ml" and e["signal"] == "grad_norm" and e["step"] == 31217
               and e.get("start_step") == 31216 for e in evs), [e for e in evs if e["signal"] == "grad_norm"]
    assert ("tr11-176B-ml", 31219, "loss", "spike", "warning") in got
    assert not any(e["run"] == "tr11-176B-ml" and e["severity"] == "critical" for e in evs)
    # 104B (tr8b): fp16 loss-scale collapse while the loss jumps (the jump is below 2x: reported when the
    # next sample confirms it, with the step it began)
    assert ("tr8b-104B", 17063, "loss", "spike", "warning") in got
    assert next(e for e in evs if e["run"] == "tr8b-104B" and e["kind"] == "spike" and e["signal"] == "loss"
                )["start_step"] == 17062
    # 104B-wide: the loss climbing 1.38x, 1.55x (confirmed on the second sample)
    assert ("tr8-104B-wide#2", 6940, "loss", "spike", "warning") in got
    assert ("tr8b-104B", 17065, "loss_scale", "loss_scale_collapse", "critical") in got
    # 13B: the loss jumps x2.6 with a loss-scale collapse and stays up (40 steps, sampled every 10)
    assert ("tr1-13B-base", 29060, "loss_scale", "loss_scale_collapse", "critical") in got
    assert ("tr1-13B-base", 29090, "loss", "sustained", "critical") in got
    sustained = next(e for e in evs if e["run"] == "tr1-13B-base" and e["kind"] == "sustained")
    assert sustained["start_step"] == 29050


def test_bigscience_without_allow_restarts_is_unreadable_with_the_line() -> None:
    rc, out, err = run([str(bigscience())])
    assert rc == 2 and out == ""
    assert ":26: step 2 is lower than step 45000" in err


def test_clean_log_exits_0_and_prints_a_summary(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    p = tmp_path / "clean.csv"
    p.write_text("step,loss\n" + "".join(f"{i},{3 * np.exp(rng.normal(0, 0.01)):.5f}\n" for i in range(500)))
    rc, out, _ = run([str(p)])
    assert rc == 0 and out.strip() == "# 500 samples in 1 run(s) (csv), 0 events, 0 critical"


def test_custom_columns_and_runs(tmp_path: Path) -> None:
    rows = []
    for run_name, jump in (("ok", 1.0), ("bad", 2.0)):
        for i in range(300):
            rows.append(json.dumps({"name": run_name, "it": i, "L": 3.0 * (jump if i >= 200 else 1.0)
                                    * (1 + 0.01 * ((i * 7919) % 13 - 6) / 6)}))
    p = tmp_path / "log.jsonl"
    p.write_text("\n".join(rows) + "\n")
    rc, out, _ = run([str(p), "--step-col", "it", "--loss-col", "L", "--run-col", "name", "--json"])
    assert rc == 1
    crit = [e for e in events(out) if e["severity"] == "critical"]
    assert [(e["run"], e["kind"]) for e in crit] == [("bad", "sustained")]


@pytest.mark.parametrize("text,line", [("step,lr\n1,2\n", 1), ("step,loss\n1,3\n2,oops\n", 3),
                                       ("step,loss\n3,3\n1,3\n", 3), ("", 0)])
def test_bad_logs_exit_2_with_the_line(tmp_path: Path, text: str, line: int) -> None:
    p = tmp_path / "bad.csv"
    p.write_text(text)
    rc, out, err = run([str(p)])
    assert rc == 2 and out == ""
    assert err.startswith("sdcwatch spikes replay: ")
    assert (f"{p}:{line}:" if line else f"{p}:") in err


def test_usage_error_exits_2() -> None:
    rc, _, _ = run(["--no-such-flag"])
    assert rc == 2


def test_plot(tmp_path: Path) -> None:
    out_png = tmp_path / "replay.png"
    rc, _, _ = run([str(bigscience()), "--allow-restarts", "--plot", str(out_png)])
    assert rc == 1 and out_png.stat().st_size > 10_000
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_as_a_subprocess() -> None:
    proc = subprocess.run([sys.executable, "-m", "probes.spikes_replay", str(nanogpt())], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert "step 3010" in proc.stdout and "critical" in proc.stdout and "nonfinite" in proc.stdout


def test_options_in_any_order_through_the_sdcwatch_cli() -> None:
    """`sdcwatch spikes replay --json FILE` and `FILE --json` are the same command."""
    for argv in (["--allow-restarts", "--json", str(bigscience())], [str(bigscience()), "--json", "--allow-restarts"]):
        proc = subprocess.run([sys.executable, "-m", "daemon.cli", "spikes", "replay", *argv], cwd=ROOT,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 1, proc.stderr
        assert any(json.loads(ln)["kind"] == "sustained" for ln in proc.stdout.splitlines())


def test_text_log_with_a_format_and_a_pattern(tmp_path: Path) -> None:
    lines = [f"iter {i}: loss {3.0 * (2.0 if i >= 300 else 1.0) * (1 + 0.003 * ((i * 7919) % 13 - 6)):.4f}, "
             f"time 98.1ms" for i in range(400)]
    p = tmp_path / "train.log"
    p.write_text("starting\n" + "\n".join(lines) + "\n")
    rc, out, _ = run(["--format", "nanogpt", "--json", str(p)])
    assert rc == 1 and [e["kind"] for e in events(out) if e["severity"] == "critical"] == ["sustained"]
    rc2, out2, _ = run([str(p), "--pattern", r"iter (?P<step>\d+): loss (?P<loss>[0-9.]+)", "--json"])
    assert rc2 == 1 and out2 == out


def test_unknown_format_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run([str(nanogpt()), "--format", "bogus"])
    assert rc == 2 and out == "" and "--format" in capsys.readouterr().err     # argparse's own message


def test_plot_of_many_runs_is_a_grid_of_readable_size(tmp_path: Path) -> None:
    """60 runs: small multiples, 4 columns, at most 24 panels (the runs with critical events first)."""
    from PIL import Image

    rng = np.random.default_rng(2)
    rows = ["run,step,loss"]
    for r in range(60):
        for i in range(200):
            jump = 3.0 if r % 10 == 0 and i >= 150 else 1.0
            rows.append(f"r{r},{i},{3.0 * jump * np.exp(rng.normal(0, 0.01)):.5f}")
    p = tmp_path / "many.csv"
    p.write_text("\n".join(rows) + "\n")
    out_png = tmp_path / "many.png"
    rc, _, _ = run([str(p), "--plot", str(out_png)])
    assert rc == 1
    width, height = Image.open(out_png).size
    assert width <= 2000 and height <= 1800, (width, height)
