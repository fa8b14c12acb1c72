"""Prefill's grouped expert GEMM straight from a raw IQ2_XXS or Q2_K bank on CUDA tensor cores: no float scratch.

Contract: x float32, (N, IN) or with row indices (N,) a chunk's tokens (T, IN), the raw bank uint8 (E, OUT * row
bytes), counts (E,) of pairs sorted by expert; the result x_i @ W[e(i)].T as float32 (N, OUT); nothing read back to
the host, tiles never straddle experts (the grid and row-tile scan of grouped_gemm.py: TM x TN = 64 x 128 tiles, 8
warps of 32 x 32 outputs each).

Arithmetic: float16 tensor cores at float32 accuracy (mma.m16n8k16, float32 sums), from two exact facts:
- a raw q2 weight is a small integer times scales: IQ2_XXS (d / 8) * (k m), m = +-8, 25 or 43 and k odd, 1..31,
  one per 32-value sub-block; Q2_K d * (sc q) - ml, q in 0..3, sc a 4-bit scale and ml one min per group of 16;
  d per block of 256. The integers (k m, sc q) are exact halves, so the tile holds them and the block's scale
  applies to a stage's partial sums as they are drained into the float32 accumulators: (d / 8) * sum(x k m) where
  the reference sums x (db m); d * sum(x sc q) and ml * sum(x) per group for Q2_K, sum(x) from the tensor cores
  too (a B of ones). Float32 reassociation of the same exact factors;
- x is split into two halves (halfsplit.py: each row scaled by a power of two first), and each product takes 2 mma
  (lo w, then hi w into the same partial sums): ~2^-22 relative dropped per product, 3xTF32's class (2^-21).
The tensor cores truncate the sums they accumulate: each stage starts from zeroed partial sums, added to the
float32 accumulators (rounded to nearest) at its drain, as grouped_tf32.py does (at most 8 mma deep: ~2^-21 of a
partial sum at worst).

Staging: a stage is TK = 64 values (two 32-value slices). The x tiles (64 rows: pairs, or with GATHER the tokens
the pairs read, by the `xrow` index, so that gate and up need no (N, IN) copy of the chunk) are copies of words: x
is split once before the GEMM (halfsplit.split_rows: one pass, hi and lo half pairs), and its stages land in
threadgroup memory by cp.async STAGES - 1 ahead of the multiply. The W tile's 128 rows are decoded from the bank's
blocks in registers, two threads a row and 16 values a slice each, and stored as halves, eight per 16-byte store,
into one of two W tiles: a stage's W loads are in flight in registers while the stage before is multiplied, and it
is decoded into the tile the multiply before that left, so a stage passes one barrier. Rows are LDH = 36 words
apart: fragment loads hit 32 distinct banks. Threadgroup memory: STAGES x 2 x 64 + 2 x 128 rows of LDH words
dynamic (55,296 bytes at TK 64, 2 stages), the row scales and indices, the scan, IQ2_XXS's grid (2,048) and two
stages' slice scales (2,048) or Q2_K's scales and mins (8,192) static: two threadgroups fit an SM (GROUPS).

Decoding: thread tid decodes W row tid / 2 of the tile, values 16 (tid % 2) .. + 15 of the slice. A 32-value slice
is one IQ2_XXS sub-block (8 bytes, plus the block's f16 d) or one (half, shift) run pair of a Q2_K block:
- IQ2_XXS: the block's d, the sub-block's aux and the thread's two grid indices are four 16-bit loads (a 66-byte
  block keeps 2-byte alignment); the grid is ggml's 256 x 8 magnitudes as bytes (2 KiB) in threadgroup memory, two
  magnitudes made the halves k m by one byte permute and one fused half multiply-add (ds4_quant_fma_half2), their
  signs xored in;
- Q2_K: d | dmin, the word holding the thread's scale byte and the thread's 16 qs bytes are six 32-bit loads
  (84-byte blocks keep 4-byte alignment); four quants are two bits of each byte of a qs word, made the halves
  sc q two at a time (ds4_quant_fma_half2).

Cost against the 3xTF32 kernel this replaced (TF32 mma.m16n8k8, x split into TF32 hi / lo as floats): per 32
values a warp issued 64 mma of 8-deep products and 96 32-bit fragment loads; here 32 mma of 16-deep products (twice
the TF32 rate per mma on the H200) and 48 loads. Measured (H200, a 4096-token chunk's 24,576 pairs,
bench/prefill_gemms.py): 12.0 / 14.3 ms per Flash IQ2_XXS / Q2_K projection for the 3xTF32 kernel; 9.8 / 10.4 here
at TK 32 and one threadgroup an SM; 7.2 / 8.6 at TK 64 and two (GROUPS); **6.5 / 8.7** with x split before the
GEMM (63 / 48 TFLOP/s of useful work, ~13% of the float16 peak: each stage still decodes W in registers between two
barriers, and a tile of 64 pairs decodes every expert's W about twice: 96 pairs an expert in a 4096-token chunk);
**6.22 / 7.87** with x by cp.async and two W tiles, one barrier a stage (2026-12-03, STAGES). Nsight Compute
(2026-12-03, bench/ncu_summary.py) then counted 12 instructions issued per mma in the Q2_K kernel, as often
waiting for an issue slot as for data: 3.2 FFMA (its drain every group of 16) and 1.7 fragment loads. The
fragments now come by ldmatrix (a tenth of the loads) and Q2_K's group scales ride in the tile.
"""

