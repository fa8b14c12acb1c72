"""Kernels of the attention sublayer (ds4.c): RoPE and one query token's attention (a chunk's queries:
chunk_attention.py).

- `ROPE`: rotates the trailing n_rot dims of rows (R, D) in adjacent pairs by the angles whose cos and sin it is
  given per position (the caller computes them once per position: in a compiled step, once for all layers), or
  by the negated angles. In MLX ops a rotation is ~5 launches (two products, two sums, a stack and a
  concatenation); a decode step has six per compressed layer.
- `DECODE_ATTENTION`: the decode step's attention core for one query token in one launch, where its reference is
  ~50 MLX ops and the step took ~10 launches with the former kernels (norm, two RoPEs, masks, key joins, a
  gather, attention). q_b's output is normed per head (RMSNorm without weight) and rotated at the token's
  position as the kernel loads it; softmax attention with sinks runs over the raw window, then (by kind,
  KEY_SETS) nothing, the visible compressed rows or the indexer's picked rows, each read where it is stored (no
  joined key array, no gathered rows) with its mask computed from the position; the output is rotated back by
  the negated angle as it is written. The angles are position * inv_freq in float32, as the reference's, with
  cos and sin taken in the kernel (ds4_cos, ds4_sin). One threadgroup per head; each SIMD group runs an online
  softmax over every eighth key, KEYS keys a step, with D / 32 dims per lane, and the groups' partial sums are
  merged with the sink at the end. Or (SPLIT_KERNELS, `splits_for`) SPLITS threadgroups a head, each over its
  share of the keys, the last to finish merging the shares: more of the GPU for a few heads, chosen on CUDA for
  the indexer's picked rows, where bench/attention_plans.py measured it faster.

Their references are the model's plain formulas (model/rope.py, model/attention.py), handed in by the model; the
kernels equal them to float32 rounding (TOLERANCE): the same products, summed in another order.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable
from typing import NamedTuple

import mlx.core as mx
import numpy as np

from ..machinery.dialect import SIMD_WIDTH, Kernel, build
from ..machinery.probe import random_activations
from ..machinery.registry import FastPath, current_backend

TOLERANCE = 1e-5
"""Float32 summation order (a 512-long dot product and sum of squares, a softmax over up to a few thousand keys,
online or with the global maximum) and cos/sin rounding: ~1e-6 of the largest output, with margin. The same bound
serves both attention kernels: the chunk one sums the same products as `attend`, in another order."""

_ROPE = """
const size_t i = (size_t)GROUP_X * THREADS + THREAD_IN_GROUP;
if (i < (size_t)count[0] * D) {
  const size_t row = i / D;
  const int d = (int)(i - row * D);
  if (d < D - NROT) {
    y[i] = x[i];
  } else {
    const size_t k = (row / HEADS) * (NROT / 2) + ((d - (D - NROT)) >> 1);
    const float c = cos_t[k];
    const float s = INVERSE ? -sin_t[k] : sin_t[k];
    const size_t even = i - ((d - (D - NROT)) & 1);
    const float a = x[even];
    const float b = x[even + 1];
    y[i] = ((d - (D - NROT)) & 1) ? a * s + b * c : a * c - b * s;
  }
}
"""

_ATTEND = """
HEAD_SHARE
const int lane = SIMD_LANE;
const int group = SIMD_INDEX;
constexpr int PER_LANE = D / 32;
constexpr int ROT_START = D - NROT;
const int pos = position[0];
SHARED float rot_cos[NROT / 2];
SHARED float rot_sin[NROT / 2];
for (int i = THREAD_IN_GROUP; i < NROT / 2; i += GROUPS * 32) {
  const float angle = (float)pos * inv_freq[i];  // the reference's float32 product
  rot_cos[i] = ds4_cos(angle);
  rot_sin[i] = ds4_sin(angle);
}
ds4_barrier();
float qv[PER_LANE];
float acc[PER_LANE];
float squares = 0.0f;
for (int j = 0; j < PER_LANE; ++j) {
  qv[j] = q[(size_t)h * D + lane * PER_LANE + j];
  squares += qv[j] * qv[j];
  acc[j] = 0.0f;
}
const float inv_rms = 1.0f / sqrt(ds4_simd_sum(squares) / (float)D + params[1]);
for (int j = 0; j < PER_LANE; j += 2) {  // a lane's dims hold whole pairs: PER_LANE and ROT_START are even
  const int d = lane * PER_LANE + j;
  const float a = qv[j] * inv_rms;
  const float b = qv[j + 1] * inv_rms;
  if (d >= ROT_START) {
    const float c = rot_cos[(d - ROT_START) >> 1];
    const float s = rot_sin[(d - ROT_START) >> 1];
    qv[j] = a * c - b * s;
    qv[j + 1] = a * s + b * c;
  } else {
    qv[j] = a;
    qv[j + 1] = b;
  }
}
const float scale = params[0];
int first = WINDOW - 1 - pos;  // window row n holds position pos - WINDOW + 1 + n: none below 0 yet
first = first > 0 ? first : 0;
EXTRA_KEYS
float m = -3.0e38f;  // below every score: exp(m - top) is 0
float l = 0.0f;
// KEYS keys a step (every (GROUPS * SPLITS)-th from this SIMD group's first): their rows' loads are all issued
// before the first dot product needs one, then one online-softmax update takes the step's scores together
for (int n0 = first + share * GROUPS + group; n0 < WINDOW + extra; n0 += KEYS * GROUPS * SPLITS) {
  float kv[KEYS][PER_LANE];
  bool use[KEYS];
  for (int b = 0; b < KEYS; ++b) {
    const int n = n0 + b * GROUPS * SPLITS;
    use[b] = n < WINDOW + extra;
    const GLOBAL_MEM float* row = window;  // a key not used reads row 0 of the window and weighs 0
    if (use[b]) {
KEY_ROW
    }
    const GLOBAL_MEM float* k = row + lane * PER_LANE;
    if (PER_LANE % 4 == 0) {  // 16-byte loads where a lane's dims allow them
      for (int j = 0; j < PER_LANE / 4; ++j) {
        const float4 v = reinterpret_cast<const GLOBAL_MEM float4*>(k)[j];
        kv[b][4 * j] = v.x;
        kv[b][4 * j + 1] = v.y;
        kv[b][4 * j + 2] = v.z;
        kv[b][4 * j + 3] = v.w;
      }
    } else {
      for (int j = 0; j < PER_LANE; ++j) {
        kv[b][j] = k[j];
      }
    }
  }
  float score[KEYS];
  float top = m;
  for (int b = 0; b < KEYS; ++b) {
    float dot = 0.0f;
    for (int j = 0; j < PER_LANE; ++j) {
      dot += qv[j] * kv[b][j];
    }
    score[b] = ds4_simd_sum(dot) * scale;
    top = use[b] && score[b] > top ? score[b] : top;
  }
  const float alpha = ds4_exp(m - top);
  l = l * alpha;
  for (int j = 0; j < PER_LANE; ++j) {
    acc[j] = acc[j] * alpha;
  }
  for (int b = 0; b < KEYS; ++b) {
    const float p = use[b] ? ds4_exp(score[b] - top) : 0.0f;
    l += p;
    for (int j = 0; j < PER_LANE; ++j) {
      acc[j] += p * kv[b][j];
    }
  }
  m = top;
}
SHARED float part_acc[GROUPS * D];
SHARED float part_m[GROUPS];
SHARED float part_l[GROUPS];
for (int j = 0; j < PER_LANE; ++j) {
  part_acc[group * D + lane * PER_LANE + j] = acc[j];
}
if (lane == 0) {
  part_m[group] = m;
  part_l[group] = l;
}
ds4_barrier();
SHARES_MERGED
const float sink = sinks[h];
float top = sink;
for (int g = 0; g < PARTS; ++g) {
  top = part_m[g] > top ? part_m[g] : top;
}
float weight[PARTS];
float total = ds4_exp(sink - top);
for (int g = 0; g < PARTS; ++g) {
  weight[g] = ds4_exp(part_m[g] - top);
  total += part_l[g] * weight[g];
}
for (int d = THREAD_IN_GROUP; d < D; d += GROUPS * 32) {
  float v = 0.0f;
  for (int g = 0; g < PARTS; ++g) {
    v += part_acc[g * D + d] * weight[g];
  }
  v = v / total;
  if (d >= ROT_START) {  // rotated back by the negated angle: (a, b) -> (a c + b s, b c - a s)
    float partner = 0.0f;  // the other dim of d's pair
    for (int g = 0; g < PARTS; ++g) {
      partner += part_acc[g * D + (d ^ 1)] * weight[g];
    }
    partner = partner / total;
    const float c = rot_cos[(d - ROT_START) >> 1];
    const float s = rot_sin[(d - ROT_START) >> 1];
    v = (d & 1) ? v * c - partner * s : v * c + partner * s;
  }
  out[(size_t)h * D + d] = v;
}
"""

ROPE_KERNEL = Kernel("ds4_rope", ("x", "cos_t", "sin_t", "count"), ("y",), _ROPE)
"""The row count is an input, not a template constant: chunks of every length share one compiled kernel."""
THREADS = 256
GROUPS = 8
KEYS = 4
"""Keys a SIMD group takes a step: their row loads in flight together, where one key at a time made its load, SIMD
sum and exponentials a serial round trip each (16-21 µs a call on the H200 over a window of ~40-128 keys). With
4, at 2k: 18-20 µs over the 128-key window, 21-25 over the window and 512 compressed rows, 55-58 over the window
and 512 picked rows (bench/RESULTS.md, 2026-12-02; no same-context figure of the one-key form to set against
these: not shown to be faster)."""

KEY_SETS: dict[str, tuple[tuple[str, ...], str, str]] = {
    "window": ((), "const int extra = 0;", """
      row = window + (size_t)n * D;"""),
    "rows": (("rows",), """
