"""A chunk's attention core (ds4.c): a block of prefill queries in one launch, the multi-query sibling of
attention.py's decode kernel. Its reference (`attend_block`, model/attention.py) builds masks, joins and gathers key
sets (a (B, top_k, D) copy of the picked rows) and runs ~25 MLX ops per block. Queries arrive normed and rotated;
each sees the raw rows of its window (from the positions), then by kind (CHUNK_KEY_SETS) nothing, the visible
compressed rows or the indexer's real picks (compacted into threadgroup memory by a prefix sum, so that keys that
are not real are never loaded), read where they are stored. Online softmax with the sinks. Two kernels:

- `CHUNK_KERNELS` (CUDA and Metal, float32 SIMT): one threadgroup of CHUNK_WARPS = 8 SIMD groups per (query, 16
  heads): 4 x B at Flash. Each SIMD group holds two heads' queries and accumulators (lane: dims lane, lane + 32,
  ...); the threadgroup stages CHUNK_TILE = 8 keys at a time in threadgroup memory, so each key is read from L2
  once per 16 heads and from threadgroup memory once per SIMD group (conflict-free). Threadgroup memory: 4 * 8 * D
  = 16 KB at D = 512, plus 4 * top_k (2 KB) for "picked": within Apple GPUs' 32 KB. Measured on the H200
  (2026-12-02): 32-40 ms for a ratio-4 layer's 4096-token chunk deep in a context (640 keys a query), a quarter of
  a prefill chunk's time over Flash's 43 layers: a key costs a SIMD group 16 threadgroup loads per lane, 64 FMAs
  and 6 shuffles for two heads. Metal's kernel, and CUDA's where the tensor-core one did not pass its check.
- `TENSOR_KERNELS` (CUDA): the same attention on float16 tensor cores at float32 accuracy (mma.m16n8k16, float32
  sums). Each query row and each key row is scaled by a power of two (halfsplit.py's rule: its largest magnitude
  in [2^14, 2^15)) and split into two halves, hi and lo, kept as half planes in threadgroup memory; a product
  takes three mma (lo x hi, hi x lo, hi x hi: ~2^-21 of each product lost, 3xTF32's class). The keys (raw and
  compressed rows) are split before the launch (halfsplit.split_rows), the queries once per threadgroup
  (halfsplit.SPLIT_ROW); P V takes each probability times its key's scale inverse over the round's largest (at
  most 1, so no half overflows) and the round's sums times that largest. The tensor cores truncate their sums, so
  a score is drained into float32 every 64 dims and P V every round: 1.1e-6 of the output at Flash's shapes in
  emulation, within TOLERANCE. One threadgroup per (query, TENSOR_HEADS heads), 4 warps per 16 heads. Each round
  of TILE = 32 keys' planes is copied into threadgroup memory (cp.async) while the previous round is multiplied,
  then (1) each warp scores 16 heads x all 32 keys over a quarter of the D dims, its queries' fragments held in
  registers from the start (loaded once, where reloading them from threadgroup memory every round took two of
  every three ldmatrix), the four quarters' partial scores left in the queries' planes' words, (2) each warp sums
  4 heads' quarters and turns them into probabilities (8 lanes a head, 4 keys a lane: its maximum and sum over
  3 shuffles, where a lane a key took 5 for each of the 4 heads; the online softmax's maximum and sum kept in the
  head's lanes), split into half planes, (3) each warp adds P V for its D / WARPS dims of every head (the keys' B
  fragments by ldmatrix.trans), its accumulators in registers. Keys are read from L2 once per TENSOR_HEADS heads.
  Each mma chain (an n-tile's scores over 64 dims, a round's P V) takes the small products before the large.
  255 registers, no spill, at Flash's shapes (bench/nvcc_check.py).
  Given the RoPE's inv_freq (NROT), it also finishes q_b's outputs as it splits them (each head's RMSNorm, then
  the RoPE at the query's position, its angles' cos and sin taken once a threadgroup) and rotates the output back
  as it stores it (`finishing`, which the other paths compose from ops): two passes over a chunk's (T, 64, 512)
  queries and outputs less.
  Measured (H200, 4096 queries from position 8192, bench/chunk_attention.py; ms for a ratio-4 layer / ratio 128 /
  window only): SIMT 32.0 / 10.8 / 4.9; the 3xTF32 kernel this replaced (mma.m16n8k8 on TF32 splits made again at
  every fragment load) 14.3 / 5.2 / 3.2; with half planes split in the kernel 10.3 / 4.1 / 2.5; with the keys
  split before the launch 8.9 / 3.5 / 2.6. Nsight Compute (2026-12-03): one threadgroup of 8 warps an SM (its
  210 KB of planes), issue slots 29% busy, 9.1 instructions a mma. With the queries' fragments in registers
  (2026-12-04): 6.85 / 2.93 / 1.95, and an 8k prompt's prefill 3,998 -> 4,109 t/s (same machine); Nsight Compute
  then put 29% of the kernel's stall samples in the softmax (a lane a key) and found 30-odd integer instructions
  a 16-byte copy in the staging: with 8 lanes a head and PER_KEY threads a key (its source found once) 5.61 /
  2.59 / 1.76, and 8k 3,965 -> 4,053 t/s against the kernel before (another machine); with the keys' inverse
  scales from their bits (one division a round) 5.32 / 2.30 / 1.62. A threadgroup's fixed cost (the picks'
  compaction, the queries' split, the output) is ~11 us by a fit over the three kinds, ~3 rounds' worth: one
  205 KB threadgroup an SM leaves nothing to overlap it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable
from typing import NamedTuple

import mlx.core as mx
import numpy as np

from ...model.norm import rms_norm
from ...model.rope import ROTATE, RoPE, cos_sin
from ..decode.attention import TOLERANCE
from ..machinery.dialect import SIMD_EXCLUSIVE_SUM, SIMD_WIDTH, Kernel, build
from ..tensor_cores.halfsplit import SPLIT_ROW, held_split
from ..machinery.probe import random_activations
from ..machinery.registry import FastPath, current_backend

_QUERY_KEYS = """const int pos = info[0] + b;
const int first = info[1];  // raw row j holds position first + j
int lo = pos - WINDOW + 1 - first;  // the query's window: raw rows lo .. pos - first
lo = lo > 0 ? lo : 0;
const int n_raw = pos - first + 1 - lo;
EXTRA_KEYS
const int n_keys = n_raw + extra;
const float scale = params[0];
"""
"""Both kernels' view of query b's keys: its position, its window of raw rows (lo..), the kind's key count after
them (EXTRA_KEYS: CHUNK_KEY_SETS) and the scores' scale."""

