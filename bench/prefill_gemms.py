"""Prefill's tensor-core GEMMs at DeepSeek V4 Flash's shapes, one chunk: ms per call and useful TFLOP/s.

    python bench/prefill_gemms.py                 # 4096-token chunk (CUDA's), random routing over 256 experts
    python bench/prefill_gemms.py --tokens 2048 --calls 4
    python bench/prefill_gemms.py --once          # each kernel's default plan once, untimed: for a profiler
    python bench/prefill_gemms.py --only raw      # the routed experts' rows only (dense, half: the others)

Rows: the raw-bank expert GEMM for IQ2_XXS gate / up and Q2_K down by mma (kernels/tensor_cores/grouped_raw.py) under
each plan (RAW_PLANS: stage width, threadgroups an SM, stages of x in flight) and by warpgroup products
(grouped_wgmma.py under each of GROUPED_PLANS; gate / up reading the tokens' rows by index as the model does, against
grouped_raw.py doing the same), the dense affine projections (Q8_0) by the float16 kernel (dense_f16.py) at each
pipeline depth, by warpgroup products (dense_wgmma.py) under each of WGMMA_PLANS, and by their fallback
(dequantize + cuBLAS's float32 GEMM; the 3xTF32 kernel measured in between is gone, bench/RESULTS.md), and F16
matrices by the same kernels and cuBLAS's float32 GEMM (what they took before).
Each line is checked against the first of its group (the outputs must agree within float32 reassociation), so a
fast but wrong variant shows. `--calls` independent calls go into one evaluation; the median of `--repeats`
evaluations is reported. CUDA only (the kernels are).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial

import mlx.core as mx
import numpy as np

from ds4_mlx.kernels.formats.affine import to_affine
from ds4_mlx.kernels.prefill.batch import dense_matmul
from ds4_mlx.kernels.tensor_cores.dense_f16 import f16_affine_matmul, half_matmul
from ds4_mlx.kernels.tensor_cores.dense_wgmma import wgmma_affine_matmul, wgmma_half_matmul
from ds4_mlx.kernels.tensor_cores.grouped_gemm import expert_counts
from ds4_mlx.kernels.tensor_cores.grouped_raw import raw_grouped_gemm
from ds4_mlx.kernels.tensor_cores.grouped_wgmma import wgmma_grouped_gemm
from ds4_mlx.kernels.machinery.probe import random_activations, random_blocks
from ds4_mlx.model.gguf import GGMLType

EXPERTS, USED = 256, 6
RAW = {"gate/up IQ2_XXS": (GGMLType.IQ2_XXS, 2048, 4096), "down Q2_K": (GGMLType.Q2_K, 4096, 2048)}
DENSE = {"q_a": (1024, 4096), "q_b": (32768, 1024), "out_b": (4096, 8192), "shared gate": (2048, 4096)}
HALF = [(512, 4096), (8192, 1024)]
"""F16 matrices: a compressor's kv (the router's gate is 256 x 4096), the indexer's q_b."""
RAW_PLANS = ((64, 2, 3), (64, 2, 2), (32, 2, 3), (32, 2, 4), (64, 1, 3), (64, 1, 4))
"""(stage width TK, threadgroups an SM, stages of x in flight) of the raw-bank kernel (grouped_raw.py)."""
STAGES = (2, 3, 4)
"""Pipeline depths of the float16 dense kernel (dense_f16.py): groups of K in flight while one is multiplied."""
GROUPED_PLANS = ((3, 64, 3, 1), (3, 64, 3, 0), (3, 64, 4, 1), (3, 32, 3, 1), (2, 64, 3, 1))
"""grouped_wgmma.py's (warpgroups a threadgroup, stage width TK, stages of x, MINS): its defaults first."""
WGMMA_PLANS = ((0, 3, 3, 1, 4), (0, 4, 3, 1, 5), (0, 5, 3, 1, 6), (0, 3, 3, 0, 4), (1, 2, 2, 0, 4), (0, 2, 3, 1, 4))
"""dense_wgmma.py's (PIPELINE, AHEAD, WARPGROUPS, OVERLAP, STAGES): its PLAN first."""


def dense_float32(x: mx.array, weight) -> mx.array:
    return dense_matmul(x, weight, mx.float32)


ONCE = False
"""--once: every call evaluated once and not timed (bench/ncu_summary.py profiles those launches)."""


def per_call_ms(call: Callable[[], mx.array], calls: int, repeats: int) -> float:
    mx.eval(call())  # compile and check first
    if ONCE:
        mx.synchronize()
        return float("nan")
    times = []
    for _ in range(repeats):
        mx.synchronize()
        t0 = time.perf_counter()
        mx.eval(*[call() for _ in range(calls)])
        mx.synchronize()
        times.append((time.perf_counter() - t0) / calls)
    return 1e3 * statistics.median(times)


