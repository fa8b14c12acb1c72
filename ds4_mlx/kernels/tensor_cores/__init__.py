"""CUDA only: prefill's GEMMs on NVIDIA tensor cores at float32 accuracy, and the grouped GEMMs MLX lacks there.

Metal and the CPU never launch these (their `prefill` paths use MLX's GEMMs).
- `halfsplit`: x scaled per row and split into two float16 halves, the shared trick that gives float32 accuracy on
  float16 tensor cores (row-major, mma fragment and wgmma tile layouts);
- `dense_f16` (mma.m16n8k16) and `dense_wgmma` (Hopper's wgmma, sm_90, 8-bit weights): a chunk's affine Q8_0 /
  Q4_K and F16 projections straight from the stored weights;
- `grouped_raw` (mma) and `grouped_wgmma` (wgmma, taken first on sm_90): routed experts straight from raw
  IQ2_XXS / Q2_K banks, no float scratch;
- `grouped_tf32` (3xTF32 mma) over a float32 scratch, and `grouped_gemm`, the SIMT kernel for a bfloat16 scratch
  or where a tensor-core kernel failed its check: both in place of MLX's sorted `gather_mm`.
"""
