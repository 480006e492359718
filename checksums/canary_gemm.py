"""Known-answer GEMM canaries: inputs whose exact product is known, compared bit for bit.

Construction (`KnownAnswerSpec`, `build_inputs`, `expected_output`):

- A base tile ``A0`` (m0 x K) and ``B0`` (K x n0) of small integers in [-ra, ra] and [-rb, rb] (seeded);
  m0 = min(M, 256), n0 = min(N, 256). The full inputs repeat the base tiles with a sign and a power-of-two
  scale per row of A and per column of B::

      A[i, k] = sa_i * 2**ea_i * A0[i % m0, k]        B[k, j] = sb_j * 2**eb_j * B0[k, j % n0]
      C[i, j] = sa_i * sb_j * 2**(ea_i + eb_j) * C0[i % m0, j % n0],   C0 = A0 @ B0

  so the exact answer costs one small product (C0, computed once on the CPU in exact integer arithmetic:
  float64 BLAS on integers whose sums stay below 2**53, converted to int64 and checked) and the scales make
  the exponents and signs differ from tile to tile.
- Exactness is guaranteed, not probable: ``K * ra * rb * 2**(2*max_exp) < 2**24``, so every product and
  every partial sum, in any order and any split of K, is an integer exactly representable in fp32. With fp32
  accumulation (reduced-precision split-K reductions switched off, `exact_matmul_settings`) the accumulator
  holds the exact integer; the only rounding is the final conversion to the output dtype (none for fp32
  outputs; one round-to-nearest-even for bf16/fp16 outputs, which the reference applies the same way).
- Input values are exactly representable in every input dtype: |values| <= 16 (fp8 e4m3), <= 8 (fp8
  e5m2), with exponents well inside range; TF32 keeps 11 significant bits, so integers <= 2048 are exact.

Comparison: the output's fingerprint (checksums.fingerprint) against the expected one; only on a mismatch
is the full output compared element by element (`localise`) to name the wrong rows, columns and tiles.

The matmul itself is a parameter (`Matmul`), so fault injection (probes.canary_faults) wraps it instead of
adding a special path here. The result types (`Status`, `DeviceInfo`, `CheckResult`) are torch-free and
live in `sdcwatch.canary`, so the agent reads canary results without loading torch.

The agent's canary suite (probes.canary_suite) and the Monitor's in-job canary (checksums.canary_injob)
both build on this module; it sits with the fingerprint it compares by, below both.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import time
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch

from checksums.fingerprint import fingerprint_tensor
from sdcwatch.canary import ALL_DTYPES, CheckResult, DeviceInfo, Status

log = logging.getLogger(__name__)

EXACT_LIMIT = 1 << 24            # fp32 holds every integer below this exactly
BASE_TILE = 256
DEFAULT_TILE = (128, 128)        # the tile size used to name wrong regions of an output
MAX_POSITIONS = 64               # mismatch positions kept in a report / evidence file


# ----------------------------------------------------------------------------- dtypes


@dataclasses.dataclass(frozen=True, slots=True)
class DtypeInfo:
    name: str
    a_dtype: torch.dtype
    b_dtype: torch.dtype
    out_dtype: torch.dtype        # the output dtype of the plain op
    max_int_a: int                # largest integer magnitude exact in the A dtype
    max_int_b: int
    tf32: bool = False
    scaled: bool = False          # runs through torch._scaled_mm
    min_cc: tuple[int, int] = (0, 0)


def _fp8(name: str) -> torch.dtype | None:
    return getattr(torch, name, None)


def dtype_table() -> dict[str, DtypeInfo]:
    t: dict[str, DtypeInfo] = {
        "fp32": DtypeInfo("fp32", torch.float32, torch.float32, torch.float32, 2048, 2048),
        "tf32": DtypeInfo("tf32", torch.float32, torch.float32, torch.float32, 2048, 2048, tf32=True,
                          min_cc=(8, 0)),
        "fp16": DtypeInfo("fp16", torch.float16, torch.float16, torch.float16, 2048, 2048, min_cc=(7, 0)),
        "bf16": DtypeInfo("bf16", torch.bfloat16, torch.bfloat16, torch.bfloat16, 256, 256, min_cc=(8, 0)),
    }
    e4, e5 = _fp8("float8_e4m3fn"), _fp8("float8_e5m2")
    if e4 is not None and e5 is not None:
        # cuBLASLt has no e5m2 x e5m2 kernel; "fp8_e5m2" multiplies an e5m2 A by an e4m3 B.
        t["fp8_e4m3"] = DtypeInfo("fp8_e4m3", e4, e4, torch.bfloat16, 16, 16, scaled=True, min_cc=(8, 9))
        t["fp8_e5m2"] = DtypeInfo("fp8_e5m2", e5, e4, torch.bfloat16, 8, 16, scaled=True, min_cc=(8, 9))
    return t


def supported_dtypes(device: torch.device | str) -> tuple[list[str], dict[str, str]]:
    """(the canary dtypes this device runs, {dtype: why not} for the others)."""
    device = torch.device(device)
    table = dtype_table()
    ok: list[str] = []
    why: dict[str, str] = {}
    if device.type != "cuda":
        for name in ALL_DTYPES:
            if name == "fp32":
                ok.append(name)
            else:
                why[name] = f"only fp32 is checked on the {device.type}"
        return ok, why
    cc = torch.cuda.get_device_capability(device)
    for name in ALL_DTYPES:
        info = table.get(name)
        if info is None:
            why[name] = f"torch {torch.__version__} has no float8 dtypes"
        elif cc < info.min_cc:
            why[name] = f"needs compute capability {info.min_cc[0]}.{info.min_cc[1]}, device has {cc[0]}.{cc[1]}"
        else:
            ok.append(name)
    return ok, why


# ----------------------------------------------------------------------------- the spec


@dataclasses.dataclass(frozen=True, slots=True)
class KnownAnswerSpec:
    """One known-answer GEMM: C[M, N] = A[M, K] @ B[K, N] in `dtype`, inputs drawn from `seed`.

    `out` is "native" (the op's usual output dtype) or "fp32" (fp32 output: bf16/fp16 through
    `torch.mm(..., out_dtype=torch.float32)`, fp8 through `_scaled_mm(out_dtype=float32)`)."""

    dtype: str
    m: int
    n: int
    k: int
    seed: int = 0
    shape_name: str = ""
    out: str = "native"
    density: float = 1.0          # fraction of nonzero input entries

    def __post_init__(self) -> None:
        if self.dtype not in dtype_table():
            raise ValueError(f"unknown canary dtype {self.dtype!r}; known: {sorted(dtype_table())}")
        for name in ("m", "n", "k"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"KnownAnswerSpec.{name} must be >= 1, got {getattr(self, name)}")
        if self.out not in ("native", "fp32"):
            raise ValueError(f"KnownAnswerSpec.out must be 'native' or 'fp32', got {self.out!r}")
        if not 0.0 < self.density <= 1.0:
            raise ValueError(f"KnownAnswerSpec.density must be in (0, 1], got {self.density}")
        info = dtype_table()[self.dtype]
        if info.scaled and (self.k % 16 or self.n % 16 or self.m % 16):
            raise ValueError(f"fp8 canaries need M, N, K multiples of 16, got {self.m}x{self.n}x{self.k}")
        ra, rb, _ = value_ranges(self)
        if ra < 1 or rb < 1:
            raise ValueError(f"K={self.k} is too large for an exact {self.dtype} canary "
                             f"(needs K * ra * rb < 2**24 with ra, rb >= 1)")

    @property
    def info(self) -> DtypeInfo:
        return dtype_table()[self.dtype]

    @property
    def name(self) -> str:
        tag = f"/{self.shape_name}" if self.shape_name else ""
        out = "" if self.out == "native" else "/out-fp32"
        return f"gemm/{self.dtype}{tag}/{self.m}x{self.n}x{self.k}{out}"

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.n * self.k

    @property
    def out_dtype(self) -> torch.dtype:
        return torch.float32 if self.out == "fp32" else self.info.out_dtype

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "KnownAnswerSpec":
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - fields
        if unknown:
            raise ValueError(f"unknown fields in a known-answer spec: {sorted(unknown)}")
        return cls(**dict(d))


def value_ranges(spec: KnownAnswerSpec) -> tuple[int, int, int]:
    """(ra, rb, max_exp): the integer ranges of A and B and the largest row/column exponent, chosen so
    that K * ra * rb * 2**(2 * max_exp) < 2**24 (every partial sum exact in fp32) and, for fp16 outputs,
    so that 8 * sqrt(K) * ra * rb * 4**max_exp stays below fp16's largest value (no overflow in practice;
    an overflow would still compare equal, as inf on both sides)."""
    info = dtype_table()[spec.dtype]
    out_max = 65504.0 if spec.out_dtype == torch.float16 else math.inf
    ra = min(info.max_int_a, 7 if not info.scaled else 4)
    rb = min(info.max_int_b, 7 if not info.scaled else 4)

    def fits(ra: int, rb: int, e: int) -> bool:
        return (spec.k * ra * rb * 4 ** e < EXACT_LIMIT
                and 8.0 * math.sqrt(spec.k) * ra * rb * 4 ** e < out_max)

    while ra > 1 and not fits(ra, rb, 0):
        ra, rb = max(1, ra - 1), max(1, rb - 1)
    if spec.k * ra * rb >= EXACT_LIMIT:
        return 0, 0, 0
    max_exp = 0
    cap = 1 if info.scaled else 3
    while max_exp < cap and fits(ra, rb, max_exp + 1):
        max_exp += 1
    return ra, rb, max_exp


# ----------------------------------------------------------------------------- construction


@dataclasses.dataclass(frozen=True, slots=True)
class BaseTiles:
    a0: torch.Tensor              # float32 [m0, K], integers
    b0: torch.Tensor              # float32 [K, n0], integers
    row_scale: torch.Tensor       # float32 [M], +-2**e
    col_scale: torch.Tensor       # float32 [N], +-2**e
    c0: torch.Tensor              # int64 [m0, n0], exact


def _ints(gen: torch.Generator, shape: tuple[int, ...], r: int, density: float) -> torch.Tensor:
    v = torch.randint(-r, r + 1, shape, generator=gen, dtype=torch.int64)
    if density < 1.0:
        keep = torch.rand(shape, generator=gen) < density
        v = v * keep
    return v.to(torch.float32)


def _scales(gen: torch.Generator, n: int, max_exp: int) -> torch.Tensor:
    sign = torch.randint(0, 2, (n,), generator=gen) * 2 - 1
    exp = torch.randint(0, max_exp + 1, (n,), generator=gen)
    return (sign * torch.pow(2.0, exp.to(torch.float64))).to(torch.float32)


@functools.lru_cache(maxsize=32)
def base_tiles(spec: KnownAnswerSpec) -> BaseTiles:
    """The seeded base tiles and the exact C0 (CPU; cached per spec)."""
    ra, rb, max_exp = value_ranges(spec)
    gen = torch.Generator().manual_seed(int(spec.seed) & 0x7FFFFFFFFFFFFFFF)
    m0, n0 = min(spec.m, BASE_TILE), min(spec.n, BASE_TILE)
    a0 = _ints(gen, (m0, spec.k), ra, spec.density)
    b0 = _ints(gen, (spec.k, n0), rb, spec.density)
    row = _scales(gen, spec.m, max_exp)
    col = _scales(gen, spec.n, max_exp)
    c0_f64 = a0.double() @ b0.double()          # integers with |partial sums| < 2**24 << 2**53: exact
    c0 = c0_f64.to(torch.int64)
    if not torch.equal(c0.double(), c0_f64):
        raise AssertionError("known-answer reference is not integral (construction bug)")
    bound = spec.k * ra * rb
    if int(c0.abs().max()) >= EXACT_LIMIT or bound * 4 ** max_exp >= EXACT_LIMIT:
        raise AssertionError("known-answer reference outside the exact fp32 range (construction bug)")
    return BaseTiles(a0, b0, row, col, c0)


def _expand_rows(t0: torch.Tensor, n: int) -> torch.Tensor:
    reps = -(-n // t0.shape[0])
    return t0.repeat(reps, 1)[:n]


def build_inputs(spec: KnownAnswerSpec, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """A [M, K] and B [K, N] on `device`, in the spec's input dtypes (B column-major for fp8)."""
    tiles = base_tiles(spec)
    device = torch.device(device)
    info = spec.info
    a0 = tiles.a0.to(device)
    b0 = tiles.b0.to(device)
    a = _expand_rows(a0, spec.m) * tiles.row_scale.to(device)[:, None]
    bt = _expand_rows(b0.t().contiguous(), spec.n) * tiles.col_scale.to(device)[:, None]   # [N, K]
    a, bt = a + 0.0, bt + 0.0        # -0 (zero times a negative scale) -> +0
    a = a.to(info.a_dtype).contiguous()
    if info.scaled:
        b = bt.to(info.b_dtype).contiguous().t()          # column-major [K, N], as _scaled_mm wants
    else:
        b = bt.t().contiguous().to(info.b_dtype)
    return a, b


