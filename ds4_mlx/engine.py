"""The Engine: one model, one live session, and generation as a stream of events.

Every front end (`ds4-mlx run`, `ds4-mlx chat`, the HTTP server, notebooks) calls `Engine.generate` and consumes
the same events. Rendering happens above (chat.py), wire formats happen above (serve/); tokenizing, prefix reuse,
sampling, stop rules and tool-call parsing happen here, once.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Generator, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import takewhile
from pathlib import Path

import mlx.core as mx

from . import dsml, memory
from .chat import ToolMemory
from .cache.checkpoints import CheckpointStore, Match
from .constrain import Constraint
from .errors import ContextOverflow, ModelFileMissing, RequestError, ResourceError, UsageError
from .events import Done, Event, ParsedMessage, PrefillProgress, PromptAccepted, Usage
from .cache import kvdrafter
from .cache.kvfiles import check_directory
from .cache.kvidentity import model_identity
from .cache.kvsplit import agreed_load, agreed_saved, rank_options
from .cache.kvstore import KvCacheOptions, KvEntry, KvHit, KvStore, SaveReason, routed_quant_bits
from .model.checkpoint import FACT_KEYS, Checkpoint
from .model.checkpoint import detect as detect_checkpoint
from .model.config import FLASH, ModelConfig
from .model.linear import loaded_nbytes
from .model.model import Model
from .model.dspark import DSpark, open_drafter
from .model.dspark_file import DSparkWeights
from .model.mtp import MTP
from .model.shard import agreed, init_split
from .model.weights import MTPWeights, open_weights
from .progress import Progress
from .reuse import Reuse, first_difference, rest_after
from .sampling import Sampler, SamplingParams, argmax
from .session import GRAPH_ENV, Session, Snapshot, decode_together, graphs_wanted, state_copies
from .stop import StopStrings
from .cache.tensordigest import tensor_digests
from .tokenizer import StreamDecoder, Tokenizer, utf8

log = logging.getLogger("ds4_mlx.engine")

DEMO_PRESET = "tiny"
DEMO_SEED = 0
MAX_MTP_DRAFT = 16  # ds4's cap on --mtp-draft
SPECULATION_LOSES = ("on CUDA decoding goes through the decode graphs, 8.2 ms a token at 2k on the H200, while a "
                     "speculative verify call through MLX costs ~88 ms over 1-3 tokens (DS4_GRAPH_DECODE=off "
                     "speculates through MLX's step)")


def speculation_pays() -> bool:
    """Whether MTP speculation can beat plain decoding here: not where the decode graphs run. A verify call goes
    through MLX's chunk path, 87.8 ms over 1 token and 89.2 over 3 on the H200 (bench/RESULTS.md, 2026-12-02), so
    even every guess right gives ~34 tokens/s against the graphs' ~120 (2026-12-03)."""
    return not graphs_wanted()


def warn_pairing(main: Checkpoint, drafter: MTPWeights | DSparkWeights, path: Path) -> None:
    """Warns when a drafter meets main weights of the other checkpoint (it still works, with fewer drafts
    accepted): the MTP-1 head and the June DSpark file go with the preview, `…DSpark-support-0731.gguf` with
    0731 (the C engine's README: checkpoint-specific). A DSpark file's checkpoint is told as a main file's is."""
    if isinstance(drafter, DSparkWeights):
        own, basis = detect_checkpoint(drafter.file.metadata, path)
    else:
        own, basis = Checkpoint.PREVIEW, "MTP-1 was published for the preview only"
    if own != main:
        log.warning("the drafter %s is for the %s weights (%s) but the model is %s: drafts are accepted less often",
                    path.name, own.value, basis, main.value)


def drafts_unused(mtp_draft: int, speculate_anyway: bool) -> bool:
    """Whether --mtp-draft asks for speculation where it does not pay (the engine then decodes plainly)."""
    return mtp_draft > 1 and not (speculate_anyway or speculation_pays())


@dataclass
class GenerationRequest:
    """What to generate from.

    `prompt` is rendered text in which the special strings are recognised, or token ids when the caller has
    tokenized it itself (the CLI does, so that special strings typed by a user stay plain text).

    `thinking` says whether the answer starts inside reasoning. Left None it follows the prompt, so that the think
    mode is chosen in one place, the rendering: a prompt that ends with the thinking opener `<think>` (rendered with
    ThinkMode.HIGH or MAX) is answered with reasoning first, any other (ThinkMode.NONE ends with `</think>`, a raw
    prompt with text) with the answer alone.
    """

    prompt: str | list[int]
    max_tokens: int | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    thinking: bool | None = None
    tools_active: bool = False
    output: Constraint | None = None
    """What the answer (after the reasoning) is held to by a token mask: a format, strict tools' calls
    (constrain.py); None: free."""


def demo_model_path() -> Path:
    """Where the built-in demo model is cached (built once, then reused)."""
    root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "ds4-mlx"
    return root / f"demo-{DEMO_PRESET}-real-vocab-seed{DEMO_SEED}.gguf"


