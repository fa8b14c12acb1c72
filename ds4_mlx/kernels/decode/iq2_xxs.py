"""IQ2_XXS dequant-matvec kernel (the q2 files' routed gate and up experts).

A 66-byte block holds 256 values: d (f16), then eight 8-byte sub-blocks of 32 values. A sub-block is four grid
indices (one byte each, 8 values each) and a u32 `aux`: the sub-block scale is d * (0.5 + (aux >> 28)) * 0.25,
and 7-bit fields of aux (shifts 0, 7, 14, 21) give each group of 8 values its signs; the eighth sign bit is the
parity of the other seven (ggml's ksigns table is exactly i | parity(i) << 7). Grid values are 8, 25 or 43; the
kernel keeps ggml's 256-entry grid as 2-bit codes (c = 0, 1, 2 -> 8 + 17c + (c >> 1)) in a 512-byte table that
each threadgroup copies into threadgroup memory. One unit is one sub-block: 32 values.

`reference_matmul` / `gathered_reference` over `quants.dequantize_iq2_xxs` is what this kernel must equal.
"""

from __future__ import annotations

import numpy as np
from gguf.quants import IQ2_XXS

from ...model.gguf import GGMLType
from .matvec import QuantMatvec, matvec_kernel

_MAGNITUDE_CODES = {8.0: 0, 25.0: 1, 43.0: 2}


def grid_codes() -> list[int]:
    """ggml's iq2xxs_grid as 16-bit words: 2 bits per value, value j in bits 2j..2j+1 (8 -> 0, 25 -> 1, 43 -> 2)."""
    IQ2_XXS.init_grid()
    grid = np.asarray(IQ2_XXS.grid).reshape(256, 8)
    return [sum(_MAGNITUDE_CODES[float(v)] << (2 * j) for j, v in enumerate(row)) for row in grid]


_HEADER = "CONSTANT unsigned short ds4_iq2xxs_grid[256] = {" + ", ".join(map(str, grid_codes())) + "};\n"

_SETUP = """
SHARED unsigned short grid[256];
for (int i = THREAD_IN_GROUP; i < 256; i += SIMDS * 32) {
  grid[i] = ds4_iq2xxs_grid[i];
}
ds4_barrier();
"""

_UNIT = """
  const int block = u >> 3;
  const int sub = u & 7;
  float xv[32];
  const GLOBAL_MEM float4* xp = reinterpret_cast<const GLOBAL_MEM float4*>(xs + u * 32);
  for (int i = 0; i < 8; ++i) {
    const float4 v = xp[i];
    xv[4 * i] = v.x;
    xv[4 * i + 1] = v.y;
    xv[4 * i + 2] = v.z;
    xv[4 * i + 3] = v.w;
  }
  for (int r = 0; r < ROWS; ++r) {
    if (r < n_rows) {
      const SHARED_MEM unsigned char* b = rows + r * ROW_BYTES + block * 66;
      const float d = ds4_half_to_float((unsigned short)(b[0] | (b[1] << 8)));
      const SHARED_MEM unsigned char* q = b + 2 + sub * 8;
      const unsigned int aux = (unsigned int)q[4] | ((unsigned int)q[5] << 8) | ((unsigned int)q[6] << 16)
          | ((unsigned int)q[7] << 24);
      float sum = 0.0f;
      for (int g = 0; g < 4; ++g) {
        const unsigned int codes = grid[q[g]];
        const unsigned int low = (aux >> (7 * g)) & 127u;
        const unsigned int signs = low | ((ds4_popcount(low) & 1u) << 7);
        for (int j = 0; j < 8; ++j) {
          const unsigned int c = (codes >> (2 * j)) & 3u;
          const float magnitude = (float)(8u + 17u * c + (c >> 1));
          sum += ((signs >> j) & 1u ? -magnitude : magnitude) * xv[8 * g + j];
        }
      }
      acc[r] += d * (0.5f + (float)(aux >> 28)) * 0.25f * sum;
    }
  }
"""

IQ2_XXS_MATVEC = QuantMatvec(
    GGMLType.IQ2_XXS,
    unit_values=32,
    kernel=matvec_kernel("ds4_iq2_xxs_matvec", _UNIT, setup=_SETUP, header=_HEADER),
)
"""x[k] @ W[ids[k]].T over IQ2_XXS blocks on CUDA and Metal; the reference elsewhere or if its check fails."""
