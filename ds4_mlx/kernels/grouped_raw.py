"""Prefill's grouped expert GEMM straight from a raw IQ2_XXS or Q2_K bank on CUDA tensor cores: no float scratch.

The 3xTF32 kernel of grouped_tf32.py multiplies a float32 scratch (E, OUT, IN) that `dequant.dequantize_used`
writes first: 8 GiB per Flash projection (256 x 2048 x 4096 floats), ~3.2 ms of writing it, and most of a
prefill's memory above the weights. This kernel is the same kernel (its grid, row-tile scan, x staging, mma loop
and float32 drain once per K slice, `tf32_source`) with another W staging: each K slice's 128 W rows x 32 values
are decoded from the bank's blocks in registers and stored as float32 into threadgroup memory (Q2_K: the values,
which the mma loop splits into TF32 hi / lo as before; IQ2_XXS: exact signed magnitudes and a scale per row).
Contract: x (N, IN) float32, the raw bank uint8 (E, OUT * row bytes), counts (E,) of pairs sorted by expert; the
result x[i] @ W[e(i)].T as float32 (N, OUT); nothing read back to the host, tiles never straddle experts.

Decoding: thread tid decodes W row tid / 2 of the tile, values 16 (tid % 2) .. + 15 of the slice. A 32-value
slice is one IQ2_XXS sub-block (8 bytes, plus the block's f16 d) or one (half, shift) run pair of a Q2_K block:

- IQ2_XXS: the block's d, the sub-block's aux and the thread's two grid indices are four 16-bit loads (a 66-byte
  block keeps 2-byte alignment); the grid is ggml's 256 x 8 magnitudes as bytes (2 KiB) in threadgroup memory, a
  magnitude one byte permute to 2^23 + m minus 2^23 (exact, no int-to-float conversion);
- Q2_K: d | dmin, the word holding the thread's scale byte and the thread's 16 qs bytes are six 32-bit loads
  (84-byte blocks keep 4-byte alignment); a quant is two bits of a qs byte, made a float the same way.

Q2_K's staged values are the reference dequantizer's float32 (quants.py) bit for bit, whether or not the compiler
contracts a multiply and an add: every product there is exact (an f16 scale has 11 significant bits, a 4-bit scale
at most 4, a 2-bit quant 2), so only the final subtraction rounds, once either way. IQ2_XXS stages the signed
magnitudes (exact in TF32: each product takes 2 mma, not 3, and no split of W) and one scale per W row and slice
(the sub-block's db), applied to the slice's partial sums as they are drained: db * sum(x m) where the reference
sums x (db m), float32 reassociation of the same exact factors. The result differs from the float64 products by
3xTF32's ~2^-21 per product and that reassociation.

Costs: threadgroup memory (2 x 64 + 128) x 36 x 4 = 36,864 bytes of tiles (x split into hi and lo tiles once) +
12 of scan; IQ2_XXS adds 2,048 of grid and 512 of row scales: 39,436 bytes (Q2_K: 36,876), under the 48 KB static
limit. Global reads: a warp's load touches 16 rows' sectors, re-read from L1/L2 over the 8 slices of a block; the
whole raw expert (2.2 MB for a Flash gate) per row tile. Decode adds ~5 integer / float operations per value (16
per thread per slice) between the slice's two barriers. Measured (H200, 2026-12-02) before the x tiles were split
once and IQ2_XXS's magnitudes staged exact: 8.8 ms (IQ2_XXS) and 8.6 ms (Q2_K) per Flash projection of a
2048-token chunk, at 159-160 registers a thread (one threadgroup per SM). Now 124 (IQ2_XXS) and 128 (Q2_K)
registers (nvcc 13, sm_90): two threadgroups fit an SM, so one's decoding can run under the other's mma; not yet
timed. Q2_K keeps its values split: staged exact (quants, with each 16-value group's dl and ml applied at two
drains a slice and ml times the group's sum of x subtracted), it took 173 registers, one threadgroup an SM again.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from gguf.quants import IQ2_XXS

from ..model.gguf import GGMLType
from .dialect import SIMD_EXCLUSIVE_SUM, Kernel, build
from .grouped_gemm import THREADS, TN, launch_grouped
from .grouped_tf32 import LD, TEMPLATE, TK, tf32_source
from .registry import current_backend

assert THREADS == 2 * TN and TK == 32 and LD % 4 == 0, "the decode mapping: two threads per W row, 16 values each"


def grid_words() -> list[int]:
    """ggml's iq2xxs_grid as bytes (8, 25 or 43), eight per entry: entry i is words 2i (values 0-3) and 2i + 1
    (values 4-7), value j in byte j % 4."""
    IQ2_XXS.init_grid()
    grid = np.asarray(IQ2_XXS.grid).reshape(256, 8).astype(np.uint8)
    return grid.view("<u4").reshape(-1).tolist()


_SHARED = """SHARED float4 ws4[TN * LD / 4];
SHARED_MEM float* ws = reinterpret_cast<SHARED_MEM float*>(ws4);
"""


def _row(block_bytes: int) -> str:
    """Setup: this thread's W row dn of the tile (a row past OUT reads row col0 and stores zeros) and half dh."""
    return f"""const int dn = tid >> 1;
const int dh = tid & 1;
const bool d_ok = col0 + dn < n_out;
const GLOBAL_MEM unsigned char* w_row = w + ((size_t)expert * n_out + (d_ok ? col0 + dn : col0))
    * (size_t)((n_in / 256) * {block_bytes});
"""


