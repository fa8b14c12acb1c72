"""The decode expert kernels (kernels/decode/experts.py) at Flash's shapes under other threadgroup counts: GPU µs a
call.

    python bench/expert_plans.py            # on the GPU machine (torch for CUPTI); ~1 min

Why: the routed experts' gate / up (IQ2_XXS, SwiGLU and input norm folded in) and down + slot sum (Q2_K) took 34
and 24 µs a layer in the 2026-12-02 decode profile, ~0.8 TB/s, a fifth of a decode token's GPU time. Their plans
spread one token over about GATE_UP_GROUPS and DOWN_GROUPS threadgroups (rows per threadgroup follow); this times
other counts as bench/matvec_plans.py times the matvec's plans (CUPTI, chained calls), each output checked against
the default count's.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from matvec_plans import CALLS, gpu_us

from ds4_mlx.kernels.decode import experts
from ds4_mlx.kernels.machinery.probe import random_activations, random_blocks
from ds4_mlx.model.gguf import GGMLType

EXPERTS = 32
"""Experts in the random banks: 6 of them a call, ~70 MB a bank, more than the H200's L2."""
K, FF, EMBD, CLAMP = 6, 2048, 4096, 10.0
COUNTS = (128, 256, 512, 1024, 2048)


def main() -> int:
    if not mx.cuda.is_available():
        raise SystemExit("expert_plans times the CUDA kernels: run it on the GPU machine")
    mx.set_default_device(mx.gpu)
    rng = np.random.default_rng(5)
    gate, up = (random_blocks(GGMLType.IQ2_XXS, EXPERTS * FF, EMBD, seed=s).reshape(EXPERTS, -1) for s in (1, 2))
    down = random_blocks(GGMLType.Q2_K, EXPERTS * EMBD, FF, seed=3).reshape(EXPERTS, -1)
    x = random_activations((1, EMBD), seed=4)
    norm = (1 + 0.1 * random_activations((EMBD,), seed=6), 1e-6)
    ids = [mx.array(rng.choice(EXPERTS, K, replace=False)[None].astype(np.int32)) for _ in range(CALLS + 1)]
    weights = mx.array(rng.uniform(0.1, 1.0, (1, K)).astype(np.float32))
    h = random_activations((K, FF), seed=7)
    mx.eval(gate, up, down, x, h, *ids)
    gate_up = experts.GateUpSwiglu(lambda g, u, w, c: g * u * w.reshape(-1, 1))
    down_sum = experts.DownSum(lambda y, k: y.reshape(-1, k, y.shape[-1]).sum(1))

    def gate_up_launch(i, groups, after=None):
        experts.GATE_UP_GROUPS = groups
        xi = x * (1 + i / CALLS) + (0 if after is None else 0 * after)
        return gate_up._kernel(xi, ids[i], weights, gate, up, GGMLType.IQ2_XXS, (EXPERTS, FF, EMBD), CLAMP, norm)

    def down_launch(i, groups, after=None):
        experts.DOWN_GROUPS = groups
        hi = h * (1 + i / CALLS) + (0 if after is None else 0 * after)
        return down_sum._kernel(hi, ids[i], down, GGMLType.Q2_K, (EXPERTS, EMBD, FF))

    for name, launch, kernel, default, tolerance in (
            ("gate / up IQ2_XXS", gate_up_launch, "gate_up_swiglu", 512, experts.GATE_UP_TOLERANCE),
            ("down + sum Q2_K", down_launch, "down_sum", 256, experts.TOLERANCE)):
        first = None
        for groups in (default,) + tuple(c for c in COUNTS if c != default):
            us, out = gpu_us(launch, groups, kernel)
            first = out if first is None else first
            error = float(mx.max(mx.abs(out - first)) / mx.max(mx.abs(first)))
            print(f"{name:>18} groups {groups:5d}: {us:7.2f} us{'  <- default' if groups == default else ''}"
                  f"{'' if error <= tolerance else f'  DIFFERS ({error:.1e})'}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
