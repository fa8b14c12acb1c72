"""Counting the primitives in one decode step's lazy graph: the figure that per-op launch overhead multiplies.

On a GPU every primitive MLX evaluates costs a launch (about 10 µs for a built-in op on the H200, bench/README.md),
so a decode step's speed follows how many primitives its graph holds. The graph is built by running the model on
one token without evaluating it, written with `mx.export_to_dot`, and its nodes counted by primitive name. The
step is the compiled one `Model.decode` replays: elementwise chains fused by `mx.compile` appear as one node each
(their names start with "Compiled"), custom kernels as their own primitive (on the CPU, which has none, their
references' primitives appear instead). Arrays already evaluated (the weights, the cache) are inputs, not
nodes.
"""

from __future__ import annotations

import re
import tempfile
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import mlx.core as mx

if TYPE_CHECKING:
    from .cache import SessionCache
    from .model import Model

VIEWS = frozenset({"Broadcast", "Reshape", "ExpandDims", "Squeeze", "Slice", "Split", "Transpose", "AsStrided",
                   "View", "StopGradient", "Depends", "Flatten", "Unflatten"})
"""Primitives that usually only reinterpret their input (no kernel launch; a reshape of a strided input copies)."""

_NODE = re.compile(r'^\{ (\d+) \[label ="([^"]*)"', re.MULTILINE)


def graph_nodes(arrays: Sequence[mx.array]) -> dict[str, str]:
    """The primitives the arrays' unevaluated graph holds: node id -> primitive name."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "graph.dot"
        mx.export_to_dot(str(path), *arrays)
        return dict(_NODE.findall(path.read_text()))


def decode_step_ops(model: Model, cache: SessionCache, token: int = 0) -> dict:
    """Primitives in the graph of one decode step of `token` at the cache's position, as `Model.decode` runs it
    (the compiled step: its fused elementwise kernels count once each); the cache is left as it was.

    Returns {"total": n, "kernels": n (total less VIEWS), "by_primitive": {name: n, ...} (most frequent first), "per_layer": [n, ...],
    "outside_layers": n}. A layer's count is the primitives its cache update needs that no earlier layer's does:
    its attention and compression, and the previous layer's MoE (the first layer's holds the embedding); what no
    layer's state needs (the last MoE, the head) is `outside_layers`.
    """
    before = cache.snapshot()
    try:
        model.decode(token, cache)  # a layout's first step runs eagerly (first-use checks); the next is compiled
        mx.eval(cache.arrays())
        cache.restore(before)
        _, logits = model.decode(token, cache)
        everything = graph_nodes([logits, *cache.arrays()])
        seen: set[str] = set()
        per_layer = []
        for layer in cache.layers:
            nodes = graph_nodes(layer.arrays()).keys()
            per_layer.append(len(nodes - seen))
            seen |= nodes
    finally:
        cache.restore(before)
    return {
        "total": len(everything),
        "kernels": sum(name not in VIEWS for name in everything.values()),
        "by_primitive": dict(Counter(everything.values()).most_common()),
        "per_layer": per_layer,
        "outside_layers": len(everything.keys() - seen),
    }
