"""A model session: the tokens a model has seen, its cache, and the logits for the next token.

This is the notebook-facing handle on one stream of model state. The engine keeps one live Session and reuses it
when a new prompt extends what it holds; the disk KV cache serialises its snapshots.

With an MTP draft block (ds4.c) the session also runs the block after the model on every token it feeds, so
the block's window follows the stream and its guess for the next token is always at hand. `speculate` then feeds
a token together with the block's guesses for the tokens after it in one model call, and keeps the guesses the
model agrees with: greedy decoding that can take several tokens per call and gives the same tokens as plain
greedy decoding.

With a DSpark drafter (model/dspark.py) instead, every token the session feeds goes through the model with its
target layers tapped, and their rows join the drafter's context windows. `speculate` drafts a block after the
token (the anchor), verifies the anchor and the drafts as the rows of one step, keeps the longest run the model's
argmax agrees with, and keeps the model state of the last kept row: nothing is fed again.
"""

from __future__ import annotations

import math
import os
import warnings
import weakref
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, replace

import mlx.core as mx
import numpy as np

from . import memory
from .errors import RequestError
from .kernels.machinery import registry
from .kernels.machinery.cudagraph import DriverError
from .kernels.machinery.nvrtc import CompileError
from .model.cache import LayerState, SessionCache, StepUndo
from .model.graphstep import GraphCheckError, GraphDecoder, JointGraphs, spare_device_bytes
from .model.model import DEFAULT_PREFILL_CHUNK, Model
from .model.dspark import DSpark, DSparkSnapshot, accept_sampled
from .model.mtp import MTP, MTPSnapshot
from .model.stream import on_cuda
from .sampling import argmax, device_argmax


GRAPH_ENV = "DS4_GRAPH_DECODE"
"""`off` keeps decoding on CUDA in MLX's compiled step instead of the decode graphs (model/graphstep.py): 121.7 t/s
at 2k and 116.7 at 32k through them against ~70 through MLX's step (2026-12-03, bench/RESULTS.md)."""


def graphs_wanted() -> bool:
    """Whether decoding goes through the decode graphs when they can be made: on CUDA, unless DS4_GRAPH_DECODE=off
    or the kernels are forced to their references."""
    return os.environ.get(GRAPH_ENV, "on") != "off" and on_cuda() and registry.mode() != "reference"


def state_copies() -> int:
    """Copies of a session's state that decoding holds: two where the decode graphs run (the decoder's own)."""
    return 2 if graphs_wanted() else 1


GRAPH_FED = "graph"
"""`_fed` while a token chosen by the decode graph awaits confirm (it is launched then) or take_back."""


class GraphDecodeWarning(RuntimeWarning):
    """Decoding went back to MLX's compiled step: the decode graph could not be made, or disagreed."""


CUDA_PREFILL_CHUNK = 12288
"""On CUDA, chunks of 12288 tokens: since the grouped expert GEMMs fill more of their tiles and each expert's weights
are read for more pairs, bigger chunks prefill faster. On the H200 (43 layers, 2026-12-04) an 11,520-token prompt,
Claude Code's system prompt and tools, takes 2.86 s as one chunk (4,026 t/s, peak 120.7 GB) against 3.04 s in
chunks of 8192 (3,785 t/s, 112.3 GB); earlier, 8192 beat 4096 (2026-12-03) and 4096 ds4's 2048 (2026-12-02).
Chunking does not change the result (ds4.c: a chunk equals feeding its tokens one at a time)."""
CUDA_DEEP_CHUNK = 8192
DEEP_CONTEXT = 65536
"""Sessions of more than this many tokens prefill in CUDA_DEEP_CHUNK-token chunks on CUDA: a chunk's transients
grow with its position too (the indexer's (chunk, rows) scores: 12288 x 262,144 rows x 4 B = 12.9 GB at 1M tokens),
and beside the q2 weights and a 1M-token session the bigger chunk would not fit the H200."""


