"""Hyper-connection kernels (ds4.c): the pre (mix projection and split with its Sinkhorn projection), the
stream update, and the update fused with the pre that follows it.

All are tiny in arithmetic (4 streams, a 4x4 matrix) but many in operations: written in MLX ops, the Sinkhorn
projection alone is ~80 reductions and divisions per hyper-connection, two hyper-connections per layer, each one
a kernel launch on a GPU. Here:

- `HCPre`, for decode-sized inputs: rms_norm, the mix projection fn (24 x n D) and the split in two
  launches (the first spreads the 16384-long dot products over many threadgroups, the second adds their partial
  sums and splits);
- `HCMix`, for prefill chunks: the mix logits rms_norm(flat streams) @ fn.T in one launch that reads the streams
  once (as ops: a normed copy of the streams written and read back by a narrow float32 matmul);
- `HCSplit`: mix (T, (2+n)n) -> pre weights, post (T, n), comb (T, n, n) by the Sinkhorn projection (one SIMD
  group per token, one lane per comb entry), and the collapsed input sum_r pre_r H_r (T, D) by every thread of
  the group; prefill chunks use it after the mix;
- `HCUpdate`: new streams H'_c = post_c * out + sum_r comb[r, c] H_r (T, n, D), one thread per (token, dim); the
  output may come as two addends (the MoE's routed and shared parts), added here rather than in a launch of its own;
- `HCPostPre`, for decode-sized inputs: a sublayer's update and the next sublayer's pre in two launches instead of
  three (the first writes the new streams and the partial sums the pre's collapse adds up).

Their references are the plain MLX formulas in model/hyper_connection.py, passed in by the model (so the two
cannot drift apart); the kernels must equal them to float32 summation order (TOLERANCE).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from functools import cache

import mlx.core as mx

from ..machinery.dialect import SIMD_WIDTH, Kernel, build
from ..machinery.probe import random_activations
from ..machinery.registry import FastPath, current_backend

TOLERANCE = 1e-5
"""Float32 summation and exp/sigmoid rounding order only: a handful of ulps through 20 Sinkhorn steps. HCPre also
reassociates the 16384-term dot products and applies the rms factor after them rather than to each input: a few
1e-7 relative on a mix of size ~1, shrunk by the sigmoids' slope, so the same bound holds."""
THREADS = 256
PRE_TOKENS = 8
"""Token counts up to this take HCPre's two launches (decode, drafts); longer chunks HCMix (or the rms_norm and the
mix matmul) + HCSplit."""
PRE_SLICE = 4 * SIMD_WIDTH
"""Inputs per threadgroup of the fused pre's first launch: one float4 per lane."""
MIX_TOKENS = 512
"""Chunks of at least this many tokens take HCMix for the mix; shorter ones past PRE_TOKENS the rms_norm and the
matmul (HCMix's threadgroups take 32 tokens each: fewer than this leave most of a large GPU idle)."""
MIX_WARPS = 8
MIX_TOKENS_PER_WARP = 8
MIX_ROWS = 32
"""fn rows HCMix takes at most: a lane holds rows / 2 x MIX_TOKENS_PER_WARP sums in registers (Flash: 24 rows),
and two slices of them fill 32 KB of threadgroup memory."""

_SINKHORN = """
float top = c;
for (int o = 1; o < N; o <<= 1) {
  const float other = ds4_simd_xor(top, o);
  top = other > top ? other : top;
}
c = ds4_exp(c - top);
float total = c;
for (int o = 1; o < N; o <<= 1) {
  total += ds4_simd_xor(total, o);
}
c = c / total + EPS;
#pragma unroll 1
for (int it = 0; it < ITERS; ++it) {
  if (it > 0) {
    total = c;
    for (int o = 1; o < N; o <<= 1) {
      total += ds4_simd_xor(total, o);
    }
    c = c / (total + EPS);
  }
  total = c;
  for (int o = N; o < N * N; o <<= 1) {
    total += ds4_simd_xor(total, o);
  }
  c = c / (total + EPS);
}
"""
"""The Sinkhorn projection of one token's comb, run by one whole SIMD group: lane l holds entry e = l % (N N)
(row e / N, column e % N) as the logit `c` and ends with the projected value in `c`. Row sums are butterflies over
the N lanes of a row (xor masks 1 .. N/2), column sums over the lanes of a column (xor masks N .. N N / 2); every
lane of a row or column gets the same bits, and lanes past N N repeat the first ones. Same steps as `sinkhorn`.
The iterations are a chain (each needs the last one's sums), so they are not unrolled: unrolled, the 20 steps'
shuffles and divisions were most of a 28-40 KB cubin, and MLX hashes a kernel's binary at every launch (nvrtc.py)."""

