"""Weight arithmetic: the reference dequantizers and the fast paths checked against them.

- `quants`: reference dequantizers in plain MLX ops (the source of truth, every backend) and `reference_matmul`;
- `registry`: uses a fast path per backend and shape class once it has matched its reference on a probe input,
  else the reference (one warning); `DS4_KERNELS=reference` forces the reference everywhere;
- `affine`: Q8_0 and Q4_K as MLX affine quantized arrays (exact) for `mx.quantized_matmul` / `mx.gather_qmm`;
  `affine_matvec`: decode's few rows (or selected experts) times an affine matrix as one custom kernel;
- `dialect`: one custom-kernel definition rendered for CUDA (`mx.fast.cuda_kernel`) or Metal; `nvrtc`: CUDA
  kernels compiled once per machine (NVRTC through ctypes, cubins kept on disk, `mx.fast.precompiled_cuda_kernel`);
- `matvec`: the dequant-matvec kernel for decode over raw blocks, with `iq2_xxs` and `q2_k` its two quant types;
- `half`: the matvec of F16 matrices kept as float16, for decode (float32 accumulation);
- `fused_norm`: an input RMSNorm folded into `affine_matvec` and `half_matvec` (their `norm=` argument);
- `experts`: a decode token's routed experts over raw IQ2_XXS / Q2_K banks in two launches (gate + up + SwiGLU, down
  + the sum over slots);
- `grouped`: prefill's routed experts as grouped GEMMs over expert-sorted pairs, with `dequant` (IQ2_XXS / Q2_K
  banks into a float scratch), `grouped_gemm` (CUDA's grouped GEMM kernel), `grouped_tf32` (its 3xTF32
  tensor-core form over a float32 scratch, CUDA only), `grouped_raw` (the kernel reading raw IQ2_XXS / Q2_K banks
  and each pair's token row, no scratch; CUDA only) and `grouped_wgmma` (the same by Hopper's warpgroup products,
  taken first on sm_90), and `batch` (projections of 16+ rows as dequantize + GEMM, DS4_PREFILL_DTYPE), with
  `dense_f16` (CUDA's tensor-core kernel for them and for a chunk's F16 projections) and `dense_wgmma` (Q8_0 and F16
  ones by warpgroup products on Hopper); `halfsplit`: how these kernels reach float32 accuracy on float16 tensor
  cores (x scaled per row, split into two halves, row-major, in mma's fragment layout or in wgmma's K order);
- `probe`: random valid quant blocks for the first-use checks.
"""