int extra = (pos + 1) / RATIO;  // compressed rows c < (pos + 1) / ratio are visible
extra = extra < ROWS ? extra : ROWS;""", """
      row = n < WINDOW ? window + (size_t)n * D : rows + (size_t)(n - WINDOW) * D;"""),
    "picked": (("rows", "picked", "valid"), "const int extra = PICKS;", """
      if (n >= WINDOW) {
        use[b] = valid[n - WINDOW];
        row = use[b] ? rows + (size_t)picked[n - WINDOW] * D : window;
      } else {
        row = window + (size_t)n * D;
      }"""),
}
"""Per kind of key set after the window: the inputs it reads, how many keys it adds (`extra`) and where key n's
row is (`row`). "window": none; "rows": the visible compressed rows, a prefix of the buffer;
"picked": the indexer's rows, by index into the buffer, leaving out (`use[b]`) those that are not real."""

WHOLE_HEAD = ("""
const int h = GROUP_X;  // one threadgroup a head
const int share = 0;
constexpr int SPLITS = 1;""", """
constexpr int PARTS = GROUPS;  // the SIMD groups' sums, merged with the sink""")
SPLIT_HEAD = ("""
const int h = GROUP_X / SPLITS;  // SPLITS threadgroups a head, each over every SPLITS-th run of GROUPS keys
const int share = GROUP_X - h * SPLITS;""", """
constexpr int PARTS = SPLITS;  // the head's shares, merged with the sink by the threadgroup that ends last
{
  float top = -3.0e38f;
  for (int g = 0; g < GROUPS; ++g) {
    top = part_m[g] > top ? part_m[g] : top;
  }
  float weight[GROUPS];
  float total = 0.0f;
  for (int g = 0; g < GROUPS; ++g) {
    weight[g] = ds4_exp(part_m[g] - top);
    total += part_l[g] * weight[g];
  }
  GLOBAL_MEM float* mine = partial + (size_t)(h * SPLITS + share) * (D + 2);
  for (int d = THREAD_IN_GROUP; d < D; d += GROUPS * 32) {
    float v = 0.0f;
    for (int g = 0; g < GROUPS; ++g) {
      v += part_acc[g * D + d] * weight[g];
    }
    mine[d] = v;
  }
  if (THREAD_IN_GROUP == 0) {
    mine[D] = top;
    mine[D + 1] = total;
  }
}
SHARED unsigned int last_flag[1];
if (!ds4_last_group(counter + h, SPLITS, last_flag, THREAD_IN_GROUP)) {
  return;
}
for (int i = THREAD_IN_GROUP; i < SPLITS * (D + 2); i += GROUPS * 32) {
  const int g = i / (D + 2);
  const int d = i - g * (D + 2);
  const float v = ds4_load_fresh(partial + (size_t)h * SPLITS * (D + 2) + i);
  if (d < D) {
    part_acc[g * D + d] = v;
  } else if (d == D) {
    part_m[g] = v;
  } else {
    part_l[g] = v;
  }
}
ds4_barrier();""")
"""How a head's keys are shared (the HEAD_SHARE and SHARES_MERGED texts): by one threadgroup (WHOLE_HEAD), or by
SPLITS threadgroups (SPLIT_HEAD, 2 <= SPLITS <= GROUPS), each writing its share's maximum, sum and weighted values
to `partial` (heads x SPLITS x (D + 2)); the last of a head's threadgroups to finish (`counter`, one word a head,
zero between launches) merges them as one threadgroup merges its SIMD groups."""


