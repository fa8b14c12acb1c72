"""The compressor's decode step (ds4.c) as one kernel: insert the token into the frontier, pool its window,
and shift the frontier when the window is complete; and a prefill chunk's pooling as one kernel (`CompressorChunk`).

In MLX ops this is ~17 launches (the row insert, the lane split of ratio 4, a softmax, a product and a sum, the
shift and two selects), twice per ratio-4 layer (attention and indexer rows) and once per ratio-128 layer.

It is latency-bound (at most 1 MB of frontier read and written, at ratio 128), so the work is spread wide: a
threadgroup owns COLS pooled dims and all their candidates (8 for ratio 4: lane 0 of rows 0..3 and lane 1 of rows
4..7; the 128 rows for ratio 128), thread (c, g) of it candidates g, g + G, ... of dim c. The softmax's max and
its two sums (of e and of e * kv) are reduced across the G threads of a dim by SIMD shuffles, then across SIMD
groups through threadgroup memory, and each thread writes the new frontier rows of the candidates it holds.
Ratio 4 runs one SIMD group per 4 dims (128 groups for width 512, 32 for 128), ratio 128 eight per 8 dims (64
groups), each thread holding 4 rows. (One thread per dim, looping over the rows, took 14-90 us on the H200.)

A ratio-4 layer with an indexer steps its two compressors (attention rows 512 wide, indexer rows 128) at the same
position and ratio, so PAIR_KERNEL does both in one launch: its first D_A / COLS threadgroups run the text on the
attention compressor's arrays, the rest on the indexer's (each group picks its pointers and width, then the same
_STEP text runs), saving one launch per ratio-4 layer.

Its reference is `pool_step` in model/compressor.py, handed in by the model; the kernel equals it to float32
rounding: the sums in another order and the division by the total once, at the end (sum(e * kv) / sum(e) where
the reference sums softmax(s) * kv).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

import mlx.core as mx

from ..machinery.dialect import Kernel, build
from ..machinery.probe import random_activations
from ..machinery.registry import FastPath, current_backend

TOLERANCE = 1e-5
LAYOUTS = {4: (4, 32), 128: (8, 256)}
"""ratio -> (COLS pooled dims per threadgroup, THREADS per threadgroup); G = THREADS / COLS threads share a dim."""

_LAYOUT = """
constexpr int ROWS = COFF * R;         // candidates of one pooled dim
constexpr int G = THREADS / COLS;      // threads sharing one pooled dim
constexpr int PER = ROWS / G;          // candidates per thread
constexpr int SIMDS = THREADS / 32;
SHARED float part_top[SIMDS * COLS];
SHARED float part_total[SIMDS * COLS];
SHARED float part_acc[SIMDS * COLS];
const int c = THREAD_IN_GROUP % COLS;
const int g = THREAD_IN_GROUP / COLS;
"""
"""The threadgroup's shape, whatever the width (so at kernel scope, where Metal wants threadgroup memory declared)."""

_ONE = """
constexpr int W = COFF * D;            // frontier row width
const int j = GROUP_X * COLS + c;      // the pooled dim
"""
"""One compressor of width D (a template constant): every threadgroup pools COLS of its dims."""

