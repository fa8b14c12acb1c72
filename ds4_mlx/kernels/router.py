"""The learned router's selection (spec §3.9) as one kernel: sqrt(softplus(logit)), the biased top-k with ds4's
tie rule, and the normalised weights.

In MLX ops the selection alone is ~12 launches (a partition for the k-th value, comparisons, a cumulative sum, an
argpartition, a gather and a sort) on top of the scoring and weighting ones. Here one threadgroup takes one token:
each thread scores one expert, then finds its rank by comparing with every other score in threadgroup memory
(greater score, or an equal score at a lower index, ranks first: ds4's rule, so ties go to the lower index), and
the k experts ranked first are put in ascending order and written with their weights.

Its reference is `route` in model/moe.py, handed in by the model. The scores are the same float32 operations
(log1p, exp, sqrt) and the selection is exact, so the ids equal the reference's; the weights differ at most by
the order of a 6-term sum (TOLERANCE).

The hash layers (the first few) take their experts from a fixed token-id table instead: in MLX ops the table row's
gather, the scores, the gather of the chosen ones, their sum and the weights are five launches. `HashRoute` is
one: a SIMD group per token, each of its first k lanes reads one id of the token's row and scores that expert
only, and a SIMD sum gives the total. Its reference is `hash_route` in model/moe.py; the ids are copied, the
weights as above.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Hashable

import mlx.core as mx
import numpy as np

from .dialect import SIMD_WIDTH, Kernel, build
from .probe import random_activations
from .registry import FastPath, current_backend

TOLERANCE = 1e-6

_ROUTE = """
const int t = GROUP_X;
const int e = THREAD_IN_GROUP;
SHARED float score[E];
SHARED float prob[E];
SHARED int by_rank[K];
SHARED int picked[K];
const float l = logits[(size_t)t * E + e];
const float soft = l > 20.0f ? l : ds4_log1p(ds4_exp(l < 20.0f ? l : 20.0f));
const float p = sqrt(soft);
prob[e] = p;
score[e] = p + bias[e];
ds4_barrier();
const float mine = score[e];
int rank = 0;
#pragma unroll 8
for (int o = 0; o < E; ++o) {
  const float other = score[o];
  rank += (other > mine || (other == mine && o < e)) ? 1 : 0;
}
if (rank < K) {
  by_rank[rank] = e;
}
ds4_barrier();
if (e < K) {  // the K picks into ascending order: each one's place is the number of smaller picks
  const int mine_id = by_rank[e];
  int place = 0;
  for (int o = 0; o < K; ++o) {
    place += by_rank[o] < mine_id ? 1 : 0;
  }
  picked[place] = mine_id;
}
ds4_barrier();
if (e < K) {
  float total = 0.0f;
  for (int o = 0; o < K; ++o) {
    total += prob[picked[o]];
  }
  total = total > FLOOR ? total : FLOOR;
  ids[(size_t)t * K + e] = picked[e];
  weights[(size_t)t * K + e] = prob[picked[e]] / total * SCALE;
}
"""
"""Its rank loop over the E experts is unrolled 8 ways, not E: fully unrolled, the 256-expert kernel was a 95 KB
cubin, and MLX hashed a kernel's whole binary at every launch (nvrtc.py). The ranks are distinct, so the K picks
land in K slots by rank; K threads put them in ascending order (each counts the smaller picks) and each writes one
(id, weight), the weights' sum taken in ascending id order by each: a single thread scanning all E flags took ~16
µs on the H200 (a decode step's route sits between the router's matvec and the experts)."""


def _constants(floor: float, scale: float) -> tuple[str, str]:
    """The header that sets FLOOR and SCALE, and a name suffix from their bits: MLX may cache compiled kernels by
    name, so kernels with other constants must not share one."""
    bits = struct.pack("<ff", floor, scale).hex()
    return f"CONSTANT float FLOOR = {floor!r}f;\nCONSTANT float SCALE = {scale!r}f;\n", bits


def route_kernel(floor: float, scale: float) -> Kernel:
    header, bits = _constants(floor, scale)
    return Kernel(f"ds4_route_{bits}", ("logits", "bias"), ("ids", "weights"), _ROUTE, header)


class Route:
    """(ids (T, k) int32 ascending, weights (T, k)) of the learned router, by the kernel where it passed."""

    def __init__(self, reference: Callable[..., tuple[mx.array, mx.array]], floor: float):
        self.floor = floor
        self.fast_path = FastPath("route", reference, self._kernel, self._probe, tolerance=(0.0, TOLERANCE),
                                  backends=("cuda", "metal"))

    def __call__(self, logits: mx.array, bias: mx.array, k: int, scale: float) -> tuple[mx.array, mx.array]:
        """logits (T, E) of the gate, bias (E,) added for the selection only."""
        e = logits.shape[-1]
        if e % 32 or e > 1024:  # one thread per expert, whole SIMD groups: other widths (test models) take the reference
            return self.fast_path.reference(logits, bias, k, scale)
        return self.fast_path(logits, bias, k, scale, key=(e, k, scale))

    def _kernel(self, logits, bias, k, scale) -> tuple[mx.array, mx.array]:
        t, e = logits.shape
        return tuple(build(route_kernel(self.floor, scale), current_backend())(
            inputs=[logits, bias], template=[("E", e), ("K", k)],
            grid=(t * e, 1, 1), threadgroup=(e, 1, 1),
            output_shapes=[(t, k), (t, k)], output_dtypes=[mx.int32, mx.float32],
        ))

    @staticmethod
    def _probe(key: Hashable) -> tuple:
        e, k, scale = key
        logits = random_activations((3, e), seed=71) * 4.0
        logits = mx.concatenate([logits[:2], mx.zeros((1, e))])  # a row of ties: lower indices must win
        return logits, random_activations((e,), seed=72) * 0.1, k, scale


_HASH_ROUTE = """
const int t = GROUP_X;
const int i = SIMD_LANE;
int id = 0;
float p = 0.0f;
if (i < K) {
  id = table[(size_t)tokens[t] * K + i];
  const float l = logits[(size_t)t * E + id];
  const float soft = l > 20.0f ? l : ds4_log1p(ds4_exp(l < 20.0f ? l : 20.0f));
  p = sqrt(soft);
}
const float total = ds4_simd_sum(p);
const float floored = total > FLOOR ? total : FLOOR;
if (i < K) {
  ids[(size_t)t * K + i] = id;
  weights[(size_t)t * K + i] = ds4_div(p, floored) * SCALE;
}
"""


def hash_route_kernel(floor: float, scale: float) -> Kernel:
    header, bits = _constants(floor, scale)
    return Kernel(f"ds4_hash_route_{bits}", ("logits", "table", "tokens"), ("ids", "weights"), _HASH_ROUTE, header)


class HashRoute:
    """(ids (T, k) int32, weights (T, k)) of a hash layer: the tokens' rows of the table and their weights, by
    the kernel where it passed."""

    def __init__(self, reference: Callable[..., tuple[mx.array, mx.array]], floor: float):
        self.floor = floor
        self.fast_path = FastPath("hash_route", reference, self._kernel, self._probe, tolerance=(0.0, TOLERANCE),
                                  backends=("cuda", "metal"))

    def __call__(self, logits: mx.array, table: mx.array, tokens: mx.array, scale: float
                 ) -> tuple[mx.array, mx.array]:
        """logits (T, E) of the gate, table (n_vocab, k) int32 (tid2eid), tokens (T,) int32."""
        k = table.shape[-1]
        if k > SIMD_WIDTH or (logits.dtype, table.dtype, tokens.dtype) != (mx.float32, mx.int32, mx.int32):
            return self.fast_path.reference(logits, table, tokens, scale)
        return self.fast_path(logits, table, tokens, scale, key=(logits.shape[-1], k, scale))

    def _kernel(self, logits, table, tokens, scale) -> tuple[mx.array, mx.array]:
        t, e = logits.shape
        k = table.shape[-1]
        return tuple(build(hash_route_kernel(self.floor, scale), current_backend())(
            inputs=[logits, table, tokens], template=[("E", e), ("K", k)],
            grid=(t * SIMD_WIDTH, 1, 1), threadgroup=(SIMD_WIDTH, 1, 1),
            output_shapes=[(t, k), (t, k)], output_dtypes=[mx.int32, mx.float32],
        ))

    @staticmethod
    def _probe(key: Hashable) -> tuple:
        """Three tokens of an 11-row table of random ids; the last token's logits above 20 (softplus linear)."""
        e, k, scale = key
        logits = random_activations((3, e), seed=73) * 4.0
        logits = mx.concatenate([logits[:2], 22.0 + mx.abs(logits[2:])])
        table = mx.array(np.random.default_rng(74).integers(0, e, (11, k)).astype(np.int32))
        return logits, table, mx.array([7, 0, 10], dtype=mx.int32), scale
