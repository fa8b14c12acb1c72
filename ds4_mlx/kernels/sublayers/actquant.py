"""Activation quantisation simulation kernels (ds4.c): the FP8 KV round trip and the indexer's Hadamard + FP4.

In MLX ops each is a chain of reductions, bit manipulations and, for the Hadamard, one stack per butterfly stage:
~10 launches for FP8 and ~25 for Hadamard + FP4, on every KV row, compressed row and indexer query of a decode
step. Here each is one launch, and exact: the same float32 operations in the same order (IEEE adds for the
butterflies, exact power-of-two scales built from exponent bits, correctly rounded divisions, ties-to-even
rounding), so they must equal the reference in model/quant_sim.py bit for bit (tolerance 0).

- `FP8_KV`: rows (R, W); blocks of 64 before the trailing n_rot RoPE dims are FP8 E4M3 round-tripped, the RoPE
  dims are copied. One SIMD group per 64-value block, two values a lane: the block's amax is one SIMD max (a max
  is exact in any order), then each lane rounds its two values alone, in the reference's sequence. A 512-wide
  row is 8 SIMD groups in 2 threadgroups (one thread per block, looping over 64 values, took ~15 us).
- `INDEXER_FP4`: rows (R, 128); a 128-point Walsh-Hadamard transform (butterflies through threadgroup memory, one
  thread per value) then an FP4 E2M1 round trip in blocks of 32 (one SIMD group per block).

The arithmetic is HELPERS (block scales, roundings, the Hadamard), which kernels/sublayers/rows.py's finish kernel
shares.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

import mlx.core as mx

from ..machinery.dialect import SIMD_WIDTH, Kernel, build
from ..machinery.probe import random_activations
from ..machinery.registry import FastPath, current_backend

HADAMARD_WIDTH = 128

HELPERS = """
DEVICE_FN int aq_exponent(float x) {
  return (int)((ds4_bits(x) >> 23) & 255u) - 127;
}
DEVICE_FN int aq_ceil_log2(float x) {
  const unsigned int bits = ds4_bits(x);
  return (int)((bits >> 23) & 255u) - 127 + ((bits & 0x7FFFFFu) != 0u ? 1 : 0);
}
DEVICE_FN float aq_pow2(int k) {
  return ds4_float((unsigned int)(k + 127) << 23);
}
DEVICE_FN float aq_round(float x, int mantissa_bits, int min_exponent, float max_value) {
  x = x < -max_value ? -max_value : (x > max_value ? max_value : x);
  int e = aq_exponent(x < 0.0f ? -x : x);
  e = e > min_exponent ? e : min_exponent;
  const float step = aq_pow2(e - mantissa_bits);
  return ds4_rint(ds4_div(x, step)) * step;
}
DEVICE_FN float aq_fp8_scale(float amax) {  // a 64-value block's power-of-two scale, from its largest |value|
  amax = amax > 1e-4f ? amax : 1e-4f;
  return aq_pow2(aq_ceil_log2(ds4_div(amax, 448.0f)));
}
DEVICE_FN float aq_fp8(float v, float scale) {
  return aq_round(ds4_div(v, scale), 3, -6, 448.0f) * scale;
}
DEVICE_FN float aq_fp4_scale(float amax) {  // a 32-value block's, likewise
  amax = amax > 7.052966e-38f ? amax : 7.052966e-38f;
  return aq_pow2(aq_ceil_log2(ds4_div(amax, 6.0f)));
}
DEVICE_FN float aq_fp4(float v, float scale) {
  return aq_round(ds4_div(v, scale), 1, 0, 6.0f) * scale;
}
// The orthonormal 128-point Walsh-Hadamard transform of the values v of threads i = 0..127 (every thread of the
// group takes part), through buf (2 x 128 floats of threadgroup memory): the reference's butterflies, in its order.
DEVICE_FN float aq_hadamard(SHARED_MEM float* buf, int i, float v) {
  buf[i] = v;
  ds4_barrier();
  int from = 0;
  for (int s = 1; s < 128; s <<= 1) {
    const float a = buf[from * 128 + (i & ~s)];
    const float b = buf[from * 128 + (i | s)];
    buf[(1 - from) * 128 + i] = (i & s) ? a - b : a + b;
    from = 1 - from;
    ds4_barrier();
  }
  return buf[from * 128 + i] * 0.08838834764831845f;
}
"""

_FP8 = """
const size_t chunk = ((size_t)GROUP_X * THREADS + THREAD_IN_GROUP) / 32;
if (chunk < (size_t)R * (W / 64)) {  // whole SIMD groups, as the grid counts them
  const size_t row = chunk / (W / 64);
  const int c = (int)(chunk - row * (W / 64));
  const GLOBAL_MEM float* src = x + row * W + 64 * c;
  GLOBAL_MEM float* dst = y + row * W + 64 * c;
  const float a = src[SIMD_LANE];
  const float b = src[SIMD_LANE + 32];
  if (64 * c < W - NROT) {
    float amax = a < 0.0f ? -a : a;
    const float abs_b = b < 0.0f ? -b : b;
    amax = abs_b > amax ? abs_b : amax;
    const float scale = aq_fp8_scale(ds4_simd_max(amax));
    dst[SIMD_LANE] = aq_fp8(a, scale);
    dst[SIMD_LANE + 32] = aq_fp8(b, scale);
  } else {
    dst[SIMD_LANE] = a;
    dst[SIMD_LANE + 32] = b;
  }
}
"""

_FP4 = """
const size_t row = GROUP_X;
const int i = THREAD_IN_GROUP;
SHARED float buf[2 * 128];
const float v = aq_hadamard(buf, i, x[row * 128 + i]);
y[row * 128 + i] = aq_fp4(v, aq_fp4_scale(ds4_simd_max(v < 0.0f ? -v : v)));
"""

FP8_KERNEL = Kernel("ds4_fp8_kv", ("x",), ("y",), _FP8, HELPERS)
FP4_KERNEL = Kernel("ds4_indexer_fp4", ("x",), ("y",), _FP4, HELPERS)
FP8_THREADS = 128  # 4 blocks of 64 values per threadgroup


class FP8KV:
    """FP8 round trip of rows' non-RoPE dims, by the kernel where it passed its (exact) check."""

    def __init__(self, reference: Callable[[mx.array, int], mx.array]):
        self.fast_path = FastPath("fp8_kv", reference, self._kernel, self._probe, tolerance=0.0,
                                  backends=("cuda", "metal"))

    def __call__(self, x: mx.array, n_rot: int) -> mx.array:
        """x (..., W) with (W - n_rot) a multiple of 64 -> the same shape."""
        return self.fast_path(x, n_rot, key=(x.shape[-1], n_rot))

    @staticmethod
    def _kernel(x: mx.array, n_rot: int) -> mx.array:
        width = x.shape[-1]
        if (width - n_rot) % 64 or width % 64:
            raise ValueError(f"FP8 rows of {width} with {n_rot} RoPE dims are not whole 64-value blocks")
        rows = x.size // width
        threads = rows * (width // 64) * SIMD_WIDTH
        (y,) = build(FP8_KERNEL, current_backend())(
            inputs=[x.astype(mx.float32)], template=[("R", rows), ("W", width), ("NROT", n_rot),
                                                     ("THREADS", FP8_THREADS)],
            grid=(-(-threads // FP8_THREADS) * FP8_THREADS, 1, 1), threadgroup=(FP8_THREADS, 1, 1),
            output_shapes=[x.shape], output_dtypes=[mx.float32],
        )
        return y

    @staticmethod
    def _probe(key: Hashable) -> tuple:
        width, n_rot = key
        x = random_activations((3, width), seed=41) * mx.array([1e-6, 1.0, 300.0])[:, None]  # floor, plain, large
        return x, n_rot


class IndexerFP4:
    """Hadamard then FP4 round trip of 128-wide rows, by the kernel where it passed its (exact) check."""

    def __init__(self, reference: Callable[[mx.array], mx.array]):
        self.fast_path = FastPath("indexer_fp4", reference, self._kernel, self._probe, tolerance=0.0,
                                  backends=("cuda", "metal"))

    def __call__(self, x: mx.array) -> mx.array:
        """x (..., 128) -> the same shape; other widths go to the reference."""
        if x.shape[-1] != HADAMARD_WIDTH:
            return self.fast_path.reference(x)
        return self.fast_path(x, key=HADAMARD_WIDTH)

    @staticmethod
    def _kernel(x: mx.array) -> mx.array:
        rows = x.size // HADAMARD_WIDTH
        (y,) = build(FP4_KERNEL, current_backend())(
            inputs=[x.astype(mx.float32)],
            grid=(rows * HADAMARD_WIDTH, 1, 1), threadgroup=(HADAMARD_WIDTH, 1, 1),
            output_shapes=[x.shape], output_dtypes=[mx.float32],
        )
        return y

    @staticmethod
    def _probe(key: Hashable) -> tuple:
        return (random_activations((5, key), seed=42) * mx.array([1e-30, 1e-3, 1.0, 7.0, 1e4])[:, None],)

