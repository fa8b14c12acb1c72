"""Prefill's grouped expert GEMM where MLX's sorted gather_mm is not trusted (CUDA): one custom kernel launch.

For x (N, IN), a float scratch (E, OUT, IN) (float32, or bfloat16 with DS4_PREFILL_DTYPE) and expert ids sorted
ascending with their per-expert counts (E,), the result is x[i] @ scratch[ids[i]].T as float32 (N, OUT). MLX
0.32.4's CUDA gather_mm is wrong with sorted_indices=True, and the unsorted call reads the expert's whole matrix
once per pair (~400 GB per Flash projection of a 2048-token chunk); `padded_matmul` needs the largest count on the
host and covers balanced routings only. Here:

- the grid is ceil(OUT/TN) column tiles x (ceil(N/TM) + min(E, N)) row tiles, an upper bound on the row tiles
  any counts need, so nothing is read back to the host. Expert e owns ceil(counts[e]/TM) consecutive row tiles
  (tiles never straddle experts); a threadgroup finds its expert and rows with SIMD group 0 scanning the counts
  (each lane ceil(E/32) experts, then a butterfly prefix sum), and leaves at once if its tile is past the last;
- a tile is TM x TN outputs: a K loop stages TK-wide slices of the tile's x rows and of W_e's rows in
  threadgroup memory (k-major, so the reads below are float4), the next slice's global loads in flight while
  the current one is multiplied; each of the 256 threads keeps a 4 x 8 register tile (rows 4 ty..4 ty+3, columns
  4 tx..4 tx+3 and TN/2 + 4 tx..), float32 FMAs; bfloat16 scratch values are read as bf16 and converted;
- x stays float32 (the unsorted gather_mm path rounds it to the scratch type): no cast, and no less accurate.

Row tiles follow each other in grid y and column tiles in grid x, so the threadgroups running together share one
expert's x rows and read W_e's rows once per row tile of e (the whole bank ~1.3 times at a random Flash routing).

Cost (estimated, not measured): 2 N OUT IN FLOPs, 206 GFLOP per Flash projection of a 2048-token chunk (N =
12288, 2048 x 4096), 618 GFLOP per layer. The H200's float32 SIMT peak is ~67 TFLOPS; a 64 x 128 tile with a
4 x 8 register tile should reach ~40-50% of it on full tiles, and a random routing fills ~75% of the tiles'
rows (48 pairs per expert on average in tiles of 64): ~9-12 ms per projection, ~30 ms per layer, ~1.3 s for the
43 layers' experts per 2048-token chunk (~1,500 tokens/s from the experts alone). Bank reads (8 GiB float32 x
~1.3, half in bfloat16) take ~2 ms at HBM speed, hidden under the arithmetic.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

import mlx.core as mx

from ..prefill.batch import BF16_TOLERANCE, DTYPES, TOLERANCE
from ..machinery.dialect import SIMD_EXCLUSIVE_SUM, Kernel, build
from ..machinery.probe import random_activations
from ..machinery.registry import FastPath, current_backend

TM, TN, TK, THREADS = 64, 128, 16, 256
"""Tile rows (pairs), tile columns (outputs), K slice and threads: 16 x 16 threads of 4 x 8 outputs each. The
thread mappings below assume these values."""
MAX_ROW_TILES = 65535
"""CUDA's limit on grid y: larger chunks (over 4M pairs) keep the fallback."""


TILE_SCAN = """
if (tid == 0) {
  where[2] = 0;
}
ds4_barrier();
if (SIMD_INDEX == 0) {
  const int lane = SIMD_LANE;
  const int per = (n_expert + 31) / 32;
  int tiles = 0;
  int rows = 0;
  for (int j = 0; j < per; ++j) {
    const int e = lane * per + j;
    const int c = e < n_expert ? (int)counts[e] : 0;
    tiles += (c + TM - 1) / TM;
    rows += c;
  }
  int tile_at = ds4_simd_exclusive_sum(tiles, lane);
  int row_at = ds4_simd_exclusive_sum(rows, lane);
  for (int j = 0; j < per; ++j) {
    const int e = lane * per + j;
    const int c = e < n_expert ? (int)counts[e] : 0;
    const int t = (c + TM - 1) / TM;
    if (tile >= tile_at && tile < tile_at + t) {
      const int part = tile - tile_at;
      where[0] = e;
      where[1] = row_at + part * TM;
      where[2] = c - part * TM < TM ? c - part * TM : TM;
    }
    tile_at += t;
    row_at += c;
  }
}
ds4_barrier();
const int expert = where[0];
const int row0 = where[1];
const int rows = where[2];
if (rows == 0) {
  return;
}
"""
"""The row-tile assignment, shared with the tensor-core kernel (grouped_tf32.py): the threadgroup of grid row tile
`tile` finds its expert, first pair and row count from `counts` (threads tid, SIMD group 0 scanning; `where` an int[3]
in threadgroup memory) and leaves at once if its tile is past the last. Defines expert, row0 and rows."""

