"""`IsolatedBackend`: the real NVML backend in child processes, so a crash or a wedge inside the NVML
library or its Python bindings cannot take the agent down.

Seen on an H200 host (driver 580.159.04, nvidia-ml-py 13): after some hundred polls of every field, glibc
aborted the process with "free(): corrupted unsorted chunks"; every field group alone and the XID wait alone
ran clean (`bench/nvml_diag.py`). Whatever corrupts the heap, it now corrupts a child's: the child dies, the
call raises a transient `NvmlError`, the probe records a failed poll, and the next call starts a new child.

Two children: one answers identity and field reads, the other waits for XID events (a blocking wait must
not delay polls). Each speaks JSON lines over its stdin/stdout; nothing is unpickled. A call that does not
answer within `call_timeout_s` kills its child (the agent's probe runner marks the probe HUNG before that,
after its own shorter timeout, and does not re-enter meanwhile).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import selectors
import subprocess
import sys
import threading
import time
from typing import Any, Sequence

from probes.nvml_backend import (
    FieldNotSupported,
    GpuIdentity,
    GpuLost,
    GpuNeedsReset,
    NvmlError,
    NvmlUnavailable,
    RawXid,
)

log = logging.getLogger(__name__)

_ERRORS: dict[str, type[NvmlError]] = {c.__name__: c for c in (NvmlError, FieldNotSupported, NvmlUnavailable,
                                                                GpuLost, GpuNeedsReset)}


def _err_to_json(err: NvmlError) -> dict[str, Any]:
    return {"__nvml_error__": type(err).__name__, "msg": str(err), "code": err.code, "transient": err.transient}


def _err_from_json(d: dict[str, Any]) -> NvmlError:
    cls = _ERRORS.get(d.get("__nvml_error__", ""), NvmlError)
    return cls(str(d.get("msg", "")), code=d.get("code"), transient=bool(d.get("transient", False)))


def _values_from_json(raw: dict[str, Any]) -> dict[str, int | float | NvmlError]:
    return {k: (_err_from_json(v) if isinstance(v, dict) else v) for k, v in raw.items()}


def _values_to_json(vals: dict[str, Any]) -> dict[str, Any]:
    return {k: (_err_to_json(v) if isinstance(v, NvmlError) else v) for k, v in vals.items()}


class _Child:
    """One child process running `python -m probes.nvml_isolated`; calls are serialised by a lock."""

    def __init__(self, name: str, call_timeout_s: float) -> None:
        self.name = name
        self.call_timeout_s = call_timeout_s
        self.proc: subprocess.Popen[bytes] | None = None
        self.lock = threading.Lock()
        self.next_id = 0
        self.restarts = 0

    def _start(self) -> None:
        env = dict(os.environ)
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        self.proc = subprocess.Popen([sys.executable, "-m", "probes.nvml_isolated"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=None, env=env, close_fds=True)

    def _kill(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()

    def call(self, method: str, *args: Any) -> Any:
        with self.lock:
            if self.proc is None or self.proc.poll() is not None:
                if self.proc is not None:
                    self.restarts += 1
                    log.warning("NVML child %s exited (%s); starting a new one", self.name, self.proc.returncode)
                self._start()
            assert self.proc is not None and self.proc.stdin is not None and self.proc.stdout is not None
            self.next_id += 1
            line = json.dumps({"id": self.next_id, "method": method, "args": list(args)}) + "\n"
            try:
                self.proc.stdin.write(line.encode())
                self.proc.stdin.flush()
                reply = self._read_line(self.proc.stdout)
            except (BrokenPipeError, OSError):
                reply = None
            if reply is None:
                code = self.proc.poll()
                if code is None and self.proc.stdout is not None and self._eof(self.proc.stdout):
                    try:  # its pipe closed: it is dying, not hung; give it a moment to be reaped
                        code = self.proc.wait(2)
                    except subprocess.TimeoutExpired:
                        code = None
                self._kill()
                what = (f"died (exit {code}, e.g. a crash inside the NVML library)" if code is not None
                        else f"did not answer {method} within {self.call_timeout_s}s and was killed")
                raise NvmlError(f"NVML child process {what}", transient=True)
            msg = json.loads(reply)
            if "error" in msg:
                raise _err_from_json(msg["error"])
            return msg.get("result")

    @staticmethod
    def _eof(stream: Any) -> bool:
        sel = selectors.DefaultSelector()
        sel.register(stream, selectors.EVENT_READ)
        try:
            return bool(sel.select(0)) and not stream.peek(1)
        except (OSError, ValueError):
            return True
        finally:
            sel.close()

    def _read_line(self, stream: Any) -> bytes | None:
        sel = selectors.DefaultSelector()
        sel.register(stream, selectors.EVENT_READ)
        try:
            if not sel.select(self.call_timeout_s):
                return None
        finally:
            sel.close()
        line = stream.readline()
        return line or None

    def close(self) -> None:
        with self.lock:
            proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            try:
                assert proc.stdin is not None
                proc.stdin.close()
                proc.wait(2)
            except (OSError, subprocess.TimeoutExpired):
                proc.kill()
                proc.wait()


class IsolatedBackend:
    """`NvmlBackend` over child processes running `PynvmlBackend` (see the module docstring)."""

    def __init__(self, call_timeout_s: float = 60.0) -> None:
        self._poll = _Child("poll", call_timeout_s)
        self._xid = _Child("xid", call_timeout_s)
        try:
            self._poll.call("ping")  # raises NvmlUnavailable when NVML cannot start: the agent says why
        except NvmlError:
            self.close()
            raise

    @property
    def restarts(self) -> int:
        return self._poll.restarts + self._xid.restarts

    def device_count(self) -> int:
        return int(self._poll.call("device_count"))

    def identity(self, index: int) -> GpuIdentity:
        return GpuIdentity(**self._poll.call("identity", index))

    def read_fields(self, index: int, names: Sequence[str]) -> dict[str, int | float | NvmlError]:
        return _values_from_json(self._poll.call("read_fields", index, list(names)))

    def read_many(self, requests: Sequence[tuple[int, Sequence[str]]]
                  ) -> list[dict[str, int | float | NvmlError] | NvmlError]:
        """Every GPU's read in one round trip: waking the idle child costs more than most reads (H200 VM)."""
        try:
            replies = self._poll.call("read_many", [[index, list(names)] for index, names in requests])
        except NvmlError as err:  # the child died or hung: every GPU's read failed with it
            return [err] * len(requests)
        return [_err_from_json(r["error"]) if "error" in r else _values_from_json(r["ok"]) for r in replies]

    def xid_open(self) -> list[int]:
        return list(self._xid.call("xid_open"))

    def xid_wait(self, timeout_ms: int) -> RawXid | None:
        r = self._xid.call("xid_wait", int(timeout_ms))
        return None if r is None else RawXid(uuid=r["uuid"], xid=int(r["xid"]))

    def xid_close(self) -> None:
        try:
            self._xid.call("xid_close")
        except NvmlError as err:
            log.warning("xid_close: %s", err)

    def close(self) -> None:
        for child in (self._poll, self._xid):
            if child.proc is not None and child.proc.poll() is None:
                try:
                    child.call("close")
                except NvmlError:
                    pass
            child.close()


# -- the child --------------------------------------------------------------------------------------------
def _serve() -> int:
    from probes.nvml_backend import PynvmlBackend

    backend: Any = None
    init_error: NvmlError | None = None
    try:
        scenario = os.environ.get("SDCWATCH_NVML_CHILD_SCENARIO")  # tests: the same child over the fake
        if scenario:
            from probes.nvml_fake import ScenarioBackend

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
            reply = {"id": req["id"], "error": _err_to_json(err)}
        except Exception as exc:  # a bug here must answer, not hang the parent
            reply = {"id": req["id"], "error": _err_to_json(NvmlError(f"{type(exc).__name__}: {exc}"))}
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
        return _values_to_json(backend.read_fields(*args))
    if method == "read_many":
        out = []
        for index, names in args[0]:
            try:
                out.append({"ok": _values_to_json(backend.read_fields(index, names))})
            except NvmlError as err:
                out.append({"error": _err_to_json(err)})
        return out
    if method == "xid_open":
        return backend.xid_open()
    if method == "xid_wait":
        ev = backend.xid_wait(*args)
        return None if ev is None else {"uuid": ev.uuid, "xid": ev.xid}
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
