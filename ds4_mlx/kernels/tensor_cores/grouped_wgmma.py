"""Prefill's routed experts from raw IQ2_XXS / Q2_K banks by Hopper's warpgroup products (wgmma, sm_90a).

The same contract and arithmetic as grouped_raw.py (whose docstring says why the products are exact halves and x's
two halves give float32 accuracy), arranged as dense_wgmma.py arranges the Q8_0 projections:

- A = W from registers: warp w of warpgroup g holds W rows 64 g + 16 w + gid and + 8 as mma's A fragments, decoded
  from the raw blocks in threadgroup memory in dense_wgmma.py's permutation of K: lane t of a k-step kk holds the
  values 8 t + 4 kk .. + 3 of a 32-value slice. For IQ2_XXS those are one grid entry's (the slice is a sub-block,
  its group t): the signed magnitudes times the sub-block's odd k, exact halves, the block's d / 8 to the drain.
  For Q2_K they are one byte run of the qs bytes: sc q as exact halves (sc the 4-bit scale of the lane's group of
  16, t / 2), the block's d to the drain;
- B = x: TM = 128 pairs of the tile as columns, their hi and lo planes, from the pairs split into tiles of their
  own (`split_slots`: each pair's row, its token's for gate and up, in its slot of halfsplit's tiles layout, so
  that a stage's plane is one block), two bulk copies a stage, STAGES deep;
- Q2_K's mins: the term -dmin m sum(x) of a group is one more product of the same B by an A that holds the lane's
  group's m in all four of its values (exact halves), drained with -dmin; or (MINS) one product a block of the
  tile's group sums of x by A = 16 m.

The W tile's raw blocks (a block is PER_BLOCK stages) are copied by cp.async too, W_SLOTS - 1 blocks ahead into
W_SLOTS slots: an expert's W is read from HBM once per tile, and loads issued a stage ahead into registers left the
decode waiting on them (Nsight Compute, 2026-12-03: the most stalled instructions were the decode's first uses of
the loaded words) and spilled registers. Per stage (TK = 64: two slices), each warpgroup decodes its A, issues the
lo then the hi plane of each k-step into zeroed partial sums, waits, and drains them into float32 accumulators with
one scale per W row (8 products deep, as grouped_raw.py drains a stage). A tile of 128 pairs and 64 WARPGROUPS W
rows never straddles experts (grouped_gemm.py's row-tile scan); column tiles run fastest, so the threadgroups
running together share one tile of x. Where grouped_raw.py's 64-pair tiles decoded an expert's W about twice at
Flash's 96 pairs an expert, these decode it once.

Measured (H200, bench/prefill_gemms.py, a 4096-token chunk's 24,576 pairs, 2026-12-03; grouped_raw.py gathered:
5.27 / 6.28 ms per IQ2_XXS / Q2_K projection): stages of 32 with W loaded into registers a stage ahead 4.22 /
5.39 ms; with L2 prefetches of W two blocks ahead 4.10 / 5.28; stages of 64 3.84 / 5.07; W by cp.async as above,
three x stages, **3.74 / 4.93** (110 / 84 TFLOP/s of useful work); 2026-12-03, Q2_K's mins by MINS, **3.71 /
3.88**. An 11.5k-token prompt over 43 layers: 2,536 → 2,688 t/s (2026-12-03), 2,641 → 2,741 t/s (MINS, 2026-12-03).
On 2026-12-04: B by two bulk copies a stage from the pairs split into their own tiles (`split_slots`), where the first
256 threads' 16-byte cp.async copies filled the memory instruction queue (Nsight Compute's stall samples: the copies'
address registers and the thread id re-read behind them): a 4-layer chunk's IQ2_XXS 30.8 → 23.0 ms, Q2_K 13.9 →
12.5, for 2.1 ms of slot splits; 3,416 → 3,708 t/s over the 11.5k prompt.

CUDA sm_90a only, checked at first use like every kernel; never run on Metal.
"""

from __future__ import annotations

from functools import cache

import mlx.core as mx
import numpy as np

from ...model.gguf import GGMLType
from .dense_wgmma import BULK_B, LBO, SBO, STORE, hopper
from ..machinery.dialect import SIMD_EXCLUSIVE_SUM, Kernel, build
from .grouped_gemm import TILE_HEAD, TILE_SCAN, launch_grouped, row_tiles
from .grouped_raw import GRID_HEADER
from .halfsplit import ROW_SCALE, TILE_BLOCK, TILE_ROWS, TILE_WORDS, X_TOP, held, reference_split_rows, to_tiles
from ..machinery.probe import random_activations
from ..machinery.registry import FastPath, current_backend

