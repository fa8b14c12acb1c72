"""Prefill's dense projections on CUDA float16 tensor cores at float32 accuracy, straight from the affine weight.

`batch.batch_matmul` on CUDA dequantized each affine weight (Q8_0 / Q4_K, w = scale * q + bias per group of 32) into
a float32 copy and ran cuBLAS's float32 SIMT GEMM (~70 ms of a 4-layer 2048-token chunk on the H200). This kernel
reads the packed quants, scales and biases themselves, one launch: y = x @ W.T for x (..., T, IN) float32 and W
(OUT, IN), or a batch x (G, T, IN) against W (G, OUT, IN).

- Exact quants: a group's 32 values of one W row are scale * (q - CENTER) + c (CENTER = 2^(bits-1), c = bias +
  CENTER * scale, exactly 0 for Q8_0, whose bias is -128 * scale), and q - CENTER (-128..127, or -8..7) is an exact
  half. The tile holds the centred quants; per group, sum_k x_k w_k = scale * sum_k x_k (q_k - CENTER) + c * sum_k
  x_k, the row sums of x from the tensor cores (a B of ones; Q4_K only), applied as the group's partial sums are
  drained into the float32 accumulators (the tensor cores truncate the sums they accumulate: each group starts from
  zeroed partial sums, added to the accumulators rounded to nearest);
- x is scaled per row by a power of two and split into two halves (halfsplit.split_blocks, once before the GEMM, in
  the fragment layout: each 16-byte word one lane's mma A fragment): each product takes 2 mma.m16n8k16 (lo, then
  hi), ~2^-22 relative dropped per product, 3xTF32's class (~2^-21). The store undoes the row scale exactly;
- tiles: a threadgroup is 8 warps over TM x TN = 128 x 128 outputs, warp w the 32 x 64 block at rows 32 (w / 2),
  columns 64 (w % 2). Each stage is one group (TK = 32) of the x rows (the tile's eight 16-row blocks of hi and
  of lo fragments, 1 KB each as split_blocks wrote them) and of the W rows (the packed quant words as stored, and
  the group's scales), copied into threadgroup memory by cp.async STAGES - 1 groups ahead of the multiply, with
  one barrier a stage. The quants are made halves in registers as the fragments are read, so the copies never pass
  through registers. A lane's mma fragments carry a permutation of K inside each 16-wide step (the same for x and
  W), so that a lane reads one 16-byte word of x per fragment (the four registers mma takes, as loaded: no moves)
  and a W row as 4, 8 or 16 bytes, conflict-free with unpadded rows. The mma of a step go lo pass, then hi pass,
  each over the 16 tiles of the warp, so that no mma waits on the one just before it. Threadgroups take row tiles
  fastest, so the ones running together share a W column tile, and x stays mostly in L2. 222-226 registers (nvcc
  13, sm_90): one threadgroup an SM.

Measured (H200, 4096 rows, bench/prefill_gemms.py), against the 3xTF32 kernel this replaced (TF32 mma.m16n8k8, x
split at every fragment read): q_a 0.66 / 0.88 ms, q_b 3.84 / 5.80, out_b 3.47 / 5.72 (79 TFLOP/s), the shared
expert's gate 1.12 / 1.57. With x split before the GEMM (2026-12-02, another machine): q_a 0.74, q_b 3.63 (was 4.01
there), out_b 3.52 (3.63), shared gate 1.10 (1.32). Staged through registers one group ahead (2026-12-03): q_a
0.64, q_b 3.50, out_b 3.38, shared gate 1.05; by cp.async 2 / 3 / 4 stages deep, mma in the order written then:
q_b 3.51 / 3.62 / 3.56, out_b 3.39 / 3.54 / 3.41, so the loads were never what held it. Nsight Compute (2026-12-03)
showed what did: 10.5 instructions issued per mma, 4.3 of them register moves gathering each A fragment from two
row-major x rows; with x in the fragment layout 6.5, and q_b 2.77, out_b 2.83, q_a 0.555, shared gate 0.95.

BITS = 16 is the same kernel for an F16 matrix (`half_matmul`: the compressor, indexer and router projections of
a chunk, which took cuBLAS's float32 SIMT GEMM, ~5% of a chunk's GPU time): its values are halves already, staged
as they are, with no scale (the partial sums are added as they are) and no offset. Measured: an 8192 x 1024 matrix
1.19 ms against cuBLAS's 1.54 (512 x 4096: 0.48 both, one wave of threadgroups).

Metal keeps the dequantize + GEMM path (the tensor-core helpers exist in the CUDA prelude only); a failed first-use
check leaves `batch_matmul`'s next choice.
"""

