"""The decode matvec kernel (kernels/decode/affine_matvec.py) at Flash's shapes under every launch plan: GPU µs a call,
GB/s.

    python bench/matvec_plans.py            # on the GPU machine (torch for CUPTI); ~1 min
    python bench/matvec_plans.py --json
    python bench/matvec_plans.py --cold --chosen   # weights read from memory (as in a decode step), chosen plans

Why: a decode token is ~12 ms of GPU work on the H200, and its 8-bit matvecs take 15-18 µs a call where the
weights alone would take 2-7 µs at the GPU's bandwidth (bench/RESULTS.md, 2026-12-02 trace). `launch_plan` picks
rows per threadgroup and SIMD groups per threadgroup by a rule (at least MIN_THREADGROUPS threadgroups); this
times every plan as the model calls it (input norm folded in, the grouped output projection over its bank, the
shared expert's down with its SwiGLU), so the rule can follow measurements. Times are the kernels' own on the GPU
(CUPTI through torch.profiler): a compiled decode step's launches cost host time apart from them. Each plan's
output is checked against the first plan's (the kernel at another plan sums in another order: TOLERANCE).
"""

from __future__ import annotations

import argparse
import collections
import json

import mlx.core as mx
import numpy as np

from ds4_mlx.kernels.formats.affine import AffineWeight, to_affine
from ds4_mlx.kernels.decode.affine_matvec import TOLERANCE, SwigluMatvec, _kernel, launch_plan
from ds4_mlx.kernels.machinery.probe import random_activations, random_blocks
from ds4_mlx.model.gguf import GGMLType

SHAPES = [("q_a + kv", 4096, 1536, "norm"), ("shared gate / up", 4096, 4096, "norm"), ("q_b", 1024, 32768, "norm"),
          ("o_a (8 groups)", 4096, 1024, "bank"), ("o_b", 8192, 4096, ""), ("shared down", 2048, 4096, "swiglu"),
          ("LM head", 4096, 129280, "norm")]
"""(name, IN, OUT, form): the model's 8-bit decode matvecs, as the compiled step launches them (bench/RESULTS.md,
the 2026-12-02 profile): normed, plain, over the output projection's bank of 8 groups, or with the SwiGLU input."""
PLANS = [(rows, simds) for rows in (1, 2, 4, 8) for simds in (1, 2, 4, 8)]
CALLS = 32
GROUPS = 8
COLD_GB = 0.25


def gpu_us(launch, plan, kernel: str = "affine_matvec") -> tuple[float, mx.array]:
    """Median GPU µs of one launch (the kernels whose names hold `kernel`) over CALLS launches in one evaluation
    (after one untimed), and the first launch's output. Each launch's x waits for the previous output (x + 0 *
    y[0]): independent launches would run side by side in MLX's CUDA graph and stretch each other's times, which
    a decode step's chain does not."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    out = launch(0, plan)
    mx.eval(out)
    torch.zeros(1, device="cuda")
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        y = out
        for i in range(CALLS):
            y = launch(i + 1, plan, y.reshape(-1)[:1])
        mx.eval(y)
    times = collections.defaultdict(list)
    for event in prof.events():
        if event.device_type.name == "CUDA" and kernel in event.name:
            times[event.name].append(getattr(event, "device_time", None) or getattr(event, "cuda_time", 0))
    longest = max(times.values(), key=len)  # the matvec's launches (a copy of x, if any, is another name)
    return float(np.median(longest)), out


def launcher(n_in: int, n_out: int, form: str, cold_gb: float = 0.0):
    """launch(i, plan, after): the i-th call's output (x scaled by i, so that no two calls are one graph node;
    after `after` where given), and the bytes of weights a call reads. Cold: the calls take turns over copies of
    the weights that together pass `cold_gb` GB, so each reads its matrix from memory, as a decode step does (the
    H200's 50 MB L2 otherwise holds every Flash matrix but the LM head between calls)."""
    matrices = GROUPS if form == "bank" else 1
    weight = to_affine(random_blocks(GGMLType.Q8_0, matrices * n_out, n_in, seed=1), GGMLType.Q8_0,
                       (matrices, n_out, n_in) if form == "bank" else (n_out, n_in))
    nbytes = weight.wq.nbytes + weight.scales.nbytes + weight.biases.nbytes
    copies = [weight] + [AffineWeight(weight.wq + 0, weight.scales + 0, weight.biases + 0, weight.bits)
                         for _ in range(max(0, -(-int(cold_gb * 2**30) // nbytes) - 1))]
    x = random_activations((matrices, 2 * n_in if form == "swiglu" else n_in), seed=2)
    norm = (1 + 0.1 * random_activations((n_in,), seed=3), 1e-6) if form == "norm" else None
    ids = mx.arange(GROUPS, dtype=mx.uint32) if form == "bank" else None
    mx.eval([(w.wq, w.scales, w.biases) for w in copies], x)
    swiglu = SwigluMatvec(lambda g, u, c: mx.sigmoid(g) * g * u)

    def launch(i: int, plan: tuple[int, int], after: mx.array | None = None) -> mx.array:
        xi = x * (1 + i / CALLS) + (0 if after is None else 0 * after)
        w = copies[i % len(copies)]
        if form == "swiglu":
            return swiglu._kernel(xi, w, 10.0, plan)
        return _kernel(xi, w, ids, plan, norm)

    return launch, nbytes


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true")
    p.add_argument("--cold", action="store_const", const=COLD_GB, default=0.0, dest="cold_gb",
                   help=f"each call reads its weights from memory, not the L2 (copies over {COLD_GB} GB)")
    p.add_argument("--cold-gb", type=float, dest="cold_gb", help="the same with copies over this many GB")
    p.add_argument("--chosen", action="store_true", help="only the plan launch_plan chooses, at each shape")
    args = p.parse_args()
    if not mx.cuda.is_available():
        raise SystemExit("matvec_plans times the CUDA kernel: run it on the GPU machine")
    mx.set_default_device(mx.gpu)
    for name, n_in, n_out, form in SHAPES:
        launch, nbytes = launcher(n_in, n_out, form, args.cold_gb)
        chosen = launch_plan(n_out, n_in, 8, 1)
        first, best = None, None
        for plan in [chosen] if args.chosen else PLANS:
            us, out = gpu_us(launch, plan)
            first = out if first is None else first
            error = float(mx.max(mx.abs(out - first)) / mx.max(mx.abs(first)))
            best = min(best or (us, plan), (us, plan))
            row = {"name": name, "in": n_in, "out": n_out, "form": form, "rows": plan[0], "simds": plan[1],
                   "us": round(us, 2), "gb_per_s": round(nbytes / us / 1e3, 1), "chosen": plan == chosen,
                   "rel_error": error, "ok": error <= TOLERANCE}
            if args.json:
                print(json.dumps(row), flush=True)
            else:
                print(f"{name:>16} {n_in:>5} -> {n_out:<6} rows {plan[0]} simds {plan[1]}: {us:7.2f} us "
                      f"{row['gb_per_s']:7.1f} GB/s{'  <- launch_plan' if row['chosen'] else ''}"
                      f"{'' if row['ok'] else '  DIFFERS'}", flush=True)
        if not args.json:
            print(f"{name:>16} {n_in:>5} -> {n_out:<6} rows {best[1][0]} simds {best[1][1]}: {best[0]:7.2f} us "
                  f"{nbytes / best[0] / 1e3:7.1f} GB/s  best", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
