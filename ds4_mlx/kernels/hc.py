"""Hyper-connection kernels (spec §3.2): the mix's split with its Sinkhorn projection, and the stream update.

Both are tiny in arithmetic (4 streams, a 4x4 matrix) but many in operations: written in MLX ops, the Sinkhorn
projection alone is ~80 reductions and divisions per hyper-connection, two hyper-connections per layer, each one
a kernel launch on a GPU. Here each is one launch:

- `HC_SPLIT`: mix (T, (2+n)n) -> pre weights, post (T, n), comb (T, n, n) by the Sinkhorn projection (one thread
  per token does the n x n iterations in threadgroup memory), and the collapsed input sum_r pre_r H_r (T, D) by
  every thread of the group;
- `HC_UPDATE`: new streams H'_c = post_c * out + sum_r comb[r, c] H_r (T, n, D), one thread per (token, dim).

Their references are the plain MLX formulas in model/hyper_connection.py, passed in by the model (so the two
cannot drift apart); the kernels must equal them to float32 summation order (TOLERANCE).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from functools import cache

import mlx.core as mx

from .dialect import Kernel, build
from .probe import random_activations
from .registry import FastPath, current_backend

TOLERANCE = 1e-5
"""Float32 summation and exp/sigmoid rounding order only: a handful of ulps through 20 Sinkhorn steps."""
THREADS = 256

_SPLIT = """
const int t = GROUP_X;
const int tid = THREAD_IN_GROUP;
SHARED float w[(2 + N) * N];
if (tid < (2 + N) * N) {
  const int part = tid < N ? 0 : (tid < 2 * N ? 1 : 2);
  w[tid] = mix[(size_t)t * (2 + N) * N + tid] * scale[part] + base[tid];
}
ds4_barrier();
if (tid == 0) {
  for (int i = 0; i < N; ++i) {
    w[i] = 1.0f / (1.0f + ds4_exp(-w[i])) + EPS;
    w[N + i] = 2.0f / (1.0f + ds4_exp(-w[N + i]));
  }
  SHARED_MEM float* c = w + 2 * N;
  for (int r = 0; r < N; ++r) {
    float top = c[r * N];
    for (int k = 1; k < N; ++k) {
      top = c[r * N + k] > top ? c[r * N + k] : top;
    }
    float total = 0.0f;
    for (int k = 0; k < N; ++k) {
      c[r * N + k] = ds4_exp(c[r * N + k] - top);
      total += c[r * N + k];
    }
    for (int k = 0; k < N; ++k) {
      c[r * N + k] = c[r * N + k] / total + EPS;
    }
  }
  for (int it = 0; it < ITERS; ++it) {
    if (it > 0) {
      for (int r = 0; r < N; ++r) {
        float total = 0.0f;
        for (int k = 0; k < N; ++k) {
          total += c[r * N + k];
        }
        for (int k = 0; k < N; ++k) {
          c[r * N + k] = c[r * N + k] / (total + EPS);
        }
      }
    }
    for (int k = 0; k < N; ++k) {
      float total = 0.0f;
      for (int r = 0; r < N; ++r) {
        total += c[r * N + k];
      }
      for (int r = 0; r < N; ++r) {
        c[r * N + k] = c[r * N + k] / (total + EPS);
      }
    }
  }
}
ds4_barrier();
if (tid < N) {
  post[t * N + tid] = w[N + tid];
}
if (tid < N * N) {
  comb[t * N * N + tid] = w[2 * N + tid];
}
const GLOBAL_MEM float* h = streams + (size_t)t * N * D;
for (int d = tid; d < D; d += THREADS) {
  float acc = 0.0f;
  for (int r = 0; r < N; ++r) {
    acc += w[r] * h[r * D + d];
  }
  x[(size_t)t * D + d] = acc;
}
"""

_UPDATE = """
const size_t i = (size_t)GROUP_X * THREADS + THREAD_IN_GROUP;
if (i < (size_t)T * D) {
  const size_t t = i / D;
  const size_t d = i - t * D;
  float h[N];
  for (int r = 0; r < N; ++r) {
    h[r] = streams[(t * N + r) * D + d];
  }
  const float o = out[i];
  for (int c = 0; c < N; ++c) {
    float acc = 0.0f;
    for (int r = 0; r < N; ++r) {
      acc += comb[t * N * N + r * N + c] * h[r];
    }
    y[(t * N + c) * D + d] = post[t * N + c] * o + acc;
  }
}
"""


@cache
def split_kernel(eps: float) -> Kernel:
    """The split kernel with its epsilon written in (a float cannot be a template argument)."""
    header = f"CONSTANT float EPS = {eps!r}f;\n"
    return Kernel("ds4_hc_split", ("mix", "scale", "base", "streams"), ("x", "post", "comb"), _SPLIT, header)


UPDATE_KERNEL = Kernel("ds4_hc_update", ("out", "streams", "post", "comb"), ("y",), _UPDATE)


class HCSplit:
    """(collapsed input, post, comb) from a hyper-connection's mix, by the kernel where it passed its check."""

    def __init__(self, reference: Callable[..., tuple[mx.array, mx.array, mx.array]]):
        self.fast_path = FastPath("hc_split", reference, self._kernel, self._probe, tolerance=TOLERANCE,
                                  backends=("cuda", "metal"))

    def __call__(self, mix: mx.array, scale: mx.array, base: mx.array, streams: mx.array, iters: int,
                 eps: float) -> tuple[mx.array, mx.array, mx.array]:
        """mix (T, (2+n)n), scale (3,), base ((2+n)n,), streams (T, n, D) -> (T, D), (T, n), (T, n, n)."""
        return self.fast_path(mix, scale, base, streams, iters, eps, key=(streams.shape[1:], iters, eps))

    @staticmethod
    def _kernel(mix, scale, base, streams, iters, eps) -> tuple[mx.array, mx.array, mx.array]:
        t, n, d = streams.shape
        return tuple(build(split_kernel(eps), current_backend())(
            inputs=[mix, scale, base, streams],
            template=[("N", n), ("D", d), ("ITERS", iters), ("THREADS", THREADS)],
            grid=(t * THREADS, 1, 1), threadgroup=(THREADS, 1, 1),
            output_shapes=[(t, d), (t, n), (t, n, n)], output_dtypes=[mx.float32] * 3,
        ))

    @staticmethod
    def _probe(key: Hashable) -> tuple:
        (n, d), iters, eps = key
        m = (2 + n) * n
        return (random_activations((3, m), seed=21), random_activations((3,), seed=22),
                random_activations((m,), seed=23), random_activations((3, n, d), seed=24), iters, eps)


