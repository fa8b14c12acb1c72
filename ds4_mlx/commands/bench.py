"""`ds4-mlx bench`: load time, and prefill and decode speed at growing context frontiers, measured as ds4-bench
measures them.

One fixed token sequence (`--prompt-file`, else a built-in text, repeated up to `--ctx-max` tokens) is prefilled
frontier by frontier: `--ctx-start`, then every `--step-incr` tokens (or times `--step-mul`) up to `--ctx-max`.
At each frontier the row gives the prefill speed of the interval since the previous frontier (incremental
prefill), then the speed of a greedy probe of `--gen-tokens` tokens (EOS never chosen, one argmax read back per
token, as a temperature-0 request does); the session is then restored to the frontier so that the walk continues
along the prompt. A warm-up (the first interval's chunk shape twice, one chunk of every other length the walk feeds,
then a few decode steps: kernel compilation, first-use checks) comes first; it is not counted and its seconds are
reported. The walk runs `--repeats` times; each figure is the median with the min and max beside it. Peak memory
is MLX's high-water mark during the frontier's interval and probe, weights included.

`--synthetic q2|q4|mxfp4` measures the full published layout built in memory (model/synthetic.py) instead of a file.

`--mtp FILE --mtp-draft N` also measures what speculative greedy decoding costs at each frontier (the draft block
then follows the stream through every prefill, as the engine runs it): one plain decode step (the compiled step),
one verify call over 1 token and over N tokens (one main-model call with logits for every position, the check
`Session.speculate` makes of a token and its N - 1 guesses), one MTP draft of N - 1 guesses, each the median of a
few calls after a warm-up, each from the frontier; then a speculative greedy probe of `--gen-tokens` tokens through
`Session.speculate` as the engine runs it, with the share of MTP guesses the model accepted. The plain probe runs
without the draft block, as a session loaded without --mtp does. With a DSpark support file as --mtp the draft is
one drafter block of min(5, N - 1) drafts after the token, and the verify call the multi-row step over the token
and those drafts, as `Session.speculate` runs them.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

from ..errors import Ds4Error, UsageError
from .bench_parallel import PARALLEL_COLUMNS, ParallelFigures
from .bench_parallel import measure as measure_parallel
from .options import (add_model_options, add_mtp_options, model_file, non_negative_int, open_engine,
                      positive_int, quiet_other_ranks, select_backend)

if TYPE_CHECKING:
    import mlx.core as mx

    from ..model.model import Model
    from ..session import Session
    from ..tokenizer import Tokenizer

GIB = 1024**3
WARMUP_DECODE_STEPS = 2
CSV_COLUMNS = ("ctx_tokens", "prefill_tokens", "prefill_tps", "gen_tokens", "gen_tps", "kvcache_bytes",
               "peak_memory_bytes", "prefill_tps_min", "prefill_tps_max", "gen_tps_min", "gen_tps_max")
"""ds4-bench's columns first, so one plot script reads both engines' files; then ours."""
MTP_COLUMNS = ("decode_step_ms", "verify_1_ms", "verify_n_ms", "verify_tokens", "draft_ms", "draft_tokens",
               "spec_tps", "spec_tps_min", "spec_tps_max", "mtp_acceptance")
"""With --mtp, after CSV_COLUMNS: call times (medians, ms), the speculative probe's t/s and acceptance."""
MTP_CALLS = 5
"""Timed calls per figure and frontier with --mtp, after one warm-up call."""