def prefill_chunk_for(ctx: int) -> int:
    """The preferred prefill chunk: ds4's 2048 tokens (ds4.c); on CUDA CUDA_PREFILL_CHUNK, or CUDA_DEEP_CHUNK for a
    context past DEEP_CONTEXT; or the whole context when that is smaller. Each chunk may still be shorter:
    memory.fit_chunk shortens it to what free device memory holds (`bench --help` states these sizes)."""
    if not on_cuda():
        return min(DEFAULT_PREFILL_CHUNK, ctx)
    return min(CUDA_PREFILL_CHUNK if ctx <= DEEP_CONTEXT else CUDA_DEEP_CHUNK, ctx)


@dataclass(frozen=True)
class Snapshot:
    """An immutable copy of a session's state (MLX arrays are immutable, so this costs no copy)."""

    tokens: tuple[int, ...]
    cache: object
    logits: mx.array | None
    mtp: MTPSnapshot | DSparkSnapshot | None = None
    """The draft block's state; None when there is none to restore (a disk checkpoint without this drafter's rows,
    cache/kvdrafter.py): the block then starts a new window at the next token fed."""


@dataclass(frozen=True)
class Verified:
    """A speculative block's verification: the state before it, its tokens, and each row's final streams, logits
    and layer states (Model.decode_rows), from which any number of its rows can be kept."""

    start: Snapshot
    tokens: tuple[int, ...]
    streams: mx.array
    logits: mx.array
    rows: list[list[LayerState]]
    features: mx.array | None = None
    """Each row's tapped layer outputs, for a DSpark drafter's context (Model.tapped)."""


@dataclass(frozen=True)
class Speculation:
    """What one `Session.speculate` step fed: `tokens`, the given token then the accepted guesses, and `logits`
    (len(tokens), n_vocab), row i for the token after tokens[i]. `drafted` MTP guesses were compared with the
    model's own argmax and `accepted` of them agreed."""

    tokens: tuple[int, ...]
    logits: mx.array
    drafted: int
    accepted: int


