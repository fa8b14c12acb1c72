"""float32 accuracy from float16 tensor cores: the two-half split of x that grouped_raw.py and dense_f16.py share.

Their W values are exact halves (raw q2 magnitudes and quants times their small sub-block scales, centred affine
quants; the other scales are applied as partial sums are drained), so only x needs more than a half's 11
significant bits. Each row of x is scaled by a power of two that puts its largest magnitude in [2^14, 2^15)
(`reference_row_scales`: exact, and undone exactly when the kernel stores the row), then split: hi = half(x), lo =
half(x - hi) (`ds4_half2_split`, CUDA prelude), once before the GEMM (`split_rows`: one pass finding the scale and
writing both halves, a kernel on CUDA, so that the GEMMs' staging of x is a copy of words; measured on the H200:
7.17 → 6.54 ms per IQ2_XXS projection, 4.01 → 3.63 for q_b). hi + lo carries ~22 bits of x; lo stays a normal
half down to 2^-17 of the row's largest value, and below that its absolute error is at most 2^-39 of it. Each
product then takes two mma.m16n8k16 (lo w, then hi w into the same partial sums), whose products are exact in the
float32 sums: ~2^-22 relative is dropped per product, the class of 3xTF32 (2^-21), with two mma of 16-deep
products where 3xTF32 takes three of 8-deep ones.

An array several kernels read is split once within a prefill chunk's forward (`held_split` inside `splits_held`: a
layer's projections of one input, the routed gate and up of the chunk's tokens, the indexer's query blocks of its
rows; the last two of each layout held).

Three layouts: row-major words (`split_rows`, for grouped_raw.py, whose tiles gather any rows by index and take
their fragments by ldmatrix), the fragment layout (`split_blocks`, for dense_f16.py, whose tiles are whole 16-row
blocks: each 16-byte word is one lane's A fragment as mma takes it, so the kernel neither gathers nor moves it;
the row-major reading cost 4.3 register moves per mma, Nsight Compute on the H200, 2026-12-03), and the tiles
layout (`split_tiles`, for the wgmma kernels: each 128-row tile's group of 32 values one 8 KB block a plane, laid
out as a stage's B plane lies in threadgroup memory, so that dense_wgmma.py moves it by one bulk copy where
cp.async took 512 instructions of 16 bytes, and grouped_wgmma.py gathers any row's 16-byte runs from it).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager

import mlx.core as mx

from ..machinery.dialect import Kernel, build
from ..machinery.probe import random_activations
from ..machinery.registry import FastPath, current_backend

X_TOP = 14
"""A row's largest magnitude is scaled into [2^14, 2^15): below float16's largest value (65504) after rounding."""
THREADS = 256
"""Threads per row of the row-scale kernel."""


@mx.compile
def reference_row_scales(x: mx.array) -> mx.array:
    """The power of two per row of x (N, IN) that brings its largest magnitude into [2^X_TOP, 2^(X_TOP+1)), as
    float32 (N,). Zero rows get 2^127 (their values stay zero), rows holding an infinity or a NaN a small scale
    (they stay non-finite)."""
    amax = mx.max(mx.abs(x), axis=-1)
    exponent = mx.right_shift(amax.view(mx.uint32), 23).astype(mx.int32) - 127
    k = mx.clip(X_TOP - exponent, -126, 127)
    return mx.left_shift((k + 127).astype(mx.uint32), 23).view(mx.float32)


ROW_SCALE = """
DEVICE_FN float ds4_abs_max(float m, float v) {
  const float a = v < 0.0f ? -v : v;
  return a > m ? a : m;
}
DEVICE_FN float ds4_row_scale(float m, int top) {
  int k = top - ((int)(ds4_bits(m) >> 23) - 127);
  k = k < -126 ? -126 : (k > 127 ? 127 : k);
  return ds4_float((unsigned int)(k + 127) << 23);
}
"""
"""The header both split kernels share: a running largest magnitude (a NaN never replaces it), and the power of two
for a row whose largest magnitude is m, from its exponent bits as `reference_row_scales` builds it (top: X_TOP)."""

SPLIT_ROW = ROW_SCALE + """
template <int N>
DEVICE_FN float ds4_split_row(const float2 (&v)[N], SHARED_MEM unsigned int* hi, SHARED_MEM unsigned int* lo) {
  float m = 0.0f;
  for (int j = 0; j < N; ++j) {
    m = ds4_abs_max(ds4_abs_max(m, v[j].x), v[j].y);
  }
  const float scale = ds4_row_scale(ds4_simd_max(m), """ + str(X_TOP) + """);
  for (int j = 0; j < N; ++j) {
    ds4_half2_split(v[j].x * scale, v[j].y * scale, hi[32 * j], lo[32 * j]);
  }
  return ds4_div(1.0f, scale);
}
"""
"""A header for kernels that split rows in threadgroup memory themselves (chunk_attention.py, indexer.py: their
queries and keys, whose products both need float32 accuracy): one row of 64 N floats held by a warp (lane: the pairs
at 2 lane + 64 j) scaled by the row's power of two, as `reference_row_scales` picks it, and split into half planes
(word lane + 32 j of hi and lo); the scale's inverse returned, to be applied to the products. CUDA only."""

