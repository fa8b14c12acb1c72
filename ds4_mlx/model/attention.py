"""The attention sublayer (ds4.c).

Queries come through a low-rank path (q_a, norm, q_b) and get a per-head RMSNorm without weight. One shared
head serves as both key and value (K = V). A query at position p attends to

* the raw window: the KV rows of positions p-W+1..p (its own included), and
* on compressed layers, compressed rows c < floor((p+1)/ratio): all of them on ratio-128 layers; on ratio-4 layers
  all of them while there are at most top_k, else the top_k the lightning indexer picks,

plus a per-head sink logit that only adds to the softmax denominator. Because values are rotated keys, the
output is de-rotated at the query position, then projected per group of heads to a low rank and mixed back to
the model width.

A chunk of T tokens is computed at once; masks give every query exactly the rows it would see if the tokens were
fed one at a time. Queries run in blocks to bound the memory of scores and gathered rows; on GPU backends a
block's attention core, `attend_block` (masks from the positions, the key sets read where they are stored, softmax
with the sinks), is one kernel (kernels/prefill/chunk_attention.py) that needs neither, so there a layer's queries are
one block unless the indexer's scores bound it. The block takes q_b's output and the RoPE, so that the queries' norm and
RoPE and the output's inverse RoPE are part of that launch on CUDA (composed around it elsewhere, as the decode
step's `attend_step` does).

`step` is the decode form of the same sublayer: one token at a position held in an array, every shape fixed by
the context size, so a compiled decode step traces it once. It always lets the indexer choose among the visible
compressed rows (with at most top_k visible, it chooses all of them, as the chunk form does by not asking it).
It multiplies the token's normed input by all the matrices that read it (q_a, kv, the compressors' kv and gate,
the indexer's proj) through one FusedLinear: one launch per storage form rather than one per matrix. Its attention
core, `attend_step` (the query's per-head norm and RoPE, the masks, attention over the window and the compressed
rows as they are stored, the output's inverse RoPE), is one kernel on GPU backends (kernels/decode/attention.py). Since
only projections read them, the layer's input norm (attn_norm) and the query latents' (q_a_norm) are not computed on
their own there: the projections take the raw input and the norm, and fold it into their matvec launches
(model/linear.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import mlx.core as mx

from ds4_mlx.kernels.decode.attention import DecodeAttention
from ds4_mlx.kernels.prefill.chunk_attention import ChunkAttention
from ds4_mlx.kernels.decode.fused_norm import Norm
from ds4_mlx.kernels.sublayers.indexer import IndexerPick
from ds4_mlx.kernels.sublayers.rows import join_rows, write_row
from ds4_mlx.model.cache import LayerState
from ds4_mlx.model.compressor import Compressor
from ds4_mlx.model.linear import FusedLinear, Linear
from ds4_mlx.model.norm import rms_norm
from ds4_mlx.model.quant_sim import FINISH_INTO_WINDOW, FINISH_ROWS, RowQuant
from ds4_mlx.model.rope import ROTATE, RoPE, cos_sin
from ds4_mlx.model.topk import mask_to_indices, top_k_mask

QUERY_BLOCK = 128
INDEXER_SCORE_BYTES = 256 << 20
"""Queries per block shrink so that the indexer's (queries, heads, rows) scores stay below this."""


