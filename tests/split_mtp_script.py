"""Greedy decoding of a fixed prompt, plain in one process or speculative under `mlx.launch` (tests/test_split.py).

    split_mtp_script.py MODEL OUT                 one process, plain: the tokens to OUT.single.json
    split_mtp_script.py MODEL OUT DRAFTER         a rank, speculative with DRAFTER (MTP-1 or DSpark): OUT.<rank>.json

A random drafter's guesses are almost never right, so its guesses are replaced by an oracle's: the plain run's
tokens (read from OUT.single.json), every third position wrong, so that verification keeps some drafts and rejects
others. The drafter still runs its forward pass (and, split, its exchanges) for every guess.
"""

from __future__ import annotations

import json
import sys

import mlx.core as mx

import ds4_mlx  # noqa: F401
from ds4_mlx.engine import Engine, GenerationRequest
from ds4_mlx.events import Done
from ds4_mlx.model.dspark import DSpark, Draft
from ds4_mlx.model.mtp import MTP
from ds4_mlx.sampling import SamplingParams

PROMPT = [0, *range(100, 131)]
TOKENS = 24


def oracle(sequence: list[int]) -> None:
    """Both drafters guess sequence[q] for the token at position q (sequence[q] + 1 where q % 3 == 0)."""
    def guess(q: int) -> int:
        return (sequence[q] if q < len(sequence) else 0) + (q % 3 == 0)

    real_draft, real_call = DSpark.draft, MTP.__call__

    def draft(self, anchor, cache, *args, **kw):
        proposed = real_draft(self, anchor, cache, *args, **kw)
        return Draft([guess(q) for q in range(cache.end + 1, cache.end + 1 + self.block_size)], proposed.probs,
                     proposed.confidence)

    def call(self, tokens, hidden, position, cache):
        logits, streams = real_call(self, tokens, hidden, position, cache)
        cache.logits = logits + 1e4 * (mx.arange(logits.size) == guess(position + tokens.size))
        return cache.logits, streams

    DSpark.draft, MTP.__call__ = draft, call


def main(path: str, out: str, drafter: str | None = None) -> None:
    mx.set_default_device(mx.cpu)
    if drafter is not None:
        with open(f"{out}.single.json") as f:
            oracle(PROMPT + json.load(f)["tokens"])
    engine = Engine.load(path, 256, simulate_quant=False, mtp=drafter, mtp_draft=4 if drafter else 1)
    *_, done = engine.generate(GenerationRequest(PROMPT, TOKENS, SamplingParams(temperature=0)))
    assert isinstance(done, Done)
    split = engine.model.split
    with open(f"{out}.{'single' if split is None else split.rank}.json", "w") as f:
        json.dump({"tokens": list(done.token_ids), "drafted": done.mtp_drafted, "accepted": done.mtp_accepted}, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
