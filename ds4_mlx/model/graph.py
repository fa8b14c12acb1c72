"""Counting the primitives in one decode step's lazy graph: the figure that per-op launch overhead multiplies.

On a GPU every primitive MLX evaluates costs a launch (about 10 µs for a built-in op on the H200, bench/README.md),
so a decode step's speed follows how many primitives its graph holds. The graph is built by running the model on
one token without evaluating it, written with `mx.export_to_dot`, and its nodes counted by primitive name. The
step is the compiled one `Model.decode` replays: elementwise chains fused by `mx.compile` appear as one node each
(their names start with "Compiled"), custom kernels as their own primitive (on the CPU, which has none, their
references' primitives appear instead, unless the graph is planned for a GPU backend: `registry.planning`, where
each launch is one stand-in node). Arrays already evaluated (the weights, the cache) are inputs, not
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

from ..kernels.machinery import registry

if TYPE_CHECKING:
    from .cache import SessionCache
    from .model import Model

VIEWS = frozenset({"Broadcast", "Reshape", "ExpandDims", "Squeeze", "Slice", "Split", "Transpose", "AsStrided",
                   "View", "StopGradient", "Depends", "Flatten", "Unflatten"})
"""Primitives that usually only reinterpret their input (no kernel launch; a reshape of a strided input copies)."""

_NODE = re.compile(r'^\{ (\d+) \[label ="([^"]*)"', re.MULTILINE)


STAND_IN = "CustomKernel"
"""The name a custom kernel's stand-in node (a Depends, kernels/machinery/dialect.py) is counted under while
planning."""


def graph_nodes(arrays: Sequence[mx.array]) -> dict[str, str]:
    """The primitives the arrays' unevaluated graph holds: node id -> primitive name. While graphs are planned for
    another backend (registry.planning), the stand-ins of custom kernels are named STAND_IN (the decode step has
    no Depends of its own)."""
    return _exported(arrays)[0]


def _exported(arrays: Sequence[mx.array]) -> tuple[dict[str, str], str]:
    """`graph_nodes`, and the dot text they were read from."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "graph.dot"
        mx.export_to_dot(str(path), *arrays)
        text = path.read_text()
    nodes = dict(_NODE.findall(text))
    if registry.planned() is not None:
        nodes = {node: STAND_IN if name == "Depends" else name for node, name in nodes.items()}
    return nodes, text


_EDGE = re.compile(r'^(\S+) -> (\S+)', re.MULTILINE)


def ops_after_kernels(arrays: Sequence[mx.array]) -> Counter[str]:
    """The primitives in the arrays' unevaluated graph that are neither views nor custom kernels and take, directly
    or through other nodes, the output of a custom kernel: MLX ops on values a step computes. A step recorded for a
    CUDA graph of our own (model/graphstep.py) must hold none, since only its kernels are replayed. (An op that
    reads a step's input array directly is not seen here: the graph's check step finds those.)"""
    names, text = _exported(arrays)
    after: dict[str, list[str]] = {}
    for source, target in _EDGE.findall(text):
        after.setdefault(source.strip('"'), []).append(target.strip('"'))
    seen: set[str] = set()
    todo = [node for node, name in names.items() if name == STAND_IN]
    while todo:
        node = todo.pop()
        for nxt in after.get(node, []):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return Counter(names[n] for n in seen if n in names and names[n] != STAND_IN and names[n] not in VIEWS)


def decode_step_ops(model: Model, cache: SessionCache, token: int = 0) -> dict:
    """Primitives in the graph of one decode step of `token` at the cache's position, as `Model.decode` runs it
    (the compiled step: its fused elementwise kernels count once each); the cache is left as it was.

    Returns {"total": n, "kernels": n (total less VIEWS), "by_primitive": {name: n, ...} (most frequent first),
    "per_layer": [n, ...], "kernels_per_layer": [n, ...], "last_layer": {name: n, ...}, "outside_layers": n}. A
    layer's nodes are those its cache update needs that no earlier layer's does: its attention and compression, and
    the previous layer's MoE (the first layer's hold the embedding); what no layer's state needs (the last MoE, the
    head) is `outside_layers`. `last_layer` lists the last layer's by name: one attention and one MoE, a steady
    layer's work.
    """
    before = cache.snapshot()
    try:
        # a layout's first step runs eagerly (first-use checks); the next is compiled. Its outputs are evaluated,
        # as a session evaluates them, so that views made of the weights at load (evaluated by that first step)
        # are inputs of the compiled step, not nodes, even where nothing ran before (--ops-for right after load)
        mx.eval(*model.decode(token, cache), cache.arrays())
        cache.restore(before)
        _, logits = model.decode(token, cache)
        everything = graph_nodes([logits, *cache.arrays()])
        seen: set[str] = set()
        layers = []
        for layer in cache.layers:
            nodes = graph_nodes(layer.arrays())
            layers.append([name for node, name in nodes.items() if node not in seen])
            seen |= nodes.keys()
    finally:
        cache.restore(before)
    return {
        "total": len(everything),
        "kernels": sum(name not in VIEWS for name in everything.values()),
        "by_primitive": dict(Counter(everything.values()).most_common()),
        "per_layer": [len(names) for names in layers],
        "kernels_per_layer": [sum(name not in VIEWS for name in names) for names in layers],
        "last_layer": dict(Counter(layers[-1]).most_common()) if layers else {},
        "outside_layers": len(everything.keys() - seen),
    }
