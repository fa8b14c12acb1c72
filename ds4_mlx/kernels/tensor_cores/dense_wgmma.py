"""Prefill's Q8_0 and F16 projections by Hopper's warpgroup products (wgmma, sm_90a), at float32 accuracy.

dense_f16.py's kernel issues one mma.m16n8k16 at a time from registers, and Nsight Compute found it bound by the
instructions around them (6.5 issued a mma, 8 warps an SM: the tensor pipe ~28% busy, ~97 TFLOP/s of useful work
for q_b on the H200). A wgmma is one instruction for a 64 x 128 x 16 product of a warpgroup (four warps), its B
operand read from threadgroup memory by the tensor cores themselves. The same arithmetic, arranged for it:

- A = W in registers: warp w of a warpgroup holds 16 W rows (outputs) as mma's A fragments, made from the quants
  in the tile as exact halves (q - 128; F16 values as they are), the permutation of K inside each 16-wide step
  dense_f16.py's W fragments take (lane t reads one 8-byte word of a Q8_0 row: its values 8 t .. 8 t + 7);
- B = x: 128 tokens as columns, in two planes, the tokens' hi and lo halves (halfsplit's rule: each row scaled by
  a power of two, then split). A plane is K-major without swizzling: core matrices of 8 columns x 8 K (16-byte
  rows), each 16-byte run the 8 K of one core-matrix row in that same permutation (`halfsplit.transpose_groups`);
  x is split into halfsplit's tiles layout, where a stage's plane lies as it lies in threadgroup memory, 8 KB that
  one bulk copy (the TMA unit's) moves;
- each group of 32 K (one affine scale) is four wgmma, each k-step's A by the lo plane and then the hi plane, into
  the same zeroed partial sums (the tensor cores truncate what they accumulate), then drained into float32
  accumulators with the group's scale (F16: none), one FMA an output, as dense_f16.py drains its mma. The store
  undoes x's row scale exactly.

A threadgroup is WARPGROUPS warpgroups over 64 WARPGROUPS W rows x 128 tokens, warpgroup g the 64 rows 64 g..; stage
s (group s of K) lands in buffer s % STAGES, AHEAD groups ahead: the B planes (2 x 8 KB, two bulk copies counted on
the stage's transaction barrier), the tile's quant rows and the group's scales (cp.async). A step waits for its
stage, passes one barrier (every warpgroup is done with the buffer the next copies overwrite: each waited for the
wgmma that read it), issues the copies, reads its A fragments and scales, and issues its wgmma. Threadgroups take
token tiles fastest, so the ones running together share a W tile.

Nsight Compute's stall sampling (2026-12-04) found B's cp.async copies (four 16-byte copies a thread a stage) the
holdup: the memory instruction queue full, so the copies' own address registers and the A fragments' shared loads
waited behind them (stalls on rewriting the copies' address registers and on the fragments' loads: 38% of the
samples in q_b's loop, against 8% waiting for the tensor cores). The bulk copies take that queue off B.

Measured (H200, 4096 tokens, bench/prefill_gemms.py, 2026-12-03): the first form (64 tokens as hi and lo columns,
a drain of an add and an FMA a token) was slower than dense_f16.py (q_b 4.08 against 2.82 ms): 312 instructions a
warp a group, 8 warps an SM, issue slots 37% busy (Nsight Compute). This form at dense_f16.py's 128 x 128 tile (two
warpgroups) was within 10% of it either way; with three warpgroups (192 W rows: 27% less of x copied a product)
15-21% faster (PLAN). End to end, an 11.5k-token prompt over 43 layers: 2,444 t/s (two warpgroups, pipelined) and
2,556 t/s (three), one machine; dense_f16.py's last figure 2,483 (2026-12-03). B by bulk copies (2026-12-04): q_b
2.38 → 1.82 ms, the prompt 3,143 → 3,298 t/s (3,416 once the tiles split was made fast).

Q4_K (whose nonzero offset needs x's row sums) keeps dense_f16.py's kernel; so does any device without wgmma (the
first-use check fails to build there and the next path is taken). CUDA only; never run on Metal.
"""

from __future__ import annotations

from functools import cache

import mlx.core as mx

from ...model.gguf import GGMLType
from ..formats.affine import GROUP_SIZE, AffineWeight, to_affine
from .dense_f16 import DENSE_F16, HALF_BATCH, PROBE_BANK, PROBE_SHAPE, TILE, TOLERANCE, half_matmul
from .dense_f16 import fits as dense_fits
from ..machinery.dialect import Kernel, build
from .halfsplit import TILE_ROWS, held_split, tile_count
from ..machinery.registry import FastPath, current_backend, planned

