"""Manifold-constrained hyper-connections (mHC, as ds4.c computes them, and the final collapse).

The residual is `n_hc` parallel streams H (T, n_hc, D). Before each sublayer a learned, input-dependent
mix collapses them into one input (`pre`); afterwards the sublayer output is spread back with `post` while the
streams themselves are mixed by `comb`, a Sinkhorn-projected (near doubly-stochastic) matrix that keeps the
residual from growing with depth.

A post is not applied at once: it is handed on (`PendingPost`) to the next sublayer's pre, which applies it in
the same launches as its own first step where a fused kernel is used (kernels/sublayers/hc.py, HCPostPre).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import mlx.core as mx

from ds4_mlx.kernels.decode.ends import HeadCollapse
from ds4_mlx.kernels.sublayers.hc import HCMix, HCPostPre, HCPre, HCSplit, HCUpdate
from ds4_mlx.model.norm import rms_norm


def sinkhorn(logits: mx.array, iters: int, eps: float) -> mx.array:
    """Row softmax plus eps, then alternate column/row normalisation, `iters` column steps in all.

    Ends on a column step, so columns sum to 1 exactly and rows only approximately (as the reference does).
    """
    comb = mx.softmax(logits, axis=-1) + eps
    comb = comb / (mx.sum(comb, axis=-2, keepdims=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (mx.sum(comb, axis=-1, keepdims=True) + eps)
        comb = comb / (mx.sum(comb, axis=-2, keepdims=True) + eps)
    return comb


@functools.lru_cache(maxsize=None)
def compiled_sinkhorn(iters: int, eps: float):
    """`sinkhorn` as one compiled graph: its ~4·iters tiny ops on 4x4 matrices would otherwise each be launched on
    their own, 86 times per token (2 per layer). Same arithmetic, bit-identical results."""
    return mx.compile(lambda logits: sinkhorn(logits, iters, eps))


def split(mix: mx.array, scale: mx.array, base: mx.array, streams: mx.array, iters: int,
          eps: float) -> tuple[mx.array, mx.array, mx.array]:
    """A mix (T, (2+n)n) made into the collapsed input (T, D), post (T, n) and comb (T, n, n) (see `pre`)."""
    n = streams.shape[1]
    pre = mx.sigmoid(mix[:, :n] * scale[0] + base[:n]) + eps
    post = 2 * mx.sigmoid(mix[:, n : 2 * n] * scale[1] + base[n : 2 * n])
    comb = compiled_sinkhorn(iters, eps)((mix[:, 2 * n :] * scale[2] + base[2 * n :]).reshape(-1, n, n))
    return mx.sum(pre[:, :, None] * streams, axis=1), post, comb


def update(output: mx.array, streams: mx.array, post: mx.array, comb: mx.array,
           addend: mx.array | None = None) -> mx.array:
    """New streams (T, n, D): H'_c = post_c * output + sum_r comb[r, c] * H_r, the output given whole or as two
    addends (output + addend)."""
    if addend is not None:
        output = output + addend
    return post[:, :, None] * output[:, None, :] + mx.swapaxes(comb, -1, -2) @ streams


def mix(flat: mx.array, fn: mx.array, norm_eps: float) -> mx.array:
    """The mix logits (T, (2+n)n) of flattened streams (T, n D): rms_norm(flat) @ fn.T."""
    return rms_norm(flat, None, norm_eps) @ fn.T


def pre(streams: mx.array, fn: mx.array, scale: mx.array, base: mx.array, iters: int, eps: float,
        norm_eps: float) -> tuple[mx.array, mx.array, mx.array]:
    """`HyperConnection.pre` of streams (T, n, D): the `mix` of the flattened streams, then `split`."""
    flat = streams.reshape(streams.shape[0], -1)
    return SPLIT(MIX(flat, fn, norm_eps), scale, base, streams, iters, eps)


def post_pre(output: mx.array, addend: mx.array | None, streams: mx.array, post: mx.array, comb: mx.array,
             fn: mx.array, scale: mx.array, base: mx.array, iters: int, eps: float,
             norm_eps: float) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    """`update`, then the next sublayer's `pre` of the new streams: (new streams, x, post, comb)."""
    new = update(output, streams, post, comb, addend)
    return (new, *pre(new, fn, scale, base, iters, eps, norm_eps))