TILE_HEAD = """
const int tid = THREAD_IN_GROUP;
const int n_expert = dims[0];
const int n_out = dims[1];
const int n_in = dims[2];
const int tile = GROUP_Y;
const int col0 = GROUP_X * TN;
SHARED int where[3];
"""
"""What a grouped GEMM kernel's threadgroup knows before its row-tile scan (TILE_SCAN, which fills `where`): its
thread, the bank's dims, its row tile (grid y) and first output column (grid x). Shared with grouped_tf32.py."""

_SOURCE = TILE_HEAD + """
SHARED float4 xs4[TK * TM / 4];
SHARED float4 ws4[TK * TN / 4];
SHARED_MEM float* xs = reinterpret_cast<SHARED_MEM float*>(xs4);
SHARED_MEM float* ws = reinterpret_cast<SHARED_MEM float*>(ws4);
""" + TILE_SCAN + """
const int rx = tid % TM;
const int kx = (tid / TM) * (TK * TM / THREADS);
const int nw = tid % TN;
const int kw = (tid / TN) * (TK * TN / THREADS);
const bool x_ok = rx < rows;
const bool w_ok = col0 + nw < n_out;
const GLOBAL_MEM float* x_row = x + (size_t)(row0 + (x_ok ? rx : 0)) * n_in;
const GLOBAL_MEM T* w_row = scratch + ((size_t)expert * n_out + (w_ok ? col0 + nw : 0)) * n_in;
const int tx = tid % (TN / 8);
const int ty = tid / (TN / 8);
float xa[TK * TM / THREADS];
float wa[TK * TN / THREADS];
float acc[4][8];
#pragma unroll
for (int i = 0; i < 4; ++i) {
  #pragma unroll
  for (int j = 0; j < 8; ++j) {
    acc[i][j] = 0.0f;
  }
}
const int steps = (n_in + TK - 1) / TK;
for (int s = 0; s <= steps; ++s) {
  if (s < steps) {
    #pragma unroll
    for (int j = 0; j < TK * TM / THREADS; ++j) {
      const int k = s * TK + kx + j;
      xa[j] = x_ok && k < n_in ? x_row[k] : 0.0f;
    }
    #pragma unroll
    for (int j = 0; j < TK * TN / THREADS; ++j) {
      const int k = s * TK + kw + j;
      wa[j] = w_ok && k < n_in ? static_cast<float>(w_row[k]) : 0.0f;
    }
  }
  if (s > 0) {
    #pragma unroll
    for (int k = 0; k < TK; ++k) {
      const float4 a = xs4[k * (TM / 4) + ty];
      const float4 b = ws4[k * (TN / 4) + tx];
      const float4 c = ws4[k * (TN / 4) + TN / 8 + tx];
      const float av[4] = {a.x, a.y, a.z, a.w};
      const float bv[8] = {b.x, b.y, b.z, b.w, c.x, c.y, c.z, c.w};
      #pragma unroll
      for (int i = 0; i < 4; ++i) {
        #pragma unroll
        for (int j = 0; j < 8; ++j) {
          acc[i][j] += av[i] * bv[j];
        }
      }
    }
  }
  ds4_barrier();
  if (s < steps) {
    #pragma unroll
    for (int j = 0; j < TK * TM / THREADS; ++j) {
      xs[(kx + j) * TM + rx] = xa[j];
    }
    #pragma unroll
    for (int j = 0; j < TK * TN / THREADS; ++j) {
      ws[(kw + j) * TN + nw] = wa[j];
    }
  }
  ds4_barrier();
}
#pragma unroll
for (int i = 0; i < 4; ++i) {
  const int r = 4 * ty + i;
  if (r < rows) {
    GLOBAL_MEM float* out = y + (size_t)(row0 + r) * n_out;
    #pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int lo = col0 + 4 * tx + j;
      const int hi = lo + TN / 2;
      if (lo < n_out) {
        out[lo] = acc[i][j];
      }
      if (hi < n_out) {
        out[hi] = acc[i][4 + j];
      }
    }
  }
}
"""
"""Step s loads slice s into registers, multiplies slice s - 1 (in threadgroup memory), then stores slice s once
every thread is past the multiply. x rows past the tile's and W rows past OUT read as zeros (never stored), as do
k past IN."""

