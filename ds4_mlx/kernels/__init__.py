"""Weight arithmetic and the model's custom kernels: the reference in plain MLX ops, and fast paths checked against it.

Every fast path is registered with its reference (`machinery.registry`) and used on a backend only once it has
matched that reference on a probe input there; otherwise the reference runs (`DS4_KERNELS=reference` forces it
everywhere). Which backend runs what:

- `machinery`: writing a kernel once for CUDA and Metal, compiling and caching it, choosing it, and replaying a
  decode step as one CUDA graph. Every backend imports it; the CPU only asks it for the reference.
- `formats`: the GGUF quant types' reference dequantizers and Q8_0 / Q4_K in MLX's affine layout. Every backend,
  the CPU included (its only fast path is MLX's built-in quantized matmul over the affine layout).
- `decode`: the decode step's memory-bound kernels (matvecs, routed experts, attention, router, the step's two
  ends). CUDA and Metal; the gated router is CUDA only.
- `sublayers`: the hyper-connections, compressor, indexer and row finishing, each with a one-token form for decode
  and a chunk form for prefill. CUDA and Metal; the indexer's tensor-core score kernel is CUDA only.
- `prefill`: a prompt chunk's kernels (chunk attention, routed experts as grouped GEMMs, batched projections).
  CUDA and Metal; on the CPU prefill runs MLX's built-in ops.
- `tensor_cores`: CUDA only. The GEMMs that run float16 tensor cores at float32 accuracy (mma, and Hopper's wgmma
  on sm_90), the 3xTF32 grouped GEMM and the SIMT grouped GEMM that stands in for MLX's sorted `gather_mm`.

So a Mac runs `machinery`, `formats`, `decode`, `sublayers` and `prefill` (Metal); an H100 or H200 runs all six;
a CPU runs the references and MLX's built-in ops.
"""