def _attend_kernel(kind: str, split: bool) -> Kernel:
    inputs, extra, row = KEY_SETS[kind]
    head, merged = SPLIT_HEAD if split else WHOLE_HEAD
    source = (_ATTEND.replace("EXTRA_KEYS", extra.strip("\n")).replace("KEY_ROW", row.strip("\n"))
              .replace("HEAD_SHARE", head.strip("\n")).replace("SHARES_MERGED", merged.strip("\n")))
    if not split:
        return Kernel(f"ds4_decode_attention_{kind}", ("q", "position", "inv_freq", "window", *inputs, "sinks",
                                                        "params"), ("out",), source)
    return Kernel(f"ds4_decode_attention_split_{kind}", ("q", "position", "inv_freq", "window", *inputs, "sinks",
                                                          "params", "counter"), ("out", "partial"), source)


ATTEND_KERNELS = {kind: _attend_kernel(kind, False) for kind in KEY_SETS}
SPLIT_KERNELS = {kind: _attend_kernel(kind, True) for kind in KEY_SETS}


def splits_for(kind: str, heads: int) -> int:
    """Threadgroups sharing a head's keys, from `bench/attention_plans.py` on the H200 (bench/RESULTS.md,
    2026-12-03; Flash's 64 heads, 1 / 2 / 4 / 8 threadgroups a head): a ratio-4 layer's call over the window and
    512 picked rows 42.1 / 29.6 / 27.3 / 41.7 µs, so four; the window alone 18.4 / 18.6 / 20.4 / 30.5 and a ratio-128
    layer's rows 14.6 / 19.0 / 28.0 / 31.2 at 2k (22.6 / 32.6 / 27.4 / 38.3 at 32k), so one. Metal keeps one:
    its split text has never run."""
    return 4 if kind == "picked" and current_backend() == "cuda" else 1


