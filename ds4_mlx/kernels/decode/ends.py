"""The decode step's two ends as one launch each: the token's embedding row as the n_hc streams (ds4.c), and
the final hyper-connection collapse before the output norm (model/hyper_connection.py `HyperHead`).

Done with MLX ops they are a gather, a dtype view, a cast and a broadcast that every kernel reading it copies, and
a norm, a matmul, a sigmoid, a product and a sum: a dozen nodes a token, each with the host cost of a node; and a
step that is to run as one CUDA graph of our own (kernels/machinery/cudagraph.py) may hold no built-in op that reads the
token or the streams, since only custom kernels are replayed.

Both take the B rows of a step over several rows (grid y: the row); their checks are made at the row count used.
EMBED_KERNEL: one thread per stream value, each a float16 (or float32) table value of the row's token, converted
exactly. HEAD_KERNEL: one threadgroup of 1024 threads a row; each thread's share of the row's flattened streams
gives its sum of squares and its dot products with the n_hc rows of fn in one pass (the norm is a scalar, so it
scales the dot products after), SIMD sums and a pass over the SIMD groups' sums give the totals, and every thread
forms the n_hc weights and writes its values of the weighted sum of the streams.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

import mlx.core as mx

from ..machinery.dialect import Kernel, build
from ..machinery.registry import FastPath, current_backend

EMBED_KERNEL = Kernel("ds4_embed_streams", ("table", "token"), ("streams",), """
const int i = GROUP_X * 256 + THREAD_IN_GROUP;
if (i < HC * D) {
  const size_t at = (size_t)token[GROUP_Y] * D + (i % D);
  streams[(size_t)GROUP_Y * HC * D + i] = HALF ? ds4_half_to_float(((const GLOBAL_MEM unsigned short*)table)[at])
                    : ((const GLOBAL_MEM float*)table)[at];
}
""")

HEAD_THREADS = 1024
HEAD_KERNEL = Kernel("ds4_hc_head", ("streams", "fn", "scale", "base", "eps"), ("out",), """
const int t = THREAD_IN_GROUP;
streams += (size_t)GROUP_Y * HC * D;
out += (size_t)GROUP_Y * D;
SHARED float sums[HC + 1][32];
float acc[HC + 1];
for (int h = 0; h <= HC; ++h) {
  acc[h] = 0.0f;
}
for (int j = t; j < HC * D; j += 1024) {
  const float v = streams[j];
  acc[HC] += v * v;
  for (int h = 0; h < HC; ++h) {
    acc[h] += v * fn[(size_t)h * HC * D + j];
  }
}
for (int h = 0; h <= HC; ++h) {
  const float s = ds4_simd_sum(acc[h]);
  if (SIMD_LANE == 0) {
    sums[h][SIMD_INDEX] = s;
  }
}
ds4_barrier();
float squares = 0.0f;
for (int k = 0; k < 32; ++k) {
  squares += sums[HC][k];
}
const float r = 1.0f / sqrt(squares / (float)(HC * D) + eps[0]);
float weights[HC];
for (int h = 0; h < HC; ++h) {
  float dot = 0.0f;
  for (int k = 0; k < 32; ++k) {
    dot += sums[h][k];
  }
  weights[h] = 1.0f / (1.0f + exp(-(dot * r * scale[0] + base[h]))) + eps[1];
}
for (int i = t; i < D; i += 1024) {
  float o = 0.0f;
  for (int h = 0; h < HC; ++h) {
    o += weights[h] * streams[h * D + i];
  }
  out[i] = o;
}
""")

HEAD_ROWS = 16
"""Most tokens the head kernel takes (a decode step's rows); a prefill chunk's take HyperHead's composition."""
HEAD_TOLERANCE = 1e-5
"""Relative to the largest output: the norm scales the dot products after they are summed (a few float32 ulps
from normed values dotted), and every sum is taken in another order than MLX's."""


def embed_reference(table: mx.array, token: mx.array, n_hc: int) -> mx.array:
    """The streams (B, n_hc, D) float32 of tokens (B,): each one's row of the table (float16 or float32 values, or
    the bytes of float16 ones: uint8 (V, 2 * D)), once per stream."""
    row = table[token]
    row = (mx.view(row, mx.float16) if row.dtype == mx.uint8 else row).astype(mx.float32)
    return mx.broadcast_to(row[:, None, :], (token.shape[0], n_hc, row.shape[-1]))


def table_width(table: mx.array) -> int:
    return table.shape[1] // 2 if table.dtype == mx.uint8 else table.shape[1]


class EmbedStreams:
    """The tokens' rows as streams in one launch, where the kernel passed its check at that many tokens."""

    def __init__(self) -> None:
        self.fast_path = FastPath("embed_streams", embed_reference, self._kernel, self._probe, tolerance=0.0,
                                  backends=("cuda", "metal"))

    def __call__(self, table: mx.array, token: mx.array, n_hc: int) -> mx.array:
        if table.dtype not in (mx.float16, mx.float32, mx.uint8) or token.ndim != 1 or token.size == 0:
            return embed_reference(table, token, n_hc)
        return self.fast_path(table, token, n_hc, key=(table_width(table), n_hc, table.dtype, token.size))

    @staticmethod
    def _kernel(table: mx.array, token: mx.array, n_hc: int) -> mx.array:
        width = table_width(table)
        (streams,) = build(EMBED_KERNEL, current_backend())(
            inputs=[table, token.astype(mx.int32)],
            template=[("HC", n_hc), ("D", width), ("HALF", table.dtype != mx.float32)],
            grid=(256 * ((n_hc * width + 255) // 256), token.size, 1), threadgroup=(256, 1, 1),
            output_shapes=[(token.size, n_hc, width)], output_dtypes=[mx.float32])
        return streams

    @staticmethod
    def _probe(key: Hashable) -> tuple:
        width, n_hc, dtype, tokens = key
        table = (mx.random.normal((tokens + 4, width), key=mx.random.key(3)) * 3).astype(
            mx.float32 if dtype == mx.float32 else mx.float16)
        ids = mx.array([(3 + 5 * i) % (tokens + 4) for i in range(tokens)], dtype=mx.int32)
        return (mx.view(table, mx.uint8) if dtype == mx.uint8 else table), ids, n_hc


class HeadCollapse:
    """HyperHead's collapse of a few tokens' streams in one launch (a threadgroup a token), where the kernel passed
    its check at that many tokens; `reference` (HyperHead's composition) takes a prefill chunk's, and the shapes the
    kernel does not."""

    def __init__(self, reference: Callable[..., mx.array]):
        self.fast_path = FastPath("hc_head", reference, self._kernel, self._probe, tolerance=HEAD_TOLERANCE,
                                  backends=("cuda", "metal"))

    def __call__(self, streams: mx.array, fn: mx.array, scale: mx.array, base: mx.array, hc_eps: float,
                 norm_eps: float) -> mx.array:
        """streams (T, n_hc, D) -> (T, D)."""
        args = (streams, fn, scale, base, hc_eps, norm_eps)
        n_hc, width = streams.shape[1:]
        if (not 0 < streams.shape[0] <= HEAD_ROWS or n_hc > 8 or any(a.dtype != mx.float32 for a in (streams, fn, scale, base))
                or fn.shape != (n_hc, n_hc * width) or base.shape != (n_hc,)):
            return self.fast_path.reference(*args)
        return self.fast_path(*args, key=(n_hc, width, streams.shape[0]))

    @staticmethod
    def _kernel(streams: mx.array, fn: mx.array, scale: mx.array, base: mx.array, hc_eps: float,
                norm_eps: float) -> mx.array:
        n_hc, width = streams.shape[1:]
        eps = mx.array([norm_eps, hc_eps], dtype=mx.float32)
        (out,) = build(HEAD_KERNEL, current_backend())(
            inputs=[streams, fn, scale, base, eps], template=[("HC", n_hc), ("D", width)],
            grid=(HEAD_THREADS, streams.shape[0], 1), threadgroup=(HEAD_THREADS, 1, 1),
            output_shapes=[(streams.shape[0], width)], output_dtypes=[mx.float32])
        return out

    @staticmethod
    def _probe(key: Hashable) -> tuple:
        n_hc, width, tokens = key
        k = mx.random.split(mx.random.key(5), 3)
        streams = mx.random.normal((tokens, n_hc, width), key=k[0]) * mx.arange(1, tokens + 1)[:, None, None]
        fn = mx.random.normal((n_hc, n_hc * width), key=k[1]) * 0.05
        return streams, fn, mx.array([0.7]), mx.random.normal((n_hc,), key=k[2]), 1e-6, 1e-6


EMBED_STREAMS = EmbedStreams()
