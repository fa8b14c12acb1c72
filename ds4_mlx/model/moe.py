"""The FFN sublayer: routed mixture of experts plus one shared expert (ds4.c).

The router scores experts with sqrt(softplus(logit)) (no softmax). The first `n_hash_layer` layers take their
experts from a fixed token-id table instead; every layer weights its experts by the normalised, unbiased router
scores times 1.5. Each expert is a SwiGLU whose gate is clamped above at 10 and whose up projection is clamped to
[-10, 10]; the shared expert is the same SwiGLU with weight 1.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx

from ds4_mlx.kernels.decode.affine_matvec import SwigluMatvec
from ds4_mlx.kernels.decode.experts import DownSum, GateUpSwiglu
from ds4_mlx.kernels.decode.fused_norm import Norm, apply
from ds4_mlx.kernels.prefill.grouped import grouped_swiglu
from ds4_mlx.kernels.decode.router import GatedRoute, HashRoute, Route
from ds4_mlx.model.linear import ExpertBank, FusedLinear, Linear
from ds4_mlx.model.topk import top_k_indices

WEIGHT_SUM_FLOOR = 6.103515625e-5  # ds4 divides by max(sum of selected scores, 2^-14)
GATHER_LIMIT = 32
"""At most this many (token, expert) pairs dequantize one expert copy per pair; more are sorted by expert and
grouped."""
FUSED_GATHER_ROWS = 8
"""Up to this many tokens (a decode step's rows) take one product per pair however many pairs they make, where the
fused kernels read the pairs' experts from the raw banks (no copy per pair): the grouped path's sort is built-in
ops, which a step replayed as one CUDA graph may not hold."""


def softplus(x: mx.array) -> mx.array:
    """ln(1 + e^x), linear above 20 like torch and ds4."""
    return mx.where(x > 20, x, mx.log1p(mx.exp(mx.minimum(x, 20))))


def _swiglu(gate: mx.array, up: mx.array, clamp: float) -> mx.array:
    gate = mx.minimum(gate, clamp)
    return gate * mx.sigmoid(gate) * mx.clip(up, -clamp, clamp)


def _weighted_swiglu(gate: mx.array, up: mx.array, weights: mx.array, clamp: float) -> mx.array:
    return _swiglu(gate, up, clamp) * weights


swiglu = mx.compile(_swiglu, shapeless=True)
"""silu(min(gate, clamp)) * clip(up, -clamp, clamp), as one fused elementwise kernel: MLX ops would make six
launches and six passes over a prefill chunk's (pairs, 2048) activations (~3% of its GPU time on the H200). The
same float32 operations in the same order: bit-identical to the ops (tests/test_model_parts.py)."""


def weighted_swiglu(gate: mx.array, up: mx.array, weights: mx.array, clamp: float) -> mx.array:
    """The routed experts' hidden activations: swiglu of (N, F) gate and up, row n times the routing weight n
    (one fused kernel, as `swiglu`)."""
    return _fused_weighted_swiglu(gate, up, weights.reshape(-1, 1), clamp)


_fused_weighted_swiglu = mx.compile(_weighted_swiglu, shapeless=True)


def sum_slots(y: mx.array, k: int) -> mx.array:
    """(T*k, D) expert outputs in (token, slot) order summed over each token's k slots -> (T, D)."""
    return mx.sum(y.reshape(-1, k, y.shape[-1]), axis=1)


GATE_UP = GateUpSwiglu(weighted_swiglu)
DOWN_SUM = DownSum(sum_slots)
"""The decode path's two fused kernels over raw q2 banks (kernels/decode/experts.py), checked against the formulas
above."""


@dataclass
class Router:
    """Chooses n_used experts per token and their weights."""

    gate: Linear
    bias: mx.array | None  # exp_probs_b: selection bias, never part of the weights
    tid2eid: mx.array | None  # (n_vocab, n_used) int32 on hash layers
    n_used: int
    scale: float

    counter: mx.array = field(default_factory=GatedRoute.new_counter, repr=False)
    """GATED_ROUTE's counter (kernels/decode/router.py): each router owns one."""

    def __call__(self, x: mx.array, tokens: mx.array, norm: Norm | None = None) -> tuple[mx.array, mx.array]:
        """Expert ids (T, n_used) int32 and weights (T, n_used) for normed inputs x (T, D) (or x and its norm)."""
        if self.tid2eid is not None:
            return HASH_ROUTE(self.gate(x, norm=norm), self.tid2eid, tokens, self.scale)
        bias = self.bias if self.bias is not None else mx.zeros(self.gate.shape[:1])
        if norm is not None and self.gate.half is not None:  # a float16 gate: its matvec and the route, one launch
            return GATED_ROUTE(x, self.gate.half, norm, bias, self.counter, self.n_used, self.scale)
        return ROUTE(self.gate(x, norm=norm), bias, self.n_used, self.scale)


def route(logits: mx.array, bias: mx.array, k: int, scale: float) -> tuple[mx.array, mx.array]:
    """The learned router: the k experts of highest sqrt(softplus(logit)) + bias (ascending ids; ties to the lower
    id) and their weights."""
    probs = mx.sqrt(softplus(logits))
    return weigh(probs, top_k_indices(probs + bias, k), scale)


def hash_route(logits: mx.array, table: mx.array, tokens: mx.array, scale: float) -> tuple[mx.array, mx.array]:
    """A hash layer's router: each token's experts from its row of the table, weighed by their scores as in
    `route`."""
    return weigh(mx.sqrt(softplus(logits)), table[tokens], scale)


def weigh(probs: mx.array, ids: mx.array, scale: float) -> tuple[mx.array, mx.array]:
    """ids and their normalised, unbiased scores times scale."""
    chosen = mx.take_along_axis(probs, ids, axis=-1)
    total = mx.maximum(mx.sum(chosen, axis=-1, keepdims=True), WEIGHT_SUM_FLOOR)
    return ids, chosen / total * scale


ROUTE = Route(route, WEIGHT_SUM_FLOOR)
HASH_ROUTE = HashRoute(hash_route, WEIGHT_SUM_FLOOR)
GATED_ROUTE = GatedRoute(ROUTE)
"""`route` and `hash_route` as one kernel each where a GPU backend has passed the first-use check, and on CUDA the
learned router's float16 gate matvec and `route` in one launch for a decode token (kernels/decode/router.py)."""
SHARED_DOWN = SwigluMatvec(swiglu)
"""The shared expert's down projection of its joined gate and up products with `swiglu` in the same launch
(kernels/decode/affine_matvec.py), checked against the formula."""


@dataclass
class SharedExpert:
    """The shared SwiGLU expert. Its gate and up read the same input: a decode step multiplies it by both as one
    matrix (`gate_up`, joined at load) and hands their [gate | up] products to down's launch, which applies the
    SwiGLU as it reads them: two launches where each projection and the SwiGLU would be one of their own."""

    gate: Linear
    up: Linear
    down: Linear
    clamp: float
    gate_up: FusedLinear = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.gate_up = FusedLinear([self.gate, self.up])

    def __call__(self, x: mx.array, norm: Norm | None = None) -> mx.array:
        joined = self.gate_up.joined(x, norm)  # [gate | up] by one launch (decode), or None
        if joined is not None:
            return self.down.after_swiglu(joined, SHARED_DOWN, self.clamp)
        return self.down(swiglu(self.gate(x, norm=norm), self.up(x, norm=norm), self.clamp))

    def folds(self, x: mx.array, norm: Norm) -> bool:
        """Whether the input projections fold x's norm into their matvec launches."""
        return self.gate_up.folds(x, norm)


@dataclass
class RoutedExperts:
    """The routed SwiGLU experts of one layer: three expert banks (model/linear.py) sharing the routing."""

    gate: ExpertBank
    up: ExpertBank
    down: ExpertBank
    clamp: float

    def __call__(self, x: mx.array, ids: mx.array, weights: mx.array, norm: Norm | None = None) -> mx.array:
        """sum_i weights[:, i] * expert_{ids[:, i]}(x) for x (T, D) (with `norm`, of rms_norm(x, *norm))."""
        if self._gathers(ids.shape[0], ids.shape[1], norm):
            return self._gathered(x, ids, weights, norm)
        return self._grouped(apply(x, norm), ids, weights)

    def _gathers(self, tokens: int, k: int, norm: Norm | None) -> bool:
        """Whether tokens x k pairs take one product per pair (`_gathered`) rather than the grouped path."""
        if tokens * k <= GATHER_LIMIT:
            return True
        down = self.down
        return (tokens <= FUSED_GATHER_ROWS and self._fused_gate_up(k, norm) and down.raw is not None
                and DOWN_SUM.enabled(down.ggml_type, down.shape, k))

    def folds(self, x: mx.array, k: int, norm: Norm) -> bool:
        """Whether a decode call of x's rows and k slots folds x's norm into its gate and up launches: the fused
        kernel's normed variant, or the affine matvec kernel of both banks."""
        if not self._gathers(x.size // x.shape[-1], k, norm):
            return False
        return self._fused_gate_up(k, norm) or (self.gate.folds(x, norm) and self.up.folds(x, norm))

    def _fused_gate_up(self, k: int, norm: Norm | None) -> bool:
        """Whether gate, up and the SwiGLU take GateUpSwiglu (with this norm folded in, or none)."""
        gate, up = self.gate, self.up
        return (gate.raw is not None and up.raw is not None and (gate.ggml_type, gate.shape) == (up.ggml_type, up.shape)
                and GATE_UP.enabled(gate.ggml_type, gate.shape, k, self.clamp, norm))

    def _gathered(self, x: mx.array, ids: mx.array, weights: mx.array, norm: Norm | None = None) -> mx.array:
        """One expert product per (token, slot); no host sync, for decode. Raw banks whose fused kernels passed
        their checks take one launch for gate, up and the SwiGLU and one for down and the slot sum; the others
        (and the CPU) one product per projection and MLX ops between them. With `norm`, x is normed in the gate
        and up launches where they fold it, else once here."""
        k = ids.shape[1]
        flat = ids.reshape(-1).astype(mx.uint32)  # the index type of gather_qmm and the kernels: cast once, not 3x
        gate, up, down = self.gate, self.up, self.down
        if self._fused_gate_up(k, norm):
            h = GATE_UP(x, ids, weights, gate.raw, up.raw, gate.ggml_type, gate.shape, self.clamp, norm)
        else:
            if norm is not None and not (gate.folds(x, norm) and up.folds(x, norm)):
                x, norm = apply(x, norm), None
            xs = mx.repeat(x, k, axis=0)  # (T*k, D)
            h = weighted_swiglu(gate(xs, flat, norm), up(xs, flat, norm), weights, self.clamp)
        if down.raw is not None and DOWN_SUM.enabled(down.ggml_type, down.shape, k):
            return DOWN_SUM(h, ids, down.raw, down.ggml_type, down.shape)
        return sum_slots(down(h, flat), k)

    def _grouped(self, x: mx.array, ids: mx.array, weights: mx.array) -> mx.array:
        """All (token, slot) pairs sorted by expert on the device, then one grouped GEMM per projection; for
        prefill, with no host round-trip (kernels/prefill/grouped.py)."""
        return grouped_swiglu(x, ids, weights, self.gate.grouped, self.up.grouped, self.down.grouped,
                              lambda gate, up, w: weighted_swiglu(gate, up, w, self.clamp), self.gate.n_expert)


@dataclass
class MoE:
    router: Router
    experts: RoutedExperts
    shared: SharedExpert

    def __call__(self, x: mx.array, tokens: mx.array, norm: Norm | None = None) -> mx.array:
        """The sublayer for normed inputs x (T, D), or (decode) for raw x and its norm (weight, eps): folded into
        every reader's kernel (router gate, shared gate and up, routed gate and up) where all of them fold it, so
        that the norm is no op of its own; otherwise applied here, once."""
        routed, shared = self.parts(x, tokens, norm)
        return routed + shared

    def parts(self, x: mx.array, tokens: mx.array, norm: Norm | None = None) -> tuple[mx.array, mx.array]:
        """The routed experts' and the shared expert's outputs, whose sum `__call__` returns: kept apart for the
        HC-post, which adds them in its own launch (model.py's Block)."""
        if norm is not None and not self.folds(x, norm):
            x, norm = apply(x, norm), None
        ids, weights = self.router(x, tokens, norm)
        return self.experts(x, ids, weights, norm), self.shared(x, norm)

    def folds(self, x: mx.array, norm: Norm) -> bool:
        """Whether every reader of x folds its norm into a kernel launch (checking those kernels on first use)."""
        return (self.router.gate.folds(x, norm) and self.shared.folds(x, norm)
                and self.experts.folds(x, self.router.n_used, norm))