class Session:
    """One live stream of model state over a fixed context size, optionally followed by a draft block (MTP-1 or
    DSpark)."""

    def __init__(self, model: Model, ctx: int, mtp: MTP | DSpark | None = None) -> None:
        self.model = model
        self.ctx = ctx
        self.mtp = mtp
        self.chunk_size = prefill_chunk_for(ctx)
        self.chunk_cap: int | None = None
        """A bound on prefill chunks below `chunk_size` while other sessions decode (batch.py), so that their
        tokens wait for one short chunk at most; None: none."""
        self.release: Callable[[], bool] | None = None
        """Gives device memory back when a prefill chunk would not fit (the engine drops its oldest RAM checkpoint);
        False when it has nothing left to give."""
        self._graph: GraphDecoder | None = None  # greedy decoding's CUDA graphs (model/graphstep.py), once made
        self._graph_on = False  # the decoder holds the state: `cache` and `logits` are handed back on access
        self._graph_token: int | None = None  # the token the decoder chose, not yet fed
        self._graph_failed = False
        self.reset()

    @property
    def cache(self) -> SessionCache:
        self._leave_graph()
        return self._cache

    @cache.setter
    def cache(self, value: SessionCache) -> None:
        self._leave_graph()
        self._cache = value

    @property
    def logits(self) -> mx.array | None:
        """The logits for the next token (while the decode graph runs, a copy of its last ones)."""
        if self._graph_on:
            self._take_graph_logits()
        return self._logits

    @logits.setter
    def logits(self, value: mx.array | None) -> None:
        self._leave_graph()
        self._logits = value

    def reset(self) -> None:
        """Forget everything: an empty cache at position 0."""
        self._leave_graph()
        self.tokens: list[int] = []
        self.cache = self.model.new_cache(self.ctx)
        self.logits: mx.array | None = None
        self.mtp_cache = self.mtp.new_cache() if self.mtp is not None else None
        self._block: Verified | None = None  # the last speculative block verified, for `rewind`
        # a token fed by `feed_chosen`, not yet confirmed: its undo point, or GRAPH_FED
        self._fed: tuple[StepUndo, mx.array | None] | str | None = None

    def close(self) -> None:
        """Gives back the decode graphs: their driver resources and their copy of the state. The session stays
        usable (its state handed back first) and makes them again if it decodes on."""
        self._leave_graph()
        if self._graph is not None:
            self._graph.close()
            self._graph = None

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
        self._check_none_fed()
        if len(tokens) > self.room:
            raise RequestError(
                f"{len(tokens)} more tokens do not fit: the session holds {len(self.tokens)} of a "
                f"{self.ctx}-token context"
            )
        start = 0
        while start < len(tokens):
            chunk = tokens[start : start + self._next_chunk(len(tokens) - start)]
            self.logits = self._feed(chunk)
            self.tokens.extend(chunk)
            self._eval()
            start += len(chunk)
            yield start, len(tokens)

    def _next_chunk(self, remaining: int) -> int:
        """The next prefill chunk's length: `chunk_size` (or what remains), shortened to what the device memory
        budget has room for at this position (memory.py), after `release` gave back what it could. Raises
        MemoryShortage, before anything is allocated, when not even memory.MIN_CHUNK tokens fit."""
        preferred = min(self.chunk_size, self.chunk_cap or self.chunk_size, remaining)
        position, config = len(self.tokens), self.model.config
        free = memory.free_bytes()
        while memory.lacks_room(config, preferred, position, free):
            if self.release is None or not self.release():
                break
            free = memory.free_bytes()
        size = memory.fit_chunk(config, preferred, position, free)
        if size == 0:
            raise memory.MemoryShortage(memory.need_message(config, min(preferred, memory.MIN_CHUNK), position, free))
        return size

    def decode(self, token: int) -> mx.array:
        """Feed one token; returns the logits for the next one. On CUDA, without an MTP block, through the
        decode graphs (model/graphstep.py) as greedy decoding: sampled decoding reads their logits."""
        if self.mtp is None and self._fed is None and self._graph_ready(None, choosing=False):
            self._launch_graph(token)
            return self.logits
        return self.prefill([token])

    def feed_chosen(self, never: int | None = None, adjust: Callable[[mx.array], mx.array] | None = None) -> mx.array:
        """Chooses the next token on the device from the current logits (the greedy choice; never `never`) and
        feeds it at once, waiting for neither: returns the token as an int32 array of shape (1,) still being
        computed.

        Why: MLX records a decode step's ~900 graph nodes on the host, which takes about as long as the device
        takes to run them. Fed this way, the host builds a step while the device still runs the one before, instead of
        after reading its token back. Read the token (`.item()`), then `confirm` it, or `take_back` the step if
        the stream stops there. Without an MTP block. On CUDA (unless DS4_GRAPH_DECODE=off) the step is one launch
        of a graph of our own (model/graphstep.py): the token comes back chosen, and `confirm` launches its step.
        `adjust` changes the logits before the choice (a token mask, constrain.py); such a choice is made on MLX's
        step, not through the decode graph.
        """
        if self.mtp is not None:
            raise ValueError("feed_chosen runs without an MTP block (speculate feeds ahead with one)")
        self._check_none_fed()
        if self._logits is None:
            raise RequestError("nothing to choose from: the session has no logits yet")
        if adjust is not None:
            self._leave_graph()
        elif self._graph_ready(never):
            if self._graph_token is None:
                self._graph_token = self._graph.chosen()
            self._fed = GRAPH_FED
            return mx.array([self._graph_token], dtype=mx.int32)
        logits = self._logits if adjust is None else adjust(self._logits)
        token = device_argmax(logits, never).astype(mx.int32).reshape(1)
        mx.async_eval(token)  # its own event: reading it waits for the previous step only
        undo, before = self.cache.undo_point(), self.logits
        _, self.logits = self.model.decode(token, self.cache)
        self._fed = (undo, before)
        mx.async_eval(self.logits, *self.cache.arrays())
        return token

    def _check_none_fed(self) -> None:
        if self._fed is not None:
            raise ValueError("a token fed by feed_chosen is neither confirmed nor taken back")

    @property
    def fed_ahead(self) -> bool:
        """Whether a token fed by `feed_chosen` awaits `confirm` or `take_back`."""
        return self._fed is not None

    def confirm(self, token: int) -> None:
        """The token `feed_chosen` fed was `token` (read back): it joins the session's tokens."""
        if self._fed is None:
            raise ValueError("no token was fed by feed_chosen")
        if self._fed == GRAPH_FED:
            self._fed = None
            if self._graph_on:
                self._launch_graph(token)
            else:  # the state was handed back between the choice and now
                self.decode(token)
            return
        self.tokens.append(token)
        self._fed = None

    def take_back(self) -> None:
        """Forgets the token `feed_chosen` fed: the session is as it was before (StepUndo)."""
        if self._fed is None:
            raise ValueError("no token was fed by feed_chosen")
        if self._fed == GRAPH_FED:  # chosen, never launched
            self._fed = None
            return
        undo, self.logits = self._fed
        self.cache.take_back(undo)
        self._fed = None

    def prepare_greedy(self, never: int | None = None) -> bool:
        """Readies greedy decoding (`feed_chosen` with this `never`) before the first token: on CUDA (unless
        DS4_GRAPH_DECODE=off) the decode graphs are recorded and checked now if they are not yet (a recorded and a
        checked step a kind), not inside the first token. Returns whether tokens will go through them."""
        self._check_none_fed()
        return self.mtp is None and self._logits is not None and self._graph_ready(never)

    def _graph_ready(self, never: int | None, choosing: bool = True) -> bool:
        """Whether decoding runs through the decode graph now (entering it if need be): on CUDA unless
        DS4_GRAPH_DECODE=off, outside the reference kernel mode, unless it failed before in this session.
        `choosing`: the graph's greedy choice (never `never`) is the next token, else only its logits are read."""
        if self._graph_on and (not choosing or self._graph.never == never):
            return True
        self._leave_graph()
        if not graphs_wanted() or self._graph_failed:
            return False
        try:
            if self._graph is not None and choosing and self._graph.never != never:
                self._graph.close()
                self._graph = None
            if self._graph is None:
                spare = spare_device_bytes()
                if self._cache.nbytes > 0.9 * spare:
                    self._graph_stand_down(f"the decode graphs hold a copy of the session's state, "
                                           f"{self._cache.nbytes / 2**30:.1f} GiB, and the device has "
                                           f"{max(spare, 0) / 2**30:.1f} GiB spare")
                    return False
                self._graph = GraphDecoder(self.model, self._cache, never)
            self._graph.enter(self._cache)
        except GraphCheckError as error:
            self._graph_stand_down(str(error))
            return False
        except (OSError, DriverError, CompileError, ValueError, RuntimeError) as error:
            self._graph_stand_down(f"the decode graph could not be made ({error})")
            return False
        self._graph_token = int(device_argmax(self._logits, never).item()) if choosing else None
        self._graph_on = True
        return True

    def _launch_graph(self, token: int) -> None:
        self._graph_token = None
        try:
            self._graph.launch(token)
        except DriverError as error:  # nothing was launched
            self._leave_graph()
            self._graph_stand_down(f"the decode graph did not launch ({error})")
            self.decode(token)
            return
        self.tokens.append(token)

    def _graph_stand_down(self, reason: str) -> None:
        warnings.warn(f"decoding goes through MLX's compiled step: {reason}", GraphDecodeWarning,
                      stacklevel=4)
        self._graph_failed = True
        if self._graph is not None:
            self._graph.close()
            self._graph = None

    def _leave_graph(self) -> None:
        """The decoder's state handed back to the cache (and its last logits to the session)."""
        if not self._graph_on:
            return
        self._graph_on = False
        self._take_graph_logits()
        self._graph.leave(self._cache)
        self._graph_token = None

    def _take_graph_logits(self) -> None:
        """The decoder's last launch's logits become the session's (once per launch)."""
        if self._graph.launched:
            self._logits = self._graph.logits()
            self._graph.launched = False

    def _feed(self, tokens: list[int]) -> mx.array:
        """Run the model (then the MTP block, on the model's final streams) over tokens at the next positions;
        returns the logits after the last one. A single token goes through the model's compiled decode step.
        With a DSpark drafter, `_feed_tapped`."""
        if isinstance(self.mtp, DSpark):
            return self._feed_tapped(tokens)
        ids = mx.array(tokens, dtype=mx.int32)
        if len(tokens) == 1:
            streams, logits = self.model.decode(tokens[0], self.cache)
        elif self.mtp is None:
            return self.model(ids, self.cache)
        else:
            streams = self.model.hidden(ids, self.cache)
            logits = self.model.head(streams[-1:])[0]
        if self.mtp is not None:
            self.mtp(ids, streams, len(self.tokens), self.mtp_cache)
        return logits

    def _feed_tapped(self, tokens: list[int]) -> mx.array:
        """`_feed` with a DSpark drafter: the model's taps of the tokens (of a chunk's last rows) join its windows.
        A single token goes through the multi-row step (which taps), a chunk through `hidden`."""
        end = len(self.tokens) + len(tokens)
        if len(tokens) == 1:
            _, logits, rows = self.model.decode_rows(tokens, [self.cache])
            self.cache.advance(rows[0], end)
            logits = logits[0]
        else:
            logits = self.model.head(self.model.hidden(mx.array(tokens, dtype=mx.int32), self.cache)[-1:])[0]
        tapped = self.model.tapped
        self.mtp.commit(tapped, end - tapped.shape[0], self.mtp_cache)
        return logits

    def _eval(self) -> None:
        mtp_arrays = self.mtp_cache.arrays() if self.mtp_cache is not None else []
        mx.eval(self.logits, *self.cache.arrays(), *mtp_arrays)

    def speculate(self, token: int, max_drafts: int, margin: float = 0.0, stop: Collection[int] = (),
                  keep_all: bool = False) -> Speculation:
        """Feed `token`, and with it up to `max_drafts` tokens the MTP block guesses will follow, keeping the
        longest run of guesses that equal the model's own argmax (greedy decoding only).

        ds4's scheme (ds4.c): the block's guess for `token` itself, made when the previous token was fed, is
        checked for free; on a miss there is no drafting and `token` is fed alone. Otherwise the block drafts
        recursively from its own output streams, stopping before a `stop` token (never fed by a greedy stream),
        and one model call over [token, guesses...] verifies them. A single guess whose top-1/top-2 logit gap is
        below `margin` is not worth a verification and is dropped (ds4's gate for --mtp-draft 2). A rejected
        guess rolls the cache back: restore the state before the call, then feed the kept tokens again.
        Without an MTP block, or before it has seen a token, this is `decode`. With a DSpark drafter,
        `_speculate_dspark` (`keep_all`: see there).
        """
        if isinstance(self.mtp, DSpark):
            return self._speculate_dspark(token, max_drafts, stop, keep_all)
        guess = self.mtp_cache.logits if self.mtp_cache is not None else None
        if guess is None or max_drafts <= 0:
            return self._single(token, drafted=0, accepted=0)
        if argmax(guess) != token:
            return self._single(token, drafted=1, accepted=0)
        drafts, gap = self._draft(token, max_drafts, stop)
        if not drafts or (len(drafts) == 1 and gap < margin):
            return self._single(token, drafted=1, accepted=1)
        return self._verify([token, *drafts])

    def _speculate_dspark(self, token: int, max_drafts: int, stop: Collection[int], keep_all: bool = False
                          ) -> Speculation:
        """The DSpark step (the reference alignment): `token` is the anchor, the drafter proposes up to
        min(block_size, max_drafts) tokens after it from its windows (cut before a `stop` token), and one
        multi-row step verifies [token, drafts...]. Counts only the drafts: `drafted` proposed, `accepted` kept.
        `keep_all` keeps every row for the caller to choose against (sampling: it `rewind`s at the first draft its
        own choice differs from), and counts none accepted."""
        if max_drafts <= 0 or self.mtp_cache.n_rows == 0 or self.mtp_cache.end != len(self.tokens):
            return self._single(token, drafted=0, accepted=0)
        drafts = self.mtp.draft(token, self.mtp_cache).tokens[:max_drafts]
        cut = next((i for i, d in enumerate(drafts) if d in stop), len(drafts))
        if cut == 0:
            return self._single(token, drafted=0, accepted=0)
        block = [token, *drafts[:cut]]
        if keep_all:
            logits = self._verify_rows(block)
            self._keep(len(block))
            return Speculation(tuple(block), logits, drafted=cut, accepted=0)
        step = self._verify(block)
        return Speculation(step.tokens, step.logits, drafted=cut, accepted=len(step.tokens) - 1)

    def _single(self, token: int, drafted: int, accepted: int) -> Speculation:
        return Speculation((token,), self.decode(token)[None], drafted, accepted)

    def _draft(self, token: int, n: int, stop: Collection[int]) -> tuple[list[int], float]:
        """Up to n recursive MTP guesses after `token`, and the top-1/top-2 logit gap of the last one. The block's
        cache is left as it was: these rows are speculative, the accepted tokens are fed again with real streams."""
        before = self.mtp_cache.snapshot()
        streams, previous, drafts, gap = self.mtp_cache.hidden, token, [], math.inf
        for i in range(n):
            logits, streams = self.mtp.draft(previous, streams, len(self.tokens) + i, self.mtp_cache)
            guess = argmax(logits)
            if guess in stop:
                break
            top2 = mx.topk(logits, 2)
            drafts.append(guess)
            gap = abs(top2[1] - top2[0]).item()
            previous = guess
        self.mtp_cache.restore(before)
        return drafts, gap

    def _verify(self, block: list[int]) -> Speculation:
        """Feed the block as the rows of one step (Model.decode_rows: every weight read once for all of them) and
        keep block[0] plus the guesses the model's argmax agrees with. The state is the one the last kept row
        left: the rows after it are dropped, not undone or fed again."""
        logits = self._verify_rows(block)
        choices = mx.argmax(logits, axis=-1).tolist()
        n = 1
        while n < len(block) and choices[n - 1] == block[n]:
            n += 1
        self._keep(n)
        return Speculation(tuple(block[:n]), logits[:n], drafted=len(block), accepted=n)

    def _verify_rows(self, block: list[int]) -> mx.array:
        """The block's rows in one step, kept as the last verified block (none of them fed yet); their logits."""
        before = self.snapshot()
        streams, logits, rows = self.model.decode_rows(block, [self.cache], groups=[len(block)])
        self._block = Verified(before, tuple(block), streams, logits, rows, self.model.tapped)
        return logits

    def speculate_sampled(self, token: int, max_drafts: int, temperature: float, rng: np.random.Generator,
                          stop: Collection[int] = ()) -> tuple[Speculation, int]:
        """The DSpark step when sampling at `temperature` (dspark.md §3.4, rejection sampling): up to max_drafts
        drafts, each drawn from its Markov-corrected row at that temperature, [token, drafts...] verified as one
        step, and the drafts kept by `accept_sampled` against the model's softmax(logits / temperature) (the whole
        vocabulary: no top-k or top-p). The state is that of the kept rows. Returns the step and the next token,
        drawn by the rule: every emitted token is distributed as plain sampling's."""
        def target(logits: mx.array) -> np.ndarray:
            p = np.array(mx.softmax(logits.astype(mx.float32) / temperature, axis=-1), dtype=np.float64)
            return p / p.sum(axis=-1, keepdims=True)

        if (not isinstance(self.mtp, DSpark) or max_drafts <= 0 or self.mtp_cache.n_rows == 0
                or self.mtp_cache.end != len(self.tokens)):
            step = self._single(token, drafted=0, accepted=0)
        else:
            draft = self.mtp.draft(token, self.mtp_cache, temperature, rng)
            k = min(max_drafts, next((i for i, d in enumerate(draft.tokens) if d in stop), len(draft.tokens)))
            if k == 0:
                step = self._single(token, drafted=0, accepted=0)
            else:
                block = [token, *draft.tokens[:k]]
                logits = self._verify_rows(block)
                kept, following = accept_sampled(target(logits), replace(draft, tokens=draft.tokens[:k],
                                                                          probs=draft.probs[:k]), rng)
                self._keep(kept + 1)
                return Speculation(tuple(block[: kept + 1]), logits[: kept + 1], drafted=k, accepted=kept), following
        p = target(step.logits[0])
        return step, int(rng.choice(p.size, p=p))

    def _keep(self, n: int) -> None:
        """The state after the first n rows of the last verified block, from its start."""
        block = self._block
        start = len(block.start.tokens)
        self.cache.advance(block.rows[n - 1], start + n)
        if isinstance(self.mtp, DSpark):
            self.mtp.commit(block.features[:n], start, self.mtp_cache)
        else:
            self.mtp(mx.array(block.tokens[:n], dtype=mx.int32), block.streams[:n], start, self.mtp_cache)
        self.tokens.extend(block.tokens[:n])
        self.logits = block.logits[n - 1]
        self._eval()

    def rewind(self, n_tokens: int) -> None:
        """Forget the tokens after the first n_tokens, back to at most the start of the last speculative block.

        A speculative step may feed tokens a caller then does not use (its answer stops first); rewinding leaves
        the state plain decoding would have: the state the block's row at n_tokens left (its start, for none).
        """
        if n_tokens == len(self.tokens):
            return
        block = self._block
        if block is None or not len(block.start.tokens) <= n_tokens < len(self.tokens):
            low = len(self.tokens) if block is None else len(block.start.tokens)
            raise ValueError(f"can rewind to between {low} and {len(self.tokens)} tokens, not {n_tokens}")
        self.restore(block.start)
        self._block = block
        if n_tokens > len(block.start.tokens):
            self._keep(n_tokens - len(block.start.tokens))

    def snapshot(self) -> Snapshot:
        self._check_none_fed()
        mtp = self.mtp_cache.snapshot() if self.mtp_cache is not None else None
        return Snapshot(tuple(self.tokens), self.cache.snapshot(), self.logits, mtp)

    def restore(self, snap: Snapshot) -> None:
        self.tokens = list(snap.tokens)
        self.cache.restore(snap.cache)
        self.logits = snap.logits
        self._block = None
        self._fed = None
        if self.mtp_cache is not None:
            if snap.mtp is None:
                self.mtp_cache.reset()
            else:
                self.mtp_cache.restore(snap.mtp)


