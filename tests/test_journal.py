from __future__ import annotations

import json

from daemon.journal import Journal
from deadlines import scaled


def test_sequence_continues_after_reopen(tmp_path):
    j = Journal(tmp_path).open()
    for i in range(5):
        assert j.append({"kind": "x", "i": i}) == i + 1
    j.close()
    j2 = Journal(tmp_path).open()
    assert j2.last_seq == 5
    assert j2.append({"kind": "y"}) == 6
    j2.close()
    assert [r["seq"] for r in Journal(tmp_path).open().read_since(0)] == [1, 2, 3, 4, 5, 6]


def test_torn_last_line_is_truncated(tmp_path):
    j = Journal(tmp_path).open()
    j.append({"kind": "a"})
    j.append({"kind": "b"})
    j.close()
    path = j.files()[-1]
    with open(path, "ab") as fh:
        fh.write(b'{"kind":"c","se')  # killed mid-write
    j2 = Journal(tmp_path).open()
    assert j2.last_seq == 2
    assert j2.append({"kind": "d"}) == 3
    j2.close()
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert [r["kind"] for r in lines] == ["a", "b", "d"]


def test_rotation_keeps_newest_files_and_reads_across(tmp_path):
    j = Journal(tmp_path, max_bytes=4096, keep_files=3).open()
    for i in range(400):
        j.append({"kind": "k", "pad": "x" * 40, "i": i})
    files = j.files()
    assert len(files) == 3
    recs = list(j.read_since(0))
    seqs = [r["seq"] for r in recs]
    assert seqs == list(range(seqs[0], 401)), "contiguous from the oldest kept record"
    assert seqs[0] > 1, "old records were rotated away"
    assert [r["seq"] for r in j.read_since(395)] == [396, 397, 398, 399, 400]
    assert [r["seq"] for r in j.read_since(390, limit=2)] == [391, 392]
    j.close()


def test_rotated_names_start_at_their_first_seq(tmp_path):
    j = Journal(tmp_path, max_bytes=4096, keep_files=10).open()
    for i in range(200):
        j.append({"pad": "y" * 50})
    for path in j.files():
        first = json.loads(path.read_text().splitlines()[0])["seq"]
        assert path.stem.endswith(f"{first:012d}")
    j.close()


def test_step_log_lines_are_json_for_every_float(tmp_path) -> None:
    """The step log's fast formatter writes valid JSON: NaN and infinities as strings, tiny and huge floats
    and 64-bit fingerprint words exactly."""
    import math

    from daemon.journal import Journal
    from daemon.step_log import step_line
    from proto.sdcwatch.v1 import agent_pb2 as pb

    j = Journal(tmp_path, prefix="steps", flush_each=True)
    j.open()
    cases = [float("nan"), float("inf"), -float("inf"), 1e-300, -2.5e300, 0.1, 3.0]
    for i, x in enumerate(cases):
        req = pb.ReportStepRequest(job_id="job-1:a@b+c=d", rank=i, step=i, loss=x, grad_norm=abs(x),
                                   fingerprint=[0, 2**64 - 1, i])
        if i == 2:
            req.vote.checked, req.vote.agreed = True, False
        j.append_body(step_line(req, 1700000000.123456))
    records = list(j.read_since(0))
    j.close()
    assert [r["seq"] for r in records] == list(range(1, len(cases) + 1))
    for r, x in zip(records, cases):
        got = r["loss"]
        assert (got == str(x)) if not math.isfinite(x) else (got == x)
        assert r["fp"][1] == "ffffffffffffffff" and r["job"] == "job-1:a@b+c=d" and r["t"] == 1700000000.123456
    assert records[2]["agreed"] is False and "agreed" not in records[0]


def test_a_failing_step_log_loses_records_not_reports(tmp_path, caplog) -> None:
    """The loop only queues step records; the step log's thread writes them. A write error loses that record
    with a log line (at most one a minute) and never fails the ReportStep."""
    from daemon.compose import build_agent
    from daemon.config import Config
    from proto.sdcwatch.v1 import agent_pb2 as pb

    cfg = Config()
    cfg.agent.state_dir = str(tmp_path / "state")
    cfg.nvml.enabled = False
    agent = build_agent(cfg)
    agent.journal.open()
    agent.steps.open()
    req = pb.ReportStepRequest(job_id="j", rank=0, world_size=1, step=1, loss=1.0)
    agent.handle_report(req, 1.0)
    assert list(agent.steps.read_since(0)) == [], "nothing formatted on the request path"
    agent.step_log.drain()
    assert [r["step"] for r in agent.steps.read_since(0)] == [1]

    def broken(body: str) -> int:
        raise OSError(28, "No space left on device")

    agent.steps.append_body = broken  # type: ignore[method-assign]
    with caplog.at_level("ERROR"):
        for step in (2, 3, 4):
            out = agent.handle_report(pb.ReportStepRequest(job_id="j", rank=0, world_size=1, step=step, loss=1.0),
                                      float(step))
            assert out == []
        agent.step_log.drain()
    assert caplog.text.count("step log:") == 1 and "No space left" in caplog.text
    assert agent.jobs.jobs["j"].last_step == 4  # the reports themselves were taken
    assert agent.step_log.lost == 2  # steps 3 and 4, since the one report of the error
    agent.step_log.close()
    agent.journal.close()


def test_the_step_log_thread_writes_and_flushes_without_the_loop(tmp_path, monkeypatch) -> None:
    import time as _time

    from daemon import step_log as sl
    from daemon.journal import Journal
    from proto.sdcwatch.v1 import agent_pb2 as pb

    j = Journal(tmp_path / "steps", prefix="steps", flush_each=False)
    j.open()
    log = sl.StepLog(j)
    log.start()
    for step in range(100):
        log.add(pb.ReportStepRequest(job_id="j", rank=0, world_size=1, step=step, loss=1.0), 1.0)
    deadline = _time.monotonic() + scaled(10)
    while len(list(j.read_since(0))) < 100 and _time.monotonic() < deadline:  # flushed within FLUSH_S
        _time.sleep(0.05)
    assert [r["step"] for r in j.read_since(0)] == list(range(100))
    monkeypatch.setattr(sl, "MAX_PENDING", 3)  # a stalled writer: memory stays bounded, the excess is counted
    with log._lock:
        for step in range(100, 110):
            log.add(pb.ReportStepRequest(job_id="j", rank=0, world_size=1, step=step), 1.0)
        assert len(log._pending) == 3 and log.dropped == 7
    log.close()
    assert [r["step"] for r in j.read_since(0)][-3:] == [100, 101, 102]


def test_a_step_log_writer_stuck_in_a_write_does_not_hang_the_stop(tmp_path, monkeypatch, caplog) -> None:
    import threading

    from daemon import step_log as sl
    from daemon.journal import Journal
    from proto.sdcwatch.v1 import agent_pb2 as pb

    j = Journal(tmp_path / "steps", prefix="steps", flush_each=False)
    j.open()
    release = threading.Event()
    real = j.append_body

    def hung(body: str) -> int:  # a write that does not return (a hung NFS mount)
        release.wait(30)
        return real(body)

    j.append_body = hung  # type: ignore[method-assign]
    log = sl.StepLog(j)
    log.start()
    for step in range(sl.WAKE_AT + 1):
        log.add(pb.ReportStepRequest(job_id="j", rank=0, world_size=1, step=step), 1.0)
    monkeypatch.setattr(log._thread, "join", lambda timeout=None: None)  # the 10 s join, without the wait
    with caplog.at_level("ERROR"):
        log.close()
    assert "stuck in a write" in caplog.text
    release.set()
