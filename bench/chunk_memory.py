"""What one prefill chunk holds beside the resident state, measured, against memory.py's estimate.

For each layer count, chunk length C and position P: the synthetic Flash layout (q2) is prefilled to P, then one
C-token chunk is fed through `Session.prefill` as the engine feeds it; the chunk's transients are MLX's peak of
active memory during it less the active memory before it. Printed as a table and written as JSON (`--json FILE`)
with memory.chunk_transient_bytes beside each figure: the estimate must stay above every measurement, which is how
its factors (TOKEN_FLOATS_FACTOR, ROW_BYTES) are chosen.

    python bench/chunk_memory.py --layers 4,8 --chunks 2048,4096,8192,12288 --positions 0,16384,65536
"""

from __future__ import annotations

import argparse
import json
import time

import mlx.core as mx

from ds4_mlx import memory
from ds4_mlx.model.model import Model
from ds4_mlx.model.synthetic import flash_config, synthetic_weights
from ds4_mlx.session import Session

GIB = 1 << 30


def numbers(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def measure(layers: int, chunks: list[int], positions: list[int], experts: str) -> list[dict]:
    config = flash_config(layers)
    weights = synthetic_weights(config, experts)
    model = Model(weights, progress=None)
    weights.close()
    ctx = max(positions) + max(chunks)
    session = Session(model, ctx)
    session.chunk_size = max(chunks)
    tokens = [5 + (i * 7919) % 100000 for i in range(ctx)]
    rows = []
    with memory.limited(1 << 50):  # measured as it is: no chunk shortened
        for position in sorted(positions):
            session.reset()
            if position:
                session.prefill(tokens[:position])
            start = session.snapshot()
            for chunk in chunks:
                session.restore(start)
                mx.synchronize()
                mx.clear_cache()
                before = mx.get_active_memory()
                mx.reset_peak_memory()
                session.chunk_size = chunk
                t0 = time.perf_counter()
                session.prefill(tokens[position:position + chunk])
                mx.eval(session.logits)
                seconds = time.perf_counter() - t0
                measured = mx.get_peak_memory() - before
                estimate = memory.chunk_transient_bytes(config, chunk, position)
                row = {"layers": layers, "chunk": chunk, "position": position, "resident_bytes": before,
                       "transient_bytes": measured, "estimate_bytes": estimate,
                       "per_token_bytes": measured / chunk, "estimate_over_measured": estimate / max(measured, 1),
                       "seconds": round(seconds, 3)}
                rows.append(row)
                print(f"layers {layers:2d} chunk {chunk:6d} at {position:7d}: resident {before / GIB:6.2f} GiB, "
                      f"transient {measured / GIB:6.2f} GiB ({measured / chunk / 1e6:5.2f} MB/token), estimate "
                      f"{estimate / GIB:6.2f} GiB (x{estimate / max(measured, 1):.2f}), {seconds:.2f} s", flush=True)
    session.close()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=numbers, default=[4])
    p.add_argument("--chunks", type=numbers, default=[2048, 4096, 8192, 12288])
    p.add_argument("--positions", type=numbers, default=[0, 16384])
    p.add_argument("--experts", default="q2", choices=("q2", "q4"))
    p.add_argument("--json", help="write the rows to this file")
    args = p.parse_args()
    rows = []
    for layers in args.layers:
        rows += measure(layers, args.chunks, args.positions, args.experts)
    worst = max(r["transient_bytes"] / r["estimate_bytes"] for r in rows)
    print(f"largest measured / estimate: {worst:.3f} (the estimate must stay above 1 / that)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