_CHUNK = """
const int b = GROUP_Y;
const int lane = SIMD_LANE;
const int warp = SIMD_INDEX;
const bool upper = lane >= 16;
constexpr int PER_LANE = D / 32;  // lane holds dims lane, lane + 32, ...: staged key reads free of bank conflicts
const int h0 = GROUP_X * (WARPS * 2) + warp * 2;  // the warp's two heads
QUERY_KEYS
float qv[2][PER_LANE];
float acc[2][PER_LANE];
float m[2];
float l[2];
for (int i = 0; i < 2; ++i) {
  for (int j = 0; j < PER_LANE; ++j) {
    qv[i][j] = h0 + i < H ? q[((size_t)b * H + h0 + i) * D + j * 32 + lane] : 0.0f;
    acc[i][j] = 0.0f;
  }
  m[i] = -3.0e38f;  // below every score: exp(m - top) is 0
  l[i] = 0.0f;
}
SHARED float tile[TILE * D];
for (int t0 = 0; t0 < n_keys; t0 += TILE) {
  ds4_barrier();  // every warp is done with the previous tile
  for (int e = THREAD_IN_GROUP; e < TILE * D; e += WARPS * 32) {
    const int n = t0 + e / D;
    if (n < n_keys) {
KEY_ROW
      tile[e] = row[e % D];
    }
  }
  ds4_barrier();
  const int count = n_keys - t0 < TILE ? n_keys - t0 : TILE;
  for (int k = 0; k < count; ++k) {
    float kv[PER_LANE];
    float d0 = 0.0f;
    float d1 = 0.0f;
    for (int j = 0; j < PER_LANE; ++j) {
      kv[j] = tile[k * D + j * 32 + lane];
      d0 += qv[0][j] * kv[j];
      d1 += qv[1][j] * kv[j];
    }
    // both heads' dots over the 32 lanes in 6 shuffles (not 2 x 5): the lower half-warp sums head 0, the upper
    // head 1, then the halves swap totals; every lane ends with the same two scores
    float mine = (upper ? d1 : d0) + ds4_simd_xor(upper ? d0 : d1, 16);
    for (int offset = 8; offset > 0; offset >>= 1) {
      mine += ds4_simd_xor(mine, offset);
    }
    const float other = ds4_simd_xor(mine, 16);
    float score[2];
    score[0] = (upper ? other : mine) * scale;
    score[1] = (upper ? mine : other) * scale;
    for (int i = 0; i < 2; ++i) {
      if (score[i] > m[i]) {  // a new maximum (the same in every lane) rescales what was summed
        const float alpha = ds4_exp(m[i] - score[i]);
        l[i] *= alpha;
        for (int j = 0; j < PER_LANE; ++j) {
          acc[i][j] *= alpha;
        }
        m[i] = score[i];
      }
      const float p = ds4_exp(score[i] - m[i]);
      l[i] += p;
      for (int j = 0; j < PER_LANE; ++j) {
        acc[i][j] += p * kv[j];
      }
    }
  }
}
for (int i = 0; i < 2; ++i) {
  if (h0 + i < H) {
    const float sink = sinks[h0 + i];
    const float top = m[i] > sink ? m[i] : sink;
    const float weight = ds4_exp(m[i] - top);
    const float total = l[i] * weight + ds4_exp(sink - top);  // no key seen: 0 + 1, and the output is 0
    for (int j = 0; j < PER_LANE; ++j) {
      out[((size_t)b * H + h0 + i) * D + j * 32 + lane] = acc[i][j] * weight / total;
    }
  }
}
"""

_COMPACT_PICKS = """
SHARED int chosen[PICKS];  // the query's real picks, in their order
SHARED int counts[WARPS];
int extra = 0;
for (int base = 0; base < PICKS; base += WARPS * 32) {
  const int i = base + THREAD_IN_GROUP;
  const int real = i < PICKS && valid[(size_t)b * PICKS + i] ? 1 : 0;
  const int before = ds4_simd_exclusive_sum(real, lane);
  if (lane == 31) {
    counts[warp] = before + real;
  }
  ds4_barrier();
  int at = extra + before;
  for (int w = 0; w < WARPS; ++w) {
    at += w < warp ? counts[w] : 0;
    extra += counts[w];
  }
  if (real) {
    chosen[at] = picked[(size_t)b * PICKS + i];
  }
  ds4_barrier();  // counts is written again next round
}"""

