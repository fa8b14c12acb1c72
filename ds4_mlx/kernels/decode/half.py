"""y = x @ W.T for an F16 matrix W kept as float16 and a few float32 rows x: one bandwidth-bound launch.

The file's F16 matrices (compressor kv/gate, indexer q_b/proj and compressor, the router) are small enough to stay
resident; held as float32 and multiplied by MLX's built-in gemv, a decode token reads twice the bytes the file
holds, in a slow kernel. Here W stays float16 and one kernel reads it once:

- a threadgroup is SIMDS SIMD groups of 32 threads; SPLIT consecutive SIMD groups share RPS rows (SIMDS / SPLIT
  x RPS rows per threadgroup), each taking a contiguous 1/SPLIT of them: enough SIMD groups in flight for small
  OUT, and each part of x (16-byte loads through the cache: x is shared by every row and stays in L1/L2) read
  once for RPS rows (`split_plan`);
- each lane issues all its 16-byte loads (8 halves each) of its RPS rows before using them, converts the halves to
  float32 and multiplies them by the matching activations, accumulating one float32 sum per row and token;
- one SIMD reduction per row and token, then, when rows are split, the SPLIT partial sums are added in
  threadgroup memory.

Every F16 value converts to float32 exactly, so the kernel multiplies and adds the very float32 values that
`reference` (x @ W.astype(float32).T) does: the results differ only in the order of the float32 sums (and where
products are fused into them), a few ulps of the output's scale over IN terms; TOLERANCE leaves a wide margin.
With `norm` the input RMSNorm is folded in (kernels/decode/fused_norm.py): the activations are multiplied by the norm
weight as they are read, each lane sums the squares of the raw ones (a row's SPLIT parts read all of x once), and
each output is scaled by 1 / rms: a reassociation again, plus the rounding of the weighted activations. Without a norm the kernel's text is exactly the plain one.

It takes IN a multiple of 256 (every lane a whole number of 16-byte loads) and 1 to MAX_TOKENS rows; a chunk's
rows (BATCH_TOKENS and more) take dense_f16.py's tensor-core GEMM on CUDA, other shapes the reference.
"""

from __future__ import annotations

from collections.abc import Hashable
from functools import cache

import mlx.core as mx
import numpy as np

from ..prefill.batch import BATCH_TOKENS
from ..tensor_cores.dense_f16 import HALF_BATCH
from ..tensor_cores.dense_wgmma import half_product
from ..machinery.dialect import SIMD_WIDTH, Kernel, build
from .fused_norm import PROBE_SCALE, Norm, apply, fits, normed_kernel, probe_norm, variant
from ..machinery.probe import random_activations
from ..machinery.registry import FastPath, current_backend

TOLERANCE = 1e-5
"""Float32 summation order only: ~1e-7 of the output's largest magnitude for IN = 4096, with margin. With the
norm folded in, up to ~3e-6 against MLX's CPU rms_norm, whose own 1 / rms is off by up to ~1e-6 (the kernel is
within ~1e-7 of a float64 evaluation)."""
MAX_TOKENS = 8
"""Most rows of x the kernel takes (decode: one; a few for short chunks); more go through a GEMM."""
SIMDS = 8
MAX_STEPS = 16
"""Most 16-byte loads one lane holds for its part of its rows (registers)."""
TARGET_SIMDS = 2048
"""Rows are split until about this many SIMD groups run (~16 per SM on an H200), at most SIMDS per row."""
ROWS_PER_SIMD = (4, 2, 1)
"""Rows a SIMD group may take at once (split_plan), most first."""
PROBE_TOKENS = (1, 5)
"""Token counts the first-use check compiles and compares (each is its own compiled variant)."""