from __future__ import annotations

from functools import cache

import mlx.core as mx
import numpy as np
from gguf.quants import IQ2_XXS

from ...model.gguf import GGMLType
from ..machinery.dialect import SIMD_EXCLUSIVE_SUM, Kernel, build
from .grouped_gemm import TILE_HEAD, TILE_SCAN, THREADS, TM, TN, launch_grouped
from .halfsplit import held_split
from ..machinery.registry import current_backend

SLICE = 32
"""The decoding unit: one IQ2_XXS sub-block (one scale), two Q2_K groups of 16 (a scale and a min each)."""
TK = 64
"""K per stage (two slices: two mma k-steps of 16 each): the work between a stage's barriers, which has to cover
the next stage's W loads in flight. Measured (H200, 4096-token chunk) at TK = 32: 9.05 ms per IQ2_XXS and 10.3 ms
per Q2_K Flash projection, ~9% of the float16 tensor-core peak, when a stage passed two barriers; with one
(2026-12-03) TK = 32 is still slower: 6.61 / 8.45 ms against 6.16 / 9.08 at 3 stages."""


def template(tk: int = TK) -> list[tuple[str, int]]:
    """The template constants for a stage of `tk` values (a multiple of SLICE dividing 256): LDH = tk / 2 + 4 words
    (half pairs) a threadgroup row, 20 or 36: both put a fragment load's 8 rows x 4 words on 32 distinct banks and
    keep rows 16-byte aligned for the W tile's vector stores."""
    assert tk % SLICE == 0 and 256 % tk == 0
    return [("TM", TM), ("TN", TN), ("TK", tk), ("THREADS", THREADS), ("LDH", tk // 2 + 4)]


assert THREADS == 2 * TN and THREADS % (TM // 4) == 0, "the staging maps: two threads per W row, whole x rows"


def grid_words() -> list[int]:
    """ggml's iq2xxs_grid as bytes (8, 25 or 43), eight per entry: entry i is words 2i (values 0-3) and 2i + 1
    (values 4-7), value j in byte j % 4."""
    IQ2_XXS.init_grid()
    grid = np.asarray(IQ2_XXS.grid).reshape(256, 8).astype(np.uint8)
    return grid.view("<u4").reshape(-1).tolist()


def f16_source(w_shared: str, w_setup: str, w_load: str, w_store: str, q2_k: bool) -> str:
    """The kernel body with its W staging given: `w_shared` declares what the staging keeps beside the W tiles
    (SCALES floats a stage for `wsc_all`, and for Q2_K `wml_all`, two stages each); `w_setup` runs once past the
    tile scan; `w_load` issues stage ls's global loads into registers; `w_store` decodes them into `ws` (TN rows of
    LDH words, row n = output column col0 + n, two halves a word along k) and the stage's scales, the tile and
    scales of stage s's parity, which the multiply two stages back left before the last barrier. A stage is U = TK
    / SLICE slices. The scales finer than a block ride in the tile, so the partial sums are drained with one scale
    per W row and stage (`wsc`, 8 mma deep): IQ2_XXS's d / 8 (KD = 2 U mma k-steps a drain); Q2_K's (`q2_k`) d,
    and a min per W row and group of 16 (`wml`, group-major; KD = 1), times the group's sum of x from the tensor
    cores with a B of ones, drained each k-step. Each k-step issues the lo pass over the warp's eight tiles, then
    the hi pass."""
    multiply = ("    float part[2][4][4] = {};\n" if q2_k else "") + """    #pragma unroll
    for (int g = 0; g < 2 * U / KD; ++g) {
""" + (_XSUM_INIT if q2_k else "      float part[2][4][4] = {};\n") + """      #pragma unroll
      for (int kk = 0; kk < KD; ++kk) {
""" + _FRAGMENTS.replace("KW", "8 * (g * KD + kk)") + """        #pragma unroll
        for (int i = 0; i < 2; ++i) {
""" + (_XSUM if q2_k else "") + """          #pragma unroll
          for (int j = 0; j < 4; ++j) {
            ds4_mma_f16_16x8x16(part[i][j], al[i], bw[j]);
          }
        }
        #pragma unroll
        for (int i = 0; i < 2; ++i) {
          #pragma unroll
          for (int j = 0; j < 4; ++j) {
            ds4_mma_f16_16x8x16(part[i][j], ah[i], bw[j]);
          }
        }
      }
""" + (_DRAIN.replace("TERM", "-wml[n], xsum[i][c]").replace("NBASE", "g * TN") if q2_k else
       _DRAIN.replace("TERM", "wsc[n], part[i][j][c]").replace("NBASE", "g * TN")) + """    }
""" + (_DRAIN.replace("TERM", "wsc[n], part[i][j][c]").replace("NBASE", "0") if q2_k else "")
    return TILE_HEAD + """
constexpr int U = TK / 32;""" + f"""
constexpr int KD = {1 if q2_k else "2 * U"};""" + """
constexpr int XSTAGE = 2 * TM * LDH;
SHARED float rsx[TM];
SHARED unsigned int xr[TM];
SHARED_MEM unsigned int* xbuf = reinterpret_cast<SHARED_MEM unsigned int*>(ds4_shared);
SHARED_MEM unsigned int* wbuf = xbuf + STAGES * XSTAGE;
""" + w_shared + TILE_SCAN + """
const int lane = SIMD_LANE;
const int warp = SIMD_INDEX;
const int gid = lane >> 2;
const int tig = lane & 3;
const int wm = (warp / (TN / 32)) * 32;
const int wn = (warp % (TN / 32)) * 32;
if (tid < TM) {
  const unsigned int at = tid < rows ? (GATHER ? xrow[row0 + tid] : (unsigned int)(row0 + tid)) : 0u;
  xr[tid] = at;
  rsx[tid] = tid < rows ? xscale[at] : 0.0f;
}
ds4_barrier();
auto load_x = [&](int ls) {
  SHARED_MEM unsigned int* st = xbuf + (ls % STAGES) * XSTAGE;
  #pragma unroll
  for (int c = tid; c < TM * TK / 8; c += THREADS) {
    const int r = c / (TK / 8);
    const int p = c % (TK / 8);
    const size_t at = (size_t)xr[r] * (n_in / 2) + ls * (TK / 2) + 4 * p;
    ds4_copy16_async(reinterpret_cast<SHARED_MEM float*>(st + r * LDH + 4 * p),
                     reinterpret_cast<const GLOBAL_MEM float*>(xhi + at), r < rows);
    ds4_copy16_async(reinterpret_cast<SHARED_MEM float*>(st + (TM + r) * LDH + 4 * p),
                     reinterpret_cast<const GLOBAL_MEM float*>(xlo + at), r < rows);
  }
};
""" + w_setup + """const int steps = n_in / TK;
#pragma unroll
for (int ls = 0; ls < STAGES - 1; ++ls) {
  if (ls < steps) {
    load_x(ls);
  }
  ds4_async_commit();
}
{
  const int ls = 0;
""" + w_load + """}
ds4_barrier();
float acc[2][4][4] = {};
for (int s = 0; s < steps; ++s) {
  SHARED_MEM unsigned int* ws = wbuf + (s & 1) * TN * LDH;
  SHARED_MEM float* wsc = wsc_all + (s & 1) * SCALES;
""" + ("  SHARED_MEM float* wml = wml_all + (s & 1) * SCALES;\n" if q2_k else "") + w_store + """  ds4_async_wait_keep<STAGES - 2>();
  ds4_barrier();
  if (s + STAGES - 1 < steps) {
    load_x(s + STAGES - 1);
  }
  ds4_async_commit();
  if (s + 1 < steps) {
    const int ls = s + 1;
""" + w_load + """  }
  const SHARED_MEM unsigned int* xh = xbuf + (s % STAGES) * XSTAGE;
  const SHARED_MEM unsigned int* xl = xh + TM * LDH;
""" + multiply + """}
ds4_async_wait_keep<0>();
#pragma unroll
for (int i = 0; i < 2; ++i) {
  #pragma unroll
  for (int c = 0; c < 4; ++c) {
    const int r = wm + 16 * i + gid + 8 * (c >> 1);
    if (r < rows) {
      const float unscale = ds4_div(1.0f, rsx[r]);
      #pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int n = col0 + wn + 8 * j + 2 * tig + (c & 1);
        if (n < n_out) {
          y[(size_t)(row0 + r) * n_out + n] = acc[i][j][c] * unscale;
        }
      }
    }
  }
}
"""


_DRAIN = """      #pragma unroll
      for (int i = 0; i < 2; ++i) {
        #pragma unroll
        for (int j = 0; j < 4; ++j) {
          #pragma unroll
          for (int c = 0; c < 4; ++c) {
            const int n = NBASE + wn + 8 * j + 2 * tig + (c & 1);
            acc[i][j][c] = fmaf(TERM, acc[i][j][c]);
          }
        }
      }
"""
"""Partial sums into the accumulators: TERM the scale and the partial sum of output (i, j, c), NBASE where the
scales of this drain start (output n's at NBASE + n)."""

_XSUM_INIT = """      float xsum[2][4] = {};
      const unsigned int ones[2] = {0x3C003C00u, 0x3C003C00u};
"""
_XSUM = """          ds4_mma_f16_16x8x16(xsum[i], al[i], ones);
          ds4_mma_f16_16x8x16(xsum[i], ah[i], ones);
"""

_FRAGMENTS = """      unsigned int ah[2][4];
      unsigned int al[2][4];
      unsigned int bw[4][2];
      #pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int at = (wm + 16 * i + (lane & 15)) * LDH + KW + 4 * (lane >> 4);
        ds4_ldmatrix_x4(ah[i], xh + at);
        ds4_ldmatrix_x4(al[i], xl + at);
      }
      #pragma unroll
      for (int j = 0; j < 4; j += 2) {
        unsigned int v[4];
        ds4_ldmatrix_x4(v, ws + (wn + 8 * j + (lane & 7) + 8 * (lane >> 4)) * LDH + KW + 4 * ((lane >> 3) & 1));
        bw[j][0] = v[0];
        bw[j][1] = v[1];
        bw[j + 1][0] = v[2];
        bw[j + 1][1] = v[3];
      }
"""
"""One mma k-step's fragments (KW: its first word in a row, 8 words = 16 halves a step), each ldmatrix.x4 four 8 x 8
blocks of the tiles as mma.m16n8k16 takes them: the x hi and lo rows of the warp's two 16-row tiles (lanes 0-15
address rows 0-15 at the step's first 8 halves, lanes 16-31 the same rows at the next 8: a0-a3), and the W rows
of two 8-column tiles a call (lanes 0-7 the first tile's rows at the first 8 halves, 8-15 at the next 8, then the
second tile's: b of both). Rows LDH words apart: each block's 8 rows on distinct banks."""


def _row(block_bytes: int) -> str:
    """Setup: this thread's W row dn of the tile (a row past OUT reads row col0 and stores zeros) and half dh."""
    return f"""const int dn = tid >> 1;
const int dh = tid & 1;
const bool d_ok = col0 + dn < n_out;
const GLOBAL_MEM unsigned char* w_row = w + ((size_t)expert * n_out + (d_ok ? col0 + dn : col0))
    * (size_t)((n_in / 256) * {block_bytes});
"""


_IQ2_XXS_SHARED = "SHARED unsigned int iq2_grid[512];\nconstexpr int SCALES = TN * (TK / 32);\nSHARED float wsc_all[2 * SCALES];\n"
_IQ2_XXS_SETUP = _row(66) + """for (int i = tid; i < 512; i += THREADS) {
  iq2_grid[i] = ds4_iq2xxs_bytes[i];
}
unsigned int w_d = 0u;
unsigned int w_q[U];
unsigned int w_aux[U];
"""
_IQ2_XXS_LOAD = """    const GLOBAL_MEM unsigned short* b16 =
        reinterpret_cast<const GLOBAL_MEM unsigned short*>(w_row + (size_t)((ls * U) >> 3) * 66);
    w_d = b16[0];
    #pragma unroll
    for (int u = 0; u < U; ++u) {
      const int sub = 4 * ((ls * U + u) & 7);
      w_q[u] = b16[1 + sub + dh];
      w_aux[u] = (unsigned int)b16[3 + sub] | ((unsigned int)b16[4 + sub] << 16);
    }
"""
_IQ2_XXS_STORE = """    #pragma unroll
    for (int u = 0; u < U; ++u) {
      if (u == 0 && dh == 0) {
        wsc[dn] = d_ok ? ds4_half_to_float((unsigned short)w_d) * 0.125f : 0.0f;
      }
      const float k = (float)(2u * (w_aux[u] >> 28) + 1u);
      const unsigned int k2 = ds4_half2_bits(k, k);
      const unsigned int o2 = ds4_half2_bits(-1024.0f * k, -1024.0f * k);
      SHARED_MEM uint4* wrow = reinterpret_cast<SHARED_MEM uint4*>(ws + dn * LDH + 16 * u + 8 * dh);
      #pragma unroll
      for (int gg = 0; gg < 2; ++gg) {
        const unsigned int idx = (w_q[u] >> (8 * gg)) & 255u;
        const unsigned int low = (w_aux[u] >> (7 * (2 * dh + gg))) & 127u;
        const unsigned int signs = low | ((ds4_popcount(low) & 1u) << 7);
        const unsigned int g0 = iq2_grid[2 * idx];
        const unsigned int g1 = iq2_grid[2 * idx + 1];
        uint4 v;
        v.x = d_ok ? ds4_quant_fma_half2(g0, 0x4140u, k2, o2) ^ ((signs * 0x40008000u) & 0x80008000u) : 0u;
        v.y = d_ok ? ds4_quant_fma_half2(g0, 0x4342u, k2, o2) ^ ((signs * 0x10002000u) & 0x80008000u) : 0u;
        v.z = d_ok ? ds4_quant_fma_half2(g1, 0x4140u, k2, o2) ^ ((signs * 0x04000800u) & 0x80008000u) : 0u;
        v.w = d_ok ? ds4_quant_fma_half2(g1, 0x4342u, k2, o2) ^ ((signs * 0x01000200u) & 0x80008000u) : 0u;
        wrow[gg] = v;
      }
    }
"""
"""Slice u of stage s is sub-block (s U + u) % 8 of block s U / 8 (a stage never straddles a block: TK divides 256;
16-bit words: d at 0, sub-block b at 1 + 4 b: grid indices in words +0 and +1, aux in +2 and +3). Half dh holds
groups 2 dh and 2 dh + 1 (8 values each): grid indices = the two bytes of word 1 + 4 b + dh, signs = aux's 7-bit
field of the group plus its parity bit (ggml's ksigns). The reference's value is db * magnitude, db = d * (0.5 +
aux >> 28) * 0.25 = (d / 8) * k with k = 2 (aux >> 28) + 1 (exact); the tile holds the signed k * magnitude (at
most 31 * 43 = 1333: exact halves, two at a time from the grid bytes by one prmt and one fused half multiply-add,
the signs' bits moved to the halves' sign bits by a multiply and xored in) and wsc the block's d / 8 per row, which
scales the stage's partial sums as they are drained (a stage of 64 values never straddles a block)."""

_Q2_K_SHARED = ("constexpr int SCALES = 2 * (TK / 32) * TN;\nSHARED float wsc_all[2 * SCALES];\n"
                "SHARED float wml_all[2 * SCALES];\n")
_Q2_K_SETUP = _row(84) + """unsigned int w_dm = 0u;
unsigned int w_sc[U];
unsigned int w_qs[U][4];
"""
_Q2_K_LOAD = """    const GLOBAL_MEM unsigned int* b32 =
        reinterpret_cast<const GLOBAL_MEM unsigned int*>(w_row + (size_t)((ls * U) >> 3) * 84);
    w_dm = b32[20];
    #pragma unroll
    for (int u = 0; u < U; ++u) {
      const int sl = ls * U + u;
      const int hb = (sl >> 2) & 1;
      w_sc[u] = b32[2 * hb + ((sl >> 1) & 1)];
      #pragma unroll
      for (int m = 0; m < 4; ++m) {
        w_qs[u][m] = b32[4 + 8 * hb + 4 * dh + m];
      }
    }
"""
_Q2_K_STORE = """    #pragma unroll
    for (int u = 0; u < U; ++u) {
      const int sl = s * U + u;
      const unsigned int sc = (w_sc[u] >> (8 * (2 * (sl & 1) + dh))) & 255u;
      if (u == 0 && dh == 0) {
        wsc[dn] = d_ok ? ds4_half_to_float((unsigned short)(w_dm & 0xFFFFu)) : 0.0f;
      }
      wml[(2 * u + dh) * TN + dn] = d_ok ? ds4_half_to_float((unsigned short)(w_dm >> 16)) * (float)(sc >> 4) : 0.0f;
      const unsigned int k2 = ds4_half2_bits((float)(sc & 15u), (float)(sc & 15u));
      const unsigned int o2 = ds4_half2_bits(-1024.0f * (float)(sc & 15u), -1024.0f * (float)(sc & 15u));
      SHARED_MEM uint4* wrow = reinterpret_cast<SHARED_MEM uint4*>(ws + dn * LDH + 16 * u + 8 * dh);
      #pragma unroll
      for (int m = 0; m < 2; ++m) {
        const unsigned int q0 = (w_qs[u][2 * m] >> (2 * (sl & 3))) & 0x03030303u;
        const unsigned int q1 = (w_qs[u][2 * m + 1] >> (2 * (sl & 3))) & 0x03030303u;
        uint4 v;
        v.x = d_ok ? ds4_quant_fma_half2(q0, 0x4140u, k2, o2) : 0u;
        v.y = d_ok ? ds4_quant_fma_half2(q0, 0x4342u, k2, o2) : 0u;
        v.z = d_ok ? ds4_quant_fma_half2(q1, 0x4140u, k2, o2) : 0u;
        v.w = d_ok ? ds4_quant_fma_half2(q1, 0x4342u, k2, o2) : 0u;
        wrow[m] = v;
      }
    }
"""
"""Slice sl = s U + u is values 32 (sl % 8) .. of block sl / 8: half hb = (sl / 4) % 2 and shift 2 j, j = sl % 4;
value 128 hb + 32 j + 16 dh + i has quant (qs[32 hb + 16 dh + i] >> 2 j) & 3 (qs from byte 16 = word 4) and scale
byte 8 hb + 2 j + dh (word 2 hb + j / 2, byte 2 (j % 2) + dh); d | dmin is word 20 (bytes 80-83). The reference's
value is dl q - ml with dl = d (sc & 15) and ml = dmin (sc >> 4), both exact products; the tile holds (sc & 15) q
(0..45, exact halves, made from the quant bytes by one prmt and one fused half multiply-add for two), the stage's
d per row (a stage of 64 values never straddles a block) and each group's ml (group 2 u + dh of the stage): the
partial sums take d once a stage, and each group's rows' sums of x its ml."""

GRID_HEADER = "CONSTANT unsigned int ds4_iq2xxs_bytes[512] = {" + ", ".join(map(str, grid_words())) + "};\n"
"""ggml's grid as `grid_words` lays it out, a constant table of the header (grouped_wgmma.py's IQ2_XXS kernel reads
it too)."""

_INPUTS = ("xhi", "xlo", "w", "counts", "dims", "xscale", "xrow")
_TEXTS = {
    GGMLType.IQ2_XXS: (f16_source(_IQ2_XXS_SHARED, _IQ2_XXS_SETUP, _IQ2_XXS_LOAD, _IQ2_XXS_STORE, False),
                       SIMD_EXCLUSIVE_SUM + GRID_HEADER),
    GGMLType.Q2_K: (f16_source(_Q2_K_SHARED, _Q2_K_SETUP, _Q2_K_LOAD, _Q2_K_STORE, True),
                    SIMD_EXCLUSIVE_SUM),
}
GROUPS = 2
"""Threadgroups an SM holds at once: the launch bounds cap registers at 128 a thread (at TK = 64, nvcc 13 for
sm_90: 169 / 182 registers without them, one threadgroup an SM; 128 with 28 / 36 bytes spilled), so that one
threadgroup's stage can run while the other waits on its loads."""
STAGES = 2
"""Stages of x in flight: the copies of the next STAGES - 1 are landing while one is multiplied. Measured (H200,
bench/prefill_gemms.py, 2026-12-03, TK 64, two threadgroups an SM): IQ2_XXS 6.22 / 6.16 ms at 2 / 3 stages, Q2_K
7.87 / 9.08 (3 stages spill registers there)."""


def shared_bytes(tk: int = TK, stages: int = STAGES) -> int:
    """Dynamic threadgroup memory: `stages` x tiles (TM rows of hi, then of lo) and two W tiles (TN rows), LDH words
    a row."""
    return 4 * (stages * 2 * TM + 2 * TN) * (tk // 2 + 4)


@cache
def kernel(ggml_type: GGMLType, groups: int = GROUPS, tk: int = TK, stages: int = STAGES) -> Kernel:
    """One kernel per raw expert type, occupancy, stage width and pipeline depth. CUDA only (the tensor-core helpers
    of the CUDA prelude)."""
    source, header = _TEXTS[ggml_type]
    return Kernel(f"ds4_grouped_raw_f16_{ggml_type.name.lower()}_{groups}_{tk}_{stages}", _INPUTS, ("y",), source,
                  header, launch_bounds=(THREADS, groups) if groups > 1 else None,
                  shared_memory=shared_bytes(tk, stages))


def raw_grouped_gemm(x: mx.array, blocks: mx.array, counts: mx.array, ggml_type: GGMLType,
                     shape: tuple[int, int, int], rows: mx.array | None = None, tk: int = TK, groups: int = GROUPS,
                     stages: int = STAGES) -> mx.array:
    """x[i] @ W[e(i)].T as float32 (N, OUT) for a raw bank `blocks` (uint8, E rows of OUT * row bytes) of type
    `ggml_type` and row-major shape (E, OUT, IN), pair i's expert given by the counts (E,) of pairs sorted by
    expert. With `rows` (N,), pair i reads x[rows[i]] (x (T, IN): a chunk's tokens, each read by its k pairs, with no
    (N, IN) copy made and one row scale per token); without, x[i] (x (N, IN)). `tk` the stage width, `groups`
    the occupancy and `stages` the pipeline's depth (bench/prefill_gemms.py compares them). CUDA only."""
    hi, lo, scales = held_split(x)
    n = x.shape[0] if rows is None else rows.size
    gather = rows is not None
    index = rows.astype(mx.uint32) if gather else mx.zeros((1,), dtype=mx.uint32)
    return launch_grouped(build(kernel(ggml_type, groups, tk, stages), current_backend()), [hi, lo], blocks, counts,
                          shape, [*template(tk), ("STAGES", stages), ("GATHER", gather)], extra=[scales, index],
                          pairs=n)