_STEP = """
const int slot = position[0] % R;
const int here = (COFF == 2 ? R : 0) + slot;
const bool done = slot == R - 1;
const float empty_score = -ds4_float(0x7f800000u);  // -inf: a row without a token weighs nothing
float s[PER];
float v[PER];
float top = empty_score;
for (int k = 0; k < PER; ++k) {
  const int i = g + k * G;
  const int col = (COFF == 2 && i >= R) ? D + j : j;
  const float held_score = frontier_score[i * W + col];  // loaded whatever the position: no wait on it
  const float held_kv = frontier_kv[i * W + col];
  s[k] = i == here ? score[col] + ape[slot * W + col] : held_score;
  v[k] = i == here ? kv[col] : held_kv;
  top = s[k] > top ? s[k] : top;
}
for (int k = 0; k < PER; ++k) {  // the new frontier: rows i at columns j (lane 0) and D + j (lane 1)
  const int i = g + k * G;
  const int own = (COFF == 2 && i >= R) ? 1 : 0;  // the lane of the candidate held in s[k], v[k]
  const int from = done ? (COFF == 2 && i < R ? i + R : -1) : i;
  for (int lane = 0; lane < COFF; ++lane) {
    const int col = lane * D + j;
    float fk = 0.0f;
    float fs = empty_score;
    if (from == i && lane == own) {
      fk = v[k];
      fs = s[k];
    } else if (from >= 0) {
      fk = from == here ? kv[col] : frontier_kv[from * W + col];
      fs = from == here ? score[col] + ape[slot * W + col] : frontier_score[from * W + col];
    }
    new_kv[i * W + col] = fk;
    new_score[i * W + col] = fs;
  }
}
for (int mask = COLS; mask < 32; mask <<= 1) {  // lanes of one SIMD group holding the same dim
  const float other = ds4_simd_xor(top, mask);
  top = other > top ? other : top;
}
if (SIMDS > 1) {
  if (SIMD_LANE < COLS) {
    part_top[SIMD_INDEX * COLS + c] = top;
  }
  ds4_barrier();
  for (int w = 0; w < SIMDS; ++w) {
    top = part_top[w * COLS + c] > top ? part_top[w * COLS + c] : top;
  }
}
float total = 0.0f;
float acc = 0.0f;
for (int k = 0; k < PER; ++k) {
  const float e = ds4_exp(s[k] - top);
  total += e;
  acc += e * v[k];
}
for (int mask = COLS; mask < 32; mask <<= 1) {
  total += ds4_simd_xor(total, mask);
  acc += ds4_simd_xor(acc, mask);
}
if (SIMDS > 1) {
  if (SIMD_LANE < COLS) {
    part_total[SIMD_INDEX * COLS + c] = total;
    part_acc[SIMD_INDEX * COLS + c] = acc;
  }
  ds4_barrier();
  total = 0.0f;
  acc = 0.0f;
  for (int w = 0; w < SIMDS; ++w) {
    total += part_total[w * COLS + c];
    acc += part_acc[w * COLS + c];
  }
}
if (g == 0) {
  pooled[j] = acc / total;
}
"""

_INPUTS = ("kv", "score", "ape", "frontier_kv", "frontier_score")
_OUTPUTS = ("pooled", "new_kv", "new_score")

STEP_KERNEL = Kernel("ds4_compressor_step", (*_INPUTS, "position"), _OUTPUTS, _LAYOUT + _ONE + _STEP)

_TWO = """
const bool second = GROUP_X >= D_A / COLS;  // groups 0..D_A/COLS-1 pool compressor a's dims, the rest b's
const int D = second ? D_B : D_A;
const int W = COFF * D;
const int j = (second ? GROUP_X - D_A / COLS : GROUP_X) * COLS + c;
""" + "".join(f"const GLOBAL_MEM float* {name} = second ? {name}_b : {name}_a;\n" for name in _INPUTS) + "".join(
    f"GLOBAL_MEM float* {name} = second ? {name}_b : {name}_a;\n" for name in _OUTPUTS)
"""Two compressors of one ratio (widths D_A and D_B): each threadgroup picks its compressor's arrays and width, and
runs the one compressor's text on them under the names it uses."""

PAIR_KERNEL = Kernel("ds4_compressor_step_pair",
                     (*(f"{name}_{x}" for x in "ab" for name in _INPUTS), "position"),
                     tuple(f"{name}_{x}" for x in "ab" for name in _OUTPUTS), _LAYOUT + _TWO + _STEP)


