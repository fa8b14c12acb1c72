"""Decode-step kernels of the attention sublayer (spec §3.4, §3.8): RoPE, and one query token's attention.

- `ROPE`: rotates the trailing n_rot dims of rows (R, D) in adjacent pairs by the angles whose cos and sin it is
  given per position (the caller computes them once per position: in a compiled step, once for all layers), or
  by the negated angles. In MLX ops a rotation is ~5 launches (two products, two sums, a stack and a
  concatenation); a decode step has six per compressed layer.
- `DECODE_ATTENTION`: softmax attention with sinks for one query token over one key set (values = keys):
  q (H, D) over key sets joined into one (N, D) with their masks. One threadgroup per head; each SIMD group runs an online softmax
  over every eighth key, with 16 dims per lane, and the groups' partial sums are merged with the sink at the end.
  Replaces ~15 launches (scores, masks, max, exp, sums, products, division) with one.

Their references are the model's plain formulas (model/rope.py, model/attention.py), handed in by the model; the
kernels equal them to float32 rounding (TOLERANCE): the same products, summed in another order.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

import mlx.core as mx

from .dialect import SIMD_WIDTH, Kernel, build
from .probe import random_activations
from .registry import FastPath, current_backend

TOLERANCE = 1e-5
"""Float32 summation order (a 512-long dot product, a softmax over up to a few thousand keys) and cos/sin
rounding: ~1e-6 of the largest output, with margin."""

_ROPE = """
const size_t i = (size_t)GROUP_X * THREADS + THREAD_IN_GROUP;
if (i < (size_t)R * D) {
  const size_t row = i / D;
  const int d = (int)(i - row * D);
  if (d < D - NROT) {
    y[i] = x[i];
  } else {
    const size_t k = (row / HEADS) * (NROT / 2) + ((d - (D - NROT)) >> 1);
    const float c = cos_t[k];
    const float s = INVERSE ? -sin_t[k] : sin_t[k];
    const size_t even = i - ((d - (D - NROT)) & 1);
    const float a = x[even];
    const float b = x[even + 1];
    y[i] = ((d - (D - NROT)) & 1) ? a * s + b * c : a * c - b * s;
  }
}
"""

_ATTEND = """
const int h = GROUP_X;
const int lane = SIMD_LANE;
const int group = SIMD_INDEX;
constexpr int PER_LANE = D / 32;
float qv[PER_LANE];
float acc[PER_LANE];
for (int j = 0; j < PER_LANE; ++j) {
  qv[j] = q[(size_t)h * D + lane * PER_LANE + j];
  acc[j] = 0.0f;
}
float m = -3.0e38f;  // below every score: exp(m - top) is 0
float l = 0.0f;
for (int n = group; n < N; n += GROUPS) {
  if (!valid[n]) {
    continue;
  }
  const GLOBAL_MEM float* k = keys + (size_t)n * D + lane * PER_LANE;
  float dot = 0.0f;
  for (int j = 0; j < PER_LANE; ++j) {
    dot += qv[j] * k[j];
  }
  const float score = ds4_simd_sum(dot) * scale[0];
  const float top = score > m ? score : m;
  const float alpha = ds4_exp(m - top);
  const float p = ds4_exp(score - top);
  l = l * alpha + p;
  for (int j = 0; j < PER_LANE; ++j) {
    acc[j] = acc[j] * alpha + p * k[j];
  }
  m = top;
}
SHARED float part_acc[GROUPS * D];
SHARED float part_m[GROUPS];
SHARED float part_l[GROUPS];
for (int j = 0; j < PER_LANE; ++j) {
  part_acc[group * D + lane * PER_LANE + j] = acc[j];
}
if (lane == 0) {
  part_m[group] = m;
  part_l[group] = l;
}
ds4_barrier();
const float sink = sinks[h];
float top = sink;
for (int g = 0; g < GROUPS; ++g) {
  top = part_m[g] > top ? part_m[g] : top;
}
float total = ds4_exp(sink - top);
for (int g = 0; g < GROUPS; ++g) {
  total += part_l[g] * ds4_exp(part_m[g] - top);
}
for (int d = THREAD_IN_GROUP; d < D; d += GROUPS * 32) {
  float v = 0.0f;
  for (int g = 0; g < GROUPS; ++g) {
    v += part_acc[g * D + d] * ds4_exp(part_m[g] - top);
  }
  out[(size_t)h * D + d] = v / total;
}
"""

ROPE_KERNEL = Kernel("ds4_rope", ("x", "cos_t", "sin_t"), ("y",), _ROPE)
ATTEND_KERNEL = Kernel("ds4_decode_attention", ("q", "keys", "valid", "sinks", "scale"), ("out",), _ATTEND)
THREADS = 256
GROUPS = 8


class Rope:
    """RoPE of rows' trailing dims, by the kernel where it passed its check."""

    def __init__(self, reference: Callable[[mx.array, mx.array, mx.array, int, bool], mx.array]):
        self.fast_path = FastPath("rope", reference, self._kernel, self._probe, tolerance=TOLERANCE,
                                  backends=("cuda", "metal"))

    def __call__(self, x: mx.array, cos: mx.array, sin: mx.array, n_rot: int, inverse: bool) -> mx.array:
        """x (T, ..., D), cos and sin (T, n_rot / 2) -> x with its last n_rot dims rotated (GPT-J pairs)."""
        return self.fast_path(x, cos, sin, n_rot, inverse, key=(x.shape[-1], n_rot, inverse))

    @staticmethod
    def _kernel(x, cos, sin, n_rot, inverse) -> mx.array:
        d = x.shape[-1]
        rows = x.size // d
        (y,) = build(ROPE_KERNEL, current_backend())(
            inputs=[x.astype(mx.float32), cos, sin],
            template=[("R", rows), ("D", d), ("NROT", n_rot), ("HEADS", rows // cos.shape[0]),
                      ("INVERSE", inverse), ("THREADS", THREADS)],
            grid=(-(-rows * d // THREADS) * THREADS, 1, 1), threadgroup=(THREADS, 1, 1),
            output_shapes=[x.shape], output_dtypes=[mx.float32],
        )
        return y

    @staticmethod
    def _probe(key: Hashable) -> tuple:
        d, n_rot, inverse = key
        angles = random_activations((3, n_rot // 2), seed=50) * 100.0
        return random_activations((3, 2, d), seed=51), mx.cos(angles), mx.sin(angles), n_rot, inverse


class DecodeAttention:
    """One query token's attention with sinks, by the kernel where it passed its check."""

    def __init__(self, reference: Callable[..., mx.array]):
        self.fast_path = FastPath("decode_attention", reference, self._kernel, self._probe, tolerance=TOLERANCE,
                                  backends=("cuda", "metal"))

    def __call__(self, q: mx.array, keys: tuple[mx.array, ...], masks: tuple[mx.array, ...], sinks: mx.array,
                 scale: float) -> mx.array:
        """q (1, H, D); key sets (N_i, D) or (1, N_i, D) with masks (1, N_i); sinks (H,) -> (1, H, D)."""
        n = sum(k.shape[-2] for k in keys)
        return self.fast_path(q, keys, masks, sinks, scale, key=(q.shape[-1], n))

    @staticmethod
    def _kernel(q, keys, masks, sinks, scale) -> mx.array:
        _, h, d = q.shape
        if d % SIMD_WIDTH:
            raise ValueError(f"decode attention needs a head width that is a multiple of 32, got {d}")
        k = mx.concatenate([key.reshape(-1, d) for key in keys])
        valid = mx.concatenate([mask.reshape(-1) for mask in masks])
        (out,) = build(ATTEND_KERNEL, current_backend())(
            inputs=[q.reshape(h, d), k, valid, sinks, mx.array([scale], dtype=mx.float32)],
            template=[("D", d), ("N", k.shape[0]), ("GROUPS", GROUPS)],
            grid=(h * GROUPS * SIMD_WIDTH, 1, 1), threadgroup=(GROUPS * SIMD_WIDTH, 1, 1),
            output_shapes=[(h, d)], output_dtypes=[mx.float32],
        )
        return out[None]

    @staticmethod
    def _probe(key: Hashable) -> tuple:
        d, n = key
        first = min(n, 128)
        valid = (mx.arange(n) % 3 != 1)[None]
        keys = random_activations((n, d), seed=53)
        return (random_activations((1, 4, d), seed=52) * 0.2, (keys[:first], keys[first:]),
                (valid[:, :first], valid[:, first:]), random_activations((4,), seed=54), 1.0 / d**0.5)