TM = TILE_ROWS
"""Pairs (rows of x) a tile: the 128 columns of B, one tile of halfsplit's tiles layout."""
WARPGROUPS = 3
"""Warpgroups a threadgroup, 64 W rows each (dense_wgmma.py's PLAN: the most an SM holds)."""
TK = 64
"""K a stage: U = TK / 32 slices (an IQ2_XXS sub-block, two Q2_K groups of 16 each) of two wgmma k-steps, drained
together: 4 U wgmma deep."""
STAGES = 3
"""x stages in flight (32 KB each): the copies of the next STAGES - 1 land while one is multiplied. Measured (H200,
2026-12-03, ms per IQ2_XXS / Q2_K projection): 3.74 / 4.93 at 3 stages, 3.87 / 5.13 at 4; with B by bulk copies
(2026-12-04) 3.111 / 3.364 at 3, 3.066 / 3.487 at 4."""
MINS = 1
"""Q2_K's mins: 0, a second product each stage of the same B by A = each lane's group's m (four more wgmma a slice
and a drain); 1, one product a block by A = 16 m over the block's 16 groups and B = the tile's sums of x over each
group of 16 / 16 (`group_sums`, as halves, copied with the block), drained with -dmin once a block. Equal within
TOLERANCE in emulation. Measured (H200, 2026-12-03, ms per Q2_K projection): 4.85 with 0, **3.88** with 1. (Two
halves of 64 pairs a k-step, the first drained while the second multiplied, were slower here: IQ2_XXS 3.71 → 3.79,
Q2_K 4.85 → 6.41 ms; dense_wgmma.py's OVERLAP, where they win, is what remains of them.)"""
W_SLOTS = 3
"""W blocks held: the one being multiplied and W_SLOTS - 1 landing (W_AHEAD = W_SLOTS - 1 blocks ahead)."""
W_WORDS = {GGMLType.IQ2_XXS: 17, GGMLType.Q2_K: 21}
"""32-bit words a W row's block takes in a slot: Q2_K's 84 bytes; IQ2_XXS's 66 bytes from the word holding its
first byte (2-byte aligned: 68 bytes at most)."""


def plane_words(tk: int = TK) -> int:
    """32-bit words of one plane (hi or lo) of a stage's B tile: 128 columns of tk halves, as tk / 32 tiles of 32
    K (dense_wgmma.py's layout) one after the other."""
    return TM * tk // 2


def shared_bytes(ggml_type: GGMLType, warpgroups: int = WARPGROUPS, tk: int = TK, stages: int = STAGES,
                 mins: int = 0) -> int:
    """Dynamic threadgroup memory: `stages` B tiles (two planes) and W_SLOTS blocks of the 64 warpgroups W rows
    (with `mins`, each block's group sums of the tile's x too: two planes of 128 x 16 halves)."""
    slot = 64 * warpgroups * W_WORDS[ggml_type] + (2 * TM * 8 if mins else 0)
    return 4 * (stages * 2 * plane_words(tk) + W_SLOTS * slot)