from __future__ import annotations

from functools import cache

import mlx.core as mx
import numpy as np

from ...model.gguf import GGMLType
from ..formats.affine import GROUP_SIZE, AffineWeight, to_affine
from ..machinery.dialect import Kernel, build
from .halfsplit import BLOCK_ROWS, held_split
from ..machinery.probe import random_activations, random_blocks
from ..formats.quants import dequantize, reference_matmul
from ..machinery.registry import FastPath, current_backend

TM = 128
"""Rows of x (tokens) per threadgroup."""
TN = 128
"""Rows of W (outputs) per threadgroup."""
TK = GROUP_SIZE
"""K slice per stage: one affine group (two mma k-steps of 16), so that one scale and one c apply to it."""
STAGES = 2
"""Stages in flight: the copies of the next group land while one is multiplied. Deeper was no faster (H200,
bench/prefill_gemms.py, 2026-12-03: q_b 3.48 / 3.53 / 3.54 ms at 2 / 3 / 4 stages, out_b 3.35 / 3.50 / 3.46)."""
THREADS = 256
"""8 warps."""
TOLERANCE = 1e-5
"""batch.TOLERANCE's value (batch imports this module): float32 reassociation, 1e-5 of the largest output."""


def stage_words(bits: int) -> int:
    """32-bit words of threadgroup memory a stage holds: x hi and lo (TM rows of TK / 2 words each), the quants
    (TN rows of TK * bits / 32 words), and the group's scales (and Q4_K's biases), TN floats each."""
    return TM * TK + TN * TK * bits // 32 + {16: 0, 8: TN, 4: 2 * TN}[bits]


TILE = """
const int tid = THREAD_IN_GROUP;
const int n_rows = dims[0];
const int n_out = dims[1];
const int n_in = dims[2];
const int col_tiles = dims[3];
const int row0 = GROUP_X * TM;
const int batch = GROUP_Y / col_tiles;
const int col0 = (GROUP_Y - batch * col_tiles) * TN;
const int rows = n_rows - row0;
SHARED float rsx[TM];
SHARED_MEM unsigned int* buffer = reinterpret_cast<SHARED_MEM unsigned int*>(ds4_shared);
const int lane = SIMD_LANE;
const int warp = SIMD_INDEX;
const int gid = lane >> 2;
const int tig = lane & 3;
"""
"""The dense GEMMs' first lines (this kernel's and dense_wgmma.py's): dims (T, OUT, IN, column tiles), threadgroup
(x, y) the row tile x and the column tile y of batch y / column tiles; `rows` of the tile's TM are real; x's row
scales (rsx), the dynamic stage buffers, the lane's mma fragment coordinates (gid, tig)."""

