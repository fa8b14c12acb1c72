"""Launching ops of one prefill chunk through each layer's attention sublayer, as a GPU backend would build them.

Runs `Attention.__call__` on a chunk of random normed inputs at a given position, for every layer of a model file,
inside `registry.planning(BACKEND)` (every fast path written for the backend taken, each custom kernel one stand-in
node), and counts the nodes of the outputs' graph that launch work (model/graph.py's VIEWS left out). Nothing is
computed: the graph is only built. Usage:

    PYTHONPATH=$PWD python bench/prefill_launches.py /tmp/m/small.gguf --chunk 2048 --n-past 0
"""

from __future__ import annotations

import argparse
from collections import Counter

import mlx.core as mx

from ds4_mlx.kernels.machinery.registry import planning
from ds4_mlx.model.graph import VIEWS, graph_nodes
from ds4_mlx.model.model import Model
from ds4_mlx.model.weights import open_weights


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--chunk", type=int, default=2048)
    parser.add_argument("--n-past", type=int, default=0, help="the chunk's first position (earlier state: zeros)")
    parser.add_argument("--backend", default="cuda", choices=("cuda", "metal"))
    args = parser.parse_args()
    with planning(args.backend):
        model = Model(open_weights(args.model), simulate_quant=False)
        cache = model.new_cache(args.n_past + args.chunk)
        x = mx.random.normal((args.chunk, model.config.n_embd), key=mx.random.key(0))
        mx.eval(x)
        total = 0
        for i, block in enumerate(model.blocks):
            out, state = block.attention(x, args.n_past, cache.layers[i])
            names = [name for name in graph_nodes([out, *state.arrays()]).values() if name not in VIEWS]
            total += len(names)
            top = ", ".join(f"{name} {n}" for name, n in Counter(names).most_common(6))
            print(f"layer {i} (ratio {block.attention.ratio}): {len(names)} launching ops; {top}")
        print(f"all {len(model.blocks)} layers: {total}")


if __name__ == "__main__":
    main()