def ensure_demo_model() -> Path:
    """Builds the tiny demo model with the real V4 tokenizer on first use; its text is meaningless."""
    path = demo_model_path()
    if not path.exists():
        from .model.factory import write_model

        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        write_model(tmp, preset=DEMO_PRESET, experts="q2", vocab="real", seed=DEMO_SEED)
        tmp.replace(path)
    return path


def check_context(config: ModelConfig, ctx: int) -> None:
    """A context from 1 token to the model's trained one (1,048,576 for DeepSeek V4 Flash): rope scaling and the
    compressed caches are not defined beyond it."""
    limit = config.context_length or FLASH.context_length
    if not 1 <= ctx <= limit:
        raise UsageError(f"context size must be from 1 to {limit} tokens (the model's trained context), got {ctx}")


@dataclass(eq=False)
class Lane:
    """One live session requests run on, and how far its tokens are already checkpointed to disk."""

    session: Session
    on_disk: int = 0
    """The furthest position of the session already checkpointed to disk."""


@dataclass(frozen=True)
class Feed:
    """What `Engine.answer` yields for a token to go into a step shared with other lanes (batch.py); the step's
    logits for the token after it are sent back."""

    token: int


class Pause:
    """What `Engine.answer` yields between prefill chunks and tokens: the scheduler may run other lanes there."""


PAUSE = Pause()