MIX = HCMix(mix)
SPLIT = HCSplit(split)
UPDATE = HCUpdate(update)
PRE = HCPre(pre)
POST_PRE = HCPostPre(post_pre, UPDATE, PRE)
"""Fused kernels where a GPU backend has passed the first-use check (kernels/sublayers/hc.py): mix, split and update one
launch each, the whole pre of a few tokens two launches (longer chunks: `pre` itself, MIX then SPLIT), and an
update with the pre after it two launches too (elsewhere UPDATE, then PRE)."""


@dataclass
class PendingPost:
    """A sublayer's HC-post not yet applied: its output (whole, or as two addends: the MoE's routed and shared
    parts), the streams it updates and the post weights and comb of its pre."""

    output: mx.array
    addend: mx.array | None
    streams: mx.array
    post: mx.array
    comb: mx.array

    def apply(self) -> mx.array:
        """The new streams (T, n, D), by the update alone (where no pre follows: the head, the MTP block)."""
        return UPDATE(self.output, self.streams, self.post, self.comb, self.addend)

    def arrays(self) -> list[mx.array]:
        return [a for a in (self.output, self.addend, self.streams, self.post, self.comb) if a is not None]


@dataclass
class HyperConnection:
    """One sublayer's mHC parameters: fn ((2 + n) n, n D), scale (3,), base ((2 + n) n,)."""

    fn: mx.array
    scale: mx.array
    base: mx.array
    n_hc: int
    sinkhorn_iters: int
    hc_eps: float
    norm_eps: float

    def pre(self, streams: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """Collapse streams (T, n, D) into the sublayer input (T, D); also return post (T, n) and comb (T, n, n).

        comb[t, r, c] is the weight of source stream r in destination stream c.
        """
        return PRE(streams, self.fn, self.scale, self.base, self.sinkhorn_iters, self.hc_eps, self.norm_eps)

    def pre_after(self, residual: mx.array | PendingPost) -> tuple[mx.array, mx.array, mx.array, mx.array]:
        """The streams (given, or made by the previous sublayer's pending post) and this sublayer's `pre` of them:
        (streams, x, post, comb). A pending post and this pre take two launches where the fused kernels are used."""
        if isinstance(residual, mx.array):
            return (residual, *self.pre(residual))
        p = residual
        return POST_PRE(p.output, p.addend, p.streams, p.post, p.comb, self.fn, self.scale, self.base,
                        self.sinkhorn_iters, self.hc_eps, self.norm_eps)


@dataclass
class HyperHead:
    """Final collapse of the streams before the output norm: weights sigmoid(fn f * scale + base) + eps."""

    fn: mx.array
    scale: mx.array
    base: mx.array
    hc_eps: float
    norm_eps: float

    def __call__(self, streams: mx.array) -> mx.array:
        """streams (T, n_hc, D) -> (T, D); one launch for a decode token on GPU backends (kernels/decode/ends.py)."""
        return HEAD_COLLAPSE(streams, self.fn, self.scale, self.base, self.hc_eps, self.norm_eps)


def head_collapse(streams: mx.array, fn: mx.array, scale: mx.array, base: mx.array, hc_eps: float,
                  norm_eps: float) -> mx.array:
    """HyperHead's formula: the streams weighed by sigmoid(rms_norm(flat streams) @ fn.T * scale + base) + eps."""
    flat = streams.reshape(streams.shape[0], -1)
    mix = rms_norm(flat, None, norm_eps) @ fn.T
    pre = mx.sigmoid(mix * scale[0] + base) + hc_eps
    return mx.sum(pre[:, :, None] * streams, axis=1)


HEAD_COLLAPSE = HeadCollapse(head_collapse)