_SOURCE = TILE + """
const int blocks = dims[4];
constexpr int XW = TM * TK / 2;
constexpr int WW = TN * TK * BITS / 32;
constexpr int XB = TM / 16;
constexpr int WC = TK * BITS / 128;
const int wm = (warp >> 1) * 32;
const int wn = (warp & 1) * 64;
const int words = n_in * BITS / 32;
const int groups = n_in / TK;
const size_t x_tile = ((size_t)batch * blocks + GROUP_X * XB) * groups * 64;
const GLOBAL_MEM uint32_t* q_tile = wq + ((size_t)batch * n_out + col0) * words;
const GLOBAL_MEM float* s_tile = scales + ((size_t)batch * n_out + col0) * groups;
const GLOBAL_MEM float* b_tile = biases + ((size_t)batch * n_out + col0) * groups;
if (tid < TM) {
  rsx[tid] = tid < rows ? xscale[(size_t)batch * n_rows + row0 + tid] : 0.0f;
}
auto load_stage = [&](int s) {
  SHARED_MEM unsigned int* st = buffer + (s % STAGES) * STAGE;
  #pragma unroll
  for (int c = tid; c < XB * 64; c += THREADS) {
    const bool ok = GROUP_X * XB + c / 64 < blocks;
    const size_t at = 4 * (x_tile + ((size_t)(ok ? c / 64 : 0) * groups + s) * 64 + c % 64);
    ds4_copy16_async(reinterpret_cast<SHARED_MEM float*>(st + 4 * c), reinterpret_cast<const GLOBAL_MEM float*>(xhi + at),
                     ok);
    ds4_copy16_async(reinterpret_cast<SHARED_MEM float*>(st + XW + 4 * c),
                     reinterpret_cast<const GLOBAL_MEM float*>(xlo + at), ok);
  }
  #pragma unroll
  for (int c = tid; c < TN * WC; c += THREADS) {
    const int n = c / WC;
    const bool ok = col0 + n < n_out;
    ds4_copy16_async(reinterpret_cast<SHARED_MEM float*>(st + 2 * XW + 4 * c),
                     reinterpret_cast<const GLOBAL_MEM float*>(q_tile + (size_t)(ok ? n : 0) * words
                                                                + s * (TK * BITS / 32) + 4 * (c % WC)), ok);
  }
  if (BITS != 16 && tid < (BITS == 4 ? 2 : 1) * TN) {
    const int n = tid % TN;
    const bool ok = col0 + n < n_out;
    const GLOBAL_MEM float* src = (tid < TN ? s_tile : b_tile) + (size_t)(ok ? n : 0) * groups + s;
    ds4_copy4_async(reinterpret_cast<SHARED_MEM float*>(st + 2 * XW + WW + tid), src, ok);
  }
};
#pragma unroll
for (int s = 0; s < STAGES - 1; ++s) {
  if (s < groups) {
    load_stage(s);
  }
  ds4_async_commit();
}
const unsigned int centre = BITS == 8 ? 0x64806480u : 0x64086408u;
const unsigned int ones[2] = {0x3C003C00u, 0x3C003C00u};
float acc[2][8][4] = {};
for (int s = 0; s < groups; ++s) {
  ds4_async_wait_keep<STAGES - 2>();
  ds4_barrier();
  if (s + STAGES - 1 < groups) {
    load_stage(s + STAGES - 1);
  }
  ds4_async_commit();
  const SHARED_MEM unsigned int* st = buffer + (s % STAGES) * STAGE;
  const SHARED_MEM uint4* xh4 = reinterpret_cast<const SHARED_MEM uint4*>(st);
  const SHARED_MEM uint4* xl4 = reinterpret_cast<const SHARED_MEM uint4*>(st + XW);
  const SHARED_MEM unsigned int* ws = st + 2 * XW;
  const SHARED_MEM float* sc = reinterpret_cast<const SHARED_MEM float*>(st + 2 * XW + WW);
  uint4 xv[2][2][2];
  #pragma unroll
  for (int i = 0; i < 2; ++i) {
    #pragma unroll
    for (int kk = 0; kk < 2; ++kk) {
      xv[i][kk][0] = xl4[((wm / 16 + i) * 2 + kk) * 32 + lane];
      xv[i][kk][1] = xh4[((wm / 16 + i) * 2 + kk) * 32 + lane];
    }
  }
  unsigned int wq_j[8][4];
  #pragma unroll
  for (int j = 0; j < 8; ++j) {
    const int n = wn + 8 * j + gid;
    if (BITS == 16) {
      const uint4 v = reinterpret_cast<const SHARED_MEM uint4*>(ws + n * (TK / 2))[tig];
      wq_j[j][0] = v.x;
      wq_j[j][1] = v.y;
      wq_j[j][2] = v.z;
      wq_j[j][3] = v.w;
    } else if (BITS == 8) {
      const uint2 v = reinterpret_cast<const SHARED_MEM uint2*>(ws + n * (TK / 4))[tig];
      wq_j[j][0] = v.x;
      wq_j[j][1] = v.y;
    } else {
      const unsigned int v = ws[n * (TK / 8) + tig];
      const unsigned int even = v & 0x0F0F0F0Fu;
      const unsigned int odd = (v >> 4) & 0x0F0F0F0Fu;
      wq_j[j][0] = ds4_byte_perm(even, odd, 0x5140u);
      wq_j[j][1] = ds4_byte_perm(even, odd, 0x7362u);
    }
  }
  float part[2][8][4] = {};
  float xsum[2][4] = {};
  #pragma unroll
  for (int kk = 0; kk < 2; ++kk) {
    unsigned int b[8][2];
    #pragma unroll
    for (int j = 0; j < 8; ++j) {
      if (BITS == 16) {
        b[j][0] = wq_j[j][2 * kk];
        b[j][1] = wq_j[j][2 * kk + 1];
      } else {
        b[j][0] = ds4_quant_half2(wq_j[j][kk], 0x4140u, centre);
        b[j][1] = ds4_quant_half2(wq_j[j][kk], 0x4342u, centre);
      }
    }
    #pragma unroll
    for (int half = 0; half < 2; ++half) {
      #pragma unroll
      for (int i = 0; i < 2; ++i) {
        const unsigned int a[4] = {xv[i][kk][half].x, xv[i][kk][half].y, xv[i][kk][half].z, xv[i][kk][half].w};
        if (BITS == 4) {
          ds4_mma_f16_16x8x16(xsum[i], a, ones);
        }
        #pragma unroll
        for (int j = 0; j < 8; ++j) {
          ds4_mma_f16_16x8x16(part[i][j], a, b[j]);
        }
      }
    }
  }
  #pragma unroll
  for (int j = 0; j < 8; ++j) {
    #pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int n = wn + 8 * j + 2 * tig + (c & 1);
      #pragma unroll
      for (int i = 0; i < 2; ++i) {
        if (BITS == 16) {
          acc[i][j][c] += part[i][j][c];
        } else {
          acc[i][j][c] = fmaf(sc[n], part[i][j][c], acc[i][j][c]);
        }
        if (BITS == 4) {
          acc[i][j][c] = fmaf(sc[TN + n] + 8.0f * sc[n], xsum[i][c], acc[i][j][c]);
        }
      }
    }
  }
}
ds4_async_wait_keep<0>();
#pragma unroll
for (int i = 0; i < 2; ++i) {
  #pragma unroll
  for (int c = 0; c < 4; ++c) {
    const int r = wm + 16 * i + gid + 8 * (c >> 1);
    if (r < rows) {
      const float unscale = ds4_div(1.0f, rsx[r]);
      #pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int n = col0 + wn + 8 * j + 2 * tig + (c & 1);
        if (n < n_out) {
          y[((size_t)batch * n_rows + row0 + r) * n_out + n] = acc[i][j][c] * unscale;
        }
      }
    }
  }
}
"""
"""Stage s (group s of K) lands in buffer s % STAGES by cp.async, STAGES - 1 groups ahead of the multiply: x's hi
and lo fragments as they are in memory (the tile's TM / 16 blocks of 2 k-steps x 32 lanes x 16 bytes), the quant
words as they are (TN rows), the scales (and Q4_K's biases) of the group's TN outputs. Each step waits for its
stage, passes one barrier (so every warp is done with the buffer the next copies overwrite), issues those copies,
and multiplies: the warp's mma tile (i, j) is rows wm + 16 i.., columns wn + 8 j... K is permuted inside each
16-wide mma step, the same way for x and W: lane t's fragment pairs (2t, 2t + 1) and (2t + 8, 2t + 9) of step kk
hold the values 8t + 4kk .. + 3 of the group, so that a lane reads x as one 16-byte word a fragment
(halfsplit.to_blocks: consecutive lanes, consecutive words) and W as 8 bytes (Q8_0), 4 bytes (Q4_K: 8 nibbles) or 16
bytes (F16) of its column's row. The quants are made halves from those words in registers (ds4_quant_half2: q - 128,
or q - 8, exact), the partial sums of each group drained into the float32 accumulators with its scale (and Q4_K's c
times x's row sums, from the tensor cores with a B of ones). Rows past T read as zeros (the layout's padding, or
blocks past the last, zero-filled), W rows past OUT as zero quants with scale and bias 0. STAGE, a stage's words, is
`stage_words`'s."""