_STORE = """    #pragma unroll
    for (int m = 0; m < 4; ++m) {
      float4 v;
      v.x = d_ok ? dv[4 * m] : 0.0f;
      v.y = d_ok ? dv[4 * m + 1] : 0.0f;
      v.z = d_ok ? dv[4 * m + 2] : 0.0f;
      v.w = d_ok ? dv[4 * m + 3] : 0.0f;
      ws4[dn * (LD / 4) + 4 * dh + m] = v;
    }
"""
"""The 16 decoded values dv as four float4 stores: row dn starts at 36 dn floats (16-byte aligned), and the 8
threads of a quarter warp (rows dn..dn + 3, both halves) land on 8 distinct 4-bank groups: no conflicts."""

_IQ2_XXS_SHARED = _SHARED + "SHARED unsigned int iq2_grid[512];\nSHARED float wsc[TN];\n"
_IQ2_XXS_SETUP = _row(66) + """for (int i = tid; i < 512; i += THREADS) {
  iq2_grid[i] = ds4_iq2xxs_bytes[i];
}
unsigned int w_d = 0u;
unsigned int w_q = 0u;
unsigned int w_aux = 0u;
"""
_IQ2_XXS_LOAD = """    const GLOBAL_MEM unsigned short* b16 =
        reinterpret_cast<const GLOBAL_MEM unsigned short*>(w_row + (size_t)(s >> 3) * 66);
    const int sub = 4 * (s & 7);
    w_d = b16[0];
    w_q = b16[1 + sub + dh];
    w_aux = (unsigned int)b16[3 + sub] | ((unsigned int)b16[4 + sub] << 16);
"""
_IQ2_XXS_STORE = """    if (dh == 0) {
      wsc[dn] = d_ok ? ds4_half_to_float((unsigned short)w_d) * (0.5f + (float)(w_aux >> 28)) * 0.25f : 0.0f;
    }
    float dv[16];
    #pragma unroll
    for (int gg = 0; gg < 2; ++gg) {
      const unsigned int idx = (w_q >> (8 * gg)) & 255u;
      const unsigned int low = (w_aux >> (7 * (2 * dh + gg))) & 127u;
      const unsigned int signs = low | ((ds4_popcount(low) & 1u) << 7);
      #pragma unroll
      for (int j = 0; j < 8; ++j) {
        const float magnitude = ds4_magic_byte(iq2_grid[2 * idx + (j >> 2)], j & 3) - 8388608.0f;
        dv[8 * gg + j] = (signs >> j) & 1u ? -magnitude : magnitude;
      }
    }
""" + _STORE
"""Slice s is sub-block s % 8 of block s / 8 (16-bit words: d at 0, the sub-block at 1 + 4 (s % 8): grid indices
in words +0 and +1, aux in +2 and +3). Half dh holds groups 2 dh and 2 dh + 1 (8 values each): grid indices = the
two bytes of word 1 + 4 (s % 8) + dh, signs = aux's 7-bit field of the group plus its parity bit (ggml's ksigns).
The reference's value is db * magnitude, db = d * (0.5 + aux >> 28) * 0.25, negated by its sign bit. The whole
slice is one sub-block, so one db per W row: the tile holds the signed magnitudes (8, 25 or 43: exact in TF32)
and wsc the row's db, which scales the slice's partial sums as they are drained (tf32_source's `w_exact`)."""