class Engine:
    """One loaded model with its live sessions (lanes), shared by every front end."""

    def __init__(
        self,
        model: Model,
        tokenizer: Tokenizer,
        ctx: int,
        model_name: str = "deepseek-v4-flash",
        default_max_tokens: int = 393216,
        tool_memory: ToolMemory | None = None,
        kv_store: KvStore | None = None,
        mtp: MTP | None = None,
        mtp_draft: int = 1,
        mtp_margin: float = 3.0,
        kv_ram_budget: int | None = None,
        speculate_anyway: bool = False,
        parallel: int = 1,
    ) -> None:
        """`mtp_draft` >= 2 turns on speculative greedy decoding with the `mtp` draft block: up to mtp_draft - 1
        guessed tokens are verified per model call (ds4's --mtp-draft; 1 = off), where it can pay
        (`speculation_pays`; `speculate_anyway` for the bench, which measures it everywhere). `mtp_margin` is ds4's
        --mtp-margin: a lone guess whose top-1/top-2 logit gap is below it is not verified. `kv_ram_budget` is
        the bytes in-memory checkpoints may hold (0 = none; None = what the device memory budget leaves once the
        weights, the session's state and one prefill chunk at the context's end are counted, memory.py).
        `parallel` is how many lanes (sessions) requests run on at once (the server's --parallel, batch.py)."""
        if parallel < 1:
            raise ValueError(f"parallel must be at least 1, got {parallel}")
        if not 1 <= mtp_draft <= MAX_MTP_DRAFT:
            raise ValueError(f"mtp_draft must be between 1 and {MAX_MTP_DRAFT}, got {mtp_draft}")
        if drafts_unused(mtp_draft, speculate_anyway):
            log.warning("--mtp-draft %d is unused: %s", mtp_draft, SPECULATION_LOSES)
            mtp_draft, mtp = 1, None
        if mtp_draft > 1 and mtp is None:
            raise ValueError(f"mtp_draft {mtp_draft} needs an MTP draft block (--mtp FILE)")
        if not mtp_margin >= 0:
            raise ValueError(f"mtp_margin must be a number >= 0, got {mtp_margin}")
        self.model = model
        self.tokenizer = tokenizer
        self.ctx = ctx
        self.model_name = model_name
        self.default_max_tokens = default_max_tokens
        self.tool_memory = tool_memory if tool_memory is not None else ToolMemory()
        self.tool_memory_lock = threading.Lock()
        """Held by whoever reads or updates the tool memory: request threads render with it, the worker saves it."""
        self.kv_store = kv_store
        self.mtp_draft = mtp_draft
        self.mtp_margin = mtp_margin
        self.lanes = [Lane(self._new_session(ctx, mtp if mtp_draft > 1 else None)) for _ in range(parallel)]
        """The live sessions requests run on: one for the CLI and notebooks, --parallel for the server."""
        state = parallel * sum(a.nbytes for a in self.session.cache.arrays())
        self.budget = memory.plan(model.config, mx.get_active_memory() - state, state_copies() * state,
                                  self.session.chunk_size, ctx)
        self.split = getattr(model, "split", None)  # test doubles have no split
        """This rank's share of a model split across ranks (model/shard.py), whose kept states are agreed."""
        kv_ram_budget = self.budget.spare if kv_ram_budget is None else kv_ram_budget
        if self.split is not None:  # every rank keeps the same checkpoints (cache/checkpoints.py)
            kv_ram_budget = self.split.least_of([kv_ram_budget])[0]
        self.checkpoints = CheckpointStore(kv_ram_budget, self._text_bytes,
                                           self.split.anywhere if self.split is not None else None)
        log.info("%s", self.budget.describe(kv_ram_budget))
        self.reuse = Reuse("none", 0)
        """Where the last prompt's reused tokens came from, and why it did not extend the live session."""
        self.load_phases: dict[str, float] = {}
        """Seconds of each part of `load` (open and check the file, weights, mtp, tokenizer, engine)."""
        self.file_facts: dict[str, object] = {}
        """The GGUF metadata that names the file and tells its checkpoint (model/checkpoint.py), for the model
        card."""
        self.checkpoint = Checkpoint.PREVIEW
        """Which checkpoint the weights are (model/checkpoint.py): it picks the reasoning-effort prefixes."""
        self.checkpoint_basis = "not loaded from a file; assumed the preview"

    @property
    def session(self) -> Session:
        """The first lane's session: the one `generate` runs on (the notebooks' and the CLI's live session)."""
        return self.lanes[0].session

    @property
    def parallel(self) -> int:
        return len(self.lanes)

    @classmethod
    def load(
        cls,
        path: str | os.PathLike,
        ctx: int = 32768,
        *,
        simulate_quant: bool = True,
        quiet: bool = True,
        kv_cache: KvCacheOptions | None = None,
        mtp: str | os.PathLike | None = None,
        checkpoint: Checkpoint | None = None,
        split: str | None = None,
        split_weights: str | None = None,
        **opts,
    ) -> Engine:
        """Opens and validates a GGUF, checks that it fits with the state at `ctx`, and builds the model.

        Loading shows a progress bar on stderr unless `quiet` (or stderr is not a terminal). `kv_cache` turns on
        the disk KV cache (checkpoints carry the model's fingerprint and routed-expert quant bits). `mtp` is an MTP
        draft file (ds4.c) to load with it; pass `mtp_draft` >= 2 to speculate with it. `checkpoint` says which
        checkpoint the file is (`--checkpoint`); None tells it from the file (model/checkpoint.py). `parallel` is
        the lanes requests run on at once (negative: up to that many, as many as fit beside the weights).
        Under `mlx.launch` the model is split across the ranks (`split`: "tensor", the default, or "layers";
        `split_weights` their shares, "3,5"; model/shard.py): each rank loads and checks the memory of its share,
        and keeps its disk checkpoints in a directory of its own under `kv_cache.directory` (cache/kvsplit.py).
        """
        path = Path(path)
        if not path.exists():
            raise ModelFileMissing.at(path)
        names, marks = [], [time.perf_counter()]

        def phase(name: str) -> None:
            names.append(name)
            marks.append(time.perf_counter())

        weights = open_weights(path)
        check_context(weights.config, ctx)
        shard = init_split(split, split_weights, weights, drafter=mtp is not None)
        if shard is not None:
            # every rank must take the same decisions: the same chunks (and RAM checkpoints, see __init__), and not
            # the decode graphs, which run one process's step (graphstep.py); each rank has its own disk cache
            memory.agree_chunks(shard.least)
            os.environ[GRAPH_ENV] = "off"
            log.info("%s", shard.describe())
        if kv_cache is not None:
            check_directory(kv_cache.directory)  # before the long load: a refused directory fails at once
            if shard is not None:
                kv_cache = rank_options(kv_cache, shard)
                check_directory(kv_cache.directory)
        mtp_weights = open_drafter(mtp, weights.config) if mtp is not None else None
        if drafts_unused(opts.get("mtp_draft", 1), opts.get("speculate_anyway", False)):
            mtp_weights = None  # checked, not loaded: the engine would not use it
        held = weights if shard is None else shard.weights(weights)  # a rank counts its own share
        model_bytes = loaded_nbytes(held) + (loaded_nbytes(mtp_weights) if mtp_weights is not None else 0)
        opts["parallel"] = memory.check_memory(weights, model_bytes, ctx, memory.apply_limit(), opts.get("parallel", 1))
        if shard is not None:  # as many lanes on every rank: the fewest any rank has room for
            opts["parallel"] = shard.least(opts["parallel"])
        phase("open")
        with ThreadPoolExecutor(2, thread_name_prefix="ds4-mlx-beside-load") as pool:
            # built beside the weights' load, which mostly waits on its reader threads (~0.5 s of Python); the
            # tensor digests of the model identity too (read from their cache, or hashed while the load reads)
            tokenizer = pool.submit(Tokenizer.from_gguf, weights.file.metadata)
            digests = pool.submit(tensor_digests, weights.file) if kv_cache is not None else None
            drafter_digest = (pool.submit(kvdrafter.drafter_identity, mtp_weights)
                       if kv_cache is not None and mtp_weights is not None else None)
            with Progress(quiet).bar(f"loading {path.name}", unit="bytes") as bar:
                model = Model(weights, simulate_quant=simulate_quant, progress=bar.update, split=shard)
            phase("weights")
            if mtp_weights is not None:
                with Progress(quiet).bar(f"loading {Path(mtp).name}", unit="bytes") as bar:
                    drafter = DSpark if isinstance(mtp_weights, DSparkWeights) else MTP
                    opts["mtp"] = drafter(mtp_weights, model, progress=bar.update)
                phase("mtp")
            tokenizer = tokenizer.result()
            digests = digests.result() if digests is not None else None
        phase("tokenizer")
        if kv_cache is not None:
            opts["kv_store"] = KvStore(kv_cache, routed_quant_bits(weights),
                                       model_identity(weights, simulate_quant, digests, shard), held=model.layers,
                                       drafter_identity=drafter_digest.result() if drafter_digest else b"")
        engine = cls(model, tokenizer, ctx, **opts)
        phase("engine")
        engine.load_phases = {name: round(b - a, 3) for name, a, b in zip(names, marks, marks[1:])}
        metadata = weights.file.metadata
        engine.file_facts = {key: metadata[key] for key in FACT_KEYS if key in metadata}
        if checkpoint is not None:
            engine.checkpoint, engine.checkpoint_basis = checkpoint, "--checkpoint"
        else:
            types = tuple(t for pair in weights.expert_types for t in pair)
            engine.checkpoint, engine.checkpoint_basis = detect_checkpoint(metadata, path, types)
        log.info("checkpoint %s (%s)", engine.checkpoint.value, engine.checkpoint_basis)
        if mtp_weights is not None:
            warn_pairing(engine.checkpoint, mtp_weights, Path(mtp))
        return engine

    @classmethod
    def demo(cls, ctx: int = 4096, **opts) -> Engine:
        return cls.load(ensure_demo_model(), ctx, **opts)

    @property
    def random_weights(self) -> bool:
        """Whether the file is one of `make-model`'s random-weight files (the demo model too), by the name they all
        carry: such a model practically never writes its end token, so its answers need a short default limit."""
        from .model.factory import RANDOM_WEIGHTS

        return RANDOM_WEIGHTS in str(self.file_facts.get("general.name", ""))

    def warm_up(self) -> float:
        """Feeds a short prompt and a few greedy tokens through the live session, then empties it; returns the
        seconds taken. Why: the first use of each kernel compiles or reads it back and checks it against its
        reference, and on CUDA the first decoded token makes and checks the decode graphs (~14 s on the full
        model, bench/RESULTS.md, 2026-12-03), each lane its own: a server does that before it takes requests, not
        inside the first. Where lanes share steps, the shared step of each row count is compiled and checked too."""
        t0 = time.perf_counter()
        tokens = self.tokenizer.encode("The kernels are compiled and checked here.")[: max(1, self.ctx // 2)]
        for lane in self.lanes:  # each lane's own decode graphs, where they run, are made as it first decodes
            session = lane.session
            session.reset()
            session.prefill(tokens)
            for _ in range(min(3, session.room)):
                if session.mtp is None:
                    session.confirm(int(session.feed_chosen().item()))
                else:
                    session.speculate(argmax(session.logits), self.mtp_draft - 1, self.mtp_margin)
            session.reset()
            if not graphs_wanted():
                break  # the other lanes take the same compiled steps
        for n in range(2, self.parallel + 1):  # the steps shared by 2..parallel lanes, made now
            sessions = [lane.session for lane in self.lanes[:n]]
            for session in sessions:
                session.prefill(tokens[:1])
            decode_together(sessions, [tokens[0]] * n)
            for session in sessions:
                session.reset()
        return time.perf_counter() - t0

    def set_context(self, ctx: int) -> None:
        """Replaces the live session with an empty one of `ctx` tokens, if the device has room for its state."""
        from .model.cache import session_bytes

        check_context(self.model.config, ctx)
        need = self.parallel * state_copies() * session_bytes(self.model.config, ctx)
        room = memory.free_bytes() + self.parallel * state_copies() * self.session.cache.nbytes
        if self.split is not None:  # every rank takes the same answer: the one with the least room
            room = self.split.least_of([room])[0]
        if need > room:
            gib = 1024**3
            raise ResourceError(
                f"ctx {ctx} needs {need / gib:.1f} GiB of session state but only {max(room, 0) / gib:.1f} GiB is "
                f"free next to the model; the context stays at {self.ctx}"
            )
        mtp = self.session.mtp
        for lane in self.lanes:
            lane.session.close()
            lane.session, lane.on_disk = self._new_session(ctx, mtp), 0
        self.ctx = ctx
        self.checkpoints.clear()  # states of the old context size

    def reset(self) -> None:
        """Forgets every state computed in memory: the live sessions and the kept checkpoints (not the disk's)."""
        for lane in self.lanes:
            self._drop_session(lane)
        self.checkpoints.clear()

    def count_tokens(self, prompt: str) -> int:
        return len(self.tokenizer.encode(prompt))

    def _reuse(self, lane: Lane, prompt: str, tokens: list[int], exact: bool) -> tuple[list[int], int]:
        """Prefix reuse (ds4_server.c): returns the effective prompt tokens and how many are already computed.

        The longest state that starts the prompt: the live session when it does (it wins ties: nothing to
        restore), else an in-memory checkpoint, else a longer disk checkpoint, else nothing (a cold prefill).
        A live session that is not reused is kept as a checkpoint before it is replaced. `exact`: the caller
        gave token ids, which then must extend a checkpoint's ids too (the text of ids is not re-tokenized).
        """
        live = self._reuse_live(lane, prompt, tokens, exact)
        kept = self.checkpoints.find(tokens, None if exact else prompt.encode("utf-8"),
                                     longer_than=live[1] if live is not None else 0)
        if live is not None and kept is None:
            self.reuse = Reuse("live", live[1])
            return live
        miss = first_difference(lane.session.tokens, tokens, self.tokenizer) if live is None else None
        self.checkpoints.add(lane.session.snapshot())
        self._replace_session(lane)
        if self.kv_store is not None:
            loaded = self._load_from_disk(lane, prompt, tokens, exact, kept.checkpoint.n_tokens if kept else 0)
            if loaded is not None:
                self.reuse = Reuse("disk", loaded[1], miss)
                return loaded
        if kept is not None:
            restored = self._restore(lane, kept, prompt, tokens)
            self.reuse = Reuse("ram", restored[1], miss)
            return restored
        self.reuse = Reuse("none", 0, miss)
        return tokens, 0

    def _restore(self, lane: Lane, match: Match, prompt: str, tokens: list[int]) -> tuple[list[int], int]:
        """Makes a kept checkpoint the live session; a text match keeps its ids and tokenizes the rest of the
        prompt text after them."""
        snapshot = self.checkpoints.use(match)
        lane.session.restore(snapshot)
        n = len(snapshot.tokens)
        log.debug("restored an in-memory checkpoint of %d tokens (%d kept)", n, len(self.checkpoints))
        if not match.by_text:
            return tokens, n
        rest = prompt.encode("utf-8")[len(match.checkpoint.text) :].decode("utf-8")
        return list(snapshot.tokens) + self.tokenizer.encode(rest), n

    def _reuse_live(self, lane: Lane, prompt: str, tokens: list[int], exact: bool) -> tuple[list[int], int] | None:
        """The live tokens are reused when they are a token prefix of the new prompt, or when the exact bytes they
        spell are a byte prefix of the prompt's UTF-8 (then only the remaining text is tokenized, never slicing
        the canonical tokens, since BPE may merge across the boundary). Bytes, not decoded text: a token run that
        spells invalid UTF-8 decodes to U+FFFD, which a prompt may also contain with other bytes. Prompts given as
        ids (`exact`) are never re-tokenized. None on a miss."""
        live = lane.session.tokens
        if live and len(tokens) >= len(live) and tokens[: len(live)] == live:
            return tokens, len(live)
        if live and not exact:
            rest = rest_after(utf8(prompt), self._text_bytes(live))
            if rest is not None:
                return live + self.tokenizer.encode(rest), len(live)
        return None

    def _replace_session(self, lane: Lane) -> None:
        """The live session is about to be dropped (a cache miss, a stop string, a cancelled prefill): checkpoint it
        to disk (reason evict) if it is worth keeping — a checkpoint loaded from disk may have been consumed — then
        drop it."""
        if self.kv_store is not None and len(lane.session.tokens) >= self.kv_store.options.min_tokens:
            self._checkpoint(lane, SaveReason.EVICT)
        self._drop_session(lane)

    def _new_session(self, ctx: int, mtp: MTP | None) -> Session:
        """A session whose prefill, short of device memory, drops the oldest RAM checkpoints first."""
        session = Session(self.model, ctx, mtp)
        session.release = lambda: self.checkpoints.drop_oldest()
        return session

    def _drop_session(self, lane: Lane) -> None:
        lane.session.reset()
        lane.on_disk = 0

    def _text_bytes(self, tokens: list[int]) -> bytes:
        """What a run of tokens spells, byte for byte: the disk cache's key space."""
        return b"".join(self.tokenizer.token_bytes(t) for t in tokens)

    def _load_from_disk(self, lane: Lane, prompt: str, tokens: list[int], exact: bool,
                        longer_than: int = 0) -> tuple[list[int], int] | None:
        """Loads the longest disk checkpoint whose text starts the prompt into the (empty) live session, when it
        holds more than `longer_than` tokens. Its token ids are kept as they are; only the prompt text after it
        is tokenized (ds4_kvstore.c)."""
        store, ctx = self.kv_store, lane.session.ctx
        data = self._text_bytes(tokens) if exact else utf8(prompt)

        def attempt(entry: KvEntry) -> tuple[KvHit, list[int]] | None:
            hit = store.load(entry, data, self.model.config, ctx)
            if hit is None:
                return None
            if exact and tokens[: len(hit.tokens)] != hit.tokens:
                log.info("kv cache hit %s not used: its tokens are not a prefix of the prompt's", entry.path)
                return None
            effective = tokens if exact else hit.tokens + self.tokenizer.encode(data[hit.text_bytes :].decode())
            return (hit, effective) if len(effective) < ctx else None

        # best first, one that fails to load falls back to the next; of a split model, every rank loads one or none
        longer = takewhile(lambda entry: entry.header.tokens > longer_than, store.candidates(data, ctx))
        found = agreed_load(self.split, longer, attempt)
        if found is None:
            return None
        hit, effective = found
        n = len(hit.tokens)
        store.record_hit(hit)
        drafted = kvdrafter.decode(hit.drafter_rows, lane.session, store.drafter_identity, n)
        lane.session.restore(Snapshot(tuple(hit.tokens), hit.cache.snapshot(), hit.logits, drafted))
        lane.on_disk = n
        if hit.tool_map:
            with self.tool_memory_lock:
                for call_id, block in hit.tool_map.items():
                    self.tool_memory.remember([call_id], block)
        return effective, n

    def _checkpoint(self, lane: Lane, reason: SaveReason) -> None:
        """Saves the live session as it is now to the disk cache, with the tool-call ids its text replays.

        A checkpoint that cannot be written is logged and skipped: the request it happens in still succeeds (and
        the session counts as on disk only up to the last checkpoint that every rank saved)."""
        tokens = lane.session.tokens
        with self.tool_memory_lock:
            tool_blocks = self.tool_memory.items()
        try:
            saved = self.kv_store.save(self._text_bytes(tokens), lane.session.cache, tokens, lane.session.logits,
                                       reason, tool_blocks,
                                       kvdrafter.encode(lane.session, self.kv_store.drafter_identity))
        except Exception:
            log.exception("kv cache checkpoint (%s) of %d tokens failed", reason.name.lower(), len(tokens))
            saved = False
        if agreed_saved(self.split, saved):  # of a split model: on every rank
            lane.on_disk = max(lane.on_disk, len(tokens))

    def _at_boundary(self, lane: Lane, cold_target: int | None) -> None:
        """At a prefill chunk boundary: the cold checkpoint if this is its position, then a continued one if this
        is a frontier not yet on disk (a cold save at a frontier stands for it)."""
        if self.kv_store is None:
            return
        if len(lane.session.tokens) == cold_target:
            self._checkpoint(lane, SaveReason.COLD)
        self._maybe_continued(lane)

    def _maybe_continued(self, lane: Lane) -> None:
        if self._at_continued_frontier(lane):
            self._checkpoint(lane, SaveReason.CONTINUED)

    def _prefill(self, lane: Lane, tokens: list[int], start: int, cold_target: int | None) -> Iterator[tuple[int, int]]:
        """Prefills tokens[start:], yielding (done, total) after each chunk. The state at the start of the last
        message and at every chunk boundary before the end is kept in memory (the end is kept by the caller,
        once the logits are there). With the disk cache on, chunks also end at the cold checkpoint and at every
        continued frontier, which are saved there."""
        total = len(tokens) - start
        stops = {len(tokens)}
        last_message = self._last_message_start(tokens)
        if last_message == start:
            self.checkpoints.add(lane.session.snapshot())
        elif last_message > start:
            stops.add(last_message)
        if self.kv_store is not None:
            stops.update(self.kv_store.options.frontiers_between(start, len(tokens)))
            if cold_target is not None:
                stops.add(cold_target)
        pos = start
        for stop in sorted(stops):
            for done, _ in lane.session.prefill_steps(tokens[pos:stop]):
                self._at_boundary(lane, cold_target)
                if len(lane.session.tokens) < len(tokens):
                    self.checkpoints.add(lane.session.snapshot())
                yield pos - start + done, total
            pos = stop

    def _last_message_start(self, tokens: list[int]) -> int:
        """Where the prompt's last user (or tool-result) turn begins: its `<｜User｜>` marker; -1 when it has none.
        Agents retry by editing or appending to that turn, so the state before it is worth keeping."""
        user = self.tokenizer.user_id
        for i in range(len(tokens) - 1, -1, -1):
            if tokens[i] == user:
                return i
        return -1

    def shutdown(self) -> None:
        """Checkpoints the live sessions to disk (reason shutdown) for the next process, when the disk cache is on
        and a session is long enough. The engine stays usable."""
        for lane in self.lanes:
            if self.kv_store is not None and len(lane.session.tokens) >= self.kv_store.options.min_tokens:
                self._checkpoint(lane, SaveReason.SHUTDOWN)

    def generate(self, req: GenerationRequest, cancel: Callable[[], bool] | None = None) -> Iterator[Event]:
        """Prefills what the live session lacks, then samples until a stop rule fires. Yields events; Done last.
        One request at a time, on the first lane (the server runs several at once through batch.py)."""
        for item in self.answer(self.lanes[0], req, cancel):
            if not isinstance(item, (Feed, Pause)):
                yield item

    def answer(self, lane: Lane, req: GenerationRequest, cancel: Callable[[], bool] | None = None,
               shared: Callable[[], bool] | None = None) -> Generator[Event | Feed | Pause, mx.array | None, None]:
        """`generate` on one lane, as a scheduler (batch.py) drives it: besides the events it yields PAUSE after each
        prefill chunk and each token, where the scheduler may run other lanes, and, while `shared()` says other
        lanes decode too, a Feed for each token instead of stepping alone; the scheduler feeds it in a step shared
        with them and sends back the logits for the token after it. Stepping alone, a lane decodes as `generate`
        does (the decode graphs, tokens fed ahead, speculation)."""
        tokens, cached, cold_target = self._accept(lane, req)
        reuse = self.reuse
        yield PromptAccepted(len(tokens), cached, reuse)
        t0 = time.perf_counter()
        for done, total in self._prefill(lane, tokens, cached, cold_target):
            if total > min(lane.session.chunk_size, lane.session.chunk_cap or lane.session.chunk_size):
                yield PrefillProgress(done, total)
            if shared is not None:
                yield PAUSE
            if done < total and cancel is not None and cancel():
                self._replace_session(lane)
                yield Done("error", ParsedMessage("", ""), Usage(len(tokens), cached, 0),
                           prefill_seconds=time.perf_counter() - t0, error="cancelled", reuse=reuse)
                return
        self.checkpoints.add(lane.session.snapshot())  # the end of the prompt: resends and regenerations land here
        logits = lane.session.logits
        t1 = time.perf_counter()

        thinking = req.thinking if req.thinking is not None else tokens[-1] == self.tokenizer.think_id
        sampler = Sampler(agreed(getattr(self.model, "split", None), req.sampling))  # test doubles have no split
        decoder = StreamDecoder(self.tokenizer)
        parser = dsml.StreamParser(thinking=thinking, tools_active=req.tools_active)
        greedy = dsml.GreedyTracker(thinking=thinking) if req.tools_active else None
        stops = StopStrings(req.stop)
        mask = req.output.start(self.tokenizer, thinking, req.tools_active) if req.output is not None else None
        limit = self.default_max_tokens if req.max_tokens is None else max(0, req.max_tokens)
        limit = min(limit, lane.session.room)
        generated: list[int] = []
        reasoning_tokens = 0
        text_parts: list[str] = []
        finish = "length"
        speculate = self._speculates(req.sampling)
        by_stream = speculate and not _plain_greedy(req.sampling)  # DSpark drafts kept or dropped by the sampler
        # a masked greedy choice is fed ahead too (the mask is ready before it), on MLX's step, not the decode graphs
        pipelined = self._pipelines(req.sampling) and (mask is None or not graphs_wanted())
        ahead: list[tuple[int, mx.array]] = []  # fed by a speculative step before the stream chose them, with logits
        drafted = accepted = 0  # MTP guesses checked against the model, and those it agreed with

        def emit(text: str) -> Iterator[Event]:
            """Visible text (after stop strings) goes to the DSML parser, which turns it into events."""
            text_parts.append(text)
            yield from parser.feed(text)

        failure = ""
        try:
            while len(generated) < limit:
                if cancel is not None and cancel():
                    finish = "error"
                    break
                together = shared is not None and shared()  # this token goes into a step shared with other lanes
                if pipelined and not together and len(generated) + 1 < limit:  # fed before read: not the last token
                    token = int(lane.session.feed_chosen(adjust=mask.apply if mask is not None else None).item())
                else:
                    use_greedy = greedy is not None and greedy.greedy
                    if mask is not None:
                        logits = mask.apply(logits)
                    token = sampler.greedy(logits) if use_greedy else sampler.sample(logits)
                if ahead and ahead[0][0] != token:  # the mask refused a draft, or the sampler chose another token
                    lane.session.rewind(len(lane.session.tokens) - len(ahead))
                    ahead = []
                if token == self.tokenizer.eos_id:
                    finish = "stop"
                    break
                generated.append(token)
                if mask is not None:
                    mask.advance(token)  # the next mask is computed while the model runs the step
                reasoning_tokens += 0 if parser.reasoning_closed else 1
                sampler.record(token)
                piece = decoder.feed(token)
                if greedy is not None:
                    greedy.feed(piece)  # the sampling mode follows the text as sampled, not as held for stops
                yield from emit(stops.feed(piece))
                if stops.hit:
                    finish = "stop"
                    break
                if req.tools_active and parser.tool_block_closed:
                    finish = "tool_calls"
                    break
                if len(generated) < limit and ahead:
                    logits = _take_ahead(ahead, token)
                    accepted += by_stream
                elif len(generated) < limit:
                    checkpoint = (self.kv_store is not None and self._at_continued_frontier(lane)
                                  and (greedy is None or greedy.state is dsml.DecodeState.OUTSIDE))
                    if lane.session.fed_ahead and not checkpoint:
                        lane.session.confirm(token)
                        logits = lane.session.logits
                    else:
                        if lane.session.fed_ahead:
                            lane.session.take_back()  # the checkpoint holds the state before this token
                        if checkpoint:  # continued checkpoints are not taken inside a tool block
                            self._checkpoint(lane, SaveReason.CONTINUED)
                        if together:
                            logits = yield Feed(token)
                        elif speculate:
                            step = lane.session.speculate(token, self._draft_room(lane, len(generated), limit),
                                                          self.mtp_margin, stop=(self.tokenizer.eos_id,),
                                                          keep_all=by_stream)
                            drafted, accepted = drafted + step.drafted, accepted + step.accepted
                            logits = step.logits[0]
                            ahead = [(t, step.logits[i]) for i, t in enumerate(step.tokens[1:], 1)]
                        else:
                            logits = lane.session.decode(token)
                if shared is not None and not together:
                    yield PAUSE
            if lane.session.fed_ahead:  # the answer ended on a token fed before it was read: unfeed it
                lane.session.take_back()
            if ahead and not stops.hit:  # the answer ended before tokens fed ahead of it: unfeed them
                lane.session.rewind(len(lane.session.tokens) - len(ahead))
        except Exception as exc:  # a decode failure ends the answer with finish "error" (ds4_server.c)
            log.exception("decode failed after %d tokens", len(generated))
            finish, failure = "error", f"decode failed: {exc}"
            self._drop_session(lane)
        tail = decoder.flush()
        if greedy is not None:
            greedy.feed(tail)
        yield from emit(stops.feed(tail) + stops.flush())
        yield from parser.finish()
        t2 = time.perf_counter()

        if stops.hit:
            self._replace_session(lane)
        message = dsml.parse_message("".join(text_parts), thinking=thinking, tools_active=req.tools_active)
        finish = dsml.final_finish_reason(finish, message)
        yield Done(
            finish_reason=finish,
            message=message,
            usage=Usage(prompt_tokens=len(tokens), cached_tokens=cached, completion_tokens=len(generated),
                        reasoning_tokens=reasoning_tokens),
            prefill_seconds=t1 - t0,
            decode_seconds=t2 - t1,
            error=failure or ("cancelled" if finish == "error" and not message.error else message.error),
            token_ids=tuple(generated),
            mtp_drafted=drafted,
            mtp_accepted=accepted,
            reuse=reuse,
        )

    def _accept(self, lane: Lane, req: GenerationRequest) -> tuple[list[int], int, int | None]:
        """Tokenizes the prompt, checks that it fits, and decides what the live session (or the disk) already holds.

        Returns the effective prompt tokens, how many of them are already computed, and where a cold disk
        checkpoint should be taken (None when there is none to take)."""
        if isinstance(req.prompt, str):
            text, tokens = req.prompt, self.tokenizer.encode(req.prompt)
        else:
            text, tokens = self.tokenizer.decode(req.prompt), list(req.prompt)
        if not tokens:
            raise RequestError("the prompt is empty")
        if len(tokens) >= self.ctx:
            raise ContextOverflow(len(tokens), self.ctx)
        if len(lane.session.tokens) < lane.on_disk:  # someone reset or replaced the session behind our back
            lane.on_disk = 0
        canonical = tokens
        tokens, cached = self._reuse(lane, text, tokens, exact=not isinstance(req.prompt, str))
        if len(tokens) >= self.ctx:
            self._replace_session(lane)
            tokens, cached = canonical, 0
            self.reuse = Reuse("none", 0, self.reuse.miss)
        cold_target = None
        if self.kv_store is not None and cached == 0:
            cold_target = self.kv_store.options.cold_target(tokens, self.tokenizer.user_id,
                                                            self.tokenizer.assistant_id)
        return tokens, cached, cold_target

    def _speculates(self, sampling: SamplingParams) -> bool:
        """Speculative decoding runs where ds4 runs it, greedy decoding (temperature 0) with --mtp-draft >= 2, and
        with the MTP block only without OpenAI penalties, which would change the greedy choice after every token.
        With a DSpark drafter it runs whatever the sampling: its drafts are fed and kept as long as the stream's
        own choices (sampled, penalised, masked) take them, target-only matching (dspark.md §3.4, option A), so the
        tokens are plain decoding's, seed for seed."""
        return self.session.mtp is not None and (_plain_greedy(sampling) or isinstance(self.session.mtp, DSpark))

    def _pipelines(self, sampling: SamplingParams) -> bool:
        """Decoding feeds each token before the host reads it back (`Session.feed_chosen`: the host builds a step
        while the device runs the one before) where the device alone makes the choice: greedy decoding without
        penalties, and no MTP block (speculative decoding feeds ahead its own way)."""
        return self.session.mtp is None and _plain_greedy(sampling)

    def _at_continued_frontier(self, lane: Lane) -> bool:
        return self.kv_store.options.is_continued_frontier(len(lane.session.tokens), lane.on_disk)

    def _draft_room(self, lane: Lane, n_generated: int, limit: int) -> int:
        """How many guesses a speculative step may feed after the chosen token: at most mtp_draft - 1, never a
        token plain decoding would not feed (the last of `limit` is not fed), and never past a continued disk
        checkpoint position, so that the step ends on it and the checkpoint is taken there as in plain decoding."""
        room = min(self.mtp_draft - 1, limit - n_generated - 1)
        if self.kv_store is not None:
            n = len(lane.session.tokens)
            frontiers = self.kv_store.options.frontiers_between(n, n + 1 + room)
            if frontiers:
                room = min(room, frontiers[0] - n - 1)
        return room


def _plain_greedy(sampling: SamplingParams) -> bool:
    """Greedy decoding with no penalty: each token is the argmax of the model's logits alone."""
    return sampling.greedy and sampling.presence_penalty == 0 and sampling.frequency_penalty == 0


def _take_ahead(ahead: list[tuple[int, mx.array]], token: int) -> mx.array:
    """The logits after `token`, which a speculative step already fed (the stream chose it there)."""
    fed, logits = ahead.pop(0)
    if fed != token:
        raise RuntimeError(f"speculative decoding fed token {fed} where the stream chose {token}")
    return logits
