"""Byte buffers for the peer transport's bulk path, without the copies Python's API would add.

- `fresh_bytes(n)`: a new `bytes` of `n` bytes and a writable view of its storage, so a message (which gRPC
  takes only as `bytes`) is filled in place, e.g. read from a file with `os.preadv` straight into it, rather
  than read into one object and joined into another. The caller fills the view before the `bytes` is shared
  or hashed, and keeps the `bytes` alive while it uses the view (the view holds no reference to it).
- `copy_into(dst, src, start)`: copies `src[start:start + len(dst)]` into `dst` with the GIL released (a
  ctypes `memmove`), so the streams of a parallel read copy their chunks at the same time.

CPython only (the storage of a bytes object starts at `bytes.__basicsize__ - 1`): `available()` says
whether `fresh_bytes` works here; `copy_into` falls back to a plain copy.
"""
from __future__ import annotations

import ctypes
import platform

_CPYTHON = platform.python_implementation() == "CPython"
_SVAL = bytes.__basicsize__ - 1            # offsetof(PyBytesObject, ob_sval)
if _CPYTHON:
    _new_bytes = ctypes.pythonapi.PyBytes_FromStringAndSize
    _new_bytes.restype = ctypes.py_object
    _new_bytes.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t)


def fresh_bytes(n: int) -> tuple[bytes, memoryview]:
    """(a new bytes object of `n` uninitialised bytes, a writable byte view of its storage)."""
    if n < 0:
        raise ValueError(f"fresh_bytes: negative size {n}")
    if not _CPYTHON or n == 0:
        raise NotImplementedError("fresh_bytes needs CPython and n > 0")
    b = _new_bytes(None, n)
    return b, memoryview((ctypes.c_char * n).from_address(id(b) + _SVAL)).cast("B")


def available() -> bool:
    return _CPYTHON


def copy_into(dst: memoryview, src: bytes, start: int) -> None:
    """dst[:] = src[start:start + len(dst)], the GIL released during the copy (for a large dst and `src` an
    exact `bytes`, whose storage is at a known place; anything else is a plain copy)."""
    n = len(dst)
    if start < 0 or start + n > len(src):
        raise ValueError(f"copy_into: {n} bytes at {start} exceed the source's {len(src)}")
    if not _CPYTHON or type(src) is not bytes or n < (64 << 10) or dst.readonly:
        dst[:] = memoryview(src)[start:start + n]
        return
    target = (ctypes.c_char * n).from_buffer(dst)
    ctypes.memmove(target, id(src) + _SVAL + start, n)
