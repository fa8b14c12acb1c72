"""The H200's mma.sync ceiling for the prefill GEMMs' instruction (mma.m16n8k16, float16 in, float32 sums): TFLOP/s
of a kernel doing nothing else, by warps an SM, with 16 independent accumulators a warp.

    python bench/mma_ceiling.py      # on the GPU machine, ~20 s

Why: dense_f16.py's and grouped_raw.py's GEMMs issue two mma per product (x split in two halves), and their useful
TFLOP/s (bench/prefill_gemms.py) only mean something against what the instruction itself can do at their occupancy
(8 warps an SM for dense_f16, 16 for grouped_raw). CUDA only.
"""

from __future__ import annotations

import mlx.core as mx

from ds4_mlx.kernels.machinery.dialect import Kernel, build
from prefill_gemms import per_call_ms

_SOURCE = """
const int tid = THREAD_IN_GROUP;
const unsigned int a[4] = {seed[0] ^ (unsigned int)tid, seed[1], seed[2], seed[3]};
const unsigned int b[2] = {seed[4], seed[5]};
float acc[16][4] = {};
for (int s = 0; s < STEPS; ++s) {
  #pragma unroll
  for (int j = 0; j < 16; ++j) {
    ds4_mma_f16_16x8x16(acc[j], a, b);
  }
}
float sum = 0.0f;
#pragma unroll
for (int j = 0; j < 16; ++j) {
  sum += acc[j][0] + acc[j][1] + acc[j][2] + acc[j][3];
}
out[GROUP_X * THREADS + tid] = sum;
"""
KERNEL = Kernel("ds4_mma_ceiling", ("seed",), ("out",), _SOURCE)
STEPS, THREADS, SMS = 2048, 256, 132


def main() -> int:
    if not mx.cuda.is_available():
        raise SystemExit("mma_ceiling times a CUDA kernel: run it on the GPU machine")
    mx.set_default_device(mx.gpu)
    seed = mx.array([0x3C003C00, 0x3C003C00, 0x38003800, 0x38003800, 0x34003400, 0x34003400], dtype=mx.uint32)
    for per_sm in (1, 2, 4):
        groups = SMS * per_sm * 4

        def call() -> mx.array:
            (out,) = build(KERNEL, "cuda")(inputs=[seed], template=[("STEPS", STEPS), ("THREADS", THREADS)],
                                           grid=(groups * THREADS, 1, 1), threadgroup=(THREADS, 1, 1),
                                           output_shapes=[(groups * THREADS,)], output_dtypes=[mx.float32])
            return out

        ms = per_call_ms(call, 4, 5)
        flops = groups * (THREADS // 32) * STEPS * 16 * 16 * 8 * 16 * 2
        print(f"{per_sm * THREADS // 32:3d} warps an SM (4 waves): {ms:8.3f} ms  {flops / ms / 1e9:7.1f} TFLOP/s",
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
