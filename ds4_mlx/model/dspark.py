"""The DSpark drafter (DeepSeek's 0731 speculative decoder): 3 stages over the main model's layer outputs.

What it reads. For every position t the main model has committed, F_t is the mean over the hyper-connection
streams of the outputs of its target layers (Flash: 40, 41, 42), side by side (Model.taps); main_x_t =
RMSNorm(main_proj F_t; main_norm) is computed once, with stage 0's weights, and each stage s keeps its own context
row ckv_{s,t} = RoPE_t(kv_norm_s(wkv_s main_x_t)) (K = V, the FP8 simulation of the main model's KV rows when it
simulates) for the last `window` positions (Flash: 128). The context rows follow DeepSeek's inference/model.py and
every port of it: no HC-pre or attn_norm before wkv (the C engine applies both when it seeds a window, not when it
maintains one). F_t stays float32, as the main model's activations and the C engine's taps do; the reference rounds
it to bfloat16 and FP8-quantizes it as main_proj's input.

How it drafts. With P the last committed position and the anchor a (the next token, chosen but not yet fed), a
block of `block_size` rows [a, noise, noise, ...] at positions P+1.. is embedded with the main model's embedding,
copied into every stream, and runs once through the three stages in series. Each stage is an ordinary V4 block
(HC, raw-window attention with a per-head sink, score-routed MoE) whose queries attend to the stage's context rows
and to all the block's own rows (non-causal inside the block). Stage 2's hc_head and norm feed the main model's LM
head: base logits U_k for the token at P+2+k. A rank-r Markov head then chains the drafts: prev_0 = a, logits_k =
U_k + W2 W1[prev_k], d_{k+1} = pick(logits_k), prev_{k+1} = d_{k+1}; and the confidence head gives
sigmoid(proj [x_k; W1[prev_k]]) from the pre-norm hc_head output x_k, as the reference does (the C engine reads it
after norm). It is advisory in this engine, which verifies every draft: the C engine (tau 0.7), DeepSpec and SGLang
cut a block at its first draft below a threshold, which saves verify rows where each row costs.

Sources: DeepSeek's DSpark paper (DeepSpec), deepseek-ai/DeepSeek-V4-Flash-0731 inference/model.py (DSparkAttention,
the heads, the taps) and its ports (mlx-vlm, SGLang, a llama.cpp fork, MindStudio), the C engine's ds4.c and its
converter, restated in prose in ../shared/spec/dspark.md §2.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from ..errors import ModelFileMissing
from . import watchdog
from .attention import attend
from .config import ModelConfig
from .dspark_file import DSparkWeights, open_dspark_weights, support_kind
from .hyper_connection import HyperHead, PendingPost
from .model import Block, Loader, Model
from .mtp import open_mtp
from .norm import rms_norm
from .weights import MTPWeights


def open_drafter(path: str | os.PathLike[str], main_config: ModelConfig) -> MTPWeights | DSparkWeights:
    """Open and validate a --mtp file as the drafter its tensors say (the C engine's rule): MTP-1 or DSpark."""
    if not os.path.exists(path):
        raise ModelFileMissing.mtp_at(path)
    return open_dspark_weights(path, main_config) if support_kind(path) == "dspark" else open_mtp(path, main_config)


@dataclass(frozen=True)
class DSparkSnapshot:
    """A DSparkCache at one moment (MLX arrays are immutable: no copy)."""

    rings: tuple[mx.array, ...]
    end: int

    def arrays(self) -> list[mx.array]:
        return list(self.rings)


class DSparkCache:
    """Each stage's context rows (n, head_dim) for the committed positions end - n .. end - 1 (n <= window)."""

    def __init__(self, n_stages: int, head_dim: int, window: int) -> None:
        self.n_stages, self.head_dim, self.window = n_stages, head_dim, window
        self.reset()

    def reset(self, end: int = 0) -> None:
        self.rings = tuple(mx.zeros((0, self.head_dim)) for _ in range(self.n_stages))
        self.end = end

    @property
    def n_rows(self) -> int:
        return self.rings[0].shape[0]

    def snapshot(self) -> DSparkSnapshot:
        return DSparkSnapshot(self.rings, self.end)

    def restore(self, snapshot: DSparkSnapshot) -> None:
        self.rings, self.end = snapshot.rings, snapshot.end

    def arrays(self) -> list[mx.array]:
        return list(self.rings)


@dataclass(frozen=True)
class Draft:
    """One block's proposals: `tokens` d_1.., the distribution each was drawn from (`probs`, (k, n_vocab), for the
    acceptance rule when sampling; None for greedy drafts) and each draft's confidence."""

    tokens: list[int]
    probs: np.ndarray | None
    confidence: list[float]


class DSpark:
    """The DSpark drafter of a main model, built from a validated support file."""

    def __init__(self, weights: DSparkWeights, model: Model, progress: Callable[[int, int], None] | None = None):
        c = model.config
        self.config, self.model, self.spec = c, model, weights.spec
        watchdog.pause()  # this rank's own load: no deadline (model/watchdog.py)
        load = Loader(weights, progress)
        self.stages: list[Block] = [
            model.block(load, f"mtp.{s}.", ratio=0, hash_routing=False, clamp=c.swiglu_clamp[-1], whole=True)
            for s in range(self.spec.n_stages)
        ]
        last = f"mtp.{self.spec.n_stages - 1}."
        self.main_proj = load.linear("mtp.0.main_proj.weight")
        self.main_norm = load.dense("mtp.0.main_norm.weight")
        self.head_hc = HyperHead(fn=load.dense(last + "hc_head_fn.weight"),
                                 scale=load.dense(last + "hc_head_scale.weight"),
                                 base=load.dense(last + "hc_head_base.weight"), hc_eps=c.hc_eps, norm_eps=c.rms_eps)
        self.norm = load.dense(last + "norm.weight")
        self.markov_w1 = load.linear(last + "markov_head.markov_w1.weight")
        self.markov_w2 = load.linear(last + "markov_head.markov_w2.weight")
        self.confidence = load.linear(last + "confidence_head.proj.weight")
        self.load_stats = load.finish()
        if model.split is not None:
            model.split.loaded()
        self.nbytes = self.load_stats.resident_bytes
        """Bytes of weights the drafter holds (the embedding and LM head are the main model's)."""
        model.taps = self.spec.target_layers

    @classmethod
    def load(cls, path: str | os.PathLike[str], model: Model,
             progress: Callable[[int, int], None] | None = None) -> DSpark:
        """Open, validate and load the DSpark support file that goes with `model`."""
        return cls(open_dspark_weights(path, model.config), model, progress)

    @property
    def block_size(self) -> int:
        return self.spec.block_size

    def new_cache(self) -> DSparkCache:
        return DSparkCache(self.spec.n_stages, self.config.head_dim, self.config.sliding_window)

    def main_x(self, features: mx.array) -> mx.array:
        """main_x (T, n_embd) of tapped features (T, len(targets) * n_embd)."""
        return rms_norm(self.main_proj(features), self.main_norm, self.config.rms_eps)

    def commit(self, features: mx.array, start: int, cache: DSparkCache) -> None:
        """Append the context rows of committed positions start.. (their tapped features (T, ...)) to every
        stage's window. A cache that does not end at `start` (a session restored without its rows) starts a new
        window there: drafting goes on with fewer context rows until it refills."""
        if start != cache.end:
            cache.reset(start)
        keep = min(features.shape[0], cache.window)
        features, start = features[-keep:], start + features.shape[0] - keep
        positions = mx.arange(start, start + keep, dtype=mx.int32)
        x = self.main_x(features)
        cache.rings = tuple(mx.concatenate([ring, stage.attention._finish_kv(stage.attention.kv(x), positions)]
                                           )[-cache.window:]
                            for ring, stage in zip(cache.rings, self.stages))
        cache.end = start + keep

    def logits(self, anchor: int, cache: DSparkCache) -> tuple[mx.array, mx.array]:
        """The block after the committed positions: base logits U (block_size, n_vocab) for the tokens at
        end + 1.., and the pre-norm hc_head output x (block_size, n_embd)."""
        c, b = self.config, self.block_size
        tokens = mx.array([anchor] + [self.spec.noise_token] * (b - 1), dtype=mx.int32)
        positions = mx.arange(cache.end, cache.end + b, dtype=mx.int32)
        residual: mx.array | PendingPost = mx.broadcast_to(self.model.embedding.rows(tokens)[:, None, :],
                                                           (b, c.n_hc, c.n_embd))
        for stage, ring in zip(self.stages, cache.rings):
            residual = self._stage(stage, residual, tokens, positions, ring)
        x = self.head_hc(residual.apply())
        return self.model.output(x, norm=(self.norm, c.rms_eps)), x

    def _stage(self, stage: Block, residual: mx.array | PendingPost, tokens: mx.array, positions: mx.array,
               context: mx.array) -> PendingPost:
        """One stage over the block's streams: attention over its context rows and the block, then its MoE."""
        eps = self.config.rms_eps
        streams, x, post, comb = stage.attn_hc.pre_after(residual)
        out = self._attend(stage, rms_norm(x, stage.attn_norm, eps), positions, context)
        streams, x, post, comb = stage.ffn_hc.pre_after(PendingPost(out, None, streams, post, comb))
        routed, shared = stage.moe.parts(rms_norm(x, stage.ffn_norm, eps), tokens)
        return PendingPost(routed, shared, streams, post, comb)

    def _attend(self, stage: Block, x: mx.array, positions: mx.array, context: mx.array) -> mx.array:
        """The stage's attention for the block's normed inputs x (B, n_embd): every query sees all the context
        rows and all B block rows, with the per-head sink; K = V, the output de-rotated at the query's position."""
        a, eps = stage.attention, self.config.rms_eps
        b = x.shape[0]
        q = a.q_b(rms_norm(a.q_a(x), a.q_a_norm, eps)).reshape(b, a.n_head, a.head_dim)
        q = a.rope(rms_norm(q, None, eps), positions)
        keys = mx.concatenate([context, a._finish_kv(a.kv(x), positions)])
        visible = mx.ones((b, keys.shape[0]), dtype=mx.bool_)
        out = attend(q, [keys], [visible], a.sinks, 1.0 / math.sqrt(a.head_dim))
        return a._project_out(a.rope(out, positions, inverse=True))

    def draft(self, anchor: int, cache: DSparkCache, temperature: float = 0.0,
              rng: np.random.Generator | None = None) -> Draft:
        """block_size drafts after `anchor` (greedy, or each sampled at `temperature` from its Markov-corrected
        row, the distribution kept for the acceptance rule), with their confidences."""
        base, x = self.logits(anchor, cache)
        prev, tokens, probs, confidence = anchor, [], [], []
        for k in range(self.block_size):
            e = self.markov_w1.rows(mx.array([prev], dtype=mx.int32))
            row = base[k] + self.markov_w2(e)[0]
            confidence.append(mx.sigmoid(self.confidence(mx.concatenate([x[k : k + 1], e], axis=-1)))[0, 0])
            if temperature <= 0:
                prev = int(mx.argmax(row).item())
            else:
                p = np.array(mx.softmax(row.astype(mx.float32) / temperature), dtype=np.float64)
                p /= p.sum()
                prev = int((rng or np.random.default_rng()).choice(p.size, p=p))
                probs.append(p)
            tokens.append(prev)
        if self.model.split is not None:  # rank 0's drafts: each rank adds its own Markov row to the gathered
            tokens = self.model.split.agree_tokens(tokens)  # logits, and hosts may round a near tie apart
        return Draft(tokens, np.stack(probs) if probs else None, [float(c.item()) for c in confidence])


RESIDUAL_FLOOR = 1e-8
"""A rejected draft's residual distribution with no more mass than this is taken as empty (DeepSpec's bound)."""


def accept_sampled(target: np.ndarray, draft: Draft, rng: np.random.Generator) -> tuple[int, int]:
    """The published acceptance rule for sampled drafts (rejection sampling, Leviathan / Chen): `target` holds the
    main model's processed distributions (k + 1, n_vocab) for the anchor row and each draft's row. Draft i is kept
    with probability min(1, p_{i-1}(d_i) / q_i(d_i)); at the first rejection the next token is drawn from
    norm(max(0, p_{i-1} - q_i)), or from p_{i-1} itself where that residual has no mass left (p and q equal up to
    rounding; DeepSpec's evaluator does the same). Returns (drafts kept, next token): every emitted token is
    distributed as the target's own sample."""
    for i, (token, q) in enumerate(zip(draft.tokens, draft.probs)):
        p = target[i]
        if rng.random() * q[token] < p[token]:
            continue
        rest = np.maximum(p - q, 0)
        mass = rest.sum()
        if mass <= RESIDUAL_FLOOR:
            rest, mass = p, p.sum()
        return i, int(rng.choice(rest.size, p=rest / mass))
    last = target[len(draft.tokens)]
    return len(draft.tokens), int(rng.choice(last.size, p=last / last.sum()))