ROWS_TOLERANCE = 1e-4
"""How far (relative to the largest logit) a row of a shared step may be from the same session's own step: the
products of several rows sum in another order than one row's (~1e-6 of the scale on the CPU); the fast paths'
own bounds are 1e-5 each, through every layer."""
_rows_checked: weakref.WeakKeyDictionary[Model, dict[tuple[str, int], bool]] = weakref.WeakKeyDictionary()
"""For each model, whether a step shared by that many sessions equals their own steps on a backend (checked at
first use)."""


class SharedStepWarning(RuntimeWarning):
    """A step shared by several sessions disagreed with their own steps here: they decode one at a time."""


def decode_together(sessions: Sequence[Session], tokens: Sequence[int]) -> list[mx.array]:
    """Feeds each session its token in one step over the weights (Model.decode_rows, a row a session); returns
    each one's logits for the token after it. Each row computes what the session's own `decode` would (up to the
    summation order of the products over several rows); the sessions' MTP blocks follow their streams.

    The first shared step of each row count on a backend is checked: the same tokens are also fed to copies of the
    sessions one at a time, and a row off by more than ROWS_TOLERANCE makes that row count decode one session at a
    time from then on (one warning), as a fast path that fails its check goes back to its reference."""
    if len(sessions) != len(tokens) or not sessions:
        raise ValueError(f"{len(tokens)} tokens for {len(sessions)} sessions")
    for session in sessions:
        session._check_none_fed()
        if session.room < 1:
            raise RequestError(f"1 token does not fit: the session holds {len(session.tokens)} of a {session.ctx}-"
                               "token context")
    key, checked = (mx.default_device().type.name, len(sessions)), _rows_checked.setdefault(sessions[0].model, {})
    if len(sessions) == 1 or checked.get(key) is False:
        return [session.decode(token) for session, token in zip(sessions, tokens)]
    if key in checked:
        return _together(sessions, tokens)
    alone = [_alone(session, token) for session, token in zip(sessions, tokens)]
    before = [session.snapshot() for session in sessions]
    out = _together(sessions, tokens)
    errors = [mx.max(mx.abs(got - want)).item() / max(mx.max(mx.abs(want)).item(), 1e-30)
              for got, want in zip(out, alone)]
    checked[key] = max(errors) <= ROWS_TOLERANCE
    if checked[key]:
        return out
    warnings.warn(f"a decode step shared by {len(sessions)} sessions differs from their own steps on {key[0]} (a "
                  f"row off by {max(errors):.3g} of its largest logit): such sessions decode one at a time",
                  SharedStepWarning, stacklevel=2)
    for session, snapshot in zip(sessions, before):
        session.restore(snapshot)
    return [session.decode(token) for session, token in zip(sessions, tokens)]