_SPLIT = """
const int tid = THREAD_IN_GROUP;
const int row = GROUP_X;
const int n_in = dims[0];
const GLOBAL_MEM float* r = x + (size_t)row * n_in;
SHARED float part[THREADS / 32];
float m = 0.0f;
for (int k = tid; k < n_in; k += THREADS) {
  m = ds4_abs_max(m, r[k]);
}
m = ds4_simd_max(m);
if (SIMD_LANE == 0) {
  part[SIMD_INDEX] = m;
}
ds4_barrier();
for (int w = 0; w < THREADS / 32; ++w) {
  m = part[w] > m ? part[w] : m;
}
const float sc = ds4_row_scale(m, X_TOP);
if (tid == 0) {
  scale[row] = sc;
}
for (int p = tid; p < n_in / 2; p += THREADS) {
  const size_t word = (size_t)row * (n_in / 2) + p;
  ds4_half2_split(r[2 * p] * sc, r[2 * p + 1] * sc, hi[word], lo[word]);
}
"""
"""One threadgroup per row: each thread the largest magnitude of its strided values, then the SIMD groups' and the
row's (a maximum is exact in any order; every thread takes it), the scale from its exponent bits as the reference
builds it, then each pair of the scaled row split into its hi and lo half pairs (word p written at p). A NaN is
dropped by the comparisons where the reference's max keeps it: such a row gets the scale of its finite values, and
its NaN stays a NaN through the products anyway."""

SPLIT_KERNEL = Kernel("ds4_split_rows", ("x", "dims"), ("hi", "lo", "scale"), _SPLIT, ROW_SCALE)


def _probe(key: int) -> tuple:
    """Rows of very different sizes, a zero row and an infinity, at the real width."""
    x = random_activations((8, key), seed=61) * mx.array([1e-30, 1e-3, 1.0, 1.0, 7e4, 1e30, 0.0, 1.0])[:, None]
    return (mx.concatenate([x[:7], mx.where(mx.arange(key) == 3, mx.inf, x[7:])]),)


