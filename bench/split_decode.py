"""Decode speed of a model split across ranks, with the exchanges a token makes, against one process.

    python bench/split_decode.py MODEL                                              # one process
    mlx.launch --backend ring -n 2 --python python -- bench/split_decode.py MODEL   # split (--split layers too)

Prefills a prompt, then times greedy decode steps (the compiled step, tokens read back each step, as `ds4-mlx
bench` does); rank 0 prints one JSON line: decode t/s and, split, the sums / sends a decode step makes and their
bytes (counted while one step's graph is built, model/shard.py).
"""

from __future__ import annotations

import argparse
import json
import time

import mlx.core as mx
import numpy as np

from ds4_mlx.model.model import Model
from ds4_mlx.model.shard import init_split, launched
from ds4_mlx.model.weights import open_weights
from ds4_mlx.sampling import argmax


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--split", choices=("tensor", "layers"))
    p.add_argument("--split-weights")
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--tokens", type=int, default=32, help="decode steps timed (default 32)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--ctx", type=int, default=1024)
    args = p.parse_args()
    mx.set_default_device(mx.cpu)
    weights = open_weights(args.model)
    split = init_split(args.split, args.split_weights, weights) if launched() else None
    model = Model(weights, split=split)
    rng = np.random.default_rng(0)
    cache = model.new_cache(args.ctx)
    logits = model.prefill(mx.array(rng.integers(0, model.config.n_vocab, args.prompt_tokens), dtype=mx.int32),
                           cache)
    start = cache.snapshot()
    per_token = {}
    if split is not None:  # one step's graph built (not evaluated): the exchanges a token makes
        before = split.exchanges, split.exchanged_bytes
        model.step(mx.array([0], dtype=mx.int32), mx.array([cache.n_tokens], dtype=mx.int32), cache.layers)
        per_token = {"exchanges_per_token": split.exchanges - before[0],
                     "bytes_per_token": split.exchanged_bytes - before[1]}
    speeds = []
    for _ in range(args.repeats + 1):  # the first: warm-up (traces the compiled steps)
        cache.restore(start)
        token = argmax(logits)
        t0 = time.perf_counter()
        for _ in range(args.tokens):
            _, step_logits = model.decode(token, cache)
            token = argmax(step_logits)
        speeds.append(args.tokens / (time.perf_counter() - t0))
    if split is None or split.rank == 0:
        print(json.dumps({"ranks": 1 if split is None else split.size, "split": None if split is None else split.kind,
                          "decode_tps": round(float(np.median(speeds[1:])), 2), **per_token}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
