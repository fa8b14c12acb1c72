"""Session state (spec §5.1): what the model remembers about the tokens it has seen.

Per layer:
* the raw window: the KV rows of the last `sliding_window` positions, oldest first, (window, head_dim);
* on compressed layers, the compressed rows (a fixed-capacity buffer of ctx // ratio + 2 rows, rows
  0..n_tokens // ratio - 1 live) and the compressor frontier;
* on ratio-4 layers, the indexer rows and the indexer compressor frontier likewise.

Row counts and positions are derived from the token count, not stored. Every update builds new arrays and
MLX arrays are immutable, so a snapshot is a cheap copy of references and stays valid whatever happens next.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from ds4_mlx.model.compressor import Frontier
from ds4_mlx.model.config import ModelConfig, memory_estimate


@dataclass(frozen=True)
class LayerState:
    raw: mx.array
    comp: mx.array | None = None
    comp_frontier: Frontier | None = None
    index: mx.array | None = None
    index_frontier: Frontier | None = None

    def arrays(self) -> list[mx.array]:
        out = [self.raw]
        for rows, frontier in ((self.comp, self.comp_frontier), (self.index, self.index_frontier)):
            if rows is not None:
                out += [rows, frontier.kv, frontier.score]
        return out

    @classmethod
    def empty(cls, config: ModelConfig, layer: int, ctx: int) -> LayerState:
        raw = mx.zeros((config.sliding_window, config.head_dim))
        ratio = config.compress_ratio(layer)
        if ratio == 0:
            return cls(raw)
        rows = ctx // ratio + 2
        state = cls(raw, mx.zeros((rows, config.head_dim)), Frontier.empty(ratio, config.head_dim))
        if ratio != 4:
            return state
        return cls(raw, state.comp, state.comp_frontier, mx.zeros((rows, config.indexer_head_dim)),
                   Frontier.empty(ratio, config.indexer_head_dim))


@dataclass(frozen=True)
class CacheSnapshot:
    """The whole state of a SessionCache at one moment."""

    n_tokens: int
    layers: tuple[LayerState, ...]


class SessionCache:
    """The state of one token stream for a context of `ctx` tokens."""

    def __init__(self, config: ModelConfig, ctx: int):
        if ctx <= 0:
            raise ValueError(f"context size must be positive, got {ctx}")
        self.config = config
        self.ctx = ctx
        self.n_tokens = 0
        self.layers = [LayerState.empty(config, layer, ctx) for layer in range(config.n_layer)]

    def n_rows(self, layer: int) -> int:
        """Live compressed (and, on ratio-4 layers, indexer) rows of a layer."""
        ratio = self.config.compress_ratio(layer)
        return self.n_tokens // ratio if ratio else 0

    def snapshot(self) -> CacheSnapshot:
        return CacheSnapshot(self.n_tokens, tuple(self.layers))

    def restore(self, snapshot: CacheSnapshot) -> None:
        self.n_tokens = snapshot.n_tokens
        self.layers = list(snapshot.layers)

    def arrays(self) -> list[mx.array]:
        return [a for layer in self.layers for a in layer.arrays()]

    @property
    def nbytes(self) -> int:
        """Bytes held by the state's arrays (their full fixed capacity)."""
        return sum(a.nbytes for a in self.arrays())


def session_bytes(config: ModelConfig, ctx: int) -> int:
    """Bytes of a SessionCache for `ctx` tokens (raw windows, row buffers, frontiers), without building it."""
    return memory_estimate(config, ctx, raw_cap=config.sliding_window).total - config.n_vocab * 4
