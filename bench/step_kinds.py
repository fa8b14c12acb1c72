"""Decode speed with the compiled step's kinds (Model.ends) against one step that always writes its rows, in one
process on one synthetic model: an A/B for the row-write skip, both ways of feeding tokens.

    python bench/step_kinds.py --layers 12          # on the GPU machine (~25 GB for 12 layers)

Why: a token that ends no compression window writes no compressed row, so the step has a kind per tuple of windows
ended (Flash: 3), each its own compiled graph and CUDA graphs. Measured across machines the change was within the
run-to-run spread (bench/RESULTS.md, 2026-12-02); this measures it without that spread: the same model, cache
and prompt, `always` forcing every step to write (the step before the change) between two `skip` runs.
"""

from __future__ import annotations

import argparse
import json
import time

import mlx.core as mx

from ds4_mlx.model.model import Model
from ds4_mlx.model.synthetic import flash_config, synthetic_weights
from ds4_mlx.sampling import argmax
from ds4_mlx.session import Session


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--prompt-tokens", type=int, default=2048)
    p.add_argument("--tokens", type=int, default=64, help="decode tokens per timed run (default 64)")
    args = p.parse_args()
    model = Model(synthetic_weights(flash_config(args.layers), "q2"))
    session = Session(model, args.prompt_tokens + 2 * args.tokens)
    session.prefill(list(range(5, 5 + args.prompt_tokens)))
    mx.eval(session.logits)
    start = session.snapshot()

    def fed(n: int) -> float:
        session.restore(start)
        t = time.perf_counter()
        for _ in range(n):
            session.confirm(int(session.feed_chosen().item()))
        mx.eval(session.logits)
        return round(n / (time.perf_counter() - t), 2)

    def read_back(n: int) -> float:
        session.restore(start)
        t = time.perf_counter()
        for _ in range(n):
            session.decode(argmax(session.logits))
        mx.eval(session.logits)
        return round(n / (time.perf_counter() - t), 2)

    results = []
    for kind in ("skip", "always", "skip"):
        model._steps.clear()
        model.ends = (lambda position: model.ratios) if kind == "always" else Model.ends.__get__(model)
        fed(16), read_back(8)  # the layout's eager step, then every kind traced and replayed once
        results.append({"steps": kind, "fed ahead t/s": [fed(args.tokens) for _ in range(2)],
                        "read back t/s": [read_back(args.tokens) for _ in range(2)]})
        print(json.dumps(results[-1]), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
