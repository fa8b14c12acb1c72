"""The MTP draft block (ds4.c): DeepSeek V4's multi-token-prediction layer as a drafter.

The MTP file holds one extra transformer block that guesses the token after next from two inputs at a position
p: the token x_p and the main model's final hyper-connection streams h_p (after the last layer, before the head).

1. e = RMSNorm(embed(x_p); enorm), projected by e_proj and copied into every stream;
2. each stream of h_p is RMSNorm'd with hnorm and projected by h_proj; the two are added;
3. the sum runs through the block as an ordinary layer with layer-1 semantics: raw sliding window only (ratio 0),
   base-10000 RoPE, learned top-k routing with its selection bias (no token hash), and its own KV window;
4. the head collapses the output streams with the MTP's own hc_head and norm, then applies the MAIN model's
   output matrix. The result is a guess for x_{p+1}.

The embedding and LM head are the main model's: the file has neither.

Drafting further ahead is recursive (ds4): the block's output streams at p stand in for h_{p+1}, and the guess
for x_{p+1} for the token, giving a guess for x_{p+2}, and so on. Those rows are speculative; callers snapshot the
cache before drafting and restore it after, and later feed the accepted tokens with the main model's real h.

The window holds rows of one contiguous run of positions. Attention with RoPE depends only on the distance between
positions, so the block runs at positions counted from the run's start (`MTPCache.origin`): 0 for a session the
MTP has followed from its first token, later when it joins a session restored from disk (ds4 does not save MTP
state either).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx

from ..errors import ModelFileMissing
from . import watchdog
from .cache import LayerState
from .config import ModelConfig
from .hyper_connection import HyperHead
from .model import Loader, Model
from .norm import rms_norm
from .weights import MTP_PREFIX, MTPWeights, open_mtp_weights


def open_mtp(path: str | os.PathLike[str], config: ModelConfig) -> MTPWeights:
    """Open an MTP file and validate its layout (ds4.c) against the main model's dimensions."""
    if not os.path.exists(path):
        raise ModelFileMissing.mtp_at(path)
    return open_mtp_weights(path, config)


@dataclass(frozen=True)
class MTPSnapshot:
    """The whole state of an MTPCache at one moment (MLX arrays are immutable: no copy)."""

    origin: int
    n_tokens: int
    layer: LayerState
    logits: mx.array | None
    hidden: mx.array | None

    def arrays(self) -> list[mx.array]:
        return [a for a in (*self.layer.arrays(), self.hidden, self.logits) if a is not None]


class MTPCache:
    """The MTP block's raw KV window over a run of positions origin..origin + n_tokens - 1, and its last output:
    `logits` guess the token after the last position, `hidden` are the block's output streams there."""

    def __init__(self, config: ModelConfig):
        self.config = config
        self.reset()

    def reset(self) -> None:
        self.origin = 0
        self.n_tokens = 0
        self.layer = LayerState(mx.zeros((self.config.sliding_window, self.config.head_dim)))
        self.logits: mx.array | None = None
        self.hidden: mx.array | None = None

    @property
    def position(self) -> int:
        """The absolute position of the next token the cache can take."""
        return self.origin + self.n_tokens

    def snapshot(self) -> MTPSnapshot:
        return MTPSnapshot(self.origin, self.n_tokens, self.layer, self.logits, self.hidden)

    def restore(self, snapshot: MTPSnapshot) -> None:
        self.origin, self.n_tokens, self.layer = snapshot.origin, snapshot.n_tokens, snapshot.layer
        self.logits, self.hidden = snapshot.logits, snapshot.hidden

    def arrays(self) -> list[mx.array]:
        """The state to evaluate after a step: the window and the output streams. The guess's logits go through
        the main model's LM head, as costly as the model's own; they stay lazy until a speculative step reads
        them, so a session that is not speculating (temperature > 0) never computes them."""
        return [a for a in (*self.layer.arrays(), self.hidden) if a is not None]


