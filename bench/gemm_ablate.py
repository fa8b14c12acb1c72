"""Where a prefill GEMM's time goes, without a profiler: the kernel timed again with one part taken out at a time.

    python bench/gemm_ablate.py                  # dense Q8_0 q_b and out_b, raw Q2_K down, 4096-token chunk

Each variant is the kernel's own text with one piece replaced (the replacement must be found, or the variant is
refused): the drain of each group's partial sums into the accumulators, the barrier of each stage, the next
stage's loads, the mma themselves (a cheap use of the same fragments in their place), the lo pass, the W decode.
A variant computes wrong results (that is the point); what it saves against the whole kernel is what that part
costs where nothing else hides it. CUDA only; the variants are compiled once each (NVRTC).
"""

from __future__ import annotations

import argparse
from dataclasses import replace

import mlx.core as mx
import numpy as np

from ds4_mlx.kernels.tensor_cores import dense_f16, grouped_raw
from ds4_mlx.kernels.formats.affine import to_affine
from ds4_mlx.kernels.tensor_cores.grouped_gemm import expert_counts
from ds4_mlx.kernels.machinery.probe import random_activations, random_blocks
from ds4_mlx.model.gguf import GGMLType
from prefill_gemms import EXPERTS, USED, per_call_ms

DENSE_CUTS = {
    "drain": [("acc[i][j][c] = fmaf(sc[n], part[i][j][c], acc[i][j][c]);", ""),
              ("ds4_mma_f16_16x8x16(part[i][j], a, b[j]);", "ds4_mma_f16_16x8x16(acc[i][j], a, b[j]);")],
    "barrier": [("  ds4_barrier();\n  if (s + STAGES - 1 < groups)", "  if (s + STAGES - 1 < groups)")],
    "loads": [("if (s + STAGES - 1 < groups) {\n    load_stage(s + STAGES - 1);", "if (false) {\n    load_stage(s);")],
    "mma": [("ds4_mma_f16_16x8x16(part[i][j], a, b[j]);", "part[i][j][0] += __uint_as_float(a[0] ^ b[j][0]);")],
    "lo pass": [("for (int half = 0; half < 2; ++half)", "for (int half = 1; half < 2; ++half)")],
}
"""Parts of dense_f16's kernel: (text, replacement) pairs that take each out. Without the drain, the mma accumulate
into the float32 accumulators directly (what a kernel with no per-group scale would do)."""
DENSE_PIN = 116 * 1024
"""Dynamic threadgroup memory every dense variant asks for, so that one threadgroup an SM runs, as the whole
kernel's registers allow (a variant with fewer registers would otherwise run more and time something else)."""
DENSE_SETS = [(), ("drain",), ("barrier",), ("loads",), ("mma",), ("lo pass",), ("drain", "barrier"),
              ("drain", "lo pass"), ("drain", "barrier", "loads"), ("drain", "barrier", "loads", "lo pass")]

RAW_CUTS = {
    "drain": [("acc[i][j][c] = fmaf(wsc[n], part[i][j][c], acc[i][j][c]);", ""),
              ("acc[i][j][c] = fmaf(-wml[n], xsum[i][c], acc[i][j][c]);", ""),
              ("ds4_mma_f16_16x8x16(part[i][j], al[i], bw[j]);", "ds4_mma_f16_16x8x16(acc[i][j], al[i], bw[j]);"),
              ("ds4_mma_f16_16x8x16(part[i][j], ah[i], bw[j]);", "ds4_mma_f16_16x8x16(acc[i][j], ah[i], bw[j]);")],
    "xsum": [("ds4_mma_f16_16x8x16(xsum[i], al[i], ones);", ""), ("ds4_mma_f16_16x8x16(xsum[i], ah[i], ones);", "")],
    "decode": [(grouped_raw._Q2_K_STORE, "")],
    "w loads": [(grouped_raw._Q2_K_LOAD, "")],
    "barrier": [("  ds4_async_wait_keep<STAGES - 2>();\n  ds4_barrier();", "  ds4_async_wait_keep<STAGES - 2>();")],
    "mma": [("ds4_mma_f16_16x8x16(part[i][j], al[i], bw[j]);",
             "part[i][j][0] += __uint_as_float(al[i][0] ^ bw[j][0]);"),
            ("ds4_mma_f16_16x8x16(part[i][j], ah[i], bw[j]);",
             "part[i][j][1] += __uint_as_float(ah[i][0] ^ bw[j][1]);")],
}
"""Parts of grouped_raw's Q2_K kernel."""
RAW_PIN = 76 * 1024
"""The same for the raw kernel's two threadgroups an SM."""
RAW_SETS = [(), ("drain",), ("xsum",), ("drain", "xsum"), ("decode",), ("decode", "w loads"), ("barrier",), ("mma",),
            ("drain", "xsum", "decode", "w loads")]


