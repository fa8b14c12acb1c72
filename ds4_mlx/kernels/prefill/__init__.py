"""A prompt chunk's kernels: many tokens per weight, so the work goes to GEMMs.

CUDA and Metal; the CPU runs MLX's built-in ops (`gather_qmm`, `quantized_matmul`) and the references.
- `chunk_attention`: a block of queries' attention in one launch (SIMT on both; on CUDA a tensor-core form first);
- `grouped`: the chunk's routed experts as grouped GEMMs over (token, slot) pairs sorted by expert. Metal uses
  MLX's sorted `gather_mm` over a float scratch (`dequant` decodes the used experts of a raw bank); CUDA, whose
  sorted `gather_mm` is wrong in MLX 0.32.4, uses the kernels of `tensor_cores`;
- `batch`: projections of BATCH_TOKENS rows or more as dequantize + dense GEMM (Metal, and CUDA where its
  tensor-core kernels are not taken); `DS4_PREFILL_DTYPE` picks float32 or bfloat16 there.
"""