_SPLIT = """
const int t = GROUP_X;
const int tid = THREAD_IN_GROUP;
SHARED float w[(2 + N) * N];
if (tid < (2 + N) * N) {
  const int part = tid < N ? 0 : (tid < 2 * N ? 1 : 2);
  w[tid] = mix[(size_t)t * (2 + N) * N + tid] * scale[part] + base[tid];
}
ds4_barrier();
if (SIMD_INDEX == 0) {
  const int lane = SIMD_LANE;
  if (lane < N) {
    post[t * N + lane] = 2.0f / (1.0f + ds4_exp(-w[N + lane]));
  }
  float c = w[2 * N + lane % (N * N)];
/*SINKHORN*/
  if (lane < N * N) {
    comb[t * N * N + lane] = c;
  }
}
float pre[N];
for (int r = 0; r < N; ++r) {
  pre[r] = 1.0f / (1.0f + ds4_exp(-w[r])) + EPS;
}
const GLOBAL_MEM float* h = streams + (size_t)t * N * D;
for (int d = tid; d < D; d += THREADS) {
  float acc = 0.0f;
  for (int r = 0; r < N; ++r) {
    acc += pre[r] * h[r * D + d];
  }
  x[(size_t)t * D + d] = acc;
}
""".replace("/*SINKHORN*/", _SINKHORN)

_SUMS = """
GLOBAL_MEM float* part = partials + (size_t)t * (M + 1) * BLOCKS + b;
if (SIMD_INDEX == 0) {
  const float squares = ds4_simd_sum(v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w);
  if (lane == 0) {
    part[0] = squares;
  }
}
for (int j = SIMD_INDEX; j < M; j += WARPS) {
  const float4 f = *reinterpret_cast<const GLOBAL_MEM float4*>(fn + (size_t)j * K + at);
  const float dot = ds4_simd_sum(v.x * f.x + v.y * f.y + v.z * f.z + v.w * f.w);
  if (lane == 0) {
    part[(size_t)(j + 1) * BLOCKS] = dot;
  }
}
"""
"""The partial sums of one 128-value slice (`at`: this lane's float4 `v` of token t's flattened streams, slice b):
its sum of squares by SIMD group 0, its dot product with fn's row j by SIMD group j % WARPS."""

_PARTIALS = """
const int t = GROUP_Y;
const int b = GROUP_X;
const int lane = SIMD_LANE;
const size_t at = (size_t)b * (4 * 32) + lane * 4;
const float4 v = *reinterpret_cast<const GLOBAL_MEM float4*>(streams + (size_t)t * K + at);
""" + _SUMS

_POST_PARTIALS = """
const int t = GROUP_Y;
const int b = GROUP_X;
const int lane = SIMD_LANE;
const size_t at = (size_t)b * (4 * 32) + lane * 4;
const int c = (int)(at / D);
const size_t d = at - (size_t)c * D;
const float4 o4 = *reinterpret_cast<const GLOBAL_MEM float4*>(out + (size_t)t * D + d);
float o[4] = {o4.x, o4.y, o4.z, o4.w};
/*ADDEND*/
float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
for (int r = 0; r < N; ++r) {
  const float4 h = *reinterpret_cast<const GLOBAL_MEM float4*>(streams + (size_t)t * K + (size_t)r * D + d);
  const float w = comb[t * N * N + r * N + c];
  acc[0] += w * h.x;
  acc[1] += w * h.y;
  acc[2] += w * h.z;
  acc[3] += w * h.w;
}
const float p = post[t * N + c];
float4 v;
v.x = p * o[0] + acc[0];
v.y = p * o[1] + acc[1];
v.z = p * o[2] + acc[2];
v.w = p * o[3] + acc[3];
if (SIMD_INDEX == 0) {
  *reinterpret_cast<GLOBAL_MEM float4*>(y + (size_t)t * K + at) = v;
}
""" + _SUMS
"""The update of one 128-value slice of the new streams (lane: 4 values of stream c, which D % 4 == 0 keeps whole;
every SIMD group computes the same bits, group 0 writes them), then its partial sums for the next pre (_SUMS)."""

