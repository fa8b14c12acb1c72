"""DeepSeek V4 Flash forward pass (ds4.c), from token ids to logits.

One token's path: its embedding row is copied into `n_hc` hyper-connection streams; every layer runs
HC-pre -> attention -> HC-post -> HC-pre -> MoE -> HC-post; the final HC collapse, RMSNorm and
LM head give the logits. A chunk of tokens runs layer-major (all tokens through layer 0, then layer 1, ...)
and gives the same result as feeding them one at a time.

`simulate_quant` (default on) applies the activation quantisation DeepSeek V4 was trained with, as ds4 does:
FP8 E4M3 on the non-RoPE dims of raw and compressed KV rows, Hadamard + FP4 E2M1 on indexer queries and rows,
and half-precision storage of the raw KV window. Compressed rows stay float32 (ds4's GPU path; its CPU path also
rounds them to f16). With it off the model computes exactly what transformers' `DeepseekV4ForCausalLM` computes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from functools import partial

import mlx.core as mx

from ds4_mlx.errors import RequestError
from ds4_mlx.kernels.machinery import registry
from ds4_mlx.kernels.decode.ends import EMBED_STREAMS
from ds4_mlx.kernels.tensor_cores.halfsplit import splits_held
from ds4_mlx.kernels.formats.quants import dequantize
from ds4_mlx.model import watchdog
from ds4_mlx.model.attention import Attention, Indexer
from ds4_mlx.model.cache import LayerState, SessionCache, unflatten_layers
from ds4_mlx.model.compressor import Compressor
from ds4_mlx.model.config import ModelConfig
from ds4_mlx.model.gguf import TensorInfo
from ds4_mlx.model.hyper_connection import HyperConnection, HyperHead, PendingPost
from ds4_mlx.model.linear import ExpertBank, Linear
from ds4_mlx.model.moe import GATHER_LIMIT, MoE, RoutedExperts, Router, SharedExpert
from ds4_mlx.model.norm import rms_norm
from ds4_mlx.model.quant_sim import RowQuant
from ds4_mlx.model.rope import RoPE, Yarn
from ds4_mlx.model.shard import Split
from ds4_mlx.model.stream import Convert, LoadStats, TensorStream
from ds4_mlx.model.weights import ModelWeights

DEFAULT_PREFILL_CHUNK = 2048


@dataclass
class Block:
    """One transformer layer: attention and MoE sublayers, each wrapped in a hyper-connection."""

    attn_hc: HyperConnection
    attn_norm: mx.array
    attention: Attention
    ffn_hc: HyperConnection
    ffn_norm: mx.array
    moe: MoE
    eps: float
    sum: Callable[[mx.array], mx.array] | None = None
    """The sum across ranks of the attention's and the MoE's outputs where every layer is split (model/shard.py)."""

    def __call__(self, residual: mx.array | PendingPost, tokens: mx.array, n_past: int, state: LayerState
                 ) -> tuple[PendingPost, LayerState]:
        """A chunk of tokens at positions n_past...

        Takes the streams, or the previous block's FFN post still pending, and returns its own FFN post pending
        (`PendingPost.apply` makes the streams): each post is applied with the pre that follows it, which fused
        kernels do in the launches of that pre (hyper_connection.py)."""
        streams, x, post, comb = self.attn_hc.pre_after(residual)
        out, state = self.attention(rms_norm(x, self.attn_norm, self.eps), n_past, state)
        streams, x, post, comb = self.ffn_hc.pre_after(PendingPost(self._sum(out), None, streams, post, comb))
        routed, shared = self._sum_parts(*self.moe.parts(rms_norm(x, self.ffn_norm, self.eps), tokens))
        return PendingPost(routed, shared, streams, post, comb), state  # the update adds the two parts

    def step(self, residual: mx.array | PendingPost, tokens: mx.array, positions: mx.array,
             states: Sequence[LayerState], groups: Sequence[int], ends: Collection[int] | None = None
             ) -> tuple[PendingPost, list[LayerState]]:
        """A decode step's rows (Attention.step_rows): tokens (B,) at array `positions` (B,), the rows of session i
        groups[i] consecutive tokens from its state states[i]; returns the FFN post pending and each row's state.
        `ends`: the compression ratios whose windows the step's tokens end (their layers write a compressed row),
        None for all of them. For one row the input projections apply attn_norm and the MoE's readers ffn_norm,
        folded into their matvecs where the kernels allow; several rows are normed first."""
        streams, x, post, comb = self.attn_hc.pre_after(residual)
        out, rows = self.attention.step_rows(x, positions, states, (self.attn_norm, self.eps), groups,
                                             completes=ends is None or self.attention.ratio in ends)
        streams, x, post, comb = self.ffn_hc.pre_after(PendingPost(self._sum(out), None, streams, post, comb))
        if tokens.shape[0] > 1:  # several rows: the norm on its own (see Attention.step_rows)
            routed, shared = self.moe.parts(rms_norm(x, self.ffn_norm, self.eps), tokens)
        else:
            routed, shared = self.moe.parts(x, tokens, norm=(self.ffn_norm, self.eps))
        routed, shared = self._sum_parts(routed, shared)
        return PendingPost(routed, shared, streams, post, comb), rows

    def _sum(self, out: mx.array) -> mx.array:
        return out if self.sum is None else self.sum(out)

    def _sum_parts(self, routed: mx.array, shared: mx.array) -> tuple[mx.array, mx.array | None]:
        """The MoE's two parts, or split across ranks their sum over the ranks (one exchange, not two)."""
        return (routed, shared) if self.sum is None else (self.sum(routed + shared), None)


