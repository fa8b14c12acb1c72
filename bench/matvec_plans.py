"""The decode matvec kernel (kernels/affine_matvec.py) at Flash's shapes under every launch plan: µs a call and GB/s.

    python bench/matvec_plans.py            # on the GPU machine; ~1 min
    python bench/matvec_plans.py --json

Why: a decode token is ~12 ms of GPU work on the H200, and its 8-bit matvecs take 15-18 µs a call where the
weights alone would take 2-7 µs at the GPU's bandwidth (bench/RESULTS.md, session 6 trace). `launch_plan` picks
rows per threadgroup and SIMD groups per threadgroup by a rule (at least MIN_THREADGROUPS threadgroups); this
times every plan, with the input norm folded in as the model calls it, so the rule can follow measurements. Each
plan's output is checked against the first plan's (the kernel at another plan sums in another order: TOLERANCE).
"""

from __future__ import annotations

import argparse
import json
import time

import mlx.core as mx
import numpy as np

from ds4_mlx.kernels.affine import to_affine
from ds4_mlx.kernels.affine_matvec import TOLERANCE, _kernel, launch_plan
from ds4_mlx.kernels.probe import random_activations, random_blocks
from ds4_mlx.model.gguf import GGMLType

SHAPES = [(4096, 1536, True), (4096, 4096, True), (8192, 4096, False), (2048, 4096, False), (4096, 129280, True)]
"""(IN, OUT, input norm folded in): a ratio-128 layer's joined input projections, a ratio-4 layer's (about),
the output projection, the shared expert's down (as a plain matvec), the LM head."""
PLANS = [(rows, simds) for rows in (1, 2, 4) for simds in (1, 2, 4, 8)]
CALLS = 64
"""Independent calls per evaluation: the launches' own cost is shared, as in a compiled decode step's graph."""


def time_plan(x: mx.array, weight, plan: tuple[int, int], norm) -> tuple[float, mx.array]:
    """Median µs a call over 5 evaluations of CALLS calls, and one call's output."""
    xs = [x * (1 + i / CALLS) for i in range(CALLS)]
    mx.eval(xs)
    out = _kernel(xs[0], weight, None, plan, norm)
    mx.eval(out)
    times = []
    for _ in range(5):
        t = time.perf_counter()
        mx.eval([_kernel(v, weight, None, plan, norm) for v in xs])
        times.append((time.perf_counter() - t) / CALLS * 1e6)
    return float(np.median(times)), out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if not mx.cuda.is_available():
        raise SystemExit("matvec_plans times the CUDA kernel: run it on the GPU machine")
    mx.set_default_device(mx.gpu)
    for n_in, n_out, normed in SHAPES:
        weight = to_affine(random_blocks(GGMLType.Q8_0, n_out, n_in, seed=1), GGMLType.Q8_0, (n_out, n_in))
        x = random_activations((1, n_in), seed=2)
        norm = (1 + 0.1 * random_activations((n_in,), seed=3), 1e-6) if normed else None
        mx.eval(weight.wq, weight.scales, weight.biases, x)
        nbytes = weight.wq.nbytes + weight.scales.nbytes + weight.biases.nbytes
        chosen = launch_plan(n_out, n_in, 8, 1)
        first = None
        for plan in PLANS:
            us, out = time_plan(x, weight, plan, norm)
            first = out if first is None else first
            error = float(mx.max(mx.abs(out - first)) / mx.max(mx.abs(first)))
            row = {"in": n_in, "out": n_out, "norm": normed, "rows": plan[0], "simds": plan[1], "us": round(us, 2),
                   "gb_per_s": round(nbytes / us / 1e3, 1), "chosen": plan == chosen, "rel_error": error,
                   "ok": error <= TOLERANCE}
            if args.json:
                print(json.dumps(row), flush=True)
            else:
                print(f"{n_in:>5} -> {n_out:<6} rows {plan[0]} simds {plan[1]}: {us:8.2f} us "
                      f"{row['gb_per_s']:7.1f} GB/s{'  <- launch_plan' if row['chosen'] else ''}"
                      f"{'' if row['ok'] else '  DIFFERS'}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