_SOURCE = TILE_HEAD + """
constexpr int STAGE = 2 * PLANE_WORDS;
constexpr int U = TK / 32;
constexpr int SUB = TM * 16;
constexpr int PER_BLOCK = 256 / TK;
constexpr int W_AREA = TN * W_WORDS;
constexpr int SLOT = W_AREA + (MINS ? 2 * TM * 8 : 0);
SHARED float rsx[TM];
SHARED unsigned int xr[TM];
SHARED_MEM unsigned int* buffer = reinterpret_cast<SHARED_MEM unsigned int*>(ds4_shared);
SHARED_MEM unsigned int* wbuf = buffer + STAGES * STAGE;
W_SHARED""" + TILE_SCAN + """
const int lane = SIMD_LANE;
const int warp = SIMD_INDEX;
const int gid = lane >> 2;
const int tig = lane & 3;
const int wrow = 64 * (warp >> 2) + 16 * (warp & 3) + gid;
if (tid < TM) {
  const unsigned int at = tid < rows ? (GATHER ? xrow[row0 + tid] : (unsigned int)(row0 + tid)) : 0u;
  xr[tid] = at;
  rsx[tid] = tid < rows ? xscale[at] : 0.0f;
}
""" + BULK_B.replace("B_TILE", "(size_t)tile * (n_in / 32) * TILE_WORDS") + """W_SETUP
ds4_barrier();
const int blocks = n_in / 256;
const size_t row_bytes = (size_t)blocks * BLOCK_BYTES;
const size_t bank_bytes = (size_t)n_expert * n_out * row_bytes;
const size_t tile_bytes = ((size_t)expert * n_out + col0) * row_bytes;
auto load_w = [&](int b) {
  if (b < blocks) {
    SHARED_MEM unsigned int* slot = wbuf + (b % W_SLOTS) * SLOT;
    for (int c = tid; c < W_AREA; c += THREADS) {
      const int r = c / W_WORDS;
      const bool ok = col0 + r < n_out;
      const size_t word = ((tile_bytes + (ok ? r : 0) * row_bytes + (size_t)b * BLOCK_BYTES) >> 2) + c % W_WORDS;
      ds4_copy4_async(reinterpret_cast<SHARED_MEM float*>(slot + c),
                      reinterpret_cast<const GLOBAL_MEM float*>(w) + word, ok && 4 * word + 4 <= bank_bytes);
    }
    if (MINS) {
      for (int c = tid; c < 4 * TM; c += THREADS) {
        const int n = (c >> 1) % TM;
        const int run = c & 1;
        const bool ok = n < rows;
        const GLOBAL_MEM uint32_t* src = (c < 2 * TM ? shi : slo) + (size_t)xr[ok ? n : 0] * (n_in / 32) + 8 * b
                                         + 4 * run;
        ds4_copy16_async(reinterpret_cast<SHARED_MEM float*>(slot + W_AREA + (c < 2 * TM ? 0 : TM * 8)
                                                             + ((n >> 3) * 2 + run) * 32 + (n & 7) * 4),
                         reinterpret_cast<const GLOBAL_MEM float*>(src), ok);
      }
    }
  }
};
int w_shift[2];
#pragma unroll
for (int h = 0; h < 2; ++h) {
  w_shift[h] = (int)((tile_bytes + (wrow + 8 * h) * row_bytes) & 3);
}
auto w_row = [&](int s, int h) {
  const int b = s / PER_BLOCK;
  return reinterpret_cast<const SHARED_MEM unsigned char*>(wbuf + (b % W_SLOTS) * SLOT + (wrow + 8 * h) * W_WORDS)
         + ((w_shift[h] + (BLOCK_BYTES & 3) * b) & 3);
};
#pragma unroll
for (int b = 0; b < W_SLOTS - 1; ++b) {
  load_w(b);
}
const int steps = n_in / TK;
#pragma unroll
for (int s = 0; s < STAGES - 1; ++s) {
  if (s < steps) {
    load_b(s);
  }
  ds4_async_commit();
}
bool w_ok[2];
#pragma unroll
for (int h = 0; h < 2; ++h) {
  w_ok[h] = col0 + wrow + 8 * h < n_out;
}
float acc[16][2][2] = {};
float part[64];
auto drain = [&](const float (&sc)[2]) {
  #pragma unroll
  for (int j = 0; j < 16; ++j) {
    #pragma unroll
    for (int h = 0; h < 2; ++h) {
      #pragma unroll
      for (int e = 0; e < 2; ++e) {
        acc[j][e][h] = fmaf(sc[h], part[4 * j + 2 * h + e], acc[j][e][h]);
      }
    }
  }
};
auto multiply = [&](const SHARED_MEM unsigned int* st, unsigned int (&a)[U][2][4], const float (&sc)[2]) {
  ds4_wgmma_fence();
  #pragma unroll
  for (int u = 0; u < U; ++u) {
    #pragma unroll
    for (int kk = 0; kk < 2; ++kk) {
      ds4_wgmma_split<128, LBO, SBO>(part, a[u][kk], st + u * SUB + kk * 2 * (LBO / 4), PLANE_WORDS, u + kk);
    }
  }
  ds4_wgmma_commit();
  ds4_wgmma_wait<0>(part);
  #pragma unroll
  for (int u = 0; u < U; ++u) {
    #pragma unroll
    for (int kk = 0; kk < 2; ++kk) {
      ds4_wgmma_hold(a[u][kk]);
    }
  }
  drain(sc);
};
for (int s = 0; s < steps; ++s) {
  ds4_async_wait_keep<STAGES - 2>();
  wait_b(s);
  if (MINS) {
    ds4_fence_async_shared();
  }
  ds4_barrier();
  if (s % PER_BLOCK == 0) {
    load_w(s / PER_BLOCK + W_SLOTS - 1);
  }
  if (s + STAGES - 1 < steps) {
    load_b(s + STAGES - 1);
  }
  ds4_async_commit();
  const SHARED_MEM unsigned int* st = buffer + (s % STAGES) * STAGE;
  unsigned int a[U][2][4];
  float sc[2];
W_DECODE  multiply(st, a, sc);
W_AFTER}
""" + STORE.replace("Y_ROW0", "row0")
"""The kernel with its W parts left as W_SHARED (static threadgroup memory), W_SETUP (once, past the scan),
W_DECODE (stage s's A fragments `a` and drain scales `sc` from the rows' blocks in their slot, `w_row(s, h)` the
first byte of row h's block) and W_AFTER (more products of the stage: Q2_K's mins). `multiply` issues a stage's
wgmma, waits and drains, then names the A registers
(ds4_wgmma_hold) so that none is reused while a wgmma may read it. A stage waits for its copies,
and for its B's transaction barrier (MINS: the sums' copies made visible to the tensor cores), passes one barrier
(every warpgroup waited for the wgmma that read the buffer the next copies overwrite, and is past the W block the
next block's copies overwrite), issues those copies (at a block's first stage, the W block W_SLOTS - 1 on too),
decodes its A, multiplies and drains. Stage s's B in buffer s % STAGES as dense_wgmma.py lays it out, column n the
tile's pair n: two bulk copies (hi, lo) of 16 KB from the pairs' tiles (`split_slots`: the tile's slots past its
pairs are zeros and are not stored). A W row's block lands as the
W_WORDS words from the one holding its first byte (past the bank's end, and for rows past OUT, zeros; those rows
get scale 0). dense_wgmma.py's STORE ends it."""