def tap(residual: PendingPost, last: int | None = None) -> mx.array:
    """A layer's output as a DSpark drafter reads it: the mean of its hyper-connection streams (T, n_embd), of
    the `last` rows only when given."""
    if last is not None:
        residual = PendingPost(*(None if a is None else a[-last:] for a in (
            residual.output, residual.addend, residual.streams, residual.post, residual.comb)))
    return mx.mean(residual.apply(), axis=1)


class Loader:
    """Streams the model's tensors into their resident form (model/stream.py) and counts the bytes they keep."""

    def __init__(self, weights: ModelWeights, progress: Callable[[int, int], None] | None = None,
                 chunk_bytes: int | None = None):
        self.weights = weights
        self.stream = TensorStream(weights, progress, chunk_bytes)
        self.nbytes = 0
        self._kept: dict[str, list[mx.array]] = {}  # resident arrays of tensors that have twins (synthetic layouts)

    def has(self, name: str) -> bool:
        return self.weights.has(name)

    def info(self, name: str) -> TensorInfo:
        return self.weights.info(name)

    def read(self, name: str, convert: Convert) -> list[mx.array]:
        """The arrays `convert` makes of a tensor's raw rows (linear.py's constructors read through this)."""
        twin = self.weights.twin(name)
        if twin is not None and twin in self._kept:
            arrays = self.stream.copy(name, self._kept[twin])
        else:
            arrays = self.stream.read(name, convert)
            if twin == name:
                self._kept[name] = arrays
        self.nbytes += sum(a.nbytes for a in arrays)
        return arrays

    def dense(self, name: str) -> mx.array:
        """Norms, biases, HC and compressor vectors, tid2eid: small tensors as float32 (int32 for I32)."""
        info = self.info(name)
        (array,) = self.read(name, lambda rows: (dequantize(rows, info.ggml_type, (rows.shape[0], info.shape[0])),))
        return array.reshape(tuple(reversed(info.shape)))

    def linear(self, name: str) -> Linear:
        return Linear(self, name)

    def experts(self, name: str) -> ExpertBank:
        return ExpertBank(self, name)

    def finish(self) -> LoadStats:
        """Evaluates the last batch and stops the reader; the figures of the load, with the bytes kept."""
        stats = self.stream.finish()
        stats.resident_bytes = self.nbytes
        return stats