def report(name: str, flops: float, ms: float, error: float) -> None:
    print(f"{name:<34} {ms:8.3f} ms  {flops / ms / 1e9:7.1f} TFLOP/s  error vs first {error:.1e}", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--calls", type=int, default=4)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--once", action="store_true", help="each kernel's default plan once, untimed (for a profiler)")
    p.add_argument("--only", choices=("raw", "dense", "half"), help="only the routed experts, dense Q8_0 or F16 rows")
    args = p.parse_args()
    global ONCE, RAW_PLANS, STAGES, WGMMA_PLANS, GROUPED_PLANS
    if args.once:
        ONCE, RAW_PLANS, STAGES, WGMMA_PLANS = True, RAW_PLANS[1:2], STAGES[:1], WGMMA_PLANS[:1]
        GROUPED_PLANS = GROUPED_PLANS[:1]

    rng = np.random.default_rng(0)
    ids = np.sort(np.concatenate([rng.choice(EXPERTS, USED, replace=False) for _ in range(args.tokens)]))
    counts = expert_counts(mx.array(ids.astype(np.uint32)), EXPERTS)
    for name, (ggml_type, n_out, n_in) in RAW.items() if args.only in (None, "raw") else ():
        blocks = random_blocks(ggml_type, EXPERTS * n_out, n_in, seed=1).reshape(EXPERTS, -1)
        x = random_activations((ids.size, n_in), seed=2)
        mx.eval(blocks, x, counts)
        first = None
        for tk, groups, stages in RAW_PLANS:
            y = raw_grouped_gemm(x, blocks, counts, ggml_type, (EXPERTS, n_out, n_in), tk=tk, groups=groups,
                                 stages=stages)
            first = y if first is None else first
            error = (mx.abs(y - first).max() / mx.abs(first).max()).item()
            ms = per_call_ms(lambda: raw_grouped_gemm(x, blocks, counts, ggml_type, (EXPERTS, n_out, n_in), tk=tk,
                                                      groups=groups, stages=stages), args.calls, args.repeats)
            report(f"{name} TK={tk} groups={groups} stages={stages}", 2.0 * ids.size * n_out * n_in, ms, error)
        rows, tokens = None, x
        if ggml_type == GGMLType.IQ2_XXS:  # gate / up as the model runs them: each pair reads its token by index
            rows = mx.array((rng.permutation(ids.size) % args.tokens).astype(np.uint32))
            tokens = x[: args.tokens]
            first = raw_grouped_gemm(tokens, blocks, counts, ggml_type, (EXPERTS, n_out, n_in), rows)
            report(f"{name} mma gathered", 2.0 * ids.size * n_out * n_in, per_call_ms(
                lambda: raw_grouped_gemm(tokens, blocks, counts, ggml_type, (EXPERTS, n_out, n_in), rows),
                args.calls, args.repeats), 0.0)
        for warpgroups, tk, stages, mins in GROUPED_PLANS:
            if not mins and ggml_type != GGMLType.Q2_K:
                continue  # MINS is Q2_K's: IQ2_XXS has no mins

            def call() -> mx.array:
                return wgmma_grouped_gemm(tokens, blocks, counts, ggml_type, (EXPERTS, n_out, n_in), rows,
                                          warpgroups=warpgroups, tk=tk, stages=stages, mins=mins)
            error = (mx.abs(call() - first).max() / mx.abs(first).max()).item()
            report(f"{name} wgmma {warpgroups} {tk} {stages} {mins}{'' if rows is None else ' gathered'}",
                   2.0 * ids.size * n_out * n_in, per_call_ms(call, args.calls, args.repeats), error)
    for name, shape in DENSE.items() if args.only in (None, "dense") else ():
        weight = to_affine(random_blocks(GGMLType.Q8_0, *shape, seed=3), GGMLType.Q8_0, shape)
        x = random_activations((args.tokens, shape[1]), seed=4)
        mx.eval(weight.wq, x)
        first = None
        for kind, matmul in (*((f"f16 stages={n}", partial(f16_affine_matmul, stages=n)) for n in STAGES),
                             *((f"wgmma plan={''.join(map(str, plan))}", partial(wgmma_affine_matmul, plan=plan))
                               for plan in WGMMA_PLANS),
                             ("dequantize + cuBLAS float32", dense_float32)):
            y = matmul(x, weight)
            first = y if first is None else first
            error = (mx.abs(y - first).max() / mx.abs(first).max()).item()
            report(f"dense {name} {kind}", 2.0 * args.tokens * shape[0] * shape[1],
                   per_call_ms(lambda: matmul(x, weight), args.calls, args.repeats), error)
    for shape in HALF if args.only in (None, "half") else ():
        w = mx.array(np.random.default_rng(5).standard_normal(shape).astype(np.float16))
        x = random_activations((args.tokens, shape[1]), seed=6)
        first = None
        for kind, matmul in (*((f"f16 stages={n}", partial(half_matmul, stages=n)) for n in STAGES),
                             *((f"wgmma plan={''.join(map(str, plan))}", partial(wgmma_half_matmul, plan=plan))
                               for plan in WGMMA_PLANS),
                             ("cublas f32", lambda x, w: x @ w.astype(mx.float32).T)):
            y = matmul(x, w)
            first = y if first is None else first
            error = (mx.abs(y - first).max() / mx.abs(first).max()).item()
            report(f"F16 {shape[0]}x{shape[1]} {kind}", 2.0 * args.tokens * shape[0] * shape[1],
                   per_call_ms(lambda: matmul(x, w), args.calls, args.repeats), error)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
