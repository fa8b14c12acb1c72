"""The weights' number formats, on every backend (the CPU included).

- `quants`: reference dequantizers of the GGUF types Flash's files use, in plain MLX ops, bit-exact with ggml: the
  source of truth every fast path is checked against, and `reference_matmul`;
- `affine`: Q8_0 and Q4_K converted exactly to MLX's affine quantized layout, for `mx.quantized_matmul` and
  `mx.gather_qmm` (the CPU's fast path, and the layout the GPU kernels of `decode` and `tensor_cores` read).
"""
