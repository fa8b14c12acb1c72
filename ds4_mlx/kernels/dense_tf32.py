"""Prefill's dense projections on CUDA tensor cores at float32 accuracy, straight from the affine weight.

dense_f16.py's float16 kernel is taken first (1.5-1.6x faster at Flash's large shapes); this 3xTF32 kernel is
`batch_matmul`'s next choice where that one's check fails, and the probe and reference both kernels are checked
against live here.

`batch.batch_matmul` on CUDA dequantized each affine weight (Q8_0 / Q4_K, w = scale * q + bias per group of 32)
into a float32 copy and ran cuBLAS's float32 SIMT GEMM (TF32 is off: README, MLX_ENABLE_TF32): ~70 ms of a 4-layer
2048-token chunk on the H200. This kernel reads the packed quants, scales and biases themselves, one launch:
y = x @ W.T for x (..., T, IN) float32 and W (OUT, IN), or a batch x (G, T, IN) against W (G, OUT, IN).

- Exact quants: a group's 32 values of one W row are scale * q + bias, and q - CENTER (CENTER = 2^(bits-1): -128..127
  for 8 bits) is an integer of at most 8 bits, exact in TF32. So over one 32-wide K slice (one group)
  sum_k x_k w_k = scale * sum_k x_k (q_k - CENTER) + c * sum_k x_k, with c = bias + CENTER * scale (exactly 0 for
  Q8_0, whose bias is -128 * scale). The tensor cores multiply x by the centred quants, with x split as in
  grouped_tf32.py (x = hi + lo, hi = tf32(x), lo = tf32(x - hi): `ds4_tf32_split`): lo q + hi q, two
  mma.m16n8k8 per product (`ds4_mma_tf32_16x8x8`). This is 3xTF32 whose W low part is zero: nothing of W is
  rounded, and only x's residue (~2^-21 relative) is dropped. The row sums of x come from the same fragments.
- Drain per slice: the tensor cores truncate the sums they accumulate, so each slice is multiplied into zeroed
  partial sums, and the float32 accumulators take acc = fma(scale, part, acc), then fma(c, rowsum, acc), rounded to
  nearest: the scale of the slice's group is applied there, once per (row, column, slice).
- Tiles: a threadgroup is 8 warps over TM x TN = 128 x 128 outputs, warp w the 32 x 64 block at rows 32 (w / 2),
  columns 64 (w % 2) (2 x 8 mma tiles of 16 x 8: 64 accumulators and 64 partial sums per thread; its x fragments,
  the split ones, are read by 2 warps, its quant fragments by 4). The K loop stages one group (TK = 32) of the x rows
  (coalesced rows of 128 bytes) and of the W rows: each thread reads whole uint32 words of quants (eight threads
  a row's 32 bytes for 8 bits), writes them as centred floats, four per 16-byte store, and threads 0..127 a row's
  scale and bias as (scale, c). Rows are padded to LD = 36 floats: a fragment load (lanes g = lane / 4 on 8
  rows, t = lane % 4 on 4 columns) hits 32 distinct banks, and the 16-byte stores of 8 lanes fill all 32. The
  next group's global loads are in flight in registers while the current one is multiplied. Threadgroup memory:
  2 x 128 x 36 x 4 + 2 x 128 x 4 = 37,888 bytes (static, under 48 KB). Threadgroups take row tiles fastest, so
  the ones running together share a W column tile, and x (8 to 64 MB a chunk) stays mostly in L2.

Metal keeps the dequantize + GEMM path: this kernel calls the CUDA prelude's tensor-core helpers, so its fast path
is registered for CUDA alone; a failed first-use check leaves `batch_matmul`'s previous chain.

Cost (an estimate, not measured): Flash's dense projections are ~500 GFLOP a layer for a 2048-token chunk, 1 PFLOP
of TF32 mma work at 2 mma per product. mma.sync at 8 warps per SM with two barriers per slice, the x splits and
the per-slice drain on the FMA pipes, should reach ~35-50% of the H200's ~490 TFLOPS dense TF32: ~4-6 ms per
layer (cuBLAS float32 SIMT: ~17 ms measured), ~15-25 ms per 4-layer chunk. Small OUT (kv, 512) fills only
ceil(OUT/128) x 16 threadgroups; those projections are small. The rendered text compiled by nvcc 13.0 for sm_90
(as NVRTC gets it, MLX's own header aside): 255 / 254 registers (8 / 4 bits), no spills, 37,888 bytes of shared
memory; 255 registers x 256 threads is one threadgroup per SM, exactly the register file.
"""

