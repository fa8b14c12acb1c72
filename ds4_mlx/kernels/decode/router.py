"""The learned router's selection (ds4.c) as one kernel: sqrt(softplus(logit)), the biased top-k with ds4's
tie rule, and the normalised weights.

In MLX ops the selection alone is ~12 launches (a partition for the k-th value, comparisons, a cumulative sum, an
argpartition, a gather and a sort) on top of the scoring and weighting ones. Here one threadgroup takes one token:
each thread scores one expert, then finds its rank by comparing with every other score in threadgroup memory
(greater score, or an equal score at a lower index, ranks first: ds4's rule, so ties go to the lower index), and
the k experts ranked first are put in ascending order and written with their weights.

Its reference is `route` in model/moe.py, handed in by the model. The scores are the same float32 operations
(log1p, exp, sqrt) and the selection is exact, so the ids equal the reference's; the weights differ at most by
the order of a 6-term sum (TOLERANCE).

On CUDA a decode token's learned router is one launch (`GatedRoute`): the float16 gate's matvec with the input
norm folded in (kernels/decode/half.py's text), after which the threadgroup that finishes last (dialect.py's
ds4_last_group) runs the selection above on the logits all of them wrote; each launch saved is a graph node, ~15-20
µs of MLX's host time a token on the H200. Its reference is the formulas: the normed input times the gate in
float32, then `route`.

The hash layers (the first few) take their experts from a fixed token-id table instead: in MLX ops the table row's
gather, the scores, the gather of the chosen ones, their sum and the weights are five launches. `HashRoute` is
one: a SIMD group per token, each of its first k lanes reads one id of the token's row and scores that expert
only, and a SIMD sum gives the total. Its reference is `hash_route` in model/moe.py; the ids are copied, the
weights as above.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Hashable
from functools import cache

import mlx.core as mx
import numpy as np

from ..machinery.dialect import SIMD_WIDTH, Kernel, build
from .fused_norm import Norm
from .fused_norm import fits as fits_norm
from .half import SIMDS as HALF_SIMDS
from .half import TOLERANCE as HALF_TOLERANCE
from .half import half_matvec, split_plan
from .half import reference as half_reference
from .half import norm_kernel as half_norm_kernel
from ..machinery.probe import random_activations
from ..machinery.registry import FastPath, current_backend

TOLERANCE = 1e-6

_ROUTE_SHARED = """
SHARED float score[E];
SHARED float prob[E];
SHARED int by_rank[K];
SHARED int picked[K];
"""

_ROUTE_CORE = """
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
"""The selection of token t from thread e's logit `l` (expert e's), in the threadgroup memory _ROUTE_SHARED
declares. Its rank loop over the E experts is unrolled 8 ways, not E: fully unrolled, the 256-expert kernel was a 95 KB
cubin, and MLX hashed a kernel's whole binary at every launch (nvrtc.py). The ranks are distinct, so the K picks
land in K slots by rank; K threads put them in ascending order (each counts the smaller picks) and each writes one
(id, weight), the weights' sum taken in ascending id order by each: a single thread scanning all E flags took ~16
µs on the H200 (a decode step's route sits between the router's matvec and the experts)."""


def _constants(floor: float, scale: float) -> tuple[str, str]:
    """The header that sets FLOOR and SCALE, and a name suffix from their bits: MLX may cache compiled kernels by
    name, so kernels with other constants must not share one."""
    bits = struct.pack("<ff", floor, scale).hex()
    return f"CONSTANT float FLOOR = {floor!r}f;\nCONSTANT float SCALE = {scale!r}f;\n", bits


_ROUTE = _ROUTE_SHARED + """
const int t = GROUP_X;
const int e = THREAD_IN_GROUP;
const float l = logits[(size_t)t * E + e];
""" + _ROUTE_CORE


def route_kernel(floor: float, scale: float) -> Kernel:
    header, bits = _constants(floor, scale)
    return Kernel(f"ds4_route_{bits}", ("logits", "bias"), ("ids", "weights"), _ROUTE, header)


GATED_TOLERANCE = HALF_TOLERANCE
"""The weights from the kernel's own logits: the half matvec's summation order (its TOLERANCE, relative to the
largest logit) carried through sqrt(softplus) and the normalisation, whose slopes are below 1 at the scale of the
weights; the ids must still be the reference's (the probe's 6th and 7th scores lie far apart, as real ones do)."""

_ROUTE_BY_LAST = _ROUTE_SHARED + """
SHARED unsigned int last_flag[1];
if (ds4_last_group(counter, OUT / GROUP_ROWS, last_flag, THREAD_IN_GROUP)) {
  const int t = 0;
  const int e = THREAD_IN_GROUP;
  const float l = ds4_load_fresh(y + e);
""" + _ROUTE_CORE + """
}
"""
"""The route of one token by the half matvec's last threadgroup (ds4_last_group): its E = SIMDS x 32 threads
read the logits every threadgroup wrote."""


