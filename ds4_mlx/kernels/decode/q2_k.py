"""Q2_K dequant-matvec kernel (the q2 files' routed down experts).

An 84-byte block holds 256 values: scales[16] (u8), qs[64] (u8), d (f16, byte 80), dmin (f16, byte 82). Each half
h of 128 values reads 32 bytes of qs four times, two bits at a time (shift 2j, j = 0..3), so value
128h + 32j + l has quant (qs[32h + l] >> 2j) & 3; every run of 16 values has its own 4-bit scale (low nibble of
scales[8h + 2j + l / 16]) and 4-bit min (high nibble): y = d * scale * q - dmin * min.

One unit is the 16 qs bytes qs[32h + 16t .. 32h + 16t + 15] (t = 0, 1) and the 64 values they hold: four runs of 16
with scale indices 8h + 2j + t. Per run the unit forms sum(q * x) and sum(x), so y . x = d * scale * sum(q x) -
dmin * min * sum(x): two multiply-adds per value. IN = 2048 (Flash's n_ff_exp) is 32 units: one per lane.

Q2_K has no exact MLX affine form (kernels/formats/affine.py says why), so this kernel is its only fast path.
"""

from __future__ import annotations

from ...model.gguf import GGMLType
from .matvec import QuantMatvec, matvec_kernel

_UNIT = """
  const int block = u >> 2;
  const int h = (u >> 1) & 1;
  const int t = u & 1;
  float xv[64];
  const GLOBAL_MEM float* xu = xs + block * 256 + 128 * h + 16 * t;
  for (int j = 0; j < 4; ++j) {
    const GLOBAL_MEM float4* xp = reinterpret_cast<const GLOBAL_MEM float4*>(xu + 32 * j);
    for (int i = 0; i < 4; ++i) {
      const float4 v = xp[i];
      xv[16 * j + 4 * i] = v.x;
      xv[16 * j + 4 * i + 1] = v.y;
      xv[16 * j + 4 * i + 2] = v.z;
      xv[16 * j + 4 * i + 3] = v.w;
    }
  }
  float xsum[4];
  for (int j = 0; j < 4; ++j) {
    float s = 0.0f;
    for (int l = 0; l < 16; ++l) {
      s += xv[16 * j + l];
    }
    xsum[j] = s;
  }
  for (int r = 0; r < ROWS; ++r) {
    if (r < n_rows) {
      const SHARED_MEM unsigned char* b = rows + r * ROW_BYTES + block * 84;
      const float d = ds4_half_to_float((unsigned short)(b[80] | (b[81] << 8)));
      const float dmin = ds4_half_to_float((unsigned short)(b[82] | (b[83] << 8)));
      const SHARED_MEM unsigned char* qs = b + 16 + 32 * h + 16 * t;
      float sum = 0.0f;
      for (int j = 0; j < 4; ++j) {
        const unsigned int sc = b[8 * h + 2 * j + t];
        float dot = 0.0f;
        for (int l = 0; l < 16; ++l) {
          dot += (float)((qs[l] >> (2 * j)) & 3) * xv[16 * j + l];
        }
        sum += d * (float)(sc & 15u) * dot - dmin * (float)(sc >> 4) * xsum[j];
      }
      acc[r] += sum;
    }
  }
"""

Q2_K_MATVEC = QuantMatvec(GGMLType.Q2_K, unit_values=64, kernel=matvec_kernel("ds4_q2_k_matvec", _UNIT))
"""x[k] @ W[ids[k]].T over Q2_K blocks on CUDA and Metal; the reference elsewhere or if its check fails."""