@cache
def kernel(bits: int, stages: int = STAGES) -> Kernel:
    """The kernel for one quant width (4, 8, or 16: F16) and pipeline depth. CUDA only: the tensor-core helpers of
    the CUDA prelude. Its threadgroup memory, `stages` x `stage_words`, is dynamic, past the 48 KB of static
    arrays: at STAGES, 41 KB for Q8_0, 38 KB for Q4_K, 48 KB for F16."""
    return Kernel(f"ds4_dense_affine_f16_{bits}_{stages}", ("xhi", "xlo", "wq", "scales", "biases", "dims", "xscale"),
                  ("y",), _SOURCE, shared_memory=4 * stages * stage_words(bits))


def f16_affine_matmul(x: mx.array, weight: AffineWeight, stages: int = STAGES) -> mx.array:
    """x @ W.T as float32 for an affine W (OUT, IN) and x (..., IN), or W (G, OUT, IN) and x (G, T, IN); IN a
    multiple of 32 (the affine layout's). `stages`: the pipeline's depth (bench/prefill_gemms.py compares them).
    CUDA only."""
    n_batch = 1 if weight.wq.ndim == 2 else weight.wq.shape[0]
    return _launch(x, n_batch, weight.shape[-2], weight.wq, weight.scales.astype(mx.float32),
                   weight.biases.astype(mx.float32), weight.bits, stages)


