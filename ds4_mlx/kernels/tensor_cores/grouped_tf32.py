"""Prefill's grouped expert GEMM on CUDA tensor cores at float32 accuracy (3xTF32): one custom kernel launch.

The contract is the SIMT kernel's (grouped_gemm.py): x (N, IN) float32, a float32 scratch (E, OUT, IN), the
per-expert counts (E,) of pairs sorted by expert; the result x[i] @ scratch[e(i)].T as float32 (N, OUT), with the
same grid (ceil(OUT/TN) column tiles x `row_tiles` row tiles), the same row-tile assignment (`TILE_SCAN`: tiles
never straddle experts, nothing read back to the host). Only the multiply differs:

- TF32 keeps 10 mantissa bits, so one TF32 product is off by ~1e-3 relative: too coarse (it moves indexer picks).
  Each operand is split instead, v = hi + lo with hi = tf32(v) and lo = tf32(v - hi) (`ds4_tf32_split`), and the
  tile accumulates lo_x hi_w + hi_x lo_w + hi_x hi_w in float32 with mma.m16n8k8 (`ds4_mma_tf32_16x8x8`); the
  dropped lo_x lo_w and lo's own rounding leave ~2^-21 relative per product, float32's class (2^-24 per product
  before the K-long sum's own rounding), at 3 mma per product;
- a threadgroup is 8 warps over a TM x TN = 64 x 128 tile, each warp a 32 x 32 block of it (2 x 4 mma tiles of 16 x
  8: 32 float accumulators and 32 partial sums per thread). A K loop stages TK = 32 wide slices of the tile's x rows and W_e rows in
  threadgroup memory, rows padded to LD = 36 floats so that a fragment load (lanes g = lane / 4 on 8 rows, t =
  lane % 4 on 4 columns) hits 32 distinct banks; the next slice's global loads (one warp reads 128 contiguous
  bytes of a row per load) are in flight in registers while the current slice is multiplied, as in the SIMT
  kernel. An x value is split once, as it is stored (hi and lo tiles: the 4 warps sharing its row read both); a W
  value is split when it is read from threadgroup memory (by the 2 warps sharing its column). Threadgroup memory:
  (2 x 64 + 128) x 36 x 4 = 36,864 bytes;
- the tensor cores truncate (round toward zero) the sums they accumulate, which over a long K drifts one way:
  each K slice is multiplied into zeroed partial sums, added to the float32 accumulators (rounded to nearest)
  once per slice.

Metal keeps the SIMT kernel: there is no tensor-core rendering of this one (its helpers exist in the CUDA prelude
only), so its fast path is registered for CUDA alone, and any failed first-use check also leaves the SIMT chain.

Cost (estimated, not measured): 206 GFLOP per Flash projection of a 2048-token chunk (N = 12288, 2048 x 4096), 618
GFLOP of TF32 mma work at 3 mma per product. The H200's dense TF32 peak is ~490 TFLOPS; mma.sync (not wgmma) with
the splits on the FMA pipes should reach ~35-45% of it, and a random routing fills ~75% of the row tiles: ~4-5 ms
per projection (against ~19 ms measured for the SIMT kernel), ~13 ms per layer. At ~130 registers per thread one
threadgroup (8 warps) may be all an SM holds; if that starves it, ~6 ms. Measured (2026-12-02) on raw banks with the
same loop (grouped_raw.py), when each warp still split the x values it read: 8.8 ms per projection, where the
splits' integer work per k-step (16 splits, ~64 instructions a warp, against 24 mma) was the likely bound.
"""

from __future__ import annotations

import mlx.core as mx

from ..prefill.batch import TOLERANCE
from ..machinery.dialect import SIMD_EXCLUSIVE_SUM, Kernel, build
from .grouped_gemm import (THREADS, TILE_HEAD, TILE_SCAN, TM, TN, expert_counts, fallback_matmul, grid_fits,
                           launch_grouped, make_probe, untrusted_matmul)
from ..machinery.registry import FastPath, current_backend

TK = 32
"""K slice staged in threadgroup memory per step (four mma k-steps of 8)."""
LD = TK + 4
"""Threadgroup row stride in floats: 36 = 4 mod 32 puts a fragment load's 8 rows x 4 columns on 32 banks."""
TEMPLATE = [("TM", TM), ("TN", TN), ("TK", TK), ("THREADS", THREADS), ("LD", LD)]
"""The template constants of every tf32_source kernel (this one and grouped_raw.py's)."""