_MATVEC = """
constexpr int GROUP_ROWS = SIMDS / SPLIT * RPS;
constexpr int PART = IN / (8 * SPLIT);
constexpr int STEPS = PART / 32;
const int lane = SIMD_LANE;
const int sg = SIMD_INDEX;
const int first_row = GROUP_X * GROUP_ROWS + sg / SPLIT * RPS;
const int part = sg % SPLIT;
SHARED float partial[SIMDS * RPS * TOKENS];
@SHARED float squares_part[SIMDS * TOKENS];

float acc[RPS][TOKENS];
for (int r = 0; r < RPS; ++r) {
  for (int t = 0; t < TOKENS; ++t) {
    acc[r][t] = 0.0f;
  }
}
@float squares[TOKENS];
@for (int t = 0; t < TOKENS; ++t) {
@  squares[t] = 0.0f;
@}
uint4 wv[RPS][STEPS];
for (int r = 0; r < RPS; ++r) {
  const int row = first_row + r < OUT ? first_row + r : OUT - 1;
  const GLOBAL_MEM uint4* wp = reinterpret_cast<const GLOBAL_MEM uint4*>(w + (size_t)row * IN) + part * PART + lane;
  for (int s = 0; s < STEPS; ++s) {
    wv[r][s] = wp[32 * s];
  }
}
for (int s = 0; s < STEPS; ++s) {
  float wf[RPS][8];
  for (int r = 0; r < RPS; ++r) {
    const unsigned int words[4] = {wv[r][s].x, wv[r][s].y, wv[r][s].z, wv[r][s].w};
    for (int j = 0; j < 4; ++j) {
      wf[r][2 * j] = ds4_half_to_float((unsigned short)(words[j] & 0xffffu));
      wf[r][2 * j + 1] = ds4_half_to_float((unsigned short)(words[j] >> 16));
    }
  }
  const int column = 8 * (part * PART + lane + 32 * s);
@  const GLOBAL_MEM float4* nw = reinterpret_cast<const GLOBAL_MEM float4*>(norm_w + column);
@  const float4 na = nw[0];
@  const float4 nb = nw[1];
  for (int t = 0; t < TOKENS; ++t) {
    const GLOBAL_MEM float4* xp = reinterpret_cast<const GLOBAL_MEM float4*>(x + (size_t)t * IN + column);
    float4 a = xp[0];
    float4 b = xp[1];
@    squares[t] += ((a.x * a.x + a.y * a.y) + (a.z * a.z + a.w * a.w)) +
@                  ((b.x * b.x + b.y * b.y) + (b.z * b.z + b.w * b.w));
@    a.x *= na.x;
@    a.y *= na.y;
@    a.z *= na.z;
@    a.w *= na.w;
@    b.x *= nb.x;
@    b.y *= nb.y;
@    b.z *= nb.z;
@    b.w *= nb.w;
    for (int r = 0; r < RPS; ++r) {
      float sum = wf[r][0] * a.x;
      sum += wf[r][1] * a.y;
      sum += wf[r][2] * a.z;
      sum += wf[r][3] * a.w;
      sum += wf[r][4] * b.x;
      sum += wf[r][5] * b.y;
      sum += wf[r][6] * b.z;
      sum += wf[r][7] * b.w;
      acc[r][t] += sum;
    }
  }
}
for (int r = 0; r < RPS; ++r) {
  for (int t = 0; t < TOKENS; ++t) {
    acc[r][t] = ds4_simd_sum(acc[r][t]);
  }
}
@for (int t = 0; t < TOKENS; ++t) {
@  squares[t] = ds4_simd_sum(squares[t]);
@  if (SPLIT == 1) {
@    for (int r = 0; r < RPS; ++r) {
@      acc[r][t] *= 1.0f / sqrt(squares[t] / (float)IN + NORM_EPS);
@    }
@  }
@}
if (SPLIT == 1) {
  if (lane == 0) {
    for (int r = 0; r < RPS; ++r) {
      if (first_row + r < OUT) {
        for (int t = 0; t < TOKENS; ++t) {
          y[(size_t)t * OUT + first_row + r] = acc[r][t];
        }
      }
    }
  }
} else {
  if (lane == 0) {
    for (int t = 0; t < TOKENS; ++t) {
      for (int r = 0; r < RPS; ++r) {
        partial[(sg * RPS + r) * TOKENS + t] = acc[r][t];
      }
@      squares_part[sg * TOKENS + t] = squares[t];
    }
  }
  ds4_barrier();
  const int i = THREAD_IN_GROUP;
  if (i < GROUP_ROWS * TOKENS) {
    const int g = i / TOKENS / RPS;  // the row's SIMD groups: g * SPLIT to g * SPLIT + SPLIT - 1
    const int r = i / TOKENS % RPS;
    const int t = i % TOKENS;
    const int row = GROUP_X * GROUP_ROWS + g * RPS + r;
    if (row < OUT) {
      float total = 0.0f;
      for (int p = 0; p < SPLIT; ++p) {
        total += partial[((g * SPLIT + p) * RPS + r) * TOKENS + t];
      }
@      float sum_squares = 0.0f;
@      for (int p = 0; p < SPLIT; ++p) {
@        sum_squares += squares_part[(g * SPLIT + p) * TOKENS + t];
@      }
@      total *= 1.0f / sqrt(sum_squares / (float)IN + NORM_EPS);
      y[(size_t)t * OUT + row] = total;
    }
  }
}
"""

