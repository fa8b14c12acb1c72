"""Session state (ds4.c): what the model remembers about the tokens it has seen.

Per layer:
* the raw window: the KV rows of the last `sliding_window` positions, oldest first, (window, head_dim);
* on compressed layers, the compressed rows (a fixed-capacity buffer of ctx // ratio + 2 rows, rows
  0..n_tokens // ratio - 1 live) and the compressor frontier;
* on ratio-4 layers, the indexer rows and the indexer compressor frontier likewise.

Row counts and positions are derived from the token count, not stored. Every update builds new arrays and
MLX arrays are immutable, so a snapshot is a cheap copy of references and stays valid whatever happens next.

`write_payload` / `read_payload` turn the state into ds4's disk payload (ds4.c) and back. A pipeline rank's cache
(model/shard.py) holds rows of its own layers only (`SessionCache.held`); its payload has their rows alone (the
header and row counts stay whole), so it is read back only by a rank that holds the same layers: the disk cache's
identity names the split and the rank (cache/kvidentity.py).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import BinaryIO

import mlx.core as mx
import numpy as np

from ds4_mlx.errors import CacheFileError
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

    @staticmethod
    def count(ratio: int) -> int:
        """How many arrays `arrays()` lists for a layer of this compression ratio."""
        return 1 if ratio == 0 else 4 if ratio != 4 else 7

    @classmethod
    def from_arrays(cls, arrays: Sequence[mx.array]) -> LayerState:
        """The state whose `arrays()` are these (1, 4 or 7 of them: raw; compressed rows; indexer rows)."""
        raw, *rest = arrays
        if not rest:
            return cls(raw)
        index = (rest[3], Frontier(rest[4], rest[5])) if len(rest) == 6 else (None, None)
        return cls(raw, rest[0], Frontier(rest[1], rest[2]), *index)

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
class StepUndo:
    """What one decode step replaces rather than appends to: per layer the raw window (it shifts) and the
    frontiers. The row buffers are not held: the step writes at most the row a completed window makes, at index
    n_tokens // ratio, which the restored token count leaves outside the live rows (and the token fed there next
    writes again). Holding only these small arrays lets the step update the row buffers in place."""

    n_tokens: int
    kept: tuple[tuple[mx.array, Frontier | None, Frontier | None], ...]


@dataclass(frozen=True)
class CacheSnapshot:
    """The whole state of a SessionCache at one moment."""

    n_tokens: int
    layers: tuple[LayerState, ...]

    def arrays(self) -> list[mx.array]:
        return [a for layer in self.layers for a in layer.arrays()]


class SessionCache:
    """The state of one token stream for a context of `ctx` tokens."""

    def __init__(self, config: ModelConfig, ctx: int):
        if ctx <= 0:
            raise ValueError(f"context size must be positive, got {ctx}")
        self.config = config
        self.ctx = ctx
        self.n_tokens = 0
        self.layers = [LayerState.empty(config, layer, ctx) for layer in range(config.n_layer)]
        self.held = range(config.n_layer)
        """The layers whose rows this cache holds (a pipeline rank's own; the others' states are placeholders)."""

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

    def undo_point(self) -> StepUndo:
        """Taken just before a one-token step, to `take_back` that token (StepUndo)."""
        return StepUndo(self.n_tokens, tuple((s.raw, s.comp_frontier, s.index_frontier) for s in self.layers))

    def take_back(self, point: StepUndo) -> None:
        """The state before the one token fed since `point` was taken."""
        if self.n_tokens != point.n_tokens + 1:
            raise ValueError(f"an undo point of {point.n_tokens} tokens takes back one token, the cache holds "
                             f"{self.n_tokens}")
        self.layers = [LayerState(raw, state.comp, comp_frontier, state.index, index_frontier)
                       for state, (raw, comp_frontier, index_frontier) in zip(self.layers, point.kept)]
        self.n_tokens = point.n_tokens

    def advance(self, layers: Sequence[LayerState], n_tokens: int) -> None:
        """Takes the layer states a step left after its row at position n_tokens - 1 (Model.decode_rows): the state
        of that many tokens, later rows of the same step left out (their rows lie past the live ones)."""
        if not self.n_tokens < n_tokens <= self.ctx:
            raise ValueError(f"a step from {self.n_tokens} tokens cannot leave {n_tokens} in a {self.ctx}-token cache")
        self.layers, self.n_tokens = list(layers), n_tokens

    def unflatten(self, arrays: Sequence[mx.array]) -> list[LayerState]:
        """Layer states from a flat list in the order `arrays()` gives (the form a compiled step takes)."""
        return unflatten_layers(self.config, arrays)

    @property
    def nbytes(self) -> int:
        """Bytes held by the state's arrays (their full fixed capacity)."""
        return sum(a.nbytes for a in self.arrays())