@mx.compile
def reference_split_rows(x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    """x (N, IN) float32, IN even -> (hi, lo) (N, IN / 2) uint32 of half pairs (value 2p in bits 0-15 of word p)
    and the row scales (N,): hi = half(x s), lo = half(x s - hi), s = `reference_row_scales`."""
    scale = reference_row_scales(x)
    scaled = x * scale[:, None]
    hi = scaled.astype(mx.float16)
    lo = (scaled - hi.astype(mx.float32)).astype(mx.float16)
    return hi.view(mx.uint32), lo.view(mx.uint32), scale


def _kernel_split_rows(x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    n, n_in = x.shape
    return tuple(build(SPLIT_KERNEL, current_backend())(
        inputs=[x, mx.array([n_in], dtype=mx.int32)], template=[("THREADS", THREADS), ("X_TOP", X_TOP)],
        grid=(n * THREADS, 1, 1), threadgroup=(THREADS, 1, 1), output_shapes=[(n, n_in // 2)] * 2 + [(n,)],
        output_dtypes=[mx.uint32, mx.uint32, mx.float32]))


def _split_probe(key: int) -> tuple:
    """`_probe`'s rows less its infinity: an infinity's residue is a NaN, whose bits (not its NaN-ness) may differ
    between the kernel and the reference, and the check compares the words bit for bit."""
    (x,) = _probe(key)
    return (mx.where(mx.isinf(x), 1.0, x),)


SPLIT_ROWS = FastPath("split_rows", reference_split_rows, _kernel_split_rows, _split_probe, tolerance=0.0,
                      backends=("cuda",))
"""One pass over x instead of the reference's scale, round, subtract and round (CUDA: the half2 helpers are its
prelude's); bit for bit equal (tolerance 0); key: the row length."""


def split_rows(x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    """`reference_split_rows` of x (N, IN) float32, by the one-pass kernel where its check passed."""
    return SPLIT_ROWS(x.astype(mx.float32), key=x.shape[-1])


def transpose_groups(words: mx.array) -> mx.array:
    """Half-pair words (N, IN / 2), IN a multiple of 32, with each group of 16 words (32 values) read as a 4 x 4
    matrix and transposed: word 4 t + a of a group goes to 4 a + t. The wgmma kernels' B tiles are these rows'
    16-byte runs as they are (each the 8 K of one row of a wgmma core matrix): the run a = 2 kk + c holds words a,
    4 + a, 8 + a, 12 + a, the values that mma fragment c of k-step kk takes in the permutation of K the W fragments
    share (lane t's values 8 t + 4 kk .. + 3, one 8-byte word of a Q8_0 row)."""
    n, w = words.shape
    return words.reshape(n, w // 16, 4, 4).swapaxes(-1, -2).reshape(n, w)


TILE_ROWS = 128
"""Rows (tokens) of a tile of the tiles layout: the 128 columns of the wgmma kernels' B."""
TILE_WORDS = TILE_ROWS * 16
"""Words of one plane of a tile's group of 32 values: 8 KB, one wgmma kernel stage's B plane as it lies in
threadgroup memory."""


def tile_count(rows: int) -> int:
    """Tiles of TILE_ROWS that hold `rows` rows (the last one padded)."""
    return -(-rows // TILE_ROWS)


def to_tiles(words: mx.array, n_batch: int = 1, interleaved: bool = False) -> mx.array:
    """Half-pair words (N, IN / 2) of n_batch batches of rows (batch b's row r at b T + r, or with `interleaved`
    at r n_batch + b), IN a multiple of 32, laid out as the wgmma kernels' B planes lie in threadgroup memory, so
    that one bulk copy moves a stage's plane: each batch's rows padded with zero rows to tiles of TILE_ROWS, then
    tile by tile and group by group of 32 values, TILE_WORDS words: `transpose_groups`'s 16-byte run kc of row n at
    word ((n / 8) 4 + kc) 32 + (n % 8) 4 (core matrix (n / 8, kc) of a K-major tile without swizzling, the 8 rows
    of a core matrix 16 bytes apart). Returns (n_batch * tiles * TILE_ROWS, IN / 2)."""
    n, w = words.shape
    rows = n // n_batch
    tiles = tile_count(rows)
    words = transpose_groups(words)
    if interleaved:
        words = words.reshape(rows, n_batch, w).swapaxes(0, 1)
    words = mx.pad(words.reshape(n_batch, rows, w), [(0, 0), (0, tiles * TILE_ROWS - rows), (0, 0)])
    words = words.reshape(n_batch, tiles, TILE_ROWS // 8, 8, w // 16, 4, 4).transpose(0, 1, 4, 2, 5, 3, 6)
    return words.reshape(n_batch * tiles * TILE_ROWS, w)


def reference_split_tiles(x: mx.array, n_batch: int = 1, interleaved: bool = False
                          ) -> tuple[mx.array, mx.array, mx.array]:
    """`reference_split_rows` with hi and lo in `to_tiles`'s layout (the scales in x's row order)."""
    hi, lo, scale = reference_split_rows(x)
    return to_tiles(hi, n_batch, interleaved), to_tiles(lo, n_batch, interleaved), scale


TILE_BLOCK = """
const int lane = SIMD_LANE;
const int warp = SIMD_INDEX;
SHARED float row_scale[8];
float sc = 0.0f;
if (real(n0 + warp)) {
  const int row = x_row(n0 + warp);
  const GLOBAL_MEM float4* r4 = reinterpret_cast<const GLOBAL_MEM float4*>(x + (size_t)row * n_in);
  float m = 0.0f;
  #pragma unroll 4
  for (int k = lane; k < n_in / 4; k += 32) {
    const float4 v = r4[k];
    m = ds4_abs_max(ds4_abs_max(ds4_abs_max(ds4_abs_max(m, v.x), v.y), v.z), v.w);
  }
  sc = ds4_row_scale(ds4_simd_max(m), X_TOP);
  if (lane == 0) {
    scale[row] = sc;
  }
}
if (lane == 0) {
  row_scale[warp] = sc;
}
ds4_barrier();
const int j = lane >> 2;
const bool ok = real(n0 + j);
const GLOBAL_MEM float* r = x + (ok ? (size_t)x_row(n0 + j) * n_in : 0) + 8 * (lane & 3);
sc = row_scale[j];
const int groups = n_in / 32;
const size_t at = (size_t)tile_index * groups * TILE_WORDS + (n0 >> 3) * 128 + lane;
#pragma unroll 2
for (int s = warp; s < groups; s += 8) {
  float4 a = {0.0f, 0.0f, 0.0f, 0.0f};
  float4 b = a;
  if (ok) {
    a = *reinterpret_cast<const GLOBAL_MEM float4*>(r + 32 * s);
    b = *reinterpret_cast<const GLOBAL_MEM float4*>(r + 32 * s + 4);
  }
  const float v[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
  #pragma unroll
  for (int kc = 0; kc < 4; ++kc) {
    const size_t word = at + (size_t)s * TILE_WORDS + 32 * kc;
    ds4_half2_split(v[2 * kc] * sc, v[2 * kc + 1] * sc, hi[word], lo[word]);
  }
}
"""
"""One threadgroup (8 SIMD groups) per 8 row slots n0 .. n0 + 7 of tile `tile_index` (the rows of one core-matrix
block; `real(n)` whether slot n holds a row, `x_row(n)` which row of x, `n_in` the row length): SIMD group j finds
slot j's row scale (its largest magnitude from 16-byte loads; a NaN is dropped as `_SPLIT` drops it), then each
SIMD group splits whole groups of 32 values of all 8 rows, lane 4 j + w reading values 8 w .. 8 w + 7 of slot j's
group (two 16-byte loads: pairs 4 w + kc, word w of run kc) and writing word w of slot j's run kc for each kc, so
that a SIMD group writes each run's 128 bytes (core matrix (n0 / 8, kc)) whole. Slots without a row are zeros. (One
threadgroup a row, each writing its own 16-byte runs, took 180 us a 4096 x 4096 split on the H200, 1.0 ms for
out_a's 32768 rows: 2026-12-04.) Shared with grouped_wgmma.py's split of a chunk's pairs into their tiles."""

_SPLIT_TILES = """
const int n_in = dims[0];
const int t_rows = dims[1];
const int tiles = dims[2];
const int n_batch = dims[3];
const int blocks = tiles * (TILE_ROWS / 8);
const int batch = GROUP_X / blocks;
const int slot0 = (GROUP_X - batch * blocks) * 8;
const int tile_index = batch * tiles + slot0 / TILE_ROWS;
const int n0 = slot0 % TILE_ROWS;
const int first = slot0 - n0;
auto real = [&](int n) { return first + n < t_rows; };
auto x_row = [&](int n) { return INTERLEAVED ? (first + n) * n_batch + batch : batch * t_rows + first + n; };
""" + TILE_BLOCK
"""`TILE_BLOCK` over batch b's rows, tiles of TILE_ROWS: slot n of its tile i is the batch's row 128 i + n."""

TILES_KERNEL = Kernel("ds4_split_tiles", ("x", "dims"), ("hi", "lo", "scale"), _SPLIT_TILES, ROW_SCALE)


def _kernel_split_tiles(x: mx.array, n_batch: int = 1, interleaved: bool = False
                        ) -> tuple[mx.array, mx.array, mx.array]:
    n, n_in = x.shape
    rows = n // n_batch
    tiles = tile_count(rows)
    return tuple(build(TILES_KERNEL, current_backend())(
        inputs=[x, mx.array([n_in, rows, tiles, n_batch], dtype=mx.int32)],
        template=[("X_TOP", X_TOP), ("TILE_ROWS", TILE_ROWS), ("TILE_WORDS", TILE_WORDS),
                  ("INTERLEAVED", int(interleaved))],
        grid=(n_batch * tiles * TILE_ROWS // 8 * 256, 1, 1), threadgroup=(256, 1, 1),
        output_shapes=[(n_batch * tiles * TILE_ROWS, n_in // 2)] * 2 + [(n,)],
        output_dtypes=[mx.uint32, mx.uint32, mx.float32]))


def _tiles_probe(key: int) -> tuple:
    """`_split_probe`'s eight rows as two batches of four, interleaved: each padded to a tile."""
    (x,) = _split_probe(key)
    return x, 2, True


SPLIT_TILES = FastPath("split_tiles", reference_split_tiles, _kernel_split_tiles, _tiles_probe, tolerance=0.0,
                       backends=("cuda",))
"""The split kernel writing `to_tiles`'s layout, bit for bit the reference's (padding zero); key: the row length."""


def split_tiles(x: mx.array, n_batch: int = 1, interleaved: bool = False) -> tuple[mx.array, mx.array, mx.array]:
    """`reference_split_tiles` of x (N, IN) float32, IN a multiple of 32, by the kernel where its check passed."""
    return SPLIT_TILES(x.astype(mx.float32), n_batch, interleaved, key=x.shape[-1])


BLOCK_ROWS = 16
"""Rows of a block of the fragment layout: the rows of one mma.m16n8k16 A tile."""


def to_blocks(words: mx.array, n_batch: int) -> mx.array:
    """Half-pair words (N, IN / 2) of n_batch batches of T rows each, IN a multiple of 32, in the layout whose
    16-byte words are mma.m16n8k16 A fragments as they are (dense_f16.py reads one per mma, with no register
    moves to assemble it): each batch's rows padded with zero rows to blocks of 16; block B's 32-value group s is
    1 KB, two k-steps kk of 32 lanes' fragments, lane 4 g + t holding words 4 t + 2 kk and 4 t + 2 kk + 1 of the
    group for rows g and g + 8 of the block (row g's word, row g + 8's word, and again for the next word), the
    permutation of K inside each 16-value step that dense_f16.py's W fragments share. Returns (N', IN / 2) for the
    N' = n_batch * 16 * blocks row slots."""
    n, w = words.shape
    rows = n // n_batch
    blocks = -(-rows // BLOCK_ROWS)
    words = mx.pad(words.reshape(n_batch, rows, w), [(0, 0), (0, BLOCK_ROWS * blocks - rows), (0, 0)])
    words = words.reshape(n_batch, blocks, 2, 8, w // 16, 4, 2, 2).transpose(0, 1, 4, 6, 3, 5, 7, 2)
    return words.reshape(n_batch * blocks * BLOCK_ROWS, w)


def reference_split_blocks(x: mx.array, n_batch: int) -> tuple[mx.array, mx.array, mx.array]:
    """`reference_split_rows` with hi and lo in `to_blocks`'s fragment layout."""
    hi, lo, scale = reference_split_rows(x)
    return to_blocks(hi, n_batch), to_blocks(lo, n_batch), scale


def _blocks_probe(key: int) -> tuple:
    """`_split_probe`'s eight rows as two batches of four, each padded to a block."""
    (x,) = _split_probe(key)
    return x, 2


_SPLIT_BLOCKS = """
const int tid = THREAD_IN_GROUP;
const int n_in = dims[0];
const int t_rows = dims[1];
const int blocks = dims[2];
const int batch = GROUP_X / blocks;
const int r0 = (GROUP_X - batch * blocks) * 16;
const GLOBAL_MEM float* xb = x + (size_t)batch * t_rows * n_in;
SHARED float row_scale[16];
float m[2] = {0.0f, 0.0f};
for (int k = 4 * SIMD_LANE; k < n_in; k += 128) {  // both rows' loads in flight together, 16 bytes each
  #pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int rr = r0 + 2 * SIMD_INDEX + h;
    if (rr < t_rows) {
      const float4 w = *reinterpret_cast<const GLOBAL_MEM float4*>(xb + (size_t)rr * n_in + k);
      m[h] = ds4_abs_max(ds4_abs_max(ds4_abs_max(ds4_abs_max(m[h], w.x), w.y), w.z), w.w);
    }
  }
}
#pragma unroll
for (int h = 0; h < 2; ++h) {
  const int rr = r0 + 2 * SIMD_INDEX + h;
  const float sc = ds4_row_scale(ds4_simd_max(m[h]), X_TOP);
  if (SIMD_LANE == 0) {
    row_scale[2 * SIMD_INDEX + h] = sc;
    if (rr < t_rows) {
      scale[(size_t)batch * t_rows + rr] = sc;
    }
  }
}
ds4_barrier();
const int frags = n_in * 2;
GLOBAL_MEM uint4* hi4 = reinterpret_cast<GLOBAL_MEM uint4*>(hi) + (size_t)GROUP_X * frags;
GLOBAL_MEM uint4* lo4 = reinterpret_cast<GLOBAL_MEM uint4*>(lo) + (size_t)GROUP_X * frags;
#pragma unroll 4
for (int f = tid; f < frags; f += THREADS) {
  const int g = (f & 31) >> 2;
  const int col = 32 * (f >> 6) + 8 * (f & 3) + 4 * ((f >> 5) & 1);
  float v[2][4] = {};
  #pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int rr = r0 + g + 8 * h;
    if (rr < t_rows) {
      const float sc = row_scale[g + 8 * h];
      const float4 w = *reinterpret_cast<const GLOBAL_MEM float4*>(xb + (size_t)rr * n_in + col);
      v[h][0] = w.x * sc;
      v[h][1] = w.y * sc;
      v[h][2] = w.z * sc;
      v[h][3] = w.w * sc;
    }
  }
  uint4 hv;
  uint4 lv;
  ds4_half2_split(v[0][0], v[0][1], hv.x, lv.x);
  ds4_half2_split(v[1][0], v[1][1], hv.y, lv.y);
  ds4_half2_split(v[0][2], v[0][3], hv.z, lv.z);
  ds4_half2_split(v[1][2], v[1][3], hv.w, lv.w);
  hi4[f] = hv;
  lo4[f] = lv;
}
"""
"""One threadgroup per block of 16 row slots (THREADS = 256: SIMD group w finds the scales of rows 2w and 2w + 1,
reading both rows 16 bytes a load), then each thread one 16-byte A fragment at a time: four values of two rows (g
and g + 8) read as 16-byte words, scaled, split, and the hi and lo fragments written whole (padding rows zero)."""

BLOCK_KERNEL = Kernel("ds4_split_blocks", ("x", "dims"), ("hi", "lo", "scale"), _SPLIT_BLOCKS, ROW_SCALE)


def _kernel_split_blocks(x: mx.array, n_batch: int) -> tuple[mx.array, mx.array, mx.array]:
    n, n_in = x.shape
    rows = n // n_batch
    blocks = -(-rows // BLOCK_ROWS)
    return tuple(build(BLOCK_KERNEL, current_backend())(
        inputs=[x, mx.array([n_in, rows, blocks], dtype=mx.int32)], template=[("THREADS", THREADS), ("X_TOP", X_TOP)],
        grid=(n_batch * blocks * THREADS, 1, 1), threadgroup=(THREADS, 1, 1),
        output_shapes=[(n_batch * blocks * BLOCK_ROWS, n_in // 2)] * 2 + [(n,)],
        output_dtypes=[mx.uint32, mx.uint32, mx.float32]))


SPLIT_BLOCKS = FastPath("split_blocks", reference_split_blocks, _kernel_split_blocks, _blocks_probe, tolerance=0.0,
                        backends=("cuda",))
"""The split in the fragment layout by its own one-pass kernel, bit for bit the reference's."""


def split_blocks(x: mx.array, n_batch: int = 1) -> tuple[mx.array, mx.array, mx.array]:
    """`reference_split_blocks` of x (N, IN) float32 (n_batch batches of rows, IN a multiple of 32), by the
    kernel where its check passed."""
    return SPLIT_BLOCKS(x.astype(mx.float32), n_batch, key=x.shape[-1])


SPLITS_HELD = 2
"""The last splits of each layout kept for reuse (`held_split`): a layer's projections read one input several times
(q_a, kv, the compressors' and the indexer's projections its normed input; q_b and the indexer's q_b its query
latent; the router and the shared expert the FFN's input; the routed gate and up the chunk's tokens; the indexer's
query blocks its rows), at most two inputs of a layout interleaved."""
LAYOUTS = ("rows", "blocks", "tiles", "slots")
"""`held_split`'s layouts (`split_rows`, `split_blocks`, `split_tiles`) and grouped_wgmma.py's pairs split into
their tiles (`held`)."""
_held: dict[str, list[tuple[tuple, Hashable, tuple[mx.array, ...]]]] | None = None


@contextmanager
def splits_held() -> Iterator[None]:
    """Within it (one prefill chunk's forward), `held_split` reuses the splits it made; after it, they are released.
    An array's values never change while its graph is built, but a state buffer that outlives the chunk can be
    written in place later (the decode graphs, model/graphstep.py), so no split outlives the chunk."""
    global _held
    _held = {layout: [] for layout in LAYOUTS}
    try:
        yield
    finally:
        _held = None


def held(layout: str, arrays: tuple, key: Hashable, make: Callable[[], tuple[mx.array, ...]]
         ) -> tuple[mx.array, ...]:
    """`make()`, or within `splits_held` what it made before for the same arrays (the same objects, None alike)
    and key; the last SPLITS_HELD of each layout held."""
    kept = None if _held is None else _held[layout]
    for made_of, made_key, parts in kept or ():
        if made_key == key and len(made_of) == len(arrays) and all(a is b for a, b in zip(made_of, arrays)):
            return parts
    parts = make()
    if kept is not None:
        kept.insert(0, (arrays, key, parts))
        del kept[SPLITS_HELD:]
    return parts


def held_split(x: mx.array, n_batch: int | None = None, layout: str = "rows",
               interleaved: bool = False) -> tuple[mx.array, mx.array, mx.array]:
    """`split_rows` of x (N, IN); with n_batch `split_blocks` of x (..., IN) as n_batch batches of rows; or with
    layout "tiles" `split_tiles` of x (..., IN) as n_batch (default one) batches, `interleaved` or not. Within
    `splits_held`, made once for an array that several kernels read (the same array object)."""
    if n_batch is not None and layout == "rows":
        layout = "blocks"
    if layout == "rows":
        return held(layout, (x,), None, lambda: split_rows(x))
    if layout == "tiles":
        return held(layout, (x,), (n_batch, interleaved),
                    lambda: split_tiles(x.reshape(-1, x.shape[-1]), n_batch or 1, interleaved))
    return held(layout, (x,), n_batch,
                lambda: split_blocks(x.astype(mx.float32).reshape(-1, x.shape[-1]), n_batch))