BUILTIN_TEXT = """\
The river came down from the hills in three long bends before it reached the town, and in each bend the water
changed its voice. In the first it was quick and narrow, talking over stones that the spring floods had rolled
down from the quarries; in the second it widened and slowed between meadows where the millers kept their geese;
in the third it grew deep and almost silent under the old stone bridge, and the children who leaned over the
parapet to drop sticks into it said that it was thinking. The town had grown up around that silence. Its market
square opened towards the bridge, its church faced the water, and its oldest houses leaned over the current as
if to listen. Travellers who came for a night often stayed a week, and could not say why.

Every morning the ferryman's daughter counted the boats tied along the quay and wrote the number in a ledger
that her grandfather had started sixty years before. Nobody asked her to do it, and nobody read the ledger, but
she kept it all the same, because a town that forgets how many boats it has will one day forget how many bridges
it needs, and after that it will forget the river. On the first page, in a hand that sloped like rain, her
grandfather had written the rule he kept: write what you see, not what you expect to see, and write it the
same way every day, so that the changes show. She had added a second rule beneath it in her own upright
letters: when the numbers surprise you, go and look again before you believe them.
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_options(p, default_ctx=None)
    g = p.add_argument_group("what to measure")
    g.add_argument("--synthetic", choices=("q2", "q4", "mxfp4"),  # model/synthetic.py's SYNTHETIC_KINDS
                   help="the full published layout with q2, q4 or MXFP4 experts, built in memory (no file, no -m)")
    g.add_argument("--layers", type=int, metavar="N", help="with --synthetic: build only the first N layers (default all 43)")
    g.add_argument("--ctx-start", type=positive_int, default=2048, metavar="N",
                   help="first frontier, tokens (default 2048)")
    g.add_argument("--ctx-max", type=positive_int, default=32768, metavar="N",
                   help="last frontier, tokens (default 32768)")
    step = g.add_mutually_exclusive_group()
    step.add_argument("--step-incr", type=positive_int, metavar="N", help="frontiers every N tokens (default 2048)")
    step.add_argument("--step-mul", type=float, metavar="F", help="each frontier F times the previous one")
    g.add_argument("--gen-tokens", type=non_negative_int, default=128, metavar="N",
                   help="greedy tokens decoded at each frontier; 0 = prefill only (default 128)")
    g.add_argument("--parallel", type=positive_int, default=1, metavar="N",
                   help="also decode N sessions at once at each frontier, their tokens in one step over the weights, "
                        "and report the aggregate and per-stream t/s (default 1: the single stream alone)")
    g.add_argument("--prompt-file", type=Path, metavar="FILE",
                   help="text whose tokens are prefilled, repeated as needed (default: a built-in text)")
    g.add_argument("--repeats", type=positive_int, default=1, metavar="N",
                   help="walks to run; figures are the median, with min and max (default 1)")
    g.add_argument("--prefill-chunk", type=positive_int, metavar="N",
                   help="tokens per prefill chunk, to choose a GPU's chunk size by measurement (default the "
                        "session's: 12288 on CUDA, 8192 there for a context past 65536, ds4's 2048 elsewhere, or the "
                        "whole context when smaller; shortened where device memory is short, see --memory-limit)")
    g.add_argument("--read-back", action="store_true",
                   help="decode as sampled decoding does, reading each token back before the next step is built "
                        "(default: as greedy decoding does, each token chosen and fed on the device before it is "
                        "read, so the host builds a step while the device runs the one before)")
    g.add_argument("--ops", action="store_true",
                   help="also count the primitives in one decode step's graph at the first frontier, in total, "
                        "per layer and by name (an mx.compile'd function counts as one node)")
    g.add_argument("--ops-for", choices=("cuda", "metal"), metavar="BACKEND",
                   help="only count one decode step's primitives, as the cuda or metal backend "
                        "builds the step (every fast path taken, each custom kernel one node), on any machine: "
                        "no timings, and the model computes nothing meaningful")
    add_mtp_options(p)
    out = p.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print the result as one JSON object")
    out.add_argument("--csv", type=Path, metavar="FILE", help=f"write one row per frontier: {','.join(CSV_COLUMNS)}")
    out.add_argument("--plot", type=Path, metavar="FILE",
                     help="write a PNG of tokens/s against context (needs matplotlib: pip install 'ds4-mlx[plot]')")


@dataclass(frozen=True)
class Walk:
    """The frontiers to visit and what to measure at each."""

    frontiers: tuple[int, ...]
    gen_tokens: int
    repeats: int
    mtp_draft: int = 0
    """--mtp-draft N with --mtp: tokens per verify call; 0 = no MTP figures."""
    mtp_margin: float = 0.0
    prefill_chunk: int | None = None
    """--prefill-chunk: the session's chunk size for the walk; None keeps the session's own."""
    read_back: bool = False
    """--read-back: each decode token read back before the next step is built."""
    parallel: int = 1
    """--parallel N: also N sessions decoding together at each frontier (bench_parallel.py)."""

    @property
    def ctx(self) -> int:
        """The context the walk needs: the last frontier plus its probe (or its N-token verify call)."""
        return self.frontiers[-1] + max(self.gen_tokens, self.mtp_draft)


def plan(args: argparse.Namespace) -> Walk:
    """Checks the measurement flags and lists the frontiers, before anything is loaded; a flag value the walk cannot
    take is a usage error (exit 2), as argparse's own are."""
    if args.ctx_max < args.ctx_start:
        raise UsageError(f"--ctx-max {args.ctx_max} is below --ctx-start {args.ctx_start}")
    if args.step_mul is not None and not args.step_mul > 1:
        raise UsageError(f"--step-mul must be > 1, got {args.step_mul}")
    if args.layers is not None and args.synthetic is None:
        raise UsageError("--layers needs --synthetic")
    if args.synthetic is not None and args.demo:
        raise UsageError("--synthetic and --demo both choose the model; give one")
    _check_mtp(args)
    frontiers = [args.ctx_start]
    while True:
        last = frontiers[-1]
        following = max(last + 1, int(last * args.step_mul)) if args.step_mul else last + (args.step_incr or 2048)
        if following > args.ctx_max:
            break
        frontiers.append(following)
    mtp_draft = args.mtp_draft if args.mtp is not None else 0
    walk = Walk(tuple(frontiers), args.gen_tokens, args.repeats, mtp_draft, args.mtp_margin, args.prefill_chunk,
                args.read_back, args.parallel)
    if args.ctx is not None and args.ctx < walk.ctx:
        probe = f"--gen-tokens {args.gen_tokens}" if args.gen_tokens >= mtp_draft else f"--mtp-draft {mtp_draft}"
        raise UsageError(f"--ctx {args.ctx} is too small for the walk: the last frontier {frontiers[-1]} + "
                         f"{probe} need {walk.ctx}")
    return walk


