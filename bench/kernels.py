"""Time each fast path against its reference on this device, at DeepSeek V4 Flash's shapes.

    python bench/kernels.py                 # the GPU (MLX's default device there)
    python bench/kernels.py --json --calls 64
    python bench/kernels.py --backend cpu --experts 16
    python bench/kernels.py --grouped-only --tokens 2048   # prefill: grouped experts and batch projections
    python bench/kernels.py --matvec-only                  # decode: the affine matvec kernel vs MLX's qmv

Each line is one operation at one shape: the reference (the blocks dequantized in MLX ops, then a matmul) and the
fast path (a custom kernel, or a built-in quantized matmul over the affine form), as microseconds per call and
the weight bytes read per second. `--calls` independent calls go into one evaluation so that the per-eval launch
and sync latency is spread over them; the median of `--repeats` evaluations is reported. Before timing, each fast
path's first-use check runs: a fast path that fails it (it would fall back in the model) is reported as such
and its kernel is still timed directly, so a wrong-but-fast kernel shows up as both.

The affine matvec rows (GPU backends) time kernels/decode/affine_matvec.py against the built-in quantized matmul it
replaces (`mx.quantized_matmul`, `mx.gather_qmm` for Q4_K experts) at every Q8_0 shape of a decode token, for one
token and five.

The prefill rows (GPU backends) time one chunk of `--tokens` tokens: a routed-expert projection over all its
(token, slot) pairs sorted by expert (kernels/prefill/grouped.py: dequantize into a float32 or bfloat16 scratch, then
one grouped GEMM) against the reference (slices of reference-dequantized experts), and a Q8_0 projection as dequantize
+ dense GEMM against MLX's quantized matmul. They also report TFLOP/s (2 * rows * OUT * IN per call).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass

import mlx.core as mx
import numpy as np

from ds4_mlx.kernels.formats.affine import AFFINE_GATHER, AFFINE_MATMUL, to_affine
from ds4_mlx.kernels.decode.affine_matvec import AFFINE_MATVEC, launch_plan
from ds4_mlx.kernels.prefill.batch import AFFINE_BATCH, dense_matmul
from ds4_mlx.kernels.prefill.grouped import (AFFINE_GROUPED, RAW_GROUPED, SLICE_BYTES, affine_scratch, expert_counts,
                                     grouped_swiglu, pair_inputs, scratch_matmul, sliced_reference, sort_by_expert)
from ds4_mlx.kernels.decode.iq2_xxs import IQ2_XXS_MATVEC
from ds4_mlx.kernels.decode.matvec import QuantMatvec, gathered_reference
from ds4_mlx.kernels.machinery.probe import random_activations, random_blocks
from ds4_mlx.kernels.decode.q2_k import Q2_K_MATVEC
from ds4_mlx.kernels.decode.mxfp4_matvec import MXFP4_MATVEC
from ds4_mlx.kernels.formats.quants import reference_matmul
from ds4_mlx.kernels.machinery.registry import KernelFallbackWarning, current_backend
from ds4_mlx.model.config import FLASH
from ds4_mlx.model.gguf import GGMLType


@dataclass(frozen=True)
class Timing:
    operation: str
    shape: str
    weight_bytes: int
    reference_us: float
    fast_us: float
    fast_path_used: bool
    max_relative_error: float
    flops: int = 0
    peak_gib: float = 0.0
    """Memory above what was allocated before the fast call (scratch and transients), where measured."""

    @property
    def speedup(self) -> float:
        return self.reference_us / self.fast_us


DEQUANTIZED_BYTES = 1 << 30
"""An evaluation holds at most about this many bytes of reference-dequantized float32 weights."""


def per_call_us(call: Callable[[], mx.array], calls: int, repeats: int, dequantized_bytes: int = 0) -> float:
    """Median over `repeats` of one evaluation of `calls` independent calls, divided by `calls`.

    Fewer calls go into one evaluation when each materializes `dequantized_bytes` of float32 weights.
    """
    calls = max(1, min(calls, DEQUANTIZED_BYTES // max(1, dequantized_bytes)))
    mx.eval([call() for _ in range(calls)])  # warm-up: compilation, allocation
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        mx.eval([call() for _ in range(calls)])
        times.append(time.perf_counter() - start)
    return statistics.median(times) / calls * 1e6


def relative_error(got: mx.array, want: mx.array) -> float:
    return (mx.abs(got - want).max() / mx.abs(want).max()).item()


def expert_kernel(matvec: QuantMatvec, n_out: int, n_in: int, args: argparse.Namespace) -> Timing:
    shape = (args.experts, n_out, n_in)
    blocks = random_blocks(matvec.ggml_type, args.experts * n_out, n_in, seed=1).reshape(args.experts, -1)
    ids = mx.array([(7 * i) % args.experts for i in range(args.pairs)], dtype=mx.int32)
    x = random_activations((args.pairs, n_in), seed=2)
    mx.eval(blocks)
    used = matvec.enabled(n_out, n_in)
    fast = matvec.fast_path.fast
    return Timing(
        operation=f"{matvec.ggml_type.name} experts matvec (top-{args.pairs} of {args.experts})",
        shape=f"{n_out}x{n_in}",
        weight_bytes=args.pairs * blocks.nbytes // args.experts,
        reference_us=per_call_us(lambda: gathered_reference(x, blocks, ids, matvec.ggml_type, shape), args.calls,
                                 args.repeats, 4 * args.pairs * n_out * n_in),
        fast_us=per_call_us(lambda: fast(x, blocks, ids, shape), args.calls, args.repeats),
        fast_path_used=used,
        max_relative_error=relative_error(fast(x, blocks, ids, shape),
                                          gathered_reference(x, blocks, ids, matvec.ggml_type, shape)),
    )


def affine_matmul(ggml_type: GGMLType, n_out: int, n_in: int, tokens: int, args: argparse.Namespace) -> Timing:
    shape = (n_out, n_in)
    blocks = random_blocks(ggml_type, n_out, n_in, seed=3)
    weight = to_affine(blocks, ggml_type, shape)
    x = random_activations((tokens, n_in), seed=4)
    mx.eval(blocks, weight.wq, weight.scales, weight.biases)
    return Timing(
        operation=f"{ggml_type.name} matmul, {tokens} token(s)",
        shape=f"{n_out}x{n_in}",
        weight_bytes=weight.nbytes,
        reference_us=per_call_us(lambda: reference_matmul(x, blocks, ggml_type, shape), args.calls, args.repeats,
                                 4 * n_out * n_in),
        fast_us=per_call_us(lambda: weight.matmul(x), args.calls, args.repeats),
        fast_path_used=AFFINE_MATMUL.enabled(ggml_type),
        max_relative_error=relative_error(weight.matmul(x), reference_matmul(x, blocks, ggml_type, shape)),
    )


def affine_experts(n_out: int, n_in: int, args: argparse.Namespace) -> Timing:
    ggml_type = GGMLType.Q4_K
    shape = (args.experts, n_out, n_in)
    blocks = random_blocks(ggml_type, args.experts * n_out, n_in, seed=5).reshape(args.experts, -1)
    weight = to_affine(blocks, ggml_type, shape)
    ids = mx.array([(7 * i) % args.experts for i in range(args.pairs)], dtype=mx.int32)
    x = random_activations((args.pairs, n_in), seed=6)
    mx.eval(blocks, weight.wq, weight.scales, weight.biases)
    return Timing(
        operation=f"Q4_K experts gather_qmm (top-{args.pairs} of {args.experts})",
        shape=f"{n_out}x{n_in}",
        weight_bytes=args.pairs * weight.nbytes // args.experts,
        reference_us=per_call_us(lambda: gathered_reference(x, blocks, ids, ggml_type, shape), args.calls,
                                 args.repeats, 4 * args.pairs * n_out * n_in),
        fast_us=per_call_us(lambda: weight.gather_matmul(x, ids), args.calls, args.repeats),
        fast_path_used=AFFINE_GATHER.enabled(ggml_type),
        max_relative_error=relative_error(weight.gather_matmul(x, ids),
                                          gathered_reference(x, blocks, ids, ggml_type, shape)),
    )


def affine_matvec_row(n_out: int, n_in: int, tokens: int, args: argparse.Namespace, experts: int = 0) -> Timing:
    """The affine matvec kernel against MLX's quantized matmul: a Q8_0 matrix, or with `experts` the selected
    `--pairs` of a Q4_K bank."""
    ggml_type = GGMLType.Q4_K if experts else GGMLType.Q8_0
    shape = (experts, n_out, n_in) if experts else (n_out, n_in)
    blocks = random_blocks(ggml_type, max(1, experts) * n_out, n_in, seed=17)
    weight = to_affine(blocks, ggml_type, shape)
    ids = mx.array([(7 * i) % experts for i in range(args.pairs)], dtype=mx.uint32) if experts else None
    x = random_activations((args.pairs if experts else tokens, n_in), seed=18)
    mx.eval(weight.wq, weight.scales, weight.biases, x)
    del blocks
    plan = launch_plan(n_out, n_in, weight.bits, tokens)
    key = (weight.bits, n_in, tokens, *plan)

    def built_in() -> mx.array:
        return weight.matmul(x) if ids is None else weight.gather_matmul(x, ids)

    def kernel() -> mx.array:
        return AFFINE_MATVEC.fast(x, weight, ids, plan)

    return Timing(
        operation=(f"Q4_K experts kernel vs gather_qmm (top-{args.pairs} of {experts})" if experts
                   else f"Q8_0 matvec kernel vs qmv, {tokens} token(s)"),
        shape=f"{n_out}x{n_in}",
        weight_bytes=args.pairs * weight.nbytes // experts if experts else weight.nbytes,
        reference_us=per_call_us(built_in, args.calls, args.repeats),
        fast_us=per_call_us(kernel, args.calls, args.repeats),
        fast_path_used=AFFINE_MATVEC.enabled(key),
        max_relative_error=relative_error(kernel(), built_in()),
    )


def matvec_rows(args: argparse.Namespace) -> list[Timing]:
    """Every Q8_0 matrix of a decode token (attention q_a, q_b, kv, output_b; shared expert gate/up, down; the LM
    head) at one token and five, and the Q4_K routed experts."""
    embd, ff = FLASH.n_embd, FLASH.n_ff_exp
    shapes = [(1024, embd), (32768, 1024), (512, embd), (embd, 8192), (ff, embd), (embd, ff), (FLASH.n_vocab, embd)]
    rows = [affine_matvec_row(n_out, n_in, tokens, args) for tokens in (1, 5) for n_out, n_in in shapes]
    return rows + [affine_matvec_row(n_out, n_in, 1, args, args.experts) for n_out, n_in in ((ff, embd), (embd, ff))]


def dtype_name(dtype: mx.Dtype) -> str:
    return str(dtype).rsplit(".", 1)[-1]


def sorted_pairs(args: argparse.Namespace) -> mx.array:
    """The sorted expert ids of a chunk: `--tokens` tokens, each routed to `--pairs` distinct random experts."""
    rng = np.random.default_rng(7)
    ids = np.stack([rng.choice(args.experts, args.pairs, replace=False) for _ in range(args.tokens)])
    return sort_by_expert(mx.array(ids.astype(np.int32)))[1]


def raw_grouped(ggml_type: GGMLType, n_out: int, n_in: int, dtype: mx.Dtype, args: argparse.Namespace) -> Timing:
    shape = (args.experts, n_out, n_in)
    blocks = random_blocks(ggml_type, args.experts * n_out, n_in, seed=8).reshape(args.experts, -1)
    ids = sorted_pairs(args)
    counts = expert_counts(ids, args.experts)
    x = random_activations((ids.size, n_in), seed=9)
    mx.eval(blocks, ids, counts, x)
    grouped = RAW_GROUPED[ggml_type].fast_paths[dtype]
    fast = grouped.fast

    def reference() -> mx.array:
        return sliced_reference(x, blocks, ids, ggml_type, shape)

    scratch_bytes = 4 * args.experts * n_out * n_in
    return Timing(
        operation=f"{ggml_type.name} grouped, {dtype_name(dtype)} scratch ({args.tokens} tok x top-{args.pairs})",
        shape=f"{n_out}x{n_in}",
        weight_bytes=blocks.nbytes,
        reference_us=per_call_us(reference, 1, args.repeats, SLICE_BYTES),
        fast_us=per_call_us(lambda: fast(x, blocks, ids, counts, shape), args.calls, args.repeats, scratch_bytes),
        fast_path_used=grouped.enabled((n_out, n_in)),
        max_relative_error=relative_error(fast(x, blocks, ids, counts, shape), reference()),
        flops=2 * ids.size * n_out * n_in,
    )


def affine_grouped_row(n_out: int, n_in: int, dtype: mx.Dtype, args: argparse.Namespace) -> Timing:
    ggml_type = GGMLType.Q4_K
    shape = (args.experts, n_out, n_in)
    blocks = random_blocks(ggml_type, args.experts * n_out, n_in, seed=10).reshape(args.experts, -1)
    weight = to_affine(blocks, ggml_type, shape)
    ids = sorted_pairs(args)
    x = random_activations((ids.size, n_in), seed=11)
    mx.eval(blocks, weight.wq, weight.scales, weight.biases, ids, x)

    def old() -> mx.array:  # what prefill would do without a scratch: gather_qmm over the sorted pairs
        return mx.gather_qmm(x[:, None, :], weight.wq, weight.scales, weight.biases, rhs_indices=ids, transpose=True,
                             group_size=32, bits=4, sorted_indices=True)[:, 0, :]

    def fast() -> mx.array:
        return scratch_matmul(x, affine_scratch(weight, dtype), ids)

    return Timing(
        operation=f"Q4_K grouped, {dtype_name(dtype)} scratch vs gather_qmm ({args.tokens} tok)",
        shape=f"{n_out}x{n_in}",
        weight_bytes=weight.nbytes,
        reference_us=per_call_us(old, 1, args.repeats),
        fast_us=per_call_us(fast, args.calls, args.repeats, 4 * args.experts * n_out * n_in),
        fast_path_used=AFFINE_GROUPED[dtype].enabled(ggml_type),
        max_relative_error=relative_error(fast(), old()),
        flops=2 * ids.size * n_out * n_in,
    )


def batch_projection(n_out: int, n_in: int, dtype: mx.Dtype, args: argparse.Namespace) -> Timing:
    ggml_type = GGMLType.Q8_0
    blocks = random_blocks(ggml_type, n_out, n_in, seed=12)
    weight = to_affine(blocks, ggml_type, (n_out, n_in))
    x = random_activations((args.tokens, n_in), seed=13)
    mx.eval(blocks, weight.wq, weight.scales, weight.biases, x)
    return Timing(
        operation=f"Q8_0 dequantize + {dtype_name(dtype)} GEMM vs qmm ({args.tokens} tok)",
        shape=f"{n_out}x{n_in}",
        weight_bytes=weight.nbytes,
        reference_us=per_call_us(lambda: weight.matmul(x), args.calls, args.repeats),
        fast_us=per_call_us(lambda: dense_matmul(x, weight, dtype), args.calls, args.repeats, 4 * n_out * n_in),
        fast_path_used=AFFINE_BATCH[dtype].enabled(ggml_type),
        max_relative_error=relative_error(dense_matmul(x, weight, dtype), reference_matmul(x, blocks, ggml_type,
                                                                                             (n_out, n_in))),
        flops=2 * args.tokens * n_out * n_in,
    )


def moe_layer(dtype: mx.Dtype, args: argparse.Namespace) -> Timing:
    """One q2 MoE layer of a chunk: sort, gate and up (IQ2_XXS), SwiGLU, down (Q2_K), unsort and sum, as
    `RoutedExperts._grouped` runs it; the peak memory above the inputs shows the scratch bound."""
    embd, ff, n_expert = FLASH.n_embd, FLASH.n_ff_exp, args.experts
    banks = {name: (ggml_type, (n_expert, n_out, n_in),
                    random_blocks(ggml_type, n_expert * n_out, n_in, seed=14 + i).reshape(n_expert, -1))
             for i, (name, ggml_type, n_out, n_in) in enumerate((("gate", GGMLType.IQ2_XXS, ff, embd),
                                                                  ("up", GGMLType.IQ2_XXS, ff, embd),
                                                                  ("down", GGMLType.Q2_K, embd, ff)))}
    rng = np.random.default_rng(15)
    ids = mx.array(np.stack([rng.choice(n_expert, args.pairs, replace=False) for _ in range(args.tokens)]).astype(
        np.int32))
    weights = mx.array(rng.uniform(0.1, 1.5, (args.tokens, args.pairs)).astype(np.float32))
    x = random_activations((args.tokens, embd), seed=16)
    mx.eval(x, ids, weights, *(blocks for _, _, blocks in banks.values()))

    def projection(name: str, fast: bool):
        ggml_type, shape, blocks = banks[name]
        path = RAW_GROUPED[ggml_type].fast_paths[dtype]

        def run(x, rows, sorted_ids, counts, after):
            xs = pair_inputs(x, rows)
            if not fast:
                return sliced_reference(xs, blocks, sorted_ids, ggml_type, shape)
            return path.fast(xs, mx.depends([blocks], [after])[0], sorted_ids, counts, shape)
        return run

    def layer(fast: bool) -> mx.array:
        return grouped_swiglu(x, ids, weights, *(projection(n, fast) for n in ("gate", "up", "down")),
                              lambda g, u, w: mx.minimum(g, 10) * mx.sigmoid(mx.minimum(g, 10)) * mx.clip(u, -10, 10)
                              * w[:, None],
                              n_expert)

    mx.synchronize()
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    mx.eval(layer(True))
    peak = (mx.get_peak_memory() - before) / 2**30
    return Timing(
        operation=f"q2 MoE layer, {dtype_name(dtype)} scratch ({args.tokens} tok x top-{args.pairs})",
        shape=f"{n_expert}x{ff}x{embd}",
        weight_bytes=sum(blocks.nbytes for _, _, blocks in banks.values()),
        reference_us=per_call_us(lambda: layer(False), 1, args.repeats, SLICE_BYTES),
        fast_us=per_call_us(lambda: layer(True), 1, args.repeats),
        fast_path_used=all(RAW_GROUPED[t].fast_paths[dtype].enabled(shape[1:]) for t, shape, _ in banks.values()),
        max_relative_error=relative_error(layer(True), layer(False)),
        flops=3 * 2 * ids.size * ff * embd,
        peak_gib=peak,
    )


def prefill_rows(args: argparse.Namespace) -> list[Timing]:
    """Grouped experts (gate/up IQ2_XXS, down Q2_K, Q4_K) and a batch projection, float32 then bfloat16."""
    embd, ff = FLASH.n_embd, FLASH.n_ff_exp
    rows = []
    for dtype in (mx.float32, mx.bfloat16):
        rows += [
            raw_grouped(GGMLType.IQ2_XXS, ff, embd, dtype, args),
            raw_grouped(GGMLType.Q2_K, embd, ff, dtype, args),
            affine_grouped_row(ff, embd, dtype, args),
            batch_projection(embd, embd, dtype, args),
            moe_layer(dtype, args),
        ]
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--backend", choices=["cpu", "gpu"], help="MLX device (default: MLX's default device)")
    p.add_argument("--experts", type=int, default=FLASH.n_expert, help="experts per bank (default 256)")
    p.add_argument("--pairs", type=int, default=FLASH.n_expert_used, help="selected experts per call (default 6)")
    p.add_argument("--calls", type=int, default=32, help="independent calls per evaluation (default 32)")
    p.add_argument("--repeats", type=int, default=5, help="timed evaluations; the median is kept (default 5)")
    p.add_argument("--tokens", type=int, default=2048, help="prefill chunk of the prefill rows (default 2048)")
    p.add_argument("--grouped-only", action="store_true", help="only the prefill rows (GPU backends)")
    p.add_argument("--matvec-only", action="store_true", help="only the affine matvec rows (GPU backends)")
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    args = p.parse_args(argv)
    if args.backend:
        mx.set_default_device(mx.gpu if args.backend == "gpu" else mx.cpu)
    embd, ff = FLASH.n_embd, FLASH.n_ff_exp
    with warnings.catch_warnings(record=True) as fallbacks:
        warnings.simplefilter("always", KernelFallbackWarning)
        timings = []
        gpu = current_backend() in IQ2_XXS_MATVEC.fast_path.backends
        if not gpu:
            print(f"no custom kernels on the {current_backend()} backend: the affine paths only", file=sys.stderr)
        if gpu and not args.grouped_only:
            timings += matvec_rows(args)
        if gpu and not (args.grouped_only or args.matvec_only):
            timings += [
                expert_kernel(IQ2_XXS_MATVEC, ff, embd, args),  # gate / up
                expert_kernel(Q2_K_MATVEC, embd, ff, args),  # down
                expert_kernel(MXFP4_MATVEC, ff, embd, args),  # 0731's MXFP4 gate / up
            ]
        if not (args.grouped_only or args.matvec_only):
            timings += [
                affine_experts(ff, embd, args),
                affine_matmul(GGMLType.Q8_0, embd, embd, 1, args),
                affine_matmul(GGMLType.Q8_0, FLASH.n_vocab, embd, 1, args),  # LM head
                affine_matmul(GGMLType.Q8_0, embd, embd, 512, args),
            ]
        if gpu and not args.matvec_only:
            timings += prefill_rows(args)
    for warning in fallbacks:
        print(f"fallback: {warning.message}", file=sys.stderr)
    print(f"backend {current_backend()}, device {mx.default_device()}, MLX {mx.__version__}", file=sys.stderr)
    for t in timings:
        if args.json:
            print(json.dumps({**asdict(t), "speedup": t.speedup, "backend": current_backend()}))
        else:
            rate = t.weight_bytes / (t.fast_us * 1e-6) / 1e9
            compute = f", {t.flops / (t.fast_us * 1e-6) / 1e12:5.1f} TFLOP/s" if t.flops else ""
            compute += f", peak +{t.peak_gib:.2f} GiB" if t.peak_gib else ""
            print(f"{t.operation:48s} {t.shape:>11s}  reference {t.reference_us:9.1f} us  fast {t.fast_us:8.1f} us "
                  f"({t.speedup:5.1f}x, {rate:6.1f} GB/s{compute})  used: {'yes' if t.fast_path_used else 'NO'}  "
                  f"max rel. error {t.max_relative_error:.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