@cache
def gated_route_kernel(floor: float, scale: float, eps: float) -> Kernel:
    """The router's matvec with its input norm folded in (kernels/decode/half.py's normed kernel) and the route after
    it, in one launch: half's text, then the selection by its last threadgroup."""
    gate = half_norm_kernel(eps)
    header, bits = _constants(floor, scale)
    return Kernel(f"ds4_gated_route_{bits}_{gate.name}", (*gate.inputs, "bias", "counter"), ("y", "ids", "weights"),
                  gate.source + _ROUTE_BY_LAST, gate.header + header)


class GatedRoute:
    """The learned router of one decode token in one launch on CUDA: its matvec (the float16 gate, the input norm
    folded in) and the selection (`Route`) done by the matvec's last threadgroup, where each launch is a graph node
    costing ~15 µs of host time. Metal, other shapes and more tokens take the matvec and `Route` apart."""

    def __init__(self, route: Route):
        self.route = route
        self.fast_path = FastPath("gated_route", self._reference, self._kernel, self._probe,
                                  tolerance=(0.0, GATED_TOLERANCE), backends=("cuda",))

    def __call__(self, x: mx.array, gate: mx.array, norm: Norm, bias: mx.array, counter: mx.array, k: int,
                 scale: float) -> tuple[mx.array, mx.array]:
        """x (1, IN) raw, gate (E, IN) float16, norm (weight (IN,), eps), bias (E,), the call site's counter
        (`new_counter`) -> (ids (1, k), weights (1, k))."""
        if self.fits(x, gate, norm, bias):
            key = (*gate.shape, k, scale, float(norm[1]))
            if self.fast_path.enabled(key):
                return self.fast_path(x, gate, norm, bias, counter, k, scale, key=key)
        return self.route(half_matvec(x, gate, norm), bias, k, scale)

    @staticmethod
    def fits(x: mx.array, gate: mx.array, norm: Norm, bias: mx.array) -> bool:
        """One float32 token, a gate the half matvec takes one row a threadgroup of E threads (split_plan)."""
        e, n_in = gate.shape
        return (x.shape == (1, n_in) and x.dtype == mx.float32 and gate.dtype == mx.float16 and e == HALF_SIMDS * 32
                and split_plan(e, n_in) == (HALF_SIMDS, 1) and fits_norm(norm, n_in)
                and bias.shape == (e,) and bias.dtype == mx.float32)

    @staticmethod
    def new_counter() -> mx.array:
        """A call site's counter (evaluated, so that a compiled step takes it as a constant input). Eight words
        where one is used: MLX's CUDA allocator puts arrays of 8 bytes or less in managed memory, which a GPU
        atomic then migrates page by page (the one-word counter made the launch ~300 µs on the H200)."""
        counter = mx.zeros((8,), dtype=mx.uint32)
        mx.eval(counter)
        return counter

    def _reference(self, x, gate, norm, bias, counter, k, scale) -> tuple[mx.array, mx.array]:
        """The formulas: the normed input times the gate in float32, then the route's reference."""
        return self.route.fast_path.reference(half_reference(x, gate, norm), bias, k, scale)

    def _kernel(self, x, gate, norm, bias, counter, k, scale) -> tuple[mx.array, mx.array]:
        e, n_in = gate.shape
        _, ids, weights = build(gated_route_kernel(self.route.floor, scale, float(norm[1])), current_backend())(
            inputs=[x, gate, norm[0], bias, counter],
            template=[("OUT", e), ("IN", n_in), ("TOKENS", 1), ("SPLIT", HALF_SIMDS), ("RPS", 1),
                      ("SIMDS", HALF_SIMDS), ("E", e), ("K", k)],
            grid=(e * HALF_SIMDS * 32, 1, 1), threadgroup=(HALF_SIMDS * 32, 1, 1),
            output_shapes=[(1, e), (1, k), (1, k)], output_dtypes=[mx.float32, mx.int32, mx.float32],
        )
        return ids, weights

    @staticmethod
    def _probe(key: Hashable) -> tuple:
        e, n_in, k, scale, eps = key
        x = random_activations((1, n_in), seed=73) * 7.0
        gate = (random_activations((e, n_in), seed=74) * (4.0 / n_in**0.5)).astype(mx.float16)
        return (x, gate, (1.0 + 0.5 * random_activations((n_in,), seed=75), eps),
                random_activations((e,), seed=76) * 0.1, GatedRoute.new_counter(), k, scale)


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