def _alone(session: Session, token: int) -> mx.array:
    """The logits the session's own compiled step gives for `token`, from a copy of its state (left as it was)."""
    cache = SessionCache(session.model.config, session.ctx)
    cache.restore(session.cache.snapshot())
    _, logits = session.model.decode(token, cache)
    mx.eval(logits)
    return logits


def _together(sessions: Sequence[Session], tokens: Sequence[int]) -> list[mx.array]:
    """The shared step: one launch of the sessions' joint decode graph where the graphs run; where that graph
    cannot be made (or disagreed) but each session's own can, each session's own graph step in turn (over 12 Flash
    layers on the H100 one stream decodes at 391 t/s through its graphs, while 2, 4 and 8 streams through MLX's
    compiled step made 316, 409 and 230 t/s in all: bench/RESULTS.md, 2026-12-07); else MLX's step over the rows."""
    out = _graph_step(sessions, tokens)
    if out is not None:
        return out
    if graphs_wanted() and not any(s.mtp is not None or s._graph_failed for s in sessions):
        return [session.decode(token) for session, token in zip(sessions, tokens)]
    return _shared_step(sessions, tokens)


def _graph_step(sessions: Sequence[Session], tokens: Sequence[int]) -> list[mx.array] | None:
    """The shared step as one launch of the joint decode graph of the sessions' decoders, where each decodes
    through its graphs (CUDA, no MTP block); None where that cannot be (the caller steps through MLX). A joint
    graph that cannot be made or disagrees is not tried again for those decoders (one warning)."""
    if not graphs_wanted() or any(s.mtp is not None or s._graph_failed for s in sessions):
        return None
    if not all(s._graph_ready(None, choosing=False) for s in sessions):
        return None
    decoders = [s._graph for s in sessions]
    key = tuple(id(d) for d in decoders)
    if key in decoders[0].joint_failed:
        return None
    try:
        JointGraphs.of(decoders).launch(list(tokens))
    except Exception as error:  # noqa: BLE001 - whatever breaks the joint graph, the sessions' own steps remain
        decoders[0].joint_failed.add(key)
        warnings.warn(f"a step shared by {len(sessions)} sessions goes through MLX's compiled step: {error}",
                      GraphDecodeWarning, stacklevel=3)
        return None
    for session, token in zip(sessions, tokens):
        session.tokens.append(token)
        session._graph_token = None
    return [session.logits for session in sessions]


def _shared_step(sessions: Sequence[Session], tokens: Sequence[int]) -> list[mx.array]:
    model = sessions[0].model
    caches = [session.cache for session in sessions]  # handed back by any decode graph first
    streams, logits, rows = model.decode_rows(list(tokens), caches)
    out = []
    for i, (session, token, cache) in enumerate(zip(sessions, tokens, caches)):
        cache.advance(rows[i], cache.n_tokens + 1)
        if isinstance(session.mtp, DSpark):
            session.mtp.commit(model.tapped[i : i + 1], len(session.tokens), session.mtp_cache)
        elif session.mtp is not None:
            session.mtp(mx.array([token], dtype=mx.int32), streams[i : i + 1], len(session.tokens), session.mtp_cache)
        session.tokens.append(token)
        session.logits = logits[i]
        out.append(session.logits)
    mx.eval(logits, *(a for s in sessions for a in s.cache.arrays()),
            *(a for s in sessions if s.mtp_cache is not None for a in s.mtp_cache.arrays()))
    return out
