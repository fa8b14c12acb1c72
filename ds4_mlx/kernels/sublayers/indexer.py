"""The lightning indexer's choice (ds4.c) in two launches: the scores, then the top k. For decode queries, and
for a prefill chunk's (finished by then: rope None), where the composition below held a (B, H, N) float32 product
and ~10 launches per block of queries.

In MLX ops the decode step's choice is ~20 launches per ratio-4 layer: the score product, relu, weighting and head
sum, the visibility mask, `top_k_mask` (partition, comparisons, sum, cumulative sum), `mask_to_indices`
(argpartition, gather, sort) and the validity gather. Here, for queries (T, H, D) at `positions` (T,) over the
indexer rows (N, D), of which the first (p + 1) // ratio are visible to a query at p:

- `SCORES_KERNEL`: score_r = sum_h w_h relu(q_h . k_r), float32, for every visible row; -inf for the others. Each
  SIMD group takes 4 rows at a time (float4 loads every lane shares), each lane 2 of the 64 heads (the queries sit
  transposed in threadgroup memory), the lanes' weighted terms are summed across the group. A query with at most
  top_k visible rows writes nothing: all of them are picked, so no score is read. It takes q_b's output and
  finishes the queries while it stages them (every threadgroup all 64 x 128 values, a head per SIMD group at a
  time with shuffles and no barrier: RoPE at the position, then, simulating, Hadamard + FP4), with the arithmetic
  of kernels/sublayers/rows.py's finish kernel: the decode step's query finish is no launch of its own. (Finished
  through threadgroup memory, 256 threads a pass with a barrier a butterfly, the finish took most of the launch's 77 µs
  at 2k: 2026-12-02.)
- `SELECT_KERNEL`: one threadgroup of 1024 threads per query. With at most top_k visible rows the answer is fixed:
  indices 0..top_k-1, valid below the visible count (what `mask_to_indices` pads with). Otherwise it finds the
  top_k-th largest score by a radix select over order-preserving uint32 keys (4 passes of 8 bits, a 256-bin
  histogram in threadgroup memory each), admits the rows above it and the tied rows in index order until top_k
  (ds4's rule: the lower index wins), and writes them in ascending order: a threadgroup-wide prefix count over
  contiguous row ranges gives each thread its first output slot.

Any number of queries T works (the decode step has one). Expected on the H200 (estimates, not measured): the
score kernel does 8k FP32 FMAs per visible row (64 heads x 128 dims), ~1 us at 2k rows and ~3-4 us at 8k (32k
tokens); the select is one threadgroup: ~1 us with at most top_k rows visible (every position below 2k tokens),
a few us at 8k rows (4 histogram passes over them).

Its reference is `pick_finished_rows` in model/attention.py, handed in by the model: the queries' finish
(`finish_rows`), then `pick_rows` (`mask_to_indices(select(...))` and the validity gather). The selection is exact
given the scores; the scores are the reference's float32 products and sums in another order (within
SCORE_TOLERANCE of the largest score), and the finish's RoPE rounds a few ulps apart (kernels/sublayers/rows.py
TOLERANCE), so where two scores at the top_k-th place are closer than that rounding, the two can pick different rows.
The first-use probe therefore uses inputs whose finished queries and scores are exact in any summation order (see
`IndexerPick._probe`), with triplicated rows so that the top_k-th place is tied, and asks for identical indices
and validity (tolerance 0).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

import mlx.core as mx
import numpy as np

from ...model.rope import RoPE
from ..machinery.dialect import SIMD_EXCLUSIVE_SUM, SIMD_WIDTH, Kernel, build
from ..tensor_cores.halfsplit import SPLIT_ROW, held_split
from ..machinery.registry import FastPath, current_backend
from .rows import ROW_HELPERS, RowQuant, fits, steady_rows

SCORE_TOLERANCE = 1e-5
"""The kernel's scores against the reference's, relative to the largest: float32 sums of 128 products per head and
of 64 weighted heads, in another order."""
ROWS_PER_SIMD = 4
SCORE_SIMDS = 8
MAX_SCORE_GROUPS = 512
"""Threadgroups of the score kernel at most (each stages the queries once; more rows loop)."""
SELECT_THREADS = 1024
QUERY_BYTES = 32768
"""Threadgroup memory for a query's heads (64 heads of 128 floats exactly): Metal's limit."""

_HELPERS = """
DEVICE_FN float ix_lane(float4 v, int e) {
  return e == 0 ? v.x : (e == 1 ? v.y : (e == 2 ? v.z : v.w));
}
DEVICE_FN unsigned int ix_key(float score) {
  unsigned int bits = ds4_bits(score);
  bits = (bits << 1) == 0u ? 0u : bits;  // -0 is +0, as comparisons have it
  return (bits & 0x80000000u) != 0u ? ~bits : (bits | 0x80000000u);
}
"""
"""ix_key: float -> uint32 in the same order (negatives bit-flipped, positives with the sign bit set).
The header also takes dialect.SIMD_EXCLUSIVE_SUM."""

_SCORES = """
const int t = GROUP_Y;
const int lane = SIMD_LANE;
const int warp = SIMD_INDEX;
SHARED float qt[D * HP];
int visible = (position[t] + 1) / RATIO;
visible = visible < N ? visible : N;
if (visible <= K) {
  return;
}
{
  // the queries finished as rows.py's FINISH_KERNEL does (RoPE at the position, then QUANT), a head per
  // SIMD group at a time with no barrier: lane l holds dims l * V .. l * V + V - 1, a RoPE pair is two values of a
  // lane (of two neighbouring lanes where V is 1), the Hadamard's butterflies below V in the lane and above it
  // across lanes (aq_hadamard's stages, in its order), an FP4 block of 32 is 32 / V lanes. Then staged
  // transposed, head h of dim d at d * HP + (h ^ (d & 31)) (a swizzle: the score loop's reads do not conflict)
  constexpr int V = D / 32;
  constexpr int HEADS_A_SIMD = HP / WARPS;
  const int p_t = position[t];
  float cs[V], sn[V];  // the lane's RoPE angles are the same for every head
  #pragma unroll
  for (int e = 0; e < V; ++e) {
    const int i = lane * V + e;
    const float angle = i >= D - NROT ? (float)p_t * inv_freq[(i - (D - NROT)) >> 1] : 0.0f;
    cs[e] = ds4_cos(angle);
    sn[e] = ds4_sin(angle);
  }
  float x[HEADS_A_SIMD][V];  // every head's loads in flight before any is used
  #pragma unroll
  for (int k = 0; k < HEADS_A_SIMD; ++k) {
    const int h = warp + k * WARPS;
    #pragma unroll
    for (int e = 0; e < V; ++e) {
      x[k][e] = h < H ? q[((size_t)t * H + h) * D + lane * V + e] : 0.0f;
    }
  }
  #pragma unroll
  for (int k = 0; k < HEADS_A_SIMD; ++k) {
    const int h = warp + k * WARPS;
    float v[V];
    #pragma unroll
    for (int e = 0; e < V; ++e) {
      const int i = lane * V + e;
      const float partner = V == 1 ? ds4_simd_xor(x[k][0], 1) : x[k][e ^ 1];
      v[e] = i < D - NROT ? x[k][e] : ((i & 1) ? partner * sn[e] + x[k][e] * cs[e] : x[k][e] * cs[e] - partner * sn[e]);
    }
    if (QUANT == 2) {
      #pragma unroll
      for (int s = 1; s < D; s <<= 1) {
        if (s < V) {
          float u[V];
          #pragma unroll
          for (int e = 0; e < V; ++e) {
            u[e] = (e & s) ? v[e & ~s] - v[e | s] : v[e & ~s] + v[e | s];
          }
          #pragma unroll
          for (int e = 0; e < V; ++e) {
            v[e] = u[e];
          }
        } else {
          #pragma unroll
          for (int e = 0; e < V; ++e) {
            const float o = ds4_simd_xor(v[e], s / V);
            v[e] = (lane & (s / V)) ? o - v[e] : v[e] + o;
          }
        }
      }
      float amax = 0.0f;
      #pragma unroll
      for (int e = 0; e < V; ++e) {
        v[e] *= 0.08838834764831845f;
        const float a = v[e] < 0.0f ? -v[e] : v[e];
        amax = a > amax ? a : amax;
      }
      #pragma unroll
      for (int o = 1; o < 32 / V; o <<= 1) {
        const float other = ds4_simd_xor(amax, o);
        amax = other > amax ? other : amax;
      }
      const float block_scale = aq_fp4_scale(amax);
      #pragma unroll
      for (int e = 0; e < V; ++e) {
        v[e] = aq_fp4(v[e], block_scale);
      }
    }
    #pragma unroll
    for (int e = 0; e < V; ++e) {
      const int i = lane * V + e;
      qt[i * HP + (h ^ (i & 31))] = h < H ? v[e] : 0.0f;
    }
  }
}
float wl[HP / 32];
for (int j = 0; j < HP / 32; ++j) {
  const int h = 32 * j + lane;
  wl[j] = h < H ? w[(size_t)t * H + h] * scale[0] : 0.0f;
}
ds4_barrier();
const GLOBAL_MEM float4* rows4 = reinterpret_cast<const GLOBAL_MEM float4*>(rows);
GLOBAL_MEM float* out = scores + (size_t)t * N;
const float below = -ds4_float(0x7f800000u);
for (int g = GROUP_X * WARPS + warp; g * R < N; g += BLOCKS * WARPS) {
  const int r0 = g * R;
  if (r0 >= visible) {
    if (lane < R && r0 + lane < N) {
      out[r0 + lane] = below;
    }
    continue;
  }
  float acc[R][HP / 32];  // unrolled loops keep acc and k in registers
  #pragma unroll
  for (int r = 0; r < R; ++r) {
    #pragma unroll
    for (int j = 0; j < HP / 32; ++j) {
      acc[r][j] = 0.0f;
    }
  }
  for (int c = 0; c < D / 4; ++c) {
    const int swizzled = lane ^ ((4 * c) & 31);  // dim 4c + e's heads lie at (h ^ (4c & 31)) ^ e
    float4 k[R];
    #pragma unroll
    for (int r = 0; r < R; ++r) {
      k[r] = rows4[(size_t)(r0 + r < N ? r0 + r : N - 1) * (D / 4) + c];
    }
    #pragma unroll
    for (int e = 0; e < 4; ++e) {
      #pragma unroll
      for (int j = 0; j < HP / 32; ++j) {
        const float qv = qt[(4 * c + e) * HP + 32 * j + (swizzled ^ e)];
        #pragma unroll
        for (int r = 0; r < R; ++r) {
          acc[r][j] += qv * ix_lane(k[r], e);
        }
      }
    }
  }
  #pragma unroll
  for (int r = 0; r < R; ++r) {
    float part = 0.0f;
    #pragma unroll
    for (int j = 0; j < HP / 32; ++j) {
      part += wl[j] * (acc[r][j] > 0.0f ? acc[r][j] : 0.0f);
    }
    const float score = ds4_simd_sum(part);
    if (lane == 0 && r0 + r < N) {
      out[r0 + r] = r0 + r < visible ? score : below;
    }
  }
}
"""

_SELECT = """
const int N = count[0];
const int t = GROUP_X;
const int tid = THREAD_IN_GROUP;
const int lane = SIMD_LANE;
const int warp = SIMD_INDEX;
SHARED int hist[256];
SHARED int sums[2 * (THREADS / 32)];
SHARED int found[2];
int visible = (position[t] + 1) / RATIO;
visible = visible < N ? visible : N;
GLOBAL_MEM int* out = picked + (size_t)t * W;
GLOBAL_MEM bool* ok = valid + (size_t)t * W;
if (visible <= K) {
  for (int i = tid; i < W; i += THREADS) {
    out[i] = i;
    ok[i] = i < visible;
  }
  return;
}
for (int i = tid; i < W; i += THREADS) {
  ok[i] = true;
}
const GLOBAL_MEM float* s = scores + (size_t)t * N;
const int rounds = (visible + THREADS - 1) / THREADS;
unsigned int prefix = 0u;
unsigned int decided = 0u;
int rank = K;  // the wanted key is the rank-th largest of those that match prefix on the decided bits
for (int shift = 24; shift >= 0; shift -= 8) {
  for (int b = tid; b < 256; b += THREADS) {
    hist[b] = 0;
  }
  ds4_barrier();
  for (int j = 0; j < rounds; ++j) {
    const int i = j * THREADS + tid;
    if (i < visible) {
      const unsigned int key = ix_key(s[i]);
      if ((key & decided) == prefix) {
        ds4_atomic_add(hist + ((key >> shift) & 255u), 1);
      }
    }
  }
  ds4_barrier();
  if (warp == 0) {
    const int top = 255 - 8 * lane;  // this lane's bins, from the highest: top, top - 1, ..., top - 7
    int count = 0;
    for (int b = 0; b < 8; ++b) {
      count += hist[top - b];
    }
    int above = ds4_simd_exclusive_sum(count, lane);
    for (int b = 0; b < 8; ++b) {
      const int c = hist[top - b];
      if (above < rank && rank <= above + c) {
        found[0] = top - b;
        found[1] = rank - above;
      }
      above += c;
    }
  }
  ds4_barrier();
  prefix |= (unsigned int)found[0] << shift;
  decided |= 255u << shift;
  rank = found[1];
}
const int lo = tid * rounds;
const int hi = lo + rounds < visible ? lo + rounds : visible;
int n_above = 0;
int n_tied = 0;
for (int i = lo; i < hi; ++i) {
  const unsigned int key = ix_key(s[i]);
  n_above += key > prefix ? 1 : 0;
  n_tied += key == prefix ? 1 : 0;
}
int above = ds4_simd_exclusive_sum(n_above, lane);
int tied = ds4_simd_exclusive_sum(n_tied, lane);
if (lane == 31) {
  sums[warp] = above + n_above;
  sums[THREADS / 32 + warp] = tied + n_tied;
}
ds4_barrier();
for (int g = 0; g < warp; ++g) {
  above += sums[g];
  tied += sums[THREADS / 32 + g];
}
for (int i = lo; i < hi; ++i) {
  const unsigned int key = ix_key(s[i]);
  if (key > prefix) {
    out[above + (tied < rank ? tied : rank)] = i;
    above += 1;
  } else if (key == prefix) {
    if (tied < rank) {
      out[above + tied] = i;
    }
    tied += 1;
  }
}
"""
"""After the passes `prefix` is the top_k-th largest key and `rank` the number of rows with that key to admit
(top_k less those above it); a row's slot is the rows above it before it plus min(tied rows before it, rank)."""