def tf32_source(w_shared: str, w_setup: str, w_load: str, w_store: str, w_exact: bool = False) -> str:
    """The kernel body with its W staging given: `w_shared` declares `ws` (TN x LD floats, row n = output column
    col0 + n, k along the row) and anything else in threadgroup memory; `w_setup` runs once past the tile scan
    (pointers, prefetch registers); `w_load` issues slice s's loads into registers (k, k_ok: this thread's x
    column); `w_store` fills ws with slice s once every warp is past the previous multiply. The float32
    scratch's pieces are below; grouped_raw.py decodes raw q2 blocks instead.

    The x tile is split into TF32 hi / lo once, when it is stored (xh, xl), not by each of the 4 warps that read a
    value. With `w_exact` the W values staged are exact in TF32 (small integers times signs: raw q2 quants) and
    `w_store` also fills `wsc[n]`, column n's scale for the slice: each product then takes 2 mma (lo_x w, hi_x w)
    and no split, and a slice's partial sums are scaled by wsc as they are drained into the accumulators."""
    if w_exact:
        b_fragment = """        bh[j][0] = ds4_bits(b[0]);
        bh[j][1] = ds4_bits(b[4]);
"""
        products = """          ds4_mma_tf32_16x8x8(part[i][j], al[i], bh[j]);
          ds4_mma_tf32_16x8x8(part[i][j], ah[i], bh[j]);
"""
        drained = "part[i][j][c] * wsc[wn + 8 * j + 2 * tig + (c & 1)]"
        b_registers = "      unsigned int bh[4][2];\n"
    else:
        b_fragment = """        ds4_tf32_split(b[0], bh[j][0], bl[j][0]);
        ds4_tf32_split(b[4], bh[j][1], bl[j][1]);
"""
        products = """          ds4_mma_tf32_16x8x8(part[i][j], al[i], bh[j]);
          ds4_mma_tf32_16x8x8(part[i][j], ah[i], bl[j]);
          ds4_mma_tf32_16x8x8(part[i][j], ah[i], bh[j]);
"""
        drained = "part[i][j][c]"
        b_registers = "      unsigned int bh[4][2];\n      unsigned int bl[4][2];\n"
    return TILE_HEAD + """
SHARED unsigned int xh[TM * LD];
SHARED unsigned int xl[TM * LD];
""" + w_shared + TILE_SCAN + """
const int lane = SIMD_LANE;
const int warp = SIMD_INDEX;
const int gid = lane >> 2;
const int tig = lane & 3;
const int wm = (warp / (TN / 32)) * 32;
const int wn = (warp % (TN / 32)) * 32;
const int sk = tid % TK;
const int sr = tid / TK;
const GLOBAL_MEM float* x_tile = x + (size_t)row0 * n_in;
float xa[TM * TK / THREADS];
""" + w_setup + """float acc[2][4][4];
#pragma unroll
for (int i = 0; i < 2; ++i) {
  #pragma unroll
  for (int j = 0; j < 4; ++j) {
    #pragma unroll
    for (int c = 0; c < 4; ++c) {
      acc[i][j][c] = 0.0f;
    }
  }
}
const int steps = (n_in + TK - 1) / TK;
for (int s = 0; s <= steps; ++s) {
  if (s < steps) {
    const int k = s * TK + sk;
    const bool k_ok = k < n_in;
    #pragma unroll
    for (int j = 0; j < TM * TK / THREADS; ++j) {
      const int r = sr + j * (THREADS / TK);
      xa[j] = k_ok && r < rows ? x_tile[(size_t)r * n_in + k] : 0.0f;
    }
""" + w_load + """  }
  if (s > 0) {
    float part[2][4][4];
    #pragma unroll
    for (int i = 0; i < 2; ++i) {
      #pragma unroll
      for (int j = 0; j < 4; ++j) {
        #pragma unroll
        for (int c = 0; c < 4; ++c) {
          part[i][j][c] = 0.0f;
        }
      }
    }
    #pragma unroll
    for (int k0 = 0; k0 < TK; k0 += 8) {
      unsigned int ah[2][4];
      unsigned int al[2][4];
""" + b_registers + """      #pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int at = (wm + 16 * i + gid) * LD + k0 + tig;
        ah[i][0] = xh[at];
        ah[i][1] = xh[at + 8 * LD];
        ah[i][2] = xh[at + 4];
        ah[i][3] = xh[at + 8 * LD + 4];
        al[i][0] = xl[at];
        al[i][1] = xl[at + 8 * LD];
        al[i][2] = xl[at + 4];
        al[i][3] = xl[at + 8 * LD + 4];
      }
      #pragma unroll
      for (int j = 0; j < 4; ++j) {
        const SHARED_MEM float* b = ws + (wn + 8 * j + gid) * LD + k0 + tig;
""" + b_fragment + """      }
      #pragma unroll
      for (int i = 0; i < 2; ++i) {
        #pragma unroll
        for (int j = 0; j < 4; ++j) {
""" + products + """        }
      }
    }
    #pragma unroll
    for (int i = 0; i < 2; ++i) {
      #pragma unroll
      for (int j = 0; j < 4; ++j) {
        #pragma unroll
        for (int c = 0; c < 4; ++c) {
          acc[i][j][c] += """ + drained + """;
        }
      }
    }
  }
  ds4_barrier();
  if (s < steps) {
    #pragma unroll
    for (int j = 0; j < TM * TK / THREADS; ++j) {
      const int at = (sr + j * (THREADS / TK)) * LD + sk;
      ds4_tf32_split(xa[j], xh[at], xl[at]);
    }
""" + w_store + """  }
  ds4_barrier();
}
#pragma unroll
for (int i = 0; i < 2; ++i) {
  #pragma unroll
  for (int j = 0; j < 4; ++j) {
    #pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int r = wm + 16 * i + gid + 8 * (c >> 1);
      const int n = col0 + wn + 8 * j + 2 * tig + (c & 1);
      if (r < rows && n < n_out) {
        y[(size_t)(row0 + r) * n_out + n] = acc[i][j][c];
      }
    }
  }
}
"""