_ADDEND = """
const float4 a4 = *reinterpret_cast<const GLOBAL_MEM float4*>(addend + (size_t)t * D + d);
o[0] += a4.x;
o[1] += a4.y;
o[2] += a4.z;
o[3] += a4.w;
"""
"""The sublayer output's second addend, added as one float32 add per value, as `out + addend` would be."""

_COLLAPSE = """
const int t = GROUP_Y;
const int g = GROUP_X;
const int tid = THREAD_IN_GROUP;
const int lane = SIMD_LANE;
SHARED float sums[M + 1];
const int needed = g == SLICES ? M + 1 : N + 1;
const GLOBAL_MEM float* part = partials + (size_t)t * (M + 1) * BLOCKS;
for (int p = SIMD_INDEX; p < needed; p += THREADS / 32) {
  float acc = 0.0f;
  for (int i = lane; i < BLOCKS; i += 32) {
    acc += part[(size_t)p * BLOCKS + i];
  }
  acc = ds4_simd_sum(acc);
  if (lane == 0) {
    sums[p] = acc;
  }
}
ds4_barrier();
const float rms_scale = 1.0f / sqrt(sums[0] / (float)(N * D) + NORM_EPS);
if (g == SLICES) {
  if (SIMD_INDEX == 0) {
    if (lane < N) {
      post[t * N + lane] = 2.0f / (1.0f + ds4_exp(-(sums[1 + N + lane] * rms_scale * scale[1] + base[N + lane])));
    }
    const int e = lane % (N * N);
    float c = sums[1 + 2 * N + e] * rms_scale * scale[2] + base[2 * N + e];
/*SINKHORN*/
    if (lane < N * N) {
      comb[t * N * N + lane] = c;
    }
  }
} else {
  const int d = g * THREADS + tid;
  if (d < D) {
    const GLOBAL_MEM float* h = streams + (size_t)t * N * D + d;
    float acc = 0.0f;
    for (int r = 0; r < N; ++r) {
      const float pre = 1.0f / (1.0f + ds4_exp(-(sums[1 + r] * rms_scale * scale[0] + base[r]))) + EPS;
      acc += pre * h[(size_t)r * D];
    }
    x[(size_t)t * D + d] = acc;
  }
}
""".replace("/*SINKHORN*/", _SINKHORN)