class HCUpdate:
    """New streams post_c * out + sum_r comb[r, c] H_r, by the kernel where it passed its check."""

    def __init__(self, reference: Callable[..., mx.array]):
        self.fast_path = FastPath("hc_update", reference, self._kernel, self._probe, tolerance=TOLERANCE,
                                  backends=("cuda", "metal"))

    def __call__(self, out: mx.array, streams: mx.array, post: mx.array, comb: mx.array) -> mx.array:
        """out (T, D), streams (T, n, D), post (T, n), comb (T, n, n) -> (T, n, D)."""
        return self.fast_path(out, streams, post, comb, key=streams.shape[1:])

    @staticmethod
    def _kernel(out, streams, post, comb) -> mx.array:
        t, n, d = streams.shape
        groups = -(-t * d // THREADS)
        (y,) = build(UPDATE_KERNEL, current_backend())(
            inputs=[out, streams, post, comb],
            template=[("N", n), ("D", d), ("T", t), ("THREADS", THREADS)],
            grid=(groups * THREADS, 1, 1), threadgroup=(THREADS, 1, 1),
            output_shapes=[(t, n, d)], output_dtypes=[mx.float32],
        )
        return y

    @staticmethod
    def _probe(key: Hashable) -> tuple:
        n, d = key
        return (random_activations((3, d), seed=31), random_activations((3, n, d), seed=32),
                random_activations((3, n), seed=33), random_activations((3, n, n), seed=34))
