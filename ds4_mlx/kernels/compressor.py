"""The compressor's decode step (spec §3.6) as one kernel: insert the token into the frontier, pool its window,
and shift the frontier when the window is complete.

In MLX ops this is ~17 launches (the row insert, the lane split of ratio 4, a softmax, a product and a sum, the
shift and two selects), twice per ratio-4 layer (attention and indexer rows) and once per ratio-128 layer.

It is latency-bound (at most 1 MB of frontier read and written, at ratio 128), so the work is spread wide: a
threadgroup owns COLS pooled dims and all their candidates (8 for ratio 4: lane 0 of rows 0..3 and lane 1 of rows
4..7; the 128 rows for ratio 128), thread (c, g) of it candidates g, g + G, ... of dim c. The softmax's max and
its two sums (of e and of e * kv) are reduced across the G threads of a dim by SIMD shuffles, then across SIMD
groups through threadgroup memory, and each thread writes the new frontier rows of the candidates it holds.
Ratio 4 runs one SIMD group per 4 dims (128 groups for width 512, 32 for 128), ratio 128 eight per 8 dims (64
groups), each thread holding 4 rows. (One thread per dim, looping over the rows, took 14-90 us on the H200.)

Its reference is `pool_step` in model/compressor.py, handed in by the model; the kernel equals it to float32
rounding: the sums in another order and the division by the total once, at the end (sum(e * kv) / sum(e) where
the reference sums softmax(s) * kv).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

import mlx.core as mx

from .dialect import Kernel, build
from .probe import random_activations
from .registry import FastPath, current_backend

TOLERANCE = 1e-5
LAYOUTS = {4: (4, 32), 128: (8, 256)}
"""ratio -> (COLS pooled dims per threadgroup, THREADS per threadgroup); G = THREADS / COLS threads share a dim."""

_STEP = """
constexpr int W = COFF * D;            // frontier row width
constexpr int ROWS = COFF * R;         // candidates of one pooled dim
constexpr int G = THREADS / COLS;      // threads sharing one pooled dim
constexpr int PER = ROWS / G;          // candidates per thread
constexpr int SIMDS = THREADS / 32;
SHARED float part_top[SIMDS * COLS];
SHARED float part_total[SIMDS * COLS];
SHARED float part_acc[SIMDS * COLS];
const int c = THREAD_IN_GROUP % COLS;
const int g = THREAD_IN_GROUP / COLS;
const int j = GROUP_X * COLS + c;
const int slot = position[0] % R;
const int here = (COFF == 2 ? R : 0) + slot;
const bool done = slot == R - 1;
const float empty_score = -ds4_float(0x7f800000u);  // -inf: a row without a token weighs nothing
float s[PER];
float v[PER];
float top = empty_score;
for (int k = 0; k < PER; ++k) {
  const int i = g + k * G;
  const int col = (COFF == 2 && i >= R) ? D + j : j;
  const float held_score = frontier_score[i * W + col];  // loaded whatever the position: no wait on it
  const float held_kv = frontier_kv[i * W + col];
  s[k] = i == here ? score[col] + ape[slot * W + col] : held_score;
  v[k] = i == here ? kv[col] : held_kv;
  top = s[k] > top ? s[k] : top;
}
for (int k = 0; k < PER; ++k) {  // the new frontier: rows i at columns j (lane 0) and D + j (lane 1)
  const int i = g + k * G;
  const int own = (COFF == 2 && i >= R) ? 1 : 0;  // the lane of the candidate held in s[k], v[k]
  const int from = done ? (COFF == 2 && i < R ? i + R : -1) : i;
  for (int lane = 0; lane < COFF; ++lane) {
    const int col = lane * D + j;
    float fk = 0.0f;
    float fs = empty_score;
    if (from == i && lane == own) {
      fk = v[k];
      fs = s[k];
    } else if (from >= 0) {
      fk = from == here ? kv[col] : frontier_kv[from * W + col];
      fs = from == here ? score[col] + ape[slot * W + col] : frontier_score[from * W + col];
    }
    new_kv[i * W + col] = fk;
    new_score[i * W + col] = fs;
  }
}
for (int mask = COLS; mask < 32; mask <<= 1) {  // lanes of one SIMD group holding the same dim
  const float other = ds4_simd_xor(top, mask);
  top = other > top ? other : top;
}
if (SIMDS > 1) {
  if (SIMD_LANE < COLS) {
    part_top[SIMD_INDEX * COLS + c] = top;
  }
  ds4_barrier();
  for (int w = 0; w < SIMDS; ++w) {
    top = part_top[w * COLS + c] > top ? part_top[w * COLS + c] : top;
  }
}
float total = 0.0f;
float acc = 0.0f;
for (int k = 0; k < PER; ++k) {
  const float e = ds4_exp(s[k] - top);
  total += e;
  acc += e * v[k];
}
for (int mask = COLS; mask < 32; mask <<= 1) {
  total += ds4_simd_xor(total, mask);
  acc += ds4_simd_xor(acc, mask);
}
if (SIMDS > 1) {
  if (SIMD_LANE < COLS) {
    part_total[SIMD_INDEX * COLS + c] = total;
    part_acc[SIMD_INDEX * COLS + c] = acc;
  }
  ds4_barrier();
  total = 0.0f;
  acc = 0.0f;
  for (int w = 0; w < SIMDS; ++w) {
    total += part_total[w * COLS + c];
    acc += part_acc[w * COLS + c];
  }
}
if (g == 0) {
  pooled[j] = acc / total;
}
"""

STEP_KERNEL = Kernel("ds4_compressor_step", ("kv", "score", "ape", "frontier_kv", "frontier_score", "position"),
                     ("pooled", "new_kv", "new_score"), _STEP)


class CompressorStep:
    """(pooled row, new frontier kv, new frontier score) of one decode token, by the kernel where it passed."""

    def __init__(self, reference: Callable[..., tuple[mx.array, mx.array, mx.array]]):
        self.fast_path = FastPath("compressor_step", reference, self._kernel, self._probe, tolerance=TOLERANCE,
                                  backends=("cuda", "metal"))

    def __call__(self, kv: mx.array, score: mx.array, ape: mx.array, frontier_kv: mx.array,
                 frontier_score: mx.array, position: mx.array, ratio: int, width: int
                 ) -> tuple[mx.array, mx.array, mx.array]:
        """kv, score (1, coff*width) of the token (score without ape), ape (ratio, coff*width), the frontier
        (coff*ratio, coff*width) twice, position (int32 scalar) -> (1, width) and the new frontier."""
        return self.fast_path(kv, score, ape, frontier_kv, frontier_score, position, ratio, width,
                              key=(ratio, width))

    @staticmethod
    def _kernel(kv, score, ape, frontier_kv, frontier_score, position, ratio, width):
        if ratio not in LAYOUTS or width % LAYOUTS[ratio][0]:
            raise ValueError(f"no compressor-step layout for ratio {ratio} and width {width}")
        cols, threads = LAYOUTS[ratio]
        coff = 2 if ratio == 4 else 1
        return tuple(build(STEP_KERNEL, current_backend())(
            inputs=[kv, score, ape, frontier_kv, frontier_score, position.reshape(1).astype(mx.int32)],
            template=[("R", ratio), ("D", width), ("COFF", coff), ("COLS", cols), ("THREADS", threads)],
            grid=(width // cols * threads, 1, 1), threadgroup=(threads, 1, 1),
            output_shapes=[(1, width), frontier_kv.shape, frontier_kv.shape],
            output_dtypes=[mx.float32] * 3,
        ))

    @staticmethod
    def _probe(key: Hashable) -> tuple:
        ratio, width = key
        coff = 2 if ratio == 4 else 1
        rows, cols = coff * ratio, coff * width
        live = (mx.arange(rows) < rows - 1)[:, None]  # one row without a token yet: -inf, as a frontier has
        return (random_activations((1, cols), seed=61), random_activations((1, cols), seed=62),
                random_activations((ratio, cols), seed=63), random_activations((rows, cols), seed=64),
                mx.where(live, random_activations((rows, cols), seed=65), -mx.inf),
                mx.array(ratio - 1 if ratio == 4 else 5, dtype=mx.int32), ratio, width)