_MIX = """
const int lane = SIMD_LANE;
const int h = SIMD_INDEX & 1;  // the fn rows h * MH .. of this SIMD group
const int tokens = count[0];
const int first = (GROUP_X * (WARPS / 2) + (SIMD_INDEX >> 1)) * TW;  // its TW tokens
constexpr int SLICES = K / 128;
constexpr int PER = (M * 32 + THREADS - 1) / THREADS;  // float4 of an fn slice a thread stages
SHARED float4 stage[2][M * 32];  // fn[:, 128 s .. 128 s + 127]: row o's 32 float4 at [o * 32]
const GLOBAL_MEM float4* fn4 = reinterpret_cast<const GLOBAL_MEM float4*>(fn);
const GLOBAL_MEM float4* x4 = reinterpret_cast<const GLOBAL_MEM float4*>(flat);
int row[TW];  // float4 index of each token's row (rows past the count repeat the last token's, written nowhere)
float acc[TW][MH];
float squares[TW];
float4 v[TW], ahead[TW];
#pragma unroll
for (int j = 0; j < TW; ++j) {
  row[j] = (first + j < tokens ? first + j : tokens - 1) * (K / 4);
  squares[j] = 0.0f;
#pragma unroll
  for (int o = 0; o < MH; ++o) {
    acc[j][o] = 0.0f;
  }
  ahead[j] = x4[row[j] + lane];
}
#pragma unroll
for (int u = 0; u < PER; ++u) {
  const int i = THREAD_IN_GROUP + u * THREADS;
  if (i < M * 32) {
    stage[0][i] = fn4[(i >> 5) * (K / 4) + (i & 31)];
  }
}
ds4_barrier();
for (int s = 0; s < SLICES; ++s) {
  const bool more = s + 1 < SLICES;
  float4 next[PER];
#pragma unroll
  for (int u = 0; u < PER; ++u) {
    const int i = THREAD_IN_GROUP + u * THREADS;
    if (more && i < M * 32) {
      next[u] = fn4[(i >> 5) * (K / 4) + (s + 1) * 32 + (i & 31)];
    }
  }
#pragma unroll
  for (int j = 0; j < TW; ++j) {
    v[j] = ahead[j];
    if (more) {  // the next slice's loads in flight while this one is multiplied
      ahead[j] = x4[row[j] + (s + 1) * 32 + lane];
    }
    squares[j] += v[j].x * v[j].x + v[j].y * v[j].y + v[j].z * v[j].z + v[j].w * v[j].w;
  }
#pragma unroll
  for (int o = 0; o < MH; ++o) {
    const float4 f = stage[s & 1][(h * MH + o) * 32 + lane];
#pragma unroll
    for (int j = 0; j < TW; ++j) {
      acc[j][o] += v[j].x * f.x + v[j].y * f.y + v[j].z * f.z + v[j].w * f.w;
    }
  }
#pragma unroll
  for (int u = 0; u < PER; ++u) {
    const int i = THREAD_IN_GROUP + u * THREADS;
    if (more && i < M * 32) {
      stage[(s + 1) & 1][i] = next[u];
    }
  }
  ds4_barrier();
}
#pragma unroll
for (int j = 0; j < TW; ++j) {
  const float rms_scale = 1.0f / sqrt(ds4_simd_sum(squares[j]) / (float)K + NORM_EPS);
#pragma unroll
  for (int o = 0; o < MH; ++o) {
    const float dot = ds4_simd_sum(acc[j][o]);
    if (lane == o % 32 && first + j < tokens) {
      mix[(size_t)(first + j) * M + h * MH + o] = dot * rms_scale;
    }
  }
}
"""
"""The mix of TW tokens and half of fn's M rows a SIMD group, WARPS / 2 groups of tokens a threadgroup (rows past
the count repeat the last token's and are written nowhere). fn is read in slices of 128 values staged in threadgroup
memory (two buffers: the next slice is loaded while this one is multiplied, one barrier a slice), read there by the
SIMD groups of every token group; each lane keeps its float4 of the TW tokens' slice in registers (the next slice's
in flight) and adds its squares and dot products with the group's rows; the lanes' sums are then added and scaled
by the rms factor. An fn slice thus feeds TW tokens from threadgroup memory and WARPS / 2 TW from global memory
(read from L1 by every SIMD group, it was fetched from L2 once per group: 680 µs a launch at 8192 tokens)."""

_UPDATE = """
const size_t i = (size_t)GROUP_X * THREADS + THREAD_IN_GROUP;
if (i < (size_t)count[0] * D) {
  const size_t t = i / D;
  const size_t d = i - t * D;
  float h[N];
  for (int r = 0; r < N; ++r) {
    h[r] = streams[(t * N + r) * D + d];
  }
  const float o = out[i]/*ADDEND*/;
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


@cache
def update_kernel(addends: int) -> Kernel:
    """The update of a sublayer output given as 1 or 2 addends (the second named `addend`). The token count is an
    input (`count`), not a template constant: chunks of every length share one compiled kernel."""
    if addends == 1:
        return Kernel("ds4_hc_update", ("out", "streams", "post", "comb", "count"), ("y",),
                      _UPDATE.replace("/*ADDEND*/", ""))
    return Kernel("ds4_hc_update2", ("out", "addend", "streams", "post", "comb", "count"), ("y",),
                  _UPDATE.replace("/*ADDEND*/", " + addend[i]"))


@cache
def post_partials_kernel(addends: int) -> Kernel:
    """The first launch of HCPostPre: new streams and the next pre's partial sums, for 1 or 2 output addends."""
    inputs = ("out", "addend")[:addends] + ("streams", "post", "comb", "fn")
    source = _POST_PARTIALS.replace("/*ADDEND*/", _ADDEND if addends == 2 else "")
    return Kernel(f"ds4_hc_post_partials{addends}", inputs, ("y", "partials"), source)


