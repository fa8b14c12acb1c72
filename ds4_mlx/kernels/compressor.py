"""The compressor's decode step (spec §3.6) as one kernel: insert the token into the frontier, pool its window,
and shift the frontier when the window is complete.

In MLX ops this is ~17 launches (the row insert, the lane split of ratio 4, a softmax, a product and a sum, the
shift and two selects), twice per ratio-4 layer (attention and indexer rows) and once per ratio-128 layer. Here one
thread owns one pooled dim j: for ratio 4 it reads and writes columns j (lane 0, rows 0..3) and d + j (lane 1,
rows 4..7) of the frontier, for ratio 128 column j of all 128 rows.

Its reference is `pool_step` in model/compressor.py, handed in by the model; the kernel equals it to float32
rounding (the softmax's sums in another order).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

import mlx.core as mx

from .dialect import Kernel, build
from .probe import random_activations
from .registry import FastPath, current_backend

TOLERANCE = 1e-5
THREADS = 128

_STEP = """
const int j = GROUP_X * THREADS + THREAD_IN_GROUP;
if (j < D) {
  constexpr int W = COFF * D;
  constexpr int ROWS = COFF * R;
  const int slot = position[0] % R;
  const int here = (COFF == 2 ? R : 0) + slot;
  const bool done = slot == R - 1;
  float s[ROWS];
  float v[ROWS];
  float top = -3.0e38f;
  for (int i = 0; i < ROWS; ++i) {
    const int col = (COFF == 2 && i >= R) ? D + j : j;
    const float sc = i == here ? score[col] + ape[slot * W + col] : frontier_score[i * W + col];
    s[i] = sc;
    v[i] = i == here ? kv[col] : frontier_kv[i * W + col];
    top = sc > top ? sc : top;
  }
  float total = 0.0f;
  for (int i = 0; i < ROWS; ++i) {
    s[i] = ds4_exp(s[i] - top);
    total += s[i];
  }
  float acc = 0.0f;
  for (int i = 0; i < ROWS; ++i) {
    acc += (s[i] / total) * v[i];
  }
  pooled[j] = acc;
  for (int lane = 0; lane < COFF; ++lane) {
    const int col = lane * D + j;
    for (int i = 0; i < ROWS; ++i) {
      const int from = done ? (COFF == 2 && i < R ? i + R : -1) : i;
      float fk = 0.0f;
      float fs = -ds4_float(0x7f800000u);  // -inf: a row without a token weighs nothing
      if (from >= 0) {
        fk = from == here ? kv[col] : frontier_kv[from * W + col];
        fs = from == here ? score[col] + ape[slot * W + col] : frontier_score[from * W + col];
      }
      new_kv[i * W + col] = fk;
      new_score[i * W + col] = fs;
    }
  }
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
        coff = 2 if ratio == 4 else 1
        return tuple(build(STEP_KERNEL, current_backend())(
            inputs=[kv, score, ape, frontier_kv, frontier_score, position.reshape(1).astype(mx.int32)],
            template=[("R", ratio), ("D", width), ("COFF", coff), ("THREADS", THREADS)],
            grid=(-(-width // THREADS) * THREADS, 1, 1), threadgroup=(THREADS, 1, 1),
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