TM = TILE_ROWS
"""Tokens (rows of x) per threadgroup: the 128 columns of B, one tile of halfsplit's tiles layout."""
WARPGROUPS = 3
"""Warpgroups a threadgroup, each 64 W rows (outputs) of the TN = 64 WARPGROUPS the threadgroup takes: all of them
read one B tile, so that more of them read less of x a product (three: 168 registers x 384 threads, the most an SM
holds; four would spill)."""
TK = GROUP_SIZE
"""K per stage: one affine group, two wgmma k-steps of 16."""
STAGES = 4
"""Stage buffers: the copies of a group land while earlier ones are multiplied."""
PLANE_WORDS = TM * TK // 2
"""One plane (hi or lo) of a stage's B tile: 128 columns of 32 halves, 8 KB."""
LBO = 128
"""Bytes from one core matrix of a B plane to the next along K."""
SBO = 4 * LBO
"""Bytes from one core matrix to the next along N: the four along K of a group come first."""
PIPELINE = 0
"""1: each warpgroup issues a group's wgmma before it drains the previous group's partial sums (two sets of 64
registers, 243 in all: two warpgroups at most); 0: it waits for each group's wgmma and drains it at once (168
registers)."""
AHEAD = STAGES - 1 - PIPELINE
"""Groups the copies run ahead of the products: at most STAGES - 1 - PIPELINE (a buffer is overwritten only
after every warpgroup's wgmma that read it is done)."""
OVERLAP = 1
"""With PIPELINE 0, 1 issues a group's products as two halves of 64 tokens (m64n64k16, 32 of the partial sums
each) and drains the first while the tensor cores multiply the second, as grouped_wgmma.py once did; 0 waits for
the whole m64n128k16 product, then drains it."""
PLAN = (PIPELINE, AHEAD, WARPGROUPS, OVERLAP, STAGES)
"""(PIPELINE, AHEAD, WARPGROUPS, OVERLAP, STAGES), for every shape. Measured on the H200 (4096 tokens,
bench/prefill_gemms.py, 2026-12-03, ms; this plan / the same waited whole (0, 3, 3, 0) / two warpgroups pipelined
(1, 2, 2, 0), the narrow plan of 2026-12-03): q_a 0.472 / 0.530 / 0.552, q_b 2.377 / 2.370 / 2.884, out_b
2.232 / 2.268 / 2.547, shared gate 0.721 / 0.778 / 0.876, F16 512 x 4096 0.317 / 0.388 / 0.367, F16 8192 x 1024
0.723 / 0.736 / 0.795. In the model (a 4-layer chunk's projections, one machine) the three were within the runs'
spread of each other (40.6-42.8 ms), so the one plan serves every shape. With B by bulk copies (2026-12-04; this
plan / (0, 3, 3, 0) / (1, 2, 2, 0) / (0, 2, 3, 1)): q_b 1.821 / 1.886 / 1.938 / 1.846, out_b 1.911 / 1.870 / 1.875 /
1.848, shared gate 0.639 / 0.641 / 0.654 / 0.653: still the one plan; a chunk's projections 40.1 → 26.8 ms. Deeper
pipelines (5 stages copied 4 ahead, 6 copied 5 ahead) were 5-15% slower at every shape (another machine)."""


def stage_words(bits: int, warpgroups: int = WARPGROUPS) -> int:
    """32-bit words of threadgroup memory a stage holds: B's hi and lo planes, the quant rows (TN rows of TK * bits
    / 32 words), and the group's TN scales (Q8_0)."""
    tn = 64 * warpgroups
    return 2 * PLANE_WORDS + tn * TK * bits // 32 + (tn if bits == 8 else 0)


STORE = """
ds4_async_wait_keep<0>();
#pragma unroll
for (int h = 0; h < 2; ++h) {
  const int n = col0 + wrow + 8 * h;
  if (n < n_out) {
    #pragma unroll
    for (int j = 0; j < 16; ++j) {
      #pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int r = 8 * j + 2 * tig + e;
        if (r < rows) {
          y[(size_t)(Y_ROW0 + r) * n_out + n] = acc[j][e][h] * ds4_div(1.0f, rsx[r]);
        }
      }
    }
  }
}
"""
"""The last lines of both wgmma kernels (this one's and grouped_wgmma.py's): once the copies are done, each lane's
accumulators acc[j][e][h] (W row wrow + 8 h of the tile, token 8 j + 2 t + e) stored to y's row Y_ROW0 + token,
the row's scale undone; rows past the tile's and outputs past OUT are not written."""