_SCRATCH_SHARED = "SHARED float ws[TN * LD];\n"
"""The float32 scratch's W staging: thread tid loads column sk of rows sr + 8 j, one warp reading 128 contiguous
bytes of a row per load."""
_SCRATCH_SETUP = """const GLOBAL_MEM float* w_tile = scratch + ((size_t)expert * n_out + col0) * n_in;
float wa[TN * TK / THREADS];
"""
_SCRATCH_LOAD = """    #pragma unroll
    for (int j = 0; j < TN * TK / THREADS; ++j) {
      const int n = sr + j * (THREADS / TK);
      wa[j] = k_ok && col0 + n < n_out ? w_tile[(size_t)n * n_in + k] : 0.0f;
    }
"""
_SCRATCH_STORE = """    #pragma unroll
    for (int j = 0; j < TN * TK / THREADS; ++j) {
      ws[(sr + j * (THREADS / TK)) * LD + sk] = wa[j];
    }
"""
_SOURCE = tf32_source(_SCRATCH_SHARED, _SCRATCH_SETUP, _SCRATCH_LOAD, _SCRATCH_STORE)
"""Step s loads slice s into registers, multiplies slice s - 1 (in threadgroup memory) into `part`, adds `part` to
`acc`, then stores slice s once every warp is past the multiply. The tensor cores round their sums toward zero: a
whole K of 4096 accumulated inside them drifts by ~4e-5 of the largest output (a float64 simulation), so each
slice's 12 mma per tile start from zero and the float32 `acc += part` rounds to nearest (~5e-7). The mma tile
(i, j) of a warp is rows wm + 16 i.. and columns wn + 8 j..: A = the x rows (row-major, k along columns), B[k][n] =
W[n][k], so a's elements are x at (row g, g + 8; k t, t + 4) and b's are W at (row g; k t, t + 4), and
accumulator c holds (row g, g + 8; column 2t, 2t + 1). Rows past the tile's, W rows past OUT and k past IN read as
zeros; every lane of every warp takes part in every mma."""

KERNEL = Kernel("ds4_grouped_gemm_tf32", ("x", "scratch", "counts", "dims"), ("y",), _SOURCE, SIMD_EXCLUSIVE_SUM)
"""CUDA only: it calls the tensor-core helpers of the CUDA prelude."""


def tf32_grouped_gemm(x: mx.array, scratch: mx.array, counts: mx.array) -> mx.array:
    """x[i] @ scratch[e(i)].T as float32 (N, OUT) for a float32 scratch (E, OUT, IN), pair i's expert given by the
    counts (E,) of pairs sorted by expert. CUDA only."""
    return launch_grouped(build(KERNEL, current_backend()), x, scratch, counts, scratch.shape, TEMPLATE)


def _fast(x: mx.array, scratch: mx.array, sorted_ids: mx.array, counts: mx.array) -> mx.array:
    return tf32_grouped_gemm(x, scratch, counts)


GROUPED_GEMM_TF32 = FastPath("grouped_gemm_3xtf32", fallback_matmul, _fast, make_probe(mx.float32),
                             tolerance=TOLERANCE, backends=("cuda",))
"""The 3xTF32 kernel against `fallback_matmul` (the SIMT kernel's reference and probe, key (OUT, IN)), with the SIMT
kernel's float32 bound: TOLERANCE, 1e-5 of the largest output. 3xTF32 leaves ~2^-21 relative per product with random
signs, ~1e-6 of the largest output over a K of 4096, below the bound like float32 reassociation; plain TF32 (~2^-11
per operand) lands near 4e-4 there and fails it (tests/test_kernels_grouped_tf32.py shows both in emulation)."""


def tensor_core_matmul(x: mx.array, scratch: mx.array, sorted_ids: mx.array, counts: mx.array | None = None
                       ) -> mx.array:
    """x[i] @ scratch[ids[i]].T as float32 (N, OUT) where the sorted gather_mm is not trusted (CUDA): the 3xTF32
    kernel for a float32 scratch where its check passed, else `untrusted_matmul` (the SIMT kernel where its check
    passed, else the fallback). counts (E,): the pairs per expert, computed here if not given."""
    n_expert, n_out, n_in = scratch.shape
    counts = expert_counts(sorted_ids, n_expert) if counts is None else counts
    if (scratch.dtype == mx.float32 and grid_fits(sorted_ids.size, n_expert)
            and GROUPED_GEMM_TF32.enabled((n_out, n_in))):
        return GROUPED_GEMM_TF32(x, scratch, sorted_ids, counts, key=(n_out, n_in))
    return untrusted_matmul(x, scratch, sorted_ids, counts)