def expected_output(spec: KnownAnswerSpec, device: torch.device | str = "cpu") -> torch.Tensor:
    """The exact C, rounded once (round to nearest even) to the output dtype, on `device`.

    Built from the exact integer C0 by sign and power-of-two scaling (exact in float32: |C| < 2**24 and
    the scales are powers of two), then converted once."""
    tiles = base_tiles(spec)
    device = torch.device(device)
    c0 = tiles.c0.to(torch.float32).to(device)
    c = _expand_rows(c0, spec.m)
    c = _expand_rows(c.t().contiguous(), spec.n).t()
    c = c * tiles.row_scale.to(device)[:, None] * tiles.col_scale.to(device)[None, :]
    # An exact zero sum is +0 under round-to-nearest (x + (-x) = +0), never -0: canonicalise.
    c = c + 0.0
    return c.to(spec.out_dtype).contiguous()


_EXPECTED_FP: dict[tuple[KnownAnswerSpec, str], tuple[int, ...]] = {}


def expected_fingerprint(spec: KnownAnswerSpec, device: torch.device | str = "cpu") -> tuple[int, ...]:
    """Fingerprint of `expected_output` (cached per spec; identical on every device by the spec)."""
    key = (spec, torch.device(device).type)
    fp = _EXPECTED_FP.get(key)
    if fp is None:
        fp = tuple(fingerprint_tensor(expected_output(spec, device)))
        if len(_EXPECTED_FP) > 256:
            _EXPECTED_FP.clear()
        _EXPECTED_FP[key] = fp
    return fp