_IQ2_XXS = {
    "BLOCK_BYTES": "66",
    "W_SHARED": "SHARED unsigned int iq2_grid[512];\n",
    "W_SETUP": """for (int i = tid; i < 512; i += THREADS) {
  iq2_grid[i] = ds4_iq2xxs_bytes[i];
}
""",
    "W_DECODE": """  #pragma unroll
  for (int h = 0; h < 2; ++h) {
    const SHARED_MEM unsigned short* block = reinterpret_cast<const SHARED_MEM unsigned short*>(w_row(s, h));
    sc[h] = w_ok[h] ? ds4_half_to_float(block[0]) * 0.125f : 0.0f;
    #pragma unroll
    for (int u = 0; u < U; ++u) {
      const int sub = 4 * ((s * U + u) & 7);
      const unsigned int idx = (block[1 + sub + (tig >> 1)] >> (8 * (tig & 1))) & 255u;
      const unsigned int aux = (unsigned int)block[3 + sub] | ((unsigned int)block[4 + sub] << 16);
      const unsigned int low = (aux >> (7 * tig)) & 127u;
      const unsigned int signs = low | ((ds4_popcount(low) & 1u) << 7);
      const float k = (float)(2u * (aux >> 28) + 1u);
      const unsigned int k2 = ds4_half2_bits(k, k);
      const unsigned int o2 = ds4_half2_bits(-1024.0f * k, -1024.0f * k);
      const unsigned int g0 = iq2_grid[2 * idx];
      const unsigned int g1 = iq2_grid[2 * idx + 1];
      a[u][0][h] = ds4_quant_fma_half2(g0, 0x4140u, k2, o2) ^ ((signs * 0x40008000u) & 0x80008000u);
      a[u][0][2 + h] = ds4_quant_fma_half2(g0, 0x4342u, k2, o2) ^ ((signs * 0x10002000u) & 0x80008000u);
      a[u][1][h] = ds4_quant_fma_half2(g1, 0x4140u, k2, o2) ^ ((signs * 0x04000800u) & 0x80008000u);
      a[u][1][2 + h] = ds4_quant_fma_half2(g1, 0x4342u, k2, o2) ^ ((signs * 0x01000200u) & 0x80008000u);
    }
  }
""",
    "W_AFTER": "",
}
"""Slice u of stage s is sub-block (U s + u) % 8 of block s / PER_BLOCK (16-bit words of a 66-byte block: d at 0,
sub-block b at 1 + 4 b: grid indices in +0 and +1, aux in +2 and +3). Lane t holds group t of the sub-block (its
values 8 t .. 8 t + 7: k-step kk's four in grid word kk): grid index = byte t of the sub-block, signs = aux's 7-bit
field t plus its parity bit (ggml's ksigns). The reference's value is d (0.5 + aux >> 28) / 4 times the signed
magnitude = (d / 8) k m with k = 2 (aux >> 28) + 1: A holds k m (at most 31 x 43 = 1333, an exact half, two at a
time from the grid bytes by one prmt and one fused half multiply-add, as grouped_raw.py makes them) with its sign
bit xored in, and the drain's scale is the block's d / 8."""