_CHUNK = """
const int waiting = info[0] % R;              // tokens of the current window already in the frontier
const int n_rows = (waiting + info[1]) / R;   // windows the chunk finishes
const int done = n_rows * R;
const int left = waiting + info[1] - done;    // tokens of the window it leaves open
constexpr int W = COFF * D;
constexpr int CURRENT = COFF == 2 ? R : 0;    // the frontier's first row of the current window
const float empty_score = -ds4_float(0x7f800000u);
const size_t i = (size_t)GROUP_X * THREADS + THREAD_IN_GROUP;
if (i < (size_t)n_rows * D) {  // pooled row w, dim j: the maximum of its candidates' scores, then sum(e kv) / sum(e)
  const int w = (int)(i / D);
  const int j = (int)(i % D);
  float top = empty_score;
  for (int k = 0; k < COFF * R; ++k) {
    const float c = ds4_candidate(score, frontier_score, ape, true, k, w, j, waiting, R, D, COFF);
    top = c > top ? c : top;
  }
  float total = 0.0f;
  float acc = 0.0f;
  for (int k = 0; k < COFF * R; ++k) {
    const float x = ds4_exp(ds4_candidate(score, frontier_score, ape, true, k, w, j, waiting, R, D, COFF) - top);
    total += x;
    acc += x * ds4_candidate(kv, frontier_kv, ape, false, k, w, j, waiting, R, D, COFF);
  }
  pooled[i] = acc / total;
} else if (i < (size_t)n_rows * D + COFF * R * W) {  // the new frontier's row f at column col
  const int at = (int)(i - (size_t)n_rows * D);
  const int f = at / W;
  const int col = at % W;
  const int e = f < CURRENT ? done - R + f : done + f - CURRENT;  // the last finished window's rows, then the open one
  const bool held = f < CURRENT || f - CURRENT < left;
  new_kv[at] = held ? ds4_entry(kv, frontier_kv, ape, false, e, col, waiting, CURRENT, R, W) : 0.0f;
  new_score[at] = held ? ds4_entry(score, frontier_score, ape, true, e, col, waiting, CURRENT, R, W) : empty_score;
}
"""
"""A chunk's pooling (`pool_chunk`): thread i < n_rows D pools row i / D at dim i % D over its window's candidates,
the maximum first, then sum(e kv) / sum(e); the threads after those copy the new frontier's rows out of the extended
sequence (the frontier's waiting tokens, then the chunk's; zeros and -inf past the open window's tokens)."""

_EXT = """
DEVICE_FN float ds4_entry(const GLOBAL_MEM float* chunk, const GLOBAL_MEM float* held, const GLOBAL_MEM float* ape,
                          bool with_ape, int e, int col, int waiting, int current, int r, int w) {
  if (e < waiting) {
    return held[(current + e) * w + col];
  }
  const float value = chunk[(size_t)(e - waiting) * w + col];
  return with_ape ? value + ape[(e % r) * w + col] : value;
}
DEVICE_FN float ds4_candidate(const GLOBAL_MEM float* chunk, const GLOBAL_MEM float* held,
                              const GLOBAL_MEM float* ape, bool with_ape, int k, int row, int j, int waiting, int r,
                              int d, int coff) {
  const bool previous = coff == 2 && k < r;  // ratio 4: lane 0 of the previous window (the frontier's before row 0)
  if (previous && row == 0) {
    return held[k * coff * d + j];
  }
  return ds4_entry(chunk, held, ape, with_ape, previous ? (row - 1) * r + k : row * r + k % r,
                   previous ? j : (coff - 1) * d + j, waiting, coff == 2 ? r : 0, r, coff * d);
}
"""
"""`ds4_entry`: entry e of a chunk's extended sequence at a column, the frontier's waiting tokens (its current
window's rows) then the chunk's rows, whose scores get their slot's ape (slot e % r: the extended sequence starts a
window). `ds4_candidate`: candidate k of pooled row `row` at dim j, ratio 4's 2r (the previous window's lane 0,
then this one's lane 1), ratio 128's r."""

CHUNK_KERNEL = Kernel("ds4_compressor_chunk", (*_INPUTS, "info"), _OUTPUTS, _CHUNK, _EXT)
CHUNK_THREADS = 256