def _check_mtp(args: argparse.Namespace) -> None:
    """--mtp and --mtp-draft go together (N >= 2: a verify call over N tokens), on a model file."""
    if args.mtp is None:
        if args.mtp_draft > 1:
            raise UsageError(f"--mtp-draft {args.mtp_draft} needs an MTP draft file: --mtp FILE")
        return
    if args.synthetic is not None:
        raise UsageError("--mtp needs a model file: --synthetic has no MTP draft file (make-model --preset flash "
                         "--mtp FILE writes a matching pair; see bench/README.md)")
    if args.ops_for is not None:
        raise UsageError("--ops-for counts the plain decode step only: --mtp is unused there")
    if args.mtp_draft < 2:
        raise UsageError("--mtp needs --mtp-draft N (N >= 2): bench measures verify calls over N tokens")


@dataclass
class MTPFigures:
    """One frontier's --mtp figures: seconds of every timed call of every run, and the speculative probes."""

    draft: int
    """The tokens of a verify call: the token and its guesses (--mtp-draft N: N - 1 guesses; DSpark: at most its
    block of 5)."""
    drafter: str = "MTP"
    """Which drafter the --mtp file holds: "MTP" (MTP-1) or "DSpark" (the tables' labels)."""
    step_s: list[float] = field(default_factory=list)
    verify_1_s: list[float] = field(default_factory=list)
    verify_n_s: list[float] = field(default_factory=list)
    draft_s: list[float] = field(default_factory=list)
    spec_tps: list[float] = field(default_factory=list)
    drafted: int = 0
    accepted: int = 0

    @property
    def acceptance(self) -> float:
        """The share of MTP guesses the model agreed with (Speculation's counts); 0 when none was checked."""
        return self.accepted / self.drafted if self.drafted else 0.0

    def row(self) -> dict:
        def ms(seconds: list[float]) -> float:
            return round(statistics.median(seconds) * 1e3, 4)

        return {
            "decode_step_ms": ms(self.step_s),
            "verify_1_ms": ms(self.verify_1_s),
            "verify_n_ms": ms(self.verify_n_s),
            "verify_tokens": self.draft,
            "draft_ms": ms(self.draft_s),
            "draft_tokens": self.draft - 1,
            "spec_tps": round(statistics.median(self.spec_tps), 3),
            "spec_tps_min": round(min(self.spec_tps), 3),
            "spec_tps_max": round(max(self.spec_tps), 3),
            "mtp_acceptance": round(self.acceptance, 4),
        }


@dataclass
class FrontierResult:
    """One frontier's figures, one entry per run."""

    ctx_tokens: int
    prefill_tokens: int
    gen_tokens: int
    kvcache_bytes: int
    prefill_tps: list[float] = field(default_factory=list)
    gen_tps: list[float] = field(default_factory=list)
    peak_memory_bytes: int = 0
    mtp: MTPFigures | None = None
    parallel: ParallelFigures | None = None

    def row(self) -> dict:
        """The CSV / JSON row: medians under ds4-bench's names, then min and max, then the --mtp and --parallel
        figures."""
        mtp = self.mtp.row() if self.mtp is not None else {}
        mtp |= self.parallel.row() if self.parallel is not None else {}
        return {
            "ctx_tokens": self.ctx_tokens,
            "prefill_tokens": self.prefill_tokens,
            "prefill_tps": round(statistics.median(self.prefill_tps), 3),
            "gen_tokens": self.gen_tokens,
            "gen_tps": round(statistics.median(self.gen_tps), 3),
            "kvcache_bytes": self.kvcache_bytes,
            "peak_memory_bytes": self.peak_memory_bytes,
            "prefill_tps_min": round(min(self.prefill_tps), 3),
            "prefill_tps_max": round(max(self.prefill_tps), 3),
            "gen_tps_min": round(min(self.gen_tps), 3),
            "gen_tps_max": round(max(self.gen_tps), 3),
        } | mtp


@dataclass
class Loaded:
    """A model ready to measure, and how its loading went."""

    label: str
    session: Session
    tokenizer: Tokenizer
    seconds: float
    file_bytes: int
    host: dict
    warmup_seconds: float = 0.0
    """The walk's warm-up: kernel compilation and first-use checks, paid once per process (not in the figures)."""
    phases: dict[str, float] = field(default_factory=dict)
    """Seconds of each part of a file's load (Engine.load_phases); empty for --synthetic."""
    others: list[Session] = field(default_factory=list)
    """With --parallel N, the N - 1 sessions that decode beside `session`."""


