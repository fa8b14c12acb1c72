"""`ds4-mlx bench`: prefill and decode speed of a model on this machine, and the memory it takes.

Prefill feeds `--prompt-tokens` random token ids into an empty session through the engine's chunked prefill.
Decode then generates `--gen-tokens` tokens greedily, reading back the argmax each step as a temperature-0 request
does. One warm-up run (the same prefill and a few decode steps) comes first and is not counted: it pays for
first-use allocation and kernel compilation. The speeds are the medians of `--repeats` timed runs. Peak memory is
MLX's high-water mark from just after loading to the end, so it includes the weights; active memory is what MLX
holds after the warm-up (weights in their resident form plus the session state).

`bench/synthetic_flash.py` runs the same measurement on the full published layout built in memory.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

from ..errors import Ds4Error
from .options import add_model_options, open_engine

if TYPE_CHECKING:
    from ..model.model import Model
    from ..session import Session

WARMUP_DECODE_STEPS = 2
GIB = 1024**3


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_options(p)
    add_bench_options(p)


def add_bench_options(p: argparse.ArgumentParser) -> None:
    """The measurement flags, shared with bench/synthetic_flash.py."""
    p.add_argument("--prompt-tokens", type=int, default=512, help="tokens to prefill (default 512)")
    p.add_argument("--gen-tokens", type=int, default=64, help="tokens to decode (default 64)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs; the median is reported (default 3)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompt (default 0)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")


@dataclass(frozen=True)
class BenchResult:
    """One benchmark: what ran where, and the measured figures (speeds are medians over the repeats)."""

    model: str
    backend: str
    ctx: int
    prompt_tokens: int
    gen_tokens: int
    repeats: int
    load_seconds: float
    prefill_tokens_per_second: float
    decode_tokens_per_second: float
    active_memory_gib: float
    peak_memory_gib: float


def check_sizes(prompt_tokens: int, gen_tokens: int, repeats: int, ctx: int) -> None:
    """Rejects sizes that cannot be measured, before anything is loaded."""
    if prompt_tokens < 1:
        raise Ds4Error(f"--prompt-tokens must be >= 1, got {prompt_tokens}")
    if gen_tokens < 1:
        raise Ds4Error(f"--gen-tokens must be >= 1, got {gen_tokens}")
    if repeats < 1:
        raise Ds4Error(f"--repeats must be >= 1, got {repeats}")
    if prompt_tokens + gen_tokens > ctx:
        raise Ds4Error(
            f"--prompt-tokens {prompt_tokens} + --gen-tokens {gen_tokens} do not fit in --ctx {ctx}; "
            f"use --ctx {prompt_tokens + gen_tokens} or more"
        )


def bench_session(
    session: Session,
    *,
    label: str,
    prompt_tokens: int,
    gen_tokens: int,
    repeats: int,
    seed: int = 0,
    load_seconds: float = 0.0,
    on_run: Callable[[str], None] | None = None,
) -> BenchResult:
    """Measures the session's model (emptying the session first); `on_run` is told about each run as it starts."""
    import mlx.core as mx
    import numpy as np

    check_sizes(prompt_tokens, gen_tokens, repeats, session.ctx)
    prompt = np.random.default_rng(seed).integers(0, session.model.config.n_vocab, size=prompt_tokens).tolist()
    session.reset()
    mx.reset_peak_memory()
    if on_run:
        on_run("warm-up")
    _prefill_and_decode(session, prompt, WARMUP_DECODE_STEPS)
    active = mx.get_active_memory()
    prefill, decode = [], []
    for i in range(repeats):
        if on_run:
            on_run(f"run {i + 1}/{repeats}")
        p, d = _prefill_and_decode(session, prompt, gen_tokens)
        prefill.append(prompt_tokens / p)
        decode.append(gen_tokens / d)
    return BenchResult(
        model=label,
        backend=mx.default_device().type.name,
        ctx=session.ctx,
        prompt_tokens=prompt_tokens,
        gen_tokens=gen_tokens,
        repeats=repeats,
        load_seconds=load_seconds,
        prefill_tokens_per_second=statistics.median(prefill),
        decode_tokens_per_second=statistics.median(decode),
        active_memory_gib=active / GIB,
        peak_memory_gib=mx.get_peak_memory() / GIB,
    )


def _prefill_and_decode(session: Session, prompt: list[int], steps: int) -> tuple[float, float]:
    """Seconds to prefill `prompt` into an emptied session, and to then decode `steps` greedy tokens."""
    import mlx.core as mx

    session.reset()
    t0 = time.perf_counter()
    logits = session.prefill(prompt)
    token = int(mx.argmax(logits).item())
    t1 = time.perf_counter()
    for _ in range(steps):
        token = int(mx.argmax(session.decode(token)).item())
    return t1 - t0, time.perf_counter() - t1


def describe(model: Model) -> str:
    c = model.config
    return f"{c.n_layer} layers, n_embd {c.n_embd}, {c.n_expert} experts, vocab {c.n_vocab}"


def print_result(result: BenchResult, as_json: bool) -> None:
    """One JSON object on stdout, or a table."""
    if as_json:
        print(json.dumps(asdict(result)))
        return
    table = Table(show_header=False)
    table.add_column(style="bold")
    table.add_column(justify="right")
    rows = [
        ("backend", result.backend),
        ("context", f"{result.ctx} tokens"),
        ("load", f"{result.load_seconds:.1f} s"),
        (f"prefill ({result.prompt_tokens} tokens)", f"{result.prefill_tokens_per_second:.1f} tokens/s"),
        (f"decode ({result.gen_tokens} tokens)", f"{result.decode_tokens_per_second:.2f} tokens/s"),
        ("active memory after warm-up", f"{result.active_memory_gib:.2f} GiB"),
        ("peak memory", f"{result.peak_memory_gib:.2f} GiB"),
        ("runs", f"median of {result.repeats}, after a warm-up"),
    ]
    for name, value in rows:
        table.add_row(name, value)
    console = Console(highlight=False, markup=False)
    console.print(f"ds4-mlx bench: {result.model}", soft_wrap=True)
    console.print(table)


def run(args: argparse.Namespace) -> int:
    check_sizes(args.prompt_tokens, args.gen_tokens, args.repeats, args.ctx)
    t0 = time.perf_counter()
    engine = open_engine(args)
    load_seconds = time.perf_counter() - t0
    label = "demo" if args.demo else args.model.name
    err = Console(stderr=True)
    result = bench_session(
        engine.session,
        label=f"{label} ({describe(engine.model)})",
        prompt_tokens=args.prompt_tokens,
        gen_tokens=args.gen_tokens,
        repeats=args.repeats,
        seed=args.seed,
        load_seconds=load_seconds,
        on_run=None if args.quiet or not sys.stderr.isatty() else lambda what: err.print(f"ds4-mlx bench: {what}"),
    )
    print_result(result, args.json)
    return 0