# ----------------------------------------------------------------------------- precision settings


@contextlib.contextmanager
def exact_matmul_settings(tf32: bool) -> Iterator[None]:
    """Reduced-precision split-K reductions off, TF32 on or off as asked; all restored on exit.

    These are host-side flags read when a GEMM is launched, so toggling them around a canary launch does
    not synchronise the GPU."""
    m = torch.backends.cuda.matmul
    saved: list[tuple[str, Any]] = []

    def _set(name: str, value: Any) -> None:
        try:
            old = getattr(m, name)
        except (AttributeError, RuntimeError):
            return
        try:
            setattr(m, name, value)
            saved.append((name, old))
        except (AttributeError, RuntimeError, TypeError) as exc:
            log.debug("cannot set %s: %s", name, exc)

    for name in ("allow_fp16_reduced_precision_reduction", "allow_bf16_reduced_precision_reduction"):
        _set(name, False)
    try:
        before = len(saved)
        _set("allow_tf32", tf32)
        if len(saved) == before and hasattr(m, "fp32_precision"):
            _set("fp32_precision", "tf32" if tf32 else "ieee")
        yield
    finally:
        for name, old in reversed(saved):
            with contextlib.suppress(AttributeError, RuntimeError, TypeError):
                setattr(m, name, old)