@dataclass
class Indexer:
    """Lightning indexer: scores compressed rows per query, sum_h w_h * relu(q_h . k_c), and keeps the top k."""

    q_b: Linear  # (n_head * head_dim, q_lora_rank)
    proj: Linear  # (n_head, n_embd)
    compressor: Compressor  # produces the indexer rows k_c
    n_head: int
    head_dim: int
    top_k: int
    rope: RoPE
    simulate_quant: bool

    def queries(self, q_latent: mx.array, proj: mx.array, positions: mx.array, norm: Norm | None = None
                ) -> tuple[mx.array, mx.array]:
        """Indexer queries (T, n_head, head_dim) and head weights (T, n_head) for a chunk, from the query latents
        and `proj` (T, n_head), the indexer's proj of the normed inputs. With `norm` (q_a_norm, eps), q_latent is
        q_a's output before that norm, which q_b applies."""
        return self.query_rows(q_latent, positions, norm), proj * self.weight_scale

    @property
    def weight_scale(self) -> float:
        """What the head weights (proj's outputs) are multiplied by."""
        return 1.0 / math.sqrt(self.head_dim * self.n_head)

    @property
    def quant(self) -> RowQuant:
        """The quantisation simulation that ends a query's finish."""
        return RowQuant.INDEXER_FP4 if self.simulate_quant else RowQuant.NONE

    def raw_queries(self, q_latent: mx.array, norm: Norm | None = None) -> mx.array:
        """q_b's output (T, n_head, head_dim), before the queries' finish (`finish_queries`). `norm` as in
        `queries`."""
        return self.q_b(q_latent, norm=norm).reshape(q_latent.shape[0], self.n_head, self.head_dim)

    def query_rows(self, q_latent: mx.array, positions: mx.array, norm: Norm | None = None) -> mx.array:
        """The indexer queries (T, n_head, head_dim) of `queries`."""
        return finish_queries(self.raw_queries(q_latent, norm), positions, self.rope, self.quant)

    def pick(self, q_latent: mx.array, proj: mx.array, positions: mx.array, rows: mx.array, norm: Norm | None = None
             ) -> tuple[mx.array, mx.array]:
        """The decode step's choice: the rows' indices (T, top_k) ascending and which of them are real, for queries
        at array `positions` over the whole row buffer (two kernels on GPU backends, see INDEXER_PICK: the first
        also finishes the queries). `norm` as in `queries`."""
        return self.pick_raw(self.q_b(q_latent, norm=norm), proj, positions, rows)

    def pick_raw(self, q: mx.array, proj: mx.array, positions: mx.array, rows: mx.array) -> tuple[mx.array, mx.array]:
        """`pick` from q_b's output q (T, n_head * head_dim), computed already (a step's rows share its launch)."""
        return INDEXER_PICK(q, proj, rows, positions, self.rope, self.quant, self.compressor.ratio, self.top_k,
                            self.weight_scale)


def finish_queries(q: mx.array, positions: mx.array, rope: RoPE, quant: RowQuant) -> mx.array:
    """Indexer queries from q_b's output (T, n_head, head_dim) at positions (T,): RoPE, then (simulating) Hadamard +
    FP4, one launch on GPU backends (FINISH_ROWS)."""
    return FINISH_ROWS(q, positions, rope, None, quant, False)


def index_scores(q: mx.array, weights: mx.array, rows: mx.array, visible: mx.array) -> mx.array:
    """sum_h w_h relu(q_h . k_c) (B, n_rows) for queries q (B, n_head, d), -inf where `visible` (B, n_rows) is not."""
    dots = mx.maximum(q @ rows.T, 0)  # (B, n_head, n_rows)
    scores = mx.sum(weights[:, :, None] * dots, axis=1)
    return mx.where(visible, scores, -mx.inf)