def unflatten_layers(config: ModelConfig, arrays: Sequence[mx.array]) -> list[LayerState]:
    """Layer states from the flat list `SessionCache.arrays()` gives."""
    layers, start = [], 0
    for layer in range(config.n_layer):
        n = LayerState.count(config.compress_ratio(layer))
        layers.append(LayerState.from_arrays(arrays[start : start + n]))
        start += n
    return layers


def session_bytes(config: ModelConfig, ctx: int) -> int:
    """Bytes of a SessionCache for `ctx` tokens (raw windows, row buffers, frontiers), without building it."""
    return memory_estimate(config, ctx, raw_cap=config.sliding_window).total - config.n_vocab * 4


# ---------------------------------------------------------------------------------------------------------------
# ds4's session payload (ds4.c): what the disk KV cache stores, byte-compatible with ds4's files.

PAYLOAD_MAGIC = 0x34565344  # "DSV4", little-endian
PAYLOAD_VERSION = 1
DS4_PREFILL_CAP = 2048  # ds4's prefill chunk, recorded in the header (the whole context when it is smaller)
_HEADER = struct.Struct("<13I")


def write_payload(f: BinaryIO, cache: SessionCache, tokens: Sequence[int], logits: mx.array) -> None:
    """Write the cache, the tokens it holds and the logits for the next token as ds4's payload, in order:
    header, token ids, logits, per-layer row counts, then per layer the raw rows (oldest first), compressed rows
    and frontier, indexer rows and frontier. Little-endian u32 / f32 throughout. Layers outside `cache.held` have
    no rows written (a pipeline rank's payload)."""
    c = cache.config
    n = cache.n_tokens
    if len(tokens) != n:
        raise ValueError(f"the cache holds {n} tokens but {len(tokens)} token ids were given")
    window = min(c.sliding_window, cache.ctx)
    raw_live = min(window, n)
    f.write(_HEADER.pack(PAYLOAD_MAGIC, PAYLOAD_VERSION, cache.ctx, min(DS4_PREFILL_CAP, cache.ctx), window, window,
                         cache.ctx // 4 + 2, n, c.n_layer, c.head_dim, c.indexer_head_dim, c.n_vocab, raw_live))
    f.write(np.asarray(tokens, dtype="<u4").tobytes())
    f.write(_f32(logits, (c.n_vocab,)))
    rows = [cache.n_rows(layer) for layer in range(c.n_layer)]
    f.write(np.asarray(rows, dtype="<u4").tobytes())
    f.write(np.asarray([r if c.compress_ratio(i) == 4 else 0 for i, r in enumerate(rows)], dtype="<u4").tobytes())
    for layer, state in enumerate(cache.layers):
        if layer not in cache.held:
            continue
        f.write(_f32(state.raw[state.raw.shape[0] - raw_live :]))
        for buffer, frontier in ((state.comp, state.comp_frontier), (state.index, state.index_frontier)):
            if buffer is not None:
                f.write(_f32(buffer[: rows[layer]]))
                f.write(_f32(frontier.kv))
                f.write(_f32(frontier.score))


def read_payload(f: BinaryIO, config: ModelConfig, ctx: int, held: range | None = None
                 ) -> tuple[SessionCache, list[int], mx.array]:
    """Read a payload into a new cache of context `ctx`; return it with its token ids and next-token logits.
    `held`: the layers it has rows of (a pipeline rank's, as it wrote them; None: all), the others placeholders.

    Checks what ds4 checks: the model dimensions, a saved context no larger than `ctx`, fewer tokens than `ctx`,
    the same raw window, row counts that match the token count, and no trailing bytes. (ds4 also requires the
    same prefill chunk size; results here do not depend on it, so it is not checked.) Frontier rows without a
    token may hold -1e30 or -inf scores; both weigh nothing.
    """
    header = _HEADER.unpack(_read(f, _HEADER.size, "the header"))
    magic, version, saved_ctx, _, _, window, _, n, n_layer, head_dim, index_dim, n_vocab, raw_live = header
    if magic != PAYLOAD_MAGIC or version != PAYLOAD_VERSION:
        raise CacheFileError(f"not a ds4 session payload (magic {magic:#x} version {version}, expected "
                             f"{PAYLOAD_MAGIC:#x} version {PAYLOAD_VERSION})")
    expected = (config.n_layer, config.head_dim, config.indexer_head_dim, config.n_vocab)
    if (n_layer, head_dim, index_dim, n_vocab) != expected:
        raise CacheFileError(f"payload is for a model with (layers, head dim, indexer head dim, vocab) "
                             f"{(n_layer, head_dim, index_dim, n_vocab)}, this model has {expected}")
    if saved_ctx > ctx or n >= ctx:
        raise CacheFileError(f"payload holds {n} tokens of a {saved_ctx}-token context; this session's context "
                             f"is {ctx}")
    if window != min(config.sliding_window, ctx) or raw_live != min(window, n):
        raise CacheFileError(f"payload raw window {window} with {raw_live} live rows does not match this session "
                             f"(window {min(config.sliding_window, ctx)}, {min(config.sliding_window, ctx, n)} rows)")
    ids = np.frombuffer(_read(f, 4 * n, "the token ids"), dtype="<u4")
    if ids.size and int(ids.max()) >= n_vocab:
        raise CacheFileError(f"payload token id {int(ids.max())} is outside the vocabulary [0, {n_vocab})")
    tokens = ids.astype(np.int64).tolist()
    logits = mx.array(np.frombuffer(_read(f, 4 * n_vocab, "the logits"), dtype="<f4"))
    counts = np.frombuffer(_read(f, 8 * n_layer, "the row counts"), dtype="<u4").reshape(2, n_layer)
    cache = SessionCache(config, ctx)
    cache.n_tokens = n
    want = [[cache.n_rows(i) for i in range(n_layer)],
            [cache.n_rows(i) if config.compress_ratio(i) == 4 else 0 for i in range(n_layer)]]
    if counts.tolist() != want:
        raise CacheFileError(f"payload row counts {counts.tolist()} do not match {n} tokens (expected {want})")
    if held is not None:
        cache.held = held
    layers = []
    for layer, state in enumerate(cache.layers):
        if layer not in cache.held:
            layers.append(LayerState.empty(config, layer, 1))  # as Model.new_cache leaves another rank's layer
            continue
        raw = _read_f32(f, (raw_live, config.head_dim), f"layer {layer} raw rows")
        fields = {"raw": mx.concatenate([state.raw[: state.raw.shape[0] - raw_live], raw])}
        for rows_name, frontier_name in (("comp", "comp_frontier"), ("index", "index_frontier")):
            buffer, frontier = getattr(state, rows_name), getattr(state, frontier_name)
            if buffer is None:
                continue
            n_rows = cache.n_rows(layer)
            rows = _read_f32(f, (n_rows, buffer.shape[1]), f"layer {layer} {rows_name} rows")
            fields[rows_name] = mx.concatenate([rows, buffer[n_rows:]])
            fields[frontier_name] = Frontier(_read_f32(f, frontier.kv.shape, f"layer {layer} {rows_name} state_kv"),
                                             _read_f32(f, frontier.score.shape, f"layer {layer} {rows_name} score"))
        layers.append(LayerState(**fields))
    if f.read(1):
        raise CacheFileError("payload has bytes after the last layer")
    cache.layers = layers
    return cache, tokens, logits


def _f32(array: mx.array, shape: tuple[int, ...] | None = None) -> bytes:
    values = np.asarray(array, dtype="<f4")
    if shape is not None and values.shape != shape:
        raise ValueError(f"expected an array of shape {shape}, got {values.shape}")
    return values.tobytes()


def _read(f: BinaryIO, n: int, what: str) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise CacheFileError(f"payload ends inside {what} ({len(data)} of {n} bytes)")
    return data


def _read_f32(f: BinaryIO, shape: tuple[int, ...], what: str) -> mx.array:
    count = int(np.prod(shape))
    return mx.array(np.frombuffer(_read(f, 4 * count, what), dtype="<f4").reshape(shape))
