"""Dequantize the used experts of a raw IQ2_XXS or Q2_K bank into a float scratch, for prefill's grouped GEMMs.

A prefill chunk routes thousands of (token, expert) pairs, so every expert of a layer is read by tens of tokens:
decoding its blocks once into float32 (or bfloat16) and handing the result to one grouped GEMM
(`mx.gather_mm`, kernels/prefill/grouped.py) moves the work onto the matmul units instead of re-decoding per token.

One SIMD group (32 threads) decodes one 256-value block: in step i (0..7) lane l writes value 32 i + l, so every
store of the group covers 32 consecutive values (128 contiguous bytes in float32) and the group reads the block's
few bytes together. Experts whose count is 0 (no pair of the chunk uses them) are skipped and their part of the
output is left unwritten: the grouped GEMM never reads it, and the count input also ties the scratch to this
layer's routing.

Each value is computed with the reference dequantizer's float32 operations in the same order (`quants.py`), so
the two agree up to the one rounding a compiler may skip by contracting a multiply and a subtract (Q2_K's
dl * q - ml) into a fused multiply-add: DEQUANT_TOLERANCE.
"""

from __future__ import annotations

import mlx.core as mx

from ...model.gguf import BLOCK_SIZES, GGMLType
from ..machinery.dialect import SIMD_WIDTH, Kernel, build
from ..decode.iq2_xxs import grid_codes
from ..machinery.registry import current_backend

THREADS = 256
DEQUANT_TOLERANCE = 1e-6
"""Relative to the bank's largest value: a contracted multiply-add rounds once where the reference rounds twice."""

_PROLOGUE = """
const size_t block = ((size_t)GROUP_X * THREADS + THREAD_IN_GROUP) >> 5;
const unsigned int lane = SIMD_LANE;
const bool live = block < (size_t)N_BLOCKS && counts[block / BLOCKS_PER_EXPERT] != 0u;
GLOBAL_MEM T* out = y + block * 256;
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
  const unsigned int g = lane >> 3;
  const unsigned int j = lane & 7u;
  for (int i = 0; i < 8; ++i) {
    const GLOBAL_MEM unsigned char* q = b + 2 + i * 8;
    const unsigned int aux = (unsigned int)q[4] | ((unsigned int)q[5] << 8) | ((unsigned int)q[6] << 16)
        | ((unsigned int)q[7] << 24);
    const float db = d * (0.5f + (float)(aux >> 28)) * 0.25f;
    const unsigned int low = (aux >> (7 * g)) & 127u;
    const unsigned int signs = low | ((ds4_popcount(low) & 1u) << 7);
    const unsigned int c = ((unsigned int)grid[q[g]] >> (2 * j)) & 3u;
    const float value = db * (float)(8u + 17u * c + (c >> 1));
    out[32 * i + lane] = static_cast<T>((signs >> j) & 1u ? -value : value);
  }
}
"""

_Q2_K = """
if (live) {
  const GLOBAL_MEM unsigned char* b = w + block * 84;
  const float d = ds4_half_to_float((unsigned short)(b[80] | (b[81] << 8)));
  const float dmin = ds4_half_to_float((unsigned short)(b[82] | (b[83] << 8)));
  for (int i = 0; i < 8; ++i) {
    const unsigned int h = i >> 2;
    const unsigned int shift = 2 * (i & 3);
    const unsigned int sc = b[8 * h + 2 * (i & 3) + (lane >> 4)];
    const float dl = d * (float)(sc & 15u);
    const float ml = dmin * (float)(sc >> 4);
    out[32 * i + lane] = static_cast<T>(dl * (float)((b[16 + 32 * h + lane] >> shift) & 3u) - ml);
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
    n_blocks = n_expert * blocks_per_expert
    kernel = build(KERNELS[ggml_type], current_backend())
    (y,) = kernel(
        inputs=[blocks, counts.astype(mx.uint32)],
        template=[("T", dtype), ("THREADS", THREADS), ("N_BLOCKS", n_blocks), ("BLOCKS_PER_EXPERT", blocks_per_expert)],
        grid=(-(-n_blocks * SIMD_WIDTH // THREADS) * THREADS, 1, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[shape],
        output_dtypes=[dtype],
    )
    return y