def half_matmul(x: mx.array, w: mx.array, stages: int = STAGES) -> mx.array:
    """x @ W.T as float32 for a float16 W (OUT, IN), IN a multiple of 32, and float32 x (..., IN). CUDA only."""
    unused = mx.zeros((1,), dtype=mx.float32)
    return _launch(x, 1, w.shape[0], w.view(mx.uint32), unused, unused, 16, stages)


def _launch(x: mx.array, n_batch: int, n_out: int, wq: mx.array, scales: mx.array, biases: mx.array, bits: int,
            stages: int) -> mx.array:
    """One launch over x (..., IN), its leading axes n_batch batches of rows (one, or one per matrix of W)."""
    n_in = x.shape[-1]
    lead = x.shape[:-1]
    n_rows = x.size // n_in // n_batch
    if n_rows == 0:
        return mx.zeros((*lead, n_out), dtype=mx.float32)
    col_tiles = -(-n_out // TN)
    hi, lo, row_scale = held_split(x, n_batch)
    blocks = -(-n_rows // BLOCK_ROWS)
    (y,) = build(kernel(bits, stages), current_backend())(
        inputs=[hi, lo, wq, scales, biases, mx.array([n_rows, n_out, n_in, col_tiles, blocks], dtype=mx.int32),
                row_scale],
        template=[("TM", TM), ("TN", TN), ("TK", TK), ("STAGES", stages), ("STAGE", stage_words(bits)),
                  ("THREADS", THREADS), ("BITS", bits)],
        grid=(-(-n_rows // TM) * THREADS, col_tiles * n_batch, 1), threadgroup=(THREADS, 1, 1),
        output_shapes=[(n_batch * n_rows, n_out)], output_dtypes=[mx.float32],
    )
    return y.reshape(*lead, n_out)


def fits(x: mx.array, weight: AffineWeight) -> bool:
    """Whether the kernel takes this product: a 2-D W, or a batch of W with a batch of x."""
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
    return (f16_affine_matmul(x, to_affine(blocks, ggml_type, PROBE_SHAPE)),
            f16_affine_matmul(xb, to_affine(bank, ggml_type, PROBE_BANK)))


DENSE_F16 = FastPath("dense_affine_f16x2", _reference, _fast, _probe, tolerance=TOLERANCE, backends=("cuda",))
"""Q8_0 / Q4_K projections of a prefill batch on float16 tensor cores; key: the ggml type (BITS names the two). The
bound is batch.py's float32 one, 1e-5 of the largest output: the split leaves ~2^-22 relative per product with
random signs and W is exact, ~1e-6 of the largest output over a K of 4096."""


def _half_probe(key: tuple[int, int]) -> tuple[mx.array, mx.array]:
    """Two column and row tiles (both partial) at the real IN, W's magnitudes from 2^-16 (subnormal halves) to 1."""
    rng = np.random.default_rng(35)
    n_out, n_in = min(key[0], 200), key[1]
    w = rng.standard_normal((n_out, n_in)) * np.exp2(rng.uniform(-16, 0, (n_out, n_in)))
    return random_activations((150, n_in), seed=36), mx.array(w.astype(np.float16))


def _half_reference(x: mx.array, w: mx.array) -> mx.array:
    return x @ w.astype(mx.float32).T


HALF_BATCH = FastPath("half_batch_f16x2", _half_reference, half_matmul, _half_probe, tolerance=TOLERANCE,
                      backends=("cuda",))
"""F16 projections of a prefill batch on float16 tensor cores; key (OUT, IN). Bound: TOLERANCE, as above."""