from __future__ import annotations

import mlx.core as mx

from ..model.gguf import GGMLType
from .affine import GROUP_SIZE, AffineWeight, to_affine
from .dialect import Kernel, build
from .probe import random_activations, random_blocks
from .quants import dequantize, reference_matmul
from .registry import FastPath, current_backend

TM = 128
"""Rows of x (tokens) per threadgroup."""
TN = 128
"""Rows of W (outputs) per threadgroup."""
TK = GROUP_SIZE
"""K slice per step: one affine group, so that one scale and one c apply to it."""
LD = TK + 4
"""Threadgroup row stride in floats: 36 = 4 mod 32 spreads a fragment load's 8 rows x 4 columns over 32 banks."""
THREADS = 256
"""8 warps: at most 255 registers a thread fit in one SM's 64K, whatever the compiler allocates."""
TOLERANCE = 1e-5
"""batch.TOLERANCE's value (batch imports this module): float32 reassociation, 1e-5 of the largest output."""

_SOURCE = """
const int tid = THREAD_IN_GROUP;
const int n_rows = dims[0];
const int n_out = dims[1];
const int n_in = dims[2];
const int col_tiles = dims[3];
const int row0 = GROUP_X * TM;
const int batch = GROUP_Y / col_tiles;
const int col0 = (GROUP_Y - batch * col_tiles) * TN;
const int rows = n_rows - row0;
SHARED float xs[TM * LD];
SHARED float4 ws4[TN * LD / 4];
SHARED float sc[TN];
SHARED float cc[TN];
SHARED_MEM float* ws = (SHARED_MEM float*)ws4;
const int lane = SIMD_LANE;
const int warp = SIMD_INDEX;
const int gid = lane >> 2;
const int tig = lane & 3;
const int wm = (warp >> 1) * 32;
const int wn = (warp & 1) * 64;
const int words = n_in * BITS / 32;
const int groups = n_in / TK;
const GLOBAL_MEM float* x_tile = x + ((size_t)batch * n_rows + row0) * n_in;
const GLOBAL_MEM uint32_t* q_tile = wq + ((size_t)batch * n_out + col0) * words;
const GLOBAL_MEM float* s_tile = scales + ((size_t)batch * n_out + col0) * groups;
const GLOBAL_MEM float* b_tile = biases + ((size_t)batch * n_out + col0) * groups;
constexpr int VPW = 32 / BITS;
constexpr int XL = TM * TK / THREADS;
constexpr int WL = TN * BITS / THREADS;
constexpr float MAGIC = 8388608.0f + (float)(1 << (BITS - 1));
const int sk = tid % TK;
const int sr = tid / TK;
const int qw = tid % BITS;
const int qr = tid / BITS;
float xa[XL];
uint32_t wa[WL];
float sa = 0.0f;
float ba = 0.0f;
float acc[2][8][4];
#pragma unroll
for (int i = 0; i < 2; ++i) {
  #pragma unroll
  for (int j = 0; j < 8; ++j) {
    #pragma unroll
    for (int c = 0; c < 4; ++c) {
      acc[i][j][c] = 0.0f;
    }
  }
}
for (int s = 0; s <= groups; ++s) {
  if (s < groups) {
    #pragma unroll
    for (int j = 0; j < XL; ++j) {
      const int r = sr + j * (THREADS / TK);
      xa[j] = r < rows ? x_tile[(size_t)r * n_in + s * TK + sk] : 0.0f;
    }
    #pragma unroll
    for (int p = 0; p < WL; ++p) {
      const int r = qr + p * (THREADS / BITS);
      wa[p] = col0 + r < n_out ? q_tile[(size_t)r * words + s * BITS + qw] : 0u;
    }
    if (tid < TN) {
      const bool ok = col0 + tid < n_out;
      sa = ok ? s_tile[(size_t)tid * groups + s] : 0.0f;
      ba = ok ? b_tile[(size_t)tid * groups + s] : 0.0f;
    }
  }
  if (s > 0) {
    float part[2][8][4];
    float rowsum[2][2];
    #pragma unroll
    for (int i = 0; i < 2; ++i) {
      rowsum[i][0] = 0.0f;
      rowsum[i][1] = 0.0f;
      #pragma unroll
      for (int j = 0; j < 8; ++j) {
        #pragma unroll
        for (int c = 0; c < 4; ++c) {
          part[i][j][c] = 0.0f;
        }
      }
    }
    #pragma unroll
    for (int k0 = 0; k0 < TK; k0 += 8) {
      unsigned int bq[8][2];
      #pragma unroll
      for (int j = 0; j < 8; ++j) {
        const SHARED_MEM float* b = ws + (wn + 8 * j + gid) * LD + k0 + tig;
        bq[j][0] = ds4_bits(b[0]);
        bq[j][1] = ds4_bits(b[4]);
      }
      #pragma unroll
      for (int i = 0; i < 2; ++i) {
        const SHARED_MEM float* a = xs + (wm + 16 * i + gid) * LD + k0 + tig;
        const float a0 = a[0];
        const float a1 = a[8 * LD];
        const float a2 = a[4];
        const float a3 = a[8 * LD + 4];
        rowsum[i][0] += a0 + a2;
        rowsum[i][1] += a1 + a3;
        unsigned int ah[4];
        unsigned int al[4];
        ds4_tf32_split(a0, ah[0], al[0]);
        ds4_tf32_split(a1, ah[1], al[1]);
        ds4_tf32_split(a2, ah[2], al[2]);
        ds4_tf32_split(a3, ah[3], al[3]);
        #pragma unroll
        for (int j = 0; j < 8; ++j) {
          ds4_mma_tf32_16x8x8(part[i][j], al, bq[j]);
          ds4_mma_tf32_16x8x8(part[i][j], ah, bq[j]);
        }
      }
    }
    #pragma unroll
    for (int i = 0; i < 2; ++i) {
      #pragma unroll
      for (int h = 0; h < 2; ++h) {
        rowsum[i][h] += ds4_simd_xor(rowsum[i][h], 1);
        rowsum[i][h] += ds4_simd_xor(rowsum[i][h], 2);
      }
    }
    #pragma unroll
    for (int j = 0; j < 8; ++j) {
      #pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int n = wn + 8 * j + 2 * tig + e;
        const float scale = sc[n];
        const float c = cc[n];
        #pragma unroll
        for (int i = 0; i < 2; ++i) {
          #pragma unroll
          for (int h = 0; h < 2; ++h) {
            float v = fmaf(scale, part[i][j][2 * h + e], acc[i][j][2 * h + e]);
            acc[i][j][2 * h + e] = fmaf(c, rowsum[i][h], v);
          }
        }
      }
    }
  }
  ds4_barrier();
  if (s < groups) {
    #pragma unroll
    for (int j = 0; j < XL; ++j) {
      xs[(sr + j * (THREADS / TK)) * LD + sk] = xa[j];
    }
    #pragma unroll
    for (int p = 0; p < WL; ++p) {
      const int base = ((qr + p * (THREADS / BITS)) * LD + qw * VPW) / 4;
      #pragma unroll
      for (int v = 0; v < VPW / 4; ++v) {
        float q[4];
        #pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int at = 4 * v + e;
          q[e] = (BITS == 8 ? ds4_magic_byte(wa[p], at)
                            : ds4_float(0x4B000000u | ((wa[p] >> (BITS * at)) & ((1u << BITS) - 1u)))) - MAGIC;
        }
        float4 f;
        f.x = q[0];
        f.y = q[1];
        f.z = q[2];
        f.w = q[3];
        ws4[base + v] = f;
      }
    }
    if (tid < TN) {
      sc[tid] = sa;
      cc[tid] = ba + sa * (float)(1 << (BITS - 1));
    }
  }
  ds4_barrier();
}
#pragma unroll
for (int i = 0; i < 2; ++i) {
  #pragma unroll
  for (int j = 0; j < 8; ++j) {
    #pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int r = wm + 16 * i + gid + 8 * (c >> 1);
      const int n = col0 + wn + 8 * j + 2 * tig + (c & 1);
      if (r < rows && n < n_out) {
        y[((size_t)batch * n_rows + row0 + r) * n_out + n] = acc[i][j][c];
      }
    }
  }
}
"""
"""Step s loads group s into registers, multiplies group s - 1 (in threadgroup memory) into `part` and the x row
sums into `rowsum`, drains both into `acc` with the group's (scale, c), then stores group s once every warp is past
the multiply. The mma tile (i, j) of a warp is rows wm + 16 i.. and columns wn + 8 j..: A = the x rows (k along
columns), B[k][n] = the centred quant of W row n at k, so a's elements are x at (row g, g + 8; k t, t + 4), b's the
quants at (row g; k t, t + 4), and accumulator c holds (row g, g + 8; column 2t, 2t + 1). A lane's row sums cover
k = t, t + 4 of each k step; the xor over lanes 1 and 2 (the 4 lanes of a row group) completes them over the group.
The quants are exact small integers as floats, so their bits are already TF32. Rows past T read as zeros, W rows
past OUT as zero quants with scale and c 0; every lane of every warp takes part in every mma and shuffle."""

