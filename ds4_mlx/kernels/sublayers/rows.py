"""Finishing rows (ds4.c): RMSNorm, RoPE of the trailing dims, then quantisation simulation, one launch.

A decode step finishes a row right after its projection: the KV row (norm with kv_norm, RoPE, FP8, float16
round), each compressed row (norm, RoPE at its window's first position, FP8 or Hadamard + FP4) and the indexer's
queries (RoPE, Hadamard + FP4, one row per head). In separate kernels that is 2-4 launches a row, plus the cos
and sin of the angles; here it is one. One threadgroup per row and one thread per value: the row's sum of squares
is a SIMD sum and a pass over the SIMD groups' sums, the RoPE partner of a value is the neighbouring lane
(adjacent pairs), the angle is float32 position * inv_freq as the reference forms it, with a full-precision cos and
sin in-kernel; FP8 blocks of 64 span two SIMD groups (their maxima meet in threadgroup memory), FP4 blocks of 32
are one. The FP8, Hadamard and FP4 arithmetic is kernels/sublayers/actquant.py's (HELPERS), exact as there.

Its reference, handed in by the model, is the model's composition (model/quant_sim.py `finish_rows`: rms_norm, the
RoPE, simulate_kv_fp8 / simulate_indexer_fp4, round_to_f16).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Hashable, Sequence
from functools import cache

import mlx.core as mx
import numpy as np

from ...model.rope import RoPE
from .actquant import HADAMARD_WIDTH, HELPERS
from ..machinery import nvrtc
from ..machinery.dialect import Kernel, build
from ..machinery.registry import FastPath, current_backend

TOLERANCE = 1e-5
"""Relative to the largest output. The norm's sum of squares is taken in another order than MLX's rms_norm, and
cos / sin and the rotation round differently (a few float32 ulps). A rounding that follows (FP8, FP4, float16) then
gets the same value unless that value lies within those few ulps of a rounding boundary: then the kernel and the
reference round it to neighbouring grid values (rare: ~1e-6 of FP8 / FP4 values, ~1e-4 of the float16-rounded RoPE
dims; either is as right as the other). The first-use probe (`steady_rows`) is built an eighth of a grid gap away
from every boundary, so that it compares by this tolerance alone."""


class RowQuant(enum.IntEnum):
    """The quantisation simulation that ends a row's finish (its value is the kernel's QUANT)."""

    NONE = 0
    KV_FP8 = 1  # simulate_kv_fp8: the dims before the trailing n_rot in FP8 E4M3 blocks of 64
    INDEXER_FP4 = 2  # simulate_indexer_fp4: a 128-point Hadamard, then FP4 E2M1 blocks of 32


NORMS = ("none", "unweighted", "weighted")
"""How a row is normed (the kernel's NORM): not at all, RMSNorm without a weight, RMSNorm times a weight."""

Norm = tuple[mx.array | None, float]
"""An RMSNorm: its weight (width,) float32 or None, and epsilon."""

ROW_HELPERS = HELPERS + """
// The RoPE of value i of a w-wide row at `position`: its trailing n_rot dims rotate in adjacent pairs, at float32
// angles position * inv_freq. Every lane of the SIMD group takes part (v's partner is the neighbouring lane's).
DEVICE_FN float rw_rope(float v, int i, int w, int n_rot, int position, const GLOBAL_MEM float* inv_freq) {
  const float partner = ds4_simd_xor(v, 1);
  if (i >= w - n_rot) {
    const float angle = (float)position * inv_freq[(i - (w - n_rot)) >> 1];
    const float c = ds4_cos(angle);
    const float s = ds4_sin(angle);
    v = (i & 1) ? partner * s + v * c : v * c - partner * s;
  }
  return v;
}
// simulate_indexer_fp4 of value i of a 128-wide row: the Hadamard (threads i = 0..127 of the group, all taking
// part, through buf as aq_hadamard's), then FP4 in blocks of 32 (one SIMD group each).
DEVICE_FN float rw_indexer_fp4(SHARED_MEM float* buf, int i, float v) {
  v = aq_hadamard(buf, i, v);
  return aq_fp4(v, aq_fp4_scale(ds4_simd_max(v < 0.0f ? -v : v)));
}
"""
"""The finish's RoPE and FP4 steps, which the indexer's score kernel (kernels/sublayers/indexer.py) shares."""

_FINISH = """
const size_t row = GROUP_X;
const int i = THREAD_IN_GROUP;  // one value of the row per thread
SHARED float sums[W / 32];
SHARED float maxima[W / 32];
SHARED float buf[QUANT == 2 ? 2 * 128 : 1];
float v = x[row * W + i];
if (NORM > 0) {
  const float squares = ds4_simd_sum(v * v);
  if (SIMD_LANE == 0) {
    sums[SIMD_INDEX] = squares;
  }
  ds4_barrier();
  float total = 0.0f;
  for (int k = 0; k < W / 32; ++k) {
    total += sums[k];
  }
  v *= 1.0f / sqrt(total / (float)W + eps[0]);
  if (NORM == 2) {
    v *= weight[i];
  }
}
v = rw_rope(v, i, W, NROT, positions[row / HEADS] - positions[row / HEADS] % ALIGN, inv_freq);
if (QUANT == 1) {
  const float amax = ds4_simd_max(v < 0.0f ? -v : v);
  if (SIMD_LANE == 0) {
    maxima[SIMD_INDEX] = amax;
  }
  ds4_barrier();
  const int first = SIMD_INDEX & ~1;  // a block of 64 values is two SIMD groups
  if (i < W - NROT) {
    v = aq_fp8(v, aq_fp8_scale(maxima[first] > maxima[first + 1] ? maxima[first] : maxima[first + 1]));
  }
} else if (QUANT == 2) {
  v = rw_indexer_fp4(buf, i, v);
}
if (ROUND_HALF) {
  v = ds4_round_half(v);
}
y[row * W + i] = v;
"""

FINISH_KERNEL = Kernel("ds4_finish_rows", ("x", "weight", "inv_freq", "positions", "eps"), ("y",), _FINISH,
                       ROW_HELPERS)
_SHIFT = """
if (GROUP_X < ROWS - 1) {  // the window's other rows move up by one; the last group finishes the new row
  y[(size_t)GROUP_X * W + THREAD_IN_GROUP] = window[((size_t)GROUP_X + 1) * W + THREAD_IN_GROUP];
  return;
}
"""
WINDOW_KERNEL = Kernel(
    "ds4_finish_into_window", FINISH_KERNEL.inputs + ("window",), ("y",),
    _SHIFT + _FINISH.replace("const size_t row = GROUP_X;", "const size_t row = 0;")
    .replace("y[row * W + i] = v;", "y[(size_t)(ROWS - 1) * W + i] = v;"),
    ROW_HELPERS,
)
"""One decode token's row finished as FINISH_KERNEL does, written after the other rows of a sliding window whose
oldest row drops out: the window update is part of the launch, not an op of its own. A threadgroup returns early
only as a whole, so every thread of the finishing group reaches its barriers."""
MAX_WIDTH = 1024
"""A row is one threadgroup of one thread per value."""


def norm_kind(norm: Norm | None) -> str:
    return "none" if norm is None else ("unweighted" if norm[0] is None else "weighted")


def fits(x: mx.array, positions: mx.array, rope: RoPE, norm: Norm | None, quant: RowQuant) -> bool:
    """Whether the kernel takes these rows: float32 rows (T, ..., W) of whole SIMD groups at T positions, RoPE dims
    in pairs, whole FP8 blocks before them, 128-wide rows for the Hadamard, a float32 norm weight of the width."""
    width, n_rot = x.shape[-1], rope.n_rot
    return (x.dtype == mx.float32 and width % 64 == 0 and width <= MAX_WIDTH and 0 < n_rot <= width
            and n_rot % 2 == 0 and positions.ndim == 1 and x.ndim >= 2 and x.shape[0] == positions.size
            and (quant != RowQuant.KV_FP8 or (width - n_rot) % 64 == 0)
            and (quant != RowQuant.INDEXER_FP4 or width == HADAMARD_WIDTH)
            and (norm is None or norm[0] is None or (norm[0].dtype == mx.float32 and norm[0].shape == (width,))))


def _launch(kernel: Kernel, args: tuple, rows: int, heads: int, shape: tuple[int, ...], *extra: mx.array,
            constants: tuple[tuple[str, int], ...] = (), align: int = 1) -> mx.array:
    """One threadgroup per output row of `shape` (float32), each of one thread per value, finishing FinishRows's
    arguments `args` (x, positions, rope, norm, quant, round_half); `extra` inputs follow the five common ones and
    `constants` the common template. The row count is the grid's alone, no constant, so that chunks of every length
    share one compiled kernel."""
    x, positions, rope, norm, quant, round_half = args
    width = x.shape[-1]
    eps = mx.array([0.0 if norm is None else norm[1]], dtype=mx.float32)
    weight = eps if norm is None or norm[0] is None else norm[0]  # read only with a weight
    (y,) = build(kernel, current_backend())(
        inputs=[x, weight, rope.inv_freq, positions.astype(mx.int32), eps, *extra],
        template=[("W", width), ("NROT", rope.n_rot), ("HEADS", heads),
                  ("NORM", NORMS.index(norm_kind(norm))), ("QUANT", int(quant)), ("ROUND_HALF", int(round_half)),
                  ("ALIGN", align), *constants],
        grid=(rows * width, 1, 1), threadgroup=(width, 1, 1),
        output_shapes=[shape], output_dtypes=[mx.float32],
    )
    return y


class FinishRows:
    """Norm, RoPE and quantisation simulation of rows in one launch, where the kernel passed its check."""

    def __init__(self, reference: Callable[..., mx.array]):
        self._formula = reference
        self.fast_path = FastPath("finish_rows", self._reference, self._kernel, self._probe, tolerance=TOLERANCE,
                                  backends=("cuda", "metal"))

    def __call__(self, x: mx.array, positions: mx.array, rope: RoPE, norm: Norm | None = None,
                 quant: RowQuant = RowQuant.NONE, round_half: bool = False, align: int = 1) -> mx.array:
        """x (T, ..., W), row t at positions[t] -> the same shape, float32: RMSNorm (`norm`), `rope`, `quant`, and
        a float16 round with `round_half`. With `align`, row t is rotated at positions[t] less positions[t] % align
        (a compressed row at its window's first token), worked out in the launch: an op of its own would be one
        node more, and one a recorded step (kernels/machinery/cudagraph.py) would not replay. Rows the kernel does not
        take go to the reference."""
        args = (x, positions, rope, norm, quant, round_half, *((align,) if align != 1 else ()))
        if not fits(x, positions, rope, norm, quant):
            return self.fast_path.reference(*args)
        return self.fast_path(*args, key=(x.shape[-1], rope.n_rot, norm_kind(norm), quant, round_half, *args[6:]))

    def _reference(self, x: mx.array, positions: mx.array, rope: RoPE, norm: Norm | None, quant: RowQuant,
                   round_half: bool, align: int = 1) -> mx.array:
        return self._formula(x, positions - positions % align if align != 1 else positions, rope, norm, quant,
                             round_half)

    @staticmethod
    def _kernel(x: mx.array, positions: mx.array, rope: RoPE, norm: Norm | None, quant: RowQuant,
                round_half: bool, align: int = 1) -> mx.array:
        rows = x.size // x.shape[-1]
        return _launch(FINISH_KERNEL, (x, positions, rope, norm, quant, round_half), rows, rows // positions.size,
                       x.shape, align=align)

    @staticmethod
    def _probe(key: Hashable) -> tuple:
        width, n_rot, kind, quant, round_half, *align = key
        rope = RoPE(n_rot, 10000.0)  # the first pair's angle is the position itself: cos and sin of up to 1e6
        positions = mx.array([0, 37, 999_983], dtype=mx.int32)
        weight = mx.array(np.random.default_rng(71).uniform(0.5, 1.5, width).astype(np.float32))
        norm = None if kind == "none" else (None if kind == "unweighted" else weight, 1e-6)
        rotated = positions - positions % align[0] if align else positions
        x = steady_rows((3, 2, width), rotated, rope, norm, quant, seed=72)
        return (x, positions, rope, norm, quant, round_half, *align)


class FinishIntoWindow:
    """window[1:] followed by one token's finished row (the decode step's raw KV ring), in one launch where the
    kernel passed its check; otherwise by `finish` (FinishRows: itself a kernel where that one passed) and a
    concatenation, the model's composition."""

    def __init__(self, finish: FinishRows):
        self.finish = finish
        self.fast_path = FastPath("finish_into_window", self._composed, self._kernel, self._probe,
                                  tolerance=TOLERANCE, backends=("cuda", "metal"))

    def __call__(self, x: mx.array, positions: mx.array, rope: RoPE, norm: Norm | None, quant: RowQuant,
                 round_half: bool, window: mx.array) -> mx.array:
        """x (1, W) at positions (1,) finished like FinishRows, appended to window (ROWS, W) float32 less its first
        row -> (ROWS, W)."""
        args = (x, positions, rope, norm, quant, round_half, window)
        if not (x.shape[0] == 1 and x.ndim == 2 and fits(x, positions, rope, norm, quant)
                and window.dtype == mx.float32 and window.ndim == 2 and window.shape[1] == x.shape[1]):
            return self._composed(*args)
        return self.fast_path(*args, key=(window.shape[0], x.shape[-1], rope.n_rot, norm_kind(norm), quant,
                                          round_half))

    def _composed(self, x, positions, rope, norm, quant, round_half, window) -> mx.array:
        return mx.concatenate([window[1:], self.finish(x, positions, rope, norm, quant, round_half)])

    @staticmethod
    def _kernel(x: mx.array, positions: mx.array, rope: RoPE, norm: Norm | None, quant: RowQuant,
                round_half: bool, window: mx.array) -> mx.array:
        return _launch(WINDOW_KERNEL, (x, positions, rope, norm, quant, round_half), window.shape[0], 1,
                       window.shape, window, constants=(("ROWS", window.shape[0]),))  # the window's rows

    @staticmethod
    def _probe(key: Hashable) -> tuple:
        rows, width, n_rot, kind, quant, round_half = key
        x, positions, rope, norm, quant, round_half = FinishRows._probe((width, n_rot, kind, quant, round_half))
        window = mx.array(np.random.default_rng(73).standard_normal((rows, width)).astype(np.float32))
        return x[-1:, 0], positions[-1:], rope, norm, quant, round_half, window


FP8_GRID = np.unique(np.concatenate([np.arange(8) * 2.0**-9] + [(8 + np.arange(8)) * 2.0 ** (e - 3)
                                                               for e in range(-6, 9)]))
FP8_GRID = FP8_GRID[FP8_GRID <= 448]
"""The non-negative FP8 E4M3 values (subnormals, then 3 mantissa bits for exponents -6..8, up to 448)."""
FP4_GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
"""The non-negative FP4 E2M1 values."""
OFFSET = 0.375
"""How far steady values lie from their grid point, in gaps to the neighbour: an eighth of a gap from the rounding
boundary (a relative 2^-13 or more: far beyond float32 reassociation), and not on the points of a grid twice as fine
(a quarter would be a tie there), so that a block scale half the right one shows in the subnormal range."""


def _between(grid: np.ndarray, rng: np.random.Generator, shape: tuple[int, ...], below: float, top: float
             ) -> np.ndarray:
    """Blocks (..., block) of values OFFSET of the way from a grid point to either neighbour, with random signs
    and power-of-two block scales. One value per block, at a random place, is near `top` (above half the grid's
    largest value): it alone sets the block's scale to the one chosen; the others come from points under `below`
    (with their neighbours, under half the largest), so that a scale taken from part of a block would differ."""
    index = rng.integers(1, int(np.searchsorted(grid, below)), shape)
    place = rng.integers(0, shape[-1], (*shape[:-1], 1))
    np.put_along_axis(index, place, int(np.searchsorted(grid, top)), axis=-1)
    toward = index + rng.choice([-1, 1], shape)
    values = grid[index] + OFFSET * (grid[toward] - grid[index])
    scales = 2.0 ** rng.integers(-2, 3, (*shape[:-1], 1))
    return values * rng.choice([-1.0, 1.0], shape) * scales


def _between_halves(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Values of magnitude 0.5 to 2 OFFSET of the way from a float16 value to a neighbour, random signs."""
    points = rng.uniform(0.5, 2.0, shape).astype(np.float16)
    toward = np.nextafter(points, rng.choice([-np.inf, np.inf], shape).astype(np.float16))
    values = points.astype(np.float64) + OFFSET * (toward.astype(np.float64) - points)
    return values * rng.choice([-1.0, 1.0], shape)


def _hadamard(x: np.ndarray) -> np.ndarray:
    """The orthonormal Walsh-Hadamard transform of the last axis in float64 (its own inverse)."""
    n = x.shape[-1]
    stride = 1
    while stride < n:
        pairs = x.reshape(*x.shape[:-1], n // (2 * stride), 2, stride)
        x = np.stack([pairs[..., 0, :] + pairs[..., 1, :], pairs[..., 0, :] - pairs[..., 1, :]], axis=-2)
        x = x.reshape(*x.shape[:-3], n)
        stride *= 2
    return x / np.sqrt(n)


def steady_rows(shape: tuple[int, ...], positions: mx.array, rope: RoPE, norm: Norm | None, quant: RowQuant,
                seed: int) -> mx.array:
    """Rows x (T, ..., W) whose finished values, before each rounding they go through (FP8 or FP4 in the quantised
    dims, float16 elsewhere), lie OFFSET of a grid gap from a grid point, with block maxima that leave each block
    scale well inside its power of two: no reassociation of the norm or the rotation can move them across a
    rounding boundary, so a kernel and the reference round them alike. Built backwards in float64: the rounded
    targets, the inverse Hadamard (FP4), the inverse rotation at float32 angles, then inputs whose norm gives them
    (x = c * target / weight with c such that rms(x) = c: c^2 (1 - mean((target / weight)^2)) = eps)."""
    rng = np.random.default_rng(seed)
    width, n_rot = shape[-1], rope.n_rot
    rows = int(np.prod(shape[:-1]))
    if quant == RowQuant.KV_FP8:
        nope = _between(FP8_GRID, rng, (rows, (width - n_rot) // 64, 64), 208.0, 256.0).reshape(rows, -1)
        rope_dims = 256.0 * _between_halves(rng, (rows, n_rot))  # of the FP8 values' size: their errors show
        target = np.concatenate([nope, rope_dims], axis=1)
    elif quant == RowQuant.INDEXER_FP4:
        target = _hadamard(_between(FP4_GRID, rng, (rows, width // 32, 32), 2.0, 4.0).reshape(rows, width))
    else:
        target = _between_halves(rng, (rows, width))
    target = target.reshape(positions.size, -1, width)

    angles = np.array(positions).astype(np.float32)[:, None] * np.array(rope.inv_freq)[None, :]  # float32
    cos, sin = np.cos(angles.astype(np.float64))[:, None], np.sin(angles.astype(np.float64))[:, None]
    a, b = target[..., width - n_rot :: 2].copy(), target[..., width - n_rot + 1 :: 2].copy()
    target[..., width - n_rot :: 2] = a * cos + b * sin
    target[..., width - n_rot + 1 :: 2] = b * cos - a * sin
    target = target.reshape(rows, width)

    if norm is not None:
        scaled = target if norm[0] is None else target / np.array(norm[0], dtype=np.float64)
        mean_square = np.mean(scaled**2, axis=-1, keepdims=True)
        # a power of two brings the mean square to 3/4 or below (the targets' rounding grids scale with it)
        scaled = scaled * 2.0 ** -np.ceil(np.log2(mean_square / 0.75) / 2).clip(0)
        mean_square = np.mean(scaled**2, axis=-1, keepdims=True)
        target = scaled * np.sqrt(norm[1] / (1.0 - mean_square))
    return mx.array(target.astype(np.float32).reshape(shape))


WRITE_ROW_KERNEL = Kernel("ds4_write_row", ("row", "position"), ("rows",), """
const int i = GROUP_X * 256 + THREAD_IN_GROUP;
if (i < W) {
  rows[(size_t)(position[0] / RATIO) * W + i] = row[i];
}
""")
"""Writes only the row: its output stands for the row buffer itself (`nvrtc.bind`), in a recorded step."""


def write_row(rows: mx.array, row: mx.array, position: mx.array, ratio: int) -> mx.array:
    """`rows` (R, W) with `row` (1, W) written at index position // ratio (position (1,) int32). Through MLX, an
    update in place where nothing else holds the buffer (a decode step's row buffers). While a step is recorded
    for a CUDA graph of our own (`nvrtc.recording`), one launch writing the row into `rows` itself: MLX ops are
    not replayed, and the replay writes in place."""
    if not nvrtc.is_recording():
        return mx.slice_update(rows, row, position // ratio, axes=(0,))
    width = rows.shape[1]
    (out,) = build(WRITE_ROW_KERNEL, "cuda")(
        inputs=[row, position], template=[("W", width), ("RATIO", ratio)],
        grid=(256 * ((width + 255) // 256), 1, 1), threadgroup=(256, 1, 1),
        output_shapes=[rows.shape], output_dtypes=[rows.dtype])
    nvrtc.bind(out, rows)
    return out


@cache
def join_kernel(count: int) -> Kernel:
    """A launch putting `count` arrays of N float32 values each one after another: row GROUP_Y of the output is
    input GROUP_Y."""
    cases = "\n".join(f"  case {i}: src = r{i}; break;" for i in range(count))
    return Kernel(f"ds4_join_rows_{count}", tuple(f"r{i}" for i in range(count)), ("out",), f"""
const GLOBAL_MEM float* src = r0;
switch (GROUP_Y) {{
{cases}
}}
const int i = GROUP_X * 256 + THREAD_IN_GROUP;
if (i < N) {{
  out[(size_t)GROUP_Y * N + i] = src[i];
}}
""")


def _join_reference(rows: tuple[mx.array, ...]) -> mx.array:
    return mx.concatenate(rows)


def _join_kernel(rows: tuple[mx.array, ...]) -> mx.array:
    n = rows[0].size
    (out,) = build(join_kernel(len(rows)), current_backend())(
        inputs=list(rows), template=[("N", n)], grid=(256 * ((n + 255) // 256), len(rows), 1),
        threadgroup=(256, 1, 1), output_shapes=[(len(rows), *rows[0].shape[1:])], output_dtypes=[mx.float32])
    return out


def _join_probe(key: Hashable) -> tuple:
    count, shape = key
    return (tuple(mx.random.normal((1, *shape), key=mx.random.key(40 + i)) for i in range(count)),)


JOIN_ROWS = FastPath("join_rows", _join_reference, _join_kernel, _join_probe, tolerance=0.0,
                     backends=("cuda", "metal"))
"""Rows (1, ...) of float32, several a step (a step's rows' attention heads), as one array in one launch: MLX's
concatenate is a built-in op, which a step replayed as a CUDA graph of our own may not hold."""


def join_rows(rows: Sequence[mx.array]) -> mx.array:
    """mx.concatenate(rows) of arrays (1, ...) of one shape: one launch of the join kernel on GPU backends."""
    rows = tuple(rows)
    if len(rows) == 1:
        return rows[0]
    if any(r.dtype != mx.float32 or r.shape != rows[0].shape or r.shape[0] != 1 for r in rows):
        return mx.concatenate(rows)
    return JOIN_ROWS(rows, key=(len(rows), rows[0].shape[1:]))
