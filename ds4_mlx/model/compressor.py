"""KV compressors (ds4.c): pool every `ratio` tokens into one compressed row.

Every token t contributes a_t = W_kv x_t and a score s_t = W_gate x_t + ape[t mod ratio]; a row pools its
tokens with a softmax over tokens taken separately for every dim.

* Ratio 128: row c pools tokens 128c..128c+127.
* Ratio 4 (overlapping, two lanes of width d): row c pools the previous window 4c-4..4c-1 through lane 0 (dims
  0..d-1) together with its own window 4c..4c+3 through lane 1 (dims d..2d-1), a softmax over 8 candidates.

A row is finished with RMSNorm, RoPE at position c*ratio and the quantisation simulation the model chose (`quant`),
in one launch on GPU backends (model/quant_sim.py FINISH_ROWS), and becomes visible when its last token is
processed. Tokens of an unfinished window wait in the frontier (state_kv, state_score: coff*ratio rows of coff*d,
coff = 2 for ratio 4), laid out as ds4 lays it out: for ratio 4, rows 0..3 hold the last complete window and rows
4+(t mod 4) the current one; for ratio 128, row t mod 128. Rows that hold no token have kv 0 and score -inf. A chunk
of any length leaves the frontier exactly as feeding its tokens one at a time would.

`step` is the decode form: one token at a position held in an array, with shapes that do not depend on it, so
a compiled decode step can trace it once. It takes the token's kv and gate projections from the caller (the
attention's step computes them with its other projections of the same input, model/linear.py FusedLinear) and
returns the row of the token's window as it stands (final once the window is complete); the caller writes it at
row position // ratio, where it stays invisible until then.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from ds4_mlx.kernels.sublayers.compressor import CompressorChunk, CompressorStep, CompressorStepPair
from ds4_mlx.model.linear import Linear
from ds4_mlx.model.quant_sim import FINISH_ROWS, RowQuant
from ds4_mlx.model.rope import RoPE


@dataclass(frozen=True)
class Frontier:
    """The tokens of the unfinished window (and, for ratio 4, the last complete one)."""

    kv: mx.array
    score: mx.array

    @classmethod
    def empty(cls, ratio: int, width: int) -> Frontier:
        coff = 2 if ratio == 4 else 1
        return cls(mx.zeros((coff * ratio, coff * width)), mx.full((coff * ratio, coff * width), -mx.inf))


@dataclass
class Compressor:
    """One compressor: attention rows (width head_dim) or indexer rows (width indexer_head_dim)."""

    kv: Linear
    gate: Linear
    ape: mx.array  # (ratio, coff * width)
    norm: mx.array  # (width,)
    ratio: int
    width: int
    rope: RoPE
    quant: RowQuant  # the quantisation simulation of finished rows (NONE when off)
    eps: float

    @property
    def overlap(self) -> bool:
        return self.ratio == 4

    def __call__(self, x: mx.array, n_past: int, frontier: Frontier) -> tuple[mx.array, Frontier]:
        """Feed normed inputs x (T, D) at positions n_past.. ; return the rows they finish and the new frontier."""
        r = self.ratio
        pooled, kv, score = POOL_CHUNK(self.kv(x), self.gate(x), self.ape, frontier.kv, frontier.score, n_past, r,
                                       self.width)
        n_rows = pooled.shape[0]
        if n_rows == 0:
            return pooled, Frontier(kv, score)
        first_row = n_past // r
        row_positions = (mx.arange(first_row, first_row + n_rows) * r).astype(mx.int32)
        return self._finish(pooled, row_positions), Frontier(kv, score)

    def step(self, kv: mx.array, gate: mx.array, position: mx.array, frontier: Frontier
             ) -> tuple[mx.array, Frontier]:
        """Feed one token at array `position` (1,), given as kv(x) and gate(x) (1, coff*width) of its normed input x;
        return the row its window gives so far (1, width) and the new frontier. Equal to `__call__` for a
        finished window; the row is final once it is."""
        stepped = POOL_STEP(kv, gate, self.ape, frontier.kv, frontier.score, position, self.ratio, self.width)
        return self._stepped(stepped, position)

    def step_with(self, other: Compressor, kv: mx.array, gate: mx.array, frontier: Frontier, other_kv: mx.array,
                  other_gate: mx.array, other_frontier: Frontier, position: mx.array
                  ) -> tuple[tuple[mx.array, Frontier], tuple[mx.array, Frontier]]:
        """`step` of this compressor and of `other`, one of the same ratio (a layer's indexer compressor), for one
        token: both (row, frontier) pairs, pooled in one launch on GPU backends (POOL_STEP_PAIR)."""
        if other.ratio != self.ratio:
            raise ValueError(f"compressors of ratios {self.ratio} and {other.ratio} do not step together")
        mine, others = POOL_STEP_PAIR((kv, gate, self.ape, frontier.kv, frontier.score),
                                      (other_kv, other_gate, other.ape, other_frontier.kv, other_frontier.score),
                                      position, self.ratio, self.width, other.width)
        return self._stepped(mine, position), other._stepped(others, position)

    def _stepped(self, stepped: tuple[mx.array, mx.array, mx.array], position: mx.array) -> tuple[mx.array, Frontier]:
        """(pooled row, frontier kv, frontier score) of a step at `position` -> its finished row and frontier."""
        pooled, kv, score = stepped
        return self._finish(pooled, position, align=self.ratio), Frontier(kv, score)  # at its window's first token

    def _finish(self, pooled: mx.array, positions: mx.array, align: int = 1) -> mx.array:
        """Pooled rows (n, width) at their positions (n,) (less positions % align), finished: norm, RoPE,
        quantisation simulation."""
        return FINISH_ROWS(pooled, positions, self.rope, (self.norm, self.eps), self.quant, False, align=align)


def pool_chunk(kv: mx.array, score: mx.array, ape: mx.array, frontier_kv: mx.array, frontier_score: mx.array,
               n_past: int, ratio: int, width: int) -> tuple[mx.array, mx.array, mx.array]:
    """A chunk's kv and gate scores (T, coff*width) at positions n_past.. into the frontier: the pooled rows of
    the windows it finishes (n, width), before their finish, and the new frontier's kv and score."""
    r, d = ratio, width
    t = kv.shape[0]
    overlap = ratio == 4
    score = score + ape[mx.arange(n_past, n_past + t) % r]
    waiting = n_past % r  # tokens of the current window already in the frontier
    current = r if overlap else 0  # first frontier row of the current window
    kv = mx.concatenate([frontier_kv[current : current + waiting], kv])
    score = mx.concatenate([frontier_score[current : current + waiting], score])
    n_rows = (waiting + t) // r
    done = n_rows * r

    if n_rows:
        windows_kv = kv[:done].reshape(n_rows, r, -1)
        windows_score = score[:done].reshape(n_rows, r, -1)
        if overlap:
            prev_kv = mx.concatenate([frontier_kv[None, :r, :d], windows_kv[:-1, :, :d]])
            prev_score = mx.concatenate([frontier_score[None, :r, :d], windows_score[:-1, :, :d]])
            windows_kv = mx.concatenate([prev_kv, windows_kv[:, :, d:]], axis=1)
            windows_score = mx.concatenate([prev_score, windows_score[:, :, d:]], axis=1)
        pooled = mx.sum(mx.softmax(windows_score, axis=1) * windows_kv, axis=1)
    else:
        pooled = mx.zeros((0, d))

    left = waiting + t - done
    pad = r - left
    new_kv = [kv[done:], mx.zeros((pad, kv.shape[1]))]
    new_score = [score[done:], mx.full((pad, kv.shape[1]), -mx.inf)]
    if overlap:
        last = (kv[done - r : done], score[done - r : done]) if n_rows else (frontier_kv[:r], frontier_score[:r])
        new_kv.insert(0, last[0])
        new_score.insert(0, last[1])
    return pooled, mx.concatenate(new_kv), mx.concatenate(new_score)


def pool_step(kv: mx.array, score: mx.array, ape: mx.array, frontier_kv: mx.array, frontier_score: mx.array,
              position: mx.array, ratio: int, width: int) -> tuple[mx.array, mx.array, mx.array]:
    """One token's kv and gate score (1, coff*width) into the frontier at `position`: its window pooled so far
    (1, width), and the new frontier (shifted, for ratio 4, or emptied once the window is complete)."""
    r, d = ratio, width
    overlap = ratio == 4
    slot = position % r
    score = score + mx.take(ape, slot, axis=0)
    current = r if overlap else 0
    here = (mx.arange(frontier_kv.shape[0]) == current + slot)[:, None]
    fkv, fscore = mx.where(here, kv, frontier_kv), mx.where(here, score, frontier_score)
    if overlap:  # lane 0 of the previous window and lane 1 of this one: 2r candidates per dim
        window_kv = mx.concatenate([fkv[:r, :d], fkv[r:, d:]])
        window_score = mx.concatenate([fscore[:r, :d], fscore[r:, d:]])
    else:
        window_kv, window_score = fkv, fscore
    pooled = mx.sum(mx.softmax(window_score, axis=0) * window_kv, axis=0, keepdims=True)
    done = slot == r - 1
    empty = Frontier.empty(ratio, width)
    if overlap:  # the finished window moves to rows 0..r-1
        empty = Frontier(mx.concatenate([fkv[r:], empty.kv[r:]]), mx.concatenate([fscore[r:], empty.score[r:]]))
    return pooled, mx.where(done, empty.kv, fkv), mx.where(done, empty.score, fscore)


POOL_CHUNK = CompressorChunk(pool_chunk)
"""`pool_chunk` as one kernel where a GPU backend has passed the first-use check (kernels/sublayers/compressor.py)."""

POOL_STEP = CompressorStep(pool_step)
"""`pool_step` as one kernel where a GPU backend has passed the first-use check (kernels/sublayers/compressor.py)."""

POOL_STEP_PAIR = CompressorStepPair(pool_step)
"""`pool_step` of two compressors of one ratio as one kernel where a GPU backend has passed the first-use check."""