_NAMES = ("ds4_half_matvec", ("x", "w"), ("y",))
HALF_MATVEC_KERNEL = Kernel(*_NAMES, variant(_MATVEC, False))
"""The plain kernel: the text without its `@` lines (the input norm, fused_norm.py)."""


@cache
def norm_kernel(eps: float) -> Kernel:
    """The kernel with the input norm folded in: the activations times norm_w, each output times the row's 1 / rms."""
    return normed_kernel(*_NAMES, _MATVEC, eps)


def split_plan(n_out: int, n_in: int) -> tuple[int, int] | None:
    """(SIMD groups per row, rows per SIMD group) for W (n_out, n_in), or None where the kernel does not apply.

    A row is 256-value chunks (32 lanes x 8 halves); each of SPLIT parts takes whole chunks. A SIMD group takes RPS
    rows at once and reads its part of x (and of the norm weight) once for all of them: at one row a SIMD group,
    x's float32 bytes read through L2 were twice the weights' (four times with the norm), which bound the kernel
    rather than memory. RPS times a lane's loads of a row is at most MAX_STEPS (registers); the most rows per SIMD
    group that still make about TARGET_SIMDS SIMD groups is taken, else one row, split as far as it goes.
    """
    if n_out < 1 or n_in < 256 or n_in % 256:
        return None
    chunks = n_in // 256
    for rps in ROWS_PER_SIMD:
        split = 1
        while split < SIMDS and chunks % (2 * split) == 0 and (
                -(-n_out // rps) * split < TARGET_SIMDS or chunks // split * rps > MAX_STEPS):
            split *= 2
        if chunks // split * rps <= MAX_STEPS and (-(-n_out // rps) * split >= TARGET_SIMDS or rps == 1):
            return split, rps
    return None


def reference(x: mx.array, w: mx.array, norm: Norm | None = None) -> mx.array:
    """x (..., IN) float32 @ W.T for W (OUT, IN) float16: the dense form's product (float16 -> float32 is exact);
    with a norm, of rms_norm(x, weight, eps)."""
    return apply(x, norm) @ w.astype(mx.float32).T


def _kernel(x: mx.array, w: mx.array, norm: Norm | None = None) -> mx.array:
    """x (T, IN) float32, T <= MAX_TOKENS, W (OUT, IN) float16 with a split plan -> (T, OUT) float32."""
    n_out, n_in = w.shape
    tokens = x.shape[0]
    split, rps = split_plan(n_out, n_in)
    groups = -(-n_out // (SIMDS // split * rps))
    kernel, extra = (HALF_MATVEC_KERNEL, []) if norm is None else (norm_kernel(float(norm[1])), [norm[0]])
    (y,) = build(kernel, current_backend())(
        inputs=[x, w, *extra],
        template=[("OUT", n_out), ("IN", n_in), ("TOKENS", tokens), ("SPLIT", split), ("RPS", rps), ("SIMDS", SIMDS)],
        grid=(groups * SIMDS * SIMD_WIDTH, 1, 1),
        threadgroup=(SIMDS * SIMD_WIDTH, 1, 1),
        output_shapes=[(tokens, n_out)],
        output_dtypes=[mx.float32],
    )
    return y


def _probe(key: Hashable) -> tuple[mx.array, mx.array, Norm | None]:
    """Activations for the largest probed token count, and W with magnitudes from 2^-16 (subnormal halves) to 1.
    A key ending in an epsilon is the normed kernel's: activations off unit rms, a norm weight around 1."""
    n_out, n_in, *eps = key
    rng = np.random.default_rng(41)
    w = rng.standard_normal((n_out, n_in)) * np.exp2(rng.uniform(-16, 0, (n_out, n_in)))
    x = random_activations((max(PROBE_TOKENS), n_in), seed=42)
    if not eps:
        return x, mx.array(w.astype(np.float16)), None
    return PROBE_SCALE * x, mx.array(w.astype(np.float16)), probe_norm(n_in, eps[0], seed=43)


def _probe_reference(x: mx.array, w: mx.array, norm: Norm | None) -> tuple[mx.array, ...]:
    return tuple(reference(x[:n], w, norm) for n in PROBE_TOKENS)


def _probe_kernel(x: mx.array, w: mx.array, norm: Norm | None) -> tuple[mx.array, ...]:
    return tuple(_kernel(x[:n], w, norm) for n in PROBE_TOKENS)


HALF_MATVEC = FastPath("half_matvec", _probe_reference, _probe_kernel, _probe, tolerance=TOLERANCE,
                       backends=("cuda", "metal"))
"""The kernel for W of one shape; key: (OUT, IN), and the norm's epsilon after them for the kernel with the input
norm folded in. The check compiles and compares the 1- and 5-token variants; the other token counts are the same
source with another constant."""


def matvec_enabled(shape: tuple[int, ...]) -> bool:
    """Whether W of this (OUT, IN) shape is multiplied by the kernel here: the shape fits it and its check passed."""
    return len(shape) == 2 and split_plan(*shape) is not None and HALF_MATVEC.enabled(tuple(shape))


def half_matvec(x: mx.array, w: mx.array, norm: Norm | None = None) -> mx.array:
    """x (..., IN) float32 @ W.T for W (OUT, IN) float16: the kernel for 1 to MAX_TOKENS rows where it passed its
    check, the reference otherwise (more rows, the reference mode, another backend). With a norm (weight (IN,),
    eps), x is first rms_norm(x, weight, eps), row by row: folded into the same launch."""
    if not _takes_kernel(x, w, norm):
        if _batch(x, w):
            return half_product(apply(x, norm), w)
        return reference(x, w, norm)
    rows = x.size // x.shape[-1]
    if x.ndim == 2:
        return _kernel(x, w, norm)
    return _kernel(x.reshape(rows, x.shape[-1]), w, norm).reshape(*x.shape[:-1], w.shape[0])


def _batch(x: mx.array, w: mx.array) -> bool:
    """Whether a chunk's rows take a float16 tensor-core GEMM (dense_f16.py, CUDA; `half_product` takes
    dense_wgmma.py's where it can): float32 x of at least BATCH_TOKENS rows, IN a multiple of 32, and dense_f16's
    check passed for W's shape."""
    rows = x.size // x.shape[-1] if x.shape[-1] else 0
    return (rows >= BATCH_TOKENS and x.dtype == mx.float32 and w.ndim == 2 and w.shape[1] % 32 == 0
            and HALF_BATCH.enabled(tuple(w.shape)))


def folds(x: mx.array, w: mx.array, norm: Norm | None) -> bool:
    """Whether half_matvec(x, w, norm) takes the normed kernel, so that no rms_norm op runs (checking it first if
    this is its first use)."""
    return norm is not None and _takes_kernel(x, w, norm)


def _takes_kernel(x: mx.array, w: mx.array, norm: Norm | None) -> bool:
    rows = x.size // x.shape[-1] if x.shape[-1] else 0
    if not 1 <= rows <= MAX_TOKENS or x.dtype != mx.float32 or not matvec_enabled(w.shape) or not fits(
            norm, w.shape[-1]):
        return False
    return norm is None or HALF_MATVEC.enabled((*w.shape, float(norm[1])))