_Q2_K = {
    "BLOCK_BYTES": "84",
    "W_SHARED": "",
    "W_SETUP": "",
    "W_DECODE": """  #pragma unroll
  for (int h = 0; h < 2; ++h) {
    const SHARED_MEM unsigned int* block = reinterpret_cast<const SHARED_MEM unsigned int*>(w_row(s, h));
    const int hb = ((s * U) >> 2) & 1;
    const unsigned int scales = block[2 * hb + (((s * U) >> 1) & 1)];
    #pragma unroll
    for (int u = 0; u < U; ++u) {
      const int sl = s * U + u;
      const unsigned int scale = (scales >> (8 * (2 * (sl & 1) + (tig >> 1)))) & 255u;
      const float k = (float)(scale & 15u);
      const unsigned int k2 = ds4_half2_bits(k, k);
      const unsigned int o2 = ds4_half2_bits(-1024.0f * k, -1024.0f * k);
      #pragma unroll
      for (int kk = 0; kk < 2; ++kk) {
        const unsigned int q = (block[4 + 8 * hb + 2 * tig + kk] >> (2 * (sl & 3))) & 0x03030303u;
        a[u][kk][h] = ds4_quant_fma_half2(q, 0x4140u, k2, o2);
        a[u][kk][2 + h] = ds4_quant_fma_half2(q, 0x4342u, k2, o2);
      }
    }
    sc[h] = w_ok[h] ? ds4_half_to_float((unsigned short)(block[20] & 0xFFFFu)) : 0.0f;
  }
""",
    "W_AFTER": """  if (MINS == 0) {
    float dmin[2];
    #pragma unroll
    for (int h = 0; h < 2; ++h) {
      const SHARED_MEM unsigned int* block = reinterpret_cast<const SHARED_MEM unsigned int*>(w_row(s, h));
      const unsigned int scales = block[2 * (((s * U) >> 2) & 1) + (((s * U) >> 1) & 1)];
      #pragma unroll
      for (int u = 0; u < U; ++u) {
        const unsigned int m = (scales >> (8 * (2 * ((s * U + u) & 1) + (tig >> 1)) + 4)) & 15u;
        #pragma unroll
        for (int kk = 0; kk < 2; ++kk) {
          a[u][kk][h] = a[u][kk][2 + h] = ds4_half2_bits((float)m, (float)m);
        }
      }
      dmin[h] = w_ok[h] ? -ds4_half_to_float((unsigned short)(block[20] >> 16)) : 0.0f;
    }
    multiply(st, a, dmin);
  } else if (s % PER_BLOCK == PER_BLOCK - 1) {
    const SHARED_MEM unsigned int* sums = wbuf + ((s / PER_BLOCK) % W_SLOTS) * SLOT + W_AREA;
    unsigned int am[4];
    float dmin[2];
    #pragma unroll
    for (int h = 0; h < 2; ++h) {
      const SHARED_MEM unsigned int* block = reinterpret_cast<const SHARED_MEM unsigned int*>(w_row(s, h));
      const unsigned int first = (block[tig >> 1] >> (16 * (tig & 1))) & 0xFFFFu;
      const unsigned int second = (block[2 + (tig >> 1)] >> (16 * (tig & 1))) & 0xFFFFu;
      am[h] = ds4_half2_bits(16.0f * (float)((first >> 4) & 15u), 16.0f * (float)(first >> 12));
      am[2 + h] = ds4_half2_bits(16.0f * (float)((second >> 4) & 15u), 16.0f * (float)(second >> 12));
      dmin[h] = w_ok[h] ? -ds4_half_to_float((unsigned short)(block[20] >> 16)) : 0.0f;
    }
    ds4_wgmma_fence();
    ds4_wgmma_split<128, LBO, 2 * LBO>(part, am, sums, TM * 8, 0);
    ds4_wgmma_commit();
    ds4_wgmma_wait<0>(part);
    ds4_wgmma_hold(am);
    drain(dmin);
  }
""",
}
"""Slice sl = U s + u is values 32 (sl % 8) .. of block s / PER_BLOCK: half hb = (sl / 4) % 2, shift 2 j with j =
sl % 4 (qs from word 4; scale bytes 0-15; d | dmin word 20 of the 84-byte block); a stage's slices share hb, so
their quants are the same qs words at other shifts. Lane t's values 8 t + 4 kk .. + 3 are qs bytes 32 hb + 8 t + 4
kk .. (word 4 + 8 hb + 2 t + kk), in the slice's group t / 2: scale byte 8 hb + 2 j + t / 2 (word 2 hb + j / 2, byte
2 (j % 2) + t / 2). The reference's value is d (sc & 15) q - dmin (sc >> 4): A holds (sc & 15) q (0..45, exact
halves, as grouped_raw.py makes them) drained with the block's d; then the same B by A = sc >> 4 in each of the
lane's values (its group's m, into the registers of the first product's A), drained with -dmin (both read again
from the slot: no register holds them across the first product)."""