class CompressorChunk:
    """A prefill chunk's compressor pooling (rows it finishes, before their finish, and the new frontier) in one
    launch where the kernel passed its check. In MLX ops it is ~25 launches a compressor (the ape gather and add,
    the frontier's waiting rows joined to the chunk's, the previous window's lane joined to each window, a
    softmax, a product and a sum, the new frontier's four joins), the joins copying the chunk's (T, coff D) kv and
    scores several times: twice per ratio-4 layer (attention and indexer rows), once per ratio-128 layer."""

    def __init__(self, reference: Callable[..., tuple[mx.array, mx.array, mx.array]]):
        self.fast_path = FastPath("compressor_chunk", reference, self._kernel, self._probe,
                                  tolerance=(TOLERANCE, 0.0, 0.0), backends=("cuda", "metal"))

    def __call__(self, kv: mx.array, score: mx.array, ape: mx.array, frontier_kv: mx.array,
                 frontier_score: mx.array, n_past: int, ratio: int, width: int
                 ) -> tuple[mx.array, mx.array, mx.array]:
        """kv, score (T, coff*width) of a chunk at positions n_past.. (score without ape), ape (ratio,
        coff*width), the frontier (coff*ratio, coff*width) twice -> the pooled rows it finishes (n, width) and the
        new frontier."""
        args = (kv, score, ape, frontier_kv, frontier_score, n_past, ratio, width)
        if ((n_past % ratio + kv.shape[0]) // ratio == 0 or ratio not in LAYOUTS
                or any(a.dtype != mx.float32 for a in args[:5])):
            return self.fast_path.reference(*args)  # no row finished: a few ops on at most a window of rows
        return self.fast_path(*args, key=(ratio, width))

    @staticmethod
    def _kernel(kv, score, ape, frontier_kv, frontier_score, n_past, ratio, width):
        coff = 2 if ratio == 4 else 1
        n_rows = (n_past % ratio + kv.shape[0]) // ratio
        threads = n_rows * width + frontier_kv.size
        return tuple(build(CHUNK_KERNEL, current_backend())(
            inputs=[kv, score, ape, frontier_kv, frontier_score, mx.array([n_past, kv.shape[0]], dtype=mx.int32)],
            template=[("R", ratio), ("D", width), ("COFF", coff), ("THREADS", CHUNK_THREADS)],
            grid=(-(-threads // CHUNK_THREADS) * CHUNK_THREADS, 1, 1), threadgroup=(CHUNK_THREADS, 1, 1),
            output_shapes=[(n_rows, width), frontier_kv.shape, frontier_kv.shape],
            output_dtypes=[mx.float32] * 3,
        ))

    @staticmethod
    def _probe(key: Hashable) -> tuple:
        """A chunk of 3 windows and a token meeting a frontier with 2 (ratio 4) or 5 (ratio 128) tokens waiting
        and, at ratio 4, the previous window's rows; the open window's rows past them empty (-inf)."""
        ratio, width = key
        coff = 2 if ratio == 4 else 1
        waiting = 2 if ratio == 4 else 5
        rows, cols = coff * ratio, coff * width
        live = (mx.arange(rows) < (coff - 1) * ratio + waiting)[:, None]
        return (random_activations((3 * ratio + 1, cols), seed=66), random_activations((3 * ratio + 1, cols), seed=67),
                random_activations((ratio, cols), seed=68), mx.where(live, random_activations((rows, cols), seed=69), 0),
                mx.where(live, 3 * random_activations((rows, cols), seed=70), -mx.inf), 7 * ratio + waiting, ratio,
                width)


class CompressorStep:
    """(pooled row, new frontier kv, new frontier score) of one decode token, by the kernel where it passed."""

    def __init__(self, reference: Callable[..., tuple[mx.array, mx.array, mx.array]]):
        self.fast_path = FastPath("compressor_step", reference, self._kernel, self._probe, tolerance=TOLERANCE,
                                  backends=("cuda", "metal"))

    def __call__(self, kv: mx.array, score: mx.array, ape: mx.array, frontier_kv: mx.array,
                 frontier_score: mx.array, position: mx.array, ratio: int, width: int
                 ) -> tuple[mx.array, mx.array, mx.array]:
        """kv, score (1, coff*width) of the token (score without ape), ape (ratio, coff*width), the frontier
        (coff*ratio, coff*width) twice, position (int32, scalar or (1,)) -> (1, width) and the new frontier."""
        return self.fast_path(kv, score, ape, frontier_kv, frontier_score, position, ratio, width,
                              key=(ratio, width))

    @staticmethod
    def _kernel(kv, score, ape, frontier_kv, frontier_score, position, ratio, width):
        cols, threads, coff = _layout(ratio, width)
        return tuple(build(STEP_KERNEL, current_backend())(
            inputs=[kv, score, ape, frontier_kv, frontier_score, position.reshape(1).astype(mx.int32)],
            template=[("R", ratio), ("D", width), ("COFF", coff), ("COLS", cols), ("THREADS", threads)],
            grid=(width // cols * threads, 1, 1), threadgroup=(threads, 1, 1),
            output_shapes=[(1, width), frontier_kv.shape, frontier_kv.shape],
            output_dtypes=[mx.float32] * 3,
        ))

    @staticmethod
    def _probe(key: Hashable) -> tuple:
        ratio, width = key
        coff = 2 if ratio == 4 else 1
        rows, cols = coff * ratio, coff * width
        live = (mx.arange(rows) < rows - 1)[:, None]  # one row without a token yet: -inf, as a frontier has
        return (random_activations((1, cols), seed=61), random_activations((1, cols), seed=62),
                random_activations((ratio, cols), seed=63), random_activations((rows, cols), seed=64),
                mx.where(live, random_activations((rows, cols), seed=65), -mx.inf),
                mx.array(ratio - 1 if ratio == 4 else 5, dtype=mx.int32), ratio, width)


class CompressorStepPair:
    """The decode step of two compressors of one ratio (a layer's attention and indexer compressors) in one launch
    where the kernel passed: one step's launch overhead instead of two, on every ratio-4 layer."""

    def __init__(self, reference: Callable[..., tuple[mx.array, mx.array, mx.array]]):
        """`reference` is the one-compressor step (CompressorStep's reference): the pair's is it twice."""
        self.one = reference
        self.fast_path = FastPath("compressor_step_pair", self._reference, self._kernel, self._probe,
                                  tolerance=TOLERANCE, backends=("cuda", "metal"))

    def __call__(self, a: Sequence[mx.array], b: Sequence[mx.array], position: mx.array, ratio: int, width_a: int,
                 width_b: int) -> tuple[tuple[mx.array, mx.array, mx.array], tuple[mx.array, mx.array, mx.array]]:
        """a and b each (kv, score, ape, frontier_kv, frontier_score) of one compressor, as CompressorStep takes
        them, at widths width_a and width_b -> each one's (pooled row, new frontier kv, new frontier score)."""
        out = self.fast_path(*a, *b, position, ratio, width_a, width_b, key=(ratio, width_a, width_b))
        return out[:3], out[3:]

    def _reference(self, *args: object) -> tuple[mx.array, ...]:
        position, ratio, width_a, width_b = args[10:]
        return (*self.one(*args[:5], position, ratio, width_a), *self.one(*args[5:10], position, ratio, width_b))

    @staticmethod
    def _kernel(*args: object) -> tuple[mx.array, ...]:
        position, ratio, width_a, width_b = args[10:]
        cols, threads, coff = _layout(ratio, width_a, width_b)
        frontier_a, frontier_b = args[3].shape, args[8].shape
        return tuple(build(PAIR_KERNEL, current_backend())(
            inputs=[*args[:10], position.reshape(1).astype(mx.int32)],
            template=[("R", ratio), ("D_A", width_a), ("D_B", width_b), ("COFF", coff), ("COLS", cols),
                      ("THREADS", threads)],
            grid=((width_a + width_b) // cols * threads, 1, 1), threadgroup=(threads, 1, 1),
            output_shapes=[(1, width_a), frontier_a, frontier_a, (1, width_b), frontier_b, frontier_b],
            output_dtypes=[mx.float32] * 6,
        ))

    @staticmethod
    def _probe(key: Hashable) -> tuple:
        ratio, width_a, width_b = key
        a = CompressorStep._probe((ratio, width_a))
        b = CompressorStep._probe((ratio, width_b))
        return (*a[:5], *b[:5], a[5], ratio, width_a, width_b)


def _layout(ratio: int, *widths: int) -> tuple[int, int, int]:
    """(COLS, THREADS, COFF) of the step at `ratio` for compressors of these widths."""
    if ratio not in LAYOUTS or any(width % LAYOUTS[ratio][0] for width in widths):
        raise ValueError(f"no compressor-step layout for ratio {ratio} and widths {widths}")
    return (*LAYOUTS[ratio], 2 if ratio == 4 else 1)