class Model:
    """DeepSeek V4 Flash over the tensors of a validated GGUF file."""

    def __init__(
        self,
        weights: ModelWeights,
        simulate_quant: bool = True,
        progress: Callable[[int, int], None] | None = None,
        split: Split | None = None,
    ):
        """`progress(bytes_read, bytes_total)` follows the loading of the file's tensors (81 GB takes a while).
        `split`: this rank's share of a model split across the ranks of an mx.distributed group (model/shard.py);
        only its slices are read."""
        self.config: ModelConfig = weights.config
        self.split = split
        self.layers = range(*split.layers) if split is not None else range(weights.config.n_layer)
        """The layers this process runs (all of them but in a pipeline)."""
        self.simulate_quant = simulate_quant
        c = self.config
        self.main_rope = RoPE(c.n_rot, c.rope_freq_base)
        self.compressed_rope = RoPE(
            c.n_rot,
            c.compress_rope_freq_base,
            Yarn(c.rope_scaling_factor, c.rope_orig_ctx, c.yarn_beta_fast, c.yarn_beta_slow),
        )
        watchdog.pause()  # this rank's own load: no deadline (model/watchdog.py)
        load = Loader(split.weights(weights) if split is not None else weights, progress)
        self.embedding = load.linear("token_embd.weight")
        self.blocks = [
            self.block(load, f"blk.{layer}.", c.compress_ratio(layer), c.is_hash_layer(layer), c.swiglu_clamp[layer])
            for layer in self.layers
        ]
        self.head_hc = HyperHead(
            fn=load.dense("output_hc_fn.weight"),
            scale=load.dense("output_hc_scale.weight"),
            base=load.dense("output_hc_base.weight"),
            hc_eps=c.hc_eps,
            norm_eps=c.rms_eps,
        )
        self.output_norm = load.dense("output_norm.weight")
        self.output = load.linear("output.weight") if split is None else split.head(load)
        self.load_stats = load.finish()
        if split is not None:
            split.loaded()
        self.nbytes = self.load_stats.resident_bytes
        """Bytes of weights the model holds in memory (raw blocks plus matrices dequantized at load)."""
        self._steps: dict[tuple, Callable[..., list[mx.array]]] = {}
        """Compiled decode steps by cache layout (the shapes of the cache's arrays) and the windows a step ends."""
        self.ratios = tuple(sorted({c.compress_ratio(layer) for layer in range(c.n_layer)} - {0}))
        """The compression ratios of the layers (Flash: 4 and 128)."""
        self.taps: tuple[int, ...] = ()
        """Layers whose outputs `hidden` and `decode_rows` keep in `tapped` (a DSpark drafter's input, set by it;
        model/dspark.py); () keeps none, and the one-token `decode` never does."""
        self.tapped: mx.array | None = None
        """The last `hidden` or `decode_rows` call's taps: per row, the mean over the hyper-connection streams of
        each tapped layer's output, side by side (rows, len(taps) * n_embd). `hidden` taps its last sliding_window
        rows only (all that a drafter's window keeps), `decode_rows` every row."""

    def block(self, load: Loader, prefix: str, ratio: int, hash_routing: bool, clamp: float, whole: bool = False
              ) -> Block:
        """The block whose tensors are named `prefix` + suffix, at a compression ratio, with token-hash
        or learned (top-k) routing. Public so that the drafters' blocks are built the same way from their own files:
        `whole`, every head and expert column and no sum across ranks, as a drafter runs on every rank of a split."""
        split = None if whole else self.split
        c = self.config if split is None else split.local()

        def hc(kind: str) -> HyperConnection:
            return HyperConnection(
                fn=load.dense(f"{prefix}hc_{kind}_fn.weight"), scale=load.dense(f"{prefix}hc_{kind}_scale.weight"),
                base=load.dense(f"{prefix}hc_{kind}_base.weight"), n_hc=c.n_hc, sinkhorn_iters=c.sinkhorn_iters,
                hc_eps=c.hc_eps, norm_eps=c.rms_eps,
            )

        def compressor(kind: str, width: int, quant: RowQuant) -> Compressor:
            name = f"{prefix}{kind}_compressor_"
            return Compressor(
                kv=load.linear(name + "kv.weight"), gate=load.linear(name + "gate.weight"),
                ape=load.dense(name + "ape.weight"), norm=load.dense(name + "norm.weight"),
                ratio=ratio, width=width, rope=rope, quant=quant if self.simulate_quant else RowQuant.NONE,
                eps=c.rms_eps,
            )

        rope = self.compressed_rope if ratio else self.main_rope
        indexer = None
        if ratio == 4:
            indexer = Indexer(
                q_b=load.linear(prefix + "indexer.attn_q_b.weight"), proj=load.linear(prefix + "indexer.proj.weight"),
                compressor=compressor("indexer", c.indexer_head_dim, RowQuant.INDEXER_FP4),
                n_head=c.indexer_n_head, head_dim=c.indexer_head_dim, top_k=c.indexer_top_k, rope=rope,
                simulate_quant=self.simulate_quant,
            )
        attention = Attention(
            q_a=load.linear(prefix + "attn_q_a.weight"), q_a_norm=load.dense(prefix + "attn_q_a_norm.weight"),
            q_b=load.linear(prefix + "attn_q_b.weight"), kv=load.linear(prefix + "attn_kv.weight"),
            kv_norm=load.dense(prefix + "attn_kv_a_norm.weight"), sinks=load.dense(prefix + "attn_sinks.weight"),
            out_a=load.linear(prefix + "attn_output_a.weight"), out_b=load.linear(prefix + "attn_output_b.weight"),
            n_head=c.n_head, head_dim=c.head_dim, n_rot=c.n_rot, window=c.sliding_window, o_groups=c.o_groups,
            rope=rope, compressor=compressor("attn", c.head_dim, RowQuant.KV_FP8) if ratio else None,
            indexer=indexer, simulate_quant=self.simulate_quant, eps=c.rms_eps,
        )
        router = Router(
            gate=load.linear(prefix + "ffn_gate_inp.weight"),
            bias=load.dense(prefix + "exp_probs_b.bias") if load.has(prefix + "exp_probs_b.bias") else None,
            tid2eid=load.dense(prefix + "ffn_gate_tid2eid.weight") if hash_routing else None,
            n_used=c.n_expert_used, scale=c.expert_weights_scale,
        )
        moe = MoE(
            router=router,
            experts=RoutedExperts(
                gate=load.experts(prefix + "ffn_gate_exps.weight"), up=load.experts(prefix + "ffn_up_exps.weight"),
                down=load.experts(prefix + "ffn_down_exps.weight"), clamp=clamp,
            ),
            shared=SharedExpert(
                gate=load.linear(prefix + "ffn_gate_shexp.weight"), up=load.linear(prefix + "ffn_up_shexp.weight"),
                down=load.linear(prefix + "ffn_down_shexp.weight"), clamp=clamp,
            ),
        )
        return Block(hc("attn"), load.dense(prefix + "attn_norm.weight"), attention, hc("ffn"),
                     load.dense(prefix + "ffn_norm.weight"), moe, eps=c.rms_eps,
                     sum=None if split is None else split.block_sum)

    def new_cache(self, ctx: int) -> SessionCache:
        """Empty session state for a context of `ctx` tokens (in a pipeline, the other ranks' layers hold no rows)."""
        cache = SessionCache(self.config, ctx)
        if len(self.layers) < self.config.n_layer:
            cache.layers = [state if layer in self.layers else LayerState.empty(self.config, layer, 1)
                            for layer, state in enumerate(cache.layers)]
            cache.held = self.layers
        return cache

    def __call__(self, tokens: mx.array, cache: SessionCache, all_logits: bool = False) -> mx.array:
        """Run tokens (T,) at positions cache.n_tokens.. and update the cache.

        Returns the logits for the token after the last one, (n_vocab,), or for every position, (T, n_vocab).
        The cache changes only once every layer has been built, so an interrupted call leaves it as it was.
        """
        streams = self.hidden(tokens, cache)
        logits = self.head(streams if all_logits else streams[-1:])
        return logits if all_logits else logits[0]

    def hidden(self, tokens: mx.array, cache: SessionCache) -> mx.array:
        """Run tokens (T,) through every layer and update the cache, like `__call__`, but return the final
        hyper-connection streams (T, n_hc, n_embd): the state the head reads, and the MTP draft block's input.

        A chunk past GATHER_LIMIT pairs is evaluated layer by layer, one layer ahead: layer i is queued
        (`mx.async_eval`) before layer i - 1 is waited for, so that the host builds and encodes a layer while the
        GPU runs the one before (waiting for each layer left the H200 idle ~4.6 ms a layer, 13% of a 4096-token
        chunk, 2026-12-03), and at most two layers' transients (a float expert scratch, kernels/prefill/grouped.py) are
        alive at once."""
        tokens = self._check(tokens, cache)
        watchdog.beat("hidden")
        n_past = cache.n_tokens
        shape = (tokens.size, self.config.n_hc, self.config.n_embd)
        streams = self._enter(lambda: mx.broadcast_to(self.embedding.rows(tokens)[:, None, :], shape), shape)
        layers = list(cache.layers)
        grouped = tokens.size * self.config.n_expert_used > GATHER_LIMIT
        residual: mx.array | PendingPost = streams
        running: list[mx.array] = []
        taps: list[mx.array] = []
        # an input several kernels read is split into halves once (kernels/tensor_cores/halfsplit.py)
        with splits_held():
            for layer, block in zip(self.layers, self.blocks):
                residual, layers[layer] = block(residual, tokens, n_past, layers[layer])
                if layer in self.taps:
                    taps.append(tap(residual, self.config.sliding_window))
                if grouped:  # one layer ahead: this layer is queued, then the previous one waited for
                    queued = [*residual.arrays(), *layers[layer].arrays()]
                    mx.async_eval(*queued)
                    mx.eval(*running)
                    running = queued
        streams = self._leave(residual)
        cache.layers, cache.n_tokens = layers, n_past + tokens.size
        self.tapped = mx.concatenate(taps, axis=-1) if taps else None
        return streams

    def step(self, token: mx.array, position: mx.array, layers: Sequence[LayerState],
             ends: Collection[int] | None = None) -> tuple[mx.array, mx.array, list[LayerState]]:
        """One decode step with every shape fixed by the context size: token (1,) at array `position` (1,), which
        ends the windows of the compression ratios in `ends` (their layers write a compressed row; None: all).

        Returns the final streams (1, n_hc, n_embd), the logits (n_vocab,) and the new layer states. Traced once by
        `decode` and replayed for every token; nothing here reads a value back to the host.
        """
        streams, logits, (layers,), _ = self.step_rows(token, position, (layers,), (1,), ends)
        return streams, logits.reshape(-1), layers  # a view: no gather to replay

    def step_rows(self, tokens: mx.array, positions: mx.array, sessions: Sequence[Sequence[LayerState]],
                  groups: Sequence[int], ends: Collection[int] | None = None, taps: Collection[int] = ()
                  ) -> tuple[mx.array, mx.array, list[list[LayerState]], mx.array | None]:
        """`step` over B rows: tokens (B,) at array `positions` (B,), the first groups[0] of them consecutive tokens
        of the session whose layer states are sessions[0], and so on (Block.step): several sessions' next tokens
        in one pass over the weights (batching), or one session's token and the guesses after it (speculation).

        Returns the final streams (B, n_hc, n_embd), the logits (B, n_vocab), each row's layer states (row r's
        are its session's states once row r is fed: a session's rows share its last row's row buffers), and the
        outputs of the layers in `taps` as `tapped` holds them (None without taps)."""
        if sum(groups) != tokens.shape[0] or len(groups) != len(sessions):
            raise ValueError(f"{tokens.shape[0]} rows do not split into {len(sessions)} sessions as {tuple(groups)}")
        shape = (tokens.shape[0], self.config.n_hc, self.config.n_embd)
        residual: mx.array | PendingPost = self._enter(lambda: self.embed_streams(tokens), shape)
        owners = [sessions[i] for i, n in enumerate(groups) for _ in range(n)]
        rows: list[list[LayerState]] = [list(s[: self.layers.start]) for s in owners]  # a pipeline's earlier layers
        tapped = []
        for layer, block in zip(self.layers, self.blocks):  # each block's last post is applied with the next one's pre
            residual, states = block.step(residual, tokens, positions, [s[layer] for s in sessions], groups, ends)
            for row, state in zip(rows, states):
                row.append(state)
            if layer in taps:
                tapped.append(tap(residual))
        for row, s in zip(rows, owners):
            row += s[self.layers.stop :]
        streams = self._leave(residual)
        return streams, self.head(streams), rows, mx.concatenate(tapped, axis=-1) if tapped else None

    def _enter(self, embedded: Callable[[], mx.array], shape: tuple[int, ...]) -> mx.array:
        """The streams the first layer this process runs reads: the tokens' embedding (`embedded()`), or in a
        pipeline past its first rank the previous rank's streams."""
        return embedded() if self.split is None else self.split.enter(embedded, shape)

    def _leave(self, residual: mx.array | PendingPost) -> mx.array:
        """The final streams of the layers this process runs (in a pipeline, handed on to the next rank)."""
        streams = residual.apply() if isinstance(residual, PendingPost) else residual
        return streams if self.split is None else self.split.leave(streams)

    def embed_streams(self, tokens: mx.array) -> mx.array:
        """The streams (B, n_hc, n_embd) decode tokens (B,) start as: each one's embedding row in every stream (one
        launch on GPU backends where the table's rows read as they are held, kernels/decode/ends.py)."""
        table = self.embedding.table
        if table is None:
            row = self.embedding.rows(tokens)
            return mx.broadcast_to(row[:, None, :], (tokens.shape[0], self.config.n_hc, self.config.n_embd))
        return EMBED_STREAMS(table, tokens, self.config.n_hc)

    def decode(self, token: int | mx.array, cache: SessionCache) -> tuple[mx.array, mx.array]:
        """Feed one token through the compiled decode step; returns (final streams (1, n_hc, n_embd), logits).

        `token` may also be an int32 array of shape (1,) that is still being computed: a token chosen on the
        device from the previous logits (`Session.feed_chosen`), so that this step is built before it is known.
        The first step of a cache layout runs eagerly (it makes the kernels' first-use checks, which evaluate
        arrays and so cannot run while a function is being traced), and the compiled steps of every kind (`ends`)
        are traced then; later steps replay them. With the kernel mode forced to "reference" the token goes
        through the chunk path instead.
        """
        ids = token if isinstance(token, mx.array) else mx.array([token], dtype=mx.int32)
        if registry.mode() == "reference":
            streams = self.hidden(ids, cache)
            return streams, self.head(streams)[0]
        if not isinstance(token, mx.array) and not 0 <= token < self.config.n_vocab:
            raise RequestError(f"token id {token} is outside the vocabulary [0, {self.config.n_vocab})")
        if cache.n_tokens >= cache.ctx:
            raise RequestError(f"1 token does not fit: the cache holds {cache.n_tokens} of a {cache.ctx}-token "
                               "context")
        layout = tuple(a.shape for a in cache.arrays())
        ends = self.ends(cache.n_tokens)
        # the position as (1,), the shape its readers take: no reshape of it is a node of the step
        flat = [ids, mx.array([cache.n_tokens], dtype=mx.int32), *cache.arrays()]
        step = self._steps.get((layout, ends))
        watchdog.beat(("decode", layout) if step is None else None)
        if step is None:  # a new layout: this step eagerly, then every kind of step traced, never evaluated
            streams, logits, *arrays = self._flat_step(ends, *flat)
            for kind in {self.ends(n) for n in range(math.lcm(*self.ratios))}:
                self._steps[layout, kind] = mx.compile(partial(self._flat_step, kind))
                self._steps[layout, kind](*flat)  # so that no later token pays a trace
        else:
            streams, logits, *arrays = step(*flat)
        del flat  # once the cache holds the new state, the graph alone holds the old: buffers can be reused
        cache.layers, cache.n_tokens = cache.unflatten(arrays), cache.n_tokens + 1
        return streams, logits

    def decode_rows(self, tokens: Sequence[int] | mx.array, caches: Sequence[SessionCache],
                    groups: Sequence[int] | None = None) -> tuple[mx.array, mx.array, list[list[LayerState]]]:
        """One compiled step over the rows `step_rows` takes: the first groups[0] tokens consecutive ones of
        caches[0]'s session at its next positions, and so on (groups None: one token per cache). `tokens` may be an
        int32 array still being computed, as in `decode`.

        Returns the final streams (B, n_hc, n_embd), the logits (B, n_vocab) and each row's layer states; the
        caches are left as they are: a caller keeps the rows it accepts (`SessionCache.advance`). One compiled step
        per grouping, context sizes and kind (the windows some row ends, `ends` of each row's position together:
        at most three kinds), traced at its first use as `decode` traces its kinds."""
        groups = tuple(groups) if groups is not None else (1,) * len(caches)
        ids = tokens if isinstance(tokens, mx.array) else mx.array(list(tokens), dtype=mx.int32)
        if len(groups) != len(caches) or sum(groups) != ids.size or ids.ndim != 1 or min(groups, default=0) < 1:
            raise ValueError(f"{ids.size} tokens do not split into {len(caches)} sessions as {groups}")
        if len({id(c) for c in caches}) != len(caches):
            raise ValueError("a session's rows are one group: the same cache was given twice")
        if not isinstance(tokens, mx.array) and not all(0 <= t < self.config.n_vocab for t in tokens):
            raise RequestError(f"a token id is outside the vocabulary [0, {self.config.n_vocab})")
        positions: list[int] = []
        for cache, n in zip(caches, groups):
            if cache.n_tokens + n > cache.ctx:
                raise RequestError(f"{n} tokens do not fit: the cache holds {cache.n_tokens} of a {cache.ctx}-token "
                                   "context")
            positions += range(cache.n_tokens, cache.n_tokens + n)
        kind = tuple(sorted({r for p in positions for r in self.ends(p)}))
        flat = [ids, mx.array(positions, dtype=mx.int32), *(a for c in caches for a in c.arrays())]
        ctxs, taps = tuple(c.ctx for c in caches), self.taps
        watchdog.beat(("rows", groups, ctxs, taps))
        if registry.mode() == "reference":  # the references, eagerly
            out = self._flat_rows(groups, kind, taps, *flat)
        elif (step := self._steps.get((groups, ctxs, kind, taps))) is not None:
            out = step(*flat)
        else:  # a new grouping: this step eagerly (the kernels' first-use checks), then every kind traced
            out = self._flat_rows(groups, kind, taps, *flat)
            for each in {self.ends(n) for n in range(math.lcm(*self.ratios))}:
                self._steps[groups, ctxs, each, taps] = mx.compile(partial(self._flat_rows, groups, each, taps))
                self._steps[groups, ctxs, each, taps](*flat)
        streams, logits, *arrays = out
        self.tapped = arrays.pop() if taps else None
        per_row = len(arrays) // ids.size
        rows = [unflatten_layers(self.config, arrays[r * per_row : (r + 1) * per_row]) for r in range(ids.size)]
        return streams, logits, rows

    def _flat_rows(self, groups: tuple[int, ...], ends: tuple[int, ...], taps: tuple[int, ...], tokens: mx.array,
                   positions: mx.array, *arrays: mx.array) -> list[mx.array]:
        """`step_rows` over the caches' flat array lists one after another (what mx.compile traces): the final
        streams, the logits, then each row's layer states flat, then the taps (if any)."""
        per_cache = len(arrays) // len(groups)
        sessions = [unflatten_layers(self.config, arrays[i * per_cache : (i + 1) * per_cache])
                    for i in range(len(groups))]
        streams, logits, rows, tapped = self.step_rows(tokens, positions, sessions, groups, ends, taps)
        return [streams, logits, *(a for row in rows for state in row for a in state.arrays()),
                *([tapped] if taps else [])]

    def ends(self, position: int) -> tuple[int, ...]:
        """The compression ratios whose windows the token at `position` ends: a decode step writes those layers'
        compressed rows (one compiled step for each such tuple)."""
        return tuple(r for r in self.ratios if (position + 1) % r == 0)

    def _flat_step(self, ends: tuple[int, ...] | None, token: mx.array, position: mx.array, *arrays: mx.array
                   ) -> list[mx.array]:
        """`step` over the cache's flat array list (what mx.compile traces, one function per `ends`)."""
        streams, logits, layers = self.step(token, position, unflatten_layers(self.config, arrays), ends)
        return [streams, logits, *(a for state in layers for a in state.arrays())]

    def head(self, streams: mx.array) -> mx.array:
        """Logits (T, n_vocab) of final streams (T, n_hc, n_embd): HC collapse, output norm, LM head.
        The LM head applies the output norm (folded into its matvec for a decode token on GPU backends)."""
        return self.output(self.head_hc(streams), norm=(self.output_norm, self.config.rms_eps))

    def prefill(
        self,
        tokens: mx.array,
        cache: SessionCache,
        chunk_size: int = DEFAULT_PREFILL_CHUNK,
        progress: Callable[[int, int], None] | None = None,
    ) -> mx.array:
        """Feed tokens in chunks of `chunk_size`; returns the logits after the last token.

        `progress(done, total)` is called after each chunk, once its results are computed.
        """
        if chunk_size <= 0:
            raise ValueError(f"chunk_size must be positive, got {chunk_size}")
        tokens = self._check(tokens, cache)
        total = tokens.size
        logits = None
        for start in range(0, total, chunk_size):
            logits = self(tokens[start : start + chunk_size], cache)
            mx.eval(logits, *cache.arrays())
            if progress is not None:
                progress(min(start + chunk_size, total), total)
        return logits

    def _check(self, tokens: mx.array, cache: SessionCache) -> mx.array:
        """Validate a token batch: 1-D, non-empty, ids in the vocabulary, and room left in the context."""
        tokens = tokens if isinstance(tokens, mx.array) else mx.array(tokens)
        if tokens.ndim != 1 or tokens.size == 0:
            raise RequestError(f"expected a non-empty 1-D array of token ids, got shape {tuple(tokens.shape)}")
        if not mx.issubdtype(tokens.dtype, mx.integer):
            raise RequestError(f"token ids must be integers, got {tokens.dtype}")
        low, high = mx.min(tokens).item(), mx.max(tokens).item()
        if low < 0 or high >= self.config.n_vocab:
            raise RequestError(f"token id {low if low < 0 else high} is outside the vocabulary [0, "
                               f"{self.config.n_vocab})")
        if cache.n_tokens + tokens.size > cache.ctx:
            raise RequestError(f"{tokens.size} tokens do not fit: the cache holds {cache.n_tokens} of a "
                               f"{cache.ctx}-token context")
        return tokens.astype(mx.int32)
