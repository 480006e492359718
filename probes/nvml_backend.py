"""The NVML boundary: a small backend protocol, the field catalogue, and the real nvidia-ml-py backend.

Every GPU reading sdcwatch takes goes through `NvmlBackend`. Two implementations exist and the probe code
(`probes.nvml_probe`) is the same over both:

- `PynvmlBackend` (this module) on nvidia-ml-py (`import pynvml`);
- `probes.nvml_fake.ScenarioBackend`, driven by a scenario file, for CPU tests and alert rehearsal.

Lifecycle (the same for both):

1. construct: the backend initialises NVML once (`nvmlInit`) or raises `NvmlUnavailable` with the reason;
2. `device_count()` and `identity(index)` to discover GPUs (the probe then names every GPU by UUID and PCI
   bus id; the index is only this session's handle);
3. `read_fields(index, names)` on every poll; names come from `probes.nvml_fields.field_specs()`;
4. XID events: `xid_open()` once, then `xid_wait(timeout_ms)` in a loop on a dedicated thread, each
   event followed by `xid_drain(max_events)` (what else is queued, folded), `xid_close()` at the end;
5. `close()`: `nvmlShutdown`. No other method may be called after it.

Errors (in `probes.nvml_types`, with the identity and XID values every backend returns): one root,
`NvmlError`, with `transient` telling whether a retry may succeed. `FieldNotSupported`
(NVML_ERROR_NOT_SUPPORTED, or a function this driver lacks) is not a fault: the probe records the field as
unsupported on that GPU. `GpuLost` (the GPU fell off the bus) and `GpuNeedsReset` are fatal for that GPU;
`NvmlUnavailable` (no library, no driver, version mismatch) is fatal for the backend.

`read_fields` returns, per requested name, either the value (int or float) or the `NvmlError` instance
for that one field, so one unsupported field never hides the others. It raises only when the whole
device is unreachable (`GpuLost`) or NVML itself is gone.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, Callable, Mapping, Protocol, Sequence, runtime_checkable

from probes.nvml_fake import ScenarioBackend
from probes.nvml_fields import EVENT_TYPES, FIELD_VALUES_CALL, FieldSpec, spec_for
from probes.nvml_isolated import IsolatedBackend
from probes.nvml_types import (EventFold, FieldNotSupported, GpuIdentity, GpuLost, GpuNeedsReset, NvmlError,
                               NvmlUnavailable, RawXid)

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------------------------------
# The protocol
# ----------------------------------------------------------------------------------------------------------


@runtime_checkable
class NvmlBackend(Protocol):
    """What the probe needs from NVML; see the module docstring for the lifecycle and error contract."""

    def device_count(self) -> int: ...

    def identity(self, index: int) -> GpuIdentity: ...

    def read_fields(self, index: int, names: Sequence[str]) -> dict[str, int | float | NvmlError]: ...

    def xid_open(self) -> dict[int, list[str]]: ...

    def xid_wait(self, timeout_ms: int) -> RawXid | None: ...

    def xid_drain(self, max_events: int) -> list[RawXid]: ...

    def xid_close(self) -> None: ...

    def close(self) -> None: ...


# ----------------------------------------------------------------------------------------------------------
# The real backend
# ----------------------------------------------------------------------------------------------------------

# NVML return codes (nvml.h), mapped to our errors.
_NOT_SUPPORTED = 3
_FUNCTION_NOT_FOUND = 13
_GPU_IS_LOST = 15
_RESET_REQUIRED = 16
_UNAVAILABLE_CODES = {1, 9, 12, 18}  # uninitialized, driver not loaded, library not found, lib/RM mismatch
_TRANSIENT_CODES = {10, 11, 19, 20, 23, 27, 999}  # timeout, irq, in use, memory, resources, not ready, unknown
_XID_EVENT_TYPE = EVENT_TYPES["xid"]


def read_many(backend: NvmlBackend, requests: Sequence[tuple[int, Sequence[str]]]
              ) -> list[dict[str, int | float | NvmlError] | NvmlError]:
    """One poll's reads of several GPUs: per request, the values or the `NvmlError` its read raised. A backend
    with its own `read_many` (the NVML child: one round trip instead of one per GPU) answers all at once."""
    many = getattr(backend, "read_many", None)
    if many is not None:
        return list(many(requests))
    out: list[dict[str, int | float | NvmlError] | NvmlError] = []
    for index, names in requests:
        try:
            out.append(backend.read_fields(index, names))
        except NvmlError as err:
            out.append(err)
    return out


def map_nvml_error(exc: BaseException, what: str = "") -> NvmlError:
    """Turn a pynvml exception (anything with `.value`, the NVML return code) into our error classes."""
    code = getattr(exc, "value", None)
    msg = f"{what}: {exc}" if what else str(exc)
    if code in (_NOT_SUPPORTED, _FUNCTION_NOT_FOUND):
        return FieldNotSupported(msg, code=code)
    if code == _GPU_IS_LOST:
        return GpuLost(msg, code=code)
    if code == _RESET_REQUIRED:
        return GpuNeedsReset(msg, code=code)
    if code in _UNAVAILABLE_CODES:
        return NvmlUnavailable(msg, code=code)
    return NvmlError(msg, code=code if isinstance(code, int) else None, transient=code in _TRANSIENT_CODES)


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _field_value(fv: Any) -> int | float:
    """Decode one nvmlFieldValue_t by its valueType (nvmlValueType_t)."""
    vt = int(fv.valueType)
    v = fv.value
    return {0: lambda: float(v.dVal), 1: lambda: int(v.uiVal), 2: lambda: int(v.ulVal),
            3: lambda: int(v.ullVal), 4: lambda: int(v.sllVal), 5: lambda: int(v.siVal),
            6: lambda: int(v.usVal)}.get(vt, lambda: int(v.ullVal))()


class PynvmlBackend:
    """`NvmlBackend` on nvidia-ml-py. `nvmlInit` here, `nvmlShutdown` in `close()`.

    Raises `NvmlUnavailable` (with the reason) when the library or driver is missing."""

    def __init__(self, pynvml_module: Any = None) -> None:
        try:
            if pynvml_module is None:
                import pynvml as pynvml_module  # noqa: PLC0415  (optional at import time)
        except ImportError as exc:  # pragma: no cover - pynvml is a dependency
            raise NvmlUnavailable(f"nvidia-ml-py is not installed: {exc}") from exc
        self._nv = pynvml_module
        try:
            self._nv.nvmlInit()
        except self._nv.NVMLError as exc:
            err = map_nvml_error(exc, "nvmlInit")
            raise NvmlUnavailable(f"NVML unavailable: {err}", code=err.code) from exc
        except OSError as exc:
            raise NvmlUnavailable(f"NVML unavailable: {exc}") from exc
        self._closed = False
        self._handles: dict[int, Any] = {}
        self._event_set: Any = None
        self._lock = threading.Lock()
        self._driver_version: str | None = None
        self._events_fallback = False
        # SDCWATCH_NVML_TIMING=1 (benchmarks): seconds of each NVML call group, by call, for `call_times`
        self.call_times: dict[str, list[float]] | None = {} if os.environ.get("SDCWATCH_NVML_TIMING") else None

    # -- helpers --------------------------------------------------------------------------------------------

    def _handle(self, index: int) -> Any:
        h = self._handles.get(index)
        if h is None:
            h = self._call("nvmlDeviceGetHandleByIndex", index)
            self._handles[index] = h
        return h

    def _call(self, fn_name: str, *args: Any) -> Any:
        if self._closed:
            raise NvmlError("backend is closed")
        fn = getattr(self._nv, fn_name, None)
        if fn is None:
            if fn_name == "nvmlDeviceGetCurrentClocksEventReasons":
                return self._call("nvmlDeviceGetCurrentClocksThrottleReasons", *args)
            raise FieldNotSupported(f"{fn_name} is not in this nvidia-ml-py")
        try:
            return fn(*args)
        except self._nv.NVMLError as exc:
            if (exc.value == _FUNCTION_NOT_FOUND and fn_name == "nvmlDeviceGetCurrentClocksEventReasons"):
                return self._call("nvmlDeviceGetCurrentClocksThrottleReasons", *args)
            raise map_nvml_error(exc, fn_name) from exc

    # -- protocol -------------------------------------------------------------------------------------------

    def device_count(self) -> int:
        return int(self._call("nvmlDeviceGetCount"))

    def identity(self, index: int) -> GpuIdentity:
        h = self._handle(index)
        uuid = _text(self._call("nvmlDeviceGetUUID", h))
        pci = self._call("nvmlDeviceGetPciInfo", h)
        bus_id = _text(getattr(pci, "busId", b"") or getattr(pci, "busIdLegacy", b""))
        name = _text(self._call("nvmlDeviceGetName", h))
        try:
            serial: str | None = _text(self._call("nvmlDeviceGetSerial", h))
        except NvmlError:
            serial = None
        if self._driver_version is None:
            try:
                self._driver_version = _text(self._call("nvmlSystemGetDriverVersion"))
            except NvmlError:
                self._driver_version = None
        return GpuIdentity(uuid=uuid, pci_bus_id=bus_id, name=name, index=index, serial=serial,
                           driver_version=self._driver_version)

    def read_fields(self, index: int, names: Sequence[str]) -> dict[str, int | float | NvmlError]:
        h = self._handle(index)
        out: dict[str, int | float | NvmlError] = {}
        fv_specs: list[FieldSpec] = []
        groups: dict[tuple[str, tuple[Any, ...]], list[FieldSpec]] = {}
        for name in names:
            spec = spec_for(name)
            if spec.call == FIELD_VALUES_CALL:
                fv_specs.append(spec)
            else:
                groups.setdefault((spec.call, spec.args), []).append(spec)
        timing = self.call_times
        for (call, args), specs in groups.items():
            t0 = time.perf_counter() if timing is not None else 0.0
            try:
                result = self._call(call, h, *args)
            except GpuLost:
                raise
            except NvmlError as err:
                for s in specs:
                    out[s.name] = err
                continue
            if timing is not None:
                timing.setdefault(f"{call}{args}", []).append(time.perf_counter() - t0)
            for s in specs:
                try:
                    out[s.name] = self._convert(s, result)
                except (AttributeError, IndexError, TypeError, ValueError) as exc:
                    out[s.name] = NvmlError(f"{call}: cannot decode {s.name}: {exc}")
        if fv_specs:
            t0 = time.perf_counter() if timing is not None else 0.0
            self._read_field_values(h, fv_specs, out)
            if timing is not None:
                key = f"{FIELD_VALUES_CALL}[{','.join(sorted({s.name.split('.')[0] for s in fv_specs}))}]"
                timing.setdefault(key, []).append(time.perf_counter() - t0)
        return out

    def _read_field_values(self, h: Any, specs: list[FieldSpec], out: dict[str, int | float | NvmlError]) -> None:
        try:
            values = self._call(FIELD_VALUES_CALL, h, [tuple(s.args) for s in specs])
        except GpuLost:
            raise
        except NvmlError as err:
            for s in specs:
                out[s.name] = err
            return
        for s, fv in zip(specs, values):
            ret = int(fv.nvmlReturn)
            if ret != 0:
                out[s.name] = map_nvml_error(_Code(ret), f"field {s.args[0]} scope {s.args[1]}")
                continue
            raw = _field_value(fv)
            out[s.name] = raw * s.scale if s.scale != 1.0 else raw

    @staticmethod
    def _convert(spec: FieldSpec, result: Any) -> int | float:
        if spec.pick == "len":
            value: Any = len(result)
        elif isinstance(spec.pick, int):
            value = result[spec.pick]
        elif isinstance(spec.pick, str):
            value = getattr(result, spec.pick)
        else:
            value = result
        if isinstance(value, float) or spec.scale != 1.0:
            return float(value) * spec.scale
        return int(value)

    def xid_open(self) -> dict[int, list[str]]:
        with self._lock:
            if self._event_set is None:
                self._event_set = self._call("nvmlEventSetCreate")
        registered: dict[int, list[str]] = {}
        for index in range(self.device_count()):
            handle = self._handle(index)
            try:
                supported = int(self._call("nvmlDeviceGetSupportedEventTypes", handle))
            except NvmlError as err:   # an older driver: XIDs only, as before
                log.info("GPU index %d: supported event types unknown (%s): XIDs only", index, err)
                supported = _XID_EVENT_TYPE
            names = [n for n, bit in EVENT_TYPES.items() if supported & bit]
            mask = sum(EVENT_TYPES[n] for n in names)
            try:
                self._call("nvmlDeviceRegisterEvents", handle, mask, self._event_set)
                registered[index] = names
            except NvmlError as err:
                log.warning("NVML events unavailable on GPU index %d: %s", index, err)
        return registered

    def xid_wait(self, timeout_ms: int) -> RawXid | None:
        if self._event_set is None:
            raise NvmlError("xid_wait before xid_open")
        fn = "nvmlEventSetWait_v2" if hasattr(self._nv, "nvmlEventSetWait_v2") else "nvmlEventSetWait"
        try:
            data = self._call(fn, self._event_set, int(timeout_ms))
        except NvmlError as err:
            if err.code == 10:  # NVML_ERROR_TIMEOUT: nothing happened
                return None
            raise
        kind = next((n for n, bit in EVENT_TYPES.items() if int(data.eventType) & bit), None)
        if kind is None:
            return None
        try:
            uuid: str | None = _text(self._call("nvmlDeviceGetUUID", data.device))
        except NvmlError:
            uuid = None
        return RawXid(uuid=uuid, xid=int(data.eventData), event=kind)

    def xid_drain(self, max_events: int) -> list[RawXid]:
        """The events queued now (no wait), at most `max_events` read, identical ones folded with their count:
        under a flood, one call (one message from the isolated child) for thousands of repeats."""
        fold = EventFold()
        for _ in range(max_events):
            ev = self.xid_wait(0)
            if ev is None:
                break
            fold.add((ev,))
        return fold.take()

    def xid_close(self) -> None:
        with self._lock:
            es, self._event_set = self._event_set, None
        if es is not None:
            try:
                self._call("nvmlEventSetFree", es)
            except NvmlError as err:
                log.warning("nvmlEventSetFree failed: %s", err)

    def close(self) -> None:
        if self._closed:
            return
        self.xid_close()
        try:
            self._nv.nvmlShutdown()
        except self._nv.NVMLError as exc:
            log.warning("nvmlShutdown failed: %s", exc)
        self._closed = True


class _Code(Exception):
    """A bare NVML return code shaped like a pynvml exception (for per-field returns)."""

    def __init__(self, value: int) -> None:
        super().__init__(f"NVML return code {value}")
        self.value = value


def open_backend(scenario: str | None = None, clock: Callable[[], float] | None = None) -> NvmlBackend:
    """The agent's one entry point: a `ScenarioBackend` for `--nvml-scenario FILE`, else `PynvmlBackend`.

    Raises `NvmlUnavailable` (the agent then runs with GPUs UNKNOWN and says why) and `ValueError` for a
    bad scenario file."""
    if scenario:
        return ScenarioBackend.from_file(scenario, clock=clock)
    if os.environ.get("SDCWATCH_NVML_INPROCESS") == "1":  # debugging only: NVML inside the agent process
        return PynvmlBackend()
    return IsolatedBackend()


def split_values(values: Mapping[str, Any]) -> tuple[dict[str, int | float], dict[str, NvmlError]]:
    """Separate a `read_fields` answer into (values, errors)."""
    ok: dict[str, int | float] = {}
    bad: dict[str, NvmlError] = {}
    for k, v in values.items():
        (bad if isinstance(v, NvmlError) else ok)[k] = v  # type: ignore[index]
    return ok, bad