KERNEL = Kernel("ds4_dense_affine_tf32", ("x", "wq", "scales", "biases", "dims"), ("y",), _SOURCE)
"""CUDA only: it calls the tensor-core helpers of the CUDA prelude."""


def tf32_affine_matmul(x: mx.array, weight: AffineWeight) -> mx.array:
    """x @ W.T as float32 for an affine W (OUT, IN) and x (..., IN), or W (G, OUT, IN) and x (G, T, IN); IN a
    multiple of 32 (the affine layout's). CUDA only."""
    n_out, n_in = weight.shape[-2:]
    if weight.wq.ndim == 2:
        lead, n_batch = x.shape[:-1], 1
        x = x.reshape(-1, n_in)
    else:
        lead, n_batch = x.shape[:-1], weight.wq.shape[0]
    n_rows = x.size // (n_batch * n_in)
    if n_rows == 0:
        return mx.zeros((*lead, n_out), dtype=mx.float32)
    col_tiles = -(-n_out // TN)
    (y,) = build(KERNEL, current_backend())(
        inputs=[_float32(x), weight.wq, _float32(weight.scales), _float32(weight.biases),
                mx.array([n_rows, n_out, n_in, col_tiles], dtype=mx.int32)],
        template=[("TM", TM), ("TN", TN), ("TK", TK), ("LD", LD), ("THREADS", THREADS), ("BITS", weight.bits)],
        grid=(-(-n_rows // TM) * THREADS, col_tiles * n_batch, 1), threadgroup=(THREADS, 1, 1),
        output_shapes=[(n_batch * n_rows, n_out)], output_dtypes=[mx.float32],
    )
    return y.reshape(*lead, n_out)


def _float32(a: mx.array) -> mx.array:
    return a if a.dtype == mx.float32 else a.astype(mx.float32)


def fits(x: mx.array, weight: AffineWeight) -> bool:
    """Whether the kernel takes this product: float32-class x, and a 2-D W or a batch of W with a batch of x."""
    if weight.wq.ndim == 2:
        return x.ndim >= 1
    return weight.wq.ndim == 3 and x.ndim == 3 and x.shape[0] == weight.wq.shape[0]


PROBE_SHAPE, PROBE_ROWS = (200, 512), 150
"""Two column tiles (the second partial) and two row tiles (the second partial) of a 512-wide W."""
PROBE_BANK, PROBE_BANK_ROWS = (3, 40, 256), 19
"""A batch of 3 matrices against 3 batches of rows, as the grouped output projection multiplies them."""


def _probe(ggml_type: GGMLType) -> tuple:
    blocks = random_blocks(ggml_type, *PROBE_SHAPE, seed=31)
    bank = random_blocks(ggml_type, PROBE_BANK[0] * PROBE_BANK[1], PROBE_BANK[2], seed=32)
    x = random_activations((PROBE_ROWS, PROBE_SHAPE[1]), seed=33)
    xb = random_activations((PROBE_BANK[0], PROBE_BANK_ROWS, PROBE_BANK[2]), seed=34)
    return ggml_type, blocks, x, bank, xb


def _reference(ggml_type, blocks, x, bank, xb) -> tuple[mx.array, mx.array]:
    w = dequantize(bank, ggml_type, PROBE_BANK)
    return reference_matmul(x, blocks, ggml_type, PROBE_SHAPE), xb @ mx.swapaxes(w, 1, 2)


def _fast(ggml_type, blocks, x, bank, xb) -> tuple[mx.array, mx.array]:
    return (tf32_affine_matmul(x, to_affine(blocks, ggml_type, PROBE_SHAPE)),
            tf32_affine_matmul(xb, to_affine(bank, ggml_type, PROBE_BANK)))


DENSE_TF32 = FastPath("dense_affine_3xtf32", _reference, _fast, _probe, tolerance=TOLERANCE, backends=("cuda",))
"""Q8_0 / Q4_K projections of a prefill batch on the tensor cores; key: the ggml type (BITS names the two). The
bound is batch.py's float32 one, 1e-5 of the largest output: x's split leaves ~2^-21 relative per product with
random signs and W is exact, ~1e-6 of the largest output over a K of 4096; plain TF32 x (one mma, ~2^-11 per
operand) lands near 3e-4 there and fails it (tests/test_kernels_dense_tf32.py shows both in emulation)."""