PARTIALS_KERNEL = Kernel("ds4_hc_pre_partials", ("streams", "fn"), ("partials",), _PARTIALS)


@cache
def mix_kernel(norm_eps: float) -> Kernel:
    """HCMix's kernel with the rms_norm's epsilon written in; the token count is an input (`count`)."""
    return Kernel("ds4_hc_mix", ("flat", "fn", "count"), ("mix",), _MIX,
                  f"CONSTANT float NORM_EPS = {norm_eps!r}f;\n")


@cache
def collapse_kernel(eps: float, norm_eps: float) -> Kernel:
    """The second launch of the fused pre, with both epsilons written in."""
    header = f"CONSTANT float EPS = {eps!r}f;\nCONSTANT float NORM_EPS = {norm_eps!r}f;\n"
    return Kernel("ds4_hc_pre_collapse", ("partials", "scale", "base", "streams"), ("x", "post", "comb"), _COLLAPSE,
                  header)


def sinkhorn_fits(n: int) -> bool:
    """Whether one SIMD group holds whole copies of an n x n comb (n = 1, 2 or 4), as _SINKHORN needs."""
    return SIMD_WIDTH % (n * n) == 0


class HCSplit:
    """(collapsed input, post, comb) from a hyper-connection's mix, by the kernel where it passed its check."""

    def __init__(self, reference: Callable[..., tuple[mx.array, mx.array, mx.array]]):
        self.fast_path = FastPath("hc_split", reference, self._kernel, self._probe, tolerance=TOLERANCE,
                                  backends=("cuda", "metal"))

    def __call__(self, mix: mx.array, scale: mx.array, base: mx.array, streams: mx.array, iters: int,
                 eps: float) -> tuple[mx.array, mx.array, mx.array]:
        """mix (T, (2+n)n), scale (3,), base ((2+n)n,), streams (T, n, D) -> (T, D), (T, n), (T, n, n)."""
        if not sinkhorn_fits(streams.shape[1]):
            return self.fast_path.reference(mix, scale, base, streams, iters, eps)
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