BULK_B = """
SHARED unsigned long long landed[STAGES];
if (tid == 0) {
  #pragma unroll
  for (int b = 0; b < STAGES; ++b) {
    ds4_bar_init(&landed[b], 1);
  }
}
const GLOBAL_MEM uint32_t* x_src[2] = {xhi + B_TILE, xlo + B_TILE};
auto load_b = [&](int s) {
  if (tid == 0) {
    SHARED_MEM unsigned int* st = buffer + (s % STAGES) * STAGE;
    ds4_bar_expect(&landed[s % STAGES], 8 * PLANE_WORDS);
    #pragma unroll
    for (int plane = 0; plane < 2; ++plane) {
      ds4_bulk_copy(st + plane * PLANE_WORDS, x_src[plane] + (size_t)s * PLANE_WORDS, 4 * PLANE_WORDS,
                    &landed[s % STAGES]);
    }
  }
};
auto wait_b = [&](int s) { ds4_bar_wait(&landed[s % STAGES], (s / STAGES) & 1); };
"""
"""Both wgmma kernels' B (this one's and grouped_wgmma.py's): a transaction barrier a stage buffer (`landed`, made
by thread 0; a ds4_barrier() must follow before any wait), `load_b(s)` (thread 0: stage s's hi and lo planes, one
bulk copy of PLANE_WORDS words each from the tile's blocks at word B_TILE of xhi and xlo, into buffer s % STAGES)
and `wait_b(s)` (until they landed: the barrier's phase s / STAGES)."""