KERNEL = Kernel("ds4_grouped_gemm", ("x", "scratch", "counts", "dims"), ("y",), _SOURCE, SIMD_EXCLUSIVE_SUM)


def expert_counts(sorted_ids: mx.array, n_expert: int) -> mx.array:
    """How many pairs use each expert, (E,) uint32."""
    return mx.zeros((n_expert,), dtype=mx.uint32).at[sorted_ids].add(mx.ones(sorted_ids.shape, dtype=mx.uint32))


def row_tiles(n_pairs: int, n_expert: int, tm: int = TM) -> int:
    """Row tiles of tm pairs any counts summing to n_pairs need at most: each used expert adds at most one partial
    tile."""
    return -(-n_pairs // tm) + min(n_expert, n_pairs)


def grid_fits(n_pairs: int, n_expert: int) -> bool:
    """Whether a grouped GEMM kernel's grid of row tiles fits CUDA's grid y (larger chunks keep the fallback)."""
    return row_tiles(n_pairs, n_expert) <= MAX_ROW_TILES


def launch_grouped(kernel: Callable, x: mx.array | list[mx.array], bank: mx.array, counts: mx.array,
                   shape: tuple[int, int, int], template: list[tuple[str, object]], extra: list[mx.array] = (),
                   pairs: int | None = None, tile: tuple[int, int, int] = (TM, TN, THREADS)) -> mx.array:
    """One launch of a grouped GEMM kernel (`kernel` as dialect.build made it) over pairs sorted by expert: x (N, IN)
    float32 (or the arrays the kernel reads x as: grouped_raw.py's halves), the bank as the kernel reads it, of shape
    (E, OUT, IN), and its counts (E,) -> float32 (N, OUT); `extra` inputs follow the dims, and `pairs` is N where x
    has other rows (a kernel that gathers them). The grid is the output's column tiles by the row tiles any counts
    summing to N need; no read-back. `tile`: the kernel's (pairs, outputs, threads) a threadgroup."""
    n_expert, n_out, n_in = shape
    tm, tn, threads = tile
    xs = x if isinstance(x, list) else [x.astype(mx.float32)]
    n = xs[0].shape[0] if pairs is None else pairs
    if n == 0:
        return mx.zeros((0, n_out), dtype=mx.float32)
    (y,) = kernel(
        inputs=[*xs, bank, counts.astype(mx.uint32),
                mx.array([n_expert, n_out, n_in], dtype=mx.int32), *extra],
        template=template, grid=(-(-n_out // tn) * threads, row_tiles(n, n_expert, tm), 1), threadgroup=(threads, 1, 1),
        output_shapes=[(n, n_out)], output_dtypes=[mx.float32],
    )
    return y


def grouped_gemm(x: mx.array, scratch: mx.array, counts: mx.array) -> mx.array:
    """x[i] @ scratch[e(i)].T as float32 (N, OUT), pair i's expert e(i) given by the counts (E,) of pairs sorted by
    expert (sum N). GPU backends only (`build` refuses the CPU)."""
    return launch_grouped(build(KERNEL, current_backend()), x, scratch, counts, scratch.shape,
                          [("T", scratch.dtype), ("TM", TM), ("TN", TN), ("TK", TK), ("THREADS", THREADS)])


def padded_matmul(x: mx.array, scratch: mx.array, sorted_ids: mx.array, counts: mx.array) -> mx.array | None:
    """x[i] @ scratch[ids[i]].T as one batched GEMM where the sorted gather_mm cannot be used (CUDA): each expert's
    pairs are placed in its own block of C rows (C: the largest count, rounded up to a power of two), (E, C, IN) @
    (E, IN, OUT) runs as a dense batched matmul, and each pair's row is read back. The unsorted gather_mm it stands
    in for does one matrix-vector product per pair, reading its expert's whole matrix each time. counts (E,): the
    pairs per expert. C needs the largest count on the host: one small read-back per projection.

    None when the padding would more than double the work (E * C > 2 N: a skewed routing, or few pairs), where the
    caller keeps the unsorted gather_mm: the padded GEMM's cost grows with E * C, so a chunk whose every token
    shares one expert would cost the whole chunk's rows for every expert. Transient memory at most 2 N * (IN + OUT)
    values."""
    n_expert = scratch.shape[0]
    capacity = 1 << max(4, (int(mx.max(counts).item()) - 1).bit_length())
    if n_expert * capacity > 2 * sorted_ids.size:
        return None
    starts = mx.cumsum(counts) - counts
    slot = sorted_ids * capacity + mx.arange(sorted_ids.size, dtype=mx.uint32) - starts[sorted_ids]
    padded = mx.zeros((n_expert * capacity, x.shape[-1]), scratch.dtype)
    padded[slot] = x.astype(scratch.dtype)
    y = mx.matmul(padded.reshape(n_expert, capacity, -1), mx.swapaxes(scratch, 1, 2))
    return y.reshape(n_expert * capacity, -1)[slot].astype(mx.float32)


def fallback_matmul(x: mx.array, scratch: mx.array, sorted_ids: mx.array, counts: mx.array) -> mx.array:
    """What the kernel replaces, and its reference: `padded_matmul` where it applies, else the unsorted gather_mm
    (one matrix-vector product per pair)."""
    padded = padded_matmul(x, scratch, sorted_ids, counts)
    if padded is not None:
        return padded
    y = mx.gather_mm(x[:, None, :].astype(scratch.dtype), mx.swapaxes(scratch, 1, 2), rhs_indices=sorted_ids)
    return y[:, 0, :].astype(mx.float32)


def _fast(x: mx.array, scratch: mx.array, sorted_ids: mx.array, counts: mx.array) -> mx.array:
    return grouped_gemm(x, scratch, counts)


def make_probe(dtype: mx.Dtype):
    def probe(key: Hashable) -> tuple:
        """Five experts at the real widths: one unused, one with a single pair, one with more than a tile of pairs
        (N = 76, not a multiple of TM)."""
        n_out, n_in = key
        ids = mx.array([0] * 3 + [1] + [3] * (TM + 6) + [4] * 2, dtype=mx.uint32)
        scratch = random_activations((5, n_out, n_in), seed=51).astype(dtype)
        return random_activations((ids.size, n_in), seed=52), scratch, ids, expert_counts(ids, 5)
    return probe


GROUPED_GEMM = {
    dtype: FastPath(f"grouped_gemm_{name}", fallback_matmul, _fast, make_probe(dtype),
                    tolerance=TOLERANCE if dtype == mx.float32 else BF16_TOLERANCE, backends=("cuda",))
    for name, dtype in DTYPES.items()
}
"""The grouped GEMM kernel per scratch type, against `fallback_matmul`; key (OUT, IN). Tolerances: float32
reassociation (TOLERANCE, 1e-5 of the largest output); with a bfloat16 scratch the fallback also rounds x and its
output to bfloat16, the kernel does not (BF16_TOLERANCE)."""


def untrusted_matmul(x: mx.array, scratch: mx.array, sorted_ids: mx.array, counts: mx.array | None = None
                     ) -> mx.array:
    """x[i] @ scratch[ids[i]].T as float32 (N, OUT) where the sorted gather_mm is not trusted: the kernel where its
    check passed, else `fallback_matmul`. counts (E,): the pairs per expert, computed here if not given."""
    n_expert, n_out, n_in = scratch.shape
    counts = expert_counts(sorted_ids, n_expert) if counts is None else counts
    if scratch.dtype not in GROUPED_GEMM or not grid_fits(sorted_ids.size, n_expert):
        return fallback_matmul(x, scratch, sorted_ids, counts)
    return GROUPED_GEMM[scratch.dtype](x, scratch, sorted_ids, counts, key=(n_out, n_in))