CHUNK_KEY_SETS: dict[str, tuple[tuple[str, ...], str, str]] = {
    "window": ((), "const int extra = 0;", """
      const GLOBAL_MEM float* row = raw + (size_t)(lo + n) * D;"""),
    "rows": (("rows",), """
int extra = (pos + 1) / RATIO;  // compressed rows c < (pos + 1) / ratio are visible
extra = extra < info[2] ? extra : info[2];""", """
      const GLOBAL_MEM float* row = n < n_raw ? raw + (size_t)(lo + n) * D : rows + (size_t)(n - n_raw) * D;"""),
    "picked": (("rows", "picked", "valid"), _COMPACT_PICKS, """
      const GLOBAL_MEM float* row = n < n_raw ? raw + (size_t)(lo + n) * D
                                              : rows + (size_t)chosen[n - n_raw] * D;"""),
}
"""Per kind of key set after the raw window, as KEY_SETS: the inputs it reads, how many keys it adds (`extra`) and
where key n's row is (`row`). "picked" first compacts the query's real picks into threadgroup memory (a prefix sum
over the valid flags), so that no key that is not real is loaded or scored."""

CHUNK_KERNELS = {
    kind: Kernel(f"ds4_chunk_attention_{kind}", ("q", "raw", *inputs, "sinks", "info", "params"), ("out",),
                 _CHUNK.replace("QUERY_KEYS", _QUERY_KEYS.strip("\n")).replace("EXTRA_KEYS", extra.strip("\n"))
                 .replace("KEY_ROW", row.strip("\n")),
                 header=SIMD_EXCLUSIVE_SUM)
    for kind, (inputs, extra, row) in CHUNK_KEY_SETS.items()
}
CHUNK_WARPS = 8
"""Warps per threadgroup: 2 heads each, so a threadgroup serves 16 heads of one query."""
CHUNK_TILE = 8
"""Keys staged in threadgroup memory at a time: 16 KB at D = 512."""