_SOURCE = TILE + """
constexpr int WW = TN * TK * BITS / 32;
constexpr int WC = TK * BITS / 128;
constexpr int B_WORDS = 2 * PLANE_WORDS;
const int wrow = 64 * (warp >> 2) + 16 * (warp & 3) + gid;
const int words = n_in * BITS / 32;
const int groups = n_in / TK;
auto x_row = [&](int r) -> size_t { return (size_t)(row0 + r) * dims[4] + (size_t)batch * dims[5]; };
if (tid < TM) {
  rsx[tid] = tid < rows ? xscale[x_row(tid)] : 0.0f;
}
""" + BULK_B.replace("B_TILE", "((size_t)batch * dims[6] + GROUP_X) * groups * PLANE_WORDS") + """
ds4_barrier();
const GLOBAL_MEM uint32_t* w_src[WC * TN / THREADS];
bool w_ok[WC * TN / THREADS];
#pragma unroll
for (int i = 0; i < WC * TN / THREADS; ++i) {
  const int c = tid + THREADS * i;
  w_ok[i] = col0 + c / WC < n_out;
  w_src[i] = wq + ((size_t)batch * n_out + col0 + (w_ok[i] ? c / WC : 0)) * words + 4 * (c % WC);
}
const bool s_ok = BITS == 8 && tid < TN && col0 + tid < n_out;
const GLOBAL_MEM float* s_src = scales + (BITS == 8 ? ((size_t)batch * n_out + col0 + (s_ok ? tid : 0)) * groups : 0);
auto load_stage = [&](int s) {
  SHARED_MEM unsigned int* st = buffer + (s % STAGES) * STAGE;
  load_b(s);
  #pragma unroll
  for (int i = 0; i < WC * TN / THREADS; ++i) {
    ds4_copy16_async(reinterpret_cast<SHARED_MEM float*>(st + B_WORDS + 4 * (tid + THREADS * i)),
                     reinterpret_cast<const GLOBAL_MEM float*>(w_src[i] + s * (TK * BITS / 32)), w_ok[i]);
  }
  if (BITS == 8 && tid < TN) {
    ds4_copy4_async(reinterpret_cast<SHARED_MEM float*>(st + B_WORDS + WW + tid), s_src + s, s_ok);
  }
};
#pragma unroll
for (int s = 0; s < AHEAD; ++s) {
  if (s < groups) {
    load_stage(s);
  }
  ds4_async_commit();
}
const unsigned int centre = 0x64806480u;
float acc[16][2][2] = {};
float part[2][64];
float scale[2][2];
unsigned int frag[2][2][4];
auto issue = [&](int s, float (&p)[64], float (&sc)[2], unsigned int (&a)[2][4]) {
  ds4_async_wait_keep<AHEAD - 1>();
  wait_b(s);
  ds4_barrier();
  if (s + AHEAD < groups) {
    load_stage(s + AHEAD);
  }
  ds4_async_commit();
  const SHARED_MEM unsigned int* st = buffer + (s % STAGES) * STAGE;
  const SHARED_MEM unsigned int* ws = st + B_WORDS;
  if (BITS == 16) {
    const uint4 v0 = reinterpret_cast<const SHARED_MEM uint4*>(ws + wrow * 16)[tig];
    const uint4 v1 = reinterpret_cast<const SHARED_MEM uint4*>(ws + (wrow + 8) * 16)[tig];
    a[0][0] = v0.x;
    a[0][1] = v1.x;
    a[0][2] = v0.y;
    a[0][3] = v1.y;
    a[1][0] = v0.z;
    a[1][1] = v1.z;
    a[1][2] = v0.w;
    a[1][3] = v1.w;
  } else {
    const uint2 v0 = reinterpret_cast<const SHARED_MEM uint2*>(ws + wrow * 8)[tig];
    const uint2 v1 = reinterpret_cast<const SHARED_MEM uint2*>(ws + (wrow + 8) * 8)[tig];
    const unsigned int r0[2] = {v0.x, v0.y};
    const unsigned int r1[2] = {v1.x, v1.y};
    #pragma unroll
    for (int kk = 0; kk < 2; ++kk) {
      a[kk][0] = ds4_quant_half2(r0[kk], 0x4140u, centre);
      a[kk][1] = ds4_quant_half2(r1[kk], 0x4140u, centre);
      a[kk][2] = ds4_quant_half2(r0[kk], 0x4342u, centre);
      a[kk][3] = ds4_quant_half2(r1[kk], 0x4342u, centre);
    }
    const SHARED_MEM float* scs = reinterpret_cast<const SHARED_MEM float*>(ws + WW);
    sc[0] = scs[wrow];
    sc[1] = scs[wrow + 8];
  }
  ds4_wgmma_fence();
  #pragma unroll
  for (int half = 0; half < 1 + OVERLAP; ++half) {
    #pragma unroll
    for (int kk = 0; kk < 2; ++kk) {
      ds4_wgmma_split<(128 >> OVERLAP), LBO, SBO>(p + 32 * half, a[kk],
                                                  st + kk * 2 * (LBO / 4) + half * 8 * (SBO / 4), PLANE_WORDS, kk);
    }
    ds4_wgmma_commit();
  }
};
auto wait_all = [&](float (&p)[64], unsigned int (&a)[2][4]) {
  ds4_wgmma_wait<0>(p);
  ds4_wgmma_hold(a[0]);
  ds4_wgmma_hold(a[1]);
};
auto wait_older = [&](float (&p)[64], unsigned int (&a)[2][4]) {
  ds4_wgmma_wait<1>(p);
  ds4_wgmma_hold(a[0]);
  ds4_wgmma_hold(a[1]);
};
auto drain = [&](const float (&p)[64], const float (&sc)[2], int j0 = 0, int j1 = 16) {
  #pragma unroll
  for (int j = j0; j < j1; ++j) {
    #pragma unroll
    for (int h = 0; h < 2; ++h) {
      #pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float sum = p[4 * j + 2 * h + e];
        acc[j][e][h] = BITS == 16 ? acc[j][e][h] + sum : fmaf(sc[h], sum, acc[j][e][h]);
      }
    }
  }
};
if (PIPELINE == 0) {
  for (int s = 0; s < groups; ++s) {
    issue(s, part[0], scale[0], frag[0]);
    if (OVERLAP) {
      ds4_wgmma_wait<1>(part[0]);
      drain(part[0], scale[0], 0, 8);
    }
    wait_all(part[0], frag[0]);
    drain(part[0], scale[0], OVERLAP ? 8 : 0, 16);
  }
} else {
  for (int s = 0; s < groups; s += 2) {
    issue(s, part[0], scale[0], frag[0]);
    if (s > 0) {
      wait_older(part[1], frag[1]);
      drain(part[1], scale[1]);
    }
    if (s + 1 < groups) {
      issue(s + 1, part[1], scale[1], frag[1]);
      wait_older(part[0], frag[0]);
      drain(part[0], scale[0]);
    }
  }
  if (groups & 1) {
    wait_all(part[0], frag[0]);
    drain(part[0], scale[0]);
  } else {
    wait_all(part[1], frag[1]);
    drain(part[1], scale[1]);
  }
}
""" + STORE.replace("(Y_ROW0 + r)", "x_row(r)")
"""Stage s (group s of K) lands in buffer s % STAGES, AHEAD groups ahead: B's two planes (hi, then lo) as two bulk
copies of the tile's group s in halfsplit's tiles layout (8 KB each, thread 0's, counted on the stage's barrier
`landed`: tokens past T are the layout's zero rows), the quant words as they are (TN rows, cp.async), the group's TN
scales (Q8_0). W rows past OUT read as zero quants with scale 0. A step waits for its own cp.async copies and the
stage's barrier (phase s / STAGES), then passes one barrier: every thread's copies landed, and every warpgroup has
waited for the wgmma that read the buffer the next copies overwrite.
Lane 4 g + t of warp w holds W rows wrow = 64 (w / 4) + 16 (w % 4) + g and wrow + 8 (mma's A fragment rows g,
g + 8); each k-step multiplies its fragment by the lo plane, then the hi plane, into the same partial sums, whose
n8 block j holds tokens 8 j + 2 t and 8 j + 2 t + 1 of those rows (part[4 j ..]). STAGE, a stage's words, is
`stage_words`'s."""


