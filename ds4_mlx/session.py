"""A model session: the tokens a model has seen, its cache, and the logits for the next token.

This is the notebook-facing handle on one stream of model state. The engine keeps one live Session and reuses it
when a new prompt extends what it holds; the disk KV cache serialises its snapshots.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import mlx.core as mx

from .errors import RequestError
from .model.model import DEFAULT_PREFILL_CHUNK, Model


def prefill_chunk_for(ctx: int) -> int:
    """ds4's prefill chunk: 2048 tokens when the context is larger, else the whole context (spec §3.10)."""
    return DEFAULT_PREFILL_CHUNK if ctx > DEFAULT_PREFILL_CHUNK else ctx


@dataclass(frozen=True)
class Snapshot:
    """An immutable copy of a session's state (MLX arrays are immutable, so this costs no copy)."""

    tokens: tuple[int, ...]
    cache: object
    logits: mx.array | None


class Session:
    """One live stream of model state over a fixed context size."""

    def __init__(self, model: Model, ctx: int) -> None:
        self.model = model
        self.ctx = ctx
        self.chunk_size = prefill_chunk_for(ctx)
        self.reset()

    def reset(self) -> None:
        """Forget everything: an empty cache at position 0."""
        self.tokens: list[int] = []
        self.cache = self.model.new_cache(self.ctx)
        self.logits: mx.array | None = None

    @property
    def room(self) -> int:
        """How many more tokens fit in the context."""
        return self.ctx - len(self.tokens)

    def prefill(
        self, tokens: Sequence[int], progress: Callable[[int, int], None] | None = None
    ) -> mx.array:
        """Feeds tokens in chunks (layer-major inside each chunk); returns the logits for the next token.

        `progress(done, total)` is called after every chunk.
        """
        for done, total in self.prefill_steps(tokens):
            if progress is not None:
                progress(done, total)
        if self.logits is None:
            raise RequestError("nothing to prefill: the session is empty and no tokens were given")
        return self.logits

    def prefill_steps(self, tokens: Sequence[int]) -> Iterator[tuple[int, int]]:
        """The chunked prefill as a generator of (done, total), so callers can report progress between chunks."""
        tokens = list(tokens)
        if len(tokens) > self.room:
            raise RequestError(
                f"{len(tokens)} more tokens do not fit: the session holds {len(self.tokens)} of a "
                f"{self.ctx}-token context"
            )
        for start in range(0, len(tokens), self.chunk_size):
            chunk = tokens[start : start + self.chunk_size]
            self.logits = self.model(mx.array(chunk, dtype=mx.int32), self.cache)
            mx.eval(self.logits, *self.cache.arrays())
            self.tokens.extend(chunk)
            yield start + len(chunk), len(tokens)

    def decode(self, token: int) -> mx.array:
        """Feed one token; returns the logits for the next one."""
        return self.prefill([token])

    def snapshot(self) -> Snapshot:
        return Snapshot(tuple(self.tokens), self.cache.snapshot(), self.logits)

    def restore(self, snap: Snapshot) -> None:
        self.tokens = list(snap.tokens)
        self.cache.restore(snap.cache)
        self.logits = snap.logits
