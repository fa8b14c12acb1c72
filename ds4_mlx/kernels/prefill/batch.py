"""Prefill-sized projections: dequantize the weight to floats once, then one dense GEMM.

MLX's quantized matmul with float32 activations has no tensor-core kernel on CUDA (its fast qmm needs float16 or
bfloat16 activations), so a Q8_0 projection of 512 tokens ran at 36 GB/s there (bench/RESULTS.md). From
BATCH_TOKENS rows on, a GPU backend instead dequantizes the affine weight (one fused `mx.dequantize`, the
reference's values exactly) and calls the dense GEMM (cuBLAS on CUDA). The transient copy is one matrix: at most
OUT * IN * 4 bytes (128 MiB for Flash's largest per-token projection, attn_q_b 32768 x 1024). On the CPU MLX's
quantized matmul is as fast as dequantize + GEMM at these sizes (measured on a 2-core CPU, within its noise), so
the CPU keeps it: no transient copy there. In float32 on CUDA, the tensor-core kernel of dense_f16.py reads the
affine weight itself instead (no copy, float16 tensor cores at float32 accuracy); this path is its fallback and
Metal's.

Arithmetic: float32, the reference's type, unless DS4_PREFILL_DTYPE=bfloat16 on a GPU backend: weights and
activations then go to the GEMM (and the expert GEMMs, grouped.py) in bfloat16 with float32 accumulation. Rounding
both operands to 8 significant bits moves each output by ~2e-3 of the output's largest magnitude (BF16_TOLERANCE);
float32 stays the default, and the CPU always uses it (MLX's CPU gather_mm is float32 only).
"""

from __future__ import annotations

import os

import mlx.core as mx

from ...errors import Ds4Error
from ...model.gguf import GGMLType
from ..formats.affine import AffineWeight, to_affine
from ..tensor_cores.dense_f16 import DENSE_F16, f16_affine_matmul, fits
from ..tensor_cores.dense_wgmma import DENSE_WGMMA, wgmma_affine_matmul
from ..tensor_cores.dense_wgmma import fits as wgmma_fits
from ..machinery.probe import random_activations, random_blocks
from ..formats.quants import reference_matmul
from ..machinery.registry import FastPath, current_backend

BATCH_TOKENS = 16
"""Rows from which a projection takes the dequantize + GEMM path (below it, the quantized matvec kernels win)."""
DTYPE_ENV = "DS4_PREFILL_DTYPE"
DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16}
TOLERANCE = 1e-5
"""float32: summation order only (a GEMM's tiling against the reference's), as the matvec kernels."""
BF16_TOLERANCE = 1e-2
"""bfloat16 operands, each rounded by up to 2^-9 relative, and a bfloat16 GEMM output (another 2^-9): measured in
float32 emulation at Flash widths, 1.8e-3 to 2.5e-3 of the output's largest magnitude for the four weight types
(tests/test_kernels_grouped.py); the output rounding can add 2e-3 more."""


def prefill_dtype() -> mx.Dtype:
    """The float type of batch and grouped GEMMs: DS4_PREFILL_DTYPE on GPU backends, float32 on the CPU."""
    name = os.environ.get(DTYPE_ENV, "float32") or "float32"
    if name not in DTYPES:
        raise Ds4Error(f"{DTYPE_ENV} must be one of {', '.join(DTYPES)}, got {name!r}")
    return DTYPES[name] if current_backend() != "cpu" else mx.float32


def dense_matmul(x: mx.array, weight: AffineWeight, dtype: mx.Dtype) -> mx.array:
    """x @ W.T as float32 with W dequantized into `dtype` (W (OUT, IN), or a batch of them against a batch of x)."""
    w = weight.dequantize().astype(dtype)  # exact float32 values, rounded once (see grouped.affine_scratch)
    return (x.astype(dtype) @ mx.swapaxes(w, -1, -2)).astype(mx.float32)


def batch_matmul(x: mx.array, weight: AffineWeight) -> mx.array:
    """x @ W.T for x of at least BATCH_TOKENS rows: in float32 on CUDA the tensor-core kernels that read the affine
    weight themselves (dense_wgmma.py on Hopper for Q8_0, dense_f16.py), elsewhere (or where their checks failed)
    dequantize + GEMM where that check passed, else the quantized matmul."""
    dtype = prefill_dtype()
    ggml_type = {4: GGMLType.Q4_K, 8: GGMLType.Q8_0}[weight.bits]
    if _takes_wgmma(x, weight):
        return wgmma_affine_matmul(x, weight)
    if dtype == mx.float32 and fits(x, weight) and DENSE_F16.enabled(ggml_type):
        return f16_affine_matmul(x, weight)
    if AFFINE_BATCH[dtype].enabled(ggml_type):
        return dense_matmul(x, weight, dtype)
    return weight.matmul(x)


def grouped_rows_matmul(x: mx.array, weight: AffineWeight) -> mx.array:
    """(T, G, OUT): group g of each row of x (T, G, IN), T at least BATCH_TOKENS, by matrix g of W (G, OUT, IN). The
    wgmma kernel reads and writes the rows where they lie; the other paths take the groups as a batch of (T, IN)
    rows (a copy of x and one of the output)."""
    batch = mx.swapaxes(x, 0, 1)  # a view: the (G, T, IN) batch the other paths take
    if _takes_wgmma(batch, weight):
        return wgmma_affine_matmul(x, weight, interleaved=True)
    return mx.swapaxes(batch_matmul(batch, weight), 0, 1)


def _takes_wgmma(x: mx.array, weight: AffineWeight) -> bool:
    """Whether dense_wgmma.py's kernel takes x @ W.T (x as batch_matmul takes it): float32 prefill, on Hopper, Q8_0,
    its check passed."""
    return prefill_dtype() == mx.float32 and wgmma_fits(x, weight) and DENSE_WGMMA.enabled(GGMLType.Q8_0)


def _probe(ggml_type: GGMLType) -> tuple:
    shape = (128, 512)
    return random_blocks(ggml_type, *shape, seed=25), ggml_type, shape, random_activations((48, 512), seed=26)


def _reference(blocks, ggml_type, shape, x) -> mx.array:
    return reference_matmul(x, blocks, ggml_type, shape)


def _fast(dtype: mx.Dtype):
    def fast(blocks, ggml_type, shape, x) -> mx.array:
        return dense_matmul(x, to_affine(blocks, ggml_type, shape), dtype)
    return fast


AFFINE_BATCH = {
    dtype: FastPath(f"affine_batch_{name}", _reference, _fast(dtype), _probe,
                    tolerance=TOLERANCE if dtype == mx.float32 else BF16_TOLERANCE, backends=("cuda", "metal"))
    for name, dtype in DTYPES.items()
}
"""Q8_0 / Q4_K projections of a prefill batch as dequantize + dense GEMM, per GEMM type; key: the ggml type."""