SCORES_KERNEL = Kernel("ds4_indexer_scores", ("q", "w", "rows", "position", "scale", "inv_freq"), ("scores",),
                       _SCORES, _HELPERS + ROW_HELPERS)
SELECT_KERNEL = Kernel("ds4_indexer_select", ("scores", "position", "count"), ("picked", "valid"), _SELECT,
                       _HELPERS + SIMD_EXCLUSIVE_SUM)
"""The tensor score and select kernels take the row count N as an input (`count`), not a template constant: a
prefill chunk's rows grow with its position, and chunks of every length and position share one compiled kernel."""


_TENSOR_SCORES = """
const int N = count[0];
const int t = GROUP_Y;
const int lane = SIMD_LANE;
const int warp = SIMD_INDEX;
const int g = lane >> 2;  // the mma fragments' row (C) or column (B) within a tile
const int c4 = lane & 3;
constexpr int LDW = D / 2 + 4;  // words (half pairs) a plane row: ldmatrix's 8 rows x 16 bytes on 32 banks
constexpr int TILE = WK * WARPS;  // keys a round: WK a warp
int visible = (position[t] + 1) / RATIO;
visible = visible < N ? visible : N;
const int begin = GROUP_X * KEYS;
const int end = begin + KEYS < N ? begin + KEYS : N;
if (visible <= K || begin >= end) {
  return;  // every visible row is picked: no score is read (as the SIMT kernel leaves it)
}
GLOBAL_MEM float* out = scores + (size_t)t * N;
SHARED_MEM unsigned int* qh = reinterpret_cast<SHARED_MEM unsigned int*>(ds4_shared);  // 16 MT x LDW, then lo
SHARED_MEM unsigned int* ql = qh + 16 * MT * LDW;
SHARED_MEM unsigned int* kh = ql + 16 * MT * LDW + warp * 2 * WK * LDW;  // the warp's keys: WK x LDW hi, then lo
SHARED_MEM unsigned int* kl = kh + WK * LDW;
SHARED_MEM float* w_s = reinterpret_cast<SHARED_MEM float*>(qh + 2 * (16 * MT + TILE) * LDW);  // 16 MT
SHARED_MEM float* kscale = w_s + 16 * MT + warp * WK;  // the warp's keys' row scales
for (int h = warp; h < 16 * MT; h += WARPS) {  // the queries, split once
  float2 v[D / 64];
  for (int j = 0; j < D / 64; ++j) {
    v[j] = h < H ? *reinterpret_cast<const GLOBAL_MEM float2*>(q + ((size_t)t * H + h) * D + 2 * lane + 64 * j)
                 : make_float2(0.0f, 0.0f);
  }
  const float inv = ds4_split_row(v, qh + h * LDW + lane, ql + h * LDW + lane);
  if (lane == 0) {
    w_s[h] = h < H ? w[(size_t)t * H + h] * scale[0] * inv : 0.0f;  // the reference's weights * scale, unscaling q
  }
}
ds4_barrier();
const int last = visible < end ? visible : end;
for (int t0 = begin + WK * warp; t0 < last; t0 += TILE) {  // the warp's own WK keys a round: no barrier
  for (int e = lane; e < WK * D / 8; e += 32) {  // their planes, split before the launch: 16-byte copies
    const int i = e / (D / 8);
    const int c = 4 * (e - i * (D / 8));
    const bool real = t0 + i < last;
    const size_t at = (size_t)(real ? t0 + i : 0) * (D / 2) + c;
    ds4_copy16_async(reinterpret_cast<SHARED_MEM float*>(kh + i * LDW + c),
                     reinterpret_cast<const GLOBAL_MEM float*>(rows_hi + at), real);
    ds4_copy16_async(reinterpret_cast<SHARED_MEM float*>(kl + i * LDW + c),
                     reinterpret_cast<const GLOBAL_MEM float*>(rows_lo + at), real);
  }
  if (lane < WK) {
    ds4_copy4_async(kscale + lane, rows_scale + (t0 + lane < last ? t0 + lane : 0), t0 + lane < last);
  }
  ds4_async_commit();
  float large[MT][WK / 8][4], small[MT][WK / 8][4];  // q . k for 16 heads x 8 keys a tile; separate chains
  for (int mi = 0; mi < MT; ++mi) {
    for (int nt = 0; nt < WK / 8; ++nt) {
      for (int i = 0; i < 4; ++i) {
        large[mi][nt][i] = 0.0f;
        small[mi][nt][i] = 0.0f;
      }
    }
  }
  ds4_async_wait_all();
  ds4_simd_barrier();  // every lane's copies of the warp's planes landed
  float kinv[WK / 8][2];  // the scales of the lane's keys 8 nt + 2 c4 (+ 1), undone
  for (int nt = 0; nt < WK / 8; ++nt) {
    for (int u = 0; u < 2; ++u) {
      const int key = 8 * nt + 2 * c4 + u;
      kinv[nt][u] = t0 + key < last ? ds4_div(1.0f, kscale[key]) : 0.0f;
    }
  }
  for (int kw = 0; kw < D / 2; kw += 16) {  // two k-steps of 16 dims
    unsigned int bh[WK / 8][4], bl[WK / 8][4];
    for (int nt = 0; nt < WK / 8; ++nt) {
      const int at = (8 * nt + (lane & 7)) * LDW + kw + 4 * (lane >> 3);
      ds4_ldmatrix_x4(bh[nt], kh + at);
      ds4_ldmatrix_x4(bl[nt], kl + at);
    }
    for (int kk = 0; kk < 2; ++kk) {
      for (int mi = 0; mi < MT; ++mi) {
        unsigned int ah[4], al[4];
        const int at = (16 * mi + (lane & 15)) * LDW + kw + 8 * kk + 4 * (lane >> 4);
        ds4_ldmatrix_x4(ah, qh + at);
        ds4_ldmatrix_x4(al, ql + at);
        for (int nt = 0; nt < WK / 8; ++nt) {
          ds4_mma_f16_16x8x16(small[mi][nt], al, bh[nt] + 2 * kk);
          ds4_mma_f16_16x8x16(small[mi][nt], ah, bl[nt] + 2 * kk);
          ds4_mma_f16_16x8x16(large[mi][nt], ah, bh[nt] + 2 * kk);
        }
      }
    }
  }
  for (int nt = 0; nt < WK / 8; ++nt) {
    float even = 0.0f;  // the lane's heads' weighted terms for keys 2 c4 and 2 c4 + 1 of the tile's 8
    float odd = 0.0f;
    for (int mi = 0; mi < MT; ++mi) {
      const float upper = w_s[16 * mi + g];
      const float lower = w_s[16 * mi + g + 8];
      const float d0 = (small[mi][nt][0] + large[mi][nt][0]) * kinv[nt][0];
      const float d1 = (small[mi][nt][1] + large[mi][nt][1]) * kinv[nt][1];
      const float d2 = (small[mi][nt][2] + large[mi][nt][2]) * kinv[nt][0];
      const float d3 = (small[mi][nt][3] + large[mi][nt][3]) * kinv[nt][1];
      even += upper * (d0 > 0.0f ? d0 : 0.0f) + lower * (d2 > 0.0f ? d2 : 0.0f);
      odd += upper * (d1 > 0.0f ? d1 : 0.0f) + lower * (d3 > 0.0f ? d3 : 0.0f);
    }
    for (int offset = 4; offset < 32; offset <<= 1) {  // over g: the lanes holding the other heads
      even += ds4_simd_xor(even, offset);
      odd += ds4_simd_xor(odd, offset);
    }
    const int key = t0 + 8 * nt + 2 * c4;
    if (g == 0 && key < last) {
      out[key] = even;
    }
    if (g == 0 && key + 1 < last) {
      out[key + 1] = odd;
    }
  }
  ds4_simd_barrier();  // every lane is done with the planes before the next round's copies
}
const float below = -ds4_float(0x7f800000u);  // -inf: not visible
for (int i = (last > begin ? last : begin) + THREAD_IN_GROUP; i < end; i += WARPS * 32) {
  out[i] = below;
}
"""
TENSOR_SCORE_WARPS = 8
"""Warps of a tensor-core score threadgroup."""
TENSOR_SCORE_WK = 16
"""Keys a warp scores a round (two n-tiles: each query fragment read from threadgroup memory serves 6 mma)."""
TENSOR_SCORE_KEYS = 512
"""Keys (rows) a tensor-core score threadgroup scores for its query: N / 512 threadgroups a query, each staging the
query's heads once."""
TENSOR_SCORE_HEADS, TENSOR_SCORE_WIDTH = 64, 128
"""The most heads and the widest rows its threadgroup memory holds (Flash's indexer: 64 heads of 128)."""