_PARTS = {GGMLType.IQ2_XXS: _IQ2_XXS, GGMLType.Q2_K: _Q2_K}
_INPUTS = ("xhi", "xlo", "w", "counts", "dims", "xscale", "xrow", "shi", "slo")


@cache
def kernel(ggml_type: GGMLType, warpgroups: int = WARPGROUPS, tk: int = TK, stages: int = STAGES, mins: int = 0
           ) -> Kernel:
    """One kernel per raw expert type, width, stage width, depth and (Q2_K) way of taking the mins. CUDA sm_90a
    only."""
    source = _SOURCE
    for name, text in _PARTS[ggml_type].items():
        source = source.replace(name, text)
    header = SIMD_EXCLUSIVE_SUM + (GRID_HEADER if ggml_type == GGMLType.IQ2_XXS else "")
    return Kernel(f"ds4_grouped_wgmma_{ggml_type.name.lower()}_{warpgroups}_{tk}_{stages}_{mins}", _INPUTS, ("y",),
                  source, header, launch_bounds=(128 * warpgroups, 1),
                  shared_memory=shared_bytes(ggml_type, warpgroups, tk, stages, mins))


def wgmma_grouped_gemm(x: mx.array, blocks: mx.array, counts: mx.array, ggml_type: GGMLType,
                       shape: tuple[int, int, int], rows: mx.array | None = None,
                       warpgroups: int = WARPGROUPS, tk: int = TK, stages: int = STAGES,
                       mins: int = MINS) -> mx.array:
    """grouped_raw.raw_grouped_gemm's product (its arguments, the same result within float32 reassociation) by
    warpgroup products; `warpgroups`, `tk` (32 or 64), `stages` and `mins` (Q2_K) for
    bench/prefill_gemms.py. CUDA sm_90a only."""
    assert tk in (32, 64)
    n_tiles = row_tiles(x.shape[0] if rows is None else rows.size, shape[0], TM)
    hi, lo, scales = held("slots", (x, counts, rows), n_tiles, lambda: split_slots(x, counts, rows, n_tiles))
    mins = int(mins and ggml_type == GGMLType.Q2_K)
    sums = group_sums(x, scales) if mins else (mx.zeros((1,), dtype=mx.uint32),) * 2
    gather = rows is not None
    index = rows.astype(mx.uint32) if gather else mx.zeros((1,), dtype=mx.uint32)
    tn, threads = 64 * warpgroups, 128 * warpgroups
    return launch_grouped(build(kernel(ggml_type, warpgroups, tk, stages, mins), current_backend()), [hi, lo], blocks,
                          counts, shape,
                          [("TM", TM), ("TN", tn), ("TK", tk), ("THREADS", threads), ("STAGES", stages),
                           ("PLANE_WORDS", plane_words(tk)), ("LBO", LBO), ("SBO", SBO), ("GATHER", gather),
                           ("W_SLOTS", W_SLOTS), ("W_WORDS", W_WORDS[ggml_type]), ("MINS", mins),
                           ("TILE_WORDS", TILE_WORDS)],
                          extra=[scales, index, *sums], pairs=x.shape[0] if rows is None else rows.size,
                          tile=(TM, tn, threads))