_TENSOR = """
const int b = GROUP_Y;
const int lane = SIMD_LANE;
const int warp = SIMD_INDEX;
const int g = lane >> 2;  // the mma fragments' row (A, C) or column (B) within a tile
const int t = lane & 3;
constexpr int HG = 16 * M_TILES;  // heads of a threadgroup
constexpr int LDW = D / 2 + 4;  // words (half pairs) a plane row: ldmatrix's 8 rows x 16 bytes on 32 banks
constexpr int PW = TILE / 2 + 4;  // words a probability plane row
constexpr int PSTRIDE = TILE + 4;  // floats a score row
constexpr int NT = D / (8 * WARPS);  // n-tiles of 8 dims a warp owns in P V
constexpr int HEADS_PER_WARP = HG / WARPS;  // in the softmax and the queries' split
constexpr int DRAIN = 64;  // dims of a score summed on the tensor cores before the sum is added in float32
constexpr int KQ = D / 4;  // in the scores: the dims of a warp's quarter
constexpr int KSTEPS = KQ / 16;
constexpr int QWORDS = 2 * HG * LDW > 4 * HG * PSTRIDE ? 2 * HG * LDW : 4 * HG * PSTRIDE;
const int h0 = GROUP_X * HG;
QUERY_KEYS
SHARED_MEM unsigned int* qh = reinterpret_cast<SHARED_MEM unsigned int*>(ds4_shared);  // HG x LDW, then lo
SHARED_MEM unsigned int* ql = qh + HG * LDW;
// once the queries' fragments are in registers, their planes' words hold each quarter's partial scores, HG x PSTRIDE
SHARED_MEM float* p_s = reinterpret_cast<SHARED_MEM float*>(ds4_shared);
SHARED_MEM unsigned int* kbuf = qh + QWORDS;  // two rounds' keys (this one, the next landing): TILE x LDW hi, lo
SHARED_MEM unsigned int* ph = kbuf + 4 * TILE * LDW;  // HG x PW: this round's probabilities, hi then lo
SHARED_MEM unsigned int* pl = ph + HG * PW;
SHARED_MEM float* alpha_s = reinterpret_cast<SHARED_MEM float*>(pl + HG * PW);  // HG: each head's rescaling this
                                                                               // round, then its output factor
SHARED_MEM float* qinv_s = alpha_s + HG;  // HG: each head's query scale undone
SHARED_MEM float* kscale_s = qinv_s + HG;  // 2 x TILE: each key's row scale, this round's and the next's
STAGE_FIRST
float2 qv[HEADS_PER_WARP][D / 64];  // the warp's heads' queries: every load issued before the first is used
for (int i = 0; i < HEADS_PER_WARP; ++i) {
  const int hl = warp * HEADS_PER_WARP + i;
  const GLOBAL_MEM float* src = q + ((size_t)b * H + h0 + hl) * D;
  for (int j = 0; j < D / 64; ++j) {
    qv[i][j] = h0 + hl < H ? *reinterpret_cast<const GLOBAL_MEM float2*>(src + 2 * lane + 64 * j)
                           : make_float2(0.0f, 0.0f);
  }
}
SHARED float rot_cos[NROT > 0 ? NROT / 2 : 1];  // with NROT, the query position's angles: every head's, both ways
SHARED float rot_sin[NROT > 0 ? NROT / 2 : 1];
if (NROT > 0) {
  for (int i = THREAD_IN_GROUP; i < NROT / 2; i += WARPS * 32) {
    const float angle = (float)pos * inv_freq[i];  // the reference's float32 product
    rot_cos[i] = ds4_cos(angle);
    rot_sin[i] = ds4_sin(angle);
  }
  ds4_barrier();
}
for (int i = 0; i < HEADS_PER_WARP; ++i) {  // the queries, split once
  const int hl = warp * HEADS_PER_WARP + i;
  float2 (&v)[D / 64] = qv[i];
  if (NROT > 0) {  // q_b's output: the head's RMSNorm, then the RoPE of its trailing NROT dims (rows.py's formulas)
    float squares = 0.0f;
    for (int j = 0; j < D / 64; ++j) {
      squares += v[j].x * v[j].x + v[j].y * v[j].y;
    }
    const float norm = 1.0f / sqrt(ds4_simd_sum(squares) / (float)D + params[1]);
    for (int j = 0; j < D / 64; ++j) {
      const int dim = 2 * lane + 64 * j;
      const float x0 = v[j].x * norm;
      const float x1 = v[j].y * norm;
      v[j] = make_float2(x0, x1);
      if (dim >= D - NROT) {
        const float cs = rot_cos[(dim - (D - NROT)) >> 1];
        const float sn = rot_sin[(dim - (D - NROT)) >> 1];
        v[j] = make_float2(x0 * cs - x1 * sn, x1 * cs + x0 * sn);
      }
    }
  }
  const float inv = ds4_split_row(v, qh + hl * LDW + lane, ql + hl * LDW + lane);
  if (lane == 0) {
    qinv_s[hl] = inv;
  }
}
static_assert(HEADS_PER_WARP * 8 == 32, "the softmax gives each head of a warp 8 lanes");
const int kg = lane & 7;  // in the softmax: head warp * HEADS_PER_WARP + (lane >> 3), keys 4 kg .. 4 kg + 3
const int hs = warp * HEADS_PER_WARP + (lane >> 3);
float m_run = -3.0e38f;  // head hs's running maximum (below every score: exp(m - top) is 0) and sum, the same in
float l_run = 0.0f;      // its 8 lanes
float o[M_TILES][NT][4];
for (int mi = 0; mi < M_TILES; ++mi) {
  for (int j = 0; j < NT; ++j) {
    for (int c = 0; c < 4; ++c) {
      o[mi][j][c] = 0.0f;
    }
  }
}
const int mw = warp >> 2;  // in the scores: the warp's 16 heads, all TILE keys, a quarter of the dims
const int kq = warp & 3;
ds4_barrier();  // every query is split
unsigned int qfh[KSTEPS][4];  // the warp's query fragments, loaded once and held for every round
unsigned int qfl[KSTEPS][4];
{
  const SHARED_MEM unsigned int* qa = qh + (16 * mw + (lane & 15)) * LDW + 4 * (lane >> 4) + kq * (KQ / 2);
  for (int k = 0; k < KSTEPS; ++k) {
    ds4_ldmatrix_x4(qfh[k], qa + 8 * k);
    ds4_ldmatrix_x4(qfl[k], qa + (ql - qh) + 8 * k);
  }
}
for (int t0 = 0; t0 < n_keys; t0 += TILE) {
  const int parity = (t0 / TILE) & 1;
  const SHARED_MEM unsigned int* kh = kbuf + parity * 2 * TILE * LDW;  // this round's keys
  const SHARED_MEM unsigned int* kl = kh + TILE * LDW;
  const SHARED_MEM float* kscale_r = kscale_s + parity * TILE;
  ds4_async_wait_all();
  ds4_barrier();  // this round's keys landed; every warp is done with the previous round's buffers
  if (t0 + TILE < n_keys) {
STAGE_NEXT
  }
  float s[4][4] = {};  // n-tile n: keys 8 n.. of the round (mma's C layout)
  const SHARED_MEM unsigned int* kb = kh + (lane & 7) * LDW + 4 * (lane >> 3) + kq * (KQ / 2);
  for (int k1 = 0; k1 < KSTEPS; k1 += DRAIN / 16) {  // the tensor cores truncate their sums: drained every DRAIN dims
    float part[4][4] = {};  // an n-tile's products, the small ones first (independent chains: the n-tiles)
    for (int k = k1; k < k1 + DRAIN / 16 && k < KSTEPS; k += 2) {  // two k-steps of 16 dims: one ldmatrix.x4 a plane
      for (int n = 0; n < 4; ++n) {
        unsigned int bh[4], bl[4];
        ds4_ldmatrix_x4(bh, kb + 8 * n * LDW + 8 * k);
        ds4_ldmatrix_x4(bl, kb + (kl - kh) + 8 * n * LDW + 8 * k);
        for (int kk = 0; kk < 2 && k + kk < KSTEPS; ++kk) {
          ds4_mma_f16_16x8x16(part[n], qfl[k + kk], bh + 2 * kk);
          ds4_mma_f16_16x8x16(part[n], qfh[k + kk], bl + 2 * kk);
          ds4_mma_f16_16x8x16(part[n], qfh[k + kk], bh + 2 * kk);
        }
      }
    }
    for (int n = 0; n < 4; ++n) {
      for (int c = 0; c < 4; ++c) {
        s[n][c] += part[n][c];
      }
    }
  }
  SHARED_MEM float* srow = p_s + kq * HG * PSTRIDE + (16 * mw + g) * PSTRIDE + 2 * t;  // the quarter's partial sums
  for (int n = 0; n < 4; ++n) {
    srow[8 * n] = s[n][0];
    srow[8 * n + 1] = s[n][1];
    srow[8 * PSTRIDE + 8 * n] = s[n][2];
    srow[8 * PSTRIDE + 8 * n + 1] = s[n][3];
  }
  ds4_barrier();
  const int count = n_keys - t0 < TILE ? n_keys - t0 : TILE;
  // P V takes the keys as split (each times its row scale): each probability times its key's inverse scale over R,
  // the round's largest inverse scale (so at most 1: no half overflows), and the round's P V times R
  const float4 ks = *reinterpret_cast<const SHARED_MEM float4*>(kscale_r + 4 * kg);
  const float kscale4[4] = {ks.x, ks.y, ks.z, ks.w};
  float kinv[4];
  float big = 0.0f;
  for (int e = 0; e < 4; ++e) {  // a row scale is a power of two in [2^-126, 2^127]: its inverse exact from its bits
    const unsigned int bits = ds4_bits(kscale4[e]);
    const float inverse = ds4_float(bits < 0x7F000000u ? 0x7F000000u - bits : 0x00400000u);
    kinv[e] = 4 * kg + e < count ? inverse : 0.0f;
    big = kinv[e] > big ? kinv[e] : big;
  }
  big = ds4_max8(big);  // over the 8 lanes of a head: every key of the round
  // the four quarters' sums, then each row's scales undone
  const SHARED_MEM float* parts = p_s + hs * PSTRIDE + 4 * kg;
  const float4 q0 = *reinterpret_cast<const SHARED_MEM float4*>(parts);
  const float4 q1 = *reinterpret_cast<const SHARED_MEM float4*>(parts + HG * PSTRIDE);
  const float4 q2 = *reinterpret_cast<const SHARED_MEM float4*>(parts + 2 * HG * PSTRIDE);
  const float4 q3 = *reinterpret_cast<const SHARED_MEM float4*>(parts + 3 * HG * PSTRIDE);
  const float sums[4] = {((q0.x + q1.x) + q2.x) + q3.x, ((q0.y + q1.y) + q2.y) + q3.y,
                         ((q0.z + q1.z) + q2.z) + q3.z, ((q0.w + q1.w) + q2.w) + q3.w};
  const float factor = scale * qinv_s[hs];
  float score[4];
  float tile_top = -3.0e38f;
  for (int e = 0; e < 4; ++e) {
    score[e] = 4 * kg + e < count ? sums[e] * factor * kinv[e] : -3.0e38f;
    tile_top = score[e] > tile_top ? score[e] : tile_top;
  }
  tile_top = ds4_max8(tile_top);
  const float top = tile_top > m_run ? tile_top : m_run;
  const float alpha = ds4_exp(m_run - top);
  float p[4];
  for (int e = 0; e < 4; ++e) {
    p[e] = 4 * kg + e < count ? ds4_exp(score[e] - top) : 0.0f;
  }
  float total = (p[0] + p[1]) + (p[2] + p[3]);
  for (int offset = 1; offset < 8; offset <<= 1) {
    total += ds4_simd_xor(total, offset);
  }
  l_run = l_run * alpha + total;
  m_run = top;
  const float inv_big = ds4_div(1.0f, big);  // a power of two: kinv * inv_big is kinv / big exactly
  for (int e = 0; e < 4; e += 2) {  // each probability times its key's inverse scale over the round's largest
    ds4_half2_split(p[e] * (kinv[e] * inv_big), p[e + 1] * (kinv[e + 1] * inv_big), ph[hs * PW + 2 * kg + e / 2],
                    pl[hs * PW + 2 * kg + e / 2]);
  }
  if (kg == 0) {
    alpha_s[hs] = alpha;
  }
  ds4_barrier();
  unsigned int pah[M_TILES][TILE / 16][4], pal[M_TILES][TILE / 16][4];  // P's fragments
  float upper[M_TILES], lower[M_TILES];  // this round's rescaling of rows g and g + 8
  for (int mi = 0; mi < M_TILES; ++mi) {
    upper[mi] = alpha_s[16 * mi + g];
    lower[mi] = alpha_s[16 * mi + g + 8];
    for (int kk = 0; kk < TILE / 16; ++kk) {
      const int at = (16 * mi + (lane & 15)) * PW + 8 * kk + 4 * (lane >> 4);
      ds4_ldmatrix_x4(pah[mi][kk], ph + at);
      ds4_ldmatrix_x4(pal[mi][kk], pl + at);
    }
  }
  const int d0 = warp * (D / WARPS);  // the warp's first dim
  for (int j = 0; j < NT; j += 2) {  // n-tiles j and j + 1 (the same tile twice where NT is odd)
    const int j1 = j + 1 < NT ? j + 1 : j;
    const int vat = (8 * ((lane >> 3) & 1) + (lane & 7)) * LDW + d0 / 2 + 4 * ((lane >> 4) ? j1 : j);
    float pv[M_TILES][2][4] = {};  // the round's P V in fresh sums (truncated over TILE keys only), then merged
    for (int kk = 0; kk < TILE / 16; ++kk) {
      unsigned int vh[4], vl[4];
      ds4_ldmatrix_x4_trans(vh, kh + 16 * kk * LDW + vat);
      ds4_ldmatrix_x4_trans(vl, kl + 16 * kk * LDW + vat);
      for (int mi = 0; mi < M_TILES; ++mi) {
        for (int jj = 0; jj < 2; ++jj) {
          ds4_mma_f16_16x8x16(pv[mi][jj], pal[mi][kk], vh + 2 * jj);  // the small products first
          ds4_mma_f16_16x8x16(pv[mi][jj], pah[mi][kk], vl + 2 * jj);
          ds4_mma_f16_16x8x16(pv[mi][jj], pah[mi][kk], vh + 2 * jj);
        }
      }
    }
    for (int mi = 0; mi < M_TILES; ++mi) {
      for (int jj = 0; jj < 2 && j + jj < NT; ++jj) {
        float* acc = o[mi][j + jj];
        acc[0] = acc[0] * upper[mi] + big * pv[mi][jj][0];
        acc[1] = acc[1] * upper[mi] + big * pv[mi][jj][1];
        acc[2] = acc[2] * lower[mi] + big * pv[mi][jj][2];
        acc[3] = acc[3] * lower[mi] + big * pv[mi][jj][3];
      }
    }
  }
}
ds4_barrier();  // every warp is done reading this round's factors
{
  const float sink = h0 + hs < H ? sinks[h0 + hs] : 0.0f;
  const float top = m_run > sink ? m_run : sink;
  const float weight = ds4_exp(m_run - top);
  const float total = l_run * weight + ds4_exp(sink - top);  // no key seen: 0 + 1, and the output is 0
  if (kg == 0) {
    alpha_s[hs] = weight / total;
  }
}
ds4_barrier();
for (int mi = 0; mi < M_TILES; ++mi) {
  for (int half = 0; half < 2; ++half) {
    const int h = 16 * mi + g + 8 * half;
    if (h0 + h < H) {
      const float factor = alpha_s[h];
      GLOBAL_MEM float* dst = out + ((size_t)b * H + h0 + h) * D + warp * 8 * NT + 2 * t;
      for (int j = 0; j < NT; ++j) {
        const float y0 = o[mi][j][2 * half] * factor;
        const float y1 = o[mi][j][2 * half + 1] * factor;
        const int dim = warp * 8 * NT + 8 * j + 2 * t;
        if (NROT > 0 && dim >= D - NROT) {  // rotated back by the negated angle
          const float cs = rot_cos[(dim - (D - NROT)) >> 1];
          const float sn = rot_sin[(dim - (D - NROT)) >> 1];
          dst[8 * j] = y0 * cs + y1 * sn;
          dst[8 * j + 1] = y1 * cs - y0 * sn;
        } else {
          dst[8 * j] = y0;
          dst[8 * j + 1] = y1;
        }
      }
    }
  }
}
"""
_MAX8 = """
DEVICE_FN float ds4_max8(float v) {
  for (int offset = 1; offset < 8; offset <<= 1) {
    const float other = ds4_simd_xor(v, offset);
    v = other > v ? other : v;
  }
  return v;
}
"""
"""The largest v of 8 aligned lanes (the softmax's lanes of one head), in each of them."""
_STAGE = """
  {  // keys ROUND..: PER_KEY threads a key, its source found once, each copying every PER_KEY-th 16-byte run
    constexpr int PER_KEY = WARPS * 32 / TILE;
    const int key = THREAD_IN_GROUP / PER_KEY;
    const int n = ROUND + key;
    const GLOBAL_MEM unsigned int* hi_src = raw_hi;  // past the last key: zeros, masked in the softmax
    const GLOBAL_MEM unsigned int* lo_src = raw_lo;
    const GLOBAL_MEM float* scale_src = raw_scale;
    if (n < n_keys) {
KEY_SOURCE
      hi_src = (from_raw ? raw_hi : ROWS_hi) + (size_t)at * (D / 2);
      lo_src = (from_raw ? raw_lo : ROWS_lo) + (size_t)at * (D / 2);
      scale_src = (from_raw ? raw_scale : ROWS_scale) + at;
    }
    SHARED_MEM unsigned int* dst = kbuf + PARITY * 2 * TILE * LDW + key * LDW;
    for (int c = 4 * (THREAD_IN_GROUP % PER_KEY); c < D / 2; c += 4 * PER_KEY) {
      ds4_copy16_async(reinterpret_cast<SHARED_MEM float*>(dst + c),
                       reinterpret_cast<const GLOBAL_MEM float*>(hi_src + c), n < n_keys);
      ds4_copy16_async(reinterpret_cast<SHARED_MEM float*>(dst + TILE * LDW + c),
                       reinterpret_cast<const GLOBAL_MEM float*>(lo_src + c), n < n_keys);
    }
    if (THREAD_IN_GROUP % PER_KEY == 0) {
      ds4_copy4_async(kscale_s + PARITY * TILE + key, scale_src, n < n_keys);
    }
  }
  ds4_async_commit();"""