def tensor_scores_bytes(heads: int = TENSOR_SCORE_HEADS, d: int = TENSOR_SCORE_WIDTH) -> int:
    """Dynamic threadgroup memory of the tensor-core score kernel: the queries' and each warp's keys' half planes
    (D / 2 + 4 words a row, hi and lo), the head weights and the keys' row scales: 105 KB at Flash's, two
    threadgroups an SM (with the launch bounds' 128 registers a thread)."""
    m_tiles = -(-heads // 16)
    return 4 * ((2 * (d // 2 + 4) + 1) * (16 * m_tiles + TENSOR_SCORE_WK * TENSOR_SCORE_WARPS))


TENSOR_SCORES_KERNEL = Kernel("ds4_indexer_scores_tc",
                              ("q", "w", "rows_hi", "rows_lo", "rows_scale", "position", "scale", "count"),
                              ("scores",), _TENSOR_SCORES, _HELPERS + SPLIT_ROW, shared_memory=tensor_scores_bytes(),
                              launch_bounds=(TENSOR_SCORE_WARPS * SIMD_WIDTH, 2))


def heads_padded(n_head: int) -> int:
    """Heads rounded up to whole SIMD groups: each lane takes every 32nd head."""
    return -(-n_head // SIMD_WIDTH) * SIMD_WIDTH


def scores_template(h: int, d: int, n: int, ratio: int, top_k: int, n_rot: int = 0,
                    quant: RowQuant = RowQuant.NONE) -> dict[str, int]:
    """The score kernel's constants; BLOCKS is its number of threadgroups per query; NROT and QUANT say how its
    SIMD groups finish the queries."""
    groups = -(-n // ROWS_PER_SIMD)
    return {"H": h, "HP": heads_padded(h), "D": d, "N": n, "K": top_k, "RATIO": ratio, "R": ROWS_PER_SIMD,
            "WARPS": SCORE_SIMDS, "BLOCKS": min(-(-groups // SCORE_SIMDS), MAX_SCORE_GROUPS), "NROT": n_rot,
            "QUANT": int(quant)}


def select_template(n: int, ratio: int, top_k: int) -> dict[str, int]:
    """The select kernel's constants; W is its output width."""
    return {"K": top_k, "W": min(n, top_k), "RATIO": ratio, "THREADS": SELECT_THREADS}


def indexer_scores(q: mx.array, weights: mx.array, rows: mx.array, positions: mx.array, ratio: int,
                   top_k: int, scale: float = 1.0, rope: RoPE | None = None,
                   quant: RowQuant = RowQuant.NONE) -> mx.array:
    """Scores (T, N) of rows (N, D) for queries q (T, H, D) (or (T, H * D): read as stored) with head weights
    (T, H) times `scale` at positions (T,): -inf where not visible; a query with at most top_k visible rows is
    left unwritten (its rows are all picked). The queries are finished first, as `finish_rows` does without a
    norm: `rope` (None: no rotation), then `quant` (NONE or INDEXER_FP4)."""
    (t, h), d = weights.shape, rows.shape[1]
    template = scores_template(h, d, rows.shape[0], ratio, top_k, 0 if rope is None else rope.n_rot, quant)
    scale = mx.array([scale], dtype=mx.float32)
    (scores,) = build(SCORES_KERNEL, current_backend())(
        inputs=[q.astype(mx.float32), weights.astype(mx.float32), rows.astype(mx.float32),
                positions.astype(mx.int32), scale, scale if rope is None else rope.inv_freq],
        template=list(template.items()),
        grid=(template["BLOCKS"] * SCORE_SIMDS * SIMD_WIDTH, t, 1), threadgroup=(SCORE_SIMDS * SIMD_WIDTH, 1, 1),
        output_shapes=[(t, rows.shape[0])], output_dtypes=[mx.float32],
    )
    return scores


def tensor_fits(weights: mx.array, rows: mx.array, rope: RoPE | None, quant: RowQuant) -> bool:
    """Whether the tensor-core score kernel takes these (CUDA; finished queries; heads and width its threadgroup
    memory holds, rows a warp splits as pairs: a multiple of 64 wide)."""
    h, d = weights.shape[1], rows.shape[1]
    return (current_backend() == "cuda" and rope is None and quant == RowQuant.NONE and h <= TENSOR_SCORE_HEADS
            and d <= TENSOR_SCORE_WIDTH and d % 64 == 0)


def tensor_scores(q: mx.array, weights: mx.array, rows: mx.array, positions: mx.array, ratio: int, top_k: int,
                  scale: float = 1.0) -> mx.array:
    """`indexer_scores` for finished queries q (T, H, D) (or (T, H * D)) on float16 tensor cores at float32
    accuracy (rows split into scaled half planes, three mma.m16n8k16 a product, as
    kernels/prefill/chunk_attention.py's): the same contract, a prefill chunk's many queries at once. The rows are split
    once, before the launch (halfsplit.split_rows); each threadgroup takes one query's TENSOR_SCORE_KEYS rows and splits
    its queries; each warp copies its own TENSOR_SCORE_WK keys' planes a round (cp.async, no barrier), scores every head
    against them, then sums w_h relu(.) over the heads in its lanes; rows past the visible count are skipped
    (causal: a chunk's early queries see fewer). Measured (H200, the indexer of a ratio-4 layer's 4096-token
    chunk at 16k): 6.6 ms for the 3xTF32 kernel this replaced (A fragments a word at a time, keys split at every
    load), 6.4 with each warp splitting its 8 keys itself (the split, once per query, was most of its work), 4.4
    with the rows split before the launch, 3.4 with their scales staged with them and two threadgroups an SM."""
    (t, h), (n, d) = weights.shape, rows.shape
    hi, lo, row_scales = held_split(rows)
    (scores,) = build(TENSOR_SCORES_KERNEL, current_backend())(
        inputs=[q.astype(mx.float32), weights.astype(mx.float32), hi, lo, row_scales, positions.astype(mx.int32),
                mx.array([scale], dtype=mx.float32), mx.array([n], dtype=mx.int32)],
        template=list(tensor_template(h, d, ratio, top_k).items()),
        grid=(-(-n // TENSOR_SCORE_KEYS) * TENSOR_SCORE_WARPS * SIMD_WIDTH, t, 1),
        threadgroup=(TENSOR_SCORE_WARPS * SIMD_WIDTH, 1, 1),
        output_shapes=[(t, n)], output_dtypes=[mx.float32],
    )
    return scores


def tensor_template(h: int, d: int, ratio: int, top_k: int) -> dict[str, int]:
    """The tensor-core score kernel's template constants."""
    return {"H": h, "MT": -(-h // 16), "D": d, "K": top_k, "RATIO": ratio, "WARPS": TENSOR_SCORE_WARPS,
            "WK": TENSOR_SCORE_WK, "KEYS": TENSOR_SCORE_KEYS}


def select_rows(scores: mx.array, positions: mx.array, ratio: int, top_k: int) -> tuple[mx.array, mx.array]:
    """(picked (T, min(N, top_k)) int32 ascending, valid (T, min(N, top_k)) bool) from scores (T, N)."""
    t, n = scores.shape
    template = select_template(n, ratio, top_k)
    return tuple(build(SELECT_KERNEL, current_backend())(
        inputs=[scores, positions.astype(mx.int32), mx.array([n], dtype=mx.int32)], template=list(template.items()),
        grid=(t * SELECT_THREADS, 1, 1), threadgroup=(SELECT_THREADS, 1, 1),
        output_shapes=[(t, template["W"])] * 2, output_dtypes=[mx.int32, mx.bool_],
    ))


def exact_inputs(h: int, d: int, n: int, positions: list[int], seed: int, copies: int = 3
                 ) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    """Queries, weights, rows and positions whose scores are exact in float32 whatever the summation order: small
    integers, weights in sixteenths (|score| < 2^17 in steps of 2^-4). Rows come in runs of `copies` equal ones,
    so equal scores (ties) are everywhere, the top_k-th place included."""
    rng = np.random.default_rng(seed)
    rows = rng.integers(-2, 3, (-(-n // copies), d), dtype=np.int8)[np.arange(n) // copies]
    q = rng.integers(-2, 3, (len(positions), h, d))
    weights = rng.integers(-3, 4, (len(positions), h)) / 16
    return (mx.array(q.astype(np.float32)), mx.array(weights.astype(np.float32)), mx.array(rows.astype(np.float32)),
            mx.array(positions, dtype=mx.int32))


def position_seeing(rows: int, ratio: int) -> int:
    """A position p whose query sees exactly `rows` rows: (p + 1) // ratio == rows."""
    return rows * ratio + ratio - 2


class IndexerPick:
    """(picked (T, top_k) int32 ascending, valid (T, top_k) bool): the rows queries attend, by the two
    kernels where they passed their check ((T, N) where the buffer holds N <= top_k rows). The queries come as
    q_b gives them: the score kernel finishes them (RoPE, quantisation simulation) while it stages them, so that
    finishing them is no launch of its own."""

    def __init__(self, reference: Callable[..., tuple[mx.array, mx.array]]):
        self.fast_path = FastPath("indexer_pick", reference, self._kernel, self._probe, tolerance=0.0,
                                  backends=("cuda", "metal"))

    def __call__(self, q: mx.array, weights: mx.array, rows: mx.array, positions: mx.array, rope: RoPE | None,
                 quant: RowQuant, ratio: int, top_k: int, scale: float = 1.0) -> tuple[mx.array, mx.array]:
        """Raw queries q (T, H, D), or (T, H * D) as q_b gives them (the kernels read them as stored: no reshape
        node), to be finished by `rope` then `quant` (rope None: finished already, as a prefill chunk's are), and
        weights (T, H) at positions (T,) over rows (N, D); the weights count times `scale` (applied in the score
        kernel: no launch of its own)."""
        args = (q, weights, rows, positions, rope, quant, ratio, top_k, scale)
        key = self.key(q, weights, rows, positions, rope, quant, ratio, top_k)
        return self.fast_path.reference(*args) if key is None else self.fast_path(*args, key=key)

    def enabled(self, q: mx.array, weights: mx.array, rows: mx.array, positions: mx.array, rope: RoPE | None,
                quant: RowQuant, ratio: int, top_k: int) -> bool:
        """Whether the kernels answer a call with these arguments (checked at their first use): then no (T, H, N)
        product is made, so a prefill chunk's queries need not be split into blocks."""
        key = self.key(q, weights, rows, positions, rope, quant, ratio, top_k)
        return key is not None and self.fast_path.enabled(key)

    @staticmethod
    def key(q: mx.array, weights: mx.array, rows: mx.array, positions: mx.array, rope: RoPE | None,
            quant: RowQuant, ratio: int, top_k: int) -> tuple | None:
        """The fast path's key, or None where the kernels do not take the arguments: float4 rows; the queries fit
        threadgroup memory; D threads finish a head, whole SIMD groups of one head. Past top_k rows the tensor-core
        score kernel and the select are the same compiled code for any row count (a count input), so a prefill
        chunk's rows count as top_k + 1: one check, not one at each new chunk position (each read its probe's
        results back mid-chunk, ~4-9 ms of idle GPU on the H200, 2026-12-04)."""
        h, d = weights.shape[1], rows.shape[1]
        if (d % SIMD_WIDTH or (SCORE_SIMDS * SIMD_WIDTH) % d or heads_padded(h) * d * 4 > QUERY_BYTES
                or quant == RowQuant.KV_FP8 or (rope is None and quant != RowQuant.NONE)
                or (rope is not None and not fits(q.reshape(-1, h, d), positions, rope, None, quant))):
            return None  # (the reshape is a view for the check alone)
        n = rows.shape[0]
        if n > top_k and tensor_fits(weights, rows, rope, quant):
            n = top_k + 1
        return h, d, n, ratio, top_k, 0 if rope is None else rope.n_rot, quant

    @staticmethod
    def _kernel(q, weights, rows, positions, rope, quant, ratio, top_k, scale=1.0) -> tuple[mx.array, mx.array]:
        if tensor_fits(weights, rows, rope, quant):
            scores = tensor_scores(q, weights, rows, positions, ratio, top_k, scale)
        else:
            scores = indexer_scores(q, weights, rows, positions, ratio, top_k, scale, rope, quant)
        return select_rows(scores, positions, ratio, top_k)

    @staticmethod
    def _probe(key: Hashable) -> tuple:
        """Four queries: all rows but the last visible, fewer than top_k, one more than top_k (as N allows) and all
        rows at position 999_983 (cos and sin of large angles). Their finished values are exact in any order:
        with INDEXER_FP4, steady rows (kernels/sublayers/rows.py) finish to FP4 values in power-of-two blocks (|q| <= 16
        in eighths); without it, the queries are integers and the rows' RoPE dims zero, so that the rotated dims
        (a few ulps apart between the kernel and the reference) add exact zeros. Weights times scale 1/16 stay
        exact: every product and sum is a multiple of 2^-11 below 2^13."""
        h, d, n, ratio, top_k, n_rot, quant = key
        seen = [n - 1, max(top_k - 3, 0), min(top_k + 1, n)]
        positions = [position_seeing(v, ratio) for v in seen] + [999_983]
        q, weights, rows, positions = exact_inputs(h, d, n, positions, seed=81)
        rope = RoPE(n_rot, 10000.0) if n_rot else None  # n_rot 0: finished queries
        if quant == RowQuant.INDEXER_FP4:
            q = steady_rows(q.shape, positions, rope, None, quant, seed=82)
        else:
            rows = mx.concatenate([rows[:, : d - n_rot], mx.zeros((n, n_rot))], axis=1)
        return q, weights, rows, positions, rope, quant, ratio, top_k, 1.0 / 16
