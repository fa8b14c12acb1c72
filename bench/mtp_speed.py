"""What speculative greedy decoding with the MTP draft block buys on this backend (`--mtp`, `--mtp-draft N`).

Speculation pays only if one model call over N tokens costs much less than N one-token calls. Random weights make
the real MTP block's guesses worthless (it guesses right about once per vocabulary size), so this measures:

1. `call`: the time of one model call over T = 1..N tokens on a live session (what verifying N - 1 guesses costs);
2. `plain`: plain greedy decoding;
3. `random`: speculative decoding with the random MTP block (the overhead when every guess fails: the block runs
   after every token, and its lone guesses are verified when --mtp-margin 0 lets them);
4. `oracle N`: speculative decoding with every guess right (the block still runs; its logits are replaced by the
   plain continuation): the best case, N tokens per model call.

Usage: python bench/mtp_speed.py [--preset small] [--backend gpu] [--draft 2 3 4] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from ds4_mlx.engine import Engine, GenerationRequest
from ds4_mlx.model.factory import PRESETS, write_model, write_mtp_model
from ds4_mlx.model.model import Model
from ds4_mlx.model.mtp import MTP, MTPCache, open_mtp
from ds4_mlx.model.weights import open_weights
from ds4_mlx.sampling import SamplingParams
from ds4_mlx.tokenizer import Tokenizer

GREEDY = SamplingParams(temperature=0)


class OracleMTP(MTP):
    """The MTP block, run as usual, with its guess replaced by the known greedy continuation."""

    sequence: list[int] = []

    def __call__(self, tokens: mx.array, hidden: mx.array, position: int, cache: MTPCache):
        _, streams = super().__call__(tokens, hidden, position, cache)
        target = position + tokens.size
        token = self.sequence[target] if target < len(self.sequence) else 0
        cache.logits = mx.where(mx.arange(self.config.n_vocab) == token, 100.0, -100.0)
        return cache.logits, streams


def call_times(engine: Engine, prompt: list[int], max_t: int, repeats: int) -> dict[int, float]:
    """Median seconds of one model call over T tokens, T = 1..max_t, each from the same state after the prompt."""
    session = engine.session
    session.reset()
    session.prefill(prompt)
    start = session.snapshot()
    times: dict[int, list[float]] = {t: [] for t in range(1, max_t + 1)}
    for _ in range(repeats + 1):  # the first round warms up
        for t in times:
            ids = mx.array(prompt[1 : t + 1], dtype=mx.int32)
            t0 = time.perf_counter()
            mx.eval(engine.model.head(engine.model.hidden(ids, session.cache)))
            times[t].append(time.perf_counter() - t0)
            session.restore(start)
    return {t: statistics.median(v[1:]) for t, v in times.items()}


def decode(engine: Engine, prompt: list[int], n: int) -> tuple[float, tuple[int, ...], int, int]:
    """Decode seconds, tokens, and the MTP guesses drafted / accepted of one greedy generation from a cold session."""
    engine.reset()  # no live session and no kept checkpoint: the prompt is prefilled
    done = list(engine.generate(GenerationRequest(prompt=prompt, max_tokens=n, sampling=GREEDY)))[-1]
    return done.decode_seconds, done.token_ids, done.mtp_drafted, done.mtp_accepted


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", choices=[k for k in PRESETS if k != "flash"], default="small")
    p.add_argument("--backend", choices=("cpu", "gpu"), default=None)
    p.add_argument("--draft", type=int, nargs="+", default=[2, 3, 4], help="--mtp-draft values (default 2 3 4)")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--gen-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if args.backend:
        mx.set_default_device(mx.cpu if args.backend == "cpu" else mx.gpu)

    with tempfile.TemporaryDirectory() as tmp:
        main_path = write_model(Path(tmp) / "m.gguf", preset=args.preset)
        mtp_path = write_mtp_model(Path(tmp) / "mtp.gguf", main_preset=args.preset)
        weights = open_weights(main_path)
        model = Model(weights)
        tokenizer = Tokenizer.from_gguf(weights.file)
        mtp_weights = open_mtp(mtp_path, weights.config)
        mtp, oracle = MTP(mtp_weights, model), OracleMTP(mtp_weights, model)
        rng = np.random.default_rng(0)
        prompt = [0, *rng.integers(2, weights.config.n_vocab, args.prompt_tokens - 1).tolist()]
        ctx = args.prompt_tokens + args.gen_tokens + 16

        plain = Engine(model, tokenizer, ctx)
        result = {"preset": args.preset, "device": str(mx.default_device()), "prompt_tokens": args.prompt_tokens,
                  "gen_tokens": args.gen_tokens,
                  "call_ms": {t: s * 1e3 for t, s in call_times(plain, prompt, max(args.draft), args.repeats).items()}}
        runs = {}
        expected: list[tuple[int, ...]] = []

        def measure(name: str, engine: Engine) -> None:
            decode(engine, prompt, args.gen_tokens)  # warm-up: first-use allocation and kernel checks
            timed = [decode(engine, prompt, args.gen_tokens) for _ in range(args.repeats)]
            _, tokens, drafted, accepted = timed[0]
            if expected and tokens != expected[0]:
                raise SystemExit(f"{name} did not give plain greedy decoding's tokens")
            expected.append(tokens)
            runs[name] = {"tok_s": (len(tokens) - 1) / statistics.median(t[0] for t in timed),
                          "drafted": drafted, "accepted": accepted}

        measure("plain", plain)
        OracleMTP.sequence = [*prompt, *expected[0]]
        measure("random N=2 margin 0", Engine(model, tokenizer, ctx, mtp=mtp, mtp_draft=2, mtp_margin=0.0))
        for n in args.draft:
            measure(f"oracle N={n}", Engine(model, tokenizer, ctx, mtp=oracle, mtp_draft=n))
        result["decode"] = runs

    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{args.preset} on {result['device']}, prompt {args.prompt_tokens}, generating {args.gen_tokens}")
    print("one model call over T tokens: " + ", ".join(f"T={t} {ms:.1f} ms" for t, ms in result["call_ms"].items()))
    for name, run in result["decode"].items():
        print(f"{name:22s} {run['tok_s']:7.2f} tok/s  (MTP guesses accepted {run['accepted']}/{run['drafted']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