_SPLIT_SLOTS = """
const int tid = THREAD_IN_GROUP;
const int n_expert = dims[0];
const int n_in = dims[1];
const int tile = GROUP_X / (TM / 8);
SHARED int where[3];
""" + TILE_SCAN + """
const int tile_index = tile;
const int n0 = (GROUP_X % (TM / 8)) * 8;
auto real = [&](int n) { return n < rows; };
auto x_row = [&](int n) { return GATHER ? (int)xrow[row0 + n] : row0 + n; };
""" + TILE_BLOCK
"""halfsplit's TILE_BLOCK over the pairs' tiles: the threadgroups of tile i find its pairs by the GEMMs' own row-tile
scan (TILE_SCAN over the counts), and slot n of the tile is its pair n's row of x (its token's with GATHER); tiles
past the last pair's are not written (the GEMMs return before reading them)."""
SLOTS_KERNEL = Kernel("ds4_split_slots", ("x", "counts", "xrow", "dims"), ("hi", "lo", "scale"), _SPLIT_SLOTS,
                      SIMD_EXCLUSIVE_SUM + ROW_SCALE)


def slot_rows(counts: mx.array, rows: mx.array | None, n_tiles: int, n_rows: int) -> mx.array:
    """Row of x (N rows) each of the n_tiles TM slots holds, N where none: the slots of the kernels' row tiles
    (TILE_SCAN: each expert's pairs in whole tiles of TM, the experts in order; pair p reads row p, or rows[p])."""
    c = counts.astype(mx.int32)
    tiles = (c + TM - 1) // TM
    tile_end = mx.cumsum(tiles)
    slot = mx.arange(n_tiles * TM)
    tile, n = slot // TM, slot % TM
    e = mx.sum(tile[:, None] >= tile_end[None, :], axis=1)
    used = e < c.size
    e = mx.minimum(e, c.size - 1)
    at = (tile - (tile_end - tiles)[e]) * TM + n
    used = used & (at < c[e])
    pair = mx.where(used, mx.cumsum(c)[e] - c[e] + at, 0)
    return mx.where(used, pair if rows is None else rows.astype(mx.int32)[pair], n_rows)


def reference_split_slots(x: mx.array, counts: mx.array, rows: mx.array | None, n_tiles: int
                          ) -> tuple[mx.array, mx.array, mx.array]:
    """halfsplit's split of x (N, IN) float32 with each tile's slots holding its pairs' rows (`slot_rows`; no row:
    zeros) in the tiles layout, n_tiles tiles; the scales in x's row order."""
    hi, lo, scale = reference_split_rows(x)
    at = slot_rows(counts, rows, n_tiles, x.shape[0])
    zero = mx.zeros((1, hi.shape[1]), dtype=hi.dtype)
    return (to_tiles(mx.concatenate([hi, zero])[at], n_tiles), to_tiles(mx.concatenate([lo, zero])[at], n_tiles),
            scale)