_Q2_K_SETUP = _row(84) + """unsigned int w_dm = 0u;
unsigned int w_sc = 0u;
unsigned int w_qs[4] = {0u, 0u, 0u, 0u};
"""
_Q2_K_LOAD = """    const GLOBAL_MEM unsigned int* b32 =
        reinterpret_cast<const GLOBAL_MEM unsigned int*>(w_row + (size_t)(s >> 3) * 84);
    const int hb = (s >> 2) & 1;
    w_dm = b32[20];
    w_sc = b32[2 * hb + ((s >> 1) & 1)];
    #pragma unroll
    for (int m = 0; m < 4; ++m) {
      w_qs[m] = b32[4 + 8 * hb + 4 * dh + m];
    }
"""
_Q2_K_STORE = """    const unsigned int sc = (w_sc >> (8 * (2 * (s & 1) + dh))) & 255u;
    const float dl = ds4_half_to_float((unsigned short)(w_dm & 0xFFFFu)) * (float)(sc & 15u);
    const float ml = ds4_half_to_float((unsigned short)(w_dm >> 16)) * (float)(sc >> 4);
    float dv[16];
    #pragma unroll
    for (int i = 0; i < 16; ++i) {
      const unsigned int q = (w_qs[i >> 2] >> (8 * (i & 3) + 2 * (s & 3))) & 3u;
      dv[i] = dl * (ds4_float(0x4B000000u | q) - 8388608.0f) - ml;
    }
""" + _STORE
"""Slice s is values 32 (s % 8) .. of block s / 8: half hb = (s / 4) % 2 and shift 2 j, j = s % 4; value
128 hb + 32 j + 16 dh + i has quant (qs[32 hb + 16 dh + i] >> 2 j) & 3 (qs from byte 16 = word 4) and scale byte
8 hb + 2 j + dh (word 2 hb + j / 2, byte 2 (j % 2) + dh); d | dmin is word 20 (bytes 80-83).
value = (d * (sc & 15)) * q - dmin * (sc >> 4), as the reference."""

_GRID_HEADER = "CONSTANT unsigned int ds4_iq2xxs_bytes[512] = {" + ", ".join(map(str, grid_words())) + "};\n"

KERNELS: dict[GGMLType, Kernel] = {
    GGMLType.IQ2_XXS: Kernel("ds4_grouped_raw_iq2_xxs", ("x", "w", "counts", "dims"), ("y",),
                             tf32_source(_IQ2_XXS_SHARED, _IQ2_XXS_SETUP, _IQ2_XXS_LOAD, _IQ2_XXS_STORE,
                                         w_exact=True),
                             SIMD_EXCLUSIVE_SUM + _GRID_HEADER),
    GGMLType.Q2_K: Kernel("ds4_grouped_raw_q2_k", ("x", "w", "counts", "dims"), ("y",),
                          tf32_source(_SHARED, _Q2_K_SETUP, _Q2_K_LOAD, _Q2_K_STORE), SIMD_EXCLUSIVE_SUM),
}
"""CUDA only (the tensor-core helpers of the CUDA prelude); one kernel per raw expert type."""


def raw_grouped_gemm(x: mx.array, blocks: mx.array, counts: mx.array, ggml_type: GGMLType,
                     shape: tuple[int, int, int]) -> mx.array:
    """x[i] @ W[e(i)].T as float32 (N, OUT) for a raw bank `blocks` (uint8, E rows of OUT * row bytes) of type
    `ggml_type` and row-major shape (E, OUT, IN), pair i's expert given by the counts (E,) of pairs sorted by
    expert. CUDA only."""
    return launch_grouped(build(KERNELS[ggml_type], current_backend()), x, blocks, counts, shape, TEMPLATE)
