"""`float32_gemms()`: the harness's CPU ranks under bf16/fp16 autocast compute their matmuls as a GPU's tensor
cores do, in float32.

On a CPU without bf16/fp16 matrix instructions (AVX2 only: this VM and the CI machine; torch's oneDNN path
needs AVX-512 or AMX), torch's bf16 and fp16 GEMMs are a reference loop: 9-35x slower than float32's (a
[4, 256, 64] x [4, 64, 256] bf16 baddbmm 21 ms against 0.6 ms in float32), and in the tests that train a
tiny GPT or MoE under CPU autocast most of a step's time. Here aten's mm, addmm, bmm and baddbmm, at the CPU
dispatch key, take bf16/fp16 inputs up to float32 (the products of 8- or 11-bit significands are exact
there), sum in float32 and round the result once to the input's dtype: what a tensor core's GEMM with
float32 accumulation does. Registered below every dispatch mode, so the fault injection (MatmulFault), the
op witness and sdcguard see the same op, dtype and output shape as before; float32 and float64 go to torch's
own `out=` kernels, bit for bit the functional ones'. A process-wide change for the harness's ranks only;
not where torch's own bf16 GEMM is fast (oneDNN's bf16 supported).
"""
from __future__ import annotations

from typing import Any, Callable

import torch

LOW = (torch.bfloat16, torch.float16)
_registered: list[torch.library.Library] = []      # kept alive: dropping the Library unregisters its kernels


def _gemm(out_op: Callable[..., torch.Tensor], mat: int) -> Callable[..., torch.Tensor]:
    """A kernel for the functional op whose `out=` overload is `out_op`; its first matrix is argument `mat`
    (1 for addmm and baddbmm, after the added input)."""
    def kernel(*args: Any, **kwargs: Any) -> torch.Tensor:
        dtype = args[mat].dtype
        if dtype not in LOW:
            return out_op(*args, **kwargs, out=torch.empty(0, dtype=dtype))
        wide = [a.float() if isinstance(a, torch.Tensor) else a for a in args]
        return out_op(*wide, **kwargs, out=torch.empty(0, dtype=torch.float32)).to(dtype)
    return kernel


def float32_gemms() -> bool:
    """Register the float32 GEMMs for bf16/fp16 CPU tensors in this process (once); False where torch's own
    bf16 GEMM is fast, and nothing is registered."""
    if _registered:
        return True
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return False
    import warnings

    lib = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():          # "Overriding a previously registered kernel": that is the point
        warnings.simplefilter("ignore", UserWarning)
        for name, mat in (("mm", 0), ("addmm", 1), ("bmm", 0), ("baddbmm", 1)):
            lib.impl(name, _gemm(getattr(torch.ops.aten, name).out, mat), "CPU")
    _registered.append(lib)
    return True