def pick_rows(q: mx.array, weights: mx.array, rows: mx.array, positions: mx.array, ratio: int, top_k: int,
              scale: float = 1.0) -> tuple[mx.array, mx.array]:
    """The indexer's choice for queries at positions (T,), which see rows c < (p + 1) // ratio of rows (N, d), with
    head weights `weights` times `scale`: ascending indices (T, top_k) and whether each is a chosen row. With at
    most top_k visible rows these are 0..top_k-1, real below the visible count (with N <= top_k: 0..N-1, shape
    (T, N))."""
    weights = weights * scale
    visible = mx.arange(rows.shape[0])[None, :] < ((positions + 1) // ratio)[:, None]
    chosen = top_k_mask(index_scores(q, weights, rows, visible), top_k) & visible
    picked = mask_to_indices(chosen, top_k)
    return picked, mx.take_along_axis(chosen, picked, axis=-1)


def pick_finished_rows(q: mx.array, weights: mx.array, rows: mx.array, positions: mx.array, rope: RoPE | None,
                       quant: RowQuant, ratio: int, top_k: int, scale: float = 1.0) -> tuple[mx.array, mx.array]:
    """`pick_rows` for q_b's output q (T, n_head, d) or (T, n_head * d): the queries finished first
    (`finish_queries`), unless `rope` is None (they are finished already)."""
    q = q.reshape(*weights.shape, rows.shape[1])
    if rope is not None:
        q = finish_queries(q, positions, rope, quant)
    return pick_rows(q, weights, rows, positions, ratio, top_k, scale)


INDEXER_PICK = IndexerPick(pick_finished_rows)
"""`pick_finished_rows` as two kernels (the queries' finish and scores, then the top k) where a GPU backend has
passed the first-use check (kernels/sublayers/indexer.py)."""


@dataclass
class Attention:
    """One layer's attention: projections, its compressor and indexer (if any), and the sink logits."""

    q_a: Linear
    q_a_norm: mx.array
    q_b: Linear
    kv: Linear
    kv_norm: mx.array
    sinks: mx.array  # (n_head,)
    out_a: Linear  # (o_groups * o_lora_rank, n_head * head_dim / o_groups)
    out_b: Linear  # (n_embd, o_groups * o_lora_rank)
    n_head: int
    head_dim: int
    n_rot: int
    window: int
    o_groups: int
    rope: RoPE
    compressor: Compressor | None
    indexer: Indexer | None
    simulate_quant: bool
    eps: float
    project: FusedLinear = field(init=False, repr=False)
    """`input_projections` read as one at load: a decode step's products of its normed input, in that order."""

    def __post_init__(self) -> None:
        self.project = FusedLinear(self.input_projections())
        self.out_a.hold_groups(self.o_groups)

    def input_projections(self) -> list[Linear]:
        """The matrices a decode step multiplies its normed input x by: q_a and kv, then the compressor's kv and
        gate, and on indexed layers the indexer compressor's kv and gate and the indexer's proj."""
        found = [self.q_a, self.kv]
        if self.compressor is not None:
            found += [self.compressor.kv, self.compressor.gate]
        if self.indexer is not None:
            found += [self.indexer.compressor.kv, self.indexer.compressor.gate, self.indexer.proj]
        return found

    @property
    def ratio(self) -> int:
        return 0 if self.compressor is None else self.compressor.ratio

    def __call__(self, x: mx.array, n_past: int, state: LayerState) -> tuple[mx.array, LayerState]:
        """Attention output (T, n_embd) for normed inputs x (T, n_embd) at positions n_past.., and the new state."""
        t = x.shape[0]
        positions = mx.arange(n_past, n_past + t, dtype=mx.int32)

        q_latent = rms_norm(self.q_a(x), self.q_a_norm, self.eps)
        q = self.q_b(q_latent).reshape(t, self.n_head, self.head_dim)  # normed and rotated in CHUNK_ATTENTION

        kv = self._finish_kv(self.kv(x), positions)
        n_prev = min(n_past, self.window - 1)
        raw = mx.concatenate([state.raw[self.window - n_prev :], kv])  # row j holds position n_past - n_prev + j
        state = replace(state, raw=mx.concatenate([state.raw, kv])[-self.window :])

        comp_rows = index_rows = index_queries = None
        if self.compressor is not None:
            state, comp_rows, index_rows = self._compress(x, n_past, state)
            if index_rows is not None and index_rows.shape[0] > self.indexer.top_k:
                index_queries = self.indexer.queries(q_latent, self.indexer.proj(x), positions)
            if comp_rows.shape[0] == 0:
                comp_rows = None

        picks = 0 if self.indexer is None else self.indexer.top_k
        block = (t if CHUNK_ATTENTION.used(self.n_head, self.head_dim, self.window, self.ratio, picks, self.rope.n_rot)
                 else QUERY_BLOCK)
        if index_queries is not None:
            iq, iw = index_queries  # the reference's (B, n_head, N) product bounds a block; the kernels' does not
            if not INDEXER_PICK.enabled(iq, iw, index_rows, positions, None, RowQuant.NONE, self.ratio, picks):
                block = max(1, min(block, INDEXER_SCORE_BYTES // (4 * self.indexer.n_head * index_rows.shape[0])))
        out = []
        for start in range(0, t, block):
            stop = min(start + block, t)
            picked = valid = None
            if index_queries is not None and (n_past + stop) // self.ratio > self.indexer.top_k:
                picked, valid = INDEXER_PICK(iq[start:stop], iw[start:stop], index_rows, positions[start:stop], None,
                                             RowQuant.NONE, self.ratio, self.indexer.top_k)
            out.append(CHUNK_ATTENTION(q[start:stop], raw, n_past - n_prev, n_past + start, self.window, comp_rows,
                                       self.ratio, picked, valid, self.sinks, self.rope.inv_freq, self.eps))
        return self._project_out(mx.concatenate(out) if len(out) > 1 else out[0]), state

    def step(self, x: mx.array, position: mx.array, state: LayerState, norm: Norm, completes: bool = True
             ) -> tuple[mx.array, LayerState]:
        """Attention output (1, n_embd) for one input x (1, n_embd) at array `position` (1,), and the new state.
        x is the layer's input before its norm `norm` (attn_norm, eps): only the input projections read the normed
        input, and they apply the norm themselves (folded into their matvec launches on GPU backends).
        `completes`: whether this token ends a compression window, whose row (and indexer row) is then written
        to the row buffers. Before that the row is masked by position, so a step that does not complete one
        leaves the buffers as they are (no write: fewer launches); True is right for any step."""
        out, (state,) = self.step_rows(x, position, (state,), norm, (1,), completes)
        return out, state

    def step_rows(self, x: mx.array, positions: mx.array, states: Sequence[LayerState], norm: Norm,
                  groups: Sequence[int], completes: bool = True) -> tuple[mx.array, list[LayerState]]:
        """`step` over B rows: inputs x (B, n_embd) at array `positions` (B,), the first groups[0] rows a token each
        of the session whose state is states[0], the next groups[1] rows of states[1]'s, and so on; a session's
        rows are consecutive tokens, each attending to the rows before it. The projections read all rows at once
        (one product per weight); the raw window, the compressors and the indexer step per row against the row's
        own session. Returns the output (B, n_embd) and each row's state, the state its session has once that row
        is fed; a session's rows share its last row's row buffers (an earlier row's state is its session's after
        that row: rows written later lie past its live rows)."""
        if x.shape[0] > 1:  # the input norm folded into the matvecs is checked for one row only: not taken here
            x, norm = rms_norm(x, *norm), None
        q_a, kv, *compressing = self.project(x, norm=norm)  # the input_projections, one launch per storage form
        q_norm = (self.q_a_norm, self.eps)  # the query latents' norm, applied by q_b and the indexer's q_b
        q = self.q_b(q_a, norm=q_norm)  # normed per head and rotated by DECODE_ATTENTION
        index_q = self.indexer.q_b(q_a, norm=q_norm) if self.indexer is not None else None
        per_row = [q, kv, positions, *compressing, *((index_q,) if index_q is not None else ())]
        many = x.shape[0] > 1
        if many:  # each product's rows, one node a product (views)
            per_row = list(zip(*(mx.split(a, x.shape[0]) for a in per_row)))
        heads, rows, at = [], [], 0
        for state, n in zip(states, groups):
            first = len(rows)
            for row in range(at, at + n):
                q_r, kv_r, position, *rest = per_row[row] if many else per_row
                out, state = self._step_row(q_r, kv_r, position, state, rest, completes, row)
                heads.append(out)
                rows.append(state)
            at += n
            last = rows[-1]  # the session's rows share its last row's buffers
            rows[first:-1] = [replace(s, comp=last.comp, index=last.index) for s in rows[first:-1]]
        return self._project_out(join_rows(heads)), rows

    def _step_row(self, q: mx.array, kv: mx.array, position: mx.array, state: LayerState,
                  compressing: list[mx.array], completes: bool, slot: int) -> tuple[mx.array, LayerState]:
        """Row `slot` of `step_rows`: its query heads (1, n_head, head_dim) and the state after it, from its products
        q (1, H * D), kv and (compressed layers) the compressors' kv and gate, the indexer's proj and q_b output."""
        raw = self._finish_kv(kv, position, window=state.raw)  # row j holds position - window + 1 + j
        state = replace(state, raw=raw)
        picked = valid = None
        if self.compressor is not None:
            comp_kv, comp_gate, *indexing = compressing
            if self.indexer is None:
                row, frontier = self.compressor.step(comp_kv, comp_gate, position, state.comp_frontier)
            else:  # both compressors' steps in one launch
                index_kv, index_gate, index_proj, index_q = indexing
                (row, frontier), (index_row, index_frontier) = self.compressor.step_with(
                    self.indexer.compressor, comp_kv, comp_gate, state.comp_frontier, index_kv, index_gate,
                    state.index_frontier, position)
            comp = write_row(state.comp, row, position, self.ratio) if completes else state.comp
            state = replace(state, comp=comp, comp_frontier=frontier)
            if self.indexer is not None:
                index = write_row(state.index, index_row, position, self.ratio) if completes else state.index
                state = replace(state, index=index, index_frontier=index_frontier)
                picked, valid = self.indexer.pick_raw(index_q, index_proj, position, index)
        out = DECODE_ATTENTION(q, position, self.rope.inv_freq, raw, state.comp, picked, valid, self.sinks,
                               self.ratio, self.eps, slot)
        return out, state

    def _compress(
        self, x: mx.array, n_past: int, state: LayerState
    ) -> tuple[LayerState, mx.array, mx.array | None]:
        """Run the compressor (and the indexer's) over the chunk; return the state and every live row so far."""
        n_before, n_rows = n_past // self.ratio, (n_past + x.shape[0]) // self.ratio
        rows, frontier = self.compressor(x, n_past, state.comp_frontier)
        state = replace(state, comp=_append_rows(state.comp, n_before, rows), comp_frontier=frontier)
        if self.indexer is None:
            return state, state.comp[:n_rows], None
        rows, frontier = self.indexer.compressor(x, n_past, state.index_frontier)
        state = replace(state, index=_append_rows(state.index, n_before, rows), index_frontier=frontier)
        return state, state.comp[:n_rows], state.index[:n_rows]

    def _finish_kv(self, kv: mx.array, positions: mx.array, window: mx.array | None = None) -> mx.array:
        """KV rows as the raw ring holds them: kv_norm, RoPE and, simulating, FP8 and the float16 round (one launch
        on GPU backends). With `window`, a decode token's row appended to it, its oldest row dropped (the same
        launch)."""
        quant = RowQuant.KV_FP8 if self.simulate_quant else RowQuant.NONE
        args = (kv, positions, self.rope, (self.kv_norm, self.eps), quant, self.simulate_quant)
        return FINISH_ROWS(*args) if window is None else FINISH_INTO_WINDOW(*args, window)

    def _project_out(self, heads: mx.array) -> mx.array:
        """Grouped low-rank output of heads (T, H, D): group g's heads (concatenated) -> o_lora_rank, then all
        groups -> n_embd."""
        return self.out_b(self.out_a.grouped(heads, self.o_groups))


def attend(q: mx.array, keys: list[mx.array], masks: list[mx.array], sinks: mx.array, scale: float) -> mx.array:
    """Softmax attention of queries q (B, H, d) with per-head sink logits over key sets that are also the values
    (each (N, d) shared or (B, N, d) per query), where masks (B, N) allow."""
    scores = []
    for k, mask in zip(keys, masks):
        s = q @ (k.T if k.ndim == 2 else mx.swapaxes(k, 1, 2)) * scale  # (B, H, N)
        scores.append(mx.where(mask[:, None, :], s, -mx.inf))
    sinks = sinks[None, :, None]
    top = mx.maximum(mx.max(mx.concatenate(scores, axis=-1), axis=-1, keepdims=True), sinks)
    probs = [mx.exp(s - top) for s in scores]
    denom = mx.exp(sinks - top) + sum(mx.sum(p, axis=-1, keepdims=True) for p in probs)
    out = sum(p @ k for p, k in zip(probs, keys))
    return out / denom


def attend_step(q: mx.array, position: mx.array, inv_freq: mx.array, window: mx.array, rows: mx.array | None,
                picked: mx.array | None, valid: mx.array | None, sinks: mx.array, ratio: int, eps: float) -> mx.array:
    """The decode step's attention core for q_b's output q (1, H * D) at `position` (1,): the query's per-head
    RMSNorm and RoPE, `attend` over the raw window (W, D) (row j at position - W + 1 + j) and the compressed rows
    (C, D) (the first (position + 1) // ratio, or with the indexer's `picked` (1, P), those where `valid`), and the
    output's inverse RoPE -> (1, H, D). The chunk form's formulas, composed as there."""
    heads, d = sinks.shape[0], window.shape[1]
    n_rot = 2 * inv_freq.shape[0]
    cos, sin = cos_sin(position, inv_freq)
    q = ROTATE(rms_norm(q.reshape(1, heads, d), None, eps), cos, sin, n_rot, False)
    keys, masks = [window], [mx.arange(window.shape[0])[None, :] >= window.shape[0] - 1 - position[:, None]]
    if picked is not None:
        keys.append(rows[picked])  # (1, P, D)
        masks.append(valid)
    elif rows is not None:
        keys.append(rows)
        masks.append(mx.arange(rows.shape[0])[None, :] < ((position + 1) // ratio)[:, None])
    return ROTATE(attend(q, keys, masks, sinks, 1.0 / math.sqrt(d)), cos, sin, n_rot, True)


DECODE_ATTENTION = DecodeAttention(attend_step)
"""`attend_step` as one kernel where a GPU backend has passed the first-use check (kernels/decode/attention.py)."""


def attend_block(q: mx.array, raw: mx.array, raw_first: int, first: int, window: int, rows: mx.array | None,
                 ratio: int, picked: mx.array | None, valid: mx.array | None, sinks: mx.array) -> mx.array:
    """A block of chunk queries' attention core: `attend` for queries q (B, H, D) at positions first.. over the raw
    rows (R, D) (row j at position raw_first + j) each query's window shows (p - window < position <= p), then
    the compressed rows (C, D) or None: the indexer's `picked` (B, K) where `valid` (B, K), or without picks the
    first (p + 1) // ratio."""
    positions = mx.arange(first, first + q.shape[0], dtype=mx.int32)[:, None]
    lo, hi = max(0, first - window + 1 - raw_first), first + q.shape[0] - raw_first
    key_pos = mx.arange(raw_first + lo, raw_first + hi, dtype=mx.int32)[None, :]
    keys, masks = [raw[lo:hi]], [(key_pos <= positions) & (key_pos > positions - window)]
    if picked is not None:
        keys.append(rows[picked])  # (B, K, D): each query's own rows
        masks.append(valid)
    elif rows is not None:
        keys.append(rows)
        masks.append(mx.arange(rows.shape[0])[None, :] < (positions + 1) // ratio)
    return attend(q, keys, masks, sinks, 1.0 / math.sqrt(q.shape[-1]))


CHUNK_ATTENTION = ChunkAttention(attend_block)
"""`attend_block` as one kernel per block where a GPU backend has passed the first-use check
(kernels/decode/attention.py); with it, a layer's queries run as one block unless the indexer's scores bound it."""


def _append_rows(buffer: mx.array, n_rows: int, rows: mx.array) -> mx.array:
    """Write `rows` after the first n_rows rows of a fixed-capacity row buffer."""
    if rows.shape[0] == 0:
        return buffer
    if n_rows + rows.shape[0] > buffer.shape[0]:
        raise ValueError(f"compressed-row buffer of {buffer.shape[0]} rows is full; the context size is exceeded")
    return mx.slice_update(buffer, rows, mx.array([n_rows]), axes=(0,))