class StepShape(NamedTuple):
    """What selects a compiled decode-attention kernel (its fast path's key): the kind of key set after the
    window (KEY_SETS), the head count and width, the rotated dims, the window, the compression ratio and buffer
    rows of "rows" and the indexer's picks of "picked" (0 where a kind has none)."""

    kind: str
    heads: int
    head_dim: int
    n_rot: int
    window: int
    ratio: int
    rows: int
    picked: int


class Rope:
    """RoPE of rows' trailing dims, by the kernel where it passed its check."""

    def __init__(self, reference: Callable[[mx.array, mx.array, mx.array, int, bool], mx.array]):
        self.fast_path = FastPath("rope", reference, self._kernel, self._probe, tolerance=TOLERANCE,
                                  backends=("cuda", "metal"))

    def __call__(self, x: mx.array, cos: mx.array, sin: mx.array, n_rot: int, inverse: bool) -> mx.array:
        """x (T, ..., D), cos and sin (T, n_rot / 2) -> x with its last n_rot dims rotated (GPT-J pairs)."""
        return self.fast_path(x, cos, sin, n_rot, inverse, key=(x.shape[-1], n_rot, inverse))

    @staticmethod
    def _kernel(x, cos, sin, n_rot, inverse) -> mx.array:
        d = x.shape[-1]
        rows = x.size // d
        (y,) = build(ROPE_KERNEL, current_backend())(
            inputs=[x.astype(mx.float32), cos, sin, mx.array([rows], dtype=mx.int32)],
            template=[("D", d), ("NROT", n_rot), ("HEADS", rows // cos.shape[0]),
                      ("INVERSE", inverse), ("THREADS", THREADS)],
            grid=(-(-rows * d // THREADS) * THREADS, 1, 1), threadgroup=(THREADS, 1, 1),
            output_shapes=[x.shape], output_dtypes=[mx.float32],
        )
        return y

    @staticmethod
    def _probe(key: Hashable) -> tuple:
        d, n_rot, inverse = key
        angles = random_activations((3, n_rot // 2), seed=50) * 100.0
        return random_activations((3, 2, d), seed=51), mx.cos(angles), mx.sin(angles), n_rot, inverse


class DecodeAttention:
    """One query token's attention core in the decode step, by the kernel where it passed its check: the query's
    norm and RoPE, the masks, the key sets as they are stored, and the output's inverse RoPE."""

    def __init__(self, reference: Callable[..., mx.array]):
        self.fast_path = FastPath("decode_attention", lambda *args: reference(*args[:-1]), self._kernel,
                                  self._probe, tolerance=TOLERANCE, backends=("cuda", "metal"))

    def __call__(self, q: mx.array, position: mx.array, inv_freq: mx.array, window: mx.array, rows: mx.array | None,
                 picked: mx.array | None, valid: mx.array | None, sinks: mx.array, ratio: int, eps: float,
                 row: int = 0) -> mx.array:
        """q (1, H * D): q_b's output for one token at `position` (1,) int32, before its per-head RMSNorm and its
        RoPE (angles position * inv_freq (n_rot / 2,)); the raw window (W, D), row j at position - W + 1 + j; the
        compressed rows buffer (C, D) or None, of which either the first (position + 1) // ratio are visible or,
        with `picked` (1, P) int32, those rows where `valid` (1, P); sinks (H,) -> (1, H, D), de-rotated. `row`:
        the query's row in a step over several rows, whose launches may run at once (each row its own counters)."""
        return self.fast_path(q, position, inv_freq, window, rows, picked, valid, sinks, ratio, eps, row,
                              key=self.key(inv_freq, window, rows, picked, sinks, ratio))

    @staticmethod
    def key(inv_freq: mx.array, window: mx.array, rows: mx.array | None, picked: mx.array | None,
            sinks: mx.array, ratio: int) -> StepShape:
        """The shape class of a call's arguments (the fast path's key)."""
        kind = "window" if rows is None else "rows" if picked is None else "picked"
        return StepShape(kind, sinks.shape[0], window.shape[1], 2 * inv_freq.shape[0], window.shape[0],
                         ratio if kind == "rows" else 0, rows.shape[0] if kind == "rows" else 0,
                         picked.shape[-1] if kind == "picked" else 0)

    counters: dict[tuple[int, int], mx.array] = {}
    """One word a head, for the split kernels (`ds4_last_group`), by (head count, row of the step): one row's
    launches follow one another (each needs the layer before), but the rows of a step over several are independent,
    and MLX's CUDA graphs (and ours, cudagraph.py) run independent launches at once: each row counts on its own."""

    @staticmethod
    def counter(heads: int, row: int = 0) -> mx.array:
        """The counters of `heads` heads for a step's row `row`, made once and evaluated (16 words or more: MLX
        keeps arrays of 8 bytes or less in managed memory, where an atomic is slow; dialect.py)."""
        if (heads, row) not in DecodeAttention.counters:
            counter = mx.zeros((max(heads, 16),), dtype=mx.uint32)
            mx.eval(counter)
            DecodeAttention.counters[heads, row] = counter
        return DecodeAttention.counters[heads, row]

    @staticmethod
    def _kernel(q, position, inv_freq, window, rows, picked, valid, sinks, ratio, eps, row: int = 0,
                splits: int | None = None) -> mx.array:
        heads = sinks.shape[0]
        w, d = window.shape
        n_rot = 2 * inv_freq.shape[0]
        if d % (2 * SIMD_WIDTH) or not 0 < n_rot <= d:
            raise ValueError(f"decode attention needs a head width that is a multiple of 64 and 0 < n_rot <= it, "
                             f"got {d} and {n_rot}")
        template = [("D", d), ("WINDOW", w), ("NROT", n_rot), ("GROUPS", GROUPS), ("KEYS", KEYS)]
        if rows is None:
            kind, extra = "window", []
        elif picked is None:
            kind, extra = "rows", [rows]
            template += [("RATIO", ratio), ("ROWS", rows.shape[0])]
        else:
            kind, extra = "picked", [rows, picked, valid]  # (1, P): read as stored, no reshape node
            template += [("PICKS", picked.shape[-1])]
        params = mx.array([1.0 / math.sqrt(d), eps], dtype=mx.float32)  # the scores' scale, the query norm's eps
        splits = splits_for(kind, heads) if splits is None else splits
        if not 1 <= splits <= GROUPS:
            raise ValueError(f"a head's keys are shared by 1 to {GROUPS} threadgroups, not {splits}")
        if splits == 1:
            (out,) = build(ATTEND_KERNELS[kind], current_backend())(
                inputs=[q, position, inv_freq, window, *extra, sinks, params],
                template=template,
                grid=(heads * GROUPS * SIMD_WIDTH, 1, 1), threadgroup=(GROUPS * SIMD_WIDTH, 1, 1),
                output_shapes=[(1, heads, d)], output_dtypes=[mx.float32],
            )
            return out
        out, _ = build(SPLIT_KERNELS[kind], current_backend())(
            inputs=[q, position, inv_freq, window, *extra, sinks, params, DecodeAttention.counter(heads, row)],
            template=template + [("SPLITS", splits)],
            grid=(heads * splits * GROUPS * SIMD_WIDTH, 1, 1), threadgroup=(GROUPS * SIMD_WIDTH, 1, 1),
            output_shapes=[(1, heads, d), (heads * splits * (d + 2),)], output_dtypes=[mx.float32, mx.float32],
        )
        return out

    @staticmethod
    def _probe(key: Hashable) -> tuple:
        """Query values 3x unit rms (the norm matters); half the window not there yet, or about half the rows
        visible ("rows"), or every third pick not real ("picked", picks among twice as many rows)."""
        kind, heads, d, n_rot, w, ratio, n_rows, n_picked = key
        inv_freq = mx.array(10000.0 ** (-np.arange(0, n_rot, 2) / n_rot), dtype=mx.float32)
        rows = picked = valid = None
        position = w // 2
        if kind == "rows":
            rows = random_activations((n_rows, d), seed=55)
            position = ratio * ((n_rows + 1) // 2)
        elif kind == "picked":
            rows = random_activations((2 * n_picked, d), seed=55)
            chosen = np.sort(np.random.default_rng(56).choice(2 * n_picked, n_picked, replace=False))
            picked = mx.array(chosen, dtype=mx.int32)[None]
            valid = (mx.arange(n_picked) % 3 != 1)[None]
        return (random_activations((1, heads * d), seed=52) * 3.0, mx.array([position], dtype=mx.int32), inv_freq,
                random_activations((w, d), seed=53), rows, picked, valid, random_activations((heads,), seed=54),
                ratio, 1e-6, 0)