class HCMix:
    """A prefill chunk's mix logits rms_norm(flat streams) @ fn.T (T, M), by one kernel where it passed its check.

    In ops this is an rms_norm that writes the normed streams (T, n D) and a float32 matmul with 24 columns that
    reads them back: on the H200 at 8192 tokens ~280 µs, then 270-520 µs (cuBLAS's SIMT GEMM, made for wide
    outputs), two per layer. The kernel reads the streams once (_MIX): MIX_WARPS SIMD groups a threadgroup, each
    adding the squares and fn dot products of MIX_TOKENS_PER_WARP tokens with half of fn's rows, fn staged in
    threadgroup memory, the rms factor applied to the sums as HCPre's collapse applies it: 409 µs a launch at 8192
    tokens (2026-12-04; 239 registers, one threadgroup an SM, ~3.5x the streams' read at full bandwidth). Float32
    sums in another order: within TOLERANCE (HCPre's argument)."""

    def __init__(self, reference: Callable[[mx.array, mx.array, float], mx.array]):
        self.fast_path = FastPath("hc_mix", reference, self._kernel, self._probe, tolerance=TOLERANCE,
                                  backends=("cuda", "metal"))

    def __call__(self, flat: mx.array, fn: mx.array, norm_eps: float) -> mx.array:
        """flat streams (T, n D), fn (M, n D) -> (T, M)."""
        if not self.fits(flat, fn):
            return self.fast_path.reference(flat, fn, norm_eps)
        return self.fast_path(flat, fn, norm_eps, key=(tuple(fn.shape), norm_eps))

    @staticmethod
    def fits(flat: mx.array, fn: mx.array) -> bool:
        """A chunk of at least MIX_TOKENS float32 tokens whose width splits into 128-value slices (int32 offsets
        into it), an even number of fn rows up to MIX_ROWS."""
        t, k = flat.shape
        return (t >= MIX_TOKENS and k % PRE_SLICE == 0 and fn.shape[1] == k and fn.shape[0] <= MIX_ROWS
                and fn.shape[0] % 2 == 0 and t * k < 2**31 and flat.dtype == fn.dtype == mx.float32)

    @staticmethod
    def _kernel(flat, fn, norm_eps) -> mx.array:
        t, (m, k) = flat.shape[0], fn.shape
        per_group = MIX_WARPS // 2 * MIX_TOKENS_PER_WARP
        (mix,) = build(mix_kernel(norm_eps), current_backend())(
            inputs=[flat, fn, mx.array([t], dtype=mx.int32)],
            template=[("K", k), ("M", m), ("MH", m // 2), ("TW", MIX_TOKENS_PER_WARP), ("WARPS", MIX_WARPS),
                      ("THREADS", MIX_WARPS * SIMD_WIDTH)],
            grid=(-(-t // per_group) * MIX_WARPS * SIMD_WIDTH, 1, 1), threadgroup=(MIX_WARPS * SIMD_WIDTH, 1, 1),
            output_shapes=[(t, m)], output_dtypes=[mx.float32],
        )
        return mix

    @staticmethod
    def _probe(key: Hashable) -> tuple:
        """42 tokens (the last threadgroup's second group of tokens with two of its eight, its last two groups
        with none), inputs as HCPre's probe makes them."""
        (m, k), norm_eps = key
        return random_activations((42, k), seed=45), random_activations((m, k), seed=46) * (2.0 / k**0.5), norm_eps


class HCPre:
    """A hyper-connection's whole pre (rms_norm, the mix projection, split) in two launches, for a few tokens.

    The mix is 24 dot products of length n D = 16384 per token: as a matmul it is a gemv whose 24 rows leave the
    GPU mostly idle, followed by the split. Here the first launch (PARTIALS_KERNEL) spreads the inputs over
    n D / 128 threadgroups, each adding one float4 per lane of the streams and of every fn row, and writes the
    per-group sums of squares and dot products, (T, 1 + M, groups); the second (collapse_kernel) has every group
    add those up (M + 1 values per token, n + 1 where only the pre weights are needed), scale them by the rms
    factor and apply the split: ceil(D / THREADS) groups per token write the collapsed input, one more the post
    weights and the Sinkhorn-projected comb (_SINKHORN). fn is read once per token, the streams twice.
    """

    def __init__(self, reference: Callable[..., tuple[mx.array, mx.array, mx.array]]):
        self.fast_path = FastPath("hc_pre", reference, self._kernel, self._probe, tolerance=TOLERANCE,
                                  backends=("cuda", "metal"))

    def __call__(self, streams: mx.array, fn: mx.array, scale: mx.array, base: mx.array, iters: int, eps: float,
                 norm_eps: float) -> tuple[mx.array, mx.array, mx.array]:
        """streams (T, n, D), fn ((2+n)n, nD), scale (3,), base ((2+n)n,) -> (T, D), (T, n), (T, n, n)."""
        args = (streams, fn, scale, base, iters, eps, norm_eps)
        if not self.fits(streams, fn):
            return self.fast_path.reference(*args)
        return self.fast_path(*args, key=(streams.shape[1:], iters, eps, norm_eps))

    @staticmethod
    def fits(streams: mx.array, fn: mx.array) -> bool:
        """A decode-sized float32 input whose width splits into whole 128-value slices (prefill chunks take the
        mix (HCMix, or the matmul) and HCSplit: this path reads fn once per token)."""
        t, n, d = streams.shape
        return (t <= PRE_TOKENS and sinkhorn_fits(n) and (n * d) % PRE_SLICE == 0
                and fn.shape == ((2 + n) * n, n * d) and streams.dtype == fn.dtype == mx.float32)

    @staticmethod
    def _kernel(streams, fn, scale, base, iters, eps, norm_eps) -> tuple[mx.array, mx.array, mx.array]:
        t, n, d = streams.shape
        m, k = fn.shape
        groups = k // PRE_SLICE
        (partials,) = build(PARTIALS_KERNEL, current_backend())(
            inputs=[streams, fn],
            template=[("K", k), ("M", m), ("BLOCKS", groups), ("WARPS", THREADS // SIMD_WIDTH)],
            grid=(groups * THREADS, t, 1), threadgroup=(THREADS, 1, 1),
            output_shapes=[(t, m + 1, groups)], output_dtypes=[mx.float32],
        )
        return HCPre.collapse(partials, scale, base, streams, iters, eps, norm_eps)

    @staticmethod
    def collapse(partials, scale, base, streams, iters, eps, norm_eps) -> tuple[mx.array, mx.array, mx.array]:
        """The second launch: partial sums (T, 1 + M, groups) of `streams` -> (T, D), (T, n), (T, n, n)."""
        t, n, d = streams.shape
        m, groups = partials.shape[1] - 1, partials.shape[2]
        slices = -(-d // THREADS)
        return tuple(build(collapse_kernel(eps, norm_eps), current_backend())(
            inputs=[partials, scale, base, streams],
            template=[("N", n), ("D", d), ("M", m), ("BLOCKS", groups), ("SLICES", slices), ("ITERS", iters),
                      ("THREADS", THREADS)],
            grid=((slices + 1) * THREADS, t, 1), threadgroup=(THREADS, 1, 1),
            output_shapes=[(t, d), (t, n), (t, n, n)], output_dtypes=[mx.float32] * 3,
        ))

    @staticmethod
    def _probe(key: Hashable) -> tuple:
        """Three tokens; fn at 2 / sqrt(n D) so the mix is O(2): the sigmoids and the Sinkhorn are not saturated."""
        (n, d), iters, eps, norm_eps = key
        m, k = (2 + n) * n, n * d
        return (random_activations((3, n, d), seed=41), random_activations((m, k), seed=42) * (2.0 / k**0.5),
                1.0 + 0.2 * random_activations((3,), seed=43), 0.5 * random_activations((m,), seed=44), iters, eps,
                norm_eps)


class HCUpdate:
    """New streams post_c * out + sum_r comb[r, c] H_r, by the kernel where it passed its check."""

    def __init__(self, reference: Callable[..., mx.array]):
        self.fast_path = FastPath("hc_update", reference, self._kernel, self._probe, tolerance=TOLERANCE,
                                  backends=("cuda", "metal"))

    def __call__(self, out: mx.array, streams: mx.array, post: mx.array, comb: mx.array,
                 addend: mx.array | None = None) -> mx.array:
        """out (T, D) (plus addend (T, D): the output as two parts), streams (T, n, D), post (T, n), comb (T, n, n)
        -> (T, n, D)."""
        key = (streams.shape[1:], 1 if addend is None else 2)
        return self.fast_path(out, streams, post, comb, addend, key=key)

    @staticmethod
    def _kernel(out, streams, post, comb, addend) -> mx.array:
        t, n, d = streams.shape
        groups = -(-t * d // THREADS)
        outputs = [out] if addend is None else [out, addend]
        (y,) = build(update_kernel(len(outputs)), current_backend())(
            inputs=[*outputs, streams, post, comb, mx.array([t], dtype=mx.int32)],
            template=[("N", n), ("D", d), ("THREADS", THREADS)],
            grid=(groups * THREADS, 1, 1), threadgroup=(THREADS, 1, 1),
            output_shapes=[(t, n, d)], output_dtypes=[mx.float32],
        )
        return y

    @staticmethod
    def _probe(key: Hashable) -> tuple:
        (n, d), addends = key
        return (random_activations((3, d), seed=31), random_activations((3, n, d), seed=32),
                random_activations((3, n), seed=33), random_activations((3, n, n), seed=34),
                random_activations((3, d), seed=35) if addends == 2 else None)


class HCPostPre:
    """A sublayer's HC-post and the next sublayer's HC-pre, in two launches for a few tokens (three apart).

    The pre's first launch reads the streams the post has just written, to add up their squares and their dot
    products with fn; here one launch (post_partials_kernel) computes each 128-value slice of the new streams, writes
    it and adds up its partial sums at once, over HCPre's threadgroups; HCPre's collapse then finishes the pre.
    The output may come as two addends, summed in the kernel. Elsewhere (longer chunks, other dtypes, a backend
    where the kernel failed its check) the update and the pre run apart, each by its own fast path.
    """

    def __init__(self, reference: Callable[..., tuple[mx.array, mx.array, mx.array, mx.array]], update: HCUpdate,
                 pre: HCPre):
        self.fast_path = FastPath("hc_post_pre", reference, self._kernel, self._probe, tolerance=TOLERANCE,
                                  backends=("cuda", "metal"))
        self.update, self.pre = update, pre

    def __call__(self, out: mx.array, addend: mx.array | None, streams: mx.array, post: mx.array, comb: mx.array,
                 fn: mx.array, scale: mx.array, base: mx.array, iters: int, eps: float,
                 norm_eps: float) -> tuple[mx.array, mx.array, mx.array, mx.array]:
        """The update's arguments (addend None for a one-part output), then the pre's -> the new streams (T, n, D)
        and the pre's (T, D), (T, n), (T, n, n)."""
        key = (streams.shape[1:], 1 if addend is None else 2, iters, eps, norm_eps)
        if self.fits(out, addend, streams, post, comb, fn) and self.fast_path.enabled(key):
            return self.fast_path(out, addend, streams, post, comb, fn, scale, base, iters, eps, norm_eps, key=key)
        new = self.update(out, streams, post, comb, addend)
        return (new, *self.pre(new, fn, scale, base, iters, eps, norm_eps))

    @staticmethod
    def fits(out: mx.array, addend: mx.array | None, streams: mx.array, post: mx.array, comb: mx.array,
             fn: mx.array) -> bool:
        """What HCPre takes, float32 throughout, and streams whose width keeps each lane's 4 values in one stream."""
        parts = (out, post, comb) if addend is None else (out, addend, post, comb)
        return (HCPre.fits(streams, fn) and streams.shape[2] % 4 == 0
                and all(a.dtype == mx.float32 for a in parts) and out.shape == (streams.shape[0], streams.shape[2]))

    @staticmethod
    def _kernel(out, addend, streams, post, comb, fn, scale, base, iters, eps,
                norm_eps) -> tuple[mx.array, mx.array, mx.array, mx.array]:
        t, n, d = streams.shape
        m, k = fn.shape
        groups = k // PRE_SLICE
        outputs = [out] if addend is None else [out, addend]
        new, partials = build(post_partials_kernel(len(outputs)), current_backend())(
            inputs=[*outputs, streams, post, comb, fn],
            template=[("N", n), ("D", d), ("K", k), ("M", m), ("BLOCKS", groups), ("WARPS", THREADS // SIMD_WIDTH)],
            grid=(groups * THREADS, t, 1), threadgroup=(THREADS, 1, 1),
            output_shapes=[(t, n, d), (t, m + 1, groups)], output_dtypes=[mx.float32] * 2,
        )
        return (new, *HCPre.collapse(partials, scale, base, new, iters, eps, norm_eps))

    @staticmethod
    def _probe(key: Hashable) -> tuple:
        """Three tokens, comb rows a softmax (near-stochastic, as the Sinkhorn makes it), the pre's inputs as
        HCPre's probe makes them."""
        (n, d), addends, iters, eps, norm_eps = key
        m, k = (2 + n) * n, n * d
        return (random_activations((3, d), seed=51), random_activations((3, d), seed=52) if addends == 2 else None,
                random_activations((3, n, d), seed=53), 2 * mx.sigmoid(random_activations((3, n), seed=54)),
                mx.softmax(random_activations((3, n, n), seed=55), axis=-1),
                random_activations((m, k), seed=56) * (2.0 / k**0.5), 1.0 + 0.2 * random_activations((3,), seed=57),
                0.5 * random_activations((m,), seed=58), iters, eps, norm_eps)
