"""What the kernels stand on: one definition for two GPU languages, compiling, choosing, and CUDA graphs.

- `dialect`: a kernel written once and rendered for CUDA (`mx.fast.cuda_kernel`) or Metal (`mx.fast.metal_kernel`);
- `registry`: a fast path per backend and shape class, used once it has matched its reference on a probe input,
  else the reference (one warning); `DS4_KERNELS=reference` forces the reference everywhere. Every backend;
- `probe`: random valid quant blocks and activations for those first-use checks;
- `nvrtc` (CUDA): kernels compiled once per machine by NVRTC through ctypes, cubins kept on disk and launched with
  `mx.fast.precompiled_cuda_kernel`; `cudalib` finds the CUDA libraries MLX loaded;
- `cudagraph` (CUDA): a recorded decode step replayed as one CUDA graph through the driver.
"""
