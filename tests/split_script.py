"""A fixed run of the model on one process or, under `mlx.launch`, split across its ranks (tests/test_split.py).

    split_script.py MODEL OUT KIND QUANT [SHARE]

QUANT "exact" turns the activation quantisation simulation off (model.py), "simulated" leaves it on; "fail" is
"exact" where the last rank stops with status 3 once loaded (the others are then waiting in their first sum);
"hang" is "exact" where the last rank sleeps past its first decode steps, its own watchdog paused, as a rank stuck
where nothing of it notices (model/watchdog.py).

Prefills a prompt in chunks, decodes greedily, restores a snapshot and decodes again, and takes one B-row step over
two sessions; saves every logit it saw to OUT.<rank>.npz (OUT.single.npz for one process) and, split, the count
and bytes of a decode step's exchanges.
"""

from __future__ import annotations

import sys
import time

import mlx.core as mx
import numpy as np

import ds4_mlx  # noqa: F401
from ds4_mlx.model import watchdog
from ds4_mlx.model.model import Model
from ds4_mlx.model.shard import init_split, launched
from ds4_mlx.model.weights import open_weights

PROMPT = 37
CHUNK = 16
STEPS = 5
CTX = 96


def main(path: str, out: str, kind: str, quant: str, share: str | None = None) -> None:
    mx.set_default_device(mx.cpu)
    weights = open_weights(path)
    split = init_split(kind, share, weights) if launched() else None
    model = Model(weights, simulate_quant=quant == "simulated", split=split)
    if quant == "fail" and split is not None and split.last:
        sys.exit(3)
    tokens = mx.array(np.random.default_rng(0).integers(0, model.config.n_vocab, PROMPT), dtype=mx.int32)
    seen: dict[str, np.ndarray] = {}
    cache = model.new_cache(CTX)
    for i, start in enumerate(range(0, PROMPT, CHUNK)):
        seen[f"chunk{i}"] = np.array(model(tokens[start : start + CHUNK], cache, all_logits=True))
    snapshot = cache.snapshot()
    token = int(np.argmax(seen[f"chunk{i}"][-1]))
    for again in ("decode", "restored"):
        if again == "restored":
            if quant == "hang" and split is not None and split.last:
                watchdog.pause()
                time.sleep(3600)
            cache.restore(snapshot)
            token = int(np.argmax(seen[f"chunk{i}"][-1]))
        for step in range(STEPS):
            _, logits = model.decode(token, cache)
            seen[f"{again}{step}"] = np.array(logits)
            token = int(np.argmax(seen[f"{again}{step}"]))
    other = model.new_cache(CTX)
    model.prefill(tokens[:5], other)
    _, logits, rows = model.decode_rows([token, 7, 9], [cache, other], groups=(1, 2))
    seen["rows"] = np.array(logits)
    cache.advance(rows[0], cache.n_tokens + 1)
    _, logits = model.decode(3, cache)
    seen["after_rows"] = np.array(logits)
    name = "single" if split is None else str(split.rank)
    if split is not None:  # the exchanges of one decode step, counted while its graph is built
        before = split.exchanges, split.exchanged_bytes
        model.step(mx.array([0], dtype=mx.int32), mx.array([cache.n_tokens], dtype=mx.int32), cache.layers)
        seen["exchanges"] = np.array([split.exchanges - before[0], split.exchanged_bytes - before[1]])
    np.savez(f"{out}.{name}.npz", **seen)


if __name__ == "__main__":
    main(*sys.argv[1:])
