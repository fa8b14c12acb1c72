"""Dequantize the used experts of a raw IQ2_XXS or Q2_K bank into a float scratch, for prefill's grouped GEMMs.

A prefill chunk routes thousands of (token, expert) pairs, so every expert of a layer is read by tens of tokens:
decoding its blocks once into float32 (or bfloat16) and handing the result to one grouped GEMM
(`mx.gather_mm`, kernels/grouped.py) moves the work onto the matmul units instead of re-decoding per token.

One thread writes 32 consecutive values (an IQ2_XXS sub-block; a quarter of a Q2_K half-block, the values that
share one 2-bit shift), so a block is 8 threads and a bank (E, OUT, IN) is E * OUT * IN / 32 threads. Experts whose
count is 0 (no pair of the chunk uses them) are skipped and their part of the output is left unwritten: the grouped
GEMM never reads it, and the count input also ties the scratch to this layer's routing, so MLX does not schedule
it before the layer's input exists.

Each value is computed with the reference dequantizer's float32 operations in the same order (`quants.py`), so
the two agree up to the one rounding a compiler may skip by contracting a multiply and a subtract (Q2_K's
dl * q - ml) into a fused multiply-add: DEQUANT_TOLERANCE.
"""

from __future__ import annotations

import mlx.core as mx

from ..model.gguf import BLOCK_SIZES, GGMLType
from .dialect import Kernel, build
from .iq2_xxs import grid_codes
from .registry import current_backend

THREADS = 256
UNIT_VALUES = 32
DEQUANT_TOLERANCE = 1e-6
"""Relative to the bank's largest value: a contracted multiply-add rounds once where the reference rounds twice."""

_PROLOGUE = """
const size_t unit = (size_t)GROUP_X * THREADS + THREAD_IN_GROUP;
const size_t block = unit >> 3;
const unsigned int part = (unsigned int)(unit & 7);
const bool live = unit < (size_t)N_UNITS && counts[block / BLOCKS_PER_EXPERT] != 0u;
GLOBAL_MEM T* out = y + unit * 32;
"""

_IQ2_XXS = """
SHARED unsigned short grid[256];
for (int i = THREAD_IN_GROUP; i < 256; i += THREADS) {
  grid[i] = ds4_iq2xxs_grid[i];
}
ds4_barrier();
if (live) {
  const GLOBAL_MEM unsigned char* b = w + block * 66;
  const float d = ds4_half_to_float((unsigned short)(b[0] | (b[1] << 8)));
  const GLOBAL_MEM unsigned char* q = b + 2 + part * 8;
  const unsigned int aux = (unsigned int)q[4] | ((unsigned int)q[5] << 8) | ((unsigned int)q[6] << 16)
      | ((unsigned int)q[7] << 24);
  const float db = d * (0.5f + (float)(aux >> 28)) * 0.25f;
  for (int g = 0; g < 4; ++g) {
    const unsigned int codes = grid[q[g]];
    const unsigned int low = (aux >> (7 * g)) & 127u;
    const unsigned int signs = low | ((ds4_popcount(low) & 1u) << 7);
    for (int j = 0; j < 8; ++j) {
      const unsigned int c = (codes >> (2 * j)) & 3u;
      const float value = db * (float)(8u + 17u * c + (c >> 1));
      out[8 * g + j] = static_cast<T>((signs >> j) & 1u ? -value : value);
    }
  }
}
"""

_Q2_K = """
if (live) {
  const GLOBAL_MEM unsigned char* b = w + block * 84;
  const float d = ds4_half_to_float((unsigned short)(b[80] | (b[81] << 8)));
  const float dmin = ds4_half_to_float((unsigned short)(b[82] | (b[83] << 8)));
  const unsigned int h = part >> 2;
  const unsigned int shift = 2 * (part & 3);
  const GLOBAL_MEM unsigned char* qs = b + 16 + 32 * h;
  for (int r = 0; r < 2; ++r) {
    const unsigned int sc = b[8 * h + (part & 3) * 2 + r];
    const float dl = d * (float)(sc & 15u);
    const float ml = dmin * (float)(sc >> 4);
    for (int l = 16 * r; l < 16 * r + 16; ++l) {
      out[l] = static_cast<T>(dl * (float)((qs[l] >> shift) & 3u) - ml);
    }
  }
}
"""

_GRID_HEADER = "CONSTANT unsigned short ds4_iq2xxs_grid[256] = {" + ", ".join(map(str, grid_codes())) + "};\n"

KERNELS: dict[GGMLType, Kernel] = {
    GGMLType.IQ2_XXS: Kernel("ds4_dequant_iq2_xxs", ("w", "counts"), ("y",), _PROLOGUE + _IQ2_XXS, _GRID_HEADER),
    GGMLType.Q2_K: Kernel("ds4_dequant_q2_k", ("w", "counts"), ("y",), _PROLOGUE + _Q2_K),
}
"""The dequantize-to-scratch kernels, one neutral definition per raw expert type (CUDA and Metal)."""


def dequantize_used(blocks: mx.array, counts: mx.array, ggml_type: GGMLType, shape: tuple[int, int, int],
                    dtype: mx.Dtype = mx.float32) -> mx.array:
    """The bank (E, OUT, IN) in `dtype`, written only for experts with counts[e] > 0 (others: unspecified).

    blocks: uint8 holding the bank's raw blocks (E rows of OUT * row_bytes); counts: (E,) pairs per expert.
    GPU backends only (`build` refuses the CPU).
    """
    n_expert, n_out, n_in = shape
    block_values = BLOCK_SIZES[ggml_type][0]
    blocks_per_expert = n_out * n_in // block_values
    n_units = n_expert * n_out * n_in // UNIT_VALUES
    kernel = build(KERNELS[ggml_type], current_backend())
    (y,) = kernel(
        inputs=[blocks, counts.astype(mx.uint32)],
        template=[("T", dtype), ("THREADS", THREADS), ("N_UNITS", n_units), ("BLOCKS_PER_EXPERT", blocks_per_expert)],
        grid=(-(-n_units // THREADS) * THREADS, 1, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[shape],
        output_dtypes=[dtype],
    )
    return y