class MTP:
    """The MTP draft block of a main model, built from a validated MTP file."""

    def __init__(self, weights: MTPWeights, model: Model, progress: Callable[[int, int], None] | None = None):
        c = model.config
        self.config = c
        self.model = model
        watchdog.pause()  # this rank's own load: no deadline (model/watchdog.py)
        load = Loader(weights, progress)
        self.e_proj = load.linear(MTP_PREFIX + "e_proj.weight")
        self.h_proj = load.linear(MTP_PREFIX + "h_proj.weight")
        self.enorm = load.dense(MTP_PREFIX + "enorm.weight")
        self.hnorm = load.dense(MTP_PREFIX + "hnorm.weight")
        # The published per-layer arrays carry the MTP block's clamp last; ds4 requires 10 everywhere anyway.
        self.block = model.block(load, MTP_PREFIX, ratio=0, hash_routing=False, clamp=c.swiglu_clamp[-1],
                                 whole=True)  # on every rank of a split model, whole (model/shard.py)
        self.head_hc = HyperHead(
            fn=load.dense(MTP_PREFIX + "hc_head_fn.weight"),
            scale=load.dense(MTP_PREFIX + "hc_head_scale.weight"),
            base=load.dense(MTP_PREFIX + "hc_head_base.weight"),
            hc_eps=c.hc_eps,
            norm_eps=c.rms_eps,
        )
        self.norm = load.dense(MTP_PREFIX + "norm.weight")
        self.load_stats = load.finish()
        if model.split is not None:
            model.split.loaded()
        self.nbytes = self.load_stats.resident_bytes
        """Bytes of weights the block holds in memory (the embedding and LM head are the main model's)."""

    @classmethod
    def load(cls, path: str | os.PathLike[str], model: Model,
             progress: Callable[[int, int], None] | None = None) -> MTP:
        """Open, validate and load the MTP file that goes with `model`."""
        return cls(open_mtp(path, model.config), model, progress)

    def new_cache(self) -> MTPCache:
        return MTPCache(self.config)

    def __call__(
        self, tokens: mx.array, hidden: mx.array, position: int, cache: MTPCache
    ) -> tuple[mx.array, mx.array]:
        """Run the block over tokens (T,) at absolute positions position.. with their input streams hidden
        (T, n_hc, n_embd), and update the cache. Returns the guess for the token after the last one as logits
        (n_vocab,), and the block's output streams at the last position (n_hc, n_embd).

        An empty cache starts its run at `position`; a non-empty one must be continued at `cache.position`.
        """
        if cache.n_tokens == 0:
            cache.origin = position
        elif position != cache.position:
            raise ValueError(f"the MTP cache continues at position {cache.position}, not {position}")
        c = self.config
        t = tokens.size
        embedded = rms_norm(self.model.embedding.rows(tokens), self.enorm, c.rms_eps)
        from_token = self.e_proj(embedded)[:, None, :]
        from_hidden = self.h_proj(rms_norm(hidden, self.hnorm, c.rms_eps).reshape(-1, c.n_embd))
        streams = from_token + from_hidden.reshape(t, c.n_hc, c.n_embd)
        pending, cache.layer = self.block(streams, tokens, cache.n_tokens, cache.layer)
        streams = pending.apply()
        cache.n_tokens += t
        last = streams[-1:]
        logits = self.model.output(rms_norm(self.head_hc(last), self.norm, c.rms_eps))[0]
        cache.logits, cache.hidden = logits, last[0]
        return cache.logits, cache.hidden

    def draft(self, token: int, hidden: mx.array, position: int, cache: MTPCache) -> tuple[mx.array, mx.array]:
        """One recursive step: the guess after `token` at `position`, given the streams (n_hc, n_embd) that stand
        for the main model's there (the previous step's output). Returns (logits, output streams)."""
        return self(mx.array([token], dtype=mx.int32), hidden[None], position, cache)
