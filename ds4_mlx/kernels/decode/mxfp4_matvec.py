"""MXFP4 dequant-matvec kernel over raw GGUF blocks (0731's MXFP4 routed experts on GPU backends).

A 17-byte block holds 32 values: an E8M0 scale byte e (d = 2^(e - 127), built as float bits e << 23, e = 0 as
2^-127, as ggml and quants.dequantize_mxfp4 build it), then 16 code bytes: value j is the low nibble of byte j and
value j + 16 its high nibble, each an E2M1 code. One unit is one block. Its codes are looked up in a threadgroup
table of the doubled E2M1 values (0, 1, 2, 3, 4, 6, 8, 12 and their negatives: integers, so each product with an
activation rounds as the reference's d * E2M1 * x does) and the block's dot product is scaled once by d / 2, a power
of two: exact, so the kernel differs from the reference (dequantize, then matmul) by float32 summation order only.

The unit is spliced into matvec.py's skeleton (rows staged in threadgroup memory, a lane per unit); the fused expert
kernels (experts.py) read the same blocks through MXFP4_UNIT, with the same table and scale. Blocks start at odd
byte offsets, so codes are read a byte at a time from threadgroup memory.
"""

from __future__ import annotations

from ...model.gguf import GGMLType
from ..formats.quants import E2M1
from .matvec import QuantMatvec, matvec_kernel

E2M1_HEADER = ("CONSTANT float ds4_mxfp4_e2m1x2[16] = {" + ", ".join(f"{2 * v:.1f}f" for v in E2M1) + "};\n")
"""The doubled E2M1 values by code, a program-scope table each threadgroup copies into threadgroup memory."""

E2M1_SETUP = """
SHARED float e2m1x2[16];
for (int i = THREAD_IN_GROUP; i < 16; i += SIMDS * 32) {
  e2m1x2[i] = ds4_mxfp4_e2m1x2[i];
}
"""



def half_scale(byte: str) -> str:
    """The expression d / 2 for a block whose scale byte is the unsigned int `byte`: it halves the doubled table's
    values back."""
    return f"(0.5f * ds4_float({byte} == 0u ? 0x00400000u : {byte} << 23))"


_UNIT = """
  const GLOBAL_MEM float4* xp = reinterpret_cast<const GLOBAL_MEM float4*>(xs + u * 32);
  float xv[32];
  for (int i = 0; i < 8; ++i) {
    const float4 v = xp[i];
    xv[4 * i] = v.x;
    xv[4 * i + 1] = v.y;
    xv[4 * i + 2] = v.z;
    xv[4 * i + 3] = v.w;
  }
  for (int r = 0; r < ROWS; ++r) {
    if (r < n_rows) {
      const SHARED_MEM unsigned char* b = rows + r * ROW_BYTES + u * 17;
      float dot = 0.0f;
      for (int l = 0; l < 16; ++l) {
        const unsigned int q = b[1 + l];
        dot += e2m1x2[q & 15u] * xv[l] + e2m1x2[q >> 4] * xv[l + 16];
      }
      const unsigned int scale_byte = b[0];
      acc[r] += HALF_SCALE * dot;
    }
  }
""".replace("HALF_SCALE", half_scale("scale_byte"))

MXFP4_MATVEC = QuantMatvec(GGMLType.MXFP4, unit_values=32, kernel=matvec_kernel(
    "ds4_mxfp4_matvec", _UNIT, setup=E2M1_SETUP + "ds4_barrier();\n", header=E2M1_HEADER))
"""x[k] @ W[ids[k]].T over MXFP4 blocks on CUDA and Metal; the reference elsewhere or if its check fails."""
