"""How fast the decode step runs when the host's per-node cost is gone: one recorded step as one CUDA graph.

    python bench/graph_replay.py --layers 43 --at 2048

MLX spends ~20 µs of host time per node of the compiled step (bench/RESULTS.md, 2026-12-02): the step's ~900 nodes
take 18 ms of host work a token against ~12.7 ms on the GPU. Here the step's launches are recorded
(`nvrtc.recording`, one eager step after a prompt of `--at` tokens) and built into one CUDA graph of our own
(kernels/machinery/cudagraph.py), with the dependencies their address ranges give (and, for comparison, as one chain).
The graph is launched again on the same inputs, so it must write the same outputs: they are zeroed first and compared
with MLX's. Printed: the MLX step fed ahead in this process (bench/gpu_profile.py's medians), then per graph its
node and edge count, its host launch time, the step launched and waited for, and back to back (the GPU's pace).
Synthetic weights in the published layout (model/synthetic.py). CUDA only.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time

import mlx.core as mx
import numpy as np

from ds4_mlx.kernels.machinery import nvrtc
from ds4_mlx.kernels.machinery.cudagraph import Driver, ReplayGraph, address, is_row_contiguous
from ds4_mlx.model.model import Model
from ds4_mlx.model.synthetic import flash_config, synthetic_weights
from ds4_mlx.session import Session
from gpu_profile import fed_ahead


def contiguous_inputs(launches: list[nvrtc.Launch]) -> tuple[list[nvrtc.Launch], int]:
    """The launches with each input MLX would copy to a row-contiguous array (a broadcast, say) replaced by such
    a copy, made now: the values a replay on the same inputs reads. Also how many were replaced."""
    out, copies = [], 0
    for launch in launches:
        if launch.row_contiguous and not all(map(is_row_contiguous, launch.inputs)):
            inputs = tuple(a if is_row_contiguous(a) else mx.contiguous(a) for a in launch.inputs)
            mx.eval(*inputs)
            copies += sum(a is not b for a, b in zip(inputs, launch.inputs))
            launch = dataclasses.replace(launch, inputs=inputs)
        out.append(launch)
    return out, copies


def record(model: Model, cache, token: int, position: int, ends: tuple[int, ...]) -> tuple[nvrtc.Recording, list]:
    """One eager step's launches, and its outputs, evaluated."""
    ids, at = mx.array([token], dtype=mx.int32), mx.array([position], dtype=mx.int32)
    mx.eval(ids, at)
    with nvrtc.recording() as recorded:
        streams, logits, layers = model.step(ids, at, cache.layers, ends)
    outputs = [streams, logits, *(a for state in layers for a in state.arrays())]
    mx.eval(*outputs)
    return recorded, [ids, at, *cache.arrays()]


def made_outside(model: Model, cache, position: int) -> list[str]:
    """The launch inputs that no recorded launch wrote and that are not the step's inputs, whose values change
    with the token and position: values some op outside the recorded kernels made from them (a replay of the
    launches alone would read them stale). The second position is in other compression windows of every ratio (a
    window's start is such a value)."""
    ends = model.ends(position)
    (first, inputs), (second, _) = (record(model, cache, t, position + d, ends) for t, d in ((7, 0), (9, 129)))
    if len(first.launches) != len(second.launches):
        return [f"the two recordings launch {len(first.launches)} and {len(second.launches)} kernels"]
    found = []
    for launch, other in zip(first.launches, second.launches):
        known = [(address(a), address(a) + a.nbytes) for a in inputs]
        known += [(address(a), address(a) + a.nbytes) for earlier in first.launches for a in earlier.outputs]
        for i, (a, b) in enumerate(zip(launch.inputs, other.inputs)):
            start = address(a)
            if any(s <= start < e for s, e in known):
                continue
            if not np.array_equal(host_copy(a), host_copy(b), equal_nan=True):
                found.append(f"{launch.function} input {i} {a.shape} {a.dtype}")
    return found


def host_copy(array: mx.array) -> np.ndarray:
    return np.array(array.astype(mx.float32) if array.dtype == mx.bfloat16 else array, copy=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--at", type=int, default=2048, help="decode after a prompt of this many tokens")
    p.add_argument("--repeats", type=int, default=50)
    args = p.parse_args()
    model = Model(synthetic_weights(flash_config(args.layers)))
    session = Session(model, args.at + 128)
    session.prefill([i % 1000 + 5 for i in range(args.at)])
    cache = session.cache
    fed_ahead(model, cache)
    outside = made_outside(model, cache, cache.n_tokens)
    print(f"inputs made outside the recorded launches that change with the token: {len(outside)}")
    for line in outside[:20]:
        print("  " + line)

    position = cache.n_tokens
    token, at = mx.array([7], dtype=mx.int32), mx.array([position], dtype=mx.int32)
    mx.eval(token, at)
    with nvrtc.recording() as recorded:
        streams, logits, layers = model.step(token, at, cache.layers, model.ends(position))
    launches = recorded.launches
    outputs = [streams, logits, *(a for state in layers for a in state.arrays())]
    mx.eval(*outputs)
    launches, copies = contiguous_inputs(launches)
    mx.synchronize()
    print(f"recorded: {len(launches)} launches at position {position} (ends {model.ends(position)}), "
          f"{copies} inputs made row-contiguous for the replay")
    expected = [host_copy(a) for a in outputs]

    driver = Driver.load()
    for chain in (False, True):
        graph = ReplayGraph(driver, launches, chain=chain)
        graph.launch()
        graph.synchronize()
        host, waited = [], []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            graph.launch()
            t1 = time.perf_counter()
            graph.synchronize()
            host.append(t1 - t0)
            waited.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for _ in range(args.repeats):
            graph.launch()
        graph.synchronize()
        ahead = (time.perf_counter() - t0) / args.repeats
        graph.clear_outputs()
        graph.launch()
        graph.synchronize()
        worst = max(float(np.max(np.abs(host_copy(a).astype(np.float64) - e.astype(np.float64)), initial=0.0))
                    for a, e in zip(outputs, expected))
        label = "chain" if chain else "dependencies"
        print(f"graph ({label}): {len(launches)} nodes, {graph.edges} edges; launch {1e3 * statistics.median(host):.3f}"
              f" ms host, launched and waited {1e3 * statistics.median(waited):.2f} ms, back to back "
              f"{1e3 * ahead:.2f} ms a step ({1 / ahead:.1f} t/s); outputs after zeroing: largest difference {worst:g}")
        graph.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