@cache
def kernel(bits: int, warpgroups: int = WARPGROUPS, stages: int = STAGES) -> Kernel:
    """The kernel for Q8_0 (bits 8) or F16 (16) weights. CUDA sm_90a only. Its threadgroup memory, `stages` x
    `stage_words`, is dynamic: 91 KB for Q8_0, 112 KB for F16 at three warpgroups and four stages."""
    return Kernel(f"ds4_dense_wgmma_{bits}_{warpgroups}_{stages}", ("xhi", "xlo", "wq", "scales", "dims", "xscale"),
                  ("y",), _SOURCE, shared_memory=4 * stages * stage_words(bits, warpgroups),
                  launch_bounds=(128 * warpgroups, 1))


def wgmma_affine_matmul(x: mx.array, weight: AffineWeight, plan: tuple[int, int, int, int, int] = PLAN,
                        interleaved: bool = False) -> mx.array:
    """x @ W.T as float32 for a Q8_0 affine W (OUT, IN) and x (..., IN), or W (G, OUT, IN) and x (G, T, IN), or
    with `interleaved` x (T, G, IN) -> (T, G, OUT): group g of each row by W's matrix g, read and written where
    they lie (the grouped output projection's rows, which a (G, T, ...) batch would copy twice). `plan`:
    (PIPELINE, AHEAD, WARPGROUPS, OVERLAP, STAGES), which bench/prefill_gemms.py compares."""
    if weight.bits != 8:
        raise ValueError(f"the wgmma kernel takes Q8_0 weights (8 bits), not {weight.bits}")
    n_batch = 1 if weight.wq.ndim == 2 else weight.wq.shape[0]
    return _launch(x, n_batch, weight.shape[-2], weight.wq, weight.scales.astype(mx.float32), 8, plan, interleaved)


def wgmma_half_matmul(x: mx.array, w: mx.array, plan: tuple[int, int, int, int, int] = PLAN) -> mx.array:
    """x @ W.T as float32 for a float16 W (OUT, IN), IN a multiple of 32, and float32 x (..., IN)."""
    return _launch(x, 1, w.shape[0], w.view(mx.uint32), mx.zeros((1,), dtype=mx.float32), 16, plan)


