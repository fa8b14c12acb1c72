"""The chunk attention kernels and the indexer's choice at DeepSeek V4 Flash's shapes, one prefill chunk: ms per call.

    python bench/chunk_attention.py                  # 4096 queries deep in a context (positions 8192..12287)
    python bench/chunk_attention.py --queries 2048 --first 2048

Rows, per kind of layer: "picked" (a ratio-4 layer: the 128-row window and the indexer's 512 real picks among the
visible compressed rows), "rows" (a ratio-128 layer: the window and every visible compressed row), "window" (the
window alone). Each kind runs through the SIMT kernel and the tensor-core kernel at 16 and 32 heads a threadgroup
(kernels/prefill/chunk_attention.py); every line is checked against the SIMT kernel's output (the same attention within
TOLERANCE), so a fast but wrong variant shows. Then the indexer's choice for the same queries on a ratio-4 layer
(scores over the visible compressed rows, then the top 512): the composed reference (`pick_rows`: a (B, 64, N)
product, relu, weighting, head sum, mask and sorts), the SIMT score kernel and the tensor-core one, each followed by
the select kernel (kernels/sublayers/indexer.py); each line gives the share of picks equal to the reference's. CUDA only
for the tensor-core lines.
"""

from __future__ import annotations

import argparse

import mlx.core as mx
import numpy as np

from ds4_mlx.kernels.prefill import chunk_attention
from ds4_mlx.kernels.prefill.chunk_attention import ChunkAttention
from ds4_mlx.kernels.sublayers.indexer import indexer_scores, select_rows, tensor_scores
from ds4_mlx.kernels.machinery.probe import random_activations
from ds4_mlx.model.attention import pick_rows
from ds4_mlx.model.config import FLASH
from prefill_gemms import per_call_ms  # bench/ is the script's directory


def inputs(kind: str, queries: int, first: int, ratio: int) -> tuple:
    """ChunkAttention's arguments for one chunk of `queries` queries at positions first.. of a Flash layer."""
    heads, d, window = FLASH.n_head, FLASH.head_dim, FLASH.sliding_window
    raw_first = max(0, first - window + 1)
    rows = picked = valid = None
    if kind != "window":
        rows = random_activations(((first + queries) // ratio, d), seed=2)
    if kind == "picked":
        top_k = FLASH.indexer_top_k
        rng = np.random.default_rng(0)
        visible = [(first + b + 1) // ratio for b in range(queries)]
        picked = mx.array(np.stack([np.sort(rng.choice(v, top_k, replace=False)) for v in visible]), dtype=mx.int32)
        valid = mx.ones((queries, top_k), dtype=mx.bool_)
    q, raw = random_activations((queries, heads, d), seed=0), random_activations((first + queries - raw_first, d), seed=1)
    return (q, raw, raw_first, first, window, rows, ratio if kind == "rows" else 4, picked, valid,
            random_activations((heads,), seed=3))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--queries", type=int, default=4096)
    p.add_argument("--first", type=int, default=8192, help="the chunk's first position")
    p.add_argument("--calls", type=int, default=3)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    for kind, ratio in (("picked", 4), ("rows", 128), ("window", 0)):
        call_args = inputs(kind, args.queries, args.first, ratio)
        keys = args.queries * (FLASH.sliding_window + (FLASH.indexer_top_k if kind == "picked" else 0)
                               + ((args.first + args.queries // 2) // ratio if kind == "rows" else 0))
        flops = 4 * keys * FLASH.n_head * FLASH.head_dim  # scores and P V
        want = ChunkAttention._kernel(*call_args)
        variants = [("simt", lambda: ChunkAttention._kernel(*call_args))]
        for heads in (16, 32):
            def tensor(heads=heads) -> mx.array:
                chunk_attention.TENSOR_HEADS = heads
                return ChunkAttention._tensor_kernel(*call_args)
            variants.append((f"tensor {heads} heads", tensor))
        for name, call in variants:
            try:
                ms = per_call_ms(call, args.calls, args.repeats)
                got = call()
                error = (mx.max(mx.abs(got - want)) / mx.max(mx.abs(want))).item()
                print(f"{kind:<7} {name:<16} {ms:8.3f} ms  {flops / ms / 1e9:6.1f} TFLOP/s  error vs simt {error:.1e}",
                      flush=True)
            except Exception as error:  # a variant that cannot run here (no CUDA) is reported, not fatal
                print(f"{kind:<7} {name:<16} did not run: {type(error).__name__}: {str(error)[:200]}", flush=True)
    choice(args)
    return 0


def choice(args: argparse.Namespace) -> None:
    """The indexer's choice for the chunk's queries on a ratio-4 layer, by each route."""
    heads, d, top_k, ratio = FLASH.indexer_n_head, FLASH.indexer_head_dim, FLASH.indexer_top_k, 4
    n = (args.first + args.queries) // ratio
    q = random_activations((args.queries, heads, d), seed=5)
    w = random_activations((args.queries, heads), seed=6) / (heads * d) ** 0.5
    rows = random_activations((n, d), seed=7)
    positions = mx.arange(args.first, args.first + args.queries, dtype=mx.int32)
    want = pick_rows(q, w, rows, positions, ratio, top_k)
    routes = [("composed", lambda: pick_rows(q, w, rows, positions, ratio, top_k)),
              ("simt scores", lambda: select_rows(indexer_scores(q, w, rows, positions, ratio, top_k), positions,
                                                  ratio, top_k)),
              ("tensor scores", lambda: select_rows(tensor_scores(q, w, rows, positions, ratio, top_k), positions,
                                                    ratio, top_k))]
    for name, call in routes:
        try:
            ms = per_call_ms(lambda: call()[0], args.calls, args.repeats)
            same = mx.mean((call()[0] == want[0]).astype(mx.float32)).item()
            print(f"choice  {name:<16} {ms:8.3f} ms  picks equal to the reference's {same:.6f}", flush=True)
        except Exception as error:
            print(f"choice  {name:<16} did not run: {type(error).__name__}: {str(error)[:200]}", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
