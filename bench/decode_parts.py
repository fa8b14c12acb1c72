"""Where one decode step's time goes: the compiled step, the same step run eagerly, the reference path, and each
part of one layer of every kind (hyper-connection, attention, MoE) timed on its own.

    python bench/decode_parts.py --layers 4            # the first 4 Flash layers (every kind of layer once)
    python bench/decode_parts.py --layers 4 --json

Synthetic weights in the published layout (ds4_mlx/model/synthetic.py, as `ds4-mlx bench --synthetic`). Each figure is the median over `--steps`
timed steps after warm-up, one mx.eval per step (what greedy decoding does).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable

import mlx.core as mx

from ds4_mlx.kernels.machinery import registry
from ds4_mlx.model.hyper_connection import PendingPost
from ds4_mlx.model.model import Model
from ds4_mlx.model.norm import rms_norm
from ds4_mlx.model.synthetic import flash_config, synthetic_weights


def median_ms(run: Callable[[], list[mx.array]], steps: int) -> float:
    for _ in range(3):
        mx.eval(*run())
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        mx.eval(*run())
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--ctx", type=int, default=4096)
    p.add_argument("--prompt-tokens", type=int, default=300)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--prefill-chunk", type=int, default=2048, help="prefill chunk (<= 5 keeps the decode paths)")
    p.add_argument("--no-parts", action="store_true", help="time the whole step only")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()

    model = Model(synthetic_weights(flash_config(args.layers)))
    cache = model.new_cache(args.ctx)
    t0 = time.perf_counter()
    mx.eval(model.prefill(mx.arange(1, args.prompt_tokens + 1, dtype=mx.int32), cache, chunk_size=args.prefill_chunk))
    out: dict[str, float] = {"prefill s": time.perf_counter() - t0}

    def step() -> list[mx.array]:
        return [model.decode(7, cache)[1], *cache.arrays()]

    out["compiled step ms"] = median_ms(step, args.steps)
    flat = [mx.array([7], dtype=mx.int32), mx.array([cache.n_tokens], dtype=mx.int32), *cache.arrays()]
    out["eager step ms"] = median_ms(lambda: model._flat_step(None, *flat), args.steps)
    with registry.forced_mode("reference"):
        snap = cache.snapshot()
        out["reference token ms"] = median_ms(lambda: [model.decode(7, cache)[1]], min(args.steps, 5))
        cache.restore(snap)

    if args.no_parts:
        print(json.dumps(out) if args.json else out)
        return 0
    streams = mx.random.normal((1, model.config.n_hc, model.config.n_embd))
    position = mx.array([cache.n_tokens], dtype=mx.int32)
    token = mx.array([7], dtype=mx.int32)
    x = mx.random.normal((1, model.config.n_embd))
    mx.eval(streams, x)
    seen = set()
    for layer, block in enumerate(model.blocks):
        kind = (model.config.compress_ratio(layer), model.config.is_hash_layer(layer))
        if kind in seen:
            continue
        seen.add(kind)
        name = f"layer {layer} (ratio {kind[0]}{', hash' if kind[1] else ''})"
        state = cache.layers[layer]
        parts = {
            "hc pre": lambda b=block: list(b.attn_hc.pre(streams)),
            "hc post": lambda b=block: [PendingPost(x, None, streams, *b.attn_hc.pre(streams)[1:]).apply()],
            "attention": lambda b=block, s=state: (lambda o: [o[0], *o[1].arrays()])(b.attention.step(
                x, position, s, norm=(b.attn_norm, b.eps))),
            "moe": lambda b=block: [b.moe(rms_norm(x, b.ffn_norm, b.eps), token)],
            "block": lambda b=block, s=state: (lambda o: [o[0].apply(), *o[1].arrays()])(
                b(streams, token, position, s)),
        }
        for part, fn in parts.items():
            out[f"{name} {part} ms"] = median_ms(mx.compile(lambda f=fn: f()), args.steps)
        del state
    out["layers"] = args.layers
    if args.json:
        print(json.dumps(out))
    else:
        for key, value in out.items():
            print(f"{key:45s} {value:9.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
