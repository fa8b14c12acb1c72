"""Where the decode graph (model/graphstep.py) first parts from MLX: launch by launch, one step.

    python bench/graph_diff.py --layers 4 --at 2048

After a prompt of `--at` tokens, the decoder takes the session's state and records the step's graph; the same
step is recorded once more as MLX evaluates it, from the same token, position and state. The graph is launched, and
each of its launches' outputs (what the graph wrote) is compared with the same launch's outputs under MLX, in order:
the first that differ name the kernel to look at. CUDA only; synthetic weights in the published layout.
"""

from __future__ import annotations

import argparse
import sys

import mlx.core as mx
import numpy as np

from ds4_mlx.kernels.machinery import nvrtc
from ds4_mlx.model.graphstep import GraphDecoder
from ds4_mlx.model.model import Model
from ds4_mlx.model.synthetic import flash_config, synthetic_weights
from ds4_mlx.session import Session
from graph_replay import host_copy


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--at", type=int, default=2048)
    p.add_argument("--show", type=int, default=8, help="how many differing launches to list")
    args = p.parse_args()
    model = Model(synthetic_weights(flash_config(args.layers)))
    session = Session(model, args.at + 128)
    session.prefill([i % 1000 + 5 for i in range(args.at)])
    cache = session.cache
    decoder = GraphDecoder(model, cache, None)
    decoder.enter(cache)
    position, token = cache.n_tokens, 7
    kind = model.ends(position)
    graph, _ = decoder._graph(kind)
    with nvrtc.recording() as mlx_run:
        model.step(mx.array([token], dtype=mx.int32), mx.array([position], dtype=mx.int32), decoder._layers(), kind)
    for launch in mlx_run.launches:
        mx.eval(*launch.outputs)
    want = [[host_copy(a) for a in launch.outputs] for launch in mlx_run.launches]
    bound = {id(a) for a, _ in graph.bound}
    decoder.io[0], decoder.io[1] = token, position
    graph.launch()
    graph.synchronize()
    launches = graph.launches[1:]  # the graph's first launch loads the token and position
    print(f"kind {kind}: graph {len(graph.launches)} launches, MLX {len(mlx_run.launches)}")
    shown = 0
    for i, (g, w) in enumerate(zip(launches, want)):
        if g.function != mlx_run.launches[i].function:
            print(f"launch {i}: the graph runs {g.function}, MLX {mlx_run.launches[i].function}")
            break
        for j, (out, expected) in enumerate(zip(g.outputs, w)):
            if id(out) in bound:
                continue
            got = host_copy(out)
            if not np.array_equal(got, expected, equal_nan=True):
                diff = np.nanmax(np.abs(got.astype(np.float64) - expected.astype(np.float64)))
                print(f"launch {i} {g.function[:90]} output {j} {out.shape}: largest difference {diff:g}")
                shown += 1
        if shown >= args.show:
            break
    if not shown:
        print("every launch's outputs equal MLX's")
    return 0


if __name__ == "__main__":
    sys.exit(main())