def _launch(x: mx.array, n_batch: int, n_out: int, wq: mx.array, scales: mx.array, bits: int,
            plan: tuple[int, int, int, int, int], interleaved: bool = False) -> mx.array:
    """One launch over x (..., IN), its leading axes n_batch batches of rows (one, or one per matrix of W), or
    with `interleaved` rows of n_batch groups: token t's group g is row t n_batch + g of x and of y (dims[4:]:
    x's rows from one token to the next, and from one batch to the next)."""
    n_in = x.shape[-1]
    lead = x.shape[:-1]
    n_rows = x.size // n_in // n_batch
    if n_rows == 0:
        return mx.zeros((*lead, n_out), dtype=mx.float32)
    pipeline, ahead, warpgroups, overlap, stages = plan
    if not 1 <= ahead <= stages - 1 - pipeline:
        raise ValueError(f"copies {ahead} groups ahead do not fit {stages} stages with PIPELINE {pipeline}")
    if overlap and pipeline:
        raise ValueError("OVERLAP's halves are drained within a group: PIPELINE must be 0")
    tn, threads = 64 * warpgroups, 128 * warpgroups
    col_tiles = -(-n_out // tn)
    steps = (n_batch, 1) if interleaved else (1, n_rows)
    hi, lo, row_scale = held_split(x, n_batch, layout="tiles", interleaved=interleaved)
    (y,) = build(kernel(bits, warpgroups, stages), current_backend())(
        inputs=[hi, lo, wq, scales,
                mx.array([n_rows, n_out, n_in, col_tiles, *steps, tile_count(n_rows)], dtype=mx.int32), row_scale],
        template=[("TM", TM), ("TN", tn), ("TK", TK), ("STAGES", stages), ("STAGE", stage_words(bits, warpgroups)),
                  ("THREADS", threads), ("BITS", bits), ("PLANE_WORDS", PLANE_WORDS), ("LBO", LBO), ("SBO", SBO),
                  ("PIPELINE", pipeline), ("AHEAD", ahead), ("OVERLAP", overlap)],
        grid=(-(-n_rows // TM) * threads, col_tiles * n_batch, 1), threadgroup=(threads, 1, 1),
        output_shapes=[(n_batch * n_rows, n_out)], output_dtypes=[mx.float32],
    )
    return y.reshape(*lead, n_out)


def _reference(*args) -> tuple[mx.array, ...]:
    one, batch = DENSE_F16.reference(*args)
    return one, batch, batch


def _fast(ggml_type: GGMLType, blocks, x, bank, xb) -> tuple[mx.array, ...]:
    """The probe's product, its batch, and the batch's rows interleaved (swapped there and back)."""
    w, wb = to_affine(blocks, ggml_type, PROBE_SHAPE), to_affine(bank, ggml_type, PROBE_BANK)
    rows = wgmma_affine_matmul(mx.swapaxes(xb, 0, 1), wb, interleaved=True)
    return wgmma_affine_matmul(x, w), wgmma_affine_matmul(xb, wb), mx.swapaxes(rows, 0, 1)


def _half_fast(x: mx.array, w: mx.array) -> mx.array:
    return wgmma_half_matmul(x, w)


DENSE_WGMMA = FastPath("dense_affine_wgmma", _reference, _fast, DENSE_F16.probe, tolerance=TOLERANCE,
                       backends=("cuda",))
"""Q8_0 projections of a prefill batch by warpgroup products; key: the ggml type (Q8_0 only: `fits`). The probe
and bound are dense_f16.py's (two partial column and row tiles, a batch of matrices; 1e-5 of the largest output)."""
HALF_WGMMA = FastPath("half_batch_wgmma", HALF_BATCH.reference, _half_fast, HALF_BATCH.probe, tolerance=TOLERANCE,
                      backends=("cuda",))
"""F16 projections of a prefill batch by warpgroup products; key (OUT, IN). Probe and bound: dense_f16.py's."""


@cache
def _hopper() -> bool:
    info = mx.device_info()
    return int(info.get("compute_capability_major", 0)) == 9


def hopper() -> bool:
    """Whether the GPU has wgmma (compute capability 9.x, sm_90a; Blackwell's tensor cores take other instructions),
    or graphs are being planned for CUDA (registry.planning: counted as the H200 runs them). Elsewhere the kernels
    are not tried at all, so that no first-use check warns on every other NVIDIA GPU."""
    if planned() is not None:
        return planned() == "cuda"
    return current_backend() == "cuda" and _hopper()


def fits(x: mx.array, weight: AffineWeight) -> bool:
    """Whether the kernel takes this product: on a Hopper GPU, Q8_0, and a 2-D W or a batch of W with a batch of
    x."""
    return weight.bits == 8 and hopper() and dense_fits(x, weight)


def half_product(x: mx.array, w: mx.array) -> mx.array:
    """x @ W.T for a float16 W (OUT, IN) and a prefill batch x: by warpgroup products on a Hopper GPU where their
    check passed, else dense_f16.py's kernel (whose check the caller has passed)."""
    if hopper() and HALF_WGMMA.enabled(tuple(w.shape)):
        return wgmma_half_matmul(x, w)
    return half_matmul(x, w)