# ----------------------------------------------------------------------------- the matmul


Matmul = Callable[[torch.Tensor, torch.Tensor, KnownAnswerSpec], torch.Tensor]


def default_matmul(a: torch.Tensor, b: torch.Tensor, spec: KnownAnswerSpec) -> torch.Tensor:
    """The plain op the canary checks: torch.mm, or torch._scaled_mm (unit scales) for fp8."""
    info = spec.info
    with exact_matmul_settings(info.tf32):
        if info.scaled:
            one = torch.ones((), dtype=torch.float32, device=a.device)
            return torch._scaled_mm(a, b, one, one, out_dtype=spec.out_dtype, use_fast_accum=False)
        if spec.out == "fp32" and a.dtype != torch.float32:
            return torch.mm(a, b, out_dtype=torch.float32)
        return torch.mm(a, b)


# ----------------------------------------------------------------------------- comparison


_BITS_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's raw bits as an integer tensor of the same shape (for bitwise comparison)."""
    return t.contiguous().view(_BITS_VIEW[t.element_size()])


@dataclasses.dataclass(slots=True)
class Mismatch:
    """Where an output differs from the expected one, bit for bit."""

    count: int
    total: int
    positions: list[dict[str, Any]]     # first MAX_POSITIONS: row, col, expected, actual, xor bits
    rows: list[int]
    cols: list[int]
    tiles: list[list[int]]              # [tile_row, tile_col] of tile (tile_size)
    tile_size: list[int]
    n_rows: int
    n_cols: int
    n_tiles: int
    pattern: str                        # element | row | column | rows | columns | tile | scattered

    def summary(self) -> str:
        where = {"element": f"element ({self.rows[0]}, {self.cols[0]})",
                 "row": f"row {self.rows[0]}", "column": f"column {self.cols[0]}",
                 "tile": f"tile {tuple(self.tiles[0])} ({self.tile_size[0]}x{self.tile_size[1]})"}
        loc = where.get(self.pattern, f"{self.n_rows} rows, {self.n_cols} columns, {self.n_tiles} tiles")
        return f"{self.count} of {self.total} elements wrong: {loc}"

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def localise(expected: torch.Tensor, actual: torch.Tensor,
             tile: Sequence[int] = DEFAULT_TILE, max_positions: int = MAX_POSITIONS) -> Mismatch | None:
    """Compare two 2-D outputs bit for bit; None when identical, else where they differ."""
    if expected.shape != actual.shape or expected.dtype != actual.dtype:
        raise ValueError(f"cannot compare {tuple(actual.shape)} {actual.dtype} with expected "
                         f"{tuple(expected.shape)} {expected.dtype}")
    if expected.dim() != 2:
        raise ValueError(f"localise wants 2-D outputs, got {expected.dim()}-D")
    e_bits, a_bits = bits(expected).cpu(), bits(actual).cpu()
    diff = e_bits != a_bits
    count = int(diff.sum())
    if count == 0:
        return None
    idx = diff.nonzero()
    th, tw = int(tile[0]), int(tile[1])
    rows = torch.unique(idx[:, 0])
    cols = torch.unique(idx[:, 1])
    tiles = torch.unique(torch.stack([idx[:, 0] // th, idx[:, 1] // tw], 1), dim=0)
    e_vals, a_vals = expected.cpu(), actual.cpu()
    positions = []
    mask = (1 << (8 * expected.element_size())) - 1
    for r, c in idx[:max_positions].tolist():
        eb, ab = int(e_bits[r, c]) & mask, int(a_bits[r, c]) & mask
        positions.append({"row": r, "col": c, "expected": float(e_vals[r, c].float()),
                          "actual": float(a_vals[r, c].float()), "expected_bits": hex(eb),
                          "actual_bits": hex(ab), "xor": hex(eb ^ ab)})
    if count == 1:
        pattern = "element"
    elif len(tiles) == 1:
        pattern = "row" if len(rows) == 1 else "column" if len(cols) == 1 else "tile"
    elif len(rows) == 1:
        pattern = "row"
    elif len(cols) == 1:
        pattern = "column"
    elif len(rows) <= max(1, count // max(1, expected.shape[1] // 2)):
        pattern = "rows"
    elif len(cols) <= max(1, count // max(1, expected.shape[0] // 2)):
        pattern = "columns"
    else:
        pattern = "scattered"
    return Mismatch(count=count, total=expected.numel(), positions=positions,
                    rows=rows[:max_positions].tolist(), cols=cols[:max_positions].tolist(),
                    tiles=tiles[:max_positions].tolist(), tile_size=[th, tw], n_rows=len(rows),
                    n_cols=len(cols), n_tiles=len(tiles), pattern=pattern)


# ----------------------------------------------------------------------------- running one check


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], torch.Tensor], device: torch.device, repeats: int) -> tuple[torch.Tensor, float]:
    """Run fn `repeats` times (after the first, untimed, call); (last output, seconds per call)."""
    out = fn()
    if repeats <= 0:
        return out, 0.0
    _sync(device)
    if device.type == "cuda":
        # events record on the CURRENT device's stream: make it the GEMM's device, or another GPU's idle
        # stream is timed (and every GPU but the current one looks infinitely fast)
        with torch.cuda.device(device):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(repeats):
                out = fn()
            end.record()
            end.synchronize()
        return out, start.elapsed_time(end) / 1000.0 / repeats
    t0 = time.perf_counter()
    for _ in range(repeats):
        out = fn()
    return out, (time.perf_counter() - t0) / repeats


def run_known_answer(spec: KnownAnswerSpec, dev: DeviceInfo, *, matmul: Matmul = default_matmul,
                     repeats: int = 0, tile: Sequence[int] = DEFAULT_TILE) -> CheckResult:
    """Run one known-answer GEMM on `dev` and compare it bit for bit with the exact answer.

    The first output is checked; with `repeats` > 0 the GEMM then runs `repeats` more times back to back
    (timed: the achieved TFLOP/s) and the last of those outputs is checked too."""
    t0 = time.perf_counter()
    device = torch.device(dev.device)
    try:
        a, b = build_inputs(spec, device)
        expected_fp = expected_fingerprint(spec, device)
        outputs_fp: list[tuple[int, ...]] = []
        out, per_call = _timed(lambda: matmul(a, b, spec), device, 0)
        outputs_fp.append(tuple(fingerprint_tensor(out)))
        tflops = None
        if repeats > 0:
            last, per_call = _timed(lambda: matmul(a, b, spec), device, repeats)
            tflops = spec.flops / per_call / 1e12 if per_call > 0 else None
            outputs_fp.append(tuple(fingerprint_tensor(last)))
            if outputs_fp[-1] != expected_fp:
                out = last
    except Exception as exc:  # unsupported op, out of memory, ...: the check could not run
        return CheckResult("gemm", spec.name, Status.UNKNOWN, (dev.label,), time.perf_counter() - t0,
                           why=f"{type(exc).__name__}: {exc}".strip()[:500],
                           details={"spec": spec.to_json()})
    bad = [fp for fp in outputs_fp if fp != expected_fp]
    details: dict[str, Any] = {"spec": spec.to_json(), "expected_fingerprint": [hex(v) for v in expected_fp],
                               "actual_fingerprint": [hex(v) for v in (bad[0] if bad else outputs_fp[0])],
                               "value_ranges": list(value_ranges(spec))}
    if not bad:
        return CheckResult("gemm", spec.name, Status.PASS, (dev.label,), time.perf_counter() - t0,
                           tflops=tflops, details=details)
    mismatch = localise(expected_output(spec, device), out, tile)
    if mismatch is None:  # the fingerprint differed on a repeat whose output we no longer hold
        why = "fingerprint mismatch on a repeated run (output not kept for localisation)"
    else:
        details["mismatch"] = mismatch.to_json()
        why = mismatch.summary()
    return CheckResult("gemm", spec.name, Status.FAIL, (dev.label,), time.perf_counter() - t0, tflops=tflops,
                       why=why, details=details)


# ----------------------------------------------------------------------------- shape sets


def shape_set(level: str, dtype: str, device_type: str) -> list[tuple[str, int, int, int]]:
    """(name, M, N, K) shapes that take different kernels: small, large, skinny (GEMV-like), split-K."""
    if level not in ("quick", "full", "tiny"):
        raise ValueError(f"level must be quick, full or tiny, got {level!r}")
    if level == "tiny" or device_type != "cuda":
        shapes = [("small", 32, 48, 64), ("skinny", 16, 128, 256), ("splitk", 16, 16, 4096)]
        if level == "full":
            shapes.append(("large", 256, 256, 512))
        return shapes
    large = 4096 if level == "quick" else 8192
    shapes = [("small", 64, 64, 64), ("large", large, large, large), ("skinny", 16, 4096, 8192),
              ("splitk", 128, 128, 32768 if dtype_table()[dtype].max_int_a > 16 else 16384)]
    if level == "full":
        shapes += [("medium", 1024, 2048, 4096), ("wide", 256, 16384, 1024)]
        if not dtype_table()[dtype].scaled:
            shapes.append(("odd", 1000, 1000, 1000))
    return shapes


def known_answer_specs(level: str, dtypes: Sequence[str], device_type: str, seed: int = 0) -> list[KnownAnswerSpec]:
    specs = []
    for dt in dtypes:
        for i, (name, m, n, k) in enumerate(shape_set(level, dt, device_type)):
            specs.append(KnownAnswerSpec(dt, m, n, k, seed=seed + i, shape_name=name))
            if level == "full" and name == "large" and dt in ("bf16", "fp16", "fp8_e4m3"):
                specs.append(KnownAnswerSpec(dt, m, n, k, seed=seed + 100 + i, shape_name=name, out="fp32"))
    return specs


def achieved(flops: float, seconds: float) -> float:
    return flops / seconds / 1e12 if seconds > 0 and math.isfinite(seconds) else 0.0