def read_prompt(path: Path | None) -> str:
    """The --prompt-file's text (read before loading, so that a bad path fails at once), or the built-in one."""
    if path is None:
        return BUILTIN_TEXT
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise Ds4Error(f"cannot read --prompt-file {path}: {getattr(e, 'strerror', None) or e}") from e
    if not text.strip():
        raise Ds4Error(f"--prompt-file {path} holds no text")
    return text


def prompt_ids(tokenizer: Tokenizer, text: str, n: int) -> list[int]:
    """The text's first n tokens, the text repeated from its start as often as needed."""
    ids = tokenizer.encode(text, specials=False)
    return (ids * (n // len(ids) + 1))[:n]


def live_kv_bytes(model: Model, n_tokens: int) -> int:
    """Bytes of the KV rows a session holds at n_tokens (float32): the raw sliding window, the compressed rows and,
    on ratio-4 layers, the indexer rows. What ds4-bench's kvcache_bytes counts, the fixed capacity left out."""
    c = model.config
    values = 0
    for layer in range(c.n_layer):
        values += min(n_tokens, c.sliding_window) * c.head_dim
        ratio = c.compress_ratio(layer)
        if ratio:
            values += n_tokens // ratio * c.head_dim
        if ratio == 4:
            values += n_tokens // ratio * c.indexer_head_dim
    return 4 * values


def run_walk(loaded: Loaded, walk: Walk, prompt: list[int], *, ops: bool = False,
             say: Callable[[str], None] = lambda line: None,
             prefill_bar: Callable[[int, int], None] | None = None) -> tuple[list[FrontierResult], dict | None]:
    """Runs the warm-up and `walk.repeats` walks; returns one result per frontier and, with `ops`, the decode
    step's primitive counts at the first frontier."""
    import mlx.core as mx

    from ..sampling import device_argmax

    session = loaded.session
    model = session.model

    def greedy(logits: mx.array) -> int:
        return int(device_argmax(logits, never=loaded.tokenizer.eos_id).item())

    if walk.prefill_chunk is not None:
        session.chunk_size = walk.prefill_chunk
    loaded.warmup_seconds = warm_up(session, prompt, walk.frontiers, greedy)
    say(f"warm-up (compilation, first-use checks) {loaded.warmup_seconds:.1f} s")
    if walk.mtp_draft and session.mtp is None:
        raise ValueError("the walk measures MTP figures but the session has no MTP draft block")
    results = []
    previous = 0
    for frontier in walk.frontiers:
        results.append(FrontierResult(frontier, frontier - previous, walk.gen_tokens, live_kv_bytes(model, frontier),
                                      mtp=MTPFigures(walk.mtp_draft, drafter_name(session)) if walk.mtp_draft else None,
                                      parallel=ParallelFigures(walk.parallel) if walk.parallel > 1 else None))
        previous = frontier
    counts = None
    for run in range(walk.repeats):
        session.reset()
        for result in results:
            mx.reset_peak_memory()
            start = result.ctx_tokens - result.prefill_tokens
            t0 = time.perf_counter()
            session.prefill(prompt[start:result.ctx_tokens], progress=prefill_bar)
            mx.eval(session.logits)
            prefill_s = time.perf_counter() - t0
            if ops and counts is None:
                from ..model.graph import decode_step_ops

                counts = decode_step_ops(model, session.cache, greedy(session.logits))
            at_frontier = session.snapshot()
            with without_mtp(session):
                t1 = time.perf_counter()  # the decode graphs, where used, are made or entered here: no token's time
                if session.prepare_greedy(never=loaded.tokenizer.eos_id):
                    say(f"decode graphs ready in {time.perf_counter() - t1:.2f} s "
                        "(DS4_GRAPH_DECODE=off decodes through MLX's step)")
                t1 = time.perf_counter()
                for _ in range(walk.gen_tokens):  # as the engine decodes
                    if walk.read_back:
                        session.decode(greedy(session.logits))
                    else:
                        session.confirm(int(session.feed_chosen(never=loaded.tokenizer.eos_id).item()))
                mx.eval(session.logits)
                gen_s = time.perf_counter() - t1
            session.restore(at_frontier)
            result.prefill_tps.append(result.prefill_tokens / prefill_s)
            result.gen_tps.append(walk.gen_tokens / gen_s if walk.gen_tokens else 0.0)
            line = (f"run {run + 1}/{walk.repeats}, ctx {result.ctx_tokens}: prefill {result.prefill_tokens} tokens "
                    f"at {result.prefill_tps[-1]:.1f} t/s, decode {walk.gen_tokens} tokens at "
                    f"{result.gen_tps[-1]:.2f} t/s")
            if result.parallel is not None and walk.gen_tokens:
                sessions = [session, *loaded.others]
                firsts = [prompt[(i * 97) % len(prompt)] for i in range(len(sessions))]  # a different token each
                with without_mtp(session):
                    seconds = measure_parallel(sessions, at_frontier, firsts, walk.gen_tokens, loaded.tokenizer.eos_id)
                result.parallel.aggregate_tps.append(walk.parallel * walk.gen_tokens / seconds)
                line += (f", {walk.parallel} streams at {result.parallel.aggregate_tps[-1]:.2f} t/s in all "
                         f"({result.parallel.aggregate_tps[-1] / walk.parallel:.2f} each)")
            if result.mtp is not None:
                drafted, accepted = measure_mtp(session, result.mtp, walk, greedy, loaded.tokenizer.eos_id)
                line += (f", speculative {result.mtp.spec_tps[-1]:.2f} t/s ({result.mtp.drafter} guesses accepted "
                         f"{accepted}/{drafted})")
            result.peak_memory_bytes = max(result.peak_memory_bytes, mx.get_peak_memory())
            say(line)
    return results, counts


def chunk_lengths(frontiers: list[int], chunk: int) -> list[int]:
    """The distinct lengths of the chunks the walk's prefills feed, in walk order: each interval from the previous
    frontier is fed in chunks of `chunk` tokens and its remainder."""
    lengths: list[int] = []
    previous = 0
    for frontier in frontiers:
        size = frontier - previous
        for n in [chunk] * min(1, size // chunk) + ([size % chunk] if size % chunk else []):
            if n not in lengths:
                lengths.append(n)
        previous = frontier
    return lengths


def warm_up(session: Session, prompt: list[int], frontiers: list[int], greedy: Callable[[mx.array], int]) -> float:
    """Seconds of a throwaway run of the first interval's chunk shape, twice (the second chunk meets the rows the
    first left: compressed rows, indexer candidates), one chunk of every other length the walk will feed, then a few
    decode steps. The kernels compile for every shape and pass their first-use checks here, so that the timed walk
    measures the steady state, as ds4-bench does."""
    t0 = time.perf_counter()
    session.reset()
    n = max(1, min(frontiers[0], session.chunk_size, len(prompt), session.ctx - WARMUP_DECODE_STEPS))
    session.prefill(prompt[:n])
    again = min(n, len(prompt) - n, session.ctx - n - WARMUP_DECODE_STEPS)
    if again > 0:
        session.prefill(prompt[n:n + again])
    for length in chunk_lengths(frontiers, session.chunk_size):
        done = len(session.tokens)
        if length not in (n, again) and length <= min(len(prompt) - done, session.room - WARMUP_DECODE_STEPS):
            session.prefill(prompt[done:done + length])
    token = greedy(session.logits)
    for _ in range(min(WARMUP_DECODE_STEPS, session.room)):
        token = greedy(session.decode(token))
    return time.perf_counter() - t0


@contextmanager
def without_mtp(session: Session) -> Iterator[None]:
    """The session decodes as one loaded without --mtp: the draft block does not run, its state is left as it was
    (the frontier's snapshot, restored after, holds it anyway)."""
    mtp, session.mtp = session.mtp, None
    try:
        yield
    finally:
        session.mtp = mtp


def verify_call(session: Session, block: list[int]) -> mx.array:
    """One main-model call over `block` with logits for every position, evaluated: the multi-row step
    `Session.speculate` checks a token and its guesses with (Model.decode_rows; the cache is left as it was)."""
    import mlx.core as mx

    _, logits, rows = session.model.decode_rows(block, [session.cache], groups=[len(block)])
    mx.eval(logits, *rows[-1][-1].arrays())
    return logits


def timed_calls(call: Callable[[], object], restore: Callable[[], None], n: int) -> list[float]:
    """Seconds of n calls after one warm-up call, the state restored after each."""
    times = []
    for i in range(n + 1):
        t0 = time.perf_counter()
        call()
        if i:
            times.append(time.perf_counter() - t0)
        restore()
    return times


def speculative_probe(session: Session, token: int, n_tokens: int, draft: int, margin: float,
                      greedy: Callable[[mx.array], int], eos: int) -> tuple[float, int, int]:
    """Feeds `token` and the greedy tokens after it, n_tokens in all, through `Session.speculate` as the engine's
    greedy decoding does (up to draft - 1 guesses a step, never a token past the n_tokens plain decoding feeds, one
    greedy choice read back per token). Returns the seconds, and the guesses drafted and accepted."""
    fed = drafted = accepted = 0
    t0 = time.perf_counter()
    while fed < n_tokens:
        step = session.speculate(token, min(draft - 1, n_tokens - fed - 1), margin, stop=(eos,))
        fed += len(step.tokens)
        drafted, accepted = drafted + step.drafted, accepted + step.accepted
        for row in step.logits:
            token = greedy(row)
    return time.perf_counter() - t0, drafted, accepted


def measure_mtp(session: Session, figures: MTPFigures, walk: Walk, greedy: Callable[[mx.array], int],
                eos: int) -> tuple[int, int]:
    """At a frontier: one plain decode step, verify calls over 1 and N tokens, an MTP draft of N - 1 guesses (each
    timed from the frontier), then the speculative probe; the session is left at the frontier. Returns the probe's
    guesses drafted and accepted."""
    at_frontier = session.snapshot()
    token = greedy(session.logits)

    def restore() -> None:
        session.restore(at_frontier)

    from ..model.dspark import DSpark

    with without_mtp(session):
        figures.step_s += timed_calls(lambda: session.decode(token), restore, MTP_CALLS)
    if isinstance(session.mtp, DSpark):  # one drafter block after the token
        def draft() -> list[int]:
            return session.mtp.draft(token, session.mtp_cache).tokens[: walk.mtp_draft - 1]
    else:  # the guesses speculate would verify
        def draft() -> list[int]:
            return session._draft(token, walk.mtp_draft - 1, stop=())[0]
    drafts = draft()
    figures.draft = len(drafts) + 1
    figures.draft_s += timed_calls(draft, restore, MTP_CALLS)
    figures.verify_1_s += timed_calls(lambda: verify_call(session, [token]), restore, MTP_CALLS)
    figures.verify_n_s += timed_calls(lambda: verify_call(session, [token, *drafts]), restore, MTP_CALLS)
    seconds, drafted, accepted = speculative_probe(session, token, walk.gen_tokens, walk.mtp_draft,
                                                   walk.mtp_margin, greedy, eos)
    restore()
    figures.spec_tps.append(walk.gen_tokens / seconds if walk.gen_tokens else 0.0)
    figures.drafted, figures.accepted = figures.drafted + drafted, figures.accepted + accepted
    return drafted, accepted


def load(args: argparse.Namespace, walk: Walk) -> Loaded:
    """The file (or the demo, or the synthetic layout) loaded for a session of the walk's context, with the time
    it took and the host memory it used."""
    from .. import hostmem

    hostmem.reset_peak()
    available_before = hostmem.available()
    with hostmem.Sampler() as sampler:
        t0 = time.perf_counter()
        phases = {}
        if args.synthetic is not None:
            label, sessions, tokenizer, file_bytes = _synthetic(args, walk.ctx, walk.parallel)
        else:
            args.ctx = walk.ctx
            # its --mtp figures are measured everywhere
            engine = open_engine(args, speculate_anyway=True, parallel=walk.parallel)
            label = "demo" if args.demo else model_file(args).name
            sessions = [lane.session for lane in engine.lanes]
            tokenizer, file_bytes = engine.tokenizer, engine.model.load_stats.file_bytes
            phases = engine.load_phases
        seconds = time.perf_counter() - t0
    peaks = sampler.peaks
    host = {"peak_rss_bytes": hostmem.peak_rss(), "peak_anon_bytes_sampled": peaks.anon,
            "available_before_bytes": available_before, "min_available_bytes": peaks.min_available,
            "after_load": hostmem.status()}
    session, *others = sessions
    return Loaded(f"{label} ({describe(session.model)})", session, tokenizer, seconds, file_bytes, host,
                  phases=phases, others=others)


def _synthetic(args: argparse.Namespace, ctx: int, parallel: int) -> tuple[str, list[Session], Tokenizer, int]:
    from .. import memory
    from ..memory import check_memory
    from ..model.factory import build_vocab
    from ..model.linear import loaded_nbytes
    from ..model.model import Model
    from ..model.shard import init_split
    from ..model.synthetic import flash_config, synthetic_weights
    from ..progress import Progress
    from ..session import Session
    from ..tokenizer import Tokenizer

    select_backend(args)
    quiet_other_ranks(args)
    config = flash_config(args.layers if args.layers is not None else 43)
    weights = synthetic_weights(config, args.synthetic)
    split = init_split(args.split, args.split_weights, weights)
    check_memory(weights, loaded_nbytes(weights if split is None else split.weights(weights)), ctx,
                 memory.apply_limit(), parallel)
    vocab = build_vocab("real")
    with Progress(quiet=args.quiet).bar("building", unit="bytes") as bar:
        model = Model(weights, simulate_quant=not args.no_quant_sim, progress=bar.update, split=split)
    weights.close()
    label = f"synthetic flash, {args.synthetic} experts"
    sessions = [Session(model, ctx) for _ in range(parallel)]
    return label, sessions, Tokenizer(list(vocab.tokens), list(vocab.merges)), model.load_stats.file_bytes


def describe(model: Model) -> str:
    c = model.config
    split = getattr(model, "split", None)  # test doubles of Model have none
    across = "" if split is None else f", split by {split.kind} over {split.size} ranks"
    return f"{c.n_layer} layers, n_embd {c.n_embd}, {c.n_expert} experts, vocab {c.n_vocab}{across}"


def write_csv(path: Path, results: list[FrontierResult]) -> None:
    try:
        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS + (MTP_COLUMNS if results[0].mtp else ())
                                    + (PARALLEL_COLUMNS if results[0].parallel else ()))
            writer.writeheader()
            writer.writerows(r.row() for r in results)
    except OSError as e:
        raise Ds4Error(f"cannot write --csv {path}: {e.strerror or e}") from e


def write_plot(path: Path, results: list[FrontierResult], title: str) -> None:
    """Prefill and decode tokens/s against context, the min-max band shaded when there are repeats."""
    plt = _pyplot()
    rows = [r.row() for r in results]
    x = [r["ctx_tokens"] for r in rows]
    fig, axes = plt.subplots(2, 1, sharex=True, figsize=(7, 6))
    for ax, key, name in ((axes[0], "prefill_tps", "prefill"), (axes[1], "gen_tps", "decode")):
        ax.plot(x, [r[key] for r in rows], marker="o", label=f"{name} (median)")
        ax.fill_between(x, [r[f"{key}_min"] for r in rows], [r[f"{key}_max"] for r in rows], alpha=0.25)
        ax.set_ylabel(f"{name} tokens/s")
        ax.grid(True, alpha=0.3)
    axes[1].set_xlabel("context (tokens)")
    fig.suptitle(title, fontsize=9)
    try:
        fig.savefig(path, dpi=120)
    except OSError as e:
        raise Ds4Error(f"cannot write --plot {path}: {e.strerror or e}") from e
    finally:
        plt.close(fig)


def _pyplot():
    """matplotlib's pyplot on a file-only backend; checked before loading when --plot is given."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise Ds4Error("--plot needs matplotlib, which is not installed: pip install 'ds4-mlx[plot]'") from None
    return plt


def report(loaded: Loaded, walk: Walk, results: list[FrontierResult], counts: dict | None, as_json: bool) -> None:
    """One JSON object on stdout, or a summary and a table."""
    import mlx.core as mx

    gbps = loaded.file_bytes / loaded.seconds / 1e9 if loaded.seconds else 0.0
    summary = {
        "model": loaded.label,
        "backend": mx.default_device().type.name,
        "ctx": walk.ctx,
        "repeats": walk.repeats,
        "load_seconds": round(loaded.seconds, 3),
        "load_bytes": loaded.file_bytes,
        "load_gb_per_second": round(gbps, 3),
        "load_stats": _load_stats(loaded.session.model),
        "load_phases": loaded.phases,
        "warmup_seconds": round(loaded.warmup_seconds, 3),
        "prefill_chunk": loaded.session.chunk_size,
        "decode": "read back" if walk.read_back else "fed ahead",
        "weights_bytes": loaded.session.model.nbytes,
        "host": loaded.host,
        "frontiers": [r.row() for r in results],
    }
    if counts is not None:
        summary["decode_ops"] = counts
    if walk.mtp_draft:
        summary["mtp"] = {"drafter": drafter_name(loaded.session), "draft": walk.mtp_draft,
                          "margin": walk.mtp_margin, "calls": MTP_CALLS, "weights_bytes": loaded.session.mtp.nbytes}
    if as_json:
        print(json.dumps(summary))
        return
    console = Console(highlight=False, markup=False)
    console.print(f"ds4-mlx bench: {loaded.label}", soft_wrap=True)
    host = loaded.host
    console.print(f"backend {summary['backend']}, context {walk.ctx}; load {loaded.file_bytes / 1e9:.2f} GB in "
                  f"{loaded.seconds:.2f} s ({gbps:.2f} GB/s), weights {loaded.session.model.nbytes / GIB:.2f} GiB; "
                  f"host peak RSS {host['peak_rss_bytes'] / GIB:.2f} GiB (mapped file pages included), "
                  f"anonymous {host['peak_anon_bytes_sampled'] / GIB:.2f} GiB (sampled)" + _available(host),
                  soft_wrap=True)
    table = Table()
    streams = (f"{walk.parallel} streams t/s", "per stream t/s") if walk.parallel > 1 else ()
    for name in ("context", "prefill tokens", "prefill t/s", "decode t/s", *streams, "KV MiB", "peak GiB"):
        table.add_column(name, justify="right")
    for r in results:
        row = r.row()
        together = ((_spread(row, "parallel_tps", walk.repeats), f"{row['parallel_stream_tps']:.2f}")
                    if walk.parallel > 1 else ())
        table.add_row(str(r.ctx_tokens), str(r.prefill_tokens), _spread(row, "prefill_tps", walk.repeats),
                      _spread(row, "gen_tps", walk.repeats), *together, f"{r.kvcache_bytes / 2**20:.1f}",
                      f"{r.peak_memory_bytes / GIB:.2f}")
    console.print(table)
    console.print(f"{walk.gen_tokens} greedy tokens per probe; "
                  + (f"median (min-max) of {walk.repeats} walks" if walk.repeats > 1 else "one walk")
                  + ", after a warm-up")
    if walk.mtp_draft:
        console.print(mtp_table(results, walk))
        n, name = walk.mtp_draft, results[0].mtp.drafter
        guesses = f"{n - 1} guess" + ("es" if n > 2 else "")
        console.print(f"--mtp-draft {n}: ms of one compiled decode step, of one main-model call over 1 and over {n} "
                      f"tokens (logits for each), of one {name} draft of {guesses} (medians over {MTP_CALLS} calls a "
                      f"walk); {name} t/s: the probe through Session.speculate (margin {walk.mtp_margin:g}), and the "
                      f"share of {name} guesses the model accepted", soft_wrap=True)
    if counts is not None:
        console.print(ops_line(counts), soft_wrap=True)


def drafter_name(session: Session) -> str:
    """The drafter's name in the tables: "DSpark" or "MTP" (MTP-1)."""
    from ..model.dspark import DSpark

    return "DSpark" if isinstance(session.mtp, DSpark) else "MTP"


def mtp_table(results: list[FrontierResult], walk: Walk) -> Table:
    """The --mtp figures, one row per frontier."""
    n = walk.mtp_draft
    table = Table()
    for name in ("context", "step ms", "verify 1 ms", f"verify {n} ms", "draft ms", f"{results[0].mtp.drafter} t/s",
                 "accepted"):
        table.add_column(name, justify="right")
    for r in results:
        row = r.row()
        table.add_row(str(r.ctx_tokens), f"{row['decode_step_ms']:.2f}", f"{row['verify_1_ms']:.2f}",
                      f"{row['verify_n_ms']:.2f}", f"{row['draft_ms']:.2f}", _spread(row, "spec_tps", walk.repeats),
                      f"{row['mtp_acceptance']:.0%}")
    return table


def _available(host: dict) -> str:
    before, low = host["available_before_bytes"], host["min_available_bytes"]
    if before is None or low is None:
        return ""
    return f"; the machine's MemAvailable fell from {before / GIB:.1f} to {low / GIB:.1f} GiB while loading"


def _spread(row: dict, key: str, repeats: int) -> str:
    if repeats == 1:
        return f"{row[key]:.2f}"
    return f"{row[key]:.2f} ({row[key + '_min']:.2f}-{row[key + '_max']:.2f})"


def _load_stats(model: Model) -> dict:
    s = model.load_stats
    return {"seconds": round(s.seconds, 3), "gb_per_second": round(s.gb_per_second, 3),
            "copy_seconds": round(s.copy_seconds, 3), "wait_seconds": round(s.wait_seconds, 3),
            "device_seconds": round(s.device_seconds, 3), "evaluations": s.evaluations, "chunks": s.chunks,
            "prefetched": s.prefetched, "pinned_bytes": s.pinned_bytes}


def run_planned(args: argparse.Namespace, walk: Walk, text: str) -> int:
    """--ops-for: the decode step's counts as the GPU backend builds it (registry.planning), for a session of the
    walk's context. The step is one fixed-shape graph whatever the position, so the first token's is counted and
    nothing is prefilled (a chunk's GPU paths would make float scratch the CPU has no room for)."""
    from ..kernels.machinery.registry import planning
    from ..model.graph import decode_step_ops

    with planning(args.ops_for):
        loaded = load(args, walk)
        session = loaded.session
        counts = decode_step_ops(session.model, session.cache, prompt_ids(loaded.tokenizer, text, 1)[0])
    if args.json:
        print(json.dumps({"model": loaded.label, "planned_for": args.ops_for, "ctx": session.ctx,
                          "decode_ops": counts}))
    else:
        console = Console(highlight=False, markup=False)
        console.print(f"ds4-mlx bench: {loaded.label}, planned for {args.ops_for}, {session.ctx}-token session",
                      soft_wrap=True)
        console.print(ops_line(counts), soft_wrap=True)
    return 0


def ops_line(counts: dict) -> str:
    top = ", ".join(f"{name} {n}" for name, n in list(counts["by_primitive"].items())[:8])
    return (f"decode step graph: {counts['total']} primitives ({counts['kernels']} not views), per layer "
            f"{counts['per_layer']} ({counts['kernels_per_layer']} not views), outside layers "
            f"{counts['outside_layers']}; most used: {top}")


def run(args: argparse.Namespace) -> int:
    walk = plan(args)
    if args.ops_for is not None:
        return run_planned(args, walk, read_prompt(args.prompt_file))
    text = read_prompt(args.prompt_file)
    if args.plot is not None:
        _pyplot()
    err = Console(stderr=True, highlight=False, markup=False)

    def say(line: str) -> None:
        if not args.quiet:
            err.print(f"ds4-mlx bench: {line}", soft_wrap=True)

    loaded = load(args, walk)
    say(f"loaded {loaded.file_bytes / 1e9:.2f} GB in {loaded.seconds:.2f} s "
        f"({loaded.file_bytes / loaded.seconds / 1e9:.2f} GB/s)")
    prompt = prompt_ids(loaded.tokenizer, text, walk.frontiers[-1])
    from ..progress import Progress

    with Progress(quiet=args.quiet).bar("prefill") as bar:
        results, counts = run_walk(loaded, walk, prompt, ops=args.ops, say=say, prefill_bar=bar.update)
    if args.csv is not None:
        write_csv(args.csv, results)
    if args.plot is not None:
        write_plot(args.plot, results, loaded.label)
    report(loaded, walk, results, counts, args.json)
    return 0