def tag(names: tuple[str, ...]) -> str:
    """A variant's name part (the kernel cache keys compiled kernels by name)."""
    return "_".join(n.replace(" ", "") for n in names) or "nothing"


def cut(source: str, cuts: dict, names: tuple[str, ...]) -> str:
    """The source with the parts named taken out, in `cuts`'s order."""
    for name in [n for n in cuts if n in names]:
        for old, new in cuts[name]:
            if old not in source:
                raise SystemExit(f"variant '{name}': its text is not in the kernel any more")
            source = source.replace(old, new)
    return source


def dense(tokens: int, calls: int, repeats: int) -> None:
    base = dense_f16.kernel
    for name, shape in {"q_b": (32768, 1024), "out_b": (4096, 8192)}.items():
        weight = to_affine(random_blocks(GGMLType.Q8_0, *shape, seed=3), GGMLType.Q8_0, shape)
        x = random_activations((tokens, shape[1]), seed=4)
        mx.eval(weight.wq, x)
        flops = 2.0 * tokens * shape[0] * shape[1]
        for names in DENSE_SETS:
            k = base(8)
            variant = replace(k, name=f"{k.name}_without_{tag(names)}", source=cut(k.source, DENSE_CUTS, names),
                              shared_memory=max(k.shared_memory, DENSE_PIN))
            dense_f16.kernel = lambda bits, stages=dense_f16.STAGES, v=variant: v
            try:
                ms = per_call_ms(lambda: dense_f16.f16_affine_matmul(x, weight), calls, repeats)
            finally:
                dense_f16.kernel = base
            print(f"dense {name:<6} without {' + '.join(names) or 'nothing':<34} {ms:7.3f} ms "
                  f"{flops / ms / 1e9:6.1f} TFLOP/s", flush=True)


def raw(tokens: int, calls: int, repeats: int) -> None:
    base = grouped_raw.kernel
    rng = np.random.default_rng(0)
    ids = np.sort(np.concatenate([rng.choice(EXPERTS, USED, replace=False) for _ in range(tokens)]))
    counts = expert_counts(mx.array(ids.astype(np.uint32)), EXPERTS)
    n_out, n_in = 4096, 2048
    blocks = random_blocks(GGMLType.Q2_K, EXPERTS * n_out, n_in, seed=1).reshape(EXPERTS, -1)
    x = random_activations((ids.size, n_in), seed=2)
    mx.eval(blocks, x, counts)
    flops = 2.0 * ids.size * n_out * n_in
    for names in RAW_SETS:
        k = base(GGMLType.Q2_K)
        variant = replace(k, name=f"{k.name}_without_{tag(names)}", source=cut(k.source, RAW_CUTS, names),
                          shared_memory=max(k.shared_memory, RAW_PIN))
        grouped_raw.kernel = lambda *a, v=variant, **kw: v
        try:
            ms = per_call_ms(lambda: grouped_raw.raw_grouped_gemm(x, blocks, counts, GGMLType.Q2_K,
                                                                  (EXPERTS, n_out, n_in)), calls, repeats)
        finally:
            grouped_raw.kernel = base
        print(f"raw Q2_K down without {' + '.join(names) or 'nothing':<34} {ms:7.3f} ms "
              f"{flops / ms / 1e9:6.1f} TFLOP/s", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--calls", type=int, default=4)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    dense(args.tokens, args.calls, args.repeats)
    raw(args.tokens, args.calls, args.repeats)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