def _kernel_split_slots(x: mx.array, counts: mx.array, rows: mx.array | None, n_tiles: int
                        ) -> tuple[mx.array, mx.array, mx.array]:
    n, n_in = x.shape
    return tuple(build(SLOTS_KERNEL, current_backend())(
        inputs=[x, counts.astype(mx.uint32),
                mx.zeros((1,), dtype=mx.uint32) if rows is None else rows.astype(mx.uint32),
                mx.array([counts.size, n_in], dtype=mx.int32)],
        template=[("TM", TM), ("X_TOP", X_TOP), ("TILE_WORDS", TILE_WORDS), ("GATHER", int(rows is not None))],
        grid=(n_tiles * (TM // 8) * 256, 1, 1), threadgroup=(256, 1, 1),
        output_shapes=[(n_tiles * TM, n_in // 2)] * 2 + [(n,)], output_dtypes=[mx.uint32, mx.uint32, mx.float32]))


def _slots_probe(key: int) -> tuple:
    """Four experts (one unused, one over two tiles) of 152 pairs reading 40 rows of very different sizes, each by
    three or four pairs, in a shuffled order."""
    x = random_activations((40, key), seed=27) * mx.power(10.0, mx.arange(40) % 9 - 4.0)[:, None]
    counts = mx.array([3, 0, 140, 9], dtype=mx.uint32)
    rows = mx.array((np.random.default_rng(28).permutation(160) % 40)[:152], dtype=mx.uint32)
    return x, counts, rows, row_tiles(152, 4, TM)


def _slots_checked(x: mx.array, counts: mx.array, rows: mx.array | None, n_tiles: int
                   ) -> tuple[mx.array, mx.array, mx.array]:
    """The kernel's split with the tiles it leaves unwritten (past the last pair's) zeroed, as the reference has
    them."""
    hi, lo, scale = _kernel_split_slots(x, counts, rows, n_tiles)
    used = (mx.arange(n_tiles * TM) // TM < mx.sum((counts.astype(mx.int32) + TM - 1) // TM))[:, None]
    return mx.where(used, hi, 0), mx.where(used, lo, 0), scale


SPLIT_SLOTS = FastPath("split_slots", reference_split_slots, _slots_checked, _slots_probe, tolerance=0.0,
                       backends=("cuda",))
"""The pairs' split into their tiles by one kernel (gathering their rows), bit for bit the reference's in every
tile the GEMMs read; key: the row length."""


def split_slots(x: mx.array, counts: mx.array, rows: mx.array | None, n_tiles: int
                ) -> tuple[mx.array, mx.array, mx.array]:
    """`reference_split_slots`, by the kernel where its check passed (its unused tiles left unwritten). Transient
    memory: n_tiles * TM * IN * 4 bytes (two planes of half pairs), n_tiles = row_tiles(N, E) <= N / TM + E: 1.34 GB
    for the gate and up of an 8192-token chunk's 49,152 pairs (Flash: IN 4096), 0.67 GB for its down (IN 2048)."""
    x = x.astype(mx.float32)
    if SPLIT_SLOTS.enabled(x.shape[-1]):
        return _kernel_split_slots(x, counts, rows, n_tiles)
    return reference_split_slots(x, counts, rows, n_tiles)


_SUMS = """
const unsigned int at = GROUP_X * THREADS + THREAD_IN_GROUP;
const unsigned int quads = (unsigned int)dims[0] / 4;
const bool ok = at < (unsigned int)dims[1] * quads;
const unsigned int q = ok ? at : 0u;
const float4 f = reinterpret_cast<const GLOBAL_MEM float4*>(x)[q];
const float sc = xscale[q / quads];
float sum = ok ? (f.x * sc + f.y * sc) + (f.z * sc + f.w * sc) : 0.0f;
sum += ds4_simd_xor(sum, 1);
sum += ds4_simd_xor(sum, 2);
const float next = ds4_simd_xor(sum, 4);
if (ok && (at & 7u) == 0u) {
  ds4_half2_split(sum * 0.0625f, next * 0.0625f, shi[at >> 3], slo[at >> 3]);
}
"""
"""Thread i: values 4 i .. 4 i + 3 of x (one float4 load: a warp reads 512 contiguous bytes), times its row's
power of two (the split's); four lanes sum a group of 16 (16 values below 2^15: below 2^19), and the first of
eight lanes writes word i / 8 of the rows' words: its group's and the next group's sum / 16 (exact: below 2^15, a
half's range) as hi and lo halves. (One thread a word, 32 loads of its own, read x at ~780 GB/s: 2026-12-03.)"""
SUMS_KERNEL = Kernel("ds4_group_sums", ("x", "xscale", "dims"), ("shi", "slo"), _SUMS)


def group_sums(x: mx.array, scales: mx.array) -> tuple[mx.array, mx.array]:
    """The sums / 16 of each group of 16 values of x (N, IN) times its row scale (the split's), as (hi, lo) half
    pairs (N, IN / 32): B of MINS's products. CUDA only."""
    n, n_in = x.shape
    words = n * n_in // 32
    return tuple(build(SUMS_KERNEL, current_backend())(
        inputs=[x.astype(mx.float32), scales, mx.array([n_in, n], dtype=mx.int32)], template=[("THREADS", 256)],
        grid=(-(-words * 8 // 256) * 256, 1, 1), threadgroup=(256, 1, 1), output_shapes=[(n, n_in // 32)] * 2,
        output_dtypes=[mx.uint32, mx.uint32]))


def fits(n_in: int) -> bool:
    """Whether the kernel takes a bank of rows n_in long: on a Hopper GPU (dense_wgmma.hopper), whole blocks."""
    return hopper() and n_in % 256 == 0