"""A round's keys staged from their half planes, split before the launch (halfsplit.split_rows), with their row
scales, without passing through registers (cp.async): round ROUND lands in buffer PARITY while the previous round
is multiplied. KEY_SOURCE says whether key n is a raw row and its index `at`; ROWS the compressed rows' inputs (the
raw ones for "window")."""
TENSOR_KEY_SOURCES: dict[str, tuple[str, str]] = {
    "window": ("raw", "const bool from_raw = true;\nconst int at = lo + n;"),
    "rows": ("rows", "const bool from_raw = n < n_raw;\nconst int at = from_raw ? lo + n : n - n_raw;"),
    "picked": ("rows", "const bool from_raw = n < n_raw;\nconst int at = from_raw ? lo + n : chosen[n - n_raw];"),
}
"""Per kind of key set (CHUNK_KEY_SETS), where the tensor-core kernel's key n is: the inputs of its compressed
rows' planes and the key's source and index."""
TENSOR_HEADS = 32
"""Heads a tensor-core threadgroup serves (16 or 32: 4 warps per 16); its keys are read from L2 and split once per
this many heads. Threadgroup memory at D = 512: 205 KB with 32, 169 KB with 16 (one threadgroup an SM either way).
Measured for the TF32 kernel before its keys were double-buffered (137 and 101 KB, two threadgroups an SM at 16):
32 heads 18.5 ms, 16 heads 23.8 for a ratio-4 layer's 4096 queries (bench/chunk_attention.py)."""
TENSOR_TILE = 32
"""Keys a round stages: a lane's key in the softmax; 4 n-tiles of 8 in the scores, one per warp of a 16-head row."""


