"""`IsolatedBackend`: the real NVML backend in child processes, so a crash or a wedge inside the NVML
library or its Python bindings cannot take the agent down.

Seen on an H200 host (driver 580.159.04, nvidia-ml-py 13): after some hundred polls of every field, glibc
aborted the process with "free(): corrupted unsorted chunks"; every field group alone and the XID wait alone
ran clean (`bench/nvml_diag.py`). Whatever corrupts the heap, it now corrupts a child's: the child dies, the
call raises a transient `NvmlError`, the probe records a failed poll, and the next call starts a new child.

Two children: one answers identity and field reads, the other waits for XID events (a blocking wait must
not delay polls). Each speaks JSON lines over its stdin/stdout; nothing is unpickled. A call that does not
answer within `call_timeout_s` kills its child (the agent's probe runner marks the probe HUNG before that,
after its own shorter timeout, and does not re-enter meanwhile). The child's side is `probes.nvml_child`;
the JSON codec of errors and values (below) is shared by both.
"""
from __future__ import annotations

import json
import logging
import os
import selectors
import subprocess
import sys
import threading
from typing import Any, Sequence

from probes.nvml_types import FieldNotSupported, GpuIdentity, GpuLost, GpuNeedsReset, NvmlError, NvmlUnavailable, RawXid

log = logging.getLogger(__name__)

_ERRORS: dict[str, type[NvmlError]] = {c.__name__: c for c in (NvmlError, FieldNotSupported, NvmlUnavailable,
                                                                GpuLost, GpuNeedsReset)}


def error_to_json(err: NvmlError) -> dict[str, Any]:
    return {"__nvml_error__": type(err).__name__, "msg": str(err), "code": err.code, "transient": err.transient}


def error_from_json(d: dict[str, Any]) -> NvmlError:
    cls = _ERRORS.get(d.get("__nvml_error__", ""), NvmlError)
    return cls(str(d.get("msg", "")), code=d.get("code"), transient=bool(d.get("transient", False)))


def values_from_json(raw: dict[str, Any]) -> dict[str, int | float | NvmlError]:
    return {k: (error_from_json(v) if isinstance(v, dict) else v) for k, v in raw.items()}


def values_to_json(vals: dict[str, Any]) -> dict[str, Any]:
    return {k: (error_to_json(v) if isinstance(v, NvmlError) else v) for k, v in vals.items()}


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
        self.proc = subprocess.Popen([sys.executable, "-m", "probes.nvml_child"], stdin=subprocess.PIPE,
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
                raise error_from_json(msg["error"])
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
        return values_from_json(self._poll.call("read_fields", index, list(names)))

    def read_many(self, requests: Sequence[tuple[int, Sequence[str]]]
                  ) -> list[dict[str, int | float | NvmlError] | NvmlError]:
        """Every GPU's read in one round trip: waking the idle child costs more than most reads (H200 VM)."""
        try:
            replies = self._poll.call("read_many", [[index, list(names)] for index, names in requests])
        except NvmlError as err:  # the child died or hung: every GPU's read failed with it
            return [err] * len(requests)
        return [error_from_json(r["error"]) if "error" in r else values_from_json(r["ok"]) for r in replies]

    def xid_open(self) -> dict[int, list[str]]:
        return {int(i): list(names) for i, names in self._xid.call("xid_open")}

    def xid_wait(self, timeout_ms: int) -> RawXid | None:
        r = self._xid.call("xid_wait", int(timeout_ms))
        return None if r is None else RawXid(uuid=r["uuid"], xid=int(r["xid"]), event=str(r.get("event", "xid")))

    def xid_drain(self, max_events: int) -> list[RawXid]:
        return [RawXid(uuid=r["uuid"], xid=int(r["xid"]), event=str(r.get("event", "xid")), count=int(r["count"]))
                for r in self._xid.call("xid_drain", int(max_events))]

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
