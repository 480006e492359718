"""The NVML child process of `probes.nvml_isolated.IsolatedBackend` (`python -m probes.nvml_child`).

It opens the real backend (or, for tests, the scenario fake named by SDCWATCH_NVML_CHILD_SCENARIO) and
answers JSON-line requests on stdin with JSON-line replies on stdout, in the codec of `probes.nvml_isolated`.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from typing import Any

from probes.nvml_backend import PynvmlBackend
from probes.nvml_fake import ScenarioBackend
from probes.nvml_isolated import error_to_json, values_to_json
from probes.nvml_types import NvmlError


def _serve() -> int:
    backend: Any = None
    init_error: NvmlError | None = None
    try:
        scenario = os.environ.get("SDCWATCH_NVML_CHILD_SCENARIO")  # tests: the same child over the fake
        if scenario:
            backend = ScenarioBackend.from_file(scenario)
        else:
            backend = PynvmlBackend()
    except NvmlError as err:
        init_error = err
    out = sys.stdout.buffer
    for line in sys.stdin.buffer:
        req = json.loads(line)
        try:
            if init_error is not None:
                raise init_error
            result = _dispatch(backend, req["method"], req.get("args", []))
            reply = {"id": req["id"], "result": result}
        except NvmlError as err:
            reply = {"id": req["id"], "error": error_to_json(err)}
        except Exception as exc:  # a bug here must answer, not hang the parent
            reply = {"id": req["id"], "error": error_to_json(NvmlError(f"{type(exc).__name__}: {exc}"))}
        out.write((json.dumps(reply) + "\n").encode())
        out.flush()
        if req["method"] == "close":
            break
    return 0


def _dispatch(backend: Any, method: str, args: list[Any]) -> Any:
    if method == "ping":
        return True
    if method == "__abort__" and os.environ.get("SDCWATCH_NVML_CHILD_SCENARIO"):  # tests: die mid-call
        import resource

        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core dump: a piped core_pattern can take seconds
        os.abort()
    if method == "device_count":
        return backend.device_count()
    if method == "identity":
        return dataclasses.asdict(backend.identity(*args))
    if method == "read_fields":
        return values_to_json(backend.read_fields(*args))
    if method == "read_many":
        out = []
        for index, names in args[0]:
            try:
                out.append({"ok": values_to_json(backend.read_fields(index, names))})
            except NvmlError as err:
                out.append({"error": error_to_json(err)})
        return out
    if method == "xid_open":   # pairs: JSON object keys would turn the indices into strings
        return [[i, names] for i, names in backend.xid_open().items()]
    if method == "xid_wait":
        ev = backend.xid_wait(*args)
        return None if ev is None else {"uuid": ev.uuid, "xid": ev.xid, "event": ev.event}
    if method == "xid_drain":
        return [{"uuid": ev.uuid, "xid": ev.xid, "event": ev.event, "count": ev.count}
                for ev in backend.xid_drain(*args)]
    if method == "xid_close":
        backend.xid_close()
        return None
    if method == "call_times":  # benchmarks: medians (ms) and counts of each call group's duration
        times = getattr(backend, "call_times", None) or {}
        out = {k: [sorted(v)[len(v) // 2] * 1e3, len(v)] for k, v in times.items()}
        times.clear()
        return out
    if method == "close":
        backend.close()
        return None
    raise NvmlError(f"unknown method {method!r}")


if __name__ == "__main__":
    time.sleep(0)
    sys.exit(_serve())