def _planes(name: str) -> tuple[str, ...]:
    """The tensor-core kernel's inputs for a float input of the SIMT kernel: rows (raw, rows) as halfsplit's half
    planes and row scales, the others as they are."""
    return (f"{name}_hi", f"{name}_lo", f"{name}_scale") if name in ("raw", "rows") else (name,)


def tensor_shared_bytes(m_tiles: int, d: int = 512) -> int:
    """Dynamic threadgroup memory of the tensor-core kernel: the queries' half planes (D / 2 + 4 words a row, hi and
    lo; then the four quarters' partial scores, TILE + 4 a row), two rounds of keys' planes, the probabilities'
    (TILE / 2 + 4) and a factor per head and key."""
    heads = 16 * m_tiles
    words = (max(2 * heads * (d // 2 + 4), 4 * heads * (TENSOR_TILE + 4)) + 4 * TENSOR_TILE * (d // 2 + 4)
             + 2 * heads * (TENSOR_TILE // 2 + 4) + 2 * heads + 2 * TENSOR_TILE)
    return 4 * words


def _tensor_source(kind: str, extra: str) -> str:
    """The tensor-core kernel's text for one kind of key set: its staging of the first round and of each next."""
    prefix, source = TENSOR_KEY_SOURCES[kind]
    stage = _STAGE.replace("KEY_SOURCE", "\n".join("      " + line for line in source.split("\n")))
    stage = stage.replace("ROWS_", prefix + "_")
    first = stage.replace("ROUND", "0").replace("PARITY", "0")
    following = stage.replace("ROUND", "t0 + TILE").replace("PARITY", "(parity ^ 1)")
    text = _TENSOR.replace("QUERY_KEYS", _QUERY_KEYS.strip("\n"))
    text = text.replace("STAGE_FIRST", first.strip("\n")).replace("STAGE_NEXT", following.strip("\n"))
    return text.replace("EXTRA_KEYS", extra.strip("\n"))


TENSOR_KERNELS = {
    (kind, m_tiles): Kernel(f"ds4_chunk_attention_tc{m_tiles}_{kind}",
                            ("q", *_planes("raw"), *[n for i in inputs for n in _planes(i)], "sinks", "inv_freq",
                             "info", "params"),
                            ("out",), _tensor_source(kind, extra),
                            header=SIMD_EXCLUSIVE_SUM + SPLIT_ROW + _MAX8, shared_memory=tensor_shared_bytes(m_tiles))
    for kind, (inputs, extra, _) in CHUNK_KEY_SETS.items() for m_tiles in (1, 2)
}
"""By (kind, m-tiles of 16 heads): their threadgroup memory is sized for D up to 512."""


class ChunkShape(NamedTuple):
    """What selects a compiled chunk-attention kernel (its fast path's key): the kind of key set after the raw
    window (CHUNK_KEY_SETS), the head count and width, the window, the compression ratio of "rows" and the
    indexer's picks per query of "picked" (0 where a kind has none), and the RoPE dims of the queries' finishing
    (0: the queries come finished)."""

    kind: str
    heads: int
    head_dim: int
    window: int
    ratio: int
    picks: int
    n_rot: int = 0


def finishing(core: Callable[..., mx.array]) -> Callable[..., mx.array]:
    """`core` (attend_block's contract) taking, where `inv_freq` is given, q_b's output: each head RMS-normed
    (`eps`, no weight) and rotated at its position first, and the output rotated back (the decode step's finishing,
    model/attention.py's attend_step). The tensor-core kernel does both in its launch; the others compose them."""

    def attend(q: mx.array, raw: mx.array, raw_first: int, first: int, window: int, rows: mx.array | None,
               ratio: int, picked: mx.array | None, valid: mx.array | None, sinks: mx.array,
               inv_freq: mx.array | None = None, eps: float = 0.0) -> mx.array:
        if inv_freq is None:
            return core(q, raw, raw_first, first, window, rows, ratio, picked, valid, sinks)
        n_rot = 2 * inv_freq.shape[0]
        cos, sin = cos_sin(mx.arange(first, first + q.shape[0], dtype=mx.int32), inv_freq)
        q = ROTATE(rms_norm(q, None, eps), cos, sin, n_rot, False)
        return ROTATE(core(q, raw, raw_first, first, window, rows, ratio, picked, valid, sinks), cos, sin, n_rot, True)

    return attend


class ChunkAttention:
    """A block of chunk queries' attention core, by a kernel where it passed its check (the tensor-core one on
    CUDA, else the SIMT one): the masks from the positions, the key sets read where they are stored, online softmax
    with the sinks."""

    def __init__(self, reference: Callable[..., mx.array]):
        reference = finishing(reference)
        self.tensor_path = FastPath("chunk_attention_tensor", reference, self._tensor_kernel, self._probe,
                                    tolerance=TOLERANCE, backends=("cuda",))
        self.simt_path = FastPath("chunk_attention", reference, finishing(self._kernel), self._probe,
                                  tolerance=TOLERANCE, backends=("cuda", "metal"))

    def __call__(self, q: mx.array, raw: mx.array, raw_first: int, first: int, window: int, rows: mx.array | None,
                 ratio: int, picked: mx.array | None, valid: mx.array | None, sinks: mx.array,
                 inv_freq: mx.array | None = None, eps: float = 0.0) -> mx.array:
        """q (B, H, D): queries at positions first..first+B-1; raw (R, D): row j at position raw_first + j, of
        which a query at p sees p - window < position <= p; then the compressed rows (C, D) or None, of which
        either the first (p + 1) // ratio are visible or, with the indexer's `picked` (B, K) int32, those rows
        where `valid` (B, K); sinks (H,) -> (B, H, D). With the RoPE's `inv_freq`, q is q_b's output, finished
        here and the output rotated back (`finishing`)."""
        key = self.key(q, window, rows, ratio, picked, inv_freq)
        args = (q, raw, raw_first, first, window, rows, ratio, picked, valid, sinks)
        return self.path(key)(*args, *(() if inv_freq is None else (inv_freq, eps)), key=key)

    def used(self, heads: int, head_dim: int, window: int, ratio: int, picks: int, n_rot: int = 0) -> bool:
        """Whether a kernel serves every kind of key set a layer of these shapes can ask for (checking each
        on its first use): then a block's memory is its output alone, so blocks need not be small."""
        kinds = ["window"] + (["rows"] if ratio else []) + (["picked"] if picks else [])
        keys = [ChunkShape(kind, heads, head_dim, window, ratio if kind == "rows" else 0,
                           picks if kind == "picked" else 0, n_rot) for kind in kinds]
        return all(self.path(key).enabled(key) for key in keys)

    def path(self, key: ChunkShape) -> FastPath:
        """The tensor-core kernel's fast path where it can serve `key` (a head width it tiles) and passed its check,
        else the SIMT kernel's (which answers with the reference where it did not pass its own)."""
        fits = key.head_dim <= 512 and key.head_dim % 64 == 0
        return self.tensor_path if fits and self.tensor_path.enabled(key) else self.simt_path

    @staticmethod
    def key(q: mx.array, window: int, rows: mx.array | None, ratio: int, picked: mx.array | None,
            inv_freq: mx.array | None = None) -> ChunkShape:
        """The shape class of a call's arguments (the fast paths' key)."""
        kind = "window" if rows is None else "rows" if picked is None else "picked"
        return ChunkShape(kind, q.shape[1], q.shape[2], window, ratio if kind == "rows" else 0,
                          picked.shape[-1] if kind == "picked" else 0, 0 if inv_freq is None else 2 * inv_freq.size)

    @staticmethod
    def _launch_inputs(q, raw, raw_first, first, window, rows, ratio, picked, valid, sinks) -> tuple[str, list, list]:
        """The kind of key set, the inputs and the template constants both kernels take."""
        b, heads, d = q.shape
        template = [("H", heads), ("D", d), ("WINDOW", window)]
        if rows is None:
            kind, extra = "window", []
        elif picked is None:
            kind, extra = "rows", [rows]
            template += [("RATIO", ratio)]
        else:
            kind, extra = "picked", [rows, picked, valid]
            template += [("PICKS", picked.shape[-1])]
        info = mx.array([first, raw_first, 0 if rows is None else rows.shape[0]], dtype=mx.int32)
        params = mx.array([1.0 / math.sqrt(d)], dtype=mx.float32)  # the reference's scale, rounded as it is
        return kind, [q, raw, *extra, sinks, info, params], template

    @staticmethod
    def _kernel(*args) -> mx.array:
        b, heads, d = args[0].shape
        if d % SIMD_WIDTH or d > 512:
            raise ValueError(f"chunk attention needs a head width that is a multiple of 32 up to 512, got {d}")
        kind, inputs, template = ChunkAttention._launch_inputs(*args)
        groups = -(-heads // (2 * CHUNK_WARPS))
        (out,) = build(CHUNK_KERNELS[kind], current_backend())(
            inputs=inputs, template=template + [("WARPS", CHUNK_WARPS), ("TILE", CHUNK_TILE)],
            grid=(groups * CHUNK_WARPS * SIMD_WIDTH, b, 1), threadgroup=(CHUNK_WARPS * SIMD_WIDTH, 1, 1),
            output_shapes=[(b, heads, d)], output_dtypes=[mx.float32],
        )
        return out

    @staticmethod
    def _tensor_kernel(*args) -> mx.array:
        """The tensor-core kernel, with the queries' finishing in its launch where args carry inv_freq and eps."""
        args, (inv_freq, eps) = args[:10], (args[10:] or (None, 0.0))
        b, heads, d = args[0].shape
        m_tiles = TENSOR_HEADS // 16
        warps = 4 * m_tiles
        if d % 64 or d > 512:  # scores drained every 64 dims; each of up to 8 warps owns D / 8 of P V's dims
            raise ValueError(f"the tensor-core chunk attention needs a head width that is a multiple of 64 up to "
                             f"512, got {d}")
        kind, (q, raw, *rest, info, params), template = ChunkAttention._launch_inputs(*args)
        if kind != "window":
            rest = [*held_split(rest[0]), *rest[1:]]
        n_rot = 0 if inv_freq is None else 2 * inv_freq.size
        finish = [inv_freq if n_rot else params, info, mx.array([1.0 / math.sqrt(d), eps], dtype=mx.float32)]
        groups = -(-heads // TENSOR_HEADS)
        (out,) = build(TENSOR_KERNELS[kind, m_tiles], current_backend())(
            inputs=[q, *held_split(raw), *rest, *finish],
            template=template + [("WARPS", warps), ("TILE", TENSOR_TILE), ("M_TILES", m_tiles), ("NROT", n_rot)],
            grid=(groups * warps * SIMD_WIDTH, b, 1), threadgroup=(warps * SIMD_WIDTH, 1, 1),
            output_shapes=[(b, heads, d)], output_dtypes=[mx.float32],
        )
        return out

    @staticmethod
    def _probe(key: Hashable) -> tuple:
        """Five queries whose window starts before the chunk (the first sees a full window); "rows": visible
        counts that change within the block (at Flash's window, ratio 4: 33 to 34; ratio 128: 2 to 3); "picked":
        each query's own ascending picks among twice as many rows, about a third not real, the third query's none;
        with n_rot, q_b's outputs to finish (the RoPE at base 10000, eps 1e-6)."""
        kind, heads, d, window, ratio, picks, n_rot = key
        b = 5
        first = max(window + 3, 3 * ratio - 2)
        raw_first = max(0, first - window + 1)
        rows = picked = valid = None
        if kind == "rows":
            rows = random_activations(((first + b) // ratio, d), seed=63)
        elif kind == "picked":
            rng = np.random.default_rng(64)
            rows = random_activations((2 * picks, d), seed=63)
            picked = mx.array(np.stack([np.sort(rng.choice(2 * picks, picks, replace=False)) for _ in range(b)]),
                              dtype=mx.int32)
            real = rng.random((b, picks)) < 0.67
            real[2] = False
            valid = mx.array(real)
        return (random_activations((b, heads, d), seed=60), random_activations((first + b - raw_first, d), seed=61),
                raw_first, first, window, rows, ratio, picked, valid, random_activations((heads,), seed=62),
                *((RoPE(n_rot, 10000.0).inv_freq, 1e-6) if n_rot else ()))
